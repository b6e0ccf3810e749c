"""What an in-memory ``nn.Module`` must not carry for its stored tensors to be the function it computes.

Every adapter reads a module's tensors (``state_dict()``, ``named_parameters()``) and rebuilds the forward
from the architecture; whatever changes the forward without being a stored tensor of that architecture is
invisible to it.  Red team 210 certified such modules as something else, silently:

* a parametrisation (``torch.nn.utils.parametrize``: ``parametrizations.bias.original``, spectral or weight
  norm) or pruning (``torch.nn.utils.prune``: ``bias_orig`` + ``bias_mask`` + a forward pre-hook) stores the
  raw tensor under another name: the encoder reader took the bias as absent (``perturb`` certified 0.0 where the
  outputs differ by 4), the per-matrix route certified the raw ``weight_orig``, HF readers said "missing";
* forward hooks (``100 * out``) and forward pre-hooks change the function outright.

:func:`refuse_rewritten_forward` refuses each in one line, naming the first submodule and how to fix it; it runs
on every path of ``load(module)`` and in the per-matrix route.  :func:`dropout_warning` is the one thing only
warned about: a module in training mode with dropout (a fresh ``nn.TransformerEncoder`` is one) is certified as
its eval-mode function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["refuse_rewritten_forward", "dropout_warning"]

# float attributes through which modules apply functional dropout in training mode (HF attention, MHA)
_DROPOUT_ATTRS = ("dropout", "attention_dropout", "attn_dropout", "dropout_p", "dropout_prob")


def _at(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _reparametrised(name: str, mod: nn.Module, allow_parametrized: bool) -> str | None:
    """The refusal line when ``mod`` (named ``name``) stores a tensor its forward recomputes, else ``None``."""
    from torch.nn.utils import parametrize, prune
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    sub = f"model.get_submodule({name!r})" if name else "model"
    fixed = "first, so the stored weights are the ones the forward uses"
    if parametrize.is_parametrized(mod) and not allow_parametrized:
        pname = next(iter(mod.parametrizations))
        return (f"{_at(name, pname)} is parametrised (torch.nn.utils.parametrize): the stored tensor is not the one "
                f"the forward uses; call torch.nn.utils.parametrize.remove_parametrizations({sub}, {pname!r}) {fixed}")
    for hook in mod._forward_pre_hooks.values():
        if isinstance(hook, (prune.BasePruningMethod, prune.PruningContainer)):
            pname = getattr(hook, "_tensor_name", "weight")
            return (f"{_at(name, pname)} is pruned (torch.nn.utils.prune: {pname}_orig times {pname}_mask): the "
                    f"stored tensor is not the one the forward uses; call torch.nn.utils.prune.remove({sub}, "
                    f"{pname!r}) {fixed}")
        if isinstance(hook, (SpectralNorm, WeightNorm)):
            how = "spectral_norm" if isinstance(hook, SpectralNorm) else "weight_norm"
            return (f"{_at(name, hook.name)} is reparametrised by torch.nn.utils.{how}: the stored tensor is not the "
                    f"one the forward uses; call torch.nn.utils.remove_{how}({sub}, {hook.name!r}) {fixed}")
    for pname, _ in mod.named_parameters(recurse=False):
        if pname.endswith("_orig") and hasattr(mod, pname[:-5] + "_mask"):
            return (f"{_at(name, pname)} and {pname[:-5]}_mask look pruned (torch.nn.utils.prune): the stored tensor "
                    f"is not the one the forward uses; call torch.nn.utils.prune.remove({sub}, {pname[:-5]!r}) "
                    f"{fixed}")
    return None


def refuse_rewritten_forward(module: nn.Module, *, allow_parametrized: bool = False) -> None:
    """Refuse, in one line naming the first submodule, a module whose forward is not its stored tensors' function.

    Parametrisations and pruning first (their message says how to remove them), then forward hooks and forward
    pre-hooks on any submodule, and torch's global forward hooks.  ``allow_parametrized``: the caller reads each
    parametrised tensor as the attribute the forward uses (``reference_spec``), so parametrisations are exact
    there (``transcover.constrain``'s caps are parametrisations).

    Raises:
        UnsupportedArchitectureError: what is found, and how to fix it (red team 210).
    """
    from torch.nn.modules import module as torch_module

    named = list(module.named_modules(remove_duplicate=False))
    for name, mod in named:
        line = _reparametrised(name, mod, allow_parametrized)
        if line is not None:
            raise UnsupportedArchitectureError(line)
    for name, mod in named:
        for kind, hooks in (("forward hook", mod._forward_hooks), ("forward pre-hook", mod._forward_pre_hooks)):
            if hooks:
                raise UnsupportedArchitectureError(
                    f"{name or 'the module'} ({type(mod).__name__}) has a {kind}, which may change the function it "
                    "computes; transcover reads the stored tensors only: remove the hook (handle.remove()) first")
    for kind in ("forward_hooks", "forward_pre_hooks"):
        if getattr(torch_module, f"_global_{kind}", None):
            raise UnsupportedArchitectureError(
                f"a global {kind.replace('_', ' ')[:-1]} is registered (torch.nn.modules.module.register_module_"
                f"{kind[:-1]}), which may change every module's function; remove it first")


def dropout_warning(module: nn.Module, name: str) -> str | None:
    """One warning line when ``module`` (or a submodule) is in training mode with a dropout probability > 0.

    Not refused (a freshly built ``nn.TransformerEncoder`` is in training mode), but said: the function
    certified is the eval-mode one, dropout off (red team 210: a ``.train()`` module with dropout 0.5 was
    certified without a word).
    """
    from torch import nn

    for sub_name, mod in module.named_modules():
        if not mod.training:
            continue
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            p = float(mod.p)
        else:
            p = next((float(v) for a in _DROPOUT_ATTRS if isinstance(v := getattr(mod, a, None), float) and v > 0),
                     0.0)
        if p > 0:
            return (f"{name} is in training mode with dropout p={p:g} ({sub_name or 'the module'}); what is certified "
                    "is its eval-mode function (dropout off): call .eval() to compare outputs with it")
    return None
