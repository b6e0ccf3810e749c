"""Lipschitz constants of Transformers and the perturbation lemma G.3 (seed 2.2, 6.2, 7.1).

Certified upper bounds (THEORY F6, F7, F8, F13, F14), each beside an empirical lower estimate
(autograd power iteration + gradient ascent over inputs), and L2 self-attention (Kim et al. 2021).
"""

_LAZY = {
    "activation_gain": "._activations",
    "activation_lipschitz": "._activations",
    "attention_lipschitz": "._attention",
    "attention_output_radius": "._attention",
    "attention_perturbation_coefficients": "._attention",
    "check_c_sm": "._attention",
    "head_lipschitz": "._attention",
    "NetworkLipschitz": "._compose",
    "compose": "._compose",
    "LipschitzConfig": "._config",
    "PerturbConfig": "._config",
    "Stage": "._compose",
    "lipschitz_bounds": "._compose",
    "LowerEstimate": "._empirical",
    "function_lipschitz_lower": "._empirical",
    "jacobian_operator_norm": "._empirical",
    "lipschitz_lower": "._empirical",
    "network_lipschitz_lower": "._empirical",
    "perturbation_lower": "._empirical",
    "ffn_lipschitz": "._ffn",
    "ffn_output_radius": "._ffn",
    "ffn_perturbation_coefficients": "._ffn",
    "l2_attention_constants": "._l2_attention",
    "l2_attention_forward": "._l2_attention",
    "l2_attention_lipschitz": "._l2_attention",
    "phi_inverse": "._l2_attention",
    "layer_local": "._local",
    "network_local": "._local",
    "norm_local": "._local",
    "attention_local_bound": "._local_attention",
    "local_table": "._local_report",
    "ball_lipschitz": "._normalisation",
    "layernorm_lipschitz": "._normalisation",
    "norm_output_radius": "._normalisation",
    "rmsnorm_lipschitz": "._normalisation",
    "CoefficientEntry": "._perturbation",
    "PerturbationBound": "._perturbation",
    "PerturbationCoefficients": "._perturbation",
    "perturbation_bound": "._perturbation",
    "perturbation_coefficients": "._perturbation",
    "perturbation_deltas": "._perturbation",
    "LogCoefficient": "._perturbation",
    "LogCoefficients": "._perturbation",
    "deltas_from_norms": "._perturbation",
    "log_perturbation_coefficients": "._perturbation",
    "ClassBounds": "._weights",
    "LayerBounds": "._weights",
    "NormBounds": "._weights",
    "class_bounds": "._weights",
    "class_max": "._weights",
    "LocalRow": "._local_report",
    "assemble_local_rows": "._local_report",
    "stage_functions": "._local_report",
    "stage_local_constants": "._local_report",
    "stage_global_parts": "._local_report",
    "keep_max": "._local_report",
    "StackLocal": "._local_stack",
    "stack_local": "._local_stack",
    "stack_lower": "._local_stack",
}


# Note [lazy package] in transcover._lazy: importing the package imports none of these modules.
from .._lazy import lazy_attributes as _lazy_attributes  # noqa: E402

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)


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


__all__ += ["LocalRow", "assemble_local_rows", "stage_functions", "stage_local_constants", "stage_global_parts",
            "keep_max"]
__all__ += ["StackLocal", "stack_local", "stack_lower"]
