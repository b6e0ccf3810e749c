"""Approximation (seed sections 4, 5.1, 5.3, 7.2; THEORY F16): I-sparse targets, positional
encodings with measured Δ, the constructive Transformer of Lemma H.1, the measured error
decomposition, rate checks, design advice and failure modes.  See ``README.md`` beside this file.
"""

from ._advice import Advice as Advice
from ._advice import advise as advise
from ._advice import simplicial_widths as simplicial_widths
from ._capacity import Capacity as Capacity
from ._capacity import construction_capacity as construction_capacity
from ._construction import Construction as Construction
from ._construction import ConstructionBound as ConstructionBound
from ._construction import build_construction as build_construction
from ._construction import off_target_mass_bound as off_target_mass_bound
from ._decomposition import ErrorDecomposition as ErrorDecomposition
from ._decomposition import attention_candidates as attention_candidates
from ._decomposition import decompose_construction as decompose_construction
from ._encodings import ENCODING_KINDS as ENCODING_KINDS
from ._encodings import Encoding as Encoding
from ._encodings import coherence as coherence
from ._encodings import designed_encoding as designed_encoding
from ._encodings import equiangular_encoding as equiangular_encoding
from ._encodings import make_encoding as make_encoding
from ._encodings import orthogonal_encoding as orthogonal_encoding
from ._encodings import random_sign_dimension as random_sign_dimension
from ._encodings import random_sign_encoding as random_sign_encoding
from ._encodings import sinusoidal_encoding as sinusoidal_encoding
from ._encodings import welch_bound as welch_bound
from ._encodings import welch_dimension as welch_dimension
from ._failures import FailureCurve as FailureCurve
from ._failures import delta_to_half_curve as delta_to_half_curve
from ._failures import shift_curve as shift_curve
from ._failures import weak_dependence_curve as weak_dependence_curve
from ._rates import AttentionRate as AttentionRate
from ._rates import MLPRate as MLPRate
from ._rates import attention_rate_sweep as attention_rate_sweep
from ._rates import fit_decay as fit_decay
from ._rates import fit_loglog as fit_loglog
from ._rates import mlp_rate_sweep as mlp_rate_sweep
from ._simplicial import SimplicialMLP as SimplicialMLP
from ._simplicial import simplicial_error_bound as simplicial_error_bound
from ._simplicial import simplicial_interpolate as simplicial_interpolate
from ._simplicial import simplicial_mlp as simplicial_mlp
from ._targets import TASK_NAMES as TASK_NAMES
from ._targets import SparseTarget as SparseTarget
from ._targets import holder_constant_of_power as holder_constant_of_power
from ._targets import holder_ridge as holder_ridge
from ._targets import make_sparse_task as make_sparse_task
from ._targets import retrieval_indices as retrieval_indices
from ._targets import sparse_majority as sparse_majority
from ._targets import sparse_parity as sparse_parity
from ._targets import sparse_target as sparse_target
from ._trained import TrainedDecomposition as TrainedDecomposition
from ._trained import decompose_trained as decompose_trained
from ._trained import forward_with_attention as forward_with_attention
from ._trained import train_sparse_model as train_sparse_model

__all__ = [
    # targets and tasks
    "TASK_NAMES", "SparseTarget", "holder_constant_of_power", "holder_ridge", "make_sparse_task",
    "retrieval_indices", "sparse_majority", "sparse_parity", "sparse_target",
    # positional encodings
    "ENCODING_KINDS", "Encoding", "coherence", "designed_encoding", "equiangular_encoding",
    "make_encoding", "orthogonal_encoding", "random_sign_dimension", "random_sign_encoding",
    "sinusoidal_encoding", "welch_bound", "welch_dimension",
    # the construction
    "SimplicialMLP", "simplicial_error_bound", "simplicial_interpolate", "simplicial_mlp",
    "Construction", "ConstructionBound", "build_construction", "off_target_mass_bound",
    "Capacity", "construction_capacity",
    # decomposition, rates, advice, failures
    "ErrorDecomposition", "attention_candidates", "decompose_construction",
    "TrainedDecomposition", "decompose_trained", "forward_with_attention", "train_sparse_model",
    "AttentionRate", "MLPRate", "attention_rate_sweep", "fit_decay", "fit_loglog", "mlp_rate_sweep",
    "Advice", "advise", "simplicial_widths",
    "FailureCurve", "delta_to_half_curve", "shift_curve", "weak_dependence_curve",
]

# Note [callable modules] in transcover._entry: transcover.approx(...) calls the API function of that name
from .._entry import make_callable as _make_callable  # noqa: E402

_make_callable(__name__)
