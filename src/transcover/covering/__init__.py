"""Covering numbers of Transformer classes and the generalisation bounds they give (seed 1.1, 2.2, 3).

Lemma G.2 (ball covers, ``_ball``), Lemma G.1 (budget allocation, ``_allocation``), matrix covers
(F2, F3, ``_matrix_covers``), the Transformer bound (F9, ``_transformer``), the MLP head and
Theorem G.5 (``_mlp``, ``_composite``), Dudley and generalisation (F11, ``_dudley``,
``_generalisation``), BFT's spectral complexity (F12, ``_bft``) and the model-level assembly
(``_model_bound``).  Everything is carried in log space.
"""

from ._allocation import Allocation as Allocation
from ._allocation import CoverCost as CoverCost
from ._allocation import allocate_mixed as allocate_mixed
from ._allocation import budget_allocation as budget_allocation
from ._allocation import budget_allocation_log as budget_allocation_log
from ._ball import ball_log_covering as ball_log_covering
from ._ball import ball_log_covering_simple as ball_log_covering_simple
from ._ball import ball_log_packing_lower as ball_log_packing_lower
from ._ball import box_log_covering as box_log_covering
from ._ball import box_linf_centres_per_axis as box_linf_centres_per_axis
from ._ball import box_log_covering_linf as box_log_covering_linf
from ._bft import SpectralComplexity as SpectralComplexity
from ._bft import bft_margin_term as bft_margin_term
from ._bft import bft_spectral_complexity as bft_spectral_complexity
from ._composite import CompositeCovering as CompositeCovering
from ._composite import composite_log_covering as composite_log_covering
from ._composite import g5_leading_log as g5_leading_log
from ._diagnosis import Diagnosis as Diagnosis
from ._diagnosis import diagnose as diagnose
from ._dudley import DudleyBound as DudleyBound
from ._dudley import dudley_entropy_integral as dudley_entropy_integral
from ._dudley import dudley_inverse_square as dudley_inverse_square
from ._data_route import DataRouteBound as DataRouteBound
from ._data_route import covering_margin_bound as covering_margin_bound
from ._data_route import margin_change_bound as margin_change_bound
from ._data_route import margins as margins
from ._data_route import pair_norms as pair_norms
from ._finite_class import OccamBound as OccamBound
from ._finite_class import binary_kl as binary_kl
from ._finite_class import catoni_occam_bound as catoni_occam_bound
from ._finite_class import error_rate_upper as error_rate_upper
from ._finite_class import kl_inverse_upper as kl_inverse_upper
from ._finite_class import kl_occam_bound as kl_occam_bound
from ._finite_class import occam_bounds as occam_bounds
from ._finite_class import occam_complexity as occam_complexity
from ._finite_class import sqrt_occam_bound as sqrt_occam_bound
from ._generalisation import GeneralisationBound as GeneralisationBound
from ._generalisation import concentration_term as concentration_term
from ._generalisation import generalisation_bound as generalisation_bound
from ._generalisation import generalisation_gap as generalisation_gap
from ._generalisation import sample_size_for_gap as sample_size_for_gap
from ._matrix_covers import bft_matrix_log_covering as bft_matrix_log_covering
from ._matrix_covers import linear_linf_log_covering as linear_linf_log_covering
from ._matrix_covers import matrix_linf_log_covering as matrix_linf_log_covering
from ._matrix_covers import spectral_ball_matrix_log_covering as spectral_ball_matrix_log_covering
from ._mlp import MLPCovering as MLPCovering
from ._mlp import mlp_log_covering as mlp_log_covering
from ._mlp import mlp_terms as mlp_terms
from ._model_bound import ModelBound as ModelBound
from ._model_bound import model_bound as model_bound
from ._model_bound import model_covering_curve as model_covering_curve
from ._model_bound import model_terms as model_terms
from ._model_bound import BoundConfig as BoundConfig
from ._model_bound import MODEL_FAMILIES as MODEL_FAMILIES
from ._transformer import NORM_FAMILIES as NORM_FAMILIES
from ._transformer import CoveringCurve as CoveringCurve
from ._transformer import MatrixTerm as MatrixTerm
from ._transformer import TermContribution as TermContribution
from ._transformer import TransformerCovering as TransformerCovering
from ._transformer import transformer_log_covering as transformer_log_covering

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
    "MLPCovering", "mlp_log_covering", "mlp_terms",
    "BoundConfig", "ModelBound", "model_bound", "model_covering_curve", "model_terms", "MODEL_FAMILIES",
    "NORM_FAMILIES", "CoveringCurve", "MatrixTerm", "TermContribution", "TransformerCovering",
    "transformer_log_covering",
]
