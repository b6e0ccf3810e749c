"""The whole stack's exact Jacobian at the data and its certified drift over the ball (issue 12; THEORY F30).

Note [stack Jacobian].  The network from the embedded tokens to the last layer's output (input norm,
layers, final norm: the map ``network_local`` describes, no head) is a chain of stages
``f = f_n o ... o f_1``; ``x_s`` is stage ``s``'s input on the data path and ``J_s = Df_s(x_s)``.
The Jacobian ``J(x) = J_n ... J_1`` (T x T blocks of d x d) is accumulated in float64 by applying
each stage's *structured* tangent map (written out below: per-token ``d x d`` matrices ``M_i``, the
attention's projections batched over heads) to all ``T d`` columns at once; the prefixes
``P_s = J_{s-1} ... J_1`` are the intermediate results.  The suffixes ``S_s = J_n ... J_{s+1}`` come
from the transposed maps applied to all ``T d`` rows (``_StageLin.apply_t``).  Cost: ``O(n T^2 d^3)``
flops for each chain (the (2,inf) certificate needs every block).

Note [stack drift].  For ``y`` in ``B(x, rho)`` (every token within rho), telescoping
``J(y) - J(x) = sum_s S_s(y) (J_s(y_s) - J_s(x_s)) P_s(x)`` and the submultiplicativity of the (2,inf)
operator norm give ``sup_B ||J(y) - J(x)|| <= sum_s Sbar_s dJ_s(r_s) ||P_s(x)||`` with
``dJ_s(r)`` the per-stage drift over ``B(x_s, r)`` (``layer_jacobians``' ``drift_rows``, the norms'
``2 max|gamma| r/(sqrt(d) s_floor^2)``), ``B_s(r)`` the per-stage ball constant, and

* radii: ``r_s <= rho sup_B ||P_s|| <= rho (||P_s(x)|| + dP_s)``, ``dP_{s+1} <= B_s dP_s + dJ_s ||P_s(x)||``
  (mean-value inequality along the segment; the prefix's own drift is the second-order remainder);
* suffixes: ``Sbar_s = min(||S_s(x)|| + dS_s, prod_{m>s} B_m)``, ``dS_s <= dS_{s+1} B_{s+1} + ||S_{s+1}(x)|| dJ_{s+1}``.

Note [stack rounding].  Each stage's map applied in float64 to the computed columns ``K`` is one
expression tree of +, -, x and division by the stage's factors (the factors are those float64
computes at the centre, the convention of F17).  Expanding ``fl`` op by op, every monomial carries
at most ``k`` factors ``(1 + delta)``, ``|delta| <= u`` (``k``: the longest chain of roundings, inner
sums included, whatever their order), so ``|fl(L K) - L K| <= gamma_k |L|(|K|)`` entrywise, where
``|L|(|K|)`` is the *abs evaluation*: the same tree on the absolute values of the computed operands,
every subtraction an addition (``apply(..., absval=True)``; a layer's ``M_i`` is built inside the
tree, so its own products are included).  The abs evaluation is itself computed in float64 on
non-negative numbers, hence within ``1/(1 - gamma)`` of its exact value.  The (2,inf) norm of the
error matrix is at most ``max_i sum_j ||E_ij||_F`` (``_local_error``).  The stage errors are carried to
the end by the later stages' certified point norms, ``||Phat_{s+1} - P_{s+1}|| <= p_s ||Phat_s - P_s||
+ e_s`` (suffixes: rows, ``C_{s-1} = C_s J_s``).  THEORY F30 item 3.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity
from ..model import NormKind, NormSpec, Placement, TransformerSpec
from ._local_jacobian import _norm_drift, _weight_norms, certified_spectral, layer_jacobians, row_norm_lower
from ._weights import ROUNDING_PAD

__all__ = ["StackLocal", "stack_local", "stack_jacobian", "stack_lower", "STACK_ROUTE_MAX"]

_U = 2.0**-53
# the default of ``network_local(route="auto")``: the stack route's cost grows as T^2 d^3 per stage
# plus the per-layer drift machinery (MiniLM at 7 tokens: minutes on 2 cores), so by default it
# runs when T*d is at most this (small models); ``route="stack"`` forces it.
STACK_ROUTE_MAX = 1024
_CHUNK = 512


def _f64(W) -> Tensor:  # noqa: ANN001
    return torch.as_tensor(W, dtype=torch.float64).detach()


class _NormLin:
    """Row-convention tangent map of a LayerNorm/RMSNorm at Z: ``r -> gamma (P r - u (u.r)) / s``."""

    def __init__(self, norm: NormSpec, Z: Tensor) -> None:
        if norm.kind is NormKind.BALL:
            raise InputError("the stack route does not cover Pi_norm; the product route does")
        d = Z.shape[1]
        self.lay = norm.kind is NormKind.LAYERNORM
        Zc = Z - Z.mean(dim=1, keepdim=True) if self.lay else Z
        self.s = torch.sqrt((Zc * Zc).mean(dim=1) + float(norm.eps))
        self.u = Zc / (math.sqrt(d) * self.s[:, None])
        self.g = torch.ones(d, dtype=torch.float64) if norm.weight is None else _f64(norm.weight)
        self.sigma = Zc.norm(dim=1) / math.sqrt(d)
        self.norm = norm
        self.k = 8 * d + 8

    def _core(self, r: Tensor, absval: bool = False) -> Tensor:
        # absval: the same expression tree on |operands|, every subtraction an addition (Note [stack rounding])
        sg, u = (1.0, self.u.abs()) if absval else (-1.0, self.u)
        rc = r + sg * r.mean(dim=-1, keepdim=True) if self.lay else r
        return (rc + sg * u * (r * u).sum(dim=-1, keepdim=True)) / self.s[:, None]

    def apply(self, K: Tensor, absval: bool = False) -> Tensor:
        return (self.g.abs() if absval else self.g) * self._core(K, absval)

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        return self._core((self.g.abs() if absval else self.g) * C, absval)


class _AttnLin:
    """Row-convention tangent map of dot-product attention at Xin (heads batched, biases folded)."""

    def __init__(self, attn, Xin: Tensor) -> None:  # noqa: ANN001
        from ..model import attention_scores

        T, d = Xin.shape
        sc = attn.softmax_scale
        Xa = torch.cat([Xin, torch.ones(T, 1, dtype=torch.float64)], dim=1)
        hs = [tuple(_f64(W) for W in attn.head(h)) for h in range(attn.n_heads)]
        self.Q = torch.stack([sc * (Xa @ _f64(attn.W_Q_augmented(h))) for h in range(attn.n_heads)])  # (H,T,dh)
        self.K = torch.stack([Xin @ Wk for _, Wk, _, _ in hs])
        self.V = torch.stack([Xin @ Wv for _, _, Wv, _ in hs])
        self.P = torch.stack([torch.softmax(attention_scores(attn, Xin, h), dim=-1) for h in range(attn.n_heads)])
        cat = lambda Ws: torch.cat(list(Ws), dim=1)  # noqa: E731  (d, H dh)
        self.W3 = torch.cat([sc * cat(h[0] for h in hs), cat(h[1] for h in hs), cat(h[2] for h in hs)], dim=1)
        self.Wo = torch.cat([h[3] for h in hs], dim=0)  # (H dh, d)
        self.H, self.dh = attn.n_heads, hs[0][0].shape[1]
        # the absolute values of the factors, for the abs evaluation (Note [stack rounding])
        self.aQ, self.aK, self.aV, self.aW3, self.aWo = (A.abs() for A in (self.Q, self.K, self.V, self.W3, self.Wo))

    def _split(self, Z: Tensor) -> tuple[Tensor, ...]:
        N, T, _ = Z.shape
        Z = Z.reshape(N, T, 3, self.H, self.dh).permute(2, 0, 3, 1, 4)  # (3, N, H, T, dh)
        return Z[0], Z[1], Z[2]

    def _f(self, absval: bool) -> tuple:
        if absval:
            return self.aQ, self.aK, self.aV, self.aW3, self.aWo, 1.0
        return self.Q, self.K, self.V, self.W3, self.Wo, -1.0

    def apply(self, dX: Tensor, absval: bool = False) -> Tensor:
        Q, K, V, W3, Wo, sg = self._f(absval)
        dQ, dK, dV = self._split(dX @ W3)
        ds = dQ @ K.transpose(-1, -2) + Q @ dK.transpose(-1, -2)
        dP = self.P * (ds + sg * (self.P * ds).sum(dim=-1, keepdim=True))
        dO = dP @ V + self.P @ dV  # (N, H, T, dh)
        N, _, T, _ = dO.shape
        return dO.permute(0, 2, 1, 3).reshape(N, T, -1) @ Wo

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        Q, K, V, W3, Wo, sg = self._f(absval)
        N, T, _ = C.shape
        gO = (C @ Wo.T).reshape(N, T, self.H, self.dh).permute(0, 2, 1, 3)
        gdP = gO @ V.transpose(-1, -2)
        gV = self.P.transpose(-1, -2) @ gO
        gds = self.P * (gdP + sg * (self.P * gdP).sum(dim=-1, keepdim=True))
        gQ = gds @ K
        gK = gds.transpose(-1, -2) @ Q
        G = torch.stack([gQ, gK, gV]).permute(1, 3, 0, 2, 4).reshape(N, T, -1)
        return G @ W3.T


class _LayerLin:
    """One layer's tangent map at X: ``dOut_i = (dX_i + dA_i) M_i^T`` (post-LN: ``M = D2 (I+F) D1``)
    or ``(dX_i + dA(D1 dX)_i) M_i^T`` (pre-LN: ``M = I + F D2``); Note [exact layer Jacobian]."""

    def __init__(self, layer, X: Tensor) -> None:  # noqa: ANN001
        from ..model import attention_forward

        attn, ffn = layer.attention, layer.ffn
        if layer.residual.value == "parallel" or ffn.gated or attn.kind != "dot" or attn.rope is not None \
                or attn.q_norm is not None or attn.k_norm is not None or attn.softcap is not None \
                or attn.window is not None or getattr(layer, "post_norm_attn", None) is not None \
                or getattr(layer, "post_norm_ffn", None) is not None:
            raise InputError(f"the stack route (THEORY F30) covers sequential layers with plain dot attention, a "
                             f"non-gated FFN and no branch-output norm; layer {layer.index} is outside it")
        T, d = X.shape
        eye = torch.eye(d, dtype=torch.float64)
        post = layer.placement is Placement.POST
        ident = lambda n, Z: None if n is None or n.kind is NormKind.NONE else _NormLin(n, Z)  # noqa: E731
        dmat = lambda nl, a=False: eye.expand(T, d, d) if nl is None else nl.apply(eye[:, None, :].expand(d, T, d), a).permute(1, 2, 0)  # noqa: E731
        if post:
            self.n1 = None
            Xin = X
            S1 = X + attention_forward(attn, X)
            na = ident(layer.norm_attn, S1)
            H = S1 if na is None else layer.norm_attn(S1)
        else:
            self.n1 = ident(layer.norm_attn, X)
            Xin = X if self.n1 is None else layer.norm_attn(X)
            S1 = X + attention_forward(attn, Xin)
            na = None
            nb = ident(layer.norm_ffn, S1)
            H = S1 if nb is None else layer.norm_ffn(S1)
        W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
        z = (H @ W1 + (0 if ffn.b_1 is None else _f64(ffn.b_1))).clone().requires_grad_(True)
        (slope,) = torch.autograd.grad(ffn.activation(z).sum(), z)
        F = (W2.T[None] * slope.detach()[:, None, :]) @ W1.T  # column convention (T, d, d)
        Fa = (W2.T.abs()[None] * slope.detach().abs()[:, None, :]) @ W1.T.abs()
        if post:
            S2 = H + _ffn(ffn, H)
            nb = ident(layer.norm_ffn, S2)
            M = dmat(nb) @ (eye + F) @ dmat(na)
            Ma = dmat(nb, True) @ (eye + Fa) @ dmat(na, True)
        else:
            M = eye + F @ dmat(nb)
            Ma = eye + Fa @ dmat(nb, True)
        self.Mt = M.transpose(1, 2).contiguous()
        # M's own construction is part of the expression tree whose abs evaluation bounds the rounding
        self.Mat = Ma.transpose(1, 2).contiguous()
        self.att = _AttnLin(attn, Xin)
        # longest chain of roundings through one application (M's construction included), generously
        self.k = 8 * (d + T + self.att.H * self.att.dh + W1.shape[1]) + 8

    def apply(self, K: Tensor, absval: bool = False) -> Tensor:
        A = self.att.apply(K if self.n1 is None else self.n1.apply(K, absval), absval)
        return torch.einsum("nti,tij->ntj", K + A, self.Mat if absval else self.Mt)

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        G = torch.einsum("ntj,tij->nti", C, self.Mat if absval else self.Mt)
        A = self.att.apply_t(G, absval)
        return G + (A if self.n1 is None else self.n1.apply_t(A, absval))


def _ffn(ffn, H: Tensor) -> Tensor:  # noqa: ANN001
    from ..model import ffn_forward

    return ffn_forward(ffn, H)


@dataclass
class _Stage:
    name: str
    spec: object  # NormSpec or LayerSpec
    x: Tensor  # the stage's input on the data path (float64)
    lin: object  # _NormLin or _LayerLin

    @property
    def k(self) -> int:
        return getattr(self.lin, "k", 8 * self.x.shape[1] + 8)


def _stages(spec: TransformerSpec, X: Tensor) -> tuple[list[_Stage], Tensor]:
    from ..model import layer_forward

    out, Z = [], X.detach().double()
    for name, n in (("input_norm", spec.input_norm),):
        if n is not None and n.kind is not NormKind.NONE:
            out.append(_Stage(name, n, Z, _NormLin(n, Z)))
            Z = n(Z).detach()
    for layer in spec.layers:
        out.append(_Stage(f"layer {layer.index}", layer, Z, _LayerLin(layer, Z)))
        Z = layer_forward(layer, Z).detach()
    n = spec.final_norm
    if n is not None and n.kind is not NormKind.NONE:
        out.append(_Stage("final_norm", n, Z, _NormLin(n, Z)))
        Z = n(Z).detach()
    return out, Z


def _chunked(fn, K: Tensor) -> Tensor:  # noqa: ANN001
    return torch.cat([fn(K[i:i + _CHUNK]) for i in range(0, K.shape[0], _CHUNK)])


def _gamma(k: int) -> float:
    return k * _U / (1 - k * _U)


def _local_error(st: _Stage, K: Tensor, *, cols: bool) -> float:
    """Bound on the (2,inf) operator norm of ``fl(L_s K) - L_s K`` (columns, ``cols``) or of the transposed
    map applied to rows: ``gamma_k`` times the abs evaluation of the stage on ``|K|``, padded for the
    abs evaluation's own (downward) rounding; per block Frobenius, summed over input tokens
    (Note [stack rounding])."""
    fn = st.lin.apply if cols else st.lin.apply_t
    A = _chunked(lambda Z: fn(Z.abs(), True), K)
    blocks = _col_blocks(A) if cols else _row_blocks(A)
    nb = blocks.shape[2] * blocks.shape[3] + blocks.shape[1]
    per_row = blocks.norm(dim=(2, 3)).sum(dim=1).max()
    g = _gamma(st.k)
    return float(per_row) * g / (1 - _gamma(st.k + nb)) * (1 + 1e-12)


def certified_rows(blocks: Tensor, exact: int = 8) -> Tensor:
    r"""Per output token ``i``, a certified upper bound on ``sum_j ||B_ij||_2`` for blocks (T, T, m, k):
    the ``exact`` blocks of each row largest in Frobenius norm by ``certified_spectral``, the others by
    their Frobenius norm (padded for its float64 rounding, ``m k u`` relative).  THEORY F17, F30."""
    T = blocks.shape[0]
    fro = blocks.norm(dim=(2, 3)) * (1 + 4 * blocks.shape[2] * blocks.shape[3] * _U)
    k = min(exact, blocks.shape[1])
    top = fro.topk(k, dim=1).indices
    sel = blocks[torch.arange(T)[:, None].expand(T, k), top]
    sp = certified_spectral(sel.reshape(T * k, *blocks.shape[2:])).reshape(T, k)
    fro.scatter_(1, top, torch.minimum(sp, fro.gather(1, top)))
    return fro.sum(dim=1)


def _col_blocks(K: Tensor) -> Tensor:
    """Blocks (i_out, j_in, d_out, d_in) of the matrix whose column ``n`` is ``K[n]`` (T, d)."""
    N, T, d = K.shape
    return K.reshape(T, N // T, T, d).permute(2, 0, 3, 1)


def _row_blocks(C: Tensor) -> Tensor:
    """Blocks (i_out, j_in, d_out, d_in) of the matrix whose row ``n`` is ``C[n]`` (T, d)."""
    N, T, d = C.shape
    return C.reshape(T, N // T, T, d).permute(0, 2, 1, 3)


def stack_jacobian(spec: TransformerSpec, X: Tensor) -> tuple[Tensor, float]:
    """The whole stack's Jacobian at X as blocks (T, T, d, d) (``J_ij = d out_i / d x_j``) and a
    bound on its float64 error in the (2,inf) operator norm (Note [stack rounding]: per stage
    ``gamma_k`` times the abs evaluation on the computed operands), via ``stack_local``."""
    r = stack_local(spec, X, [1e-300], keep_jacobian=True)[0]
    return r.jacobian, r.rounding


@dataclass
class StackLocal:
    """The whole stack on ``B(X, rho)``: exact-Jacobian route (point + telescoped drift) and the
    product of the per-stage ball constants; ``upper`` is the smaller (``route`` says which)."""

    rho: float
    point: float  # certified ||J(x)||_(2,inf) (block sums + rounding)
    drift: float  # certified sup over the ball of ||J(y) - J(x)|| (Note [stack drift])
    stack: float  # point + drift, padded
    product: float  # prod_s B_s (per-stage ball constants along the data path)
    radii: list[float]  # certified radius at each stage's input
    stage_names: list[str]
    stage_point: list[float]
    stage_ball: list[float]
    stage_drift: list[float]
    prefix_norms: list[float]  # certified ||P_s(x)||
    suffix_norms: list[float]  # certified ||S_s(x)||
    rounding: float  # bound on the float64 error of the computed J (included in ``point``)
    seconds: float = math.nan
    cpu_seconds: float = math.nan
    parts: dict = field(default_factory=dict)  # drift share of each stage
    jacobian: Tensor | None = field(default=None, repr=False)  # blocks (T, T, d, d) at X when kept

    @property
    def upper(self) -> float:
        return min(self.stack, self.product)

    @property
    def route(self) -> str:
        return "stack" if self.stack <= self.product else "product"

    def quantity(self) -> Quantity:
        return Quantity(self.upper, Kind.CERTIFIED_UPPER, "THEORY F17, F30 (whole-stack local route, issue 12)",
                        (f"every embedded token within rho={self.rho:.6g} (l2) of the data point", "metric (2,inf)",
                         f"route: {self.route} (exact stack Jacobian + telescoped drift, or product of stage constants)",
                         "float64 evaluation with the rounding of Note [stack rounding] and _local_jacobian's pads"))


def _stage_local(st: _Stage, radii: list[float], norms: dict) -> tuple[float, list[float], list[float]]:
    """(certified point ||J_s(x_s)||, per radius sup-drift dJ_s, per radius ball constant B_s)."""
    T, d = st.x.shape
    if isinstance(st.lin, _NormLin):
        nl = st.lin
        pt = float((nl.g.abs().max() / nl.s).max()) * (1 + ROUNDING_PAD)
        dr, ba = [], []
        for r in radii:
            drift, sup = _norm_drift(nl.norm, nl.sigma, torch.full((T,), r, dtype=torch.float64), d)
            dj = float(drift.max()) * (1 + ROUNDING_PAD)
            dr.append(dj)
            ba.append(min(float(sup.max()) * (1 + ROUNDING_PAD), pt + dj))
        return pt, dr, ba
    key = st.spec.index
    if key not in norms:
        from ._local_attention import head_norms

        norms[key] = (_weight_norms(st.spec), head_norms(st.spec.attention))
    call = lambda rs: layer_jacobians(st.spec, st.x, rs, norms=norms[key][0], head_norms_=norms[key][1])  # noqa: E731
    try:
        ljs = call(radii)
    except RuntimeError:  # a radius so large that the layer's drift machinery overflows: no bound there
        ljs = []
        for r in radii:
            try:
                ljs.append(call([r])[0])
            except RuntimeError:
                ljs.append(None)
    pt = next((lj.point for lj in ljs if lj is not None), None)
    pt = call([0.0])[0].point if pt is None else pt
    return (pt, [math.inf if lj is None else float(lj.drift_rows.max()) for lj in ljs],
            [math.inf if lj is None else lj.ball for lj in ljs])


def stack_local(spec: TransformerSpec, X: Tensor, rhos, *, exact: int = 8, chain_exact: int = 4,  # noqa: ANN001
                norms: dict | None = None, keep_jacobian: bool = False) -> list[StackLocal]:
    r"""Certified local constant of the whole stack on ``B(X, rho)`` for each ``rho`` (X: embedded tokens
    before the input norm), by the exact Jacobian at X and its telescoped drift (Notes [stack
    Jacobian], [stack drift], [stack rounding]), beside the product of the per-stage ball constants.

    .. math:: \mathrm{Lip}_{B(X,\rho)} \le \min\Big(\max_i \sum_j \|J_{ij}(X)\|_2 + \varepsilon_{\mathrm{fl}}
              + \sum_s \bar S_s\, \Delta J_s(r_s)\, \|P_s(X)\|,\ \prod_s B_s(r_s)\Big)

    Source: THEORY F17, F30.  Assumptions: every embedded token within ``rho`` (l2) of X; the stages
    are input norm, sequential layers with dot attention (no RoPE, window, soft-cap or q/k norm) and a
    non-gated FFN, final norm; float64.  ``exact``: blocks per row certified by ``certified_spectral``
    for J itself, ``chain_exact`` for the prefixes and suffixes.
    """
    from ._local import check_rho

    rhos = [check_rho(r) for r in (rhos if isinstance(rhos, (list, tuple)) else [rhos])]
    t0, c0 = time.perf_counter(), time.process_time()
    X = X.detach().double()
    T, d = X.shape
    stages, _ = _stages(spec, X)
    n = len(stages)
    norms = {} if norms is None else norms
    nr = len(rhos)
    # -- forward: prefixes P_s (certified norms with their rounding), radii, per-stage constants ------
    K = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
    pre = [1.0]  # ||P_0|| = ||I||
    loc_err: list[float] = []  # E_s of applying stage s to the prefix
    pts, drifts, balls, radii = [], [], [], []
    dP = [0.0] * nr
    prod = [1.0] * nr
    for s, st in enumerate(stages):
        scale = float(st.x.norm(dim=1).max())
        r_s = [min(rho * (pre[s] + dP[k]), rho * prod[k]) * (1 + 1e-12) + 1e-13 * scale for k, rho in enumerate(rhos)]
        pt, dj, ba = _stage_local(st, [r if math.isfinite(r) else 0.0 for r in r_s], norms)
        dj = [v if math.isfinite(r) else math.inf for v, r in zip(dj, r_s)]
        ba = [v if math.isfinite(r) else math.inf for v, r in zip(ba, r_s)]
        pts.append(pt)
        drifts.append(dj)
        balls.append(ba)
        radii.append(r_s)
        dP = [ba[k] * dP[k] + dj[k] * pre[s] for k in range(nr)]
        prod = [prod[k] * ba[k] for k in range(nr)]
        loc_err.append(_local_error(st, K, cols=True))
        K = _chunked(st.lin.apply, K)
        rows = certified_rows(_col_blocks(K), exact if s == n - 1 else chain_exact)
        # error of the computed prefix: the stages' errors carried by the later stages' point bounds
        err = sum(loc_err[m] * math.prod(pts[m + 1: s + 1]) for m in range(s + 1))
        pre.append(float(rows.max()) + err)
    point_err = err
    point = pre[n]
    kept = _col_blocks(K).contiguous() if keep_jacobian else None
    del K
    # -- backward: suffixes S_s = J_{n-1} ... J_{s+1}, certified norms -------------------------------
    suf = [0.0] * n
    suf[n - 1] = 1.0
    C = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
    s_err: list[float] = []
    for s in range(n - 1, 0, -1):
        s_err.append(_local_error(stages[s], C, cols=False))
        C = _chunked(stages[s].lin.apply_t, C)  # rows of S_{s-1}
        # applied after the errors: S_{s-1} = J_{n-1} ... J_s, the error of step m carried by J_{s..m-1}
        steps = list(range(n - 1, s - 1, -1))
        err = sum(e * math.prod(pts[s:m]) for e, m in zip(s_err, steps))
        suf[s - 1] = float(certified_rows(_row_blocks(C), chain_exact).max()) + err
    del C
    out = []
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for k, rho in enumerate(rhos):
        dS = 0.0
        sbar = [1.0] * n
        for s in range(n - 2, -1, -1):
            dS = dS * balls[s + 1][k] + suf[s + 1] * drifts[s + 1][k]
            sbar[s] = min(suf[s] + dS, math.prod(balls[m][k] for m in range(s + 1, n)))
        terms = [sbar[s] * drifts[s][k] * pre[s] for s in range(n)]
        drift = sum(terms)
        if not math.isfinite(drift):
            drift = math.inf
        stack = (point + drift) * (1 + ROUNDING_PAD)
        product = math.prod(balls[s][k] for s in range(n)) * (1 + ROUNDING_PAD)
        out.append(StackLocal(rho, point, drift, stack, product, [r[k] for r in radii], [st.name for st in stages],
                              pts, [b[k] for b in balls], [dj[k] for dj in drifts], pre[:n], suf, point_err, wall, cpu,
                              {st.name: t for st, t in zip(stages, terms)}, kept if k == 0 else None))
    return out


def stack_lower(spec: TransformerSpec, X: Tensor, rho: float, *, restarts: int = 3, steps: int = 30,
                iters: int = 30, seed: int = 0, blocks: Tensor | None = None, blocks_err: float = 0.0) -> float:
    """An empirical lower estimate of the whole stack's local constant on ``B(X, rho)``, (2,inf) metric:
    the larger of the attained (2,inf) norm of the exact Jacobian at X (``row_norm_lower`` on its
    blocks, alternating maximisation with restarts) and a float64 Adam ascent on the pair ratio
    ``||f(a) - f(b)|| / ||a - b||`` over pairs in the ball (restarts).  Kind: empirical lower."""
    from ..model import transformer_forward
    from ._empirical import jacobian_operator_norm

    X = X.detach().double()
    fn = lambda Z: transformer_forward(spec, Z, with_head=False)  # noqa: E731
    if blocks is None:
        blocks, blocks_err = stack_jacobian(spec, X)
    # attained by the computed J; the exact one is within its rounding bound
    best = max(float(row_norm_lower(blocks, iters=iters, restarts=restarts, seed=seed).max()) - blocks_err, 0.0)
    n24 = lambda Z: Z.norm(dim=-1).max()  # noqa: E731
    clip = lambda D: D * torch.clamp(rho * (1 - 1e-12) / D.norm(dim=-1, keepdim=True).clamp(min=1e-300), max=1.0)  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    for k in range(restarts):
        C = clip(torch.randn(X.shape, generator=g, dtype=torch.float64) * rho)
        _, V = jacobian_operator_norm(fn, X + C, metric="2,inf", n_iter=8, seed=seed + k)
        A = C.clone().requires_grad_(True)
        B = clip(C + 1e-2 * rho * V).clone().requires_grad_(True)
        opt = torch.optim.Adam([A, B], lr=0.05 * rho)
        for _ in range(steps):
            with torch.no_grad():
                A.copy_(clip(A))
                B.copy_(clip(B))
            num, den = n24(fn(X + A) - fn(X + B)), n24(A - B)
            ratio = num / den
            if bool(torch.isfinite(ratio)) and float(den.detach()) > 1e-9 * rho:
                best = max(best, float(ratio.detach()))
            opt.zero_grad()
            (-ratio).backward()
            opt.step()
    return best
