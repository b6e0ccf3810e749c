"""Hard projections applied after each optimiser step: exact, by SVD (seed 5.2).

.. math::

    P_c(W) = U \\min(S, c) V^T \\quad (W = U S V^T),

the Frobenius-nearest matrix with ``||W||_2 <= c`` (Eckart--Young--Mirsky applied to the singular
values above c).  For a per-head product ``M_h = scale A_h B_h^T`` the projection shrinks both
factors only along the offending singular directions (Note [product projection]), so that
``||scale A'_h B'^T_h||_2 = min(sigma_h, c)`` exactly while everything else is left as it was.

All computations run in float64 and are written back in the parameter's dtype, so the projected
norm is ``c`` up to the rounding of that final cast (``~ sqrt(m n) * eps(dtype) * c``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._layout import HeadLayout
from ._spectral import check_radius

__all__ = ["project_spectral_", "project_product_", "project_bias_"]


@torch.no_grad()
def project_spectral_(W: Tensor, radius: float) -> Tensor:
    """Clip the singular values of ``W`` (..., m, n) above ``radius``, in place.

    .. math::  W \\leftarrow U \\min(S, c) V^T

    Args:
        W: a matrix or a stack of matrices (each projected on its own).
        radius: c > 0.

    Returns:
        The singular values' maxima *before* projection, shape ``(...)`` (float64).

    Raises:
        InputError: radius not a finite positive number.

    Example:
        >>> W = torch.diag(torch.tensor([3.0, 0.5]))
        >>> _ = project_spectral_(W, 1.0)
        >>> W.diagonal().tolist()
        [1.0, 0.5]
    """
    c = check_radius(radius)
    W64 = W.detach().double()
    U, S, Vh = torch.linalg.svd(W64, full_matrices=False)
    before = S[..., 0].clone()
    if bool((S > c).any()):
        W.copy_((U * S.clamp(max=c)[..., None, :]) @ Vh)
    return before


@torch.no_grad()
def project_product_(A: Tensor, B: Tensor, radius: float, scale: float = 1.0) -> Tensor:
    """Make ``||scale * A_h B_h^T||_2 <= radius`` for every head, in place, exactly.

    Note [product projection]: with thin QR ``A = Q_a R_a``, ``B = Q_b R_b`` and the SVD of the
    small core ``scale R_a R_b^T = U_c S V_c^T``, the product is ``M = U S V^T`` with
    ``U = Q_a U_c``, ``V = Q_b V_c``.  Setting ``D = diag(1 - sqrt(min(1, c/S)))``,

    .. math::

        A' = (I - U D U^T) A,\\qquad B' = (I - V D V^T) B
        \\;\\Rightarrow\\; \\text{scale}\\,A' B'^T = U\\,\\min(S, c)\\,V^T .

    Only the directions whose singular value exceeds c move, symmetrically in both factors.
    Cost O(H (d k^2 + k^3)), never forming the (d, d) product.

    Args:
        A: (H, m, k) left factors (e.g. W_Q^h), a view into the parameter is fine.
        B: (H, n, k) right factors (W_K^h or W_O^hT).
        radius: c > 0.
        scale: the product's constant (1/sqrt(d_head) for W_KQ).

    Returns:
        The per-head norms before projection (float64, shape (H,)).
    """
    c = check_radius(radius)
    A64, B64 = A.detach().double(), B.detach().double()
    Qa, Ra = torch.linalg.qr(A64)
    Qb, Rb = torch.linalg.qr(B64)
    Uc, S, Vch = torch.linalg.svd(scale * Ra @ Rb.transpose(-1, -2), full_matrices=False)
    before = S[..., 0].clone()
    if bool((S > c).any()):
        D = 1.0 - torch.sqrt(torch.clamp(c / S.clamp_min(1e-300), max=1.0))  # (H, r)
        U = Qa @ Uc
        V = Qb @ Vch.transpose(-1, -2)
        A.copy_(A64 - U @ (D[..., :, None] * (U.transpose(-1, -2) @ A64)))
        B.copy_(B64 - V @ (D[..., :, None] * (V.transpose(-1, -2) @ B64)))
    return before


@torch.no_grad()
def project_bias_(b: Tensor, radius: float) -> Tensor:
    """``b <- b * min(1, c / ||b||_2)`` in place (exact projection onto the l2 ball; seed 2.1 B_b).

    Returns the norm before projection.
    """
    c = check_radius(radius)
    norm = b.detach().double().norm()
    if float(norm) > c:
        b.mul_((c / norm).to(b.dtype))
    return norm


def project_heads_(T: Tensor, layout: HeadLayout) -> Tensor:
    """The writable ``(H, d, d_head)`` view of ``T`` that :func:`project_product_` modifies."""
    return layout.heads(T)
