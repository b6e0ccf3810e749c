"""Export to a plain model keeps the function; constrained models round-trip through state_dict."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from transcover.constrain import ConstraintConfig, constrain, constrained_tensors, export_plain, strip_constraints
from transcover.model import ReferenceConfig, ReferenceTransformer



def _model(name):
    """(model, input, radius): radii below the initial norms so every group is capped."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 5))
    if name == "reference":
        ref = ReferenceTransformer(ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, init_scale=3.0))
        return ref, torch.randn(3, 5, 16), 0.5
    if name == "torch":
        enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                    enable_nested_tensor=False)
        return enc, torch.randn(3, 5, 16), 0.2
    import transformers  # a test dependency (pyproject [test])

    if name == "vit":
        return transformers.ViTModel(transformers.ViTConfig(
            hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32, image_size=8,
            patch_size=4)), torch.randn(3, 3, 8, 8), 0.05
    if name == "bert":
        return transformers.BertModel(transformers.BertConfig(
            hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32, vocab_size=50,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), ids, 0.002
    return transformers.GPT2Model(transformers.GPT2Config(
        n_embd=16, n_head=2, n_layer=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), ids, 0.002


def _out(model, x):
    y = model(x)
    return y if isinstance(y, torch.Tensor) else y.last_hidden_state


def _certified_within(model, c):
    """Every slot of ``model`` has certified norm <= c (transcover.norms on the stored values)."""
    from transcover.constrain import find_slots
    from transcover.constrain._measure import certified_slot_norm, forward_weights

    with forward_weights(model):
        worst = max(certified_slot_norm(s) / c for s in find_slots(model))
    return worst <= 1.0, worst


@pytest.mark.parametrize("name", ["reference", "torch", "bert", "gpt2", "vit"])
def test_export_keeps_outputs(name):
    model, x, c = _model(name)
    original = copy.deepcopy(model).eval()
    cons = constrain(model, ConstraintConfig(method="spectral", radii={"all": c}))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(5):
        loss = _out(model, x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        y = _out(model, x)
        plain = export_plain(model, certify=False)
        y_plain = _out(plain.eval(), x)
        y_orig = _out(original, x)
    assert constrained_tensors(plain) == []
    assert not any(parametrize.is_parametrized(m) for m in plain.modules())
    # Same tensors, same ops: equal up to the nondeterminism of fused kernels (here bitwise).
    assert torch.allclose(y_plain, y, rtol=0, atol=10 * torch.finfo(y.dtype).eps * float(y.abs().max()))
    assert not torch.allclose(y, y_orig)  # the constraint did act (so the equality above means something)
    assert len(constrained_tensors(model)) > 0  # export copied; the model keeps its constraints
    with torch.no_grad():
        assert torch.equal(_out(model, x), y)  # ... and still computes with them
    # Issue 10, defect 8: the default export certifies every cap (power iteration alone may overshoot).
    ok, worst = _certified_within(export_plain(model), c)
    assert ok, worst
    # After finalize the caps hold, certified, and the certified export is the same function bit for bit.
    cons.finalize()
    ok, worst = _certified_within(model, c)
    assert ok, worst
    with torch.no_grad():
        y_final = _out(model, x)
        assert torch.equal(_out(export_plain(model).eval(), x), y_final)


def test_state_dict_round_trip_and_strip_in_place():
    torch.manual_seed(1)
    cfg = ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8, init_scale=3.0)
    a = ReferenceTransformer(cfg)
    constrain(a, ConstraintConfig(method="spectral", radii={"all": 0.3}, schedule="linear"))
    for _ in range(3):
        a(torch.randn(2, 3, 8))
    torch.manual_seed(2)
    b = ReferenceTransformer(cfg)
    constrain(b, ConstraintConfig(method="spectral", radii={"all": 0.3}, schedule="linear"))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 8)
    a.eval()
    b.eval()
    assert torch.equal(a(x), b(x))  # originals and power-iteration buffers both travel
    strip_constraints(a, certify=False)
    assert constrained_tensors(a) == []
    assert torch.equal(a(x), b(x))
