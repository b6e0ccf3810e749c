"""THEORY F79: the norm and FFN sub-stages' direction-aware Taylor rests (``_local_rest_rows``) against float64
projected Adam of the exact rest ``f(x + Delta) - f(x) - J_f(x) Delta`` over the move set ``Delta_i = sum_j B_ij
delta_j + e_i`` (``||delta_j|| <= rho``, ``||e_i|| <= E_i``), T = 3, d = 8; and the rows' homogeneity."""

from __future__ import annotations

import math

import pytest
import torch

from transcover.lipschitz._local_rest_rows import ffn_rest_rows, norm_move_forms, norm_rest_rows
from transcover.lipschitz._local_stack_aligned import FFNAligned
from transcover.model import Activation, FFNSpec, NormKind, NormSpec, ffn_forward

F64 = torch.float64
T, D, DFF = 3, 8, 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _blocks(g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """(T, T, D, D) prefix blocks: a dominant diagonal, weaker off-diagonal blocks."""
    B = torch.randn(T, T, D, D, generator=g, dtype=F64) * 0.1 * scale
    return B + torch.eye(D, dtype=F64) * scale * torch.eye(T, dtype=F64)[:, :, None, None]


def _rest(f, x: torch.Tensor, J: torch.Tensor, Dl: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """(T,) ``||f(x + Dl) - f(x) - J_f(x) Dl||`` per token, ``J`` the (T D, T D) Jacobian at x."""
    lin = (J @ Dl.reshape(-1)).reshape(T, D)
    return (f(x + Dl) - f(x) - lin).norm(dim=-1)


def _rest_at(f, x: torch.Tensor, Dl: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """(T,) the same rest with the linear part by a forward-mode product at ``x`` (differentiable in ``x``)."""
    lin = torch.autograd.functional.jvp(f, x, Dl, create_graph=True)[1]
    return (f(x + Dl) - f(x) - lin).norm(dim=-1)


def _attained(f, x: torch.Tensor, B: torch.Tensor, rho: float, E: torch.Tensor, seed: int,  # noqa: ANN001
              starts: int = 3, steps: int = 60, pad: float = 0.0) -> torch.Tensor:
    """(T,) the largest rest per token found by projected Adam over ``delta`` and ``e`` (each token its own run) and,
    with ``pad``, over the exact centre ``x + c``, ``||c_i|| <= pad`` (the Jacobian then taken at ``x + c``)."""
    g = _gen(seed)
    J = None if pad > 0 else torch.autograd.functional.jacobian(f, x).reshape(T * D, T * D)
    best = torch.zeros(T, dtype=F64)
    clip = lambda v, c: v * torch.clamp(c / v.norm(dim=-1, keepdim=True).clamp(min=1e-300), max=1.0)  # noqa: E731
    for i in range(T):
        for _ in range(starts):
            dl = clip(torch.randn(T, D, generator=g, dtype=F64) * 10 * rho, rho).requires_grad_(True)
            e = clip(torch.randn(T, D, generator=g, dtype=F64) * 10, E[:, None]).requires_grad_(True)
            c = clip(torch.randn(T, D, generator=g, dtype=F64), pad).requires_grad_(pad > 0)
            opt = torch.optim.Adam([dl, e, c] if pad > 0 else [dl, e], lr=0.1 * max(rho, pad))
            for _ in range(steps):
                Dl = torch.einsum("ijab,jb->ia", B, dl) + e
                R = _rest(f, x, J, Dl)[i] if J is not None else _rest_at(f, x + c, Dl)[i]
                best[i] = max(float(best[i]), float(R.detach()))
                opt.zero_grad()
                (-R).backward()
                opt.step()
                with torch.no_grad():
                    dl.copy_(clip(dl, rho))
                    e.copy_(clip(e, E[:, None]))
                    c.copy_(clip(c, pad))
    return best


def _norm_case(kind: str, seed: int):  # noqa: ANN202
    g = _gen(seed)
    gam = 1.0 + 0.5 * torch.randn(D, generator=g, dtype=F64)
    x = torch.randn(T, D, generator=g, dtype=F64)
    eps = 1e-5
    if kind == "flat":  # near-flat tokens (a large mean, a small spread), eps 1e-12
        x = 7.0 + 0.05 * x
        eps = 1e-12
    if kind == "gamma":  # tiny and sign-mixed gamma with one large entry
        gam = 1e-3 * torch.randn(D, generator=g, dtype=F64)
        gam[3] = -2.0
    lay = kind != "rms"
    norm = NormSpec(NormKind.LAYERNORM if lay else NormKind.RMSNORM, gam, torch.zeros(D, dtype=F64), eps)
    return norm, x, gam, eps, lay


def _norm_row(B, x, gam, eps, lay, rho, E, pad=0.0):  # noqa: ANN001, ANN202
    f = norm_move_forms(B, x, gam, lay)
    Bc = B - B.mean(dim=2, keepdim=True) if lay else B
    r = (rho * torch.linalg.matrix_norm(Bc, 2).sum(dim=1) + E) * (1 + 1e-9)
    return norm_rest_rows(f, eps, rho, E, r, pad)


def _offset(x: torch.Tensor, frac: float) -> tuple[torch.Tensor, float]:
    """(``x*``, ``pad``): the exact centre off the stored ``x`` by ``frac`` of its smallest token, every row."""
    p = torch.randn(x.shape, generator=_gen(21), dtype=F64)
    pad = frac * float(x.norm(dim=1).min())
    return x + pad * p / p.norm(dim=1, keepdim=True), pad


@pytest.mark.parametrize("kind", ["plain", "rms"])
def test_norm_rest_at_an_offset_centre(kind: str) -> None:
    """The row at the stored input with ``pad``, the rest at the exact centre ``x*`` within ``pad`` of it."""
    norm, x, gam, eps, lay = _norm_case(kind, 1)
    xs, pad = _offset(x, 0.01)
    B = _blocks(_gen(2))
    rho = 0.02 * float(x.norm(dim=1).min())
    E = torch.tensor([0.0, 0.3, 1.0], dtype=F64) * rho
    assert (_attained(norm, xs, B, rho, E, 3, starts=2, steps=40) <= _norm_row(B, x, gam, eps, lay, rho, E, pad)).all()


@pytest.mark.parametrize("kind", ["plain", "rms"])
def test_norm_rest_at_the_worst_centre(kind: str) -> None:
    """red26: the exact centre searched within ``pad`` = 0.55 of the smallest centred token (towards its zero the
    curvature grows as ``1/||Z||^2``): the row with the pad holds, and what is found beats the row without it (so the
    segment's floor ``||Z|| - pad - ...`` is needed; dropping the pad failed no test before)."""
    norm, x, gam, eps, lay = _norm_case(kind, 1)
    B = _blocks(_gen(2))
    zn = float((x - x.mean(1, keepdim=True) if lay else x).norm(dim=1).min())
    rho, pad = 0.02 * zn, 0.55 * zn
    E = torch.tensor([0.0, 0.3, 1.0], dtype=F64) * rho
    got = _attained(norm, x, B, rho, E, 3, starts=2, steps=40, pad=pad)
    assert (got <= _norm_row(B, x, gam, eps, lay, rho, E, pad)).all()
    assert (got > _norm_row(B, x, gam, eps, lay, rho, E, 0.0)).any()


def test_ffn_rest_at_an_offset_centre() -> None:
    """The same for the FFN (``W_1 x 3``): the centre's offset as a free move plus the ``pad (r + pad)`` term."""
    x = torch.randn(T, D, generator=_gen(7), dtype=F64)
    xs, pad = _offset(x, 0.01)
    ffn, B = _ffn_case(8, w1=3.0), _blocks(_gen(9))
    E = torch.tensor([0.0, 0.01, 0.02], dtype=F64)
    got = _attained(lambda Z: Z + ffn_forward(ffn, Z), xs, B, 0.02, E, 10, starts=2, steps=40)
    assert (got <= _ffn_row(ffn, x, B, 0.02, E, pad)).all()


def test_ffn_rest_at_the_worst_centre() -> None:
    """red26: the FFN (``W_1 x 3``) with its exact centre searched within ``pad = 1``: the row with the pad holds, the
    rest found beats the row without it (the pad's free move and its ``pad (r + pad)`` term are needed)."""
    x = torch.randn(T, D, generator=_gen(7), dtype=F64)
    ffn, B = _ffn_case(8, w1=3.0), _blocks(_gen(9))
    E = torch.tensor([0.0, 0.01, 0.02], dtype=F64)
    got = _attained(lambda Z: Z + ffn_forward(ffn, Z), x, B, 0.02, E, 10, starts=2, steps=40, pad=1.0)
    assert (got <= _ffn_row(ffn, x, B, 0.02, E, 1.0)).all()
    assert (got > _ffn_row(ffn, x, B, 0.02, E, 0.0)).any()


def _tangent(B: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The blocks with every output row projected off its centred token's direction: the prefix's moves tangent to
    the sphere, the radial part only from ``e``."""
    n = x - x.mean(dim=1, keepdim=True)
    n = n / n.norm(dim=1, keepdim=True)
    Pt = torch.eye(D, dtype=F64) - 1.0 / D - n[:, :, None] * n[:, None, :]
    return torch.einsum("iab,ijbc->ijac", Pt, B)


@pytest.mark.parametrize("kind", ["plain", "flat", "gamma", "rms", "tangent", "large"])
def test_norm_rest_never_below_attained(kind: str) -> None:
    """``large``: the move a quarter of the centred token (the curvature's floor along the segment binds)."""
    norm, x, gam, eps, lay = _norm_case(kind, 1)
    scale = 0.05 if kind == "flat" else 1.0
    B = _tangent(_blocks(_gen(2), scale), x) if kind == "tangent" else _blocks(_gen(2), scale)
    frac = 0.2 if kind == "large" else 0.02
    rho = frac * float((x - x.mean(1, keepdim=True) if lay else x).norm(dim=1).min()) / scale
    E = torch.tensor([0.0, 0.3, 1.0], dtype=F64) * rho * scale * (3.0 if kind == "tangent" else 1.0)
    row = _norm_row(B, x, gam, eps, lay, rho, E)
    got = _attained(norm, x, B, rho, E, 3)
    assert torch.isfinite(row).all()
    assert (got <= row).all(), (got, row)
    # the search reaches the row's order (a loose row would not be tested); at a quarter of the token the floor
    # ``(||Z|| - q)^2`` of the whole segment is the row's slack
    assert float((got / row).max()) > (0.15 if kind == "large" else 0.4)


def test_norm_rest_homogeneity() -> None:
    """gamma x c -> the row x c; rho -> tau rho with E = 0: the row x tau^2 (to first order in tau)."""
    _, x, gam, eps, lay = _norm_case("plain", 4)
    B = _blocks(_gen(5))
    E0 = torch.zeros(T, dtype=F64)
    base = _norm_row(B, x, gam, eps, lay, 1e-3, E0)
    assert torch.allclose(_norm_row(B, x, 3.0 * gam, eps, lay, 1e-3, E0), 3.0 * base, rtol=1e-9)
    tau = 1e-2
    small = _norm_row(B, x, gam, eps, lay, tau * 1e-3, E0)
    assert torch.allclose(small, tau * tau * base, rtol=5e-3)


def _ffn_case(seed: int, w1: float = 1.0, b1: torch.Tensor | None = None, w2: float = 1.0) -> FFNSpec:
    g = _gen(seed)
    W1 = torch.randn(D, DFF, generator=g, dtype=F64) * w1 / math.sqrt(D)
    W2 = torch.randn(DFF, D, generator=g, dtype=F64) * w2 / math.sqrt(DFF)
    b = 0.1 * torch.randn(DFF, generator=g, dtype=F64) if b1 is None else b1
    return FFNSpec(W_1=W1, W_2=W2, activation=Activation.GELU, b_1=b, b_2=torch.zeros(D, dtype=F64))


def _ffn_row(ffn: FFNSpec, H, B, rho, E, pad=0.0):  # noqa: ANN001, ANN202
    al = FFNAligned(ffn, H, B, {})
    r = (rho * torch.linalg.matrix_norm(B, 2).sum(dim=1) + E) * (1 + 1e-9)
    return ffn_rest_rows(al, rho, E, r, pad)


def _extreme_bias(ffn: FFNSpec, H: torch.Tensor) -> torch.Tensor:
    """b_1 that puts token 0's pre-activations at GELU'''s extremes: 0 (sup GELU''), +-2 (inf), +-sqrt 2 (zero)."""
    marks = torch.tensor([0.0, 2.0, -2.0, math.sqrt(2), -math.sqrt(2), 0.7923, -0.7923, 0.0], dtype=F64)
    return marks.repeat(DFF // len(marks)) - H[0] @ ffn.W_1


@pytest.mark.parametrize("kind", ["plain", "saturated", "extremes", "free"])
def test_ffn_rest_never_below_attained(kind: str) -> None:
    """``free``: the move's part outside the prefix's rows up to ten times the prefix's (the mixed and ``E^2`` terms)."""
    H = torch.randn(T, D, generator=_gen(7), dtype=F64)
    ffn = _ffn_case(8, w1=6.0 if kind == "saturated" else 1.0)
    if kind == "extremes":
        ffn = _ffn_case(8, b1=_extreme_bias(ffn, H))
    B = _blocks(_gen(9))
    rho = {"saturated": 0.05 / 6.0, "free": 0.005}.get(kind, 0.05)
    E = torch.tensor([0.0, 0.5, 1.0], dtype=F64) * rho * (10.0 if kind == "free" else 1.0)
    row = _ffn_row(ffn, H, B, rho, E)
    got = _attained(lambda Z: Z + ffn_forward(ffn, Z), H, B, rho, E, 10)
    assert torch.isfinite(row).all()
    assert (got <= row).all(), (got, row)
    assert float((got / row).max()) > 0.45


def test_ffn_rest_homogeneity() -> None:
    """W_2 x c -> the row x c; rho -> tau rho with E = 0: the row x tau^2 (to first order in tau)."""
    H = torch.randn(T, D, generator=_gen(11), dtype=F64)
    B = _blocks(_gen(12))
    E0 = torch.zeros(T, dtype=F64)
    base = _ffn_row(_ffn_case(13), H, B, 1e-3, E0)
    assert torch.allclose(_ffn_row(_ffn_case(13, w2=4.0), H, B, 1e-3, E0), 4.0 * base, rtol=1e-6)
    tau = 1e-2
    assert torch.allclose(_ffn_row(_ffn_case(13), H, B, tau * 1e-3, E0), tau * tau * base, rtol=5e-3)


@pytest.mark.parametrize("kind", ["plain", "rms"])
def test_norm_rest_rows_are_scale_free(kind: str) -> None:
    """red26 (THEORY F80): the norm's rest is of degree 0 in (x, the move, pad, sqrt(eps)) jointly, so scaling them
    all by 2^k leaves the rows unchanged; at k = -300 the fourth powers of the move once underflowed to a row of 0
    (the true rest there is the unscaled one, ~1e-3); past 2^+-450 the row refuses with inf (never 0, never finite)."""
    _, x, gam, eps, lay = _norm_case(kind, 1)
    B = _blocks(_gen(2))
    E = torch.tensor([0.0, 0.01, 0.03], dtype=F64)
    base = _norm_row(B, x, gam, eps, lay, 0.02, E, 1e-3)
    for k in (-300, -60, 60, 300):
        c = 2.0**k
        assert torch.equal(_norm_row(B, x * c, gam, eps * c * c, lay, 0.02 * c, E * c, 1e-3 * c), base), k
    for k in (-480, 480):
        c = 2.0**k
        assert torch.isinf(_norm_row(B, x * c, gam, 0.0, lay, 0.02 * c, E * c, 1e-3 * c)).all(), k


def test_rest_rows_refuse_with_inf() -> None:
    """red26: a move past the centred token (the segment may pass its zero) and an infinite free part give inf rows,
    not the largest finite float (``nan_to_num``'s default)."""
    _, x, gam, eps, lay = _norm_case("plain", 1)
    B = _blocks(_gen(2))
    assert torch.isinf(_norm_row(B, x, gam, eps, lay, 10.0, torch.zeros(T, dtype=F64))).all()
    H = torch.randn(T, D, generator=_gen(7), dtype=F64)
    E = torch.tensor([0.0, math.inf, 0.0], dtype=F64)
    row = _ffn_row(_ffn_case(8), H, _blocks(_gen(9)), 0.05, E)
    assert torch.isinf(row[1]) and torch.isfinite(row[[0, 2]]).all()
