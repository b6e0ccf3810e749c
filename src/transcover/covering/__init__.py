"""Covering numbers of Transformer classes and the generalisation bounds they give (seed 1.1, 2.2, 3).

Lemma G.2 (ball covers, ``_ball``), Lemma G.1 (budget allocation, ``_allocation``), matrix covers
(F2, F3, ``_matrix_covers``), the Transformer bound (F9, ``_transformer``), the MLP head and
Theorem G.5 (``_mlp``, ``_composite``), Dudley and generalisation (F11, ``_dudley``,
``_generalisation``), BFT's spectral complexity (F12, ``_bft``) and the model-level assembly
(``_model_bound``).  Everything is carried in log space.
"""

_LAZY = {
    "Allocation": "._allocation",
    "CoverCost": "._allocation",
    "allocate_mixed": "._allocation",
    "budget_allocation": "._allocation",
    "budget_allocation_log": "._allocation",
    "ball_log_covering": "._ball",
    "ball_log_covering_simple": "._ball",
    "ball_log_packing_lower": "._ball",
    "box_log_covering": "._ball",
    "box_linf_centres_per_axis": "._ball",
    "box_log_covering_linf": "._ball",
    "SpectralComplexity": "._bft",
    "bft_margin_term": "._bft",
    "bft_spectral_complexity": "._bft",
    "CompositeCovering": "._composite",
    "composite_log_covering": "._composite",
    "g5_leading_log": "._composite",
    "Diagnosis": "._diagnosis",
    "diagnose": "._diagnosis",
    "DudleyBound": "._dudley",
    "dudley_entropy_integral": "._dudley",
    "dudley_inverse_square": "._dudley",
    "DataRouteBound": "._data_route",
    "covering_margin_bound": "._data_route",
    "margin_change_bound": "._data_route",
    "margins": "._data_route",
    "pair_norms": "._data_route",
    "OccamBound": "._finite_class",
    "binary_kl": "._finite_class",
    "catoni_occam_bound": "._finite_class",
    "error_rate_upper": "._finite_class",
    "kl_inverse_upper": "._finite_class",
    "kl_occam_bound": "._finite_class",
    "occam_bounds": "._finite_class",
    "occam_complexity": "._finite_class",
    "sqrt_occam_bound": "._finite_class",
    "GeneralisationBound": "._generalisation",
    "concentration_term": "._generalisation",
    "generalisation_bound": "._generalisation",
    "generalisation_gap": "._generalisation",
    "sample_size_for_gap": "._generalisation",
    "bft_matrix_log_covering": "._matrix_covers",
    "linear_linf_log_covering": "._matrix_covers",
    "matrix_linf_log_covering": "._matrix_covers",
    "spectral_ball_matrix_log_covering": "._matrix_covers",
    "NormGrid": "._norm_grid",
    "NORM_GRID_MAX_STEPS": "._norm_grid",
    "MLPCovering": "._mlp",
    "mlp_log_covering": "._mlp",
    "mlp_terms": "._mlp",
    "ModelBound": "._model_bound",
    "model_bound": "._model_bound",
    "model_covering_curve": "._model_bound",
    "model_terms": "._model_bound",
    "BoundConfig": "._model_bound",
    "MODEL_FAMILIES": "._model_bound",
    "NoFiniteBound": "._model_bound",
    "NORM_FAMILIES": "._transformer",
    "CoveringCurve": "._transformer",
    "MatrixTerm": "._transformer",
    "TermContribution": "._transformer",
    "TransformerCovering": "._transformer",
    "transformer_log_covering": "._transformer",
}


# Note [lazy package] in transcover._lazy: importing the package imports none of these modules.
from .._lazy import lazy_attributes as _lazy_attributes  # noqa: E402

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)


__all__ = [
    "Allocation", "CoverCost", "allocate_mixed", "budget_allocation", "budget_allocation_log",
    "ball_log_covering", "ball_log_covering_simple", "ball_log_packing_lower", "box_log_covering",
    "box_log_covering_linf", "box_linf_centres_per_axis",
    "SpectralComplexity", "bft_margin_term", "bft_spectral_complexity",
    "CompositeCovering", "composite_log_covering", "g5_leading_log",
    "Diagnosis", "diagnose", "DudleyBound", "dudley_entropy_integral", "dudley_inverse_square",
    "DataRouteBound", "covering_margin_bound", "margin_change_bound", "margins", "pair_norms",
    "OccamBound", "binary_kl", "catoni_occam_bound", "error_rate_upper", "kl_inverse_upper", "kl_occam_bound",
    "occam_bounds", "occam_complexity", "sqrt_occam_bound",
    "GeneralisationBound", "concentration_term", "generalisation_bound", "generalisation_gap",
    "sample_size_for_gap",
    "bft_matrix_log_covering", "linear_linf_log_covering", "matrix_linf_log_covering",
    "spectral_ball_matrix_log_covering",
    "MLPCovering", "mlp_log_covering", "mlp_terms", "NormGrid", "NORM_GRID_MAX_STEPS",
    "BoundConfig", "ModelBound", "model_bound", "model_covering_curve", "model_terms", "MODEL_FAMILIES",
    "NoFiniteBound",
    "NORM_FAMILIES", "CoveringCurve", "MatrixTerm", "TermContribution", "TransformerCovering",
    "transformer_log_covering",
]
