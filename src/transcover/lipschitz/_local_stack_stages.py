"""The whole stack's sub-stages on the data path and their certified per-token ball constants
(issue 12; THEORY F33).

Each ``_Stage`` holds its input ``x`` on the data path, its tangent map ``lin``
(``_local_stack_maps``), the certified point rows ``pt_i >= nu_i(J_s(x))`` and ``bounds(r)``: for
per-token input radii ``r`` (T,), every token ``j`` of the stage's input within ``r_j`` of ``x_j``,

* ``dJ``  (T,): ``nu_i(J_s(y) - J_s(x)) <= dJ_i`` (the drift rows),
* ``dJc`` (T,): the same for ``P_c (J_s(y) - J_s(x))`` when the next stage is a LayerNorm
  (``P_c = I - 11^T/d``; its Jacobian kills the mean, ``D P_c = D``), else ``dJ``,
* ``ball`` (T,): ``sup nu_i(J_s(y))``.

* ``heads`` (attention only): ``(dZ, a, c)`` with ``dJ_i <= a sum_h ||W_O^h|| dZ_{h,i} + c_i``, ``dZ`` (H, T)
  the heads' drift rows before ``W_O`` (``attention_drift_rows``), so a suffix can see the change
  through its own ``S W_O^hT`` (THEORY F33 item 4).

``local``: the stage acts on each token alone (block-diagonal Jacobian), so its row ``i`` depends on
token ``i``'s radius only.  The per-stage formulas are F17's (norm floor, attention drift rows
``attention_drift_rows``, FFN drift ``ffn_drift_constant``), applied per token, with a norm's Jacobian drift the
smaller of F17's and the sphere's curvature (``norm_drift``, THEORY F43a, F48a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..model import Activation, NormKind, Placement, attention_forward, ffn_forward
from ._local_jacobian import _head_data, _weight_norms, certified_spectral, point_slope_err, pow2_norm, pre_activations
from ._local_joint import norm_drift
from ._local_stack_maps import _AttnLin, _AttnRes, _f64, _NormLin, _TokenLin, check_stack_layer
from ._weights import ROUNDING_PAD

_U = 2.0**-53


@dataclass
class _Stage:
    name: str
    group: int  # stages of one layer share a group (error propagation by the layer's own constant)
    x: Tensor
    lin: object
    local: bool
    pt: Tensor  # (T,) certified nu_i(J_s(x))
    bounds: Callable[[Tensor], tuple]  # r -> (dJ, dJc, ball, heads), ``heads`` below or None
    layernorm: bool = False  # a LayerNorm stage (the previous stage's drift may be centred)
    ffn: object = None  # the FFN spec of a stage ``h -> h + FFN(h)`` with no norm inside (post-LN; THEORY F40)
    attn: dict | None = None  # a post-LN attention ``x -> x + A(x)``: its heads at x and norms (THEORY F44)
    # Note [per-layer refusals]: where ``bounds`` gave no bound (inf rows) and why, one line each
    refusals: list = field(default_factory=list)

    @property
    def k(self) -> int:
        return self.lin.k

    @property
    def p(self) -> float:
        return float(self.pt.max())


def _inf(T: int) -> tuple:
    v = torch.full((T,), math.inf, dtype=torch.float64)
    return v, v, v, None


def _active(n) -> bool:  # noqa: ANN001
    return n is not None and n.kind is not NormKind.NONE


def _gmax(n) -> float:  # noqa: ANN001
    return 1.0 if n is None or n.weight is None else n.gamma_max_abs * (1 + ROUNDING_PAD)


def norm_stage(name: str, group: int, norm, Z: Tensor) -> _Stage:  # noqa: ANN001
    """A LayerNorm/RMSNorm on its own: ``nu_i = ||D_i|| <= max|gamma|/s_i``; on the ball the floor
    ``s_i >= sqrt((sigma_i - r_i/sqrt d)_+^2 + eps)`` and ``||D'_i - D_i|| <= max|gamma| e_i``, ``e_i`` the smaller
    of F17's ``2 r_i/(sqrt d s_floor^2)`` and the sphere's curvature (``norm_drift``, THEORY F43a, F48a), per token."""
    nl = _NormLin(norm, Z)
    T, d = Z.shape
    g = _gmax(norm)
    pt = (g / nl.s + nl.err) * (1 + ROUNDING_PAD)  # s* may sit below s (F17f)

    def bounds(r: Tensor) -> tuple:
        e, sf = norm_drift(norm, nl.sigma, r, d)
        dj = torch.nan_to_num(g * e * (1 + ROUNDING_PAD), nan=math.inf)
        return dj, dj, torch.minimum(g / sf * (1 + ROUNDING_PAD), pt + dj), None

    return _Stage(name, group, Z, nl, True, pt, bounds, layernorm=nl.lay)


def _ffn_parts(layer, H: Tensor, cache: dict) -> dict:  # noqa: ANN001
    """The FFN's per-token Jacobians ``F_i`` at H (column convention), their abs evaluation, rounding
    pads and the drift function ``dF(rh, centred)`` of ``_local_rows`` (Hadamard-Gram kappa, curvature
    bound, cap), with the data-free constants cached per layer.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    from ._activations import activation_lipschitz
    from ._local import second_derivative_sup
    from ._local_rows import drift_kappa

    ffn = layer.ffn
    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    z, ez = pre_activations(ffn, H)
    z = z.clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(ffn.activation(z).sum(), z)
    slope = slope.detach()
    F = (W2.T[None] * slope[:, None, :]) @ W1.T
    Fa = (W2.T.abs()[None] * slope.abs()[:, None, :]) @ W1.T.abs()
    w = cache["w"]  # eF: the rounding and the slope's move from the exact z (F51a, red17-2; spectral norms)
    eF = (4 * (W1.shape[1] + 8) * _U * float(pow2_norm(W1) * pow2_norm(W2)) * (slope.abs().max(dim=1).values + 1.0)
          + point_slope_err(ffn.activation, z.detach(), ez) * w["W1"] * w["W2"] * (1 + 1e-12))
    # kept where ``layer_rows`` looks for them (``drift_kappa``), so the per-layer route does not recompute them; the
    # centred constant only when a LayerNorm follows the FFN
    lay = layer.norm_ffn is not None and layer.norm_ffn.kind is NormKind.LAYERNORM
    s2 = second_derivative_sup(ffn.activation)
    gelu_range = (math.erf(1.0) + 2 * math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)) * (1 + 1e-9)
    cap = (gelu_range if Activation(ffn.activation) is Activation.GELU
           else 2 * activation_lipschitz(ffn.activation)) * w["W1"] * w["W2"] * (1 + ROUNDING_PAD)
    lffn = activation_lipschitz(ffn.activation) * w["W1"] * w["W2"] * (1 + ROUNDING_PAD) ** 2

    def dF(rh: Tensor, centred: bool) -> Tensor:
        kap = drift_kappa(ffn, w, centred and lay)
        return torch.minimum(torch.minimum(kap * rh, s2 * w["ffn_curv"] * rh), torch.full_like(rh, cap))

    return {"F": F, "Fa": Fa, "eF": eF, "dF": dF, "lffn": lffn, "dff": W1.shape[1]}


def _attn_stage(name: str, group: int, layer, X: Tensor, n1: _NormLin | None, cache: dict) -> tuple[_Stage, Tensor]:  # noqa: ANN001
    """``x -> x + A(n1(x))``: drift rows ``nu_i(dA)`` from ``attention_drift_rows`` (heads combined
    through ``W_O``) at the largest radius reaching the attention (every key moves); pre-LN adds the
    norm's drift, ``dA sup||D1'|| + sup nu_i(A') max||dD1||``; ball ``1 + sup nu_i(A') sup||D1'||``."""
    from ._local_attention import attention_local_bound
    from ._local_drift import heads_joint, output_block_norms
    from ._local_rows import _head_output_norms, _heads_combined, _HeadMoments, attention_drift_rows

    attn = layer.attention
    T, d = X.shape
    Xin = X if n1 is None else layer.norm_attn(X).detach()
    heads = _head_data(attn, Xin)
    mom = _HeadMoments(heads, attn.softmax_scale)
    Oh, _ = _head_output_norms(None, None, heads, T)
    Oall = torch.full((T,), float(cache["h"]["O"]), dtype=torch.float64)
    Cw = output_block_norms(heads)  # F35d
    att0 = attention_local_bound(attn, Xin, 0.0, norms=cache["h"]).per_query
    g1 = _gmax(layer.norm_attn) if n1 is not None else 1.0
    nD1 = g1 / n1.s * (1 + 1e-12) if n1 is not None else torch.ones(T, dtype=torch.float64)
    pt = (1 + att0 * float(nD1.max())) * (1 + 1e-12)
    refused: list = []

    def bounds(r: Tensor) -> tuple:
        if n1 is not None:
            e1, sf1 = norm_drift(layer.norm_attn, n1.sigma, r, d)  # F17 or F43a (F48a)
            sD1 = torch.minimum(g1 / sf1, nD1 + g1 * e1)
        else:
            e1, sD1 = torch.zeros_like(r), torch.ones_like(r)
        ry = float((r * sD1).max()) * (1 + 1e-12)
        if not (math.isfinite(ry) and bool(torch.isfinite(e1).all())):
            return _inf(T)
        try:
            dZ = attention_drift_rows(mom, ry, cache["w"])
            dA = _heads_combined(Oh, Oall, dZ, heads_joint(Cw, dZ))
            att = attention_local_bound(attn, Xin, ry, norms=cache["h"]).per_query
        except torch.linalg.LinAlgError as e:  # an eigensolver given an overflowed Gram: no bound; other errors are bugs
            refused.append(f"{name} at radius {ry:.6g}: LinAlgError: {e}")
            return _inf(T)
        mD1, mE1 = float(sD1.max()), float((g1 * e1).max())
        dj = (dA * mD1 + att * mE1) * (1 + 1e-12)
        dj = torch.nan_to_num(dj, nan=math.inf)
        return dj, dj, torch.minimum(1 + att * mD1, pt + dj) * (1 + 1e-12), (dZ, mD1, att * mE1)

    lin = _AttnRes(_AttnLin(attn, Xin), n1, T, d)
    parts = None if n1 is not None else {"heads": heads, "mom": mom, "scale": attn.softmax_scale, "norms": cache["w"],
                                         "Oh": Oh, "Oall": Oall, "Cw": Cw,
                                         "Wqa": [_f64(attn.W_Q_augmented(h)) for h in range(attn.n_heads)], "X": Xin}
    return _Stage(name, group, X, lin, False, pt, bounds, attn=parts, refusals=refused), X + attention_forward(attn, Xin)


def _ffn_stage(name: str, group: int, layer, S: Tensor, n2: _NormLin | None, centred: bool,  # noqa: ANN001
               cache: dict) -> tuple[_Stage, Tensor]:
    """``s -> s + FFN(n2(s))``, per token ``J_i = I + F_i D2_i``: drift ``dF(r_i sup||D2'||) sup||D2'||
    + ||F_i Gamma|| e2_i`` (pre-LN; ``D2 = I`` post-LN, where the centred ``kappa`` serves when a
    LayerNorm follows), ball ``min(pt + drift, 1 + Lip(FFN) sup||D2'||)``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = S.shape
    norm = layer.norm_ffn if n2 is not None else None
    H = S if n2 is None else norm(S).detach()
    fp = _ffn_parts(layer, H, cache)
    F, Fa, eF = fp["F"], fp["Fa"], fp["eF"]
    eye = torch.eye(d, dtype=torch.float64)
    g2 = _gmax(norm) if n2 is not None else 1.0
    if n2 is None:
        M, Ma, eM = eye + F, eye + Fa, eF
        nFg = None
        nD2 = torch.ones(T, dtype=torch.float64)
    else:
        D2, D2a = n2.matrices(), n2.matrices(True)
        M, Ma = eye + F @ D2, eye + Fa @ D2a
        nD2 = g2 / n2.s * (1 + 1e-12) + n2.err  # s* may sit below s (F17f)
        # F's error through D2, and D2's construction (8d + 8 roundings) and the product's through |F|
        k = 9 * d + 16
        eM = eF * nD2 + k * _U / (1 - k * _U) * pow2_norm(Fa @ D2a, (1, 2)) * (1 + 1e-12)
        gv = torch.ones(d, dtype=torch.float64) if norm.weight is None else _f64(norm.weight).abs() * (1 + ROUNDING_PAD)
        nFg = certified_spectral(F * gv[None, None, :]) + eF * g2
    pt = (certified_spectral(M) + eM) * (1 + 1e-12)
    lffn = fp["lffn"]

    def bounds(r: Tensor) -> tuple:
        if n2 is None:
            dj, djc = fp["dF"](r, False), fp["dF"](r, centred)
            return dj, djc, torch.minimum(pt + dj, torch.full_like(dj, 1 + lffn)), None
        e2, sf2 = norm_drift(norm, n2.sigma, r, d)  # F17 or F43a (F48a)
        sD2 = torch.minimum(g2 / sf2, nD2 + g2 * e2)
        dj = (fp["dF"](r * sD2 * (1 + 1e-12), False) * sD2 + nFg * e2) * (1 + 1e-12)
        dj = torch.nan_to_num(dj, nan=math.inf)
        return dj, dj, torch.minimum(pt + dj, 1 + lffn * sD2), None

    k = 8 * (3 * d + fp["dff"]) + 8
    st = _Stage(name, group, S, _TokenLin(M, Ma, k), True, pt, bounds, ffn=layer.ffn if n2 is None else None)
    return st, S + ffn_forward(layer.ffn, H)


def layer_cache(layer, cache: dict) -> dict:  # noqa: ANN001
    """``cache`` with the layer's weight-only constants (``"h"``: ``head_norms``, ``"w"``: ``_weight_norms``) after the
    layer's checks (``check_stack_layer``; Note [local weight range] before ``_weight_norms`` can raise), as
    ``layer_stages`` reads them."""
    from ._local_attention import check_layer_range, head_norms

    check_stack_layer(layer)
    if "w" not in cache:
        cache["h"] = head_norms(layer.attention)
        check_layer_range(layer, {"O": cache["h"]["O"]})
        cache["w"] = _weight_norms(layer)
    return cache


def layer_stages(layer, X: Tensor, cache: dict) -> tuple[list[_Stage], Tensor, Tensor]:  # noqa: ANN001
    """The sub-stages of one layer at X (Note [sub-stages] in ``_local_stack_maps``: the attention
    first, then the token-local ones), the layer's output, and (T,) a certified ``m_i >= ||M_i(X)||``
    for the product ``M_i`` of the token-local sub-stages' Jacobians (post-LN ``D2_i (I + F_i) D1_i``,
    taken exactly rather than as a product of norms), so ``nu_i(J_L) <= m_i nu_i(I + A)``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    layer_cache(layer, cache)
    X = X.detach().double()
    T, d = X.shape
    g = layer.index
    nm = f"layer {g}"
    if layer.placement is Placement.POST:
        att, S1 = _attn_stage(f"{nm} attention", g, layer, X, None, cache)
        out = [att]
        H = S1
        if _active(layer.norm_attn):
            out.append(norm_stage(f"{nm} norm_attn", g, layer.norm_attn, S1))
            H = layer.norm_attn(S1).detach()
        lay2 = _active(layer.norm_ffn) and layer.norm_ffn.kind is NormKind.LAYERNORM
        ffn, S2 = _ffn_stage(f"{nm} ffn", g, layer, H, None, lay2, cache)
        out.append(ffn)
        Y = S2
        if _active(layer.norm_ffn):
            out.append(norm_stage(f"{nm} norm_ffn", g, layer.norm_ffn, S2))
            Y = layer.norm_ffn(S2).detach()
        # the whole layer: nu_i(M_i (I + A)) <= ||M_i|| nu_i(I + A), M_i the token-local product
        Ms = [st.lin.matrices() if isinstance(st.lin, _NormLin) else st.lin.Mt.transpose(1, 2) for st in out[1:]]
        Mas = [st.lin.matrices(True) if isinstance(st.lin, _NormLin) else st.lin.Mat.transpose(1, 2) for st in out[1:]]
        M, Ma = Ms[0], Mas[0]
        for A, Aa in zip(Ms[1:], Mas[1:]):
            M, Ma = A @ M, Aa @ Ma
        # the product's rounding, the factors' construction included: gamma_k of its abs evaluation
        k = 8 * (3 * d + layer.ffn.W_1.shape[1]) + 8
        eM = k * _U / (1 - k * _U) * pow2_norm(Ma, (1, 2)) * (1 + 1e-12)  # at a power of two: 0 for a 2^-580 M
        mL = torch.minimum((certified_spectral(M) + eM) * (1 + 1e-12), math.prod(st.pt for st in out[1:]))
        if att.attn is not None:  # THEORY F44g: (H, T) ||M_i W_O^hT|| and (T,) ||M_i W_O^T||, M_i at x
            from ._local_rows import _head_output_norms

            att.attn["MO"] = _head_output_norms(M, eM, att.attn["heads"], T)
            att.attn["M"] = (M, eM)  # THEORY F50: the joint heads through M
        return out, Y, mL
    n1 = _NormLin(layer.norm_attn, X) if _active(layer.norm_attn) else None
    att, S1 = _attn_stage(f"{nm} attention", g, layer, X, n1, cache)
    n2 = _NormLin(layer.norm_ffn, S1) if _active(layer.norm_ffn) else None
    ffn, Y = _ffn_stage(f"{nm} ffn", g, layer, S1, n2, False, cache)
    return [att, ffn], Y, ffn.pt
