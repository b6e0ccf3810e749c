"""Training under norm constraints: tasks (digits, sparse tokens), the loop, checkpoints, experiments."""

_LAZY = {
    "load_checkpoint": "._checkpoint",
    "save_checkpoint": "._checkpoint",
    "STRATEGIES": "._experiment",
    "StagedConfig": "._experiment",
    "StagedResult": "._experiment",
    "staged_experiment": "._experiment",
    "TrainConfig": "._loop",
    "TrainResult": "._loop",
    "build_model": "._loop",
    "checkpoint_spec": "._loop",
    "is_train_checkpoint": "._source",
    "checkpoint_folder": "._source",
    "checkpoint_files": "._source",
    "data_files": "._source",
    "TASK_DATA": "._source",
    "load_data": "._source",
    "load_model": "._source",
    "load_model_task": "._source",
    "constraint_report": "._loop",
    "evaluate": "._loop",
    "exact_group_norms": "._loop",
    "train": "._loop",
    "NONVACUOUS_TASKS": "._nonvacuous",
    "NonvacuousCase": "._nonvacuous",
    "NonvacuousConfig": "._nonvacuous",
    "run_nonvacuous_case": "._nonvacuous:run_case",
    "ABLATION_PLAN": "._nonvacuous_report",
    "FULL_PLAN": "._nonvacuous_report",
    "QUICK_PLAN": "._nonvacuous_report",
    "NonvacuousResult": "._nonvacuous_report",
    "nonvacuous_experiment": "._nonvacuous_report",
    "TASKS": "._tasks",
    "Task": "._tasks",
    "load_task": "._tasks",
}


# Note [lazy package] in transcover._lazy: importing the package imports none of these modules (a train
# run is read as a model by commands that must not pay for torch before they need it).
from .._lazy import lazy_attributes as _lazy_attributes  # noqa: E402

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)

__all__ = [
    "Task", "TASKS", "load_task",
    "TrainConfig", "TrainResult", "train", "build_model", "evaluate", "exact_group_norms", "constraint_report",
    "save_checkpoint", "load_checkpoint", "checkpoint_spec", "is_train_checkpoint", "checkpoint_folder", "load_model",
    "load_model_task", "checkpoint_files", "data_files",
    "load_data", "TASK_DATA",
    "StagedConfig", "StagedResult", "staged_experiment", "STRATEGIES",
    "NonvacuousConfig", "NonvacuousCase", "NonvacuousResult", "nonvacuous_experiment", "run_nonvacuous_case",
    "NONVACUOUS_TASKS", "FULL_PLAN", "QUICK_PLAN", "ABLATION_PLAN",
]

# Note [callable modules] in transcover._entry: transcover.train(...) calls the API function of that name
from .._entry import make_callable as _make_callable  # noqa: E402

_make_callable(__name__)
