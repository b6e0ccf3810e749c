"""Spectral normalisation to a radius: ``W -> W * min(1, c / sigma(W))`` (seed 5.2).

.. math::

    \\operatorname{cap}_c(W) = W \\cdot \\min\\!\\Big(1, \\frac{c}{\\sigma_1(W)}\\Big),
    \\qquad \\sigma_1(\\operatorname{cap}_c(W)) = \\min(\\sigma_1(W), c).

Unlike ``torch.nn.utils.parametrizations.spectral_norm`` (which divides by sigma, i.e. radius 1
and always rescales), the cap leaves a matrix already inside the spectral ball of radius ``c``
untouched, so a loose radius is a no-op and a schedule can tighten it gradually.

sigma is estimated by power iteration (Miyato et al. 2018, arXiv 1802.05957, Alg. 1) warm-started
from buffers ``u``, ``v`` (Note [warm start]).  Stacked tensors ``(H, m, n)`` are capped per head.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._errors import InputError, check_positive_int, check_radius, radius_in
from ._checks import check_weight

__all__ = [
    "power_iteration", "product_power_iteration", "spectral_cap", "remove_spectral_cap",
    "check_radius",
]

_WARMUP_ITERATIONS = 15


def _floor(x: Tensor) -> Tensor:
    """``x`` kept away from 0 (a divisor) by the dtype's smallest normal number.  A fixed 1e-12 used to scale every
    matrix of norm below it by ``c/1e-12``: at radius 1e-30 the capped weights came out 1e-18 of the radius, or 0
    in float32 (stop 38 red team)."""
    return x.clamp_min(torch.finfo(x.dtype).tiny)


def _normalize(x: Tensor) -> Tensor:
    """``x / ||x||`` along the last axis, scaled first by the power of two of its largest entry: at weights near 1e20
    in float32 the norm's squares overflowed, u became 0, sigma 0 and the cap a no-op (red team 171).  A power of two
    is exact, so in the normal range the result is bit for bit the unscaled one (a division by the largest entry
    moved ordinary runs by an ulp: red team 173).

    Note [zero restart]: a zero ``x`` gives the fixed unit vector :func:`_seed`, not 0.  Power iteration from 0 stays
    at 0, so a matrix that was all zero when its cap was registered (a zero-initialised output projection) kept
    ``u = 0``, sigma 0 and factor 1 for good, and grew to 918x its radius once trained (red team 190).
    """
    _, e = torch.frexp(x.abs().amax(dim=-1, keepdim=True))
    x = torch.ldexp(x, -e)
    norm = x.norm(dim=-1, keepdim=True)
    return torch.where(norm == 0, _seed(x), x / _floor(norm))


def _seed(x: Tensor) -> Tensor:
    """A deterministic unit vector of ``x``'s length, dtype and device: ``frac(k phi) - 1/2`` for k = 1..n
    (golden-ratio points spread over (-1/2, 1/2)), normalised.  Formed in float64 on the CPU: no entry is 0 there for
    n <= 2^22 (checked; the smallest |entry| before normalising is 6.4e-8, where float32 had 7 zeros at n = 2^14, red
    team 197); a float16 copy may flush the smallest to 0, which only leaves those coordinates to the next step.
    Formed once per length, dtype and device (formed on every forward it cost 1.5x the normalisation itself)."""
    return _seed_vector(x.shape[-1], x.dtype, x.device)


@functools.lru_cache(maxsize=64)
def _seed_vector(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    k = torch.arange(1, n + 1, dtype=torch.float64)
    s = torch.frac(k * 0.6180339887498949) - 0.5
    return (s / s.norm()).to(device=device, dtype=dtype)


def _check_iterations(n_iter: int) -> int:
    """``n_iter``, or :class:`InputError` unless it is an integer >= 0 (``bool`` refused)."""
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 0:
        raise InputError(f"n_iter must be an integer >= 0, but got n_iter={n_iter!r}")
    return n_iter


def _vecmat(u: Tensor, W: Tensor) -> Tensor:
    """``u^T W`` batched: (..., m) x (..., m, n) -> (..., n), as one (batched) matrix product."""
    return (u.unsqueeze(-2) @ W).squeeze(-2)


def _matvec(W: Tensor, v: Tensor) -> Tensor:
    """``W v`` batched: (..., m, n) x (..., n) -> (..., m)."""
    return (W @ v.unsqueeze(-1)).squeeze(-1)


def power_iteration(W: Tensor, u: Tensor, n_iter: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    r"""``n_iter`` steps of power iteration on ``W`` (..., m, n) from the left vector ``u`` (..., m).

    .. math::  v \leftarrow W^T u / \|W^T u\|, \quad u \leftarrow W v / \|W v\|,
               \quad \sigma = u^T W v .

    ``sigma`` is a lower estimate of ``||W||_2`` (it is ``u^T W v`` for unit ``u``, ``v``) that is
    differentiable in ``W`` with ``u``, ``v`` held fixed, as in Miyato et al. 2018, eq. (12).
    With ``n_iter = 0`` it is ``||W^T u||`` for the normalised ``u`` (``u`` is not assumed to be a
    unit vector: an all-ones start gave 3.46 for ``||W|| = 2``, red team 190).  A zero ``u`` or
    ``W^T u`` restarts from a fixed vector (Note [zero restart]).

    Raises:
        InputError: ``n_iter`` not an integer >= 0.

    Returns:
        ``(sigma, u, v)`` with shapes ``(...)``, ``(..., m)``, ``(..., n)``.

    Example:
        >>> W = torch.diag(torch.tensor([3.0, 1.0]))
        >>> round(float(power_iteration(W, torch.tensor([1.0, 1.0]), 30)[0]), 4)
        3.0
    """
    _check_iterations(n_iter)
    with torch.no_grad():
        Wd = W.detach()
        u = _normalize(u) if n_iter == 0 else u  # n_iter >= 1 renormalises u below (bit for bit as before)
        v = _normalize(_vecmat(u, Wd))
        for i in range(n_iter):
            if i:
                v = _normalize(_vecmat(u, Wd))
            u = _normalize(_matvec(Wd, v))
    sigma = (u * _matvec(W, v)).sum(-1)
    return sigma, u, v


def product_power_iteration(
    A: Tensor, B: Tensor, u: Tensor, n_iter: int = 1, scale: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Power iteration on ``M = scale * A B^T`` without forming ``M``.

    ``A`` is (..., m, k), ``B`` is (..., n, k) (for W_KQ^h: A = W_Q^h, B = W_K^h, scale =
    1/sqrt(d_head); for W_OV^h: A = W_V^h, B = (W_O^h)^T).  Cost O((m + n) k) per step instead of
    O(m n k): every product is a matrix-vector product through the rank-k factors.

    .. math::  v \leftarrow B (A^T u), \quad u \leftarrow A (B^T v),
               \quad \sigma = \text{scale}\,(A^T u)\cdot(B^T v).

    Returns ``(sigma, u, v)``; sigma is differentiable in ``A`` and ``B`` with ``u``, ``v`` fixed, and
    ``|sigma|`` is a lower estimate of ``||M||_2`` (``n_iter = 0`` and a zero ``u``: as in :func:`power_iteration`).
    """
    _check_iterations(n_iter)
    with torch.no_grad():
        Ad, Bd = A.detach(), B.detach()
        u = _normalize(u) if n_iter == 0 else u
        v = _normalize(_matvec(Bd, _vecmat(u, Ad)))
        for i in range(n_iter):
            if i:
                v = _normalize(_matvec(Bd, _vecmat(u, Ad)))
            u = _normalize(_matvec(Ad, _vecmat(v, Bd)))
    sigma = scale * (_vecmat(u, A) * _vecmat(v, B)).sum(-1)
    return sigma, u, v


class _SpectralCap(nn.Module):
    """Parametrization ``W -> W * min(1, c / sigma)`` with warm-started power iteration.

    Note [warm start]: ``u`` and ``v`` are buffers.  They are refined by ``n_power_iterations``
    steps at every forward in training mode only (in eval mode the estimate is frozen, so exported
    weights and evaluation are deterministic).  Fifteen iterations at registration give a good
    start; afterwards the weights move little per optimiser step, so one iteration per step tracks
    sigma (Miyato et al. 2018, Sec. 2.2).  The updated vectors are cloned before entering the graph
    so that a second forward before ``backward`` does not invalidate the first one.

    Note [scale factor]: ``u``, ``v`` are computed under ``no_grad``; only
    ``sigma = u^T W v`` (one batched bilinear form) is differentiated, which is the exact gradient
    of the cap with the singular vectors treated as constants -- the same convention as torch's
    ``spectral_norm``.  When ``sigma <= c`` the factor is the constant 1 and costs no gradient.
    """

    def __init__(self, W: Tensor, radius: float, n_power_iterations: int = 1):
        super().__init__()
        if W.dim() < 2:
            raise InputError(f"spectral_cap needs a matrix or a stack of matrices, got shape {tuple(W.shape)}")
        self.n_power_iterations = check_positive_int(n_power_iterations, "n_power_iterations")
        gen = torch.Generator().manual_seed(0)
        u0 = torch.randn(*W.shape[:-1], generator=gen, dtype=torch.float64).to(W.dtype)
        _, u, v = power_iteration(W.detach(), _normalize(u0.to(W.device)), _WARMUP_ITERATIONS)
        self.register_buffer("u", u)
        self.register_buffer("v", v)
        self.register_buffer("radius", torch.tensor(radius_in(radius, W.dtype), dtype=W.dtype, device=W.device))

    def sigma(self, W: Tensor) -> Tensor:
        """Current (differentiable) estimate of sigma of the *unconstrained* W, per matrix."""
        if self.training:
            _, u, v = power_iteration(W, self.u, self.n_power_iterations)
            with torch.no_grad():
                self.u.copy_(u)
                self.v.copy_(v)
        return (self.u.clone() * _matvec(W, self.v.clone())).sum(-1)

    def forward(self, W: Tensor) -> Tensor:
        sigma = self.sigma(W)
        factor = torch.clamp(self.radius / _floor(sigma), max=1.0)
        return W * factor[..., None, None]

    def right_inverse(self, W: Tensor) -> Tensor:
        # Assigning W stores it as the unconstrained weight: a W inside the ball is reproduced
        # exactly; a W outside it is capped when read, which is what "constrained" means.
        return W


def spectral_cap(
    module: nn.Module, name: str = "weight", radius: float = 1.0, *, n_power_iterations: int = 1
) -> nn.Module:
    """Constrain ``module.<name>`` to the spectral ball of radius ``radius`` (per head if stacked).

    .. math::  W \\mapsto W \\cdot \\min(1, c/\\hat\\sigma(W))

    with ``hat sigma`` the warm-started power-iteration estimate (a lower estimate, so the capped
    matrix exceeds ``c`` by the estimate's error, which does not vanish while the weights keep
    moving: exact sigma/c up to 1.27 (p90 1.13) in digits training, see README.md; use
    :func:`transcover.constrain.project_spectral_` for a certified guarantee at every step, or
    :meth:`Constrainer.finalize` / :func:`export_plain` for a certified end result).  Seed 5.2
    (spectral normalisation), generalising Miyato et al. 2018 from radius 1 to any ``c``.

    Args:
        module: any module owning a parameter ``name`` of shape (m, n) or (..., m, n).
        name: the parameter's attribute name.
        radius: c > 0.  It lives in the buffer ``parametrizations[name][i].radius`` so a schedule
            can change it in place.
        n_power_iterations: refinement steps per training forward (>= 1).

    Returns:
        ``module``, with the parametrization registered.

    Raises:
        InputError: radius not a finite positive number, parameter missing, not a matrix, not real
            floating point (complex, integer, meta), or with NaN/inf entries.

    Example:
        >>> lin = spectral_cap(nn.Linear(4, 4), radius=0.5)
        >>> _ = [lin(torch.randn(2, 4)) for _ in range(20)]
        >>> bool(torch.linalg.matrix_norm(lin.weight.detach().double(), 2) <= 0.5 * 1.01)
        True
    """
    check_radius(radius)
    W = getattr(module, name, None)
    if not isinstance(W, Tensor):
        raise InputError(f"{type(module).__name__} has no tensor named {name!r}")
    check_weight(W, f"{type(module).__name__}.{name}")
    parametrize.register_parametrization(
        module, name, _SpectralCap(W.detach(), radius, n_power_iterations), unsafe=True
    )
    return module


def remove_spectral_cap(module: nn.Module, name: str = "weight", *, keep_constrained: bool = True) -> nn.Module:
    """Remove every parametrization on ``module.<name>``.

    With ``keep_constrained`` the parameter becomes the constrained weight (same function);
    otherwise it goes back to the unconstrained weight.
    """
    if not parametrize.is_parametrized(module, name):
        raise InputError(f"{type(module).__name__}.{name} carries no constraint")
    parametrize.remove_parametrizations(module, name, leave_parametrized=keep_constrained)
    return module
