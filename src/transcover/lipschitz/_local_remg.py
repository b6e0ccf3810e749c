"""The first norm's own remainder through ``(I + F)`` with the norm's ``gamma`` inside, post-LN (issue 12; THEORY F55).

F34b/F47 bound the second-order remainder of S2's move through ``(I + F) D1`` by ``remG = min(||I + F|| remH_att, F32's
chains, F47's joint) + ||I + F|| remN`` with ``remN`` the first norm's own remainder (F34b's drift form or F41c's
sphere), each carrying ``max|gamma1|``.  The norm's remainder is ``diag(gamma1)`` times the remainder of the norm
without ``gamma`` (the bias cancels), so through ``I + F`` it is at most ``||(I + F) diag(gamma1)||`` times that
``gamma``-free remainder, and on MiniLM ``||(I + F) diag(gamma1)||`` is 0.41-0.45 of ``||I + F|| max|gamma1|``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_jacobian import certified_spectral, pow2_norm
from ._local_joint import norm_drift, norm_remainder, sphere_remainder
from ._local_rows import _U, _gamma_vec, _heads_combined

__all__ = ["if_gamma_norm", "gamma_free_norm_remainder", "remg_gamma", "first_norm_gamma"]


def if_gamma_norm(IF: Tensor, eF: Tensor, gamma: Tensor, g: float) -> Tensor:
    r"""(T,) certified ``||(I + F_i) diag(gamma)||`` (THEORY F55a) from the formed ``I + F`` (T, d, d), within ``eF``
    (spectral) of the exact one, and ``gamma`` = ``|gamma|`` padded (``_gamma_vec``), ``g >= max|gamma|``.

    ``||A* Gamma|| <= ||A Gamma|| + eF g`` (``A*`` exact); the formed product ``fl(A |gamma|)`` (columns scaled, one
    rounding an entry; ``diag(sign gamma)`` is orthogonal) is within ``u ||A |gamma|||_F <= u (1 + u) ||fl(A
    |gamma|)||_F`` of the exact one (Frobenius bounds spectral), padded ``2u``; ``certified_spectral`` of the formed
    product.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    A = IF * gamma[None, None, :]
    return (certified_spectral(A) + 2 * _U * pow2_norm(A, (1, 2)) + eF * g) * (1 + 1e-12)


def gamma_free_norm_remainder(norm, sig: Tensor, s: Tensor, r1: Tensor, d: int) -> Tensor:  # noqa: ANN001
    """(T,) the first norm's own remainder with ``max|gamma| = 1`` (``gamma`` left out, THEORY F55a): the smaller of
    F34b's drift form (``norm_remainder``) and F41c's sphere (``sphere_remainder``) on the centred input ball of radii
    ``r1``; ``sig`` the norm's sigma, ``s`` its ``(sigma^2 + eps)^{1/2}`` at X."""
    e, _ = norm_drift(norm, sig, r1, d)
    return torch.minimum(norm_remainder(1.0, e, r1), sphere_remainder(1.0, s, r1, d))


def remg_gamma(at, pt, att, nIFG: Tensor) -> Tensor:  # noqa: ANN001
    r"""(T,) F55a's branch of ``remG`` (``post_first_norm``'s remainder of S2's move through ``(I + F) D1``):

    .. math:: \min\big(\|I + F\|\,rem_{H,att},\ \textstyle\sum_h \|(I + F)D_1W_O^{hT}\|\,\|R_h\| \wedge \text{stacked},\
              F47_{(I+F)D_1}\big) + \|(I + F)\,\mathrm{diag}(\gamma_1)\|\,rem_N^{\gamma = 1}

    with ``rem_{H,att} = min(||D1|| remA, F32's chains through D1, F47_{D1})`` (F34b, F47), the same attention terms as
    ``post_first_norm``; only the norm's own remainder changes.  Post-LN with a scaling first norm; inf where a term
    is nan (a zero map times an infinite remainder)."""
    remHatt = torch.minimum(torch.minimum(at.nD1 * att.remA, _heads_combined(*pt.D1O, att.remV)), att.remJ["H"])
    attG = torch.minimum(pt.nIF * remHatt, torch.minimum(_heads_combined(*pt.IFD1O, att.remV), att.remJ["G"]))
    remN = gamma_free_norm_remainder(at.layer.norm_attn, at.sig1, at.n1.s, att.r1, at.d)
    return torch.nan_to_num(attG + nIFG * remN, nan=math.inf)


def first_norm_gamma(at, IF: Tensor) -> Tensor:  # noqa: ANN001
    """(T,) ``if_gamma_norm`` of a post-LN layer's ``I + F`` (formed, within ``at.eF``) and first norm (``LayerAtX``)."""
    return if_gamma_norm(IF, at.eF, _gamma_vec(at.layer.norm_attn, at.d), at.g1)
