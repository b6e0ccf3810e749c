"""Hard projections applied after each optimiser step: exact, by SVD, certified after the cast (seed 5.2).

.. math::

    P_c(W) = U \\min(S, c) V^T \\quad (W = U S V^T),

the Frobenius-nearest matrix with ``||W||_2 <= c`` (Eckart--Young--Mirsky applied to the singular
values above c).  For a per-head product ``M_h = scale A_h B_h^T`` the projection shrinks both
factors only along the offending singular directions (Note [product projection]), so that
``||scale A'_h B'^T_h||_2 = min(sigma_h, c)`` while everything else is left as it was.

Note [cast margin]: the projection is computed in float64 and written back in the parameter's
dtype, and that rounding can push sigma above c (bf16: sigma/c up to 1.0035 measured before this
note existed).  Rounding to a dtype with unit roundoff ``u`` (``eps/2``) and subnormal half-spacing
``eta`` moves each entry by at most ``u |w_ij| + eta``, so

.. math::

    \\|\\mathrm{fl}(W) - W\\|_2 \\le \\|\\mathrm{fl}(W) - W\\|_F \\le u \\|W\\|_F + \\eta \\sqrt{mn}
    \\quad\\Rightarrow\\quad
    \\sigma(\\mathrm{fl}(P_{c'}(W))) \\le c' + u \\|P_{c'}(W)\\|_F + \\eta\\sqrt{mn},

and for a product ``s (A + dA)(B + dB)^T`` the error is at most
``s (e_A ||B||_2 + ||A||_2 e_B + e_A e_B)`` with ``e_X = u ||X||_F + eta sqrt(size)``.  We project to
``c' = c - margin``: first with the typical margin ``2 u c`` (rounding errors rarely align), and if
the certified norm of the *stored* weights (``transcover.norms``, Gram + Cholesky certificate, kind
certified) still exceeds ``c``, with the proven margin above, then doubling it.  Every margin adds
``_REL_FLOOR * c``, which covers the certificate's own slack (~1e-9 relative) and the float64
reconstruction error (~1e-15 relative).  So after a projection the certified norm of what is
stored is ``<= c`` for float64, float32, fp16 and bf16 parameters alike.

Note [boundary check]: a matrix whose float64 SVD gives ``sigma_max <= c (1 - 1e-6)`` is left as is
(the float64 SVD's error is ~1e-15 relative, nine orders of magnitude smaller); one closer to ``c``
is certified as stored and projected only if the certificate exceeds ``c``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from .._errors import InputError
from ._checks import check_number, check_weight
from ._layout import HeadLayout
from ._spectral import check_radius

__all__ = ["project_spectral_", "project_product_", "project_bias_", "rounding_of", "certified_sigma",
           "radius_floor"]

_REL_FLOOR = 4e-9
_NEAR = 1e-6
_MAX_DOUBLINGS = 60
# a head whose product exceeds its radius by more than this is written in balanced factors (``project_product_``):
# below (1/u)^2 = 2^104 of float64 with room, where the shrunk factors' rounding starts to exceed what they keep
_BALANCE = 2.0**80


def rounding_of(dtype: torch.dtype) -> tuple[float, float]:
    """``(u, eta)``: unit roundoff ``eps/2`` and half the subnormal spacing of ``dtype`` (round to nearest)."""
    fi = torch.finfo(dtype)
    return float(fi.eps) / 2.0, float(fi.smallest_normal) * float(fi.eps) / 2.0


def radius_floor(radius: Tensor) -> float:
    """A float64 number ``<= c`` for any real ``c`` whose rounding to ``radius.dtype`` is ``radius``.

    A cap stores its radius in the parameter dtype; round to nearest gives ``|fl(c) - c| <= u |c|``
    where ``c`` is normal and ``<= eta`` (half the subnormal spacing) where it is not, so
    ``c >= fl(c) (1 - u) - eta`` (one more float64 ulp of slack for the product itself; the
    ``- eta`` since stop 36: an fp16 radius of 1.1e-6 rounds up by 2.7 %, far beyond ``u``).
    """
    u, eta = rounding_of(radius.dtype)
    return max(float(radius) * (1.0 - u - 2.0**-52) - eta, 5e-324)  # a radius is a float > 0, so >= 2^-1074


def certified_sigma(W: Tensor) -> float:
    """Certified upper bound on ``||W||_2`` of a stored matrix (its float values upcast exactly)."""
    from ..norms import spectral_norm_interval

    return spectral_norm_interval(W.detach().cpu()).upper


def certified_product_sigma(A: Tensor, B: Tensor, scale: float) -> float:
    """Certified upper bound on ``||scale A B^T||_2`` for stored factors ``A`` (m, k), ``B`` (n, k)."""
    from ..norms import product_norm_interval, scale_interval

    iv = product_norm_interval(A.detach().cpu(), B.detach().cpu().transpose(-1, -2))
    return scale_interval(iv, abs(float(scale))).upper  # ||s M|| = |s| ||M|| (a negative s crashed here, stop 38)


def certified_vector_norm(b: Tensor) -> float:
    from ..norms import vector_norm_interval

    return vector_norm_interval(b.detach().cpu().double().numpy()).upper


def _shrink_until_certified(write: Callable[[float], None], certify: Callable[[], float], c: float,
                            typical: float, proven: float) -> None:
    """Write the projection at ``c - margin`` for growing margins until the certified norm is ``<= c``."""
    floor = _REL_FLOOR * c
    margins = [typical + floor, proven + floor]
    margins += [margins[-1] * 2.0**k for k in range(1, _MAX_DOUBLINGS)]
    for m in margins:
        write(max(c - m, 0.0))
        if certify() <= c:
            return
    # not reached: every write at c' = 0 stores exact zeros, whose certified norm is 0
    raise RuntimeError(f"internal error: could not certify a projection to radius {c}")


@torch.no_grad()
def project_spectral_(W: Tensor, radius: float) -> Tensor:
    """Clip the singular values of ``W`` (..., m, n) to ``radius``, in place, certified after the cast.

    .. math::  W \\leftarrow \\mathrm{fl}(U \\min(S, c') V^T),\\quad c' = c - \\text{margin}

    (Note [cast margin]): afterwards the certified ``||W||_2`` of every stored matrix is ``<= c``.

    Args:
        W: a matrix or a stack of matrices (each projected on its own).
        radius: c > 0.

    Returns:
        The singular values' maxima *before* projection, shape ``(...)`` (float64).

    Raises:
        InputError: radius not a finite positive number; ``W`` not a matrix, not real floating
            point (a complex one lost its imaginary part, red team 190) or with NaN/inf entries (a raw
            ``torch.linalg`` error, or an ``IndexError`` for ``0 x n``, before stop 36).

    Example:
        >>> W = torch.diag(torch.tensor([3.0, 0.5]))
        >>> _ = project_spectral_(W, 1.0)
        >>> [round(x, 6) for x in W.diagonal().tolist()]
        [1.0, 0.5]
    """
    c = check_radius(radius)
    if W.dim() < 2:
        raise InputError(f"project_spectral_ needs a matrix or a stack of matrices, but got shape {tuple(W.shape)}")
    check_weight(W, "the projected weight")
    if W.numel() == 0:  # an empty matrix has norm 0: nothing to project
        return torch.zeros(W.shape[:-2], dtype=torch.float64)
    W64 = W.detach().double()
    U, S, Vh = torch.linalg.svd(W64, full_matrices=False)
    before = S[..., 0].clone()
    u, eta = rounding_of(W.dtype)
    for idx in itertools.product(*map(range, W.shape[:-2])):
        s_max = float(before[idx])
        if s_max <= c * (1.0 - _NEAR):
            continue
        Wi = W[idx]
        if s_max <= c and certified_sigma(Wi) <= c:
            continue
        Ui, Si, Vhi = U[idx], S[idx], Vh[idx]
        fro = float(Si.clamp(max=c).norm())  # ||P_c'(W)||_F <= this for every c' <= c
        proven = u * fro + eta * (Wi.numel() ** 0.5)

        def write(ck: float, Wi=Wi, Ui=Ui, Si=Si, Vhi=Vhi) -> None:
            Wi.copy_((Ui * Si.clamp(max=ck)[None, :]) @ Vhi)

        _shrink_until_certified(write, lambda Wi=Wi: certified_sigma(Wi), c, 2.0 * u * c, proven)
    return before


def _shrunk(a: Tensor, U: Tensor, S: Tensor, ck: float) -> Tensor:
    """``(I - U D U^T) a`` with ``D = diag(1 - sqrt(min(1, ck/S)))`` (Note [product projection]), formed stably.

    Only the directions with ``S > ck`` move.  The rest of ``a`` outside them is orthogonalised twice against them
    (Kahan-Parlett: twice is enough), and what is kept inside them is added back scaled: the one-pass
    ``a - U D U^T a`` leaves rounding of size ``u ||a||`` in a shrunk direction, which exceeds what is kept there
    (``sqrt(ck/S)`` of it) once ``S/ck > 1/u^2``, so a diverged head came back far above its radius (stop 38).
    """
    hi = S > ck
    if not bool(hi.any()):
        return a.clone()
    Uh = U[:, hi]
    c1 = Uh.T @ a
    r = a - Uh @ c1
    c2 = Uh.T @ r
    r = r - Uh @ c2
    keep = torch.sqrt(torch.clamp(ck / S[hi].clamp_min(1e-300), max=1.0))
    return r + Uh @ (keep[:, None] * (c1 + c2))


def _product_projection(A64: Tensor, B64: Tensor, scale: float):
    """QR of both factors and SVD of the small core (Note [product projection]), per head."""
    Qa, Ra = torch.linalg.qr(A64)
    Qb, Rb = torch.linalg.qr(B64)
    Uc, S, Vch = torch.linalg.svd(scale * Ra @ Rb.transpose(-1, -2), full_matrices=False)
    return Qa @ Uc, S, Qb @ Vch.transpose(-1, -2)


@torch.no_grad()
def project_product_(A: Tensor, B: Tensor, radius: float, scale: float = 1.0) -> Tensor:
    """Make ``||scale * A_h B_h^T||_2 <= radius`` for every head, in place, certified after the cast.

    Note [product projection]: with thin QR ``A = Q_a R_a``, ``B = Q_b R_b`` and the SVD of the
    small core ``scale R_a R_b^T = U_c S V_c^T``, the product is ``M = U S V^T`` with
    ``U = Q_a U_c``, ``V = Q_b V_c``.  Setting ``D = diag(1 - sqrt(min(1, c'/S)))``,

    .. math::

        A' = (I - U D U^T) A,\\qquad B' = (I - V D V^T) B
        \\;\\Rightarrow\\; \\text{scale}\\,A' B'^T = U\\,\\min(S, c')\\,V^T .

    Only the directions whose singular value exceeds c' move, symmetrically in both factors;
    ``c' = c - margin`` (Note [cast margin]) so that the certified norm of the stored factors'
    product is ``<= c``.  Cost O(H (d k^2 + k^3)), never forming the (d, d) product.

    Args:
        A: (H, m, k) left factors (e.g. W_Q^h), a view into the parameter is fine.
        B: (H, n, k) right factors (W_K^h or W_O^hT).
        radius: c > 0.
        scale: the product's constant (1/sqrt(d_head) for W_KQ).

    Returns:
        The per-head norms before projection (float64, shape (H,)).

    Raises:
        InputError: bad radius; ``scale`` not a finite number; factors not real floating point or with NaN/inf.
    """
    c = check_radius(radius)
    check_weight(A, "the projected product's left factor")
    check_weight(B, "the projected product's right factor")
    scale = check_number(scale, "scale")  # NaN reached the SVD as a _LinAlgError (red team 190)
    # copies: for float64 factors .double() is the parameter itself, and every retry of the write below would
    # start from the previous write (the head shrank to 3e-9 of its radius, stop 38)
    A64, B64 = A.detach().to(torch.float64, copy=True), B.detach().to(torch.float64, copy=True)
    U, S, V = _product_projection(A64, B64, scale)
    before = S[..., 0].clone()
    u, eta = rounding_of(A.dtype)
    u_b, eta_b = rounding_of(B.dtype)
    m, n, k = A.shape[-2], B.shape[-2], A.shape[-1]
    for h in range(A.shape[0]):
        s_max = float(before[h])
        # the QR-and-SVD norm errs by about u |s| ||A|| ||B||, which cancelling columns make far larger than the norm
        # itself: A = [2^60, 3, -2^60], B = [1, 1, 1] came out 0 for a product of 3 and the head was skipped (stop 38)
        err = 16 * (m + n + k) * 2.0**-53 * abs(scale) * float(A64[h].norm()) * float(B64[h].norm())
        if s_max + err <= c * (1.0 - _NEAR):
            continue
        if s_max <= c and certified_product_sigma(A[h], B[h], scale) <= c:
            continue
        # each singular value as an upper end (Weyl: the computed ones are exact for a product within err), so a
        # direction at the noise level (a rank-deficient factor's zero read as 5e-26) is not shrunk by c/5e-26 to
        # ten times c, which then ran the retries down to a zero head (stop 38)
        a64, b64, Uh, Sh, Vhh = A64[h], B64[h], U[h], S[h] + err, V[h]
        # the cast's margin from the factors as projected at c: at every c' <= c each direction is scaled by
        # sqrt(min(1, c'/S_i)), at most its value at c, so these norms bound the written factors' (stop 38: the
        # factors before projection made the margin exceed c for a diverged head, which was then written at c' = 0)
        a_c, b_c = _shrunk(a64, Uh, Sh, c), _shrunk(b64, Vhh, Sh, c)
        e_a = u * float(a_c.norm()) + eta * a64.numel() ** 0.5
        e_b = u_b * float(b_c.norm()) + eta_b * b64.numel() ** 0.5
        na, nb = float(torch.linalg.matrix_norm(a_c, 2)), float(torch.linalg.matrix_norm(b_c, 2))
        proven = abs(scale) * (e_a * nb + na * e_b + e_a * e_b) * (1.0 + 1e-6)
        # balanced factors where the shrunk ones cannot hold the radius: a diverged head (S/c beyond 2^80), or factors
        # so large against their product that the cast's margin eats a quarter of c (the head was written at c' = 0,
        # or bf16 kept 0.15 of it: stop 38). Their margin is the cast's on factors of norm sqrt(c/|s|).
        balanced = s_max > _BALANCE * c or proven > c / 4
        if balanced:
            root_c = (c / abs(scale)) ** 0.5
            e_a = u * root_c * k**0.5 + eta * a64.numel() ** 0.5
            e_b = u_b * root_c * k**0.5 + eta_b * b64.numel() ** 0.5
            proven = abs(scale) * (e_a * root_c + root_c * e_b + e_a * e_b) * (1.0 + 1e-6)

        def write(ck: float, h=h, a64=a64, b64=b64, Uh=Uh, Sh=Sh, Vhh=Vhh, balanced=balanced) -> None:
            if ck == 0.0:  # the last resort: a product of exactly 0
                A[h].zero_()
                B[h].zero_()
            elif balanced or float(Sh[0]) > _BALANCE * ck:
                # A's columns lie in span(U) only up to the QR's backward error u ||A||, which exceeds what the shrunk
                # directions keep: write the balanced factors of U min(S, c') V^T instead (the nearest product; the
                # factors' own balance is reset). U (m, r), V (n, r), r = min(m, n, k) <= k: the first r columns.
                root = torch.sqrt(Sh.clamp(max=ck) / abs(scale))
                r = root.shape[0]
                A[h].zero_()
                B[h].zero_()
                A[h][:, :r].copy_(Uh * root[None, :])
                B[h][:, :r].copy_(Vhh * (root * math.copysign(1.0, scale))[None, :])
            else:
                A[h].copy_(_shrunk(a64, Uh, Sh, ck))
                B[h].copy_(_shrunk(b64, Vhh, Sh, ck))

        _shrink_until_certified(write, lambda h=h: certified_product_sigma(A[h], B[h], scale), c,
                                2.0 * max(u, u_b) * c, proven)
    return before


@torch.no_grad()
def project_bias_(b: Tensor, radius: float) -> Tensor:
    """``b <- fl(b * c'/||b||_2)`` in place when ``||b|| > c``: the l2-ball projection (seed 2.1 B_b),
    with ``c'`` below ``c`` by the cast margin (``u c + eta sqrt(n)``, Note [cast margin]) so that
    the certified norm of the stored vector is ``<= c``.

    Returns the norm before projection.

    Raises:
        InputError: radius not a finite number > 0; ``b`` not a vector (a matrix had its Frobenius
            norm projected, red team 190), not real floating point, or with NaN/inf entries (a NaN
            norm failed ``n > c`` and the vector was returned as it was, before stop 36).
    """
    c = check_radius(radius)
    if not isinstance(b, Tensor) or b.dim() != 1:
        raise InputError(f"project_bias_ needs a vector, but got shape {tuple(getattr(b, 'shape', ()))}")
    check_weight(b, "the projected bias")
    b64 = b.detach().to(torch.float64, copy=True)  # a copy: a float64 bias is otherwise rescaled at every retry
    norm = b64.norm()
    n = float(norm)
    if n > c * (1.0 - _NEAR) and not (n <= c and certified_vector_norm(b) <= c):
        u, eta = rounding_of(b.dtype)
        proven = u * c + eta * b.numel() ** 0.5

        def write(ck: float) -> None:
            b.copy_(b64 * (ck / n))

        _shrink_until_certified(write, lambda: certified_vector_norm(b), c, 2.0 * u * c, proven)
    return norm


def project_heads_(T: Tensor, layout: HeadLayout) -> Tensor:
    """The writable ``(H, d, d_head)`` view of ``T`` that :func:`project_product_` modifies."""
    return layout.heads(T)
