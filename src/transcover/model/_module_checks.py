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
its eval-mode function; so are :func:`float32_warning` (a float64 module whose forward rounds to float32 inside)
and :func:`fast_path_warning` (torch's encoder fast path computes a tanh GELU as exact GELU), red team 216.
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING

from .._errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["refuse_rewritten_forward", "dropout_warning", "float32_warning", "fast_path_warning"]

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


# a cast to float32 inside a forward: ``.to(torch.float32)``, ``.float()``, ``softmax(..., dtype=torch.float32)``
_TO_FLOAT32 = re.compile(r"\btorch\.float32\b|\.float\(\)|\bdtype=torch\.float\b")


def _source(fn: object) -> str:
    try:
        return inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def float32_warning(module: nn.Module, name: str) -> str | None:
    """One warning line when a float64 HF ``module``'s own forward rounds to float32 inside, naming the places.

    Read from the installed transformers source of each submodule class's ``forward`` (and of its modelling file's
    ``eager_attention_forward`` when the config runs eager attention): e.g. ``LlamaRMSNorm`` casts its input to
    float32, ``LlamaRotaryEmbedding`` builds cos/sin in float32, eager attention takes its softmax in float32.  What
    is certified is the exact function of the weights (red team 216: after ``.double()`` a pair of points rounding to
    either side of a float32 number gave ``module(x)`` a ratio of 6e9 against a certified 8.9e6).
    """
    import sys

    import torch

    if not any(p.dtype == torch.float64 for p in module.parameters()):
        return None  # float32 and lower-precision modules round at (or below) float32 everywhere anyway
    places: list[str] = []
    for cls in dict.fromkeys(type(m) for m in module.modules()):
        if not cls.__module__.startswith("transformers."):
            continue
        forward = _source(cls.forward)
        if _TO_FLOAT32.search(forward):
            places.append(f"{cls.__name__}.forward")
        eager = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        config = getattr(module, "config", None)
        if ("eager_attention_forward" in forward and getattr(config, "_attn_implementation", None) == "eager"
                and _TO_FLOAT32.search(_source(eager)) and "eager_attention_forward" not in places):
            places.append("eager_attention_forward")
    if not places:
        return None
    return (f"{name}'s own forward rounds to float32 inside ({', '.join(places)}) although its weights are float64; "
            "what is certified is the exact function of its weights (its float64 evaluation, within the stated "
            "rounding), so module(x) can differ from it by float32 rounding")


def fast_path_warning(module: nn.Module, name: str) -> str | None:
    """One warning line when an ``nn.TransformerEncoder(Layer)`` with ``nn.GELU(approximate="tanh")`` may take torch's
    fused fast path, which computes exact GELU instead (Note [encoder fast path]; red team 216: outputs 2.7e-4 apart).

    The conditions are those of ``TransformerEncoderLayer.forward``: batch_first, input projection biases, one
    LayerNorm eps, an even number of heads; it then runs in eval mode without gradients.
    """
    from torch import nn

    if not isinstance(module, (nn.TransformerEncoder, nn.TransformerEncoderLayer)):
        return None
    layers = [module] if isinstance(module, nn.TransformerEncoderLayer) else list(module.layers)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if (type(layer.activation) is nn.GELU and layer.activation.approximate == "tanh" and attn.batch_first
                and attn.in_proj_bias is not None and attn._qkv_same_embed_dim and attn.num_heads % 2 == 0
                and layer.norm1.eps == layer.norm2.eps):
            where = "its layer" if layer is module else f"layers.{i}"
            return (f"{name} ({where}) uses nn.GELU(approximate='tanh'), which torch's fused encoder fast path (eval "
                    "mode, batch_first, no gradients) computes as exact GELU; what is certified is the tanh GELU of "
                    "its definition: compare outputs with torch.backends.mha.set_fastpath_enabled(False)")
    return None
