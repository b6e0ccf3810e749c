"""Remove constraints, or export a plain model computing the same function (cf. torchlip ``vanilla_export``).

Note [strip order]: a product constraint reads its partner's unconstrained tensor, so removing
parametrizations one at a time would change what the remaining ones compute.  Every constrained
value is therefore computed first (in eval mode: no power-iteration update, so the values are the
ones evaluation uses), then every parametrization is removed, then the values are written back.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._clip import _NormCap
from ._product import _ProductCapFactor
from ._spectral import _SpectralCap

__all__ = ["strip_constraints", "export_plain", "constrained_tensors"]

_OURS = (_SpectralCap, _ProductCapFactor, _NormCap)


def constrained_tensors(model: nn.Module, *, only_transcover: bool = True) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of every parametrized tensor (only transcover's constraints by default)."""
    found = []
    for module in model.modules():
        if not parametrize.is_parametrized(module):
            continue
        for name, plist in module.parametrizations.items():
            if not only_transcover or all(isinstance(p, _OURS) for p in plist):
                found.append((module, name))
    return found


@torch.no_grad()
def strip_constraints(model: nn.Module, *, only_transcover: bool = True) -> nn.Module:
    """Replace every constrained tensor by its constrained value, in place; returns ``model``.

    The model then computes, in eval mode, exactly what it computed before in eval mode (the
    values are copied bit for bit).  Training-mode power-iteration updates are gone with the
    parametrizations.
    """
    targets = constrained_tensors(model, only_transcover=only_transcover)
    was_training = model.training
    model.eval()
    values = [getattr(m, n).detach().clone() for m, n in targets]
    for (m, n), value in zip(targets, values):
        parametrize.remove_parametrizations(m, n, leave_parametrized=False)
        getattr(m, n).copy_(value)
    model.train(was_training)
    return model


def _unshare_parametrized_classes(model: nn.Module) -> None:
    """Give every parametrized module of ``model`` its own class object.

    Note [shared parametrized class]: ``torch.nn.utils.parametrize`` swaps a module's class for a
    generated subclass holding one property per parametrized tensor, and its ``__deepcopy__`` keeps
    that *same* class object for the copy.  Removing a parametrization deletes the property from the
    class, so stripping a deep copy would silently strip the original too.  A fresh class with the
    same dictionary and bases makes the copy independent.
    """
    for m in model.modules():
        if parametrize.is_parametrized(m):
            cls = type(m)
            m.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))


def export_plain(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without transcover's constraints, computing the same function.

    Example:
        >>> from transcover.constrain import spectral_cap
        >>> lin = spectral_cap(nn.Linear(3, 3), radius=0.1).eval()
        >>> plain = export_plain(lin)
        >>> x = torch.randn(2, 3)
        >>> bool(torch.equal(plain(x), lin(x))), parametrize.is_parametrized(plain)
        (True, False)
    """
    replica = copy.deepcopy(model)
    _unshare_parametrized_classes(replica)
    return strip_constraints(replica)
