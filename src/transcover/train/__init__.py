"""Training under norm constraints: tasks (digits, sparse tokens), the loop, checkpoints, experiments."""

from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import save_checkpoint as save_checkpoint
from ._experiment import STRATEGIES as STRATEGIES
from ._experiment import StagedConfig as StagedConfig
from ._experiment import StagedResult as StagedResult
from ._experiment import staged_experiment as staged_experiment
from ._loop import TrainConfig as TrainConfig
from ._loop import TrainResult as TrainResult
from ._loop import build_model as build_model
from ._loop import checkpoint_spec as checkpoint_spec
from ._loop import is_train_checkpoint as is_train_checkpoint
from ._loop import constraint_report as constraint_report
from ._loop import evaluate as evaluate
from ._loop import exact_group_norms as exact_group_norms
from ._loop import train as train
from ._nonvacuous import NONVACUOUS_TASKS as NONVACUOUS_TASKS
from ._nonvacuous import NonvacuousCase as NonvacuousCase
from ._nonvacuous import NonvacuousConfig as NonvacuousConfig
from ._nonvacuous import run_case as run_nonvacuous_case
from ._nonvacuous_report import ABLATION_PLAN as ABLATION_PLAN
from ._nonvacuous_report import FULL_PLAN as FULL_PLAN
from ._nonvacuous_report import QUICK_PLAN as QUICK_PLAN
from ._nonvacuous_report import NonvacuousResult as NonvacuousResult
from ._nonvacuous_report import nonvacuous_experiment as nonvacuous_experiment
from ._tasks import TASKS as TASKS
from ._tasks import Task as Task
from ._tasks import load_task as load_task

__all__ = [
    "Task", "TASKS", "load_task",
    "TrainConfig", "TrainResult", "train", "build_model", "evaluate", "exact_group_norms", "constraint_report",
    "save_checkpoint", "load_checkpoint", "checkpoint_spec", "is_train_checkpoint",
    "StagedConfig", "StagedResult", "staged_experiment", "STRATEGIES",
    "NonvacuousConfig", "NonvacuousCase", "NonvacuousResult", "nonvacuous_experiment", "run_nonvacuous_case",
    "NONVACUOUS_TASKS", "FULL_PLAN", "QUICK_PLAN", "ABLATION_PLAN",
]

# Note [callable modules] in transcover._entry: transcover.train(...) calls the API function of that name
from .._entry import make_callable as _make_callable  # noqa: E402

_make_callable(__name__)
