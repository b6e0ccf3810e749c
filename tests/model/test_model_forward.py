"""The one forward pass (issue 11, item 2): every former forward is reproduced by it, hooks observe and
replace exactly what it uses, member stacks equal a loop over members.

The independent reference is ``_seed_literal``: the seed's section 1.2 written out with einsum over
all heads at once (the order the former ``ReferenceTransformer``, ``forward_with_attention`` and
Monte-Carlo forwards used), ``torch.nn.functional.layer_norm`` and explicit pairwise distances for L2
attention.  Tolerances come from conftest's ``assert_close`` (dtype and the longest inner product).
"""

from __future__ import annotations

import ast
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from transcover import InputError
from transcover.approx import forward_with_attention
from transcover.empirical import NormRadii, random_inputs, sample_reference_class
from transcover.model import (
    Activation, AttentionSpec, FFNSpec, ForwardHooks, LayerSpec, MLPHeadSpec, NormKind, NormSpec, Placement,
    ReferenceConfig, ReferenceTransformer, RopeSpec, TransformerSpec, attention_forward, reference_spec,
    stack_members, transformer_forward,
)
from transcover.model._functional import attention_scores

F64 = torch.float64


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # values only (the gradient test turns autograd back on)
        yield


# -- the independent reference ----------------------------------------------------------------------
def _seed_literal(m: ReferenceTransformer, X: torch.Tensor, key_mask=None):
    """(output, probs per layer (B, H, T, T)) of a ReferenceTransformer, written out independently."""
    cfg = m.cfg
    act = Activation(cfg.activation)
    if m.embed is not None:
        X = X @ m.embed.weight.T
    if m.pos is not None:
        X = X + m.pos[: X.shape[-2]]
    ball = lambda Z: Z / Z.norm(dim=-1, keepdim=True).clamp(min=1.0)  # noqa: E731

    def norm(Z, blk, which):
        if cfg.norm == "ball":
            return ball(Z)
        if cfg.norm == "layernorm":
            ln = getattr(blk, f"ln_{which}")
            return torch.nn.functional.layer_norm(Z, (cfg.d_model,), ln.weight, ln.bias, ln.eps)
        return Z

    Z = ball(X) if cfg.norm == "ball" else X
    probs = []
    T, dh = Z.shape[-2], cfg.head_dim
    for b in m.blocks:
        q = torch.einsum("btd,hde->bhte", Z, b.W_Q)
        if cfg.attention == "l2":
            S = -torch.cdist(q, q).pow(2) / math.sqrt(dh)
            V = torch.einsum("btd,hde->bhte", Z, b.W_Q @ b.W_Q.transpose(-1, -2) @ b.W_V / math.sqrt(dh))
        else:
            S = q @ torch.einsum("btd,hde->bhte", Z, b.W_K).transpose(-1, -2) / math.sqrt(dh)
            V = torch.einsum("btd,hde->bhte", Z, b.W_V)
        if cfg.causal:
            S = S.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        if key_mask is not None:
            S = S.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        P = torch.softmax(S, dim=-1)
        probs.append(P)
        Z = norm(Z + torch.einsum("bhte,hed->btd", P @ V, b.W_O), b, "attn")
        u = Z @ b.W_1 + (0 if b.b_1 is None else b.b_1)
        Z = norm(Z + act(u) @ b.W_2 + (0 if b.b_2 is None else b.b_2), b, "ffn")
    z = Z.mean(-2) if cfg.readout == "mean" else Z[:, 0]
    for i, lin in enumerate(m.head):
        z = z @ lin.weight.T + lin.bias
        z = act(z) if i < len(m.head) - 1 else z
    return z, probs


def _reference_model(seed: int, **kw) -> ReferenceTransformer:
    torch.manual_seed(seed)
    cfg = ReferenceConfig(**{"d_model": 8, "n_heads": 2, "n_layers": 2, "d_ff": 12, "head_hidden": (6,), **kw})
    m = ReferenceTransformer(cfg).double()
    with torch.no_grad():  # LayerNorm away from (1, 0) and biases away from 0, so a mapping slip shows
        for name, p in m.named_parameters():
            if name.endswith(("bias", "b_1", "b_2")) or ".ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    return m


MODELS = [
    dict(norm="ball"), dict(norm="layernorm", activation="gelu"), dict(norm="none", readout="first"),
    dict(norm="ball", causal=True), dict(norm="layernorm", attention="l2"), dict(norm="ball", attention="l2"),
    dict(norm="ball", d_input=3, max_len=7, ffn_bias=False, activation="silu"),
]


@pytest.mark.parametrize("kw", MODELS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_reference_module_computes_through_the_functional_forward(kw, assert_close):
    m = _reference_model(1, **kw)
    X = torch.randn(3, 5, kw.get("d_input") or 8, dtype=F64)
    expected, _ = _seed_literal(m, X)
    assert_close(m(X), expected, 2 * 12, what="ReferenceTransformer vs seed-literal")
    # the module and its detached spec are the same function: one forward pass, no second copy
    Xe = m.embed_inputs(X)
    assert torch.equal(m(X), transformer_forward(reference_spec(m), Xe))
    assert torch.equal(m.features(X), transformer_forward(reference_spec(m), Xe, with_head=False))


def test_reference_module_gradients_reach_every_parameter():
    m = _reference_model(2, norm="layernorm")
    with torch.enable_grad():
        m(torch.randn(2, 4, 8, dtype=F64)).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in m.parameters())


@pytest.mark.parametrize("readout", ["first", "mean"])
@pytest.mark.parametrize("norm", ["ball", "none"])
def test_trained_lab_forward_is_the_seed_literal_with_and_without_key_mask(norm, readout, assert_close):
    m = _reference_model(3, norm=norm, readout=readout, d_input=2, max_len=6, n_layers=1)
    X = torch.randn(4, 6, 2, dtype=F64)
    key_mask = torch.zeros(4, 6, dtype=torch.bool)
    key_mask[:, [1, 4]] = True
    for mask in (None, key_mask):
        out, probs, heads = forward_with_attention(m, X, mask)
        exp_out, exp_probs = _seed_literal(m, X, mask)
        assert_close(out, exp_out, 12, what="output")
        assert_close(probs[0], exp_probs[0], 12, what="attention probabilities")
        # the heads' outputs are the summands of the attention output: P X W_OV^h
        Z = m.embed_inputs(X)
        Z = Z / Z.norm(dim=-1, keepdim=True).clamp(min=1.0) if norm == "ball" else Z
        b = m.blocks[0]
        assert_close(heads[0], torch.einsum("bhts,bsd,hde,hef->bhtf", probs[0], Z, b.W_V, b.W_O), 12, what="heads")
    assert float(probs[0][..., [0, 2, 3, 5]].abs().max()) == 0.0  # masked keys get no weight at all


# -- Monte-Carlo members: one batched forward ------------------------------------------------------
@pytest.mark.parametrize("output", ["head", "features"])
def test_monte_carlo_batched_members_equal_a_loop_over_members(output, assert_close):
    cfg = ReferenceConfig(d_model=6, n_heads=2, n_layers=2, d_ff=10, head_hidden=(5,), causal=True)
    sample = sample_reference_class(cfg, NormRadii(B_b1=0.5), 7, seed=3, output=output)
    X = random_inputs(4, 3, 6, seed=1)
    Y = sample.evaluate(X)
    loop = sample.evaluate(X, chunk_size=1)  # a Python loop over the members, one at a time
    assert torch.equal(Y, loop), "a chunk of members and the members one by one must agree bit for bit"
    for j in range(sample.n_functions):
        m = sample.model(j)
        ref = m(X) if output == "head" else m.features(X).reshape(-1, 6)
        assert_close(Y[j], ref, 2 * 10, what=f"member {j} vs its own module")
        assert_close(Y[j], _seed_literal(m, X)[0] if output == "head" else ref, 2 * 10, what=f"member {j}")


def _random_spec(seed: int, *, placement=Placement.PRE, norm=NormKind.LAYERNORM, gqa=False, rope=False,
                 gated=False, causal=False, L=2, d=8, dh=4, H=2, dff=10) -> TransformerSpec:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64) * 0.5  # noqa: E731
    Hkv = 1 if gqa else H

    def nrm():
        if norm in (NormKind.LAYERNORM, NormKind.RMSNORM):
            return NormSpec(norm, 1 + r(d), r(d) if norm is NormKind.LAYERNORM else None, 1e-3)
        return NormSpec(norm)

    layers = [LayerSpec(
        index=i,
        attention=AttentionSpec(W_Q=r(H, d, dh), W_K=r(Hkv, d, dh), W_V=r(Hkv, d, dh), W_O=r(H, dh, d),
                                b_Q=r(H, dh), b_K=r(Hkv, dh), b_V=r(Hkv, dh), b_O=r(d), causal=causal,
                                rope=RopeSpec(theta=100.0) if rope else None),
        ffn=FFNSpec(W_1=r(d, dff), W_2=r(dff, d), activation=Activation.SILU if gated else Activation.GELU,
                    b_1=r(dff), b_2=r(d), W_gate=r(d, dff) if gated else None),
        norm_attn=nrm(), norm_ffn=nrm(), placement=placement) for i in range(L)]
    head = MLPHeadSpec(weights=(r(d, 5), r(5, 2)), biases=(r(5), r(2)), activation=Activation.RELU)
    return TransformerSpec(arch="test", name=f"random {seed}", d_model=d, layers=layers, input_norm=nrm(),
                           final_norm=nrm() if placement is Placement.PRE else None, head=head)


SPECS = [dict(), dict(placement=Placement.POST, norm=NormKind.BALL), dict(gqa=True, rope=True, causal=True),
         dict(gated=True, norm=NormKind.RMSNORM), dict(placement=Placement.POST, norm=NormKind.NONE)]


@pytest.mark.parametrize("kw", SPECS, ids=str)
def test_stack_members_evaluates_every_member_at_once(kw, assert_close):
    specs = [_random_spec(s, **kw) for s in (5, 6, 7)]
    stack = stack_members(specs)
    X = torch.randn(2, 4, 8, dtype=F64)
    Y = transformer_forward(stack, X[None])  # shared inputs
    own = transformer_forward(stack, torch.stack([X, 2 * X, -X]))  # each member its own inputs
    for j, (spec, Xj) in enumerate(zip(specs, (X, 2 * X, -X))):
        assert_close(Y[j], transformer_forward(spec, X), 2 * 10, what=f"member {j}, shared inputs")
        assert_close(own[j], transformer_forward(spec, Xj), 2 * 10, what=f"member {j}, own inputs")
        one = stack_members([spec])
        assert torch.equal(transformer_forward(one, X[None])[0], transformer_forward(stack_members(
            [spec, specs[(j + 1) % 3]]), X[None])[0]), "a member's numbers must not depend on its neighbours"


def test_stack_members_refuses_members_of_different_structure():
    a, b = _random_spec(1), _random_spec(2, causal=True)
    with pytest.raises(InputError, match="causal"):
        stack_members([a, b])
    with pytest.raises(InputError, match="b_O"):
        stack_members([a, replace(a, layers=[replace(a.layers[0], attention=replace(a.layers[0].attention, b_O=None)),
                                             a.layers[1]])])
    with pytest.raises(InputError, match="zero members"):
        stack_members([])


# -- hooks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", SPECS[:3], ids=str)
def test_recorded_attention_is_what_the_forward_used(kw):
    spec = _random_spec(11, **kw)
    X = torch.randn(3, 5, 8, dtype=F64)
    plain = transformer_forward(spec, X)
    seen: dict[tuple[int, int], torch.Tensor] = {}
    rec = transformer_forward(spec, X, hooks=ForwardHooks(on_attention_probs=lambda l, h, P: seen.update({(l, h): P})))
    assert torch.equal(rec, plain) and torch.equal(transformer_forward(spec, X, hooks=ForwardHooks()), plain)
    assert sorted(seen) == [(l, h) for l in range(2) for h in range(2)]
    for P in seen.values():
        assert float((P.sum(-1) - 1).abs().max()) <= 8 * torch.finfo(F64).eps
    # feeding the recorded probabilities back changes nothing: they are exactly the ones used
    again = transformer_forward(spec, X, hooks=ForwardHooks(on_attention_probs=lambda l, h, P: seen[(l, h)].clone()))
    assert torch.equal(again, plain)
    # and layer 0's equal the softmax of its scores at its (normalised) input
    X0 = spec.input_norm(X)
    if spec.layers[0].placement is Placement.PRE:
        X0 = spec.layers[0].norm_attn(X0)
    assert torch.equal(seen[(0, 1)], torch.softmax(attention_scores(spec.layers[0].attention, X0, 1), dim=-1))


def test_replaced_attention_changes_the_output_accordingly(assert_close):
    spec = replace(_random_spec(12, placement=Placement.POST, norm=NormKind.NONE, L=1), head=None, input_norm=None)
    attn = spec.layers[0].attention
    X = torch.randn(2, 5, 8, dtype=F64)
    uniform = lambda l, h, P: torch.full_like(P, 1 / P.shape[-1])  # noqa: E731
    out = attention_forward(attn, X, hooks=ForwardHooks(on_attention_probs=uniform))
    # every query reads the mean token: sum_h mean(X) W_V^h W_O^h + b_V W_O + b_O
    W_OV = sum(attn.W_V[h] @ attn.W_O[h] for h in range(2))
    bias = sum(attn.b_V[h] @ attn.W_O[h] for h in range(2)) + attn.b_O
    expected = (X.mean(-2, keepdim=True) @ W_OV + bias).expand_as(out)
    assert_close(out, expected, 8, what="uniform attention")
    assert not torch.allclose(out, attention_forward(attn, X))


def test_replaced_head_output_and_norm_equal_the_edited_model():
    spec = _random_spec(13, placement=Placement.PRE)
    # without b_V the head's whole contribution is its summand (b_V W_O is folded into the output bias)
    a0 = replace(spec.layers[0].attention, b_V=None)
    spec = replace(spec, layers=[replace(spec.layers[0], attention=a0), spec.layers[1]])
    X = torch.randn(2, 4, 8, dtype=F64)
    # head 1 of layer 0 silenced == its W_O^1 set to zero (the summand is exactly 0 either way)
    W_O = a0.W_O.clone()
    W_O[1] = 0
    edited = replace(spec, layers=[replace(spec.layers[0], attention=replace(a0, W_O=W_O)), spec.layers[1]])
    silence = ForwardHooks(on_head_output=lambda l, h, Y: torch.zeros_like(Y) if (l, h) == (0, 1) else None)
    assert torch.equal(transformer_forward(spec, X, hooks=silence), transformer_forward(edited, X))
    # a norm replaced by the identity == that norm removed from the spec; sites are the chain's keys
    sites = []

    def skip_ffn_norm_1(site, norm, Z):
        sites.append(site)
        return Z if site == (1, "norm_ffn") else None

    no_norm = replace(spec, layers=[spec.layers[0], replace(spec.layers[1], norm_ffn=NormSpec(NormKind.NONE))])
    assert torch.equal(transformer_forward(spec, X, hooks=ForwardHooks(on_norm=skip_ffn_norm_1)),
                       transformer_forward(no_norm, X))
    assert sites == [(-1, "input_norm"), (0, "norm_attn"), (0, "norm_ffn"), (1, "norm_attn"), (1, "norm_ffn"),
                     (2, "final_norm")]


def test_l2_attention_hooks_record_and_replace(assert_close):
    m = _reference_model(4, attention="l2", norm="none", n_layers=1, head_hidden=())
    spec = reference_spec(m)
    X = torch.randn(2, 5, 8, dtype=F64)
    seen = {}
    out = transformer_forward(spec, X, hooks=ForwardHooks(on_attention_probs=lambda l, h, P: seen.update({h: P})))
    assert torch.equal(out, transformer_forward(spec, X))
    _, probs = _seed_literal(m, X)
    assert_close(torch.stack([seen[0], seen[1]], dim=1), probs[0], 8, what="L2 probabilities")
    heads = []
    split = transformer_forward(spec, X, hooks=ForwardHooks(on_head_output=lambda l, h, Y: heads.append(Y)))
    assert_close(split, out, 8, what="L2 output summed from recorded heads")
    assert len(heads) == 2


@pytest.mark.parametrize("kind", ["dot", "l2"])
def test_key_mask_hides_keys_like_a_shorter_sequence(kind, assert_close):
    m = _reference_model(5, attention=kind, norm="layernorm")
    spec = reference_spec(m)
    X = torch.randn(3, 6, 8, dtype=F64)
    keep = torch.tensor([True, True, True, True, False, False]).expand(3, 6)
    masked = transformer_forward(spec, X, key_mask=keep, with_head=False)
    assert_close(masked[:, :4], transformer_forward(spec, X[:, :4], with_head=False), 2 * 12, what="kept rows")


def test_model_is_the_ground_floor():
    """model imports no other transcover package (issue 11: it imported lipschitz and report)."""
    root = Path(__file__).resolve().parents[2] / "src" / "transcover" / "model"
    allowed = {"_errors", "_io"}
    bad = []
    for path in root.rglob("*.py"):
        depth = len(path.relative_to(root).parts)  # 1 for model/x.py, 2 for model/_adapters/x.py
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > depth:
                top = (node.module or "").split(".")[0]
                if top not in allowed:
                    bad.append(f"{path.relative_to(root)}: from {'.' * node.level}{node.module}")
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if isinstance(node, ast.Import) and any(n.startswith("transcover.") for n in names):
                bad.append(f"{path.relative_to(root)}: import {names}")
    assert not bad, "model imports upward: " + "; ".join(bad)


@pytest.mark.parametrize("kind", [NormKind.BALL, NormKind.LAYERNORM, NormKind.RMSNORM])
@pytest.mark.parametrize("eps", [0.0, 1e-12, 0.5])
def test_norms_are_exact_at_any_scale(kind, eps):
    """Red team 162: a token near 1e200 had an infinite norm or variance and every normalisation returned 0 (a Monte
    Carlo cover at radius 1e100 then read log N = 0). Note [scaled norms]: each token is scaled by a power of two
    first. In the normal range the result is the unscaled formula's, float for float; beyond it, the normalisations'
    homogeneity holds exactly: at eps = 0 LayerNorm and RMSNorm are scale-invariant, Pi_norm of a vector of norm
    >= 1 is its direction; with eps > 0 a huge token's output is the eps = 0 one (eps / s^2 vanishes)."""
    g = torch.Generator().manual_seed(0)
    n = NormSpec(kind, eps=eps)
    for dt in (torch.float64, torch.float32):
        X = (torch.randn(40, 12, dtype=torch.float64, generator=g)
             * torch.logspace(-3, 3, 40, dtype=torch.float64)[:, None]).to(dt)
        if kind is NormKind.BALL:
            want = X / torch.clamp(X.norm(dim=-1, keepdim=True), min=1.0)
        elif kind is NormKind.LAYERNORM:
            c = X - X.mean(dim=-1, keepdim=True)
            want = c / torch.sqrt((c**2).mean(dim=-1, keepdim=True) + eps)
        else:
            want = X / torch.sqrt((X**2).mean(dim=-1, keepdim=True) + eps)
        assert torch.equal(n(X), want)
    X0 = torch.randn(6, 12, dtype=torch.float64, generator=g) * 4.0  # every row norm >= 1 (checked)
    assert bool((X0.norm(dim=-1) >= 1).all())
    exact0 = NormSpec(kind, eps=0.0)(X0)
    for c in (2.0**600, 2.0**1000, 2.0**-40):
        got = n(X0 * c)
        assert bool(torch.isfinite(got).all())
        if c > 1:
            assert torch.equal(got, exact0)


def test_norms_of_constant_huge_tokens_and_half_precision():
    """Red team 166 on Note [scaled norms]: (a) a constant token at 2^530 gave 0 / 0 = NaN (eps / s^2 underflowed)
    where LayerNorm's value is its bias; (b) float16 tokens from 32 on lost eps / s^2 and the centred entries below
    float16's normal range (2.0 for an exact 1.687). Half precision is now normalised in float32 and rounded once:
    within one float16 rounding of the float64 value."""
    d = 768
    ones = torch.ones(d, dtype=torch.float64)
    n = NormSpec(NormKind.LAYERNORM, eps=1e-5, weight=ones, bias=0.5 * ones)
    for v in (2.0**530, 2.0**1000, 32.0):
        assert torch.equal(n(torch.full((1, d), v, dtype=torch.float64)), torch.full((1, d), 0.5, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    for kind in (NormKind.LAYERNORM, NormKind.RMSNORM, NormKind.BALL):
        m = NormSpec(kind, eps=1e-5)
        for dt in (torch.float16, torch.bfloat16):
            X = (torch.randn(64, 16, generator=g, dtype=torch.float64) * 0.05 + 40.0).to(dt)
            got, exact = m(X), m(X.double())
            assert got.dtype == dt and bool(torch.isfinite(got).all())
            tol = torch.finfo(dt).eps * exact.abs() + torch.finfo(dt).tiny  # one rounding of the result
            assert bool(((got.double() - exact).abs() <= tol).all()), (kind, dt)
