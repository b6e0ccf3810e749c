"""The seed's decomposition (section 1.2): typed layers and heads, adapters, loading, the reference model,
and the one forward pass that evaluates a spec (``_functional``).

``model`` is the ground floor: it imports no other transcover package (only ``_errors``, ``_io``),
so every package may build on it.

Importing this package does not import torch (Note [no torch on the file path] in ``_arrays``): the
torch module :class:`ReferenceTransformer` and its helpers are resolved on first access
(``__getattr__`` below).
"""

from typing import Any

from ._functional import ForwardHooks as ForwardHooks
from ._functional import attention_forward as attention_forward
from ._functional import ffn_forward as ffn_forward
from ._functional import head_forward as head_forward
from ._functional import l2_attention_forward as l2_attention_forward
from ._functional import layer_forward as layer_forward
from ._functional import norm_forward as norm_forward
from ._functional import transformer_forward as transformer_forward
from ._members import stack_members as stack_members
from ._compare import require_same_structure as require_same_structure
from ._compare import structural_differences as structural_differences
from ._convert import as_torch as as_torch
from ._arrays import norm2_f64 as norm2_f64
from ._arrays import to_tensor as to_tensor
from ._functional import apply_rope as apply_rope
from ._functional import attention_scores as attention_scores
from ._spec import QUICK_GELU_SLOPE as QUICK_GELU_SLOPE
from ._adapters._refused import MOE_REASON as MOE_REASON
from ._adapters._refused import moe_refusal as moe_refusal
from ._adapters._refused import OutsideDecompositionError as OutsideDecompositionError
from ._adapters._support import support_table as support_table
from ._sources import StateDictSource as StateDictSource
from ._sources import open_safetensors as open_safetensors
from ._reference_spec import ReferenceConfig as ReferenceConfig
from ._spec import Activation as Activation
from ._spec import AttentionSpec as AttentionSpec
from ._spec import FFNSpec as FFNSpec
from ._spec import LayerSequence as LayerSequence
from ._spec import LayerSpec as LayerSpec
from ._spec import MLPHeadSpec as MLPHeadSpec
from ._spec import NormKind as NormKind
from ._spec import NormSpec as NormSpec
from ._spec import Placement as Placement
from ._spec import Residual as Residual
from ._spec import MoESpec as MoESpec
from ._spec import RelativeBiasSpec as RelativeBiasSpec
from ._spec import RopeSpec as RopeSpec
from ._spec import TransformerSpec as TransformerSpec

__all__ = [
    "Activation", "AttentionSpec", "FFNSpec", "LayerSequence", "LayerSpec", "MLPHeadSpec",
    "NormKind", "NormSpec", "Placement", "Residual", "MoESpec", "RelativeBiasSpec", "RopeSpec", "TransformerSpec",
    "ReferenceConfig", "ReferenceTransformer", "reference_spec", "save_reference",
    "ForwardHooks", "attention_forward", "ffn_forward", "head_forward", "l2_attention_forward", "layer_forward",
    "norm_forward", "transformer_forward", "stack_members", "as_torch",
    "structural_differences", "require_same_structure",
    "OutsideDecompositionError", "MOE_REASON", "moe_refusal", "ROLES_FILE", "support_table", "norm2_f64", "to_tensor", "apply_rope", "attention_scores",
    "QUICK_GELU_SLOPE", "StateDictSource", "open_safetensors",
]
from ._load import ROLES_FILE as ROLES_FILE
from ._load import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from ._load import bundled_model_dir as bundled_model_dir
from ._load import files_read as files_read
from ._files import identity as file_identity
from ._files import identity_when_read as identity_when_read
from ._files import read_recorded as read_recorded
from ._files import read_text as read_text
from ._load import load as load
from ._load import spec_from_module as spec_from_module
from ._module_checks import refuse_rewritten_forward as refuse_rewritten_forward

from ._data import inputs_from_array as inputs_from_array
from ._data import check_sequence_length as check_sequence_length
from ._data import default_sequence_length as default_sequence_length
from ._data import max_sequence_length as max_sequence_length
from ._data import sequence_length as sequence_length
from ._data import sequence_too_long as sequence_too_long
from ._data import load_inputs as load_inputs
from ._data import data_files as data_files
from ._data import BuiltinData as BuiltinData

__all__ += ["SUPPORTED_ARCHITECTURES", "bundled_model_dir", "files_read", "file_identity", "identity_when_read",
            "read_recorded", "read_text", "load", "spec_from_module", "refuse_rewritten_forward",
            "load_inputs", "data_files", "BuiltinData",
            "inputs_from_array", "check_sequence_length", "max_sequence_length", "default_sequence_length",
            "sequence_length", "sequence_too_long"]

_TORCH_NAMES = ("ReferenceTransformer", "reference_spec", "save_reference")


def __getattr__(name: str) -> Any:
    """The torch-backed names (``ReferenceTransformer``, ``reference_spec``, ``save_reference``), imported on use."""
    if name in _TORCH_NAMES:
        from . import _reference

        return getattr(_reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
