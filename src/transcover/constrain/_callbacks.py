"""Hooks for training loops: a Hugging Face ``TrainerCallback`` built lazily.

``import transcover.constrain`` never imports ``transformers``: the callback class subclasses
``transformers.TrainerCallback`` only when :func:`hf_callback` is first called.  For a plain
PyTorch loop use :meth:`Constrainer.step_hook` (an optimiser post-step hook) and
:class:`TrainingMonitor` directly.

Note [step progress]: optimiser step ``k`` (0-based) of ``N`` runs at progress ``k / (N - 1)``,
the convention of ``transcover.train``: the first step uses the loose radius, the last one the
target, exactly.  The Trainer's ``global_step`` counts *completed* steps, so at ``on_step_begin``
it is ``k``; the radius set there serves the step's forward (spectral caps) and the projection
after it (``on_step_end``).  (Issue 10, defect 10: the previous ``global_step / max_steps`` left
a 40-step run at 1.1x the target.)
"""

from __future__ import annotations

from functools import lru_cache

from ._export import save_plain, track_with
from ._monitor import TrainingMonitor, grad_norm
from ._plan import Constrainer

__all__ = ["hf_callback", "step_progress"]


def step_progress(step: int, max_steps: int) -> float:
    """Training progress of 0-based optimiser step ``step`` out of ``max_steps`` (Note [step progress])."""
    return step / (max_steps - 1) if max_steps > 1 else 1.0


def _resumed_folder():
    """The checkpoint folder a running ``Trainer.train(resume_from_checkpoint=...)`` resumes from: the Trainer keeps
    it in a local variable only (not in ``args`` or ``state``), so it is read off the calling frames; None when no
    Trainer frame holds one.  What is found is only a candidate: ``load_raw_state`` checks its digest."""
    import os
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        value = frame.f_locals.get("resume_from_checkpoint")
        if isinstance(value, (str, os.PathLike)) and "transformers" in frame.f_code.co_filename:
            return value
        frame = frame.f_back
    return None


@lru_cache(maxsize=1)
def _callback_class():
    from transformers import TrainerCallback

    class TranscoverCallback(TrainerCallback):
        """Moves the radii per optimiser step (Note [step progress]), projects after each step, logs
        the weights each step's forward used, certifies the targets at the end
        (:meth:`Constrainer.finalize`) and makes ``save_model`` / checkpoints write the plain,
        certified model (:func:`save_plain`).  Soft penalties must be added to the loss by the
        user's ``compute_loss`` (a callback cannot change the loss)."""

        def __init__(self, constrainer: Constrainer | None, monitor: TrainingMonitor | None):
            self.constrainer = constrainer
            self.monitor = monitor
            if constrainer is not None:  # before the Trainer loads a checkpoint to resume: its plain weights must
                save_plain(constrainer.model)  # reach the unconstrained tensors (the hook came too late, stop 39)
                track_with(constrainer.model, constrainer.tracker)  # a penalty's power iteration travels too
            if monitor is not None and constrainer is not None and monitor.radii is None:
                monitor.radii = constrainer.radii_in_force
                monitor.ratios = constrainer.bounds_sigma
            self._grad = None

        def on_train_begin(self, args, state, control, **kwargs):
            if self.constrainer is not None:
                save_plain(self.constrainer.model)
                self.constrainer.set_progress(step_progress(state.global_step, state.max_steps))
                if state.global_step == 0:  # a fresh run: the first step's forward uses projected weights, as in
                    self.constrainer.before_training()  # ``transcover.train`` (red team 207)
                if state.global_step > 0:  # resumed: the weights were projected at the previous step's radius
                    self._restore_raw_state(args, state)
                    self.constrainer.resumed_after(step_progress(state.global_step - 1, state.max_steps))

        def _restore_raw_state(self, args, state):
            """Note [exact trainer resume]: the Trainer loaded the plain weights; the constrained state saved
            beside them replaces them.  Only a file whose digest matches the weights just loaded is used, so
            another run's checkpoint of the same step in ``output_dir`` is never read (stop 39 red team)."""
            import os
            import warnings

            from .._errors import TranscoverWarning
            from ._export import RAW_STATE_FILE, expects_raw_state, load_raw_state

            if not expects_raw_state(self.constrainer.model):  # project, clip: the plain checkpoint is the state
                return

            named = _resumed_folder() or getattr(args, "resume_from_checkpoint", None)
            out = getattr(args, "output_dir", None)
            folders = [f for f in (named if isinstance(named, (str, os.PathLike)) else None,
                                   os.path.join(out, f"checkpoint-{state.global_step}") if out else None) if f]
            if not any(load_raw_state(self.constrainer.model, f) for f in folders):
                warnings.warn(f"resumed at step {state.global_step} without the {RAW_STATE_FILE} of the weights "
                              f"loaded (looked in {', '.join(map(str, folders)) or 'no folder'}): the plain checkpoint "
                              "restores the model's function, not its unconstrained tensors or the power iteration of "
                              "a spectral cap or a penalty, so the run is not the uninterrupted one",
                              TranscoverWarning, stacklevel=2)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.constrainer is not None:
                self.constrainer.set_progress(step_progress(state.global_step, state.max_steps))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            model = kwargs.get("model")
            if self.monitor is not None:
                # the Trainer clips before this hook: with clipping on, the norm here is the clipped one (every value
                # above max_grad_norm read as max_grad_norm, stop 38 red team), so the pre-clip norm is taken from
                # the Trainer's own logs (on_log) instead
                clipped = (getattr(args, "max_grad_norm", None) or 0) > 0
                self._grad = grad_norm(model) if model is not None and not clipped else None
                self.monitor.snapshot()  # after backward, before the step: the forward's weights

        def on_step_end(self, args, state, control, **kwargs):
            if self.constrainer is not None:
                self.constrainer.after_step()
            if self.monitor is not None:
                progress = self.constrainer.progress if self.constrainer is not None else None
                self.monitor.log(step=state.global_step, epoch=state.epoch, progress=progress, grad_norm=self._grad)

        def on_train_end(self, args, state, control, **kwargs):
            # Only a run that reached its last step ends at the targets (Note [step progress]).
            if self.constrainer is not None and state.max_steps and state.global_step >= state.max_steps:
                # a half-precision Trainer's forward runs on weights cast to it: certify the casts too (stop 38)
                import torch

                cast = torch.float16 if getattr(args, "fp16", False) else (
                    torch.bfloat16 if getattr(args, "bf16", False) else None)
                self.constrainer.finalize(forward_dtype=cast)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.monitor is not None and logs:
                fields = {}
                if "loss" in logs:  # the Trainer's mean batch loss since its last log: a batch loss, as "loss" is
                    fields["loss"] = logs["loss"]  # in `transcover train` ("train_loss" there: the whole set's)
                if "eval_loss" in logs:
                    fields["test_loss"] = logs["eval_loss"]
                if logs.get("grad_norm") is not None:  # the Trainer's norm before clipping
                    fields["grad_norm"] = float(logs["grad_norm"])
                if fields:  # an evaluation also certifies (Note [certified columns] in ``_monitor``)
                    # an evaluation ran on the current weights: measured and certified; a training-loss row is not
                    # (its batches ran on earlier steps' weights, measured in those steps' rows)
                    evaluation = "eval_loss" in logs
                    self.monitor.log(step=state.global_step, epoch=state.epoch, certify=evaluation,
                                     measure=evaluation, **fields)

    return TranscoverCallback


def hf_callback(constrainer: Constrainer | None = None, monitor: TrainingMonitor | None = None):
    """A ``transformers.TrainerCallback`` that drives ``constrainer`` and feeds ``monitor``.

    The monitor's ``grad_norm`` is the gradient norm before clipping: read at each step when the Trainer does not
    clip (``max_grad_norm = 0``), else taken from the Trainer's own log at its logging steps (the callback's hooks
    run after the clipping, where every norm above the cap reads as the cap).  A Trainer in fp16/bf16 has the
    final weights certified as cast to that dtype too (``Constrainer.finalize(forward_dtype=)``).

    Example (not run: needs a Trainer)::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[hf_callback(constrain(model, cfg), TrainingMonitor(model, "out/run"))])
        trainer.train()          # the last step runs at the target radius; finalize() certifies it
        trainer.save_model(out)  # plain weights (no parametrizations), reload with from_pretrained
    """
    return _callback_class()(constrainer, monitor)
