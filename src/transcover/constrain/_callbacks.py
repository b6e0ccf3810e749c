"""Hooks for training loops: a Hugging Face ``TrainerCallback`` built lazily.

``import transcover.constrain`` never imports ``transformers``: the callback class subclasses
``transformers.TrainerCallback`` only when :func:`hf_callback` is first called.  For a plain
PyTorch loop use :meth:`Constrainer.step_hook` (an optimiser post-step hook) and
:class:`TrainingMonitor` directly.
"""

from __future__ import annotations

from functools import lru_cache

from ._monitor import TrainingMonitor, grad_norm
from ._plan import Constrainer

__all__ = ["hf_callback"]


@lru_cache(maxsize=1)
def _callback_class():
    from transformers import TrainerCallback

    class TranscoverCallback(TrainerCallback):
        """Moves the radii with ``global_step / max_steps``, projects after each optimiser step,
        and logs norms with the monitor.  Soft penalties must be added to the loss by the user's
        ``compute_loss`` (a callback cannot change the loss)."""

        def __init__(self, constrainer: Constrainer | None, monitor: TrainingMonitor | None):
            self.constrainer = constrainer
            self.monitor = monitor
            if monitor is not None and constrainer is not None and monitor.radii is None:
                monitor.radii = constrainer.radii

        def _progress(self, state) -> float:
            return state.global_step / state.max_steps if state.max_steps else 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            if self.constrainer is not None:
                self.constrainer.set_progress(0.0)

        def on_step_begin(self, args, state, control, **kwargs):
            # The radius of this step, so that the projection after it uses the same one.
            if self.constrainer is not None:
                self.constrainer.set_progress(self._progress(state))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            model = kwargs.get("model")
            if self.monitor is not None and model is not None:
                self._grad = grad_norm(model)

        def on_step_end(self, args, state, control, **kwargs):
            if self.constrainer is not None:
                self.constrainer.after_step()
            if self.monitor is not None:
                self.monitor.log(step=state.global_step, epoch=state.epoch, progress=self._progress(state),
                                 grad_norm=getattr(self, "_grad", None))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.monitor is not None and logs:
                fields = {}
                if "loss" in logs:
                    fields["train_loss"] = logs["loss"]
                if "eval_loss" in logs:
                    fields["test_loss"] = logs["eval_loss"]
                if fields:
                    self.monitor.log(step=state.global_step, epoch=state.epoch, **fields)

    return TranscoverCallback


def hf_callback(constrainer: Constrainer | None = None, monitor: TrainingMonitor | None = None):
    """A ``transformers.TrainerCallback`` that drives ``constrainer`` and feeds ``monitor``.

    Example (not run: needs a Trainer)::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[hf_callback(constrain(model, cfg), TrainingMonitor(model, "out/run"))])
    """
    return _callback_class()(constrainer, monitor)
