"""Red team 190, D1: ``model.to(dtype or device)`` replaces every buffer by a new tensor.

The Constrainer kept the caps' old ``radius`` tensors, so a schedule moved nothing the model used after a cast (a
Trainer moves the model in ``__init__``): sigma/c = 4.08 at the target.  A penalty's SigmaTracker lives outside the
model and raised a dtype mismatch after a float64 cast.
"""

import pytest
import torch

from transcover.constrain import ConstraintConfig, constrain, exact_slot_norms, forward_weights
from transcover.model import ReferenceConfig, ReferenceTransformer


def _model():
    torch.manual_seed(0)
    return ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=12, init_scale=3.0,
                                                head_hidden=(6,)))


def _radius_buffers(model):
    return [m.radius for m in model.modules() if "radius" in m._buffers]


def test_the_schedule_reaches_the_caps_after_a_cast():
    model = _model()
    cons = constrain(model, ConstraintConfig(method="spectral", radii={"all": 0.5}, schedule="linear",
                                             loose_factor=4.0))
    model.to(torch.float64)
    cons.set_progress(1.0)
    buffers = _radius_buffers(model)
    assert buffers and all(b.dtype == torch.float64 and float(b) == 0.5 for b in buffers)  # not the loose 2.0
    model.train()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    for _ in range(60):  # the weights are fixed: the warm-started estimate converges
        model(x)
    with forward_weights(model):
        ratios = {s.key: float(exact_slot_norms(s).max()) / 0.5 for s in cons.slots}
    assert max(ratios.values()) <= 1.01, ratios  # the estimate's gap; 4x (the loose radius) before the fix


@pytest.mark.parametrize("method,radii", [("penalty", {"all": 0.5}), ("log_penalty", {}), ("lipschitz", {})])
def test_penalties_follow_a_cast(method, radii):
    config = ConstraintConfig(method=method, radii=radii, penalty_weight=1.0)
    model = _model()
    cons = constrain(model, config)
    model.to(torch.float64)
    p = cons.penalty()  # RuntimeError: expected scalar type Float but found Double, before the fix
    assert p.dtype == torch.float64
    reference = constrain(_model().to(torch.float64), config).penalty()  # constrained after the cast
    assert float(p.detach()) == pytest.approx(float(reference.detach()), rel=1e-4)
    p.backward()
    assert model.blocks[0].W_1.grad is not None


def test_a_trainer_run_of_a_cast_model_follows_the_schedule(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transcover.constrain import hf_callback

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
                                  vocab_size=40, max_position_embeddings=16, num_labels=2, initializer_range=0.5)
    model = transformers.BertForSequenceClassification(cfg)
    cons = constrain(model, ConstraintConfig(method="spectral", radii={"all": 0.5}, schedule="linear",
                                             loose_factor=4.0))
    model.to(torch.float64)

    seen = []

    class Spy(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(({float(b) for b in _radius_buffers(model)}, set(cons.radii().values())))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (8, 6), generator=g)
    data = [{"input_ids": i, "labels": int(i.sum()) % 2} for i in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                          learning_rate=5e-2, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[hf_callback(cons), Spy()]).train()
    assert len(seen) == 4
    for in_model, scheduled in seen:
        assert in_model == scheduled  # the loose 2.0 stayed in the model at every step before the fix
    assert seen[-1][0] == {0.5}
