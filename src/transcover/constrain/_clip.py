"""Element-wise weight clipping and bias-norm constraints (seed 5.2 "weight clipping", 2.1 B_b).

.. math::

    \\operatorname{clip}_c(W)_{ij} = \\max(-c, \\min(c, W_{ij})),\\qquad
    \\operatorname{ball}_c(b) = b\\,\\min(1, c/\\|b\\|_2).

Clipping bounds ``||W||_max <= c``, hence ``||W||_2 <= c sqrt(m n)`` (a loose spectral bound:
``||W||_2 <= ||W||_F <= sqrt(mn) ||W||_max``); it is the WGAN-style constraint the seed names.
The l2-ball map is the exact projection for the bias constraints ``||b_1|| <= B_b1``,
``||b_2|| <= B_b2``; :func:`norm_cap` registers it as a parametrization.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._errors import InputError
from ._checks import check_weight
from ._projection import rounding_of
from .._errors import radius_in
from ._spectral import _floor, check_radius

__all__ = ["clip_weights_", "norm_cap"]


@torch.no_grad()
def clip_weights_(W: Tensor, bound: float) -> Tensor:
    """Clamp every entry of ``W`` to ``[-bound, bound]`` in place; returns ``W``.

    The bound is rounded *toward zero* in ``W``'s dtype (round to nearest put ``fl(0.1)`` above 0.1:
    ``max|W| = 0.10009765625`` in bf16, 1.0155x the bound at a subnormal fp16 one; red team of stop
    36), so ``||W||_max <= bound`` holds for the stored values.

    Raises:
        InputError: bound not a finite number > 0; ``W`` not real floating point (or meta), or holds NaN or inf.

    Example:
        >>> clip_weights_(torch.tensor([-3.0, 0.5, 2.0]), 1.0).tolist()
        [-1.0, 0.5, 1.0]
    """
    c = check_radius(bound, "bound")
    check_weight(W, "the clipped weight")
    t = torch.tensor(c, dtype=W.dtype)
    if float(t) > c:  # rounded up: the next value toward zero is below c
        t = torch.nextafter(t, torch.zeros((), dtype=W.dtype))
    return W.clamp_(-float(t), float(t))


class _NormCap(nn.Module):
    """Parametrization ``b -> b * min(1, c' / ||b||_2)`` (no estimate involved).

    Note [rounding-safe ball]: computed naively in float32 the capped vector's norm came out at
    ``c (1 + 1.5e-7)`` (issue 10, digits at lr 5e-2).  The norm is taken in float64 and the factor
    aims at ``c' = fl(c) (1 - 6u - 4 (n + 2) 2^-53)``: ``u`` is the dtype's unit roundoff, the last
    term twice the float64 norm's error bound (so a certificate can see the margin).  Since
    ``fl(c) <= c (1 + u)`` and casting the factor and multiplying each entry add at most ``u``
    each, the stored vector has norm ``<= fl(c) (1 - 4u) < c``, below the radius a certified
    export checks (``fl(c) (1 - u)``, Note [certified export]).  A vector inside that ball is
    returned unchanged.

    That argument holds only where nothing is subnormal: in fp16 a factor of 9.5e-8 (a bias of
    60000 capped at 0.0057) rounded to 2^-23, 1.25x too large, and the capped vector came out at
    1.25 c (1.99 c in a fuzz; red team of stop 36).  So the product is formed in float64 and cast
    once: each stored entry then errs by ``<= u |x| + eta`` (``eta`` half the subnormal spacing), so
    aiming at ``c' - 2 eta sqrt(n)`` keeps the stored norm ``<= fl(c) (1 - 4u) - eta sqrt(n) < c``
    (and where that aim is ``<= 0`` the vector is set to 0).
    """

    def __init__(self, radius: float, like: Tensor):
        super().__init__()
        self.register_buffer("radius", torch.tensor(radius_in(radius, like.dtype), dtype=like.dtype, device=like.device))

    def forward(self, b: Tensor) -> Tensor:
        u, eta = rounding_of(b.dtype)
        b64 = b.double()
        norm = b64.norm(dim=-1, keepdim=True)
        shrink = 1.0 - 6.0 * u - 4.0 * (b.shape[-1] + 2) * 2.0**-53
        aim = (self.radius.double() * shrink - 2.0 * eta * b.shape[-1] ** 0.5).clamp_min(0.0)
        factor = torch.clamp(aim / _floor(norm), max=1.0)
        return (b64 * factor).to(b.dtype)

    def right_inverse(self, b: Tensor) -> Tensor:
        return b


def norm_cap(module: nn.Module, name: str = "bias", radius: float = 1.0) -> nn.Module:
    """Constrain the vector ``module.<name>`` to the l2 ball of radius ``radius`` (seed 2.1, B_b1/B_b2).

    .. math::  b \\mapsto b \\min(1, c/\\|b\\|_2)

    Raises:
        InputError: bad radius, no such tensor, or one not real floating point or with NaN/inf entries.
    """
    check_radius(radius)
    b = getattr(module, name, None)
    if not isinstance(b, Tensor):
        raise InputError(f"{type(module).__name__} has no tensor named {name!r}")
    check_weight(b, f"{type(module).__name__}.{name}")
    parametrize.register_parametrization(module, name, _NormCap(radius, b.detach()), unsafe=True)
    return module
