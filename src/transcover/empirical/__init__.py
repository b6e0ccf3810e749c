"""Empirical covering numbers (seed 1.1, 6.1): eps-nets, packings, Monte Carlo, uniform search, asymptotics.

Finite sets: :func:`estimate_covering_number` brackets ``N(eps)`` between a strict 2eps-packing
and a greedy eps-net; :func:`exact_covering_number` is the exact value on tiny sets.  Parametric
classes: :func:`sample_reference_class` / :func:`sample_local_class` draw members and
:func:`monte_carlo_covering` gives lower estimates of the class's packing and covering numbers;
:func:`uniform_covering_search` searches sample sets for the uniform covering number; the
``_asymptotics`` fits compare growth rates with the bounds'.
"""

from ._asymptotics import EpsGrowthFit as EpsGrowthFit
from ._asymptotics import LineFit as LineFit
from ._asymptotics import fit_eps_growth as fit_eps_growth
from ._asymptotics import fit_line as fit_line
from ._asymptotics import fit_power_growth as fit_power_growth
from ._asymptotics import usable_points as usable_points
from ._classes import NormRadii as NormRadii
from ._classes import RADIAL_LAWS as RADIAL_LAWS
from ._classes import ReferenceClassSample as ReferenceClassSample
from ._classes import random_inputs as random_inputs
from ._classes import sample_reference_class as sample_reference_class
from ._exact import exact_covering_number as exact_covering_number
from ._io import load_outputs as load_outputs
from ._local import LOCAL_ROLES as LOCAL_ROLES
from ._classes import MAX_SEED as MAX_SEED
from ._classes import check_seed as check_seed
from ._local import LocalClassSample as LocalClassSample
from ._local import sample_local_class as sample_local_class
from ._metrics import as_outputs as as_outputs
from ._metrics import check_eps as check_eps
from ._metrics import check_q as check_q
from ._metrics import distance_matrix as distance_matrix
from ._metrics import sample_distance as sample_distance
from ._montecarlo import MonteCarloCovering as MonteCarloCovering
from ._montecarlo import covering_of_outputs as covering_of_outputs
from ._montecarlo import monte_carlo_covering as monte_carlo_covering
from ._montecarlo import SEED_BLOCK as SEED_BLOCK
from ._montecarlo import block_seed as block_seed
from ._montecarlo import check_output_memory as check_output_memory
from ._montecarlo import check_outputs_memory as check_outputs_memory
from ._montecarlo import outputs_bytes as outputs_bytes
from ._montecarlo import reference_block_outputs as reference_block_outputs
from ._nets import CoveringEstimate as CoveringEstimate
from ._nets import IncrementalNet as IncrementalNet
from ._nets import estimate_covering_number as estimate_covering_number
from ._nets import greedy_net as greedy_net
from ._nets import maximal_packing as maximal_packing
from ._nets import torch_threads as torch_threads
from ._nets import FORWARD_PAD_ASSUMPTION as FORWARD_PAD_ASSUMPTION
from ._nets import FORWARD_REL_PAD as FORWARD_REL_PAD
from ._nets import forward_pad as forward_pad
from ._uniform import MAX_FUNCTIONS as MAX_FUNCTIONS
from ._uniform import UniformSearchResult as UniformSearchResult
from ._uniform import uniform_covering_search as uniform_covering_search

__all__ = [
    "as_outputs", "check_eps", "check_q", "distance_matrix", "sample_distance",
    "CoveringEstimate", "IncrementalNet", "estimate_covering_number", "greedy_net", "maximal_packing",
    "torch_threads", "FORWARD_PAD_ASSUMPTION", "FORWARD_REL_PAD", "forward_pad",
    "exact_covering_number", "load_outputs",
    "MAX_SEED", "check_seed",
    "NormRadii", "RADIAL_LAWS", "ReferenceClassSample", "random_inputs", "sample_reference_class",
    "LOCAL_ROLES", "LocalClassSample", "sample_local_class",
    "MonteCarloCovering", "covering_of_outputs", "monte_carlo_covering",
    "SEED_BLOCK", "block_seed", "reference_block_outputs", "check_output_memory", "check_outputs_memory",
    "outputs_bytes",
    "MAX_FUNCTIONS", "UniformSearchResult", "uniform_covering_search",
    "EpsGrowthFit", "LineFit", "fit_eps_growth", "fit_line", "fit_power_growth",
    "usable_points",
]
