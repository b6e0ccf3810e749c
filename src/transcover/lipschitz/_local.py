"""Certified Lipschitz constants on a ball around real data (issue 12; THEORY F14, F17).

The ball is ``B(X, rho) = {X' : ||x'_t - x_t||_2 <= rho for every token t}``, the metric (2,inf).
Every constant below bounds the operator norm of the Jacobian at *every* point of the ball; the
ball is convex, so the mean-value theorem turns that into a Lipschitz constant on it.

Note [local norm floor].  For LayerNorm ``sigma(x) = ||P x|| / sqrt(d)`` (``P`` centres, a
projection), so ``sigma(x') >= sigma(x) - ||P(x' - x)||/sqrt(d) >= sigma(x) - rho/sqrt(d)`` per
token; RMSNorm likewise with ``P = I``.  With ``s_t = sqrt((sigma_t - rho/sqrt d)_+^2 + eps)``,
F14's ``||J|| <= max|gamma| / s`` holds at every point of the token's ball (convex: no radial
argument is needed), and the (2,inf) constant of a per-token map is the max over tokens.  The
Jacobian ``D(x) = diag(gamma)(P - u u^T)/s`` moves on the ball by at most
``3 max|gamma| r / (sqrt(d) s_t^2)``: ``|d(1/s)| <= 1/(sqrt(d) s^2)`` per unit step and
``du = (P - u u^T) dx / (sqrt(d) s)`` with ``||u|| < 1`` give ``||dD|| <= max|gamma| (1 + 2)/(sqrt(d) s^2)``.

Note [layer Jacobian route].  Post-LN: ``J_ij = M_i (delta_ij I + dattn_i/dx_j)`` with the
per-token ``M_i = D2_i (I + F_i) D1_i``, ``F_i = W_2^T diag(sigma'(z_i)) W_1^T``; pre-LN:
``M_i = I + F_i D2_i`` and the attention sees ``D1_j dx_j``.  Row ``i`` of ``J dX`` is at most
``||M_i|| + ||M_i W_O^T|| (sum_h L_{h,i}^2)^{1/2} n_1`` (Note [local attention bound]; ``n_1`` = 1
post-LN, the sup of ``||D1_j||`` pre-LN), which avoids the product ``||D2|| ||I+F|| ||D1||``.
On the ball ``M_i`` moves by at most (telescoping) ``dD2 (||I+F||+dF) sD1 + ||D2|| dF sD1 +
||D2|| ||I+F|| dD1`` with ``dF <= ||W_1|| ||W_2|| sup|sigma''| max_k ||W_1[:, k]|| r_ffn``.
``||M_i||`` and ``||M_i W_O^T||`` come from float64 eigenvalues of the Gram matrices, padded by
``GRAM_PAD`` relative plus the matmul rounding (``n u`` times the absolute-value products).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._errors import InputError, TranscoverError
from .._results import Kind, Quantity
from ..model import to_tensor
from ..model import QUICK_GELU_SLOPE, Activation, LayerSpec, MoESpec, NormKind, NormSpec, Placement, TransformerSpec
from ._activations import activation_lipschitz
from ._local_attention import (DATA_PAD, attention_local_bound, check_layer_range, check_radius, check_tokens,
                               head_norms)
from ._local_centre import CENTRE_PAD_ASSUMPTION, f17_pad
from ._local_jacobian import _pow2_far, centre_tokens, norm_jacobian_error, point_slope_err, pow2_norm, pre_activations
from ._rounding import _gamma, root_sq_plus
from ._weights import ROUNDING_PAD, spectral

__all__ = ["norm_local", "LayerLocal", "layer_local", "NetworkLocal", "network_local", "second_derivative_sup"]

GRAM_PAD = 1e-9
_U = 2.0**-53


def _f64(W) -> Tensor:  # noqa: ANN001
    return to_tensor(W, dtype=torch.float64).detach()


def check_rho(rho: float) -> float:
    try:
        rho = float(rho)
    except (TypeError, ValueError):  # a string or None was a bare ValueError/TypeError (red team 166)
        raise InputError(f"rho must be a finite number > 0, but got rho={rho!r}") from None
    if not (rho > 0 and math.isfinite(rho)):
        raise InputError(f"rho must be a finite number > 0, but got rho={rho!r}")
    return rho


def second_derivative_sup(act: Activation) -> float:
    """sup |sigma''| (GELU: phi(x)(2 - x^2) peaks at 0, 2/sqrt(2 pi); SiLU: 1/2 at 0; GELU-tanh:
    0.798 by the same shape, padded to 0.8; QuickGELU: 1.702 / 2; identity 0; ReLU: infinite, the drift is then
    unbounded)."""
    act = Activation(act)
    return {Activation.GELU: 2.0 / math.sqrt(2.0 * math.pi) * (1 + ROUNDING_PAD), Activation.SILU: 0.5 * (1 + ROUNDING_PAD),
            Activation.GELU_TANH: 0.8, Activation.IDENTITY: 0.0,
            # quick_gelu''(x) = a silu''(a x), a = 1.702
            Activation.QUICK_GELU: 0.5 * QUICK_GELU_SLOPE * (1 + ROUNDING_PAD)}.get(act, math.inf)


def variance_floor(norm: NormSpec, s: Tensor) -> Tensor:
    """The std floor without eps, ``sqrt(s^2 - eps)``, from :func:`norm_local`'s floor ``s`` of ``sqrt(var + eps)``."""
    return torch.sqrt(torch.clamp(s * s - float(norm.eps), min=0.0))


def norm_local(norm: NormSpec | None, X: Tensor, rho: float) -> tuple[Tensor, Tensor]:
    r"""Per-token local constants of a normalisation on ``B(X, rho)`` and the certified floors ``s_t``.

    .. math:: \mathrm{Lip}_t \le \frac{\max|\gamma|}{\sqrt{(\sigma(x_t) - \rho/\sqrt d)_+^2 + \varepsilon}}

    Source: THEORY F14, F17; Note [local norm floor].  Assumptions: each token moves by ``<= rho``.
    Returns ``(lip, s)`` of shape (T,); ``s`` is ``inf`` for Pi_norm / identity (constant 1).  Refused (InputError):
    ``rho`` negative or not finite, ``X`` not (T, d) with finite entries, ``eps`` negative or not finite.
    """
    rho = check_radius(rho)
    if norm is not None and norm.kind not in (NormKind.NONE, NormKind.BALL):
        for name, t in (("gain", norm.weight), ("bias", norm.bias)):  # a (d, d) gain passed the width check (37c)
            if t is not None and len(t.shape) != 1:
                raise InputError(f"a normalisation's {name} must be one vector of shape (d,) here, but got shape "
                                 f"{tuple(t.shape)}")
        check_tokens(X, int(norm.weight.shape[-1]) if norm.weight is not None else X.shape[-1])
        if not (math.isfinite(float(norm.eps)) and float(norm.eps) >= 0) or not math.isfinite(norm.gamma_max_abs):
            raise InputError(f"a normalisation needs a finite eps >= 0 and finite gains, but got eps={norm.eps!r}")
    T, d = X.shape
    if norm is None or norm.kind in (NormKind.NONE, NormKind.BALL):
        return torch.ones(T, dtype=torch.float64), torch.full((T,), math.inf, dtype=torch.float64)
    X = X.double()
    sigma = centre_tokens(X, norm.kind is NormKind.LAYERNORM)[2] * (1.0 - DATA_PAD)  # certified low
    floor = torch.clamp(sigma - rho / math.sqrt(d) * (1.0 + 1e-15), min=0.0)
    s = root_sq_plus(floor, float(norm.eps)) * (1.0 - DATA_PAD)
    if bool((s <= 0).any()):
        raise InputError("a normalisation with eps=0 is not Lipschitz on a ball reaching a constant token; "
                         "use a smaller rho")
    lip = norm.gamma_max_abs / s * (1.0 + ROUNDING_PAD)
    if norm.gamma_max_abs > 0:  # a quotient below the normal range (absolute error 2^-1075, or 0): 2^-1021 is above it
        lip = torch.clamp(lip, min=2.0**-1021)
    return lip, s


def _norm_jacobians(norm: NormSpec | None, X: Tensor) -> Tensor:
    """The per-token Jacobians ``diag(gamma)(P - u u^T)/s`` (column convention), float64 (T, d, d)."""
    T, d = X.shape
    eye = torch.eye(d, dtype=torch.float64).expand(T, d, d)
    if norm is None or norm.kind in (NormKind.NONE,):
        return eye.clone()
    if norm.kind is NormKind.BALL:
        raise InputError("the layer Jacobian route does not cover Pi_norm; use the product route")
    lay = norm.kind is NormKind.LAYERNORM
    Z, sigma, _ = centre_tokens(X, lay)
    s = root_sq_plus(sigma, float(norm.eps))
    u = Z / (math.sqrt(d) * s[:, None])
    P = eye - (1.0 / d if lay else 0.0)
    J = (P - u[:, :, None] * u[:, None, :]) / s[:, None, None]
    if norm.weight is not None:
        J = _f64(norm.weight)[None, :, None] * J
    return J


def _sym_top(B: Tensor) -> Tensor:
    """Largest singular value of each (..., m, n) matrix from the Gram eigenvalues, padded upward.  A matrix whose
    largest entry is outside ``[2^-400, 2^400]`` is scaled by a power of two to one in ``[1/2, 1)`` first (exact, undone
    on the root): its Gram flushed to 0 below ``2^-537`` (a post-LN ``M`` near ``2^-580`` got the norm 0) and overflowed
    above ``2^512``; the others give the very same floats as before."""
    B, ex = _pow2_far(B)
    G = B.transpose(-1, -2) @ B if B.shape[-1] <= B.shape[-2] else B @ B.transpose(-1, -2)
    lam = torch.linalg.eigvalsh(G)[..., -1].clamp(min=0.0)
    fro2 = (B * B).sum(dim=(-1, -2))
    # eigvalsh is backward stable: error <= c n u ||G||; pad by GRAM_PAD of the Frobenius mass.
    return torch.ldexp(torch.sqrt(lam + GRAM_PAD * fro2), ex)


@dataclass
class LayerLocal:
    """Local certified constants of one layer on ``B(X, rho)`` (values include rounding pads)."""

    index: int
    rho: float
    components: dict[str, float]  # name -> local certified constant of that component
    radii: dict[str, float]  # name -> ball radius at that component's input
    product: float  # composition of the components' local constants
    jacobian_point: float  # block bound of the Jacobian at X (rho -> 0)
    jacobian_ball: float  # Jacobian route on the ball (point + drift)
    out: Tensor = field(repr=False)  # the layer's output at X (float64)
    min_sigma: float = math.inf
    exact_point: float = math.inf  # exact-Jacobian route at X (certified block sums)
    exact_ball: float = math.inf  # exact-Jacobian route on the ball (point + drift)
    drift_parts: dict = field(default_factory=dict)  # where the exact route's drift sits
    # the components whose global constant, on a domain holding their ball, replaced a larger local one in
    # ``components`` (Note [global on a component's ball])
    global_parts: tuple[str, ...] = ()

    @property
    def upper(self) -> float:
        return min(self.product, self.jacobian_ball)

    def quantity(self) -> Quantity:
        return Quantity(self.upper, Kind.CERTIFIED_UPPER, "THEORY F14, F17 (local, issue 12)",
                        (f"every token within rho={self.rho:.6g} (l2) of the data point", "metric (2,inf)",
                         "float64 evaluation with rounding pads (Note [rounding], GRAM_PAD)", CENTRE_PAD_ASSUMPTION))


def _ffn_parts(ffn, Y: Tensor):  # noqa: ANN001, ANN202
    """(W_1, W_2, sigma'(z), e): the slope at ``z = fl(Y W_1 + b_1)`` and ``e`` (T,) its largest move from the exact
    pre-activation's (``pre_activations``, ``point_slope_err``; F51a, red17-2)."""
    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    z, ez = pre_activations(ffn, Y)
    zz = z.detach().clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(ffn.activation(zz).sum(), zz)
    return W1, W2, slope, point_slope_err(ffn.activation, z, ez)


# Note [exact route default]: the exact-Jacobian route (``_local_jacobian.layer_jacobians``) now runs
# by its rows route (``_local_rows``: per-token d x d Grams, no T^2 d^2 blocks; about a second per
# layer for a 32-token MiniLM sentence on 2 cores), so it is the default up to this many entries
# T*d (32 tokens at width 384 and well beyond); ``exact=True`` forces it, ``exact=False`` skips it.
EXACT_ROUTE_MAX = 65536


def ball_radius(X: Tensor, rho: float) -> float:
    """A float ``>= max_t ||x_t|| + rho``: every token norm on the (2,inf) ball ``B(X, rho)`` (THEORY F104).  The formed
    norm (d squares summed, one root, at powers of two) is within ``(d + 4) u`` of the exact one, relatively, and the
    sum is rounded up by one ``2u``."""
    return (float(pow2_norm(X.double(), 1).max()) * (1 + (X.shape[-1] + 4) * 2.0**-53) + rho) * (1 + 2.0**-52)


# Note [global on a component's ball] (THEORY F112): the global chain (F8: F6, F7, F14 with no variance floor,
# c_sm = 1, metric (2,inf)) bounds each component on a domain of its own: a LayerNorm/RMSNorm everywhere (eps
# bounds it), an attention or FFN branch on inputs whose tokens have norm <= r (``_attention_block``,
# ``_ffn_block`` at r; RoPE only for sequences of at most max_position tokens).  Where that domain holds every
# point a component sees from the layer's ball, the global constant is a certified bound there too, and the smaller
# of it and the local one is kept; the later inner radii, the layer's product and the network's product route
# compose it.  The points a branch sees lie in its input ball (tokens <= ``ball_radius``) and, behind a norm, in
# that norm's image (tokens <= ``norm_output_radius(n, d, inf)``: max|gamma| sqrt(d) + ||beta|| for LayerNorm and
# RMSNorm, 1 for Pi_norm, no bound for the identity): the branch is bounded at the smaller radius.  A gated FFN's
# local constant (F107) grows with its ball, which the inner radii compound (a float16 Llama at rho = 0.01: 1.3e11
# for its layer 0 FFN beside the chain's 1.5e7, red team 221), and a norm's local constant with no floor left is
# its global one times the data pads (a bfloat16 BERT: 2468750.0027 beside 2468750.000000002).


# Note [local cache binding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``layer_local``, ``network_local`` and ``local_table`` keep what depends on the weights alone (spectral norms, F17c's
# kappa, F38's Hadamard Grams, the global chain's bounds: ~7 s a MiniLM layer) in the caller's ``cache``, keyed by the
# layer's index, so a cache passed across sentences and radii computes them once.  Keyed by index alone, one cache
# passed to two models (or kept across an in-place change of a weight) handed the second the first's norms: a false
# certificate.  Each layer's entries are therefore stamped with the layer object and every tensor it holds with its
# version counter (torch bumps it on every in-place write); a different stamp drops that index's entries first.
# Numpy arrays carry no version: their identity is checked, not their contents.


def _layer_stamp(layer: LayerSpec) -> tuple:
    """The layer object and each array it holds (tensors with their version counters), in field order."""
    out: list = [layer]

    def walk(v) -> None:  # noqa: ANN001
        if isinstance(v, Tensor):
            out.append((v, v._version))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif hasattr(v, "__array__"):
            out.append((v, None))

    for f in dataclasses.fields(layer):
        walk(getattr(layer, f.name))
    return tuple(out)


def _same_stamp(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and a[0] is b[0] and all(x[0] is y[0] and x[1] == y[1] for x, y in zip(a[1:], b[1:]))


def bind_cache(cache: dict, layer: LayerSpec) -> None:
    """Note [local cache binding]: drop ``cache``'s entries of ``layer.index`` unless they were made from this very
    layer object with its tensors unchanged since; then stamp them as this layer's."""
    key = ("owner", layer.index)
    stamp, old = _layer_stamp(layer), cache.get(key)
    if old is not None and _same_stamp(old, stamp):
        return
    if old is not None:
        for k in [k for k in cache if isinstance(k, tuple) and len(k) == 2 and k[1] == layer.index]:
            del cache[k]
        stack = cache.get("stack_norms")
        if isinstance(stack, dict):
            stack.pop(layer.index, None)
    cache[key] = stamp


def _layer_bounds(layer: LayerSpec, cache: dict):  # noqa: ANN202
    """The layer's class bounds (the global chain's, ``_weights.layer_norms``), once per cache (``local_table``
    seeds it with the global column's own); None where they cannot be measured."""
    from ._weights import layer_norms

    key = ("bounds", layer.index)
    if key not in cache:
        try:
            cache[key] = layer_norms(layer)
        except TranscoverError:  # an architecture the chain does not cover: the local constants stand alone
            cache[key] = None
    return cache[key]


def _global_norm(n) -> float:  # noqa: ANN001  (NormBounds)
    """F14's global constant of a norm (no floor), valid at every input; inf where there is none (eps = 0)."""
    from ._normalisation import norm_lipschitz

    try:
        return norm_lipschitz(n, 0.0)
    except TranscoverError:
        return math.inf


def _image_radius(n, d: int) -> float:  # noqa: ANN001  (NormBounds)
    """A bound on every token a norm outputs, whatever its input (inf for the identity)."""
    from ._normalisation import norm_output_radius

    return norm_output_radius(n, d, math.inf)


def _global_branch(L, block: str, r: float, T: int) -> float:  # noqa: ANN001  (LayerBounds)
    """The chain's constant of the attention (``block="attn"``) or FFN branch on inputs of token norms <= r, with no
    residual; inf where it does not hold (r not finite, a RoPE sequence longer than max_position) or is not derived."""
    from ._compose import _attention_block, _ffn_block

    if not r < math.inf or (block == "attn" and L.rope_positions is not None and T > L.rope_positions):
        return math.inf
    try:
        if block == "attn":
            return _attention_block(L, r, 1.0, "2,inf", None)[0]
        return _ffn_block(L, r)[0]
    except TranscoverError:
        return math.inf


def _smaller(local: float, glob: float, name: str, taken: list) -> float:
    """The smaller of a component's local and global constants; ``name`` goes to ``taken`` when the global is."""
    if glob < nan_as_inf(local):
        taken.append(name)
        return glob
    return local


def layer_local(layer: LayerSpec, X: Tensor, rho: float, *, cache: dict | None = None,
                jacobian: bool = True, exact: bool | None = None) -> LayerLocal:
    r"""Certified local constants of one layer on ``B(X, rho)``: per component, product route and
    Jacobian route (Note [layer Jacobian route]); the layer's constant is the smaller route.

    .. math:: \mathrm{Lip}_{B(X,\rho)}(g) \le \min\Big(\prod_c L_c,\ \max_i\, \|M_i\| + \|M_i W_O^\top\| n_1
              \big(\textstyle\sum_h L_{h,i}^2\big)^{1/2} + \text{drift}\Big)

    Each component's constant is the smaller of its local one and the global chain's where that holds on every point
    the component sees (Note [global on a component's ball], THEORY F112; ``global_parts`` names those taken).
    Source: THEORY F14, F17; Notes [local norm floor], [local attention bound], [layer Jacobian
    route].  Assumptions: every token within ``rho`` of ``X``; dot attention.  Gated FFNs and RoPE attention take the
    product route only, with THEORY F107's local constants (``_local_gated``, ``_local_rope``).
    ``cache``: a dict to pass again on later calls (other inputs, other radii) so the weight-only constants are computed
    once (~7 s a MiniLM layer); its entries are bound to this layer object and its tensors' versions (Note [local cache
    binding]).  ``exact``: also the exact-Jacobian route (THEORY F17; None: when T*d <= ``EXACT_ROUTE_MAX``,
    Note [exact route default]).
    Norms at powers of two (``pow2_norm``, THEORY F96).  ``rho`` finite and > 0, as ``network_local``'s (a rho of 0
    was certified here and refused there, stop 39's list)."""
    rho = check_rho(rho)
    check_tokens(X, int(layer.attention.W_O.shape[-1]))
    if isinstance(layer.ffn, MoESpec):  # before any norm of its stacked experts (a ValueError, red team of stop 36)
        from ..model import moe_refusal

        raise moe_refusal(layer.index)
    if layer.residual.value == "parallel":
        raise InputError(f"local bounds (THEORY F17) are not derived for the parallel residual of layer "
                         f"{layer.index} (F21); its global bounds are available (lipschitz without --data)")
    if layer.post_norm_attn is not None or layer.post_norm_ffn is not None:
        raise InputError(f"local bounds (THEORY F17) are not derived for the branch-output norms of layer "
                         f"{layer.index} (F26); its global bounds are available (lipschitz without --data)")
    X = X.detach().double()
    T, d = X.shape
    cache = {} if cache is None else cache
    bind_cache(cache, layer)  # Note [local cache binding]
    key = ("norms", layer.index)
    if key not in cache:
        f, hn = layer.ffn, head_norms(layer.attention)
        nW1, nW2 = spectral(f.W_1) * (1 + ROUNDING_PAD), spectral(f.W_2) * (1 + ROUNDING_PAD)
        check_layer_range(layer, {"W1": nW1, "W2": nW2, "O": hn["O"]})  # Note [local weight range]
        cache[key] = (hn, nW1, nW2)
    hn, nW1, nW2 = cache[key]
    # a gated FFN's constant is local (THEORY F107): formed in the body, where its ball is known
    Lffn = None if layer.ffn.gated else activation_lipschitz(layer.ffn.activation) * nW1 * nW2 * (1 + ROUNDING_PAD)

    try:
        return _layer_local_body(layer, X, rho, cache, jacobian, exact, hn, nW1, nW2, Lffn)
    except _Unbounded:
        # Note [unbounded inner ball]: the user's rho is valid but some inner radius is not finite (at a large
        # rho the attention's weight-move factor exp(Delta) overflows): the layer has no finite certificate
        # here, reported as inf.  It was NaN, then a refusal of "rho=nan" that blamed the user's rho (37e).
        from ..model import layer_forward

        return LayerLocal(layer.index, rho, {}, {}, math.inf, math.inf, math.inf,
                          layer_forward(layer, X).detach().double())


class _Unbounded(Exception):
    """An inner radius of ``layer_local`` is not finite (Note [unbounded inner ball])."""


def _pad(r: float, Y: Tensor) -> float:
    """An inner ball's radius with the centre's rounding (F64); ``_Unbounded`` where it is not finite (a softmax
    weight's move overflowed)."""
    out = r * (1 + 1e-12) + f17_pad(Y)
    if not out < math.inf:
        raise _Unbounded
    return out


def _layer_local_body(layer: LayerSpec, X: Tensor, rho: float, cache: dict, jacobian: bool, exact: bool | None,
                      hn: dict, nW1: float, nW2: float, Lffn: float | None) -> LayerLocal:
    from ..model import attention_forward, ffn_forward

    T, d = X.shape
    ffn = layer.ffn
    comps, radii = {}, {}
    scratch: dict = {}
    # Pi_norm (the projection onto the unit ball) is 1-Lipschitz, which the product route uses; the Jacobian routes
    # are not derived for it (not differentiable on the sphere), so a layer with one takes the product route (F104)
    jacobian = jacobian and not any(n is not None and n.kind is NormKind.BALL for n in (layer.norm_attn, layer.norm_ffn))
    # the Jacobian routes are not derived for gated FFNs or RoPE: such layers take the product route (THEORY F107)
    jacobian = jacobian and not ffn.gated and layer.attention.rope is None
    # the global chain's constants where their domains hold the balls (Note [global on a component's ball])
    L = _layer_bounds(layer, cache)
    taken: list[str] = []
    if L is None:
        g_norm = g_branch = lambda *args: math.inf  # noqa: E731
    else:
        g_norm = lambda n: _global_norm(getattr(L, n))  # noqa: E731
        g_branch = lambda block, r: _global_branch(L, block, r, T)  # noqa: E731
    r_img = {n: math.inf if L is None else _image_radius(getattr(L, n), d) for n in ("norm_attn", "norm_ffn")}
    if layer.placement is Placement.POST:
        a = attention_local_bound(layer.attention, X, rho, norms=hn)
        a_up = _smaller(a.upper, g_branch("attn", ball_radius(X, rho)), "attention", taken)
        X1 = X + attention_forward(layer.attention, X)
        r1 = _pad((1 + a_up) * rho, X1)
        n1, s1 = norm_local(layer.norm_attn, X1, r1)
        n1_up = _smaller(float(n1.max()), g_norm("norm_attn"), "norm_attn", taken)
        H = layer.norm_attn(X1)
        rh = _pad(n1_up * r1, H)
        Lffn = _smaller(_ffn_local(ffn, H, rh, Lffn), g_branch("ffn", min(ball_radius(H, rh), r_img["norm_attn"])),
                        "ffn", taken)
        X2 = H + ffn_forward(ffn, H)
        ffn_res = 1 + Lffn
        if jacobian:  # the FFN block's own point + drift constant (Note [layer Jacobian route])
            scratch["ffn"] = _ffn_point(ffn, H)
            nIF = _sym_top(scratch["ffn"][4]) * (1 + GRAM_PAD) + 1e-9 * (1 + Lffn) + scratch["ffn"][5]
            colmax = float(pow2_norm(scratch["ffn"][0], 0).max())
            dF = nW1 * nW2 * second_derivative_sup(ffn.activation) * colmax * rh
            ffn_res = min(ffn_res, float(nIF.max()) + dF)
            if ffn_res < 1 + Lffn and "ffn" in taken:  # the FFN block's own route won: no global constant in it
                taken.remove("ffn")
        r2 = _pad(ffn_res * rh, X2)
        n2, s2 = norm_local(layer.norm_ffn, X2, r2)
        out = layer.norm_ffn(X2)
        comps = {"attention": a_up, "norm_attn": n1_up, "ffn": Lffn,
                 "norm_ffn": _smaller(float(n2.max()), g_norm("norm_ffn"), "norm_ffn", taken)}
        radii = {"attention": rho, "norm_attn": r1, "ffn": rh, "norm_ffn": r2}
        comps["ffn_residual"] = ffn_res
        product = (1 + a_up) * comps["norm_attn"] * ffn_res * comps["norm_ffn"]
        att_in, att_rho, n_in = X, rho, 1.0
    else:
        n1, s1 = norm_local(layer.norm_attn, X, rho)
        n1_up = _smaller(float(n1.max()), g_norm("norm_attn"), "norm_attn", taken)
        Y = layer.norm_attn(X)
        ry = _pad(n1_up * rho, Y)
        a = attention_local_bound(layer.attention, Y, ry, norms=hn)
        a_up = _smaller(a.upper, g_branch("attn", min(ball_radius(Y, ry), r_img["norm_attn"])), "attention", taken)
        X1 = X + attention_forward(layer.attention, Y)
        r1 = _pad((1 + a_up * n1_up) * rho, X1)
        n2, s2 = norm_local(layer.norm_ffn, X1, r1)
        n2_up = _smaller(float(n2.max()), g_norm("norm_ffn"), "norm_ffn", taken)
        H = layer.norm_ffn(X1)
        rh = _pad(n2_up * r1, H)
        Lffn = _smaller(_ffn_local(ffn, H, rh, Lffn), g_branch("ffn", min(ball_radius(H, rh), r_img["norm_ffn"])),
                        "ffn", taken)
        out = X1 + ffn_forward(ffn, H)
        comps = {"norm_attn": n1_up, "attention": a_up, "norm_ffn": n2_up, "ffn": Lffn}
        radii = {"norm_attn": rho, "attention": ry, "norm_ffn": r1, "ffn": rh}
        product = (1 + a_up * comps["norm_attn"]) * (1 + Lffn * comps["norm_ffn"])
        att_in, att_rho, n_in = Y, ry, comps["norm_attn"]
    product *= 1 + ROUNDING_PAD
    floors = []
    for n, s_ in ((layer.norm_attn, s1), (layer.norm_ffn, s2)):
        if n is not None and n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM):
            floors.append(variance_floor(n, s_))
    min_sigma = float(torch.cat(floors).min()) if floors else math.inf  # the variance floor without eps
    jp = jb = math.inf
    ep = eb = math.inf
    parts: dict = {}
    if jacobian:
        jp, jb = _jacobian_route(layer, att_in, att_rho, n_in, H, rh, X1, r1, X2 if layer.placement is Placement.POST else None,
                                 r2 if layer.placement is Placement.POST else None, s1, s2, hn, nW1, nW2, rho, scratch)
        if exact or (exact is None and X.shape[-2] * X.shape[-1] <= EXACT_ROUTE_MAX):
            ep, eb, parts = _exact_route(layer, X, rho, cache, hn)
    jp, jb, ep, eb = map(nan_as_inf, (jp, jb, ep, eb))  # Python's min(nan, x) is nan (red team 192)
    return LayerLocal(layer.index, rho, comps, radii, product, min(jp, ep), min(jb, eb), out.detach(), min_sigma,
                      ep, eb, parts, tuple(taken))


def nan_as_inf(x: float) -> float:
    """``x``, or ``inf`` where it is NaN: a certified upper bound that could not be evaluated is no bound.  A softmax
    weight that overflowed in ``mixed_head_terms`` made the Jacobian route's ball NaN, which ``min`` kept and the
    per-sequence ``max`` in ``local_table`` would have dropped (``max(0.0, nan)`` is 0.0; red team 192; THEORY F110)."""
    return math.inf if math.isnan(x) else x


def _ffn_local(ffn, H: Tensor, rh: float, Lffn: float | None) -> float:  # noqa: ANN001
    """The FFN's constant on ``B(H, rh)``: the global one (``Lffn``) or, gated, THEORY F107's local one."""
    if Lffn is not None:
        return Lffn
    from ._local_gated import gated_ffn_local

    return gated_ffn_local(ffn, H, rh).upper * (1 + ROUNDING_PAD)


def _exact_route(layer: LayerSpec, X: Tensor, rho: float, cache: dict, hn: dict) -> tuple[float, float, dict]:
    """The exact-Jacobian route (``_local_jacobian``): (point, ball, drift parts); inf where it does
    not apply (Pi_norm, gated FFN, RoPE, L2 attention)."""
    from ._local_jacobian import _weight_norms, layer_jacobian

    if layer.attention.kind != "dot" or layer.attention.rope is not None or layer.ffn.gated:
        return math.inf, math.inf, {}
    key = ("exact_norms", layer.index)
    try:
        if key not in cache:
            cache[key] = _weight_norms(layer)
        lj = layer_jacobian(layer, X, rho, norms=cache[key], head_norms_=hn)
    except InputError:
        return math.inf, math.inf, {}
    return lj.point, lj.ball, lj.parts


def _ffn_point(ffn, H):  # noqa: ANN001, ANN202
    """(W_1, W_2, sigma'(z), F, I + F, eFz) at the FFN's input points, float64; ``eFz`` (float) bounds the formed
    ``F``'s distance to the one at the exact pre-activations (``_ffn_parts``) times ``||W_1|| ||W_2||``."""
    W1, W2, slope, es = _ffn_parts(ffn, H)
    F = (W2.T[None] * slope[:, None, :]) @ W1.T  # (T, d, d): W_2^T diag(sigma') W_1^T
    eFz = float(es.max()) * spectral(W1) * spectral(W2) * (1 + 1e-12)
    return W1, W2, slope, F, torch.eye(H.shape[1], dtype=torch.float64) + F, eFz


def _jacobian_route(layer, att_in, att_rho, n_in, H, rh, X1, r1, X2, r2, s1, s2, hn, nW1, nW2, rho, scratch):  # noqa: ANN001, ANN202, PLR0913
    from ._local_attention import attention_query_terms, mixed_head_terms

    post = layer.placement is Placement.POST
    ffn = layer.ffn
    T, d = H.shape
    W1, W2, slope, F, IF, eFz = scratch["ffn"] if "ffn" in scratch else _ffn_point(ffn, H)
    D1 = _norm_jacobians(layer.norm_attn, X1) if post else None
    if post:
        D2 = _norm_jacobians(layer.norm_ffn, X2)
        M = D2 @ IF @ D1
    else:
        D2 = _norm_jacobians(layer.norm_ffn, X1)
        M = torch.eye(d, dtype=torch.float64) + F @ D2
    W_O = _f64(layer.attention.W_O).reshape(-1, d)  # (H dh, d), attn = concat(g) @ W_O
    MO = M @ W_O.T[None]  # column convention: M_i W_O^T
    # matmul rounding (Higham: |fl(AB) - AB| <= n u |A||B|, chained): bounded in Frobenius norm by
    # n u ||A||_F ||B||_F ..., n the longest inner dimension (Frobenius dominates the spectral error).
    fro = lambda A: float(pow2_norm(A, (-2, -1)).max()) if A.dim() == 3 else float(pow2_norm(A))  # noqa: E731
    n_in_mm = W1.shape[1] + 2 * d + 2
    fF = fro(W2) * float(slope.abs().max()) * fro(W1)
    fD = (fro(D1) if post else 1.0) * fro(D2)
    mm = 4 * n_in_mm * _U * (math.sqrt(d) + fF) * max(fD, 1.0) * (1.0 + math.sqrt(d))
    mm = mm + eFz * max(fD, 1.0) * (1 + 1e-12)  # F at the exact pre-activations (F51a, red17-2)
    # F17f: the formed norm Jacobians against the true ones (not relative to ||D||_F)
    eD2 = float(norm_jacobian_error(layer.norm_ffn, X2 if post else X1, formed=True).max())
    if post:
        eD1 = float(norm_jacobian_error(layer.norm_attn, X1, formed=True).max())
        fIF = fro(IF)
        mm = mm + (eD2 * fIF * (fro(D1) + eD1) + fro(D2) * fIF * eD1) * (1 + 1e-12)
    else:
        mm = mm + fro(F) * eD2 * (1 + 1e-12)
    nM = _sym_top(M) * (1 + GRAM_PAD) + mm
    nMO = _sym_top(MO) * (1 + GRAM_PAD) + mm * fro(W_O) * 2
    nO = hn["O"]
    t0, _ = attention_query_terms(layer.attention, att_in, 0.0, norms=hn)
    tb, _ = attention_query_terms(layer.attention, att_in, att_rho, norms=hn)
    # THEORY F97: the heads-summed form sees the formed M through its distance mm from the exact one (as ``drift``)
    # and the product M_i W_O^hT's rounding gamma_d || |M_i| |W_O^h|^T ||_F (``eMO``)
    nh, dh = layer.attention.n_heads, layer.attention.d_head
    eMO = _gamma(d) * pow2_norm((M.abs() @ W_O.abs().T[None]).reshape(T, d, nh, dh), (1, 3)) * (1 + 1e-12)
    mixed0 = mixed_head_terms(layer.attention, att_in, 0.0, MO, mm, hn, eMO)
    point = float((nM + torch.minimum(nMO * t0, mixed0) * n_in).max()) * (1 + ROUNDING_PAD)
    # drift of M over the ball (Note [layer Jacobian route])
    g1 = layer.norm_attn.gamma_max_abs if layer.norm_attn is not None else 1.0
    g2 = layer.norm_ffn.gamma_max_abs if layer.norm_ffn is not None else 1.0
    sq = math.sqrt(d)
    s1m, s2m = float(s1.min()), float(s2.min())
    colmax = float(pow2_norm(W1, 0).max())
    dF = nW1 * nW2 * second_derivative_sup(ffn.activation) * colmax * rh
    nIF = _sym_top(IF) * (1 + GRAM_PAD) + mm
    if post:
        # the FFN's own local constant (point + drift) gives a tighter certified radius at norm_ffn
        r2 = min(r2, float((nIF.max() + dF)) * rh * (1 + 1e-12) + f17_pad(X2))
        s2 = norm_local(layer.norm_ffn, X2, r2)[1]
        s2m = float(s2.min())
        sD1, sD2 = g1 / s1m, g2 / s2m
        dD1 = 3 * g1 * r1 / (sq * s1m * s1m) if math.isfinite(s1m) else 0.0
        dD2 = 3 * g2 * r2 / (sq * s2m * s2m) if math.isfinite(s2m) else 0.0
        nD2 = _sym_top(D2) * (1 + GRAM_PAD) + eD2
        drift = dD2 * (nIF + dF) * sD1 + nD2 * dF * sD1 + nD2 * nIF * dD1
        n_in_ball = 1.0
    else:
        sD2 = g2 / s2m
        dD2 = 3 * g2 * r1 / (sq * s2m * s2m) if math.isfinite(s2m) else 0.0
        drift = dF * sD2 + (nW1 * nW2 * activation_lipschitz(ffn.activation)) * dD2
        n_in_ball = n_in
    if not torch.isfinite(torch.as_tensor(drift, dtype=torch.float64)).all():  # float32 default: 1e39 read as inf
        return nan_as_inf(point), math.inf
    mixed = mixed_head_terms(layer.attention, att_in, att_rho, MO, (drift + mm) * (1 + 1e-12), hn, eMO)
    att = torch.minimum((nMO + drift * nO) * tb, mixed)
    ball = float((nM + drift + att * n_in_ball).max()) * (1 + ROUNDING_PAD)
    return nan_as_inf(point), nan_as_inf(ball)


@dataclass
class NetworkLocal:
    """Per-layer local constants along the data path and the whole network's product bound."""

    rho: float
    input_norm: float
    layers: list[LayerLocal]
    final_norm: float
    upper: float
    product: float = math.nan  # the product route (per-layer local constants)
    stack: float = math.inf  # the whole-stack route (THEORY F30), inf when not run
    # (blocks (T, T, d, d) of the stack's Jacobian at X, their float64 error): kept by the stack route when asked
    # (``keep_jacobian``), for the lower estimate at the same point
    jacobian: tuple | None = field(default=None, repr=False)
    # the product route's components that took their global constant (Note [global on a component's ball]):
    # "input_norm", "layer 0 ffn", ..., "final_norm"
    global_parts: tuple[str, ...] = ()

    @property
    def route(self) -> str:
        return "stack" if self.stack < self.product else "product"

    def quantity(self) -> Quantity:
        how = ("exact stack Jacobian at the data + telescoped drift (THEORY F30)" if self.route == "stack"
               else "product of per-layer local constants along the data path")
        return Quantity(self.upper, Kind.CERTIFIED_UPPER, "THEORY F8, F14, F17, F30 (local, issue 12)",
                        (f"every embedded token within rho={self.rho:.6g} (l2) of the data point",
                         "metric (2,inf)", f"route: {how}", CENTRE_PAD_ASSUMPTION))


def network_local(spec: TransformerSpec, X: Tensor, rho: float, *, cache: dict | None = None,
                  jacobian: bool = True, route: str = "auto", move_rest: bool = False,
                  keep_jacobian: bool = False) -> NetworkLocal:
    r"""Whole network on ``B(X, rho)`` (X: embedded tokens before the input norm), by composition:
    ``g_l(B(Y_l, r_l)) subset B(g_l(Y_l), L_l r_l + pad)`` and ``Lip <= prod_l L_l``; and by the
    whole stack's exact Jacobian plus its drift (``lipschitz._local_stack``, THEORY F30); ``upper``
    is the smaller (``route`` on the result says which won).  Where one route refuses the ball
    (InputError) and the other certifies it, the other's value is returned (the refused one is
    ``inf``; its ``layers`` hold what it certified before refusing); both refusing raises.

    ``route``: ``"product"``, ``"stack"`` (both routes, the stack one forced), ``"auto"`` (the stack
    route too when T*d <= ``STACK_ROUTE_MAX``: it costs T^2 d^3 per layer).  ``move_rest``: the stack route's
    THEORY F77 switch (``stack_local(move_rest=)``: the move's rest by its own recursion, tighter at larger radii).
    ``cache``: as ``layer_local``'s, for every layer of ``spec`` (Note [local cache binding]).
    ``keep_jacobian``: where the stack route runs, its Jacobian blocks at X and their error on the result
    (``jacobian``; ``stack_lower`` takes them instead of forming them again).
    Source: THEORY F8 (composition), F17, F30.  The head (if any) is not included.
    """
    from ._local_stack import STACK_ROUTE_MAX, stack_local

    if route not in ("auto", "product", "stack"):
        raise InputError(f"route must be 'auto', 'product' or 'stack', but got route={route!r}")
    rho = check_rho(rho)
    check_tokens(X, spec.d_model)  # an empty, 1-D or 3-D X, or the wrong width, was a traceback (stop 39 red team)
    cache = {} if cache is None else cache
    for layer in spec.layers:  # before the stack route reads "stack_norms" (Note [local cache binding])
        bind_cache(cache, layer)
    X = X.detach().double()
    stack, blocks = math.inf, None
    if route == "stack" or (route == "auto" and X.shape[-2] * X.shape[-1] <= STACK_ROUTE_MAX):
        try:
            sl = stack_local(spec, X, [rho], norms=cache.setdefault("stack_norms", {}), move_rest=move_rest,
                             keep_jacobian=keep_jacobian)[0]
            stack, blocks = sl.upper, ((sl.jacobian, sl.rounding) if keep_jacobian else None)
        except InputError:
            if route == "stack":
                raise
    lip_in, lip_out, layers, taken = math.inf, math.inf, [], []
    try:
        lip_in, lip_out, product = _product_route(spec, X, rho, cache, jacobian, layers, taken)
    except InputError:
        # Note [either route]: a ball the product route refuses (a norm with eps = 0 whose stage ball
        # reaches a constant token, a softmax weight that underflows on its grown radius) may still be
        # certified by the stack route, whose radii do not compound; refuse only when both do (before
        # stop 36 the product route's refusal ended the call with the stack's 6.95 in hand)
        if stack == math.inf:
            raise
        product = math.inf
    taken = ([t for t in taken if t == "input_norm"]
             + [f"layer {ll.index} {c}" for ll in layers for c in ll.global_parts]
             + [t for t in taken if t == "final_norm"])
    return NetworkLocal(rho, lip_in, layers, lip_out, min(product, stack), product, stack, blocks, tuple(taken))


def _product_route(spec: TransformerSpec, X: Tensor, rho: float, cache: dict, jacobian: bool,
                   layers: list, taken: list) -> tuple[float, float, float]:
    """``network_local``'s composition route: (input norm's, final norm's, whole) constants; the
    per-layer results are appended to ``layers`` as they are certified, and "input_norm", "final_norm" to ``taken``
    where F14's global constant is the smaller (Note [global on a component's ball])."""
    from ..norms import NormMeasure
    from ._weights import _norm_bounds

    lip_in = 1.0
    r = rho
    if spec.input_norm is not None:
        n0, _ = norm_local(spec.input_norm, X, rho)
        lip_in = _smaller(float(n0.max()), _global_norm(_norm_bounds(NormMeasure.of(spec.input_norm))), "input_norm",
                          taken)
        X = spec.input_norm(X)
        r = lip_in * rho * (1 + 1e-12) + f17_pad(X)
    total = lip_in
    for layer in spec.layers:
        ll = layer_local(layer, X, r, cache=cache, jacobian=jacobian)
        layers.append(ll)
        total *= ll.upper
        X = ll.out
        r = ll.upper * r * (1 + 1e-12) + f17_pad(X)
        if not r < math.inf:  # Note [unbounded inner ball]: no later layer has a finite ball; the product is inf
            return lip_in, math.inf, math.inf
    lip_out = 1.0
    if spec.final_norm is not None:
        lip_out = _smaller(float(norm_local(spec.final_norm, X, r)[0].max()),
                           _global_norm(_norm_bounds(NormMeasure.of(spec.final_norm))), "final_norm", taken)
        total *= lip_out
    return lip_in, lip_out, total * (1 + ROUNDING_PAD)
