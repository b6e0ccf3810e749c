"""Lipschitz constants of Transformers and the perturbation lemma G.3 (seed 2.2, 6.2, 7.1).

Certified upper bounds (THEORY F6, F7, F8, F13, F14), each beside an empirical lower estimate
(autograd power iteration + gradient ascent over inputs), and L2 self-attention (Kim et al. 2021).
"""

from ._activations import activation_gain as activation_gain
from ._activations import activation_lipschitz as activation_lipschitz
from ._attention import attention_lipschitz as attention_lipschitz
from ._attention import attention_output_radius as attention_output_radius
from ._attention import attention_perturbation_coefficients as attention_perturbation_coefficients
from ._attention import check_c_sm as check_c_sm
from ._attention import head_lipschitz as head_lipschitz
from ._compose import NetworkLipschitz as NetworkLipschitz
from ._compose import compose as compose
from ._config import LipschitzConfig as LipschitzConfig
from ._config import PerturbConfig as PerturbConfig
from ._compose import Stage as Stage
from ._compose import lipschitz_bounds as lipschitz_bounds
from ._empirical import LowerEstimate as LowerEstimate
from ._empirical import function_lipschitz_lower as function_lipschitz_lower
from ._empirical import jacobian_operator_norm as jacobian_operator_norm
from ._empirical import lipschitz_lower as lipschitz_lower
from ._empirical import network_lipschitz_lower as network_lipschitz_lower
from ._empirical import perturbation_lower as perturbation_lower
from ._ffn import ffn_lipschitz as ffn_lipschitz
from ._ffn import ffn_output_radius as ffn_output_radius
from ._ffn import ffn_perturbation_coefficients as ffn_perturbation_coefficients
from ._l2_attention import l2_attention_constants as l2_attention_constants
from ._l2_attention import l2_attention_forward as l2_attention_forward
from ._l2_attention import l2_attention_lipschitz as l2_attention_lipschitz
from ._l2_attention import phi_inverse as phi_inverse
from ._local import layer_local as layer_local
from ._local import network_local as network_local
from ._local import norm_local as norm_local
from ._local_attention import attention_local_bound as attention_local_bound
from ._local_report import local_table as local_table
from ._normalisation import ball_lipschitz as ball_lipschitz
from ._normalisation import layernorm_lipschitz as layernorm_lipschitz
from ._normalisation import norm_output_radius as norm_output_radius
from ._normalisation import rmsnorm_lipschitz as rmsnorm_lipschitz
from ._perturbation import CoefficientEntry as CoefficientEntry
from ._perturbation import PerturbationBound as PerturbationBound
from ._perturbation import PerturbationCoefficients as PerturbationCoefficients
from ._perturbation import perturbation_bound as perturbation_bound
from ._perturbation import perturbation_coefficients as perturbation_coefficients
from ._perturbation import perturbation_deltas as perturbation_deltas
from ._perturbation import LogCoefficient as LogCoefficient
from ._perturbation import LogCoefficients as LogCoefficients
from ._perturbation import deltas_from_norms as deltas_from_norms
from ._perturbation import log_perturbation_coefficients as log_perturbation_coefficients
from ._weights import ClassBounds as ClassBounds
from ._weights import LayerBounds as LayerBounds
from ._weights import NormBounds as NormBounds
from ._weights import class_bounds as class_bounds
from ._weights import class_max as class_max

__all__ = [
    "activation_gain", "activation_lipschitz",
    "head_lipschitz", "attention_lipschitz", "attention_output_radius", "attention_perturbation_coefficients",
    "ffn_lipschitz", "ffn_output_radius", "ffn_perturbation_coefficients",
    "layernorm_lipschitz", "rmsnorm_lipschitz", "ball_lipschitz", "norm_output_radius",
    "l2_attention_constants", "l2_attention_forward", "l2_attention_lipschitz", "phi_inverse",
    "Stage", "NetworkLipschitz", "lipschitz_bounds", "compose", "LipschitzConfig", "PerturbConfig",
    "CoefficientEntry", "PerturbationCoefficients", "PerturbationBound",
    "perturbation_coefficients", "perturbation_deltas", "perturbation_bound",
    "LogCoefficient", "LogCoefficients", "log_perturbation_coefficients", "deltas_from_norms",
    "ClassBounds", "LayerBounds", "NormBounds", "class_bounds", "class_max", "check_c_sm",
    "LowerEstimate", "function_lipschitz_lower", "jacobian_operator_norm", "lipschitz_lower", "network_lipschitz_lower",
    "perturbation_lower",
    "norm_local", "attention_local_bound", "layer_local", "network_local", "local_table",
]

# Note [callable modules] in transcover._entry: transcover.lipschitz(...) calls the API function of that name
from .._entry import make_callable as _make_callable  # noqa: E402

_make_callable(__name__)

from ._local_report import LocalRow as LocalRow  # noqa: E402
from ._local_report import stage_functions as stage_functions  # noqa: E402
from ._local_report import stage_local_constants as stage_local_constants  # noqa: E402

__all__ += ["LocalRow", "stage_functions", "stage_local_constants"]
