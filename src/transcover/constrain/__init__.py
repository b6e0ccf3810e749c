"""Enforcing the seed's norm constraints during training (seed 2.1, 5.2, 6.2, closing remark).

Parametrizations (:func:`spectral_cap`, :func:`product_cap`, :func:`norm_cap`), exact projections
(:func:`project_spectral_`, :func:`project_product_`, :func:`project_bias_`), clipping, soft
penalties, radius schedules, a monitor and training-loop hooks; :func:`constrain` applies a whole
:class:`ConstraintConfig` per group (KQ, OV, W1, W2, b1, b2, head) and layer.  See README.md.
"""

from ._callbacks import hf_callback as hf_callback
from ._clip import clip_weights_ as clip_weights_
from ._clip import norm_cap as norm_cap
from ._export import constrained_tensors as constrained_tensors
from ._export import export_plain as export_plain
from ._export import load_raw_state as load_raw_state
from ._export import save_plain as save_plain
from ._export import save_raw_state as save_raw_state
from ._export import strip_constraints as strip_constraints
from ._layout import HeadLayout as HeadLayout
from ._monitor import CAPACITY_KIND as CAPACITY_KIND
from ._monitor import TrainingMonitor as TrainingMonitor
from ._monitor import certified_record as certified_record
from ._monitor import grad_norm as grad_norm
from ._monitor import read_history as read_history
from ._measure import certified_model_norms as certified_model_norms
from ._measure import certified_slot_norm as certified_slot_norm
from ._measure import certified_slot_uppers as certified_slot_uppers
from ._measure import exact_slot_norms as exact_slot_norms
from ._measure import forward_weights as forward_weights
from ._penalties import SigmaTracker as SigmaTracker
from ._penalties import capacity_proxy as capacity_proxy
from ._penalties import layer_lipschitz_factor as layer_lipschitz_factor
from ._penalties import lipschitz_regulariser as lipschitz_regulariser
from ._penalties import log_spectral_penalty as log_spectral_penalty
from ._penalties import spectral_hinge_penalty as spectral_hinge_penalty
from ._plan import METHODS as METHODS
from ._plan import ConstraintConfig as ConstraintConfig
from ._plan import Constrainer as Constrainer
from ._plan import constrain as constrain
from ._plan import parse_radii as parse_radii
from ._product import product_cap as product_cap
from ._projection import project_bias_ as project_bias_
from ._projection import project_product_ as project_product_
from ._projection import project_spectral_ as project_spectral_
from ._schedules import SCHEDULE_KINDS as SCHEDULE_KINDS
from ._schedules import RadiusSchedule as RadiusSchedule
from ._slots import GROUPS as GROUPS
from ._slots import Slot as Slot
from ._slots import find_slots as find_slots
from ._spectral import power_iteration as power_iteration
from ._spectral import product_power_iteration as product_power_iteration
from ._spectral import remove_spectral_cap as remove_spectral_cap
from ._spectral import spectral_cap as spectral_cap

__all__ = [
    "certified_slot_norm", "exact_slot_norms", "forward_weights", "certified_model_norms", "certified_slot_uppers",
    "certified_record",
    "spectral_cap", "remove_spectral_cap", "product_cap", "norm_cap", "HeadLayout",
    "power_iteration", "product_power_iteration",
    "project_spectral_", "project_product_", "project_bias_", "clip_weights_",
    "spectral_hinge_penalty", "log_spectral_penalty", "layer_lipschitz_factor", "lipschitz_regulariser",
    "capacity_proxy", "SigmaTracker",
    "RadiusSchedule", "SCHEDULE_KINDS",
    "Slot", "find_slots", "GROUPS",
    "ConstraintConfig", "Constrainer", "constrain", "parse_radii", "METHODS",
    "strip_constraints", "export_plain", "constrained_tensors", "save_plain", "save_raw_state", "load_raw_state",
    "TrainingMonitor", "grad_norm", "read_history", "CAPACITY_KIND",
    "hf_callback",
]
