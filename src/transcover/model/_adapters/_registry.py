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
from ._common import model_type_key
from ._falcon import build_falcon
from ._encoders import build_clip, build_clip_text, build_clip_vision, build_distilbert, build_whisper_encoder
from ._gemma import build_gemma
from ._gpt2 import build_gpt2
from ._gpt_neox import build_gpt_neox
from ._gptj import build_gptj
from ._llama import build_llama
from ._olmo1 import build_olmo1
from ._olmo import build_olmo2
from ._phi import build_phi, build_phi3
from ._reference import build_reference
from ._t5 import build_t5
from ._moe import build_moe
from ._refused import OutsideDecompositionError, build_deberta_v2
from ._torch_encoder import build_torch_encoder
from ._vit import build_vit

__all__ = ["SUPPORTED_ARCHITECTURES", "ARCH_ALIASES", "PARTS", "adapter_for", "arch_from_config"]

Adapter = Callable[[TensorSource, dict, str], TransformerSpec]

_ADAPTERS: dict[str, Adapter] = {
    "bert": build_bert,
    "gpt2": build_gpt2,
    "llama": build_llama,
    "vit": build_vit,
    "torch_encoder": build_torch_encoder,
    "reference": build_reference,
    "distilbert": build_distilbert,
    "clip_text": build_clip_text,
    "clip_vision": build_clip_vision,
    "clip": build_clip,
    "whisper": build_whisper_encoder,
    "deberta_v2": build_deberta_v2,
    "gpt_neox": build_gpt_neox,
    "gptj": build_gptj,
    "falcon": build_falcon,
    "olmo": build_olmo1,  # OLMo 1: non-parametric LayerNorm (OLMo 2 is another block)
    "moe": build_moe,  # norms per expert; bounds refused: top-k routing is discontinuous (THEORY F25)
    "gemma": build_gemma,  # Gemma 1/2/3 text: (1 + gamma) RMSNorm, GeGLU, sandwich norms (THEORY F26)
    "olmo2": build_olmo2,  # post-norms inside the residual, whole-projection q/k norm (F23, F26)
    "t5": build_t5,  # the encoder (THEORY F28)
    "phi": build_phi,  # Phi-1/1.5/2: parallel residual with one LayerNorm (F21), partial rotary
    "phi3": build_phi3,  # refused: fused qkv_proj/gate_up_proj (per-matrix norms only)
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
    "xlm_roberta": "bert",  # XLMRobertaLayer is BertLayer; only the vocabulary differs
    "clip_text_model": "clip_text",  # CLIPTextConfig.model_type
    "clip_vision_model": "clip_vision",
    "deberta": "deberta_v2",  # DeBERTa v1 has the same disentangled attention
    "qwen3": "llama",  # + per-head query/key RMSNorm, read by the Llama adapter (THEORY F23)
    "refinedweb": "falcon",  # the RW checkpoints Falcon-7B/40B were first published with
    "refinedwebmodel": "falcon",
    "mt5": "t5",  # T5 v1.1's blocks
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "gemma3": "gemma",  # the multimodal checkpoint: its text tower (text_config)
}

#: Adapters that read one part of a checkpoint whose configuration names the whole model:
#: ``arch="clip_text"`` on a ``model_type="clip"`` checkpoint is a choice, not a contradiction.
PARTS: dict[str, tuple[str, ...]] = {"clip": ("clip_text", "clip_vision")}

# config["architectures"] class-name stems, for configs without model_type.
_CLASS_STEMS = (("Bert", "bert"), ("Roberta", "bert"), ("GPT2", "gpt2"), ("GPTNeoX", "gpt_neox"), ("GPTJ", "gptj"), ("Falcon", "falcon"),
                ("OlmoFor", "olmo"), ("Llama", "llama"),
                ("Mistral", "llama"), ("Qwen2", "llama"), ("Qwen3For", "llama"), ("ViT", "vit"), ("XLMRoberta", "bert"),
                ("DistilBert", "distilbert"), ("CLIPText", "clip_text"), ("CLIPVision", "clip_vision"),
                ("CLIP", "clip"), ("Whisper", "whisper"), ("Gemma", "gemma"), ("Olmo2", "olmo2"), ("DebertaV2", "deberta_v2"), ("Deberta", "deberta_v2"),
                ("T5", "t5"), ("MT5", "t5"), ("Phi3", "phi3"), ("PhiFor", "phi"), ("PhiModel", "phi"))


def _unsupported(what: str) -> UnsupportedArchitectureError:
    # OutsideDecompositionError: analyze falls back to per-matrix norms for an unknown architecture
    return OutsideDecompositionError(
        f"unsupported architecture {what}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        f" (also {', '.join(f'{k}->{v}' for k, v in ARCH_ALIASES.items())}); name the roles of its "
        "tensors in a mapping file (--roles roles.json, or transcover_roles.json beside the weights) "
        "for the full analysis; without --arch and --roles, `transcover analyze` reports per-matrix norms"
    )


def adapter_for(arch: str) -> tuple[str, Adapter]:
    """(canonical name, adapter) for an ``arch=`` value or an HF ``model_type``."""
    key = model_type_key(arch)
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
