"""The whole stack's exact Jacobian at the data and its certified drift over the ball (issue 12; THEORY F30).

Note [stack Jacobian].  The network from the embedded tokens to the last layer's output (input norm,
layers, final norm: the map ``network_local`` describes, no head) is a chain of sub-stages
``f = f_{n-1} o ... o f_0`` (``_local_stack_maps`` Note [sub-stages]: each layer cut where it is
token-local); ``x_s`` is sub-stage ``s``'s input on the data path and ``J_s = Df_s(x_s)``.  The
Jacobian ``J(x) = J_{n-1} ... J_0`` (T x T blocks of d x d) is accumulated in float64 by applying each
sub-stage's structured tangent map to all ``T d`` columns at once; the prefixes ``P_s`` are the
intermediate results.  The suffixes ``S_s = J_{n-1} ... J_{s+1}`` come from the transposed maps applied
to all ``T d`` rows.  Cost: ``O(n T^2 d^3)`` flops for each chain (the (2,inf) certificate needs every block).

Note [stack drift].  For ``y`` in ``B(x, rho)`` (every token within rho), ``J(y) - J(x) = sum_s S_s(y)
(J_s(y_s) - J_s(x_s)) P_s(x)``; THEORY F33 bounds it row by row: per-token radii ``r_{s,i} = rho
(nu_i(P_s(x)) + dP_{s,i})`` from the exact prefix rows, the sub-stages' drift rows at those radii, and
the suffix's certified block norms ``N(S_s)`` (the attention's change seen through ``S_s W_O^hT``), with
the second-order remainders ``dP``, ``dS`` by recursions over sub-stages and over whole layers, and at
every layer-level cut by the exact middle products at X (THEORY F36, ``_local_stack_middle`` Note
[middle products]), which also give the drift of J as a route of its own.  Beside it, F30's
telescoping over whole layers with the per-layer route (``_layer_route``, its remainders also by the
middle products); the smallest wins.

Note [stack rounding].  Each stage's map applied in float64 to the computed columns ``K`` is one
expression tree of +, -, x and division by the stage's factors (the factors are those float64
computes at the centre, the convention of F17).  Expanding ``fl`` op by op, every monomial carries
at most ``k`` factors ``(1 + delta)``, ``|delta| <= u`` (``k``: the longest chain of roundings, inner
sums included, whatever their order), so ``|fl(L K) - L K| <= gamma_k |L|(|K|)`` entrywise, where
``|L|(|K|)`` is the *abs evaluation*: the same tree on the absolute values of the computed operands,
every subtraction an addition (``apply(..., absval=True)``; per-token matrices are built inside the
tree, so their own products are included).  The abs evaluation is itself computed in float64 on
non-negative numbers, hence within ``1/(1 - gamma)`` of its exact value.  The (2,inf) norm of the
error matrix is at most ``max_i sum_j ||E_ij||_F`` (``_local_error``).  Intermediate prefixes and
suffixes carry the errors by the stages' point norms (or a whole layer's, from its own blocks); the
Jacobian itself by the exact suffixes, ``fl(J) - J = sum_m S_m E_m``.  THEORY F30 item 3.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity
from ..model import NormKind, Placement, TransformerSpec
from ._local_centre import CENTRE_PAD_ASSUMPTION, centre_errors, f17_pad, stage_forward_error
from ._local_jacobian import certified_spectral, pow2_norm, row_norm_lower
from ._local_stack_aligned import FFNAligned, block_norms_and_rows, gram_rows
from ._local_stack_attn import AttentionAligned
from ._local_stack_carry import carried_first_order, carry_blocks, tail_drift
from ._local_attn_gram_rest import gram_factors, head_block_norms
from ._local_attn_psd import PSD_MAX_TOKENS, KeyImages, form_rows, psd_rest_rows
from ._local_attn_rest import attn_rest_data, joint_rest_rows, piecewise_rest_rows, segment_rest_heads
from ._local_drift import hessian_ball_sup
from ._local_lower import _clip, _inner_radius, _pair_quotients
from ._local_rest_rows import ffn_rest_rows as f79_ffn_rows
from ._local_rest_rows import norm_move_forms
from ._local_rest_rows import norm_rest_rows as f79_norm_rows
from ._local_stack_maps import _NormLin
from ._local_stack_middle import cut_carried_error, layer_cuts, middle_drift_column, middle_of_products, middle_rows
from ._local_stack_move import (attention_rest_rows, carried_error, ffn_rest_rows, image_sources, layer_rest_rows,
                                move_rest_rows, norm_rest_rows, pull_rows, stage_rest_rows, substage_products)
from ._local_stack_second import far_second_order, heads_second_order, near_second_order, second_order_rows, tail_sup
from ._local_stack_segment import segment_moves, with_auxiliary
from ._local_stack_stages import _Stage, layer_stages, norm_stage
from ._rounding import _gamma
from ._weights import ROUNDING_PAD

__all__ = ["StackLocal", "stack_local", "stack_jacobian", "stack_lower", "STACK_ROUTE_MAX", "SEGMENT_AUX"]

_U = 2.0**-53
# the default of ``network_local(route="auto")``: the stack route's cost grows as T^2 d^3 per stage
# (MiniLM at 7 tokens: about two CPU minutes), so by default it
# runs when T*d is at most this (small models); ``route="stack"`` forces it.
STACK_ROUTE_MAX = 1024
_CHUNK = 512
# THEORY F71c: the auxiliary radii (fractions of the run's largest) whose prefix drift rows average the move (the
# benchmark's default; ``stack_local``'s is none: each costs about what a reported radius does)
SEGMENT_AUX: tuple[float, ...] = (0.25, 0.5, 0.75)
# THEORY F93: the prefix's rows (every per-token radius, the point) by the weighted row Gram as well as the triangle
GRAM_ROWS = True
# THEORY F95: the move's rest carried through each product by its unit rows (weighted row Gram) as well as its blocks
CARRY_ROWS = True
# THEORY F77: ``stack_local``'s default for the move's rest by its own recursion (F73c, F76a): off, its chains from
# every sub-stage start cost MiniLM +35-55 % CPU, with F78/F79's rests 2.2-2.4x (F77b), about 2x since F83, for a
# gain at factors >= 1e-5 only
MOVE_REST = False


def _stages(spec: TransformerSpec, X: Tensor, norms: dict | None = None) -> tuple[list[_Stage], Tensor, dict]:
    """The sub-stages on the data path (input norm, each layer's sub-stages, final norm), the output,
    and per layer its sub-stages' index range and the norms ``m_i`` of its token-local product."""
    norms = {} if norms is None else norms
    out, Z = [], X.detach().double()
    groups: dict = {}
    if spec.input_norm is not None and spec.input_norm.kind is not NormKind.NONE:
        out.append(norm_stage("input_norm", -1, spec.input_norm, Z))
        Z = spec.input_norm(Z).detach()
    for layer in spec.layers:
        sts, Z, mL = layer_stages(layer, Z, norms.setdefault(layer.index, {}))
        groups[layer.index] = (len(out), len(out) + len(sts), mL)
        out.extend(sts)
    n = spec.final_norm
    if n is not None and n.kind is not NormKind.NONE:
        out.append(norm_stage("final_norm", -2, n, Z))
        Z = n(Z).detach()
    return out, Z, groups


def _chunked(fn, K: Tensor) -> Tensor:  # noqa: ANN001
    return torch.cat([fn(K[i:i + _CHUNK]) for i in range(0, K.shape[0], _CHUNK)])


def _local_error(st: _Stage, K: Tensor, *, cols: bool) -> float:
    """Bound on the (2,inf) operator norm of ``fl(L_s K) - L_s K`` (columns, ``cols``) or of the transposed
    map applied to rows: ``gamma_k`` times the abs evaluation of the stage on ``|K|`` (Note [stack
    rounding]), per block Frobenius, summed over input tokens.  The abs evaluation is linear with
    non-negative output and a non-negative block has ``||B||_F <= ||B 1||_2`` (and ``<= ||1^T B||_2``), so
    it runs on ``|K|`` summed over each token's ``d`` columns (rows): ``T`` of them instead of ``T d``.
    Padded for the float64 sums of non-negative numbers (THEORY F30 item 3, F36 item 1)."""
    N, T, d = K.shape
    summed = K.abs().reshape(T, d, T, d).sum(dim=1)  # one column (row) per token
    A = (st.lin.apply if cols else st.lin.apply_t)(summed, True)
    per_row = pow2_norm(A, 2).sum(dim=0 if cols else 1).max()  # at powers of two: no square flushes
    return float(per_row) * _gamma(st.k) / (1 - _gamma(st.k + 2 * d + 2 * T)) * (1 + 1e-12)


def _row_errors(st: _Stage, G: Tensor) -> Tensor:
    """(n,) bounds on ``||fl(G J_s) - G J_s||`` per row of ``G`` (n, T, d) (``st.lin.apply_t``): ``_local_error``'s
    ``gamma_k`` times the abs evaluation on ``|G|``, row by row (THEORY F86, Note [stack rounding])."""
    T, d = G.shape[1:]
    A = _chunked(lambda C: st.lin.apply_t(C, True), G.abs())
    return pow2_norm(A.flatten(1), 1) * _gamma(st.k) / (1 - _gamma(st.k + 2 * d + 2 * T)) * (1 + 1e-12)


def certified_block_norms(blocks: Tensor, exact: int = 8) -> Tensor:
    r"""(T, T) certified upper bounds on ``||B_ij||_2`` for blocks (T, T, m, k): the ``exact`` blocks of
    each row largest in Frobenius norm by ``certified_spectral``, the others by their Frobenius norm
    (padded for its float64 rounding, ``m k u`` relative; formed at a power of two where the plain norm leaves
    ``[2^-400, 2^400]``, ``pow2_norm``: torch's norm of a 1e-170 block is 0).  THEORY F17, F30, F96."""
    T = blocks.shape[0]
    fro = pow2_norm(blocks, (-2, -1)) * (1 + 4 * blocks.shape[2] * blocks.shape[3] * _U)  # no square flushes
    k = min(exact, blocks.shape[1])
    if k > 0:
        top = fro.topk(k, dim=1).indices
        sel = blocks[torch.arange(T)[:, None].expand(T, k), top]
        sp = certified_spectral(sel.reshape(T * k, *blocks.shape[2:])).reshape(T, k)
        fro.scatter_(1, top, torch.minimum(sp, fro.gather(1, top)))
    return fro


def certified_rows(blocks: Tensor, exact: int = 8) -> Tensor:
    r"""Per output token ``i``, a certified upper bound on ``sum_j ||B_ij||_2`` (``certified_block_norms``
    summed, the float64 sum padded).  THEORY F17, F30."""
    return rows_of_block_norms(certified_block_norms(blocks, exact))


def rows_of_block_norms(N: Tensor) -> Tensor:
    """(T,) ``sum_j N_ij`` of certified block norms (T, T), its float64 sum padded.  THEORY F30."""
    return N.sum(dim=1) * (1 + N.shape[1] * _U)


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
    token_radii: list = field(default_factory=list, repr=False)  # per stage, (T,) certified radius of each token
    # THEORY F36: the layer-level cuts (sub-stage indices, n last) and per span (a, b) of layer-level
    # stages the rows of sup_B nu_i(M_{a,b}(y) - M_{a,b}(x)) (sub-stage drift rows)
    cuts: list = field(default_factory=list, repr=False)
    spans: dict = field(default_factory=dict, repr=False)
    # Note [per-layer refusals]: where the per-layer route gave no bound at this X, and why
    refusals: list = field(default_factory=list)
    # per sub-stage (max_k of its reach nu_k(dJ_s P_s(x)) by the drift rows, the same with F40/F44's aligned reach)
    reaches: dict = field(default_factory=dict, repr=False)
    pads: list = field(default_factory=list, repr=False)  # per stage the centre pad in its radii (THEORY F64)
    centre: str = "f17"  # which centre pad: F17's assumed one or F64's certified recursion

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
                         "float64 evaluation with the rounding of Note [stack rounding] and _local_jacobian's pads")
                        + ((CENTRE_PAD_ASSUMPTION,) if self.centre == "f17" else ()))


def _suffix_heads(C: Tensor, att) -> Tensor:  # noqa: ANN001
    """(T, T, H) certified ``||Shat_ik W_O^hT||_2`` from the rows ``C`` of the computed suffix: the
    products in float64 (their rounding ``gamma_d ||Shat_ik||_F ||W_O^h||_F`` added) and
    ``certified_spectral`` of each d x d_head block.  THEORY F33 item 4."""
    N, T, d = C.shape
    H, dh = att.H, att.dh
    B = _row_blocks(C @ att.Wo.T)  # (T, T, d, H dh): S_ik W_O^T
    B = B.reshape(T, T, d, H, dh).permute(0, 1, 3, 2, 4).reshape(T * T * H, d, dh)
    sp = certified_spectral(B).reshape(T, T, H)
    pad = (d + 2) * _U / (1 - (d + 2) * _U) * pow2_norm(_row_blocks(C), (2, 3))[..., None] \
        * pow2_norm(att.Wo.reshape(H, dh, d), (1, 2))[None, None, :]
    return (sp + pad) * (1 + 1e-12)


def _tail(a: int, last: int, balls: list, dJs: list, k: int, stages: list) -> list[Tensor]:
    """``tail_drift``'s rows ``dR_s`` of the layer on sub-stages ``a .. last`` (THEORY F66)."""
    span = range(a, last + 1)
    return tail_drift([balls[t][k] for t in span], [dJs[t][k] for t in span], [stages[t].pt for t in span])


def _carry(G: dict, blk: dict, a: int, last: int, q: int, reach: dict, dR: list, heads: tuple | None) -> Tensor:
    """THEORY F66: rows ``Q_i >= sup nu_i(M_{q+1,q+2}(x) dJ_q(y) M_{0,q}(x))`` of the layer on sub-stages
    ``a .. last`` (layer-level stage ``q``), from the sub-stages' reach rows carried by ``G`` (``carry_blocks``)."""
    return carried_first_order([G[t] for t in range(a, last)], [reach[t] for t in range(a, last + 1)], dR,
                               blk[(q + 1, q + 2)], heads)


def _second(G: dict, GW: dict, blk: dict, inner: dict, a: int, last: int, q: int, dM: Tensor, balls: list,
            dJs: list, k: int, stages: list, dR: list, heads: tuple | None) -> tuple[Tensor, Tensor | None]:
    """THEORY F69: rows ``(near, far)`` of the layer's second-order term ``(J_q(y) - J_q(x)) D(y)`` on sub-stages
    ``a .. last``, ``D`` the incoming prefix drift with rows ``dM``: split over the sub-stages, and carried across the
    next layer-level stage by ``G`` (``None`` where there is none).  ``heads = (dZ, through)`` (optional): the post-LN
    attention's heads' drift rows and their view through the layer's token-local product at x (F44g)."""
    span = range(a, last + 1)
    u = second_order_rows(dM, [dJs[t][k] for t in span], [None] + [inner[t] for t in range(a + 1, last + 1)],
                          stages[a].local)
    first = heads_second_order(heads[1], dR[0], dJs[a][k], dM) if heads is not None else None
    near = near_second_order(u, tail_sup([balls[t][k] for t in span], [stages[t].pt for t in span], dR), first)
    if a not in G:
        return near, None
    hw = (GW[a], heads[0] * float(dM.max())) if heads is not None and a in GW else None
    return near, far_second_order([G[t] for t in range(a, last)], u, dR, blk[(q + 1, q + 2)], hw)


def _nan_inf(t: Tensor) -> Tensor:
    return torch.nan_to_num(t, nan=math.inf, posinf=math.inf)


def _group_ball(stages: list[_Stage], a: int, b: int, mL: Tensor, balls: list, dJs: list) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A layer's rows on the ball (THEORY F33 item 3): with ``J_L = M (I + A)``, ``M`` the token-local
    sub-stages' product, ``||M_i(y) - M_i(x)|| <= dM_i = sum_m (prod_{t>m} B_t,i) dJ_m,i (prod_{t<m} pt_t,i)``,
    ``nu_i(J_L(y)) <= (m_i + dM_i) B_a,i`` and ``nu_i(J_L(y) - J_L(x)) <= dM_i B_a,i + m_i dJ_a,i``; also
    ``sup ||M_i(y)|| <= min(m_i + dM_i, prod_{t>a} B_t,i)`` (THEORY F40f); returns ``(B_L, dJ_L, sup ||M(y)||, dM)``."""
    dM = torch.zeros_like(mL)
    for m in range(a + 1, b):
        left = math.prod((balls[t] for t in range(m + 1, b)), start=torch.ones_like(mL))
        right = math.prod((stages[t].pt for t in range(a + 1, m)), start=torch.ones_like(mL))
        dM = dM + left * dJs[m] * right
    dM = _nan_inf(dM)
    full = math.prod((balls[t] for t in range(a + 1, b)), start=torch.ones_like(mL))
    Mball = _nan_inf(torch.minimum((mL + dM), full)) * (1 + 1e-12)
    BL = _nan_inf(Mball * balls[a])
    dJL = _nan_inf(dM * balls[a] + mL * dJs[a])
    return BL * (1 + 1e-12), dJL * (1 + 1e-12), Mball, dM


# Note [per-layer refusals].  The per-layer route (``layer_jacobians``) says that it does not apply to a
# layer at this point and radius by raising ``InputError`` (its own refusals, e.g. a radius into the
# pre-LN attention that overflows float64 or a visible softmax weight that underflows) or
# ``torch.linalg.LinAlgError`` (an eigensolver given a Gram that overflowed).  There the layer route has
# no bound (inf rows) and the reason is recorded (``StackLocal.refusals``); any other exception is a bug
# and propagates.  The sub-stage route's attention bounds do the same with a ``LinAlgError`` (their
# ``_Stage.refusals``, collected into the same list).
PER_LAYER_REFUSALS = (InputError, torch.linalg.LinAlgError)


@dataclass
class _LayerMemo:
    """The per-layer route's results at one data point, per (layer index, radius list), and the refusals
    met there (Note [per-layer refusals]), one line each."""

    rows: dict = field(default_factory=dict)
    refusals: list = field(default_factory=list)


@dataclass(frozen=True)
class _LayerRows:
    """The per-layer route at one radius: its ``drift`` rows and ball rows (``ball``, sup nu_i(J_L)), its certified
    per-token stage radii ``stage`` (``LayerJacobian.stage_radii``, THEORY F59a) and remainders ``rem``
    (``LayerJacobian.stage_remainders``, F59b); ``{}`` where it gave none."""

    drift: Tensor
    ball: Tensor
    stage: dict = field(default_factory=dict)
    rem: dict = field(default_factory=dict)


def _per_layer(layer, x: Tensor, rs: list[float], norms: dict, memo: _LayerMemo) -> list[_LayerRows]:  # noqa: ANN001
    """Per radius ``r`` the per-layer route's rows on ``B(x, r)`` (``layer_jacobians``, THEORY F17,
    F31): ``(drift rows, sup nu_i(J_L) rows)`` with the stage radii (``_LayerRows``), inf where ``r`` is not
    finite or the route refuses (Note [per-layer refusals]).  ``memo`` (one per data point ``x``): the results
    per layer and radius list; the same list is evaluated once (a list, not a radius: F37b lets the larger balls of one call
    refine the smaller ones, so a radius's rows depend on the list it came in)."""
    key = (layer.index, tuple(rs))
    if key not in memo.rows:
        memo.rows[key] = _per_layer_rows(layer, x, rs, norms, memo.refusals)
    return memo.rows[key]


def _per_layer_rows(layer, x: Tensor, rs: list[float], norms: dict,  # noqa: ANN001
                    refusals: list | None = None) -> list[_LayerRows]:
    """``_per_layer`` without the memo; a refusal's reason is appended to ``refusals``.  Only the finite
    radii are evaluated (the others' rows are inf): ``layer_rows`` takes the balls from the largest down
    and lets a larger one refine the smaller (F37b), so leaving out what would sit last changes no other
    radius's rows."""
    from ._local_jacobian import layer_jacobians

    inf = torch.full((x.shape[0],), math.inf, dtype=torch.float64)
    finite = [r for r in rs if math.isfinite(r)]
    if not finite:
        return [_LayerRows(inf, inf)] * len(rs)
    c = norms[layer.index]
    try:
        ljs = iter(layer_jacobians(layer, x, finite, norms=c["w"], head_norms_=c["h"]))
    except PER_LAYER_REFUSALS as e:
        if refusals is not None:
            radii = ", ".join(f"{r:.3g}" for r in finite)
            refusals.append(f"layer {layer.index} at radii [{radii}]: {type(e).__name__}: {e}")
        return [_LayerRows(inf, inf)] * len(rs)
    rows = lambda lj: _LayerRows(_nan_inf(lj.drift_rows), _nan_inf(lj.total_rows * (1 + ROUNDING_PAD)),  # noqa: E731
                                 lj.stage_radii, lj.stage_remainders)
    return [rows(next(ljs)) if math.isfinite(r) else _LayerRows(inf, inf) for r in rs]


def _stage_caps(spec: TransformerSpec, stages: list[_Stage], groups: dict) -> dict:
    """Sub-stage index -> (its layer's first sub-stage, the per-layer route's stage radius that bounds its
    input's move): in a post-LN layer with two LayerNorms, ``S1`` (the first norm's input) by ``"attention"``, ``H``
    (the FFN's) by ``"norm_attn"``, ``S2`` (the second norm's) by ``"ffn"`` (``_local_stages.post_tail``).  The
    radii of ``S1`` and ``S2`` bound their centred moves, all a LayerNorm stage reads (its floor, drift and ball see
    ``P dx`` only, Note [local norm floor]).  THEORY F59a."""
    out = {}
    for layer in spec.layers:
        a, b, _ = groups[layer.index]
        names = [st.name for st in stages[a:b]]
        nm = f"layer {layer.index}"
        lay = all(n is not None and n.kind is NormKind.LAYERNORM for n in (layer.norm_attn, layer.norm_ffn))
        full = [f"{nm} {x}" for x in ("attention", "norm_attn", "ffn", "norm_ffn")]
        if layer.placement is Placement.POST and lay and names == full:
            out.update({a + 1: (a, "attention"), a + 2: (a, "norm_attn"), a + 3: (a, "ffn")})
    return out


def _hybrid_radius(name: str, rem: dict, first: Tensor, rH: Tensor | None) -> Tensor | None:
    """THEORY F59b: the move of a post-LN layer's sub-stage output ``name`` (``_stage_caps``' names) for every network
    input in the ball as the stack's exact first order plus the per-layer route's remainders on its ball ``B(x_c, r)``:
    ``first >= ||(M_{c->s}(x_c) Delta_c)_i||`` (``rho (nu_i(P_s) + N(M_{c->s}) dP_c)``, ``Delta_c`` the layer input's
    move, within ``r``), plus ``remA`` (``S1``), ``remH`` (``H``), or ``remG`` and the FFN's remainder (``S2``),
    ``min(ffn_fixed, c ||dh||)`` with ``||dh|| <= rh = min(rH, ffn_ball)`` (``rH`` the stack's certified radius of
    ``H``) and ``c`` the smaller of ``dFh`` on the per-layer ball and F17c's ``min(slope rh / 2, cap)`` on ``rh``'s.
    None where the per-layer route gave no remainders (pre-LN, refused)."""
    if name not in rem:
        return None
    out = first + rem[name]
    if name == "ffn":
        out = out + _ffn_rest(rem, rH)
    return _nan_inf(out)


def _ffn_rest(rem: dict, rH: Tensor) -> Tensor:
    """THEORY F59b: the FFN's own centred Taylor rest ``||P(F(h + dh) - F(h) - F'(h) dh)_i||`` for every move of the
    FFN's input within ``rH`` (the stack's certified radius of ``H``) and the per-layer ball ``ffn_ball``:
    ``min(ffn_fixed, c ||dh||)``, ``c`` the smaller of ``dFh`` and F17c's ``min(slope rh / 2, cap)``."""
    rh = torch.minimum(rH, rem["ffn_ball"])
    glob = torch.where(rh == 0, 0.0, torch.minimum(rem["ffn_slope"] * rh / 2, torch.full_like(rh, rem["ffn_cap"])))
    return torch.minimum(rem["ffn_fixed"], torch.minimum(rem["ffn_coef"], glob) * rh)


def _next_cut(pos: dict, a: int, b: int) -> bool:
    """Sub-stages ``a < b`` are consecutive layer-level cuts, ``a`` not the first (THEORY F66's carry reads the product
    of that layer-level stage)."""
    return a in pos and b in pos and pos[b] == pos[a] + 1 and pos[a] > 0


def _move_rest(prods: dict, rests: list[Tensor], s: int, cap: dict, inner: dict, PL: dict, Ecs: dict, radii: list,
               k: int, pad: float, T: int, nus: dict | None = None) -> Tensor:
    """THEORY F73c, F76a item 4: rows ``E_s >= ||e_{s,i}||`` at sub-stage ``s``'s input for the ``k``-th radius: the
    exact products' sum of the earlier stages' rests (``move_rest_rows``) and, at a post-LN layer's inner point, the
    partial layer's own rest in one step from the layer input's ``E_c`` (``layer_rest_rows``: F59b's remainders, the
    FFN's own at ``S2`` on the stack's radius of ``H``, with the centre pad), the smaller."""
    E = move_rest_rows(prods, rests, s, T, nus=nus)
    if s in cap and s in inner:
        c, name = cap[s]
        rem = _hybrid_radius(name, PL[c][k].rem, torch.zeros_like(E), radii[s - 1][k] if name == "ffn" else None)
        if rem is not None:
            nu = nus.get((c, s)) if nus is not None else None  # THEORY F95: the same product's carried rows
            E = torch.minimum(E, layer_rest_rows(*inner[s], Ecs[c][k], rem + pad, nu))
    return E


class _RestAt(NamedTuple):
    """What a stage's direction-aware rests (THEORY F78, F79) read besides its rows, at its input: the radius-free
    forms (F79a's ``NormForms`` of a norm, F78's ``AttnRestData`` of an attention, else None), the stage's
    ``FFNAligned`` and ``AttentionAligned`` (or None), the prefix's rows ``nu``, its rounding ``eP``, the segment
    move rows ``dPm`` per radius and (an attention stage, F86) per radius the move's rest as images (``image_sources``)
    or None, and (F87) per radius the move's rest through every head's Gram factor ``(C, delta)`` or None."""

    forms: object
    al: object
    aa: object
    nu: Tensor
    eP: float
    dPm: list
    img: list | None = None
    hr: list | None = None


def _rest_at(st: _Stage, K: Tensor, al, aa, nu: Tensor, eP: float, dPm: list) -> _RestAt:  # noqa: ANN001
    """THEORY F78, F79: the stage's radius-free rest forms at its input (``K`` the prefix's computed columns)."""
    if isinstance(st.lin, _NormLin):
        forms = norm_move_forms(_col_blocks(K), st.x, st.lin.g, st.lin.lay)
    elif aa is not None:
        forms = attn_rest_data(st.x, aa.p["heads"], aa.p["Wqa"], aa.p["scale"], aa.proj, aa.nQ, aa.nK,
                               aa.p["norms"]["V"], aa.p["mom"])
    else:
        forms = None
    return _RestAt(forms, al, aa, nu, eP, dPm)


def _attention_rest(st: _Stage, at: _RestAt, k: int, rho: float, E: Tensor, r: Tensor, pad: float) -> Tensor:
    """THEORY F78, F81, F84: the attention stage's own Taylor rest, the smallest of F78a/b's exact second derivative with
    F81's score-change variance joint over the keys (``joint_rest_rows``: ``min(F78, F81)`` inside), F78c's ball sups
    under the Taylor weight (``segment_rest_heads``, heads through ``W_O``) and F78d's drift rows on the segment's
    pieces (``piecewise_rest_rows``: the stage's rows, F44e's aligned drift, F44c's reach and F50's joint reach at the
    move scaled by ``t``) and F84's PSD majorant over heads and keys (``psd_rest_rows``, its low-rank part through the
    prefix's blocks, F85; the move's rest as the images of the upstream rests when ``at.img`` holds them, F86, and
    seen through every head's Gram factor when ``at.hr`` holds its reach, F87)."""
    aa, eP = at.aa, at.eP
    rx = joint_rest_rows(at.forms, rho, E, eP, pad)
    if st.x.shape[0] <= PSD_MAX_TOKENS:  # THEORY F84 (its cost grows as T^2 d^3)
        if "F85 keys" not in aa.memo:  # the prefix's forms, formed once for every radius
            aa.memo["F85 keys"] = KeyImages(aa.blocks)
        keys = aa.memo["F85 keys"]
        rx = torch.minimum(rx, psd_rest_rows(at.forms, aa.p["heads"], aa.p["Wqa"], st.x, aa.Qs, aa.eQ, rho, E, eP, pad,
                                                  Bp=keys, images=None if at.img is None else at.img[k],
                                                  heads_rest=None if at.hr is None else at.hr[k]))
    if rho <= 0:
        return rx
    mom, wn = aa.p["mom"], aa.p["norms"]
    hz = segment_rest_heads(lambda t: (aa.sup(t), aa.sup(t, True), hessian_ball_sup(mom, t, wn)), rho,
                            float((E + rho * eP).max()), float((rho * at.nu + E).max()), pad)
    rx = torch.minimum(rx, aa.combined(hz) * (1 + 1e-12))

    def rows_at(t: float) -> tuple[Tensor, Tensor]:
        rt = t * r + 2 * pad
        djt, _, _, hdt = st.bounds(rt)
        img = None if at.hr is None else t * at.hr[k][0]  # THEORY F89: the move's rest scaled with the move
        alt, _ = aa.drift(rt, t * rho, at.dPm[k], eP, pad, hdt, img)
        djt = _nan_inf(djt if alt is None else torch.minimum(djt, alt))
        reach = aa.combined(aa.reach_heads(rt, t * rho, at.dPm[k], eP, pad, img))
        # THEORY F83a: the pieces read the joint's first value only (through W_O), not its view through M
        return torch.minimum(reach, aa.joint(rt, t * rho, at.dPm[k], eP, pad, through=False)[0]), djt

    return torch.minimum(rx, piecewise_rest_rows(rows_at, rho, float(E.max())))


def _stage_rest(st: _Stage, s: int, rho: float, reach: Tensor, dj: Tensor, E: Tensor, r: Tensor, pad: float,
                cap: dict, PL: dict, k: int, at: _RestAt) -> Tensor:
    """THEORY F73c, F76a, F78, F79: rows ``>= ||R_{s,i}||`` of sub-stage ``s``'s own Taylor rest for the ``k``-th
    radius, one function per stage kind, each the smaller of F73c/F76a's rows and the direction-aware ones: a norm
    (``norm_rest_rows``; F79b's curvature through the centred prefix ellipsoid), an attention (``attention_rest_rows``
    with F59b's ``remA`` of a post-LN layer with two LayerNorms; F78), an FFN (``ffn_rest_rows``, the FFN's own rest
    there; F79c through F40b's forms), else F73c's (``stage_rest_rows``).  ``reach``, ``dj``, ``r``: the stage's reach,
    drift rows and radius; ``E`` its input's move rest rows; ``at`` the stage's ``_RestAt``."""
    Ep = E + rho * at.eP  # the move outside the computed prefix's rows (F79's free part)
    if isinstance(st.lin, _NormLin):
        R = norm_rest_rows(rho, reach, dj, E, r)
        return torch.minimum(R, f79_norm_rows(at.forms, float(st.lin.norm.eps), rho, Ep, r, pad))
    if st.attn is not None:
        remA = PL[s][k].rem.get("attention") if s + 1 in cap else None
        R = attention_rest_rows(rho, reach, dj, E, remA, pad)
        return R if at.aa is None else torch.minimum(R, _attention_rest(st, at, k, rho, E, r, pad))
    if st.ffn is not None:
        rem = PL[cap[s][0]][k].rem if s in cap and cap[s][1] == "norm_attn" else {}
        R = ffn_rest_rows(rho, reach, dj, E, _ffn_rest(rem, r) if "ffn_coef" in rem else None, pad)
        return R if at.al is None else torch.minimum(R, f79_ffn_rows(at.al, rho, Ep, r, pad))
    return stage_rest_rows(rho, reach, dj, E, st.local)


def _layer_route(spec: TransformerSpec, stages: list[_Stage], groups: dict, nuP: list, suf: list,  # noqa: PLR0912
                 radii: list, rhos: list, norms: dict, mid: dict, blk: dict, memo: _LayerMemo,
                 reach0: list, pads: list) -> list[tuple[float, float]]:
    """The telescoped drift over whole layers (THEORY F30 item 5): per layer the per-layer route's
    drift and ball rows (``layer_jacobians``) at the smallest of F30's radius recursion, the
    middle-product one (F36, ``mid`` and ``blk`` the rows and block norms of the middle products at
    X) and the sub-stage radius, with the exact prefix and suffix norms at the layer's ends; per rho ``(drift, product)``,
    the drift the smaller of F30's sum and F36's.  Kept beside the sub-stage telescoping (F33), the
    smaller is used: the sub-stages are first-order exact, a layer's joint bound is tighter on its
    second-order part.  ``reach0``: per rho the prefix spans' ``v_{0,m}`` of the sub-stage recursion (THEORY
    F40d; a bound on the true quantity over the ball, so valid beside this route's own rows); ``pads``: per sub-stage the
    centre pad (THEORY F64)."""
    items = []  # (first sub-stage, last sub-stage, layer or None)
    byfirst = {a: (b, idx) for idx, (a, b, _) in groups.items()}
    s = 0
    while s < len(stages):
        if s in byfirst:
            b, idx = byfirst[s]
            items.append((s, b - 1, next(ly for ly in spec.layers if ly.index == idx)))
            s = b
        else:
            items.append((s, s, None))
            s += 1
    nr = len(rhos)
    dP, prod = [0.0] * nr, [1.0] * nr
    dj_it, ball_it = [], []
    rows_it: list[list[Tensor]] = [[] for _ in rhos]  # per rho, each item's drift rows (F36)
    loc = [layer is None and stages[a].local for a, _, layer in items]
    for j, (a, e, layer) in enumerate(items):
        P = float(nuP[a].max())
        dM = [float(middle_drift_column(mid, rows_it[k], loc, j, blk, reach0[k])[0].max()) if j else 0.0 for k in range(nr)]
        rs = [min(rho * (P + min(dP[k], dM[k])), rho * prod[k]) * (1 + 1e-12) + pads[a] for k, rho in enumerate(rhos)]
        rs = [min(r, float(radii[a][k].max())) for k, r in enumerate(rs)]
        if layer is None:
            out = [stages[a].bounds(torch.full_like(nuP[a], r if math.isfinite(r) else math.inf)) for r in rs]
            djr = [_nan_inf(o[0]) for o in out]
            ba = [float(_nan_inf(o[2]).max()) for o in out]
        else:
            pl = _per_layer(layer, stages[a].x, rs, norms, memo)
            djr, ba = [v.drift for v in pl], [float(v.ball.max()) for v in pl]
        for k in range(nr):
            rows_it[k].append(djr[k])
        dj = [float(v.max()) for v in djr]
        dj = [v if math.isfinite(v) else math.inf for v in dj]
        ba = [v if math.isfinite(v) else math.inf for v in ba]
        for k in range(nr):
            dP[k] = (ba[k] * dP[k] if dP[k] > 0 else 0.0) + dj[k] * P
            prod[k] *= ba[k]
        dj_it.append(dj)
        ball_it.append(ba)
    res = []
    for k in range(nr):
        dS, drift = 0.0, 0.0
        for j in range(len(items) - 1, -1, -1):
            a, e, _ = items[j]
            S = suf[e]
            sbar = min(S + dS, math.prod(ball_it[m][k] for m in range(j + 1, len(items))))
            drift += sbar * dj_it[j][k] * float(nuP[a].max()) if dj_it[j][k] > 0 else 0.0
            dS = (dS * ball_it[j][k] if dS > 0 else 0.0) + S * dj_it[j][k]
        drift = min(drift if math.isfinite(drift) else math.inf,
                    float(middle_drift_column(mid, rows_it[k], loc, len(items), blk, reach0[k])[0].max()))
        res.append((drift, math.prod(b[k] for b in ball_it)))
    return res


def stack_local(spec: TransformerSpec, X: Tensor, rhos, *, exact: int = 8, chain_exact: int | None = None,  # noqa: ANN001, PLR0915, PLR0912
                norms: dict | None = None, keep_jacobian: bool = False, layer_route: bool = True,
                centre: str = "f17", segment: bool = True, aux: tuple[float, ...] = (),
                move_rest: bool = MOVE_REST) -> list[StackLocal]:
    r"""Certified local constant of the whole stack on ``B(X, rho)`` for each ``rho`` (X: embedded tokens
    before the input norm), by the exact Jacobian at X and its telescoped drift over the sub-stages
    (Notes [stack Jacobian], [stack drift], [stack rounding]; THEORY F30, F33), beside the product of
    the ball constants.

    .. math:: \mathrm{Lip}_{B(X,\rho)} \le \min\Big(\max_i \sum_j \|J_{ij}(X)\|_2 + \varepsilon_{\mathrm{fl}}
              + \max_i \sum_s \big[\bar N(S_s)\, (\Delta J_s \odot w_s)\big]_i,\ \prod_s B_s(r_s)\Big)

    with per-token radii ``r_{s,i} = rho (nu_i(P_s(X)) + dP_{s,i})`` and ``w_{s,k} = nu_k(P_s)`` (token-local
    stage) or ``||P_s||``, the remainders also by exact middle products.  Source: THEORY F17, F30, F33,
    F36.  Assumptions: every embedded token within ``rho``
    (l2) of X; the stages are input norm, sequential layers with dot attention (no RoPE, window,
    soft-cap or q/k norm) and a non-gated FFN, final norm; float64.  ``exact``: blocks per row certified
    by ``certified_spectral`` for J itself, ``chain_exact`` for every product of the chains (None: every block, THEORY F94, F95).  ``norms``: a
    dict that caches the data-free constants per layer (pass the same one for every sentence).
    ``layer_route``: also telescope over whole layers with the per-layer route (``_layer_route``) and
    keep the smaller drift and product, and take the smaller of each layer's drift rows and the
    per-layer route's in the middle-product recursion (F36 item 3).  ``centre``: the pad in every radius for the
    computed centre's error ``||xhat_s - x_s(X)||``: ``"f17"`` F17's ``1e-13 max||xhat_s||`` (assumed, not derived;
    beaten by tokens whose mean dwarfs their spread), ``"f64"`` the larger of it and THEORY F64's certified recursion
    (``_local_centre``; on MiniLM astronomically larger, so not the default); ``"f64"`` turns the per-layer route off
    (``layer_route``), whose own stage radii inside a layer carry F17's pad.  ``segment``: every bound of a sub-stage
    input's *move* (its radius, F44/F40c/F62's part outside the prefix's rows, F59b's first order) reads the prefix drift
    averaged along the segment over the run's radii up to its own (THEORY F71, ``segment_moves``; the drift of a
    Jacobian at a point keeps the sup); ``aux``: fractions of the largest radius added as radii of the run whose results
    are not returned (THEORY F71c: they only refine the larger radii's averages; ``SEGMENT_AUX`` is the benchmark's).
    ``move_rest``: the same bounds of a move also read the move's part outside the prefix's rows by its own linear
    recursion at the data, ``e_s = sum_m M_{m+1 -> s}(x) R_m`` (THEORY F73c, F76a, F77, ``_local_stack_move``): exact
    products of the sub-stages from every start (which also give F36/F40e's middle products) and each stage's own
    Taylor rest rows, the smaller kept (``MOVE_REST`` is the default).
    """
    from ._local import check_rho

    rhos = [check_rho(r) for r in (rhos if isinstance(rhos, (list, tuple)) else [rhos])]
    if centre not in ("f17", "f64"):
        raise InputError(f"centre must be 'f17' or 'f64', not {centre!r}")
    layer_route = layer_route and centre == "f17"
    rhos, keep = with_auxiliary(rhos, aux if segment else ())
    t0, c0 = time.perf_counter(), time.process_time()
    X = X.detach().double()
    T, d = X.shape
    chain_exact = T if chain_exact is None else chain_exact
    norms = {} if norms is None else norms
    stages, _, groups = _stages(spec, X, norms)
    eye = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
    # Note [middle products]: rows of every product of consecutive layer-level stages at X (THEORY F36)
    cuts = layer_cuts(len(stages), groups)
    pos = {c: q for q, c in enumerate(cuts)}
    G: dict = {}  # THEORY F66: sub-stage -> the exact product to the end of the next layer-level stage
    GW: dict = {}  # THEORY F66: a layer's attention -> that product's heads' blocks through W_O

    def carry(a: int, K: Tensor, e: float) -> None:
        blocks, heads = carry_blocks(stages, cuts, {c for c, _, _ in groups.values()},
                                     lambda C: certified_block_norms(_row_blocks(C), chain_exact), a, K, e)
        G.update(blocks)
        GW.update(heads)

    norms_of = lambda K: certified_block_norms(_col_blocks(K), chain_exact)  # noqa: E731
    if move_rest:  # THEORY F73c, F77: the chains from every sub-stage start, the cuts' among them
        factors: dict = {}  # THEORY F87: an attention stage -> its heads' Gram factors
        hprods: dict = {}  # THEORY F87: (a, s) -> the product's blocks through those factors
        nus: dict = {}  # THEORY F95: (a, s) -> the product's certified unit rows (weighted row Gram)

        def on_product(a: int, b: int, K: Tensor, e: float) -> None:
            if _next_cut(pos, a, b):
                carry(pos[a], K, e)
            if 0 < a and b < len(stages) and stages[b].attn is not None and T <= PSD_MAX_TOKENS:  # F86's stages
                if b not in factors:
                    factors[b] = gram_factors(stages[b].attn["heads"], values=True)
                hprods[(a, b)] = head_block_norms(factors[b][0], K)

        rows_of = (lambda K: block_norms_and_rows(_col_blocks(K))) if CARRY_ROWS and T <= chain_exact else None
        prods = substage_products(stages, norms_of, lambda st, K: _local_error(st, K, cols=True),
                                  lambda st, K: _chunked(st.lin.apply, K), on_product, cuts[1], rows_of, nus)
        mid, blk, first_rows, inner = middle_of_products(prods, cuts)
    else:
        prods = None
        mid, blk, first_rows, inner = middle_rows(stages, cuts, norms_of, on_next=carry)
    nuL = {}  # layer -> (T,) certified nu_i(J_L(X)) from the layer's own blocks
    for a, b, _ in groups.values():  # the attention sub-stage's and the whole layer's rows at X
        stages[a].pt = torch.minimum(stages[a].pt, first_rows[a])
        nuL[a] = mid[(pos[a], pos[b])]
    first = {a: (b, mL) for a, b, mL in groups.values()}
    loc = [cuts[q] not in first and stages[cuts[q]].local for q in range(len(cuts) - 1)]
    dJq: list[list[Tensor]] = [[] for _ in rhos]  # per rho, each layer-level stage's drift rows
    reach0: list[list[Tensor]] = [[] for _ in rhos]  # per rho, each layer-level stage's v_{0,m} (THEORY F40d)
    carry0: list[dict] = [{} for _ in rhos]  # per rho, layer-level stage -> its carried first order (THEORY F66)
    second0: list[dict] = [{} for _ in rhos]  # per rho, layer-level stage -> its split second-order rows (THEORY F69)
    reach_at: list[dict] = [{} for _ in rhos]  # per rho, sub-stage -> its reach rows nu_k(dJ_s P_s(x))
    heads_at: list[dict] = [{} for _ in rhos]  # per rho, attention sub-stage -> its heads' reach rows before W_O
    hdz: list[dict] = [{} for _ in rhos]  # per rho, attention sub-stage -> (heads' drift rows, their F44g view)
    w0 = [torch.zeros(T, dtype=torch.float64) for _ in rhos]  # the running v_{0,m} inside a layer
    wm = [torch.zeros(T, dtype=torch.float64) for _ in rhos]  # the running drift rows of the partial layer product
    w0L = [torch.zeros(T, dtype=torch.float64) for _ in rhos]  # the running v_{0,m} of a layer's token-local part
    wmL = [torch.zeros(T, dtype=torch.float64) for _ in rhos]  # the running drift rows of that part (THEORY F40g)
    ratt: list = [None] * len(rhos)  # the attention sub-stage's reach of the current layer (THEORY F40f)
    hatt: list = [None] * len(rhos)  # the same, per head through the layer's token-local product at x (THEORY F44g)
    spans: list[dict] = [{} for _ in rhos]  # per rho, (a, b) -> rows of sup nu_i(M_{a,b}(y) - M_{a,b}(x))
    reaches: list[dict] = [{} for _ in rhos]  # per rho, stage -> (max_k dJ_k nu_k, max_k v_k with F40/F44)
    layer_at = {groups[ly.index][0]: ly for ly in spec.layers}
    PL: dict = {}  # layer start -> per rho the per-layer route's (drift rows, ball rows)
    cap = _stage_caps(spec, stages, groups)
    memo = _LayerMemo()  # the per-layer route's results at this X (``_per_layer``), shared with ``_layer_route``
    last = {b - 1: (a, mL) for a, b, mL in groups.values()}
    pL = {a: min(float((mL * stages[a].pt).max()) * (1 + 1e-12), float(nuL[a].max())) for a, b, mL in groups.values()}
    n, nr = len(stages), len(rhos)
    # -- forward: prefixes P_s (certified rows with their rounding), per-token radii, stage bounds -----
    K = eye.clone()
    rows = torch.ones(T, dtype=torch.float64)  # P_0 = I
    eP, e_loc, nuP = [0.0], [], []
    ecent, pads = 0.0, []  # THEORY F64: the running bound on the computed centre's error, the pad of each stage
    dP = [torch.zeros(T, dtype=torch.float64) for _ in rhos]
    rc = [torch.full((T,), rho, dtype=torch.float64) for rho in rhos]  # composition radii (product route)
    at: dict = {}
    atm: dict = {}  # THEORY F71: a layer's first sub-stage -> per rho the segment-averaged move rows at its input
    radii, dJs, dJcs, balls = [], [], [], []
    rests: list[list[Tensor]] = [[] for _ in rhos]  # THEORY F73c: per rho, each sub-stage's Taylor rest rows
    Eall: list[list[Tensor]] = []  # THEORY F86: per sub-stage, per rho the rows E at its input
    Ecs: dict = {}  # THEORY F76a item 4: a layer's first sub-stage -> per rho the rows E at its input
    GB: dict = {}  # group start -> per rho (B_L, dJ_L)
    hx: dict = {}  # stage -> per rho the attention's head drift rows (or None)
    for s, st in enumerate(stages):
        nu = rows + eP[s]
        nuP.append(nu)
        normP = float(nu.max())
        if s in pos and s > 0:  # the prefix's drift by exact middle products (THEORY F36 item 3)
            mid[(0, pos[s])] = torch.minimum(mid[(0, pos[s])], nu) if (0, pos[s]) in mid else nu
            for k in range(nr):
                col = middle_drift_column(mid, dJq[k], loc, pos[s], blk, reach0[k], spans[k], carry0[k], second0[k])
                spans[k].update({(a, pos[s]): v for a, v in enumerate(col[:-1])})
                dP[k] = torch.minimum(dP[k], col[0])
        if s in first:
            at[s] = ([v.clone() for v in dP], [v.clone() for v in rc], normP)
        if s in inner:  # THEORY F40e: inside a layer, the prefix drift by the exact partial product at x
            c = max(a for a in first if a < s)
            N, e = inner[s]
            for k in range(nr):
                dPc = at[c][0][k]
                alt = N @ dPc + (e + wm[k]) * float(dPc.max()) + w0[k]
                dP[k] = torch.minimum(dP[k], _nan_inf(alt))
        # THEORY F71: the move's part outside the prefix's rows at X, averaged along the segment over the run's radii
        dPm = segment_moves(dP, rhos) if segment else dP
        # THEORY F64: the centre pad for ||xhat_s - x_s(X)||, F17's 1e-13 max||xhat_s|| or (``centre="f64"``) the
        # recursion's certified e_s when larger
        pad = max(f17_pad(st.x), ecent)
        pads.append(pad)
        if prods is not None:  # THEORY F73c: the same part by its own recursion at x, the smaller kept
            Es = [_move_rest(prods, rests[k], s, cap, inner, PL, Ecs, radii, k, pad, T, nus)
                  for k in range(nr)]
            Eall.append(Es)
            if s in first:
                Ecs[s] = Es
            dPm = [torch.minimum(m, E / rho * (1 + 1e-12)) for m, E, rho in zip(dPm, Es, rhos)]
        if s in first:
            atm[s] = [v.clone() for v in dPm]
        mrow = rows_of_block_norms(inner[s][0]) + inner[s][1] if s in inner else torch.ones(T, dtype=torch.float64)
        # THEORY F40: a post-LN FFN's first-order drift through the prefix's own reachable rows
        al = FFNAligned(st.ffn, st.x, _col_blocks(K), norms[st.group]["w"]) \
            if st.ffn is not None and FFNAligned.applies(st.ffn) else None
        # THEORY F44: a post-LN attention's first-order drift through the same ellipsoids
        aa = AttentionAligned(st.attn, _col_blocks(K)) if st.attn is not None else None
        # THEORY F78, F79: the stage's direction-aware rest forms (the move's rest recursion only)
        rat = _rest_at(st, K, al, aa, nu, eP[s], dPm) if prods is not None else None
        if rat is not None and aa is not None and 0 < s and T <= PSD_MAX_TOKENS:  # THEORY F86: the rest as images
            pulled = pull_rows(stages, s, form_rows(aa.p["heads"], aa.p["scale"]), prods,
                               lambda st_, G: _chunked(st_.lin.apply_t, G), _row_errors)
            keys = {a: KeyImages.pulled(G, g, len(aa.p["heads"])) for a, (G, g) in pulled.items()}
            a0 = min(keys, default=s)
            rat = rat._replace(img=[image_sources(rests[k], Eall[a0][k], a0, s, keys.get) for k in range(nr)])
            # THEORY F87: the same rest through every head's Gram factor
            _, dl, fn = factors.pop(s) if s in factors else gram_factors(aa.p["heads"], values=True)
            rat = rat._replace(hr=[(move_rest_rows(prods, rests[k], s, T, hprods, fn), dl) for k in range(nr)])
        rs, djs, djcs, bs = [], [], [], []
        for k, rho in enumerate(rhos):
            r = torch.minimum(rho * (nu + dPm[k]), rc[k]) * (1 + 1e-12) + pad
            if s in cap and cap[s][1] in PL[cap[s][0]][k].stage:  # THEORY F59a: the per-layer route's stage radius
                r = torch.minimum(r, _nan_inf(PL[cap[s][0]][k].stage[cap[s][1]]) * (1 + 1e-12) + pad)
            if s in cap and s in inner:  # THEORY F59b: exact first order + the per-layer remainders
                N, e = inner[s]
                dPc = atm[cap[s][0]][k]
                hyb = _hybrid_radius(cap[s][1], PL[cap[s][0]][k].rem, rho * (nu + N @ dPc + e * float(dPc.max())),
                                     radii[s - 1][k] if cap[s][1] == "ffn" else None)
                if hyb is not None:
                    r = torch.minimum(r, hyb * (1 + 1e-12) + pad)
            dj, djc, b, hd = st.bounds(r)
            img = rat.hr[k][0] if rat is not None and rat.hr is not None else None  # THEORY F89
            # THEORY F44e, F44f: the drift rows for moves along the prefix's rows (attention, FFN)
            alt, hd = aa.drift(r, rho, dPm[k], eP[s], pad, hd, img) if aa is not None else (None, hd)
            alt = al.drift(r, rho, dPm[k], eP[s], pad) if al is not None else alt
            if alt is not None:
                dj, djc = torch.minimum(dj, alt), torch.minimum(djc, alt)
            dj, djc, b = _nan_inf(dj), _nan_inf(djc), _nan_inf(torch.minimum(b, st.pt + dj))
            hx.setdefault(s, []).append(hd)
            rs.append(r)
            djs.append(dj)
            djcs.append(djc)
            bs.append(b)
            # Note [stack drift], radii: P_{s+1}(y) - P_{s+1}(x) = J_s(y)(P_s(y) - P_s(x)) + dJ_s P_s(x), per row
            reach = _nan_inf(dj * nu if st.local else dj * normP)  # nu_k(dJ_s P_s(x))
            plain = float(reach.max())
            if al is not None:
                reach = torch.minimum(reach, al.reach(r, nu, rho, dPm[k], eP[s], pad))
            if aa is not None:
                rh = aa.reach_heads(r, rho, dPm[k], eP[s], pad, img)  # (H, T), before W_O
                heads_at[k][s] = rh
                reach = torch.minimum(reach, aa.combined(rh))
                jr, jrM = aa.joint(r, rho, dPm[k], eP[s], pad)  # THEORY F50: one direction for all heads
                reach = torch.minimum(reach, jr)
            reaches[k][st.name] = (plain, float(reach.max()))
            reach_at[k][s] = reach
            move = b * dP[k] if st.local else b * float(dP[k].max())
            dP[k] = _nan_inf(torch.where(dP[k] == 0, 0.0, move) + reach)
            # THEORY F40d: v_{0,m} of the layer-level stage, telescoped over its sub-stages from zero
            w = torch.zeros_like(reach) if s in pos else w0[k]
            w0[k] = _nan_inf(torch.where(w == 0, 0.0, b * w if st.local else b * float(w.max())) + reach)
            w = torch.zeros_like(reach) if s in pos else wm[k]  # nu_k(M_{c,s+1}(y) - M_{c,s+1}(x))
            wm[k] = _nan_inf(torch.where(w == 0, 0.0, b * w if st.local else b * float(w.max()))
                             + dj * (mrow if st.local else float(mrow.max())))
            if s in first:  # the layer's attention: its reach seen through the exact token-local product (F40f)
                ratt[k], w0L[k], wmL[k] = reach, torch.zeros_like(reach), torch.zeros_like(reach)
                hatt[k] = aa.through(rh) if aa is not None else None
                if hatt[k] is not None and hx[s][k] is not None:  # THEORY F69: the heads' drift through M(x) W_O^hT
                    hdz[k][s] = (hx[s][k][0], aa.through(hx[s][k][0]))
                if hatt[k] is not None and jrM is not None:
                    hatt[k] = torch.minimum(hatt[k], jrM)
            else:
                w0L[k] = _nan_inf(torch.where(w0L[k] == 0, 0.0, b * w0L[k]) + reach)
                wmL[k] = _nan_inf(torch.where(wmL[k] == 0, 0.0, b * wmL[k]) + dj * mrow)
            rc[k] = _nan_inf(b * (r if st.local else float(r.max())))
        if centre == "f64" and s + 1 < n:  # THEORY F64: e_{s+1} = loc_s + B_s e_s, B_s on a ball of radius r >= pad >= e_s
            own = stage_forward_error(st, layer_at.get(s))  # F17's 1e-13 max||xhat_{s+1}|| where none is derived
            own = f17_pad(stages[s + 1].x) if own is None else own
            ecent = centre_errors([own], [min(float(b.max()) for b in bs)], ecent)[-1]
        if s in first:  # the per-layer route at the layer's input radius (F36 item 3: the smaller drift)
            rmax = [float(r.max()) if layer_route else math.inf for r in rs]
            PL[s] = _per_layer(layer_at[s], st.x, rmax, norms, memo)
        if prods is not None:  # THEORY F73c, F76a: the stage's own Taylor rest rows, by its kind
            for k, rho in enumerate(rhos):
                rests[k].append(_stage_rest(st, s, rho, reach_at[k][s], djs[k], Es[k], rs[k], pad, cap, PL, k,
                                                rat))
        radii.append(rs)
        dJs.append(djs)
        dJcs.append(djcs)
        balls.append(bs)
        if s in last:  # a whole layer: the same recursions with the layer's own rows (F33 item 3)
            a, mL = last[s]
            dPa, rca, nPa = at[a]
            GB[a] = []
            for k in range(nr):
                BL, dJL, Mb, dMk = _group_ball(stages, a, s + 1, mL, [balls[t][k] for t in range(len(balls))], [dJs[t][k] for t in range(len(dJs))])
                w0[k] = torch.minimum(w0[k], _nan_inf(Mb * ratt[k] + w0L[k]) * (1 + 1e-12))
                if hatt[k] is not None:  # THEORY F44g: the heads' reach through M(x) W_O^hT, M's drift on the rest
                    w0[k] = torch.minimum(w0[k], _nan_inf(hatt[k] + dMk * ratt[k] + w0L[k]) * (1 + 1e-12))
                dJL = torch.minimum(dJL, PL[a][k].drift)
                # THEORY F40g: the layer's drift rows by the exact partial products at x (wm), or with the
                # attention's drift through the token-local product
                dJL = torch.minimum(dJL, torch.minimum(wm[k], _nan_inf(Mb * dJs[a][k] + wmL[k])) * (1 + 1e-12))
                BL = torch.minimum(torch.minimum(BL, _nan_inf(nuL[a] + dJL)), PL[a][k].ball)
                GB[a].append((BL, dJL))
                # THEORY F66: the layer's first order carried across the next layer-level stage by exact products
                if all(stages[t].local for t in range(a + 1, s + 1)):
                    dR = _tail(a, s, balls, dJs, k, stages)
                    if a in G:
                        heads = (GW[a], heads_at[k][a]) if a in GW and a in heads_at[k] else None
                        carry0[k][pos[a]] = _carry(G, blk, a, s, pos[a], reach_at[k], dR, heads)
                    if (0, pos[a]) in spans[k]:  # THEORY F69: the second-order term over the sub-stages
                        second0[k][pos[a]] = _second(G, GW, blk, inner, a, s, pos[a], spans[k][(0, pos[a])], balls,
                                                     dJs, k, stages, dR, hdz[k].get(a))
                alt = _nan_inf(torch.where(dPa[k] == 0, 0.0, BL * float(dPa[k].max())) + dJL * nPa)
                dP[k] = torch.minimum(dP[k], alt)
                rc[k] = torch.minimum(rc[k], _nan_inf(BL * float(rca[k].max())))
        if s + 1 in pos:  # a layer-level stage ends: its drift rows (the whole layer's, F33 item 3)
            for k in range(nr):
                dJq[k].append(GB[last[s][0]][k][1] if s in last else dJs[s][k])
                reach0[k].append(w0[k])
        e_loc.append(_local_error(st, K, cols=True))
        K = _chunked(st.lin.apply, K)
        Kb = _col_blocks(K)
        Nb = certified_block_norms(Kb, exact if s == n - 1 else chain_exact)
        # THEORY F93: each row's (2,inf) norm by the weighted row Gram, never above the blocks' triangle
        rows = rows_of_block_norms(Nb)
        if GRAM_ROWS:
            rows = torch.minimum(rows, gram_rows(Kb, Nb))
        e_next = eP[s] * st.p + e_loc[s]
        if s in last:  # carry the errors by the layer's own constant
            a, _ = last[s]
            alt = eP[a] * pL[a] + sum(e_loc[m] * math.prod(stages[t].p for t in range(m + 1, s + 1)) for m in range(a, s + 1))
            e_next = min(e_next, alt)
        if prods is not None:  # THEORY F88: the same errors carried by the exact products at the data
            e_next = min(e_next, carried_error(prods, e_loc, 0, s + 1))
        else:  # THEORY F88 with the layer-level products only
            e_next = min(e_next, cut_carried_error(stages, cuts, mid, inner, e_loc, 0, s + 1))
        eP.append(e_next)
    kept = _col_blocks(K).contiguous() if keep_jacobian else None
    del K
    # -- backward: suffixes S_s = J_{n-1} ... J_{s+1}, certified block norms ---------------------------
    Nmat: list[Tensor] = [torch.eye(T, dtype=torch.float64)] * n
    eS = [0.0] * n
    f_loc = [0.0] * n
    SW: dict = {}  # attention stage -> (T, T, H) certified ||Shat_s,ik W_O^hT||
    C = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
    for s in range(n - 1, 0, -1):
        f_loc[s] = _local_error(stages[s], C, cols=False)
        C = _chunked(stages[s].lin.apply_t, C)  # rows of S_{s-1} = S_s J_s
        Nmat[s - 1] = certified_block_norms(_row_blocks(C), chain_exact)
        if s - 1 in first:
            SW[s - 1] = _suffix_heads(C, stages[s - 1].lin.att)
        e_prev = eS[s] * stages[s].p + f_loc[s]
        if s in first:  # a layer's first sub-stage: S_{a-1} = S_{b-1} J_L
            b, _ = first[s]
            alt = eS[b - 1] * pL[s] + sum(f_loc[m] * math.prod(stages[t].p for t in range(s, m)) for m in range(s, b))
            e_prev = min(e_prev, alt)
        eS[s - 1] = e_prev
    del C
    mid[(0, len(cuts) - 1)] = rows + eP[n]
    middle = [middle_drift_column(mid, dJq[k], loc, len(cuts) - 1, blk, reach0[k], spans[k], carry0[k], second0[k])
              for k in range(nr)]
    for k in range(nr):
        spans[k].update({(a, len(cuts) - 1): v for a, v in enumerate(middle[k][:-1])})
    suf = [float(N.sum(dim=1).max()) * (1 + T * _U) + e for N, e in zip(Nmat, eS)]
    # Note [stack rounding]: fl(J) - J = sum_m S_m E_m exactly, so the suffixes carry the stage errors
    e_J = min(eP[n], sum(sm * em for sm, em in zip(suf, e_loc)) * (1 + 1e-12))
    point = float(rows.max()) + e_J
    coarse = _layer_route(spec, stages, groups, nuP, suf, radii, rhos, norms, mid, blk, memo, reach0, pads) if layer_route else [(math.inf, math.inf)] * nr
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = []
    for k, rho in enumerate(rhos):
        bmax = [float(balls[s][k].max()) for s in range(n)]
        after = [1.0] * (n + 1)  # after[s + 1] >= sup ||S_s(y)||; after[0] the product route
        for s in range(n - 1, -1, -1):
            after[s] = after[s + 1] * bmax[s]
            if s in first:
                after[s] = min(after[s], after[first[s][0]] * float(GB[s][k][0].max()))
        dS = torch.zeros(T, dtype=torch.float64)  # rows of S_s(y) - S_s(x), s = n - 1
        dS_at: dict = {n - 1: dS}
        total = torch.zeros(T, dtype=torch.float64)
        parts = {}
        for s in range(n - 1, -1, -1):
            if s + 1 in pos:  # S_s = M_{q,L}: its drift by exact middle products (THEORY F36 item 3)
                dS = torch.minimum(dS, middle[k][pos[s + 1]])
                dS_at[s] = dS
            djc = dJcs[s][k]
            w = djc * (nuP[s] if stages[s].local else float(nuP[s].max()))  # nu_k(dJ_s P_s(x))
            wmax = float(w.max())
            seen = Nmat[s] @ djc  # nu_i(Shat_s dJ_s)
            if s in SW and hx[s][k] is not None:  # the heads' drift seen through S_s W_O^hT
                dZ, a_, c_ = hx[s][k]
                seen = torch.minimum(seen, _nan_inf(a_ * torch.einsum("ikh,hk->i", SW[s], dZ) + Nmat[s] @ c_))
            own = nuP[s] if stages[s].local else None
            main = Nmat[s] @ w if own is not None else seen * float(nuP[s].max())
            term = _nan_inf(main + (eS[s] + dS) * wmax)
            term = torch.minimum(term, torch.full_like(term, after[s + 1] * wmax))
            total = total + term
            parts[stages[s].name] = float(term.max())
            if s > 0:  # S_{s-1} = S_s J_s: rows of S_s(x) dJ_s + (S_s(y) - S_s(x)) J_s(y)
                step = _nan_inf(dS * bmax[s] + seen + eS[s] * float(djc.max()))
                if s in first:  # or over the whole layer, S_{s-1} = S_{b-1} J_L
                    b = first[s][0]
                    BL, dJL = GB[s][k]
                    alt = dS_at[b - 1] * float(BL.max()) + Nmat[b - 1] @ dJL + eS[b - 1] * float(dJL.max())
                    step = torch.minimum(step, _nan_inf(alt))
                dS = torch.minimum(step, torch.full_like(step, 2 * after[s]))
                dS_at[s - 1] = dS
        fine = float(total.max())
        whole = float(middle[k][0].max())
        drift = min(fine if math.isfinite(fine) else math.inf, coarse[k][0], whole)
        parts["(sub-stage route)"], parts["(layer route)"], parts["(middle products)"] = fine, coarse[k][0], whole
        stack = (point + drift) * (1 + ROUNDING_PAD)
        product = min(after[0], coarse[k][1]) * (1 + ROUNDING_PAD)
        out.append(StackLocal(rho, point, drift, stack, product, [float(r[k].max()) for r in radii],
                              [st.name for st in stages], [st.p for st in stages], bmax,
                              [float(dj[k].max()) for dj in dJs], [float(v.max()) for v in nuP], suf, e_J, wall, cpu,
                              parts, kept if k == 0 else None, [r[k] for r in radii], cuts, spans[k],
                              list(memo.refusals) + [why for st in stages for why in st.refusals], reaches[k], pads,
                              centre))
    return [out[k] for k in keep]


def stack_lower(spec: TransformerSpec, X: Tensor, rho: float, *, restarts: int = 3, steps: int = 30,
                iters: int = 30, seed: int = 0, blocks: Tensor | None = None, blocks_err: float = 0.0,
                form_blocks: bool = True) -> float:
    """An empirical lower estimate of the whole stack's local constant on ``B(X, rho)``, (2,inf) metric:
    the larger of the attained (2,inf) norm of the exact Jacobian at X (``row_norm_lower`` on its
    blocks, alternating maximisation with restarts) and a float64 Adam ascent on the pair ratio
    ``||f(a) - f(b)|| / ||a - b||`` over pairs in the ball (restarts), each pair's value that of the points as
    evaluated less the float64 error of the two evaluations, measured by the network in float32 (Note [pair
    allowance] in ``_local_lower``, red team 218), the pairs kept in ball's inner radius there.  Kind: empirical lower.
    ``blocks``: the Jacobian's blocks at X and their error, if the caller has them (the stack route's); without them
    they are formed by ``stack_jacobian`` (the stack route's machinery at a radius of 1e-300), or with
    ``form_blocks=False`` the Jacobian's norm is attained by autograd's power iteration instead (a product-route run
    spent 83 % of its time forming blocks for its lower estimate)."""
    from ..model import transformer_forward
    from ._empirical import jacobian_operator_norm

    X = X.detach().double()
    fn = lambda Z: transformer_forward(spec, Z, with_head=False)  # noqa: E731
    if blocks is None and form_blocks:
        try:
            blocks, blocks_err = stack_jacobian(spec, X)
        except InputError:  # a stage the exact blocks do not cover (Pi_norm): autograd's Jacobian at X instead
            blocks = None
    if blocks is not None:  # attained by the computed J; the exact one is within its rounding bound
        best = max(float(row_norm_lower(blocks, iters=iters, restarts=restarts, seed=seed).max()) - blocks_err, 0.0)
    else:
        best = jacobian_operator_norm(fn, X, metric="2,inf", n_iter=iters, seed=seed)[0]
    n24 = lambda Z: Z.norm(dim=-1).max()  # noqa: E731
    inner = _inner_radius(X, rho)  # fl(X + A) stays in the ball (red team 218: 1e-15 rho relative)
    if inner == 0.0:
        return best
    clip = lambda D: _clip(D, inner)  # noqa: E731
    spec32 = spec.to_torch(torch.float32)
    shadow = lambda Z: transformer_forward(spec32, Z, with_head=False)  # noqa: E731
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
            Ya, Yb = X + A, X + B
            fa, fb = fn(Ya), fn(Yb)
            num, den = n24(fa - fb), n24(A - B)
            ratio = num / den
            if bool(torch.isfinite(ratio)) and float(den.detach()) > 1e-9 * rho:
                # the recorded value: the points as evaluated, less the evaluations' error (Note [pair allowance])
                if float(num.detach()) / float(n24(Ya - Yb).detach()) > best:
                    best = max(best, float(_pair_quotients(Ya, Yb, fa, fb, shadow).max()))
            opt.zero_grad()
            (-ratio).backward()
            opt.step()
    return best
