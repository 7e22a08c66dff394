"""Hugging Face ``transformers.Trainer``: one callback, nothing else to change.

    trainer = Trainer(model, args, train_dataset=train, callbacks=[ArcCallback("arc.yaml")])
    trainer.train()

At ``on_train_begin`` the callback finds what the Trainer prepared (``model_wrapped``: a DDP module, a DeepSpeed
engine or an FSDP2 model; the optimizer Accelerate wraps, its ``GradScaler`` under fp16; the LR scheduler) and
attaches arc_engine to it. It then keeps the Trainer honest, on every rank alike:

- **the loss**: every micro-batch's training loss is recorded where the Trainer back-propagates it
  (``accelerator.backward``), before any loss scaling and multiplied back by the gradient-accumulation steps the
  Trainer divided it by, so what arc_engine judges is each micro-batch's loss and the step's is their mean: the
  ``loss`` the Trainer logs. Evaluation never goes through ``backward``, so it is never recorded. Fault injection
  (``faults``) acts on that loss.
- **the step counter**: ``state.global_step`` counts the steps whose update was applied (:attr:`Arc.applied_steps`):
  a skipped step does not advance it, a rollback takes it back to the restored state's count.
- **the LR scheduler** steps only on applied steps (the Trainer already holds it back on a loss-scaler overflow),
  and a rollback restores it with the model and optimizer (under DeepSpeed too: it lives outside the engine).
- **the data**: the Trainer's loader cannot seek, so after a rollback training goes on with the next batches
  (``recovery.skip_data: stream``; ``none``, replaying batches, is refused) and the events say so.
- **the logs**: each training log the Trainer writes gains ``arc_skipped_steps``, ``arc_rollbacks`` and
  ``arc_applied_steps``.
- **a stop**: :class:`~arc_engine.ArcAbort` on any rank (the same step on every rank) ends training cleanly (no
  checkpoint or evaluation of the failed state) and then the process with the abort's exit code
  (``exit_on_abort=False``: ``trainer.train()`` raises the ``ArcAbort`` instead).
- **the watchdog** does not count evaluation or checkpoint saves.
"""

from __future__ import annotations

import functools
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine.attach import Arc, attach
from arc_engine.compat import Capabilities
from arc_engine.config import ArcConfig, load_config
from arc_engine.integrations.hf import internals as hf_internals
from arc_engine.integrations.pytorch.loops import (
    end_with,
    one_resume,
    report_capabilities,
    resume_at,
    stream_config,
)
from arc_engine.policy.decision import ArcAbort

try:
    from transformers import Trainer, TrainerCallback
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("arc_engine.integrations.hf needs transformers (pip install 'arc-engine[hf]')") from error


def resumed_data_position(args: Any, global_step: int, loader: Any) -> int:
    """Where the Trainer's loader reads next after resuming ``global_step``, in data positions (one per optimizer
    step over the epochs): it skips ``global_step`` steps' batches, or, with ``ignore_data_skip``, only the epochs
    they complete (``len(loader)`` micro-batches an epoch, ``gradient_accumulation_steps`` a step)."""
    if not args.ignore_data_skip or global_step == 0:
        return global_step
    try:
        batches = len(loader)
    except TypeError:  # an iterable dataset: one epoch of max_steps
        return 0
    per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)
    return global_step // per_epoch * per_epoch


def _calling_trainer() -> Any | None:
    """The ``Trainer`` whose callback handler is calling us (a few frames up the stack), if any."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class ArcCallback(TrainerCallback):
    """arc_engine for a Hugging Face ``Trainer`` (DDP, DeepSpeed ZeRO-1/2/3 or FSDP2 through Accelerate).

    ``config``: an :class:`ArcConfig`, a YAML path or None (defaults). ``trainer``: only where the callback is
    added to a Trainer after its construction from outside its own call stack (``trainer.add_callback``): the
    Trainer it belongs to. ``group``: the decision group (default: the whole job). ``exit_on_abort``: end the
    process with the abort's exit code (default) or let ``trainer.train()`` raise the ``ArcAbort``.
    After ``on_train_begin``, :attr:`arc` is the attached :class:`~arc_engine.Arc`."""

    def __init__(self, config: ArcConfig | str | Path | None = None, *, trainer: Any | None = None,
                 group: dist.ProcessGroup | None = None, exit_on_abort: bool = True) -> None:
        self.config = config
        self.group = group
        self.exit_on_abort = exit_on_abort
        self.arc: Arc | None = None
        self._trainer = trainer
        self._abort: ArcAbort | None = None
        self._step_offset = 0  # the Trainer's global_step when arc_engine attached (a resumed run's)
        self._loss_sum: torch.Tensor | None = None
        self._rollbacks = 0
        self._capabilities: Capabilities | None = None

    # ------------------------------------------------------------------ the Trainer's events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None:
            self._trainer = _calling_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer if self._trainer is not None else _calling_trainer()
        if trainer is None:
            raise RuntimeError("arc_engine ArcCallback: no Trainer found; pass it: ArcCallback(config, "
                               "trainer=trainer)")
        if self.arc is not None:
            raise RuntimeError("arc_engine ArcCallback: trainer.train() ran twice with one callback; give each "
                               "run a new ArcCallback")
        self._trainer = trainer
        config = self.config if isinstance(self.config, ArcConfig) else load_config(self.config)
        config = resume_at(stream_config(config), state.global_step)
        model = trainer.model_wrapped
        deepspeed = type(model).__module__.startswith("deepspeed.")
        scaler = hf_internals.accelerator_scaler(trainer)
        scheduler = trainer.lr_scheduler
        if deepspeed and model.lr_scheduler is not None and \
                hf_internals.inner_scheduler(scheduler) is model.lr_scheduler:
            scheduler = None  # a DeepSpeed config's "scheduler": the engine's own, which it steps and recovery restores
        self.arc = attach(model, None if deepspeed else trainer.optimizer, config, group=self.group,
                          lr_scheduler=scheduler, grad_scaler=None if deepspeed else scaler)
        one_resume(self.arc, state.global_step, "the Trainer (resume_from_checkpoint)",
                   resumed_data_position(args, state.global_step, kwargs.get("train_dataloader")))
        self._step_offset = state.global_step - self.arc.progress.applied_steps
        self._capabilities = hf_internals.check_trainer(trainer)
        report_capabilities(self.arc, self._capabilities)
        self._wrap(trainer)

    def _has(self, feature: str) -> bool:
        return self._capabilities is not None and self._capabilities.has(feature)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._has("logged_loss"):  # the Trainer's running sum of logged losses, kept to take undone steps out
            loss_sum = self._trainer._tr_loss
            self._loss_sum = loss_sum.detach().clone() if isinstance(loss_sum, torch.Tensor) else None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.arc is None or self._abort is not None:
            return
        try:  # the optimizer step and its loss scaler returned: a step the scaler skipped is closed here
            self.arc.end_step()
        except ArcAbort as abort:
            self._abort = abort
            return
        # the Trainer adds 1 to global_step right after this event: leave it one short of the applied count
        state.global_step = self._step_offset + self.arc.progress.applied_steps - 1
        if self.arc.progress.rolled_back != self._rollbacks:  # the undone steps leave the Trainer's history
            self._rollbacks = self.arc.progress.rolled_back
            state.log_history = [entry for entry in state.log_history
                                 if entry.get("step", 0) <= state.global_step + 1]
            self._remove_undone_checkpoints(args, state, state.global_step + 1)
            if self._has("log_counter") and self._trainer._globalstep_last_logged > state.global_step + 1:
                self._trainer._globalstep_last_logged = state.global_step + 1  # the next log counts from here
        loss_sum = self._trainer._tr_loss if self._has("logged_loss") else None
        if not self.arc.last_step_applied and self._loss_sum is not None and isinstance(loss_sum, torch.Tensor):
            loss_sum.copy_(self._loss_sum)  # the logged loss averages the applied steps only

    def _remove_undone_checkpoints(self, args: Any, state: Any, target: int) -> None:
        """After a rollback to global step ``target``: the Trainer's checkpoints of later steps hold the state the
        rollback undid. The ranks that save remove them (the step's checkpoint is written again when the run
        reaches it; a stop before then leaves the last checkpoint the run still stands behind), with one event."""
        if not args.should_save:
            return
        stale = sorted((path for path in Path(args.output_dir).glob("checkpoint-*")
                        if path.name.removeprefix("checkpoint-").isdigit()
                        and int(path.name.removeprefix("checkpoint-")) > target),
                       key=lambda path: int(path.name.removeprefix("checkpoint-")))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        if state.best_model_checkpoint is not None and Path(state.best_model_checkpoint) in stale:
            state.best_model_checkpoint = None
        if stale and self.arc is not None:
            self.arc.engine.emit_lifecycle(
                "checkpoints_removed", f"the rollback to global step {target} removed {len(stale)} Trainer "
                f"checkpoint(s) saved after it (they held the state it undid; each is saved again when its step is "
                f"reached): {', '.join(path.name for path in stale)}",
                {"global_step": target, "paths": [str(path) for path in stale]})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._abort is not None:  # nothing of the failed state is saved or evaluated
            control.should_training_stop = True
            control.should_save = control.should_evaluate = control.should_log = False
        elif self.arc is not None and not self.arc.last_step_applied:
            # a skip or a rollback: global_step did not advance past a step already saved, logged and evaluated
            # (a rollback's restored step was, when it was first reached)
            control.should_save = control.should_evaluate = control.should_log = False
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._abort is not None:  # the epoch's save and evaluation would be of the stopped state
            control.should_training_stop = True
            control.should_save = control.should_evaluate = control.should_log = False
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.arc is not None:
            self.arc.close()
        if self._abort is not None:
            end_with(self._abort, exit_on_abort=self.exit_on_abort)

    # ------------------------------------------------------------------ what the callback wraps

    def _wrap(self, trainer: Any) -> None:
        """On these instances only (the classes are untouched): ``accelerator.backward`` records the loss and
        catches a stop; the optimizer's ``step`` catches a stop; ``accelerator.optimizer_step_was_skipped`` is also
        true for a step arc_engine did not apply (the Trainer then leaves its scheduler); the evaluation and
        checkpoint saves pause the watchdog; ``log`` gains arc_engine's counters."""
        arc = self.arc
        assert arc is not None

        def catching(fn: Any) -> Any:
            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                if self._abort is not None:
                    return None
                try:
                    return fn(*args, **kwargs)
                except ArcAbort as abort:
                    self._abort = abort
                    return None
            return call

        backward = trainer.accelerator.backward
        per_token: list[torch.Tensor | None] = [None]  # the current micro-batch's (compute_loss -> backward)

        @functools.wraps(backward)
        def recording_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
            loss = arc.faults.on_loss(loss)
            factor, per_token[0] = per_token[0], None
            if factor is None:  # the micro-batch's mean, divided by the accumulation steps
                factor = hf_internals.accumulation_steps(trainer)
            arc.record_loss((loss.detach().double() * factor).to(loss.dtype))
            return backward(loss, **kwargs)

        if self._has("per_token_loss"):
            compute_loss = trainer.compute_loss

            @functools.wraps(compute_loss)
            def counting_compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
                items = kwargs.get("num_items_in_batch", args[1] if len(args) > 1 else None)
                per_token[0] = hf_internals.per_token_factor(trainer, inputs, items)
                return compute_loss(model, inputs, *args, **kwargs)

            trainer.compute_loss = counting_compute_loss

        trainer.accelerator.backward = catching(recording_backward)
        trainer.optimizer.step = catching(trainer.optimizer.step)

        # the Trainer steps its scheduler unless accelerator.optimizer_step_was_skipped (a loss-scaler overflow):
        # a step arc_engine did not apply counts as skipped too (a subclass for this instance: the property is the
        # class's, and the scheduler's own step must stay out of its state_dict)
        accelerator = trainer.accelerator
        base = type(accelerator)
        framework_skipped = base.optimizer_step_was_skipped

        def step_was_skipped(instance: Any) -> bool:
            return framework_skipped.fget(instance) or self._abort is not None or not arc.last_step_applied

        accelerator.__class__ = type(base.__name__, (base,), {"__module__": base.__module__,
                                                              "optimizer_step_was_skipped": property(step_was_skipped)})

        if self._has("watchdog_pauses"):  # hf_internals.WATCHDOG_PAUSED_METHODS; nestable: evaluate() in _evaluate()
            trainer.evaluate = _paused(arc, trainer.evaluate)
            trainer._evaluate = _paused(arc, trainer._evaluate)
            trainer.predict = _paused(arc, trainer.predict)
            trainer._save_checkpoint = _paused(arc, trainer._save_checkpoint)
            trainer.save_model = _paused(arc, trainer.save_model)
            trainer._load_best_model = _paused(arc, trainer._load_best_model)
            trainer._load_from_checkpoint = _paused(arc, trainer._load_from_checkpoint)

        trainer_log = trainer.log

        @functools.wraps(trainer_log)
        def logging(logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
            if "loss" in logs:  # a training log
                progress = arc.progress
                logs = {**logs, "arc_applied_steps": progress.applied_steps,
                        "arc_steps_not_applied": progress.steps_not_applied, "arc_rolled_back": progress.rolled_back,
                        "arc_lr_factor": arc.lr_factor}
            return trainer_log(logs, *args, **kwargs)

        trainer.log = logging


def _paused(arc: Arc, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with arc.watchdog_paused():
            return fn(*args, **kwargs)
    return call


__all__ = ["ArcCallback"]
