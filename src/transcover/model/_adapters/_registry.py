"""Which adapter reads which architecture, and how an architecture is recognised.

An adapter is ``build(source, config, name) -> TransformerSpec``: it reads tensors from a
:class:`~transcover.model._sources.TensorSource` (files or a state dict alike) under a configuration
dict (an HF ``config.json``, ``model.config.to_dict()``, or transcover's own metadata).
"""

from __future__ import annotations

from collections.abc import Callable

from ..._errors import UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import TransformerSpec
from ._bert import build_bert
from ._gpt2 import build_gpt2
from ._gpt_neox import build_gpt_neox
from ._llama import build_llama
from ._reference import build_reference
from ._torch_encoder import build_torch_encoder
from ._vit import build_vit

__all__ = ["SUPPORTED_ARCHITECTURES", "ARCH_ALIASES", "adapter_for", "arch_from_config"]

Adapter = Callable[[TensorSource, dict, str], TransformerSpec]

_ADAPTERS: dict[str, Adapter] = {
    "bert": build_bert,
    "gpt2": build_gpt2,
    "gpt_neox": build_gpt_neox,
    "llama": build_llama,
    "vit": build_vit,
    "torch_encoder": build_torch_encoder,
    "reference": build_reference,
}

#: The adapter names :func:`transcover.model.load` accepts as ``arch=``.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ADAPTERS)

# HF model_type values whose blocks are exactly another architecture's blocks (their differences
# are in the embeddings or the attention mask only: RoBERTa's position offset, Mistral's optional
# sliding window, Qwen2's q/k/v biases, which the Llama adapter reads when present).
ARCH_ALIASES: dict[str, str] = {
    "roberta": "bert",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",  # + per-head query/key RMSNorm, read by the Llama adapter (THEORY F21)
}

# config["architectures"] class-name stems, for configs without model_type.
_CLASS_STEMS = (("Bert", "bert"), ("Roberta", "bert"), ("GPT2", "gpt2"), ("GPTNeoX", "gpt_neox"), ("Llama", "llama"),
                ("Mistral", "llama"), ("Qwen2", "llama"), ("Qwen3For", "llama"), ("ViT", "vit"))


def _unsupported(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"unsupported architecture {what}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        f" (also {', '.join(f'{k}->{v}' for k, v in ARCH_ALIASES.items())})"
    )


def adapter_for(arch: str) -> tuple[str, Adapter]:
    """(canonical name, adapter) for an ``arch=`` value or an HF ``model_type``."""
    key = str(arch).lower().replace("-", "_")
    key = ARCH_ALIASES.get(key, key)
    if key not in _ADAPTERS:
        raise _unsupported(repr(arch))
    return key, _ADAPTERS[key]


def arch_from_config(config: dict, where: str) -> str:
    """The architecture named by ``model_type``, else by the ``architectures`` class names."""
    model_type = config.get("model_type")
    if model_type:
        return str(model_type)
    for cls in config.get("architectures") or []:
        for stem, arch in _CLASS_STEMS:
            if str(cls).startswith(stem):
                return arch
    raise _unsupported(f"(no model_type or known architectures in {where})")
