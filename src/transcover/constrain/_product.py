"""Product constraints: cap ``W_KQ^h = scale * W_Q^h W_K^hT`` and ``W_OV^h = W_V^h W_O^h`` per head.

The seed's constraints (2.1) bound the *products* ``||W_KQ||_2 <= B_KQ`` and ``||W_V||_2 <= B_V``
(read as the OV circuit), not the factors.  Capping the factors separately only bounds the product
by ``c_Q c_K`` and wastes capacity; capping the product directly scales both factors of head h by

.. math::

    f_h = \\sqrt{\\min\\Big(1, \\frac{c}{\\hat\\sigma_h}\\Big)},\\qquad
    \\hat\\sigma_h \\approx \\|\\text{scale}\\cdot A_h B_h^T\\|_2,

so that ``scale * (f_h A_h)(f_h B_h)^T = min(1, c/sigma_h) * scale * A_h B_h^T`` has norm
``min(sigma_h, c)``.  ``hat sigma_h`` comes from power iteration on the product without forming it
(:func:`product_power_iteration`, O(d d_head) per step), warm-started from buffers.

Two parametrizations (one on each tensor; one if both factors live in the same fused tensor) share
a :class:`_ProductCapState` that holds ``u``, ``v`` and ``radius``; the first one registered owns
it (it appears once in the ``state_dict``).  Each reads the partner's *unconstrained* tensor
(``parametrizations[name].original``), so the constrained factors are computed from the same
pair.  Note [update owner]: only the parametrization holding factor A refines ``u``, ``v`` (one
step per training forward), so a forward that reads both factors iterates once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._errors import InputError
from ._checks import check_number, check_weight
from ._layout import HeadLayout
from .._errors import radius_in
from ._spectral import _WARMUP_ITERATIONS, _floor, _normalize, _vecmat, check_radius, product_power_iteration

__all__ = ["product_cap"]


class _ProductCapState(nn.Module):
    def __init__(self, refs: dict[str, tuple[nn.Module, str, HeadLayout]], radius: float, scale: float,
                 A: Tensor, B: Tensor):
        super().__init__()
        # Plain dict, not registered: the hosts own these modules (registering would make a cycle).
        self.__dict__["refs"] = refs
        self.scale = float(scale)
        H, m, _ = A.shape
        gen = torch.Generator().manual_seed(0)
        u0 = _normalize(torch.randn(H, m, generator=gen, dtype=torch.float64).to(A.dtype).to(A.device))
        _, u, v = product_power_iteration(A.detach(), B.detach(), u0, _WARMUP_ITERATIONS, self.scale)
        self.register_buffer("u", u)
        self.register_buffer("v", v)
        self.register_buffer("radius", torch.tensor(radius_in(radius, A.dtype), dtype=A.dtype, device=A.device))

    def raw(self, side: str) -> Tensor:
        """The unconstrained (H, d, d_head) factor ``side`` read from its host."""
        module, name, layout = self.refs[side]
        if parametrize.is_parametrized(module, name):
            T = module.parametrizations[name].original
        else:
            T = getattr(module, name)
        return layout.heads(T)

    def factor(self, A: Tensor, B: Tensor, update: bool) -> Tensor:
        """``f_h = sqrt(min(1, c / sigma_h))`` for every head, differentiable in A and B."""
        if update and self.training:
            _, u, v = product_power_iteration(A, B, self.u, 1, self.scale)
            with torch.no_grad():
                self.u.copy_(u)
                self.v.copy_(v)
        left = _vecmat(self.u.clone(), A)  # (H, k): A_h^T u_h
        right = _vecmat(self.v.clone(), B)  # (H, k): B_h^T v_h
        sigma = self.scale * (left * right).sum(-1)
        return torch.sqrt(torch.clamp(self.radius / _floor(sigma.abs()), max=1.0))


class _ProductCapFactor(nn.Module):
    """Parametrization of the tensor holding factor(s) ``sides`` of one product cap."""

    def __init__(self, state: _ProductCapState, sides: tuple[str, ...], own_state: bool):
        super().__init__()
        if own_state:
            self.state = state
        else:
            self.__dict__["state"] = state
        self.sides = sides

    def forward(self, T: Tensor) -> Tensor:
        st = self.state
        layouts = {s: st.refs[s][2] for s in self.sides}
        A = layouts["a"].heads(T) if "a" in self.sides else st.raw("a")
        B = layouts["b"].heads(T) if "b" in self.sides else st.raw("b")
        f = st.factor(A, B, update="a" in self.sides)
        out = T
        for s in self.sides:
            out = out * layouts[s].multiplier(T, f)
        return out

    def right_inverse(self, T: Tensor) -> Tensor:
        return T


def product_cap(
    a: tuple[nn.Module, str, HeadLayout],
    b: tuple[nn.Module, str, HeadLayout],
    radius: float,
    *,
    scale: float = 1.0,
) -> _ProductCapState:
    """Constrain ``||scale * A_h B_h^T||_2 <= radius`` for every head h (approximately; see below).

    .. math::  A_h \\mapsto f_h A_h,\\; B_h \\mapsto f_h B_h,\\quad f_h = \\sqrt{\\min(1, c/\\hat\\sigma_h)}

    Seed 2.1 (``B_KQ``, ``B_V`` are norms of products).  ``hat sigma_h`` is a warm-started power
    iteration estimate, a lower estimate of the true norm: the product exceeds ``c`` while the
    estimate lags (KQ up to 1.27 c in digits training, README.md); use
    :func:`transcover.constrain.project_product_` for a certified guarantee.

    Args:
        a: ``(module, tensor name, layout)`` of the left factor (W_Q^h or W_V^h), each head
            ``(d, d_head)``.
        b: the right factor (W_K^h, or (W_O^h)^T), each head ``(d, d_head)``; may be the same
            tensor as ``a`` with another layout offset (fused ``in_proj_weight``).
        radius: c > 0, stored in the returned state's ``radius`` buffer.
        scale: the product's constant factor (1/sqrt(d_head) for W_KQ, 1 for W_OV).

    Returns:
        The shared state (buffers ``u``, ``v``, ``radius``).

    Raises:
        InputError: bad radius or ``scale``, missing tensors, tensors not real floating point or with
            NaN/inf entries, shapes that do not fit the layouts, or a tensor that already carries a
            constraint (stacking would break the partner's reading).
    """
    check_radius(radius)
    check_number(scale, "scale")  # NaN was accepted and made every factor NaN (red team 190)
    tensors = {}
    for side, (module, name, layout) in (("a", a), ("b", b)):
        T = getattr(module, name, None)
        if not isinstance(T, Tensor):
            raise InputError(f"{type(module).__name__} has no tensor named {name!r}")
        check_weight(T, f"{type(module).__name__}.{name}")
        try:
            layout.check(T, f"{type(module).__name__}.{name}")
        except ValueError as err:
            raise InputError(str(err)) from None
        tensors[side] = T
    same = a[0] is b[0] and a[1] == b[1]
    for module, name, _ in (a,) if same else (a, b):
        # Note [disjoint regions]: several product caps may share a fused tensor (KQ and the V of
        # OV in ``in_proj_weight``) because each touches only its own heads' blocks; any other
        # constraint would change what the partner reads.
        if parametrize.is_parametrized(module, name) and not all(
            isinstance(p, _ProductCapFactor) for p in module.parametrizations[name]
        ):
            raise InputError(f"{type(module).__name__}.{name} already carries a constraint; "
                             "remove it before adding a product constraint")
    A = a[2].heads(tensors["a"].detach())
    B = b[2].heads(tensors["b"].detach())
    if A.shape[0] != B.shape[0] or A.shape[2] != B.shape[2]:
        raise InputError(f"product factors do not match: A heads {tuple(A.shape)}, B heads {tuple(B.shape)}")
    state = _ProductCapState({"a": a, "b": b}, radius, scale, A, B)
    if same:
        parametrize.register_parametrization(a[0], a[1], _ProductCapFactor(state, ("a", "b"), True), unsafe=True)
    else:
        parametrize.register_parametrization(a[0], a[1], _ProductCapFactor(state, ("a",), True), unsafe=True)
        parametrize.register_parametrization(b[0], b[1], _ProductCapFactor(state, ("b",), False), unsafe=True)
    return state
