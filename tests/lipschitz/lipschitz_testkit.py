"""Random small Transformer specs of every component the Lipschitz bounds support (test helper)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from transcover.model import (
    Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, RopeSpec, TransformerSpec,
)

# The models here are tiny: torch's intra-op thread pool only adds contention on a shared 2-core
# runner (a 6x3x3 softmax went from 0.4 ms to 30 ms with the default pool under load).
torch.set_num_threads(1)

NORMS = ("ball", "layernorm", "rmsnorm", "none")
ACTS = ("relu", "gelu", "gelu_tanh", "silu", "identity")


def _norm(kind: str, d: int, g: torch.Generator, eps: float) -> NormSpec:
    if kind == "ball":
        return NormSpec(NormKind.BALL)
    if kind == "none":
        return NormSpec(NormKind.NONE)
    w = 1.0 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)
    b = 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    return NormSpec(NormKind.LAYERNORM if kind == "layernorm" else NormKind.RMSNORM, w,
                    b if kind == "layernorm" else None, eps)


def last_norm_doubled(spec: TransformerSpec) -> TransformerSpec:
    """``spec`` with its last layer's second norm x 2 (weight and bias; exact in float64)."""
    last = spec.layers[-1]
    n2 = last.norm_ffn
    return dataclasses.replace(spec, layers=spec.layers[:-1] + [dataclasses.replace(
        last, norm_ffn=dataclasses.replace(n2, weight=2.0 * n2.weight, bias=2.0 * n2.bias))])


def random_spec(seed: int, *, d: int = 6, H: int = 2, dh: int = 3, dff: int = 8, L: int = 2,
                norm: str = "ball", placement: str = "post", act: str = "relu", gated: bool = False,
                biases: bool = False, causal: bool = False, scale: float = 1.0, eps: float = 0.05,
                input_norm: bool = True, final_norm: bool = False, rope: bool = False) -> TransformerSpec:
    g = torch.Generator().manual_seed(seed)
    if rope:  # rotary pairs need an even head dimension; RoPE models carry no query/key biases here
        dh = 4

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s * scale / shape[-2] ** 0.5

    layers = []
    for i in range(L):
        attn = AttentionSpec(
            W_Q=rnd(H, d, dh), W_K=rnd(H, d, dh), W_V=rnd(H, d, dh), W_O=rnd(H, dh, d),
            b_Q=rnd(H, dh, 1)[..., 0] if biases and not rope else None,
            b_K=rnd(H, dh, 1)[..., 0] if biases and not rope else None,
            b_V=rnd(H, dh, 1)[..., 0] if biases else None, b_O=rnd(d, 1)[..., 0] if biases else None,
            causal=causal, rope=RopeSpec(theta=10.0) if rope else None,
        )
        ffn = FFNSpec(W_1=rnd(d, dff), W_2=rnd(dff, d), activation=Activation(act),
                      b_1=rnd(dff, 1)[..., 0] if biases else None, b_2=rnd(d, 1)[..., 0] if biases else None,
                      W_gate=rnd(d, dff) if gated else None,
                      b_gate=rnd(dff, 1)[..., 0] if (gated and biases) else None)
        layers.append(LayerSpec(i, attn, ffn, _norm(norm, d, g, eps), _norm(norm, d, g, eps),
                                Placement(placement)))
    return TransformerSpec(
        arch="test", name=f"random{seed}", d_model=d, layers=layers,
        input_norm=_norm(norm, d, g, eps) if input_norm else None,
        final_norm=_norm(norm, d, g, eps) if final_norm else None,
    )


def softmax_box(seed: int, sharp: float, causal: bool, tight: bool, T: int = 6):
    """A random softmax case for the envelope attacks (F31a, F34a): ``(g, s, P, delta, osc)`` — score rows
    ``sharp`` x N(0, 1) (future keys at -inf when ``causal``), per-key shift radii ``delta`` (0 on masked keys)
    and a spread bound ``osc`` (0.4 x the box's when ``tight``); ``g`` the generator, to draw the shifts."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(T, T, generator=g, dtype=torch.float64) * sharp
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    P = torch.softmax(s, dim=-1)
    delta = torch.rand(T, T, generator=g, dtype=torch.float64) * 3 * torch.rand(T, 1, generator=g, dtype=torch.float64)
    delta = torch.where(P > 0, delta, torch.zeros_like(delta))
    osc = 2 * delta.max(dim=1).values * (0.4 if tight else 1.0)
    return g, s, P, delta, osc


def box_shifts(g: torch.Generator, P: torch.Tensor, delta: torch.Tensor, osc: torch.Tensor, n: int = 2048):
    """Feasible shifts ``t`` (m, T, T): ``|t_j| <= delta_j`` and spread ``<= osc`` over the visible keys, 0 on
    masked ones — the box's vertices clamped into random osc windows (the extremes of linear-fractional
    functions of t) and random interior points; at least n/8 of the n drawn survive the feasibility check."""
    T = P.shape[-1]
    sign = torch.randint(0, 2, (n, T, T), generator=g).double() * 2 - 1
    frac = torch.where(torch.rand(n, 1, 1, generator=g) < 0.5, torch.ones(n, 1, 1, dtype=torch.float64),
                       torch.rand(n, T, T, generator=g, dtype=torch.float64))
    t = sign * frac * delta[None]
    c = (torch.rand(n, T, 1, generator=g, dtype=torch.float64) * 2 - 1) * delta.max(dim=1).values[None, :, None]
    t = torch.minimum(torch.maximum(t, c - osc[None, :, None] / 2), c + osc[None, :, None] / 2)
    t = torch.minimum(torch.maximum(t, -delta[None]), delta[None])
    vis = (P > 0)[None]
    big, small = torch.where(vis, t, -torch.inf).max(-1).values, torch.where(vis, t, torch.inf).min(-1).values
    ok = (big - small <= osc[None]).all(dim=1)  # the box clamp can reopen the window: keep the feasible shifts
    assert int(ok.sum()) >= n // 8
    return torch.where(vis, t, torch.zeros_like(t))[ok]


def gelu_ffn_case():
    """A small exact-GELU FFN with three centres for the per-unit FFN bounds (F31d, F37b): ``(ffn, H, z, n1,
    F)`` — the FFN (d = 6, d_ff = 10, weights x 2, biases), centres H (3, 6), pre-activations z = H W_1 + b_1,
    the units' weight norms n1 and ``F(h)``, the FFN Jacobian at h (rows convention, float64)."""
    import math

    spec = random_spec(5, act="gelu", norm="layernorm", d=6, dff=10, scale=2.0, biases=True)
    ffn = spec.layers[0].ffn
    W1, W2, b1 = ffn.W_1.double(), ffn.W_2.double(), ffn.b_1.double()
    H = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def F(h: torch.Tensor) -> torch.Tensor:
        zz = h @ W1 + b1
        s = torch.special.ndtr(zz) + zz * torch.exp(-0.5 * zz * zz) / math.sqrt(2 * math.pi)  # GELU'
        return (W2.T * s) @ W1.T

    return ffn, H, H @ W1 + b1, W1.norm(dim=0), F


def weight_underflows(attn, X: torch.Tensor) -> bool:  # noqa: ANN001
    """Whether some visible key's float64 softmax weight at X is below the smallest normal float64: the one
    input the local ball bounds refuse (Note [underflowed attention weights]); computed here from the model's
    own scores, independently of the certificate's code."""
    from transcover.model import attention_scores

    for h in range(attn.n_heads):
        s = attention_scores(attn, X.double(), h)
        P = torch.softmax(s, dim=-1)
        if bool((torch.isfinite(s) & (P < torch.finfo(torch.float64).tiny)).any()):
            return True
    return False


def hetero_gamma(kind: str, d: int, g: torch.Generator) -> torch.Tensor:
    """A norm's scale ``gamma`` (d,) in ``0.3 + U(0, 1)``, made heterogeneous by ``kind``: ``"outlier"`` (the first two
    x10), ``"tiny"`` (every other 1e-6), ``"negative"`` (every other negated); anything else leaves it."""
    b = 0.3 + torch.rand(d, generator=g, dtype=torch.float64)
    if kind == "outlier":
        b[:2] *= 10
    elif kind == "tiny":
        b[::2] = 1e-6
    elif kind == "negative":
        b = b * torch.where(torch.arange(d) % 2 == 0, -1.0, 1.0)
    return b


def stack_substage_maps(spec) -> list:  # noqa: ANN001
    """``stack_local``'s sub-stages of a post-LN stack as maps from one sub-stage input to the next (the input norm,
    per layer the attention with its residual, the first norm, the FFN with its residual and the second norm), on
    (..., T, d); a LayerNorm's input centred (all it reads: THEORY F59a)."""
    from transcover.model import attention_forward, ffn_forward

    centre = lambda S: S - S.mean(dim=-1, keepdim=True)  # noqa: E731
    out = [spec.input_norm]
    for ly in spec.layers:
        out += [lambda Z, ly=ly: centre(Z + attention_forward(ly.attention, Z)), ly.norm_attn,
                lambda H, ly=ly: centre(H + ffn_forward(ly.ffn, H)), ly.norm_ffn]
    return out


def chain(maps: list, Z: torch.Tensor) -> list:
    """Every sub-stage input along ``maps`` from ``Z`` (``Z`` first, the last map's output last)."""
    xs = [Z]
    for f in maps:
        xs.append(f(xs[-1]))
    return xs


def stage_jacobians(maps: list, xs: list) -> list:
    """Each map's exact (T d, T d) Jacobian at its input on the data path (float64 autograd), ``xs`` as ``chain`` gives
    them."""
    T, d = xs[0].shape
    return [torch.autograd.functional.jacobian(lambda v, f=f: f(v.reshape(T, d)).reshape(-1), x.detach().reshape(-1))
            for f, x in zip(maps, xs)]


def clip_rows(E: torch.Tensor, r: float) -> torch.Tensor:
    """Each row of E projected into the ball of radius r."""
    return E * torch.clamp(r / E.norm(dim=-1, keepdim=True).clamp(min=1e-300), max=1.0)


def projected_adam(value, starts: list, radii: tuple, lr: float, steps: int) -> float:  # noqa: ANN001
    """The largest ``value(*params)`` seen by float64 Adam ascent from each start (a tuple of tensors, one per
    parameter), every parameter's rows projected into the ball of its radius in ``radii`` before each step; ``lr``
    is absolute (an empirical lower estimate of ``sup value``)."""
    best = 0.0
    for start in starts:
        ps = [clip_rows(p0, c).clone().requires_grad_(True) for p0, c in zip(start, radii)]
        opt = torch.optim.Adam(ps, lr=lr)
        for _ in range(steps):
            with torch.no_grad():
                for p, c in zip(ps, radii):
                    p.copy_(clip_rows(p, c))
            v = value(*ps)
            best = max(best, float(v.detach()))
            opt.zero_grad()
            (-v).backward()
            opt.step()
    return best


def sphere_ascent(value, X: torch.Tensor, r: float, g: torch.Generator, *, starts: int = 4, steps: int = 120,  # noqa: ANN001
                  lr: float = 0.3) -> torch.Tensor:
    """Per token, the largest ``value(X + E)`` (``value`` maps (starts, T, d) to (starts, T)) seen by float64 Adam on
    ``V`` (step ``lr``, scale-free) with every row of ``E = r V/||V||`` on the sphere of radius r, ``starts`` draws
    from ``g`` in one batch.  Reaches 1.02-1.7x more than the projected ascent on remainders (THEORY F57)."""
    V = torch.randn((starts, *X.shape), generator=g, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.Adam([V], lr=lr)
    best = torch.zeros(X.shape[0], dtype=torch.float64)
    for _ in range(steps):
        val = value(X + r * V / V.norm(dim=-1, keepdim=True))
        best = torch.maximum(best, val.detach().amax(dim=0))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best


def sphere_adam(value, starts: list, radii: tuple, steps: int, lr: float = 0.3) -> float:  # noqa: ANN001
    """``projected_adam``'s attack with every row of every parameter on the sphere of its radius: the largest
    ``value(*params)``, ``param = c V/||V||`` (rows), float64 Adam on ``V`` (step ``lr``, scale-free) from the
    starts' directions (THEORY F57)."""
    best = 0.0
    for start in starts:
        Vs = [p0.clone().requires_grad_(True) for p0 in start]
        opt = torch.optim.Adam(Vs, lr=lr)
        for _ in range(steps):
            v = value(*(c * V / V.norm(dim=-1, keepdim=True).clamp(min=1e-300) for V, c in zip(Vs, radii)))
            best = max(best, float(v.detach()))
            opt.zero_grad()
            (-v).backward()
            opt.step()
    return best


def jvp_row_norm(f, X: torch.Tensor):  # noqa: ANN001, ANN201
    """``value(E, V) = max_t ||(J_f(X + E) V)_t||`` (the (2,inf) norm of a Jacobian-vector product, differentiable in
    ``E`` and ``V``), the objective ``jvp_ascent`` maximises for a map ``f`` of the tokens."""
    def value(E: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        _, out = torch.autograd.functional.jvp(f, (X + E,), (V,), create_graph=True)
        return out.norm(dim=-1).amax()
    return value


def jvp_ascent(value, X: torch.Tensor, rho: float, *, seed: int, starts: int = 3, steps: int = 100) -> float:  # noqa: ANN001
    """The largest finite ``value(E, V)`` seen by float64 Adam ascent over moves ``E`` (rows within rho, projected;
    each start on the sphere) and per-token unit ``V`` (an empirical lower estimate of ``sup value``)."""
    def batch(E: torch.Tensor, V: torch.Tensor) -> torch.Tensor:  # the starts one after another, in one step
        return torch.stack([value(E[s, 0], V[s, 0]) for s in range(starts)])[:, None]

    return jvp_ascents(batch, X, rho, [seed], starts=starts, steps=steps)[0]


def jvp_ascents(value, X: torch.Tensor, rho: float, seeds: list, *, starts: int = 3, steps: int = 100) -> list:  # noqa: ANN001
    """``jvp_ascent`` of K objectives, one per seed, every start of every objective in one batch: ``value(E, V)`` maps
    moves and unit rows (starts, K, T, d) to (starts, K) values, entry (s, k) the k-th objective at ``E[s, k]``,
    ``V[s, k]`` alone.  Entry (s, k) is start s of the k-th objective's own ascent from ``seeds[k]``: the same draws
    and the same Adam steps (Adam acts entrywise, the sum's gradient in ``E[s, k]`` is that entry's), to rounding;
    a batched step costs about what one single step did."""
    gens = [torch.Generator().manual_seed(seed) for seed in seeds]
    # per seed, each start draws E, then V
    EV = torch.stack([torch.stack([torch.stack([torch.randn(X.shape, generator=g, dtype=torch.float64) for _ in "EV"])
                                   for g in gens]) for _ in range(starts)])  # (starts, K, 2, T, d)
    E = (EV[:, :, 0] / EV[:, :, 0].norm(dim=-1, keepdim=True) * rho).requires_grad_(True)
    V = EV[:, :, 1].clone().requires_grad_(True)
    opt = torch.optim.Adam([{"params": [E], "lr": 0.1 * rho}, {"params": [V], "lr": 0.05}])
    best = torch.zeros(starts, len(seeds), dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, rho))
        val = value(E, V / V.norm(dim=-1, keepdim=True))
        v = val.detach()
        best = torch.where(torch.isfinite(v), torch.maximum(best, v), best)
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best.amax(dim=0).tolist()


def token_ascents(out, X: torch.Tensor, rho: float, *, starts: int = 3, steps: int = 100) -> list:  # noqa: ANN001
    """Per token k, ``jvp_ascent`` of ``||out(E, V)[k]||`` from seed k, the T ascents in one batch (``jvp_ascents``):
    ``out`` maps moves and unit rows E, V (starts, T, T, d), one (T, d) pair per start and ascent, to
    (starts, T, T, m) (evaluated at ``X + E``, broadcast)."""
    k = torch.arange(X.shape[0])
    return jvp_ascents(lambda E, V: out(E, V)[:, k, k].norm(dim=-1), X, rho, k.tolist(), starts=starts, steps=steps)


def _digest(h, obj) -> None:  # noqa: ANN001
    """Feed every tensor (dtype, shape, bytes) and scalar reachable from ``obj`` (dataclasses, sequences) to ``h``."""
    if isinstance(obj, torch.Tensor):
        h.update(f"{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(obj.detach().contiguous().cpu().numpy().tobytes())
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _digest(h, getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _digest(h, o)
    else:
        h.update(repr(obj).encode())


_ROWS: dict = {}


def cached_layer_rows(layer, X: torch.Tensor, radii: list, shared: Path) -> list:  # noqa: ANN001
    """``layer_rows(layer, X, radii)``, computed once per test run: kept in this process and, for the other xdist
    workers, in ``shared`` (``torch.save`` of the ``LayerJacobian`` fields, plain tensors, floats and dicts: the same
    floats back), keyed on the layer's weights, ``X`` and ``radii``; a file lock makes a second worker wait for the
    first one's result instead of repeating it."""
    from filelock import FileLock

    from transcover.lipschitz._local_jacobian import LayerJacobian
    from transcover.lipschitz._local_rows import layer_rows

    h = hashlib.sha256()
    _digest(h, (layer, X, [float(r) for r in radii]))
    key = h.hexdigest()
    if key not in _ROWS:
        path = shared / f"layer_rows_{key}.pt"
        with FileLock(f"{path}.lock"):
            if path.exists():
                rows = [LayerJacobian(**d) for d in torch.load(path, weights_only=True)]
            else:
                rows = layer_rows(layer, X, radii)
                torch.save([{f.name: getattr(lj, f.name) for f in dataclasses.fields(lj)} for lj in rows],
                           path.with_suffix(".tmp"))
                path.with_suffix(".tmp").replace(path)
        _ROWS[key] = rows
    return _ROWS[key]


def minilm_layer0_rows(shared: Path) -> tuple:
    """Real MiniLM (float64), the second sklearn-descr sentence cut to 12 tokens after the input norm (``X``) and
    layer 0's ``layer_rows`` at ``radii`` = 1e-3 and 1e-2 of its median token norm (``cached_layer_rows``): the
    setup the MiniLM tests of F46, F47 and F51a share.  Returns ``(spec, X, radii, rows)``."""
    from transcover.model import load
    from transcover.model._data import load_inputs

    spec = load(None).to_torch(torch.float64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=12, limit=2)[1].double())
    med = float(X.norm(dim=1).median())
    radii = [1e-3 * med, 1e-2 * med]
    return spec, X, radii, cached_layer_rows(spec.layers[0], X, radii, shared)


def refine_every_token(evaluate, reported, refine, T, lowest=None):  # noqa: ANN001, ANN201, ARG001
    """A stand-in for ``_local_rows.refine_lazily`` that refines every token to its final level (the reference the
    lazy rule (F37a) and its tiers must reproduce at the maxima)."""
    idx = torch.arange(T)
    while len(idx):  # until every token is final (F45b: a first step may give an intermediate tier)
        final = refine(idx)
        idx = idx[:0] if final is None else idx[~final]
    return evaluate()


def assert_stack_never_looser(new, old) -> None:  # noqa: ANN001
    """``stack_local`` results with a branch on (``new``) and off (``old``): the bound, drift, every span drift row and
    every per-token radius at most the old, and some prefix span row (start 0) strictly below it (the branch binds)."""
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)
    assert all(bool((new.spans[k] <= old.spans[k]).all()) for k in old.spans)
    assert any(bool((new.spans[k] < old.spans[k]).any()) for k in old.spans if k[0] == 0)
    assert all(bool((a <= b).all()) for a, b in zip(new.token_radii, old.token_radii))


def tiny_bert(path: Path, bias: float = 0.0) -> Path:
    """A seeded random HF BERT (2 layers, hidden 64) saved at ``path``, its layer-0 attention output bias the constant
    ``bias``: layer 0's ``norm_attn`` input then has mean ``bias`` and std about 1, the same real function (LayerNorm
    is shift-invariant) evaluated with that much cancellation (red team 218's ``build_bias.py``)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=32)
    m = BertModel(cfg, add_pooling_layer=False)
    with torch.no_grad():
        m.encoder.layer[0].attention.output.dense.bias.fill_(bias)
    m.save_pretrained(path, safe_serialization=True)
    return path
