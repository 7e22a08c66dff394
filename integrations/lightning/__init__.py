"""PyTorch Lightning: one callback, nothing else to change.

    trainer = L.Trainer(strategy="ddp", max_steps=1000, callbacks=[ArcCallback("arc.yaml")])
    trainer.fit(module, train_loader)

At ``on_train_start`` the callback attaches arc_engine to what the strategy prepared (``trainer.strategy.model``: the
DDP-wrapped module or the DeepSpeed engine; ``trainer.optimizers[0]``; the mixed-precision plugin's ``GradScaler``;
the first LR scheduler) and keeps Lightning honest, on every rank alike:

- **the loss**: each micro-batch's training loss is recorded as ``training_step`` returns it (before Lightning
  divides it by ``accumulate_grad_batches``), after arc_engine's loss faults; validation never goes through
  ``training_step``, so it is never recorded.
- **the order**: Lightning's default precision runs the forward/backward closure inside ``optimizer.step()``, after
  the optimizer's step pre-hooks, where arc_engine decides. The callback runs the closure first (once; the
  optimizer then gets its result), so the decision sees this step's gradients.
- **the step counter**: ``trainer.global_step`` counts applied steps (:attr:`Arc.applied_steps`): a skipped step
  does not advance it, a rollback takes it back, so ``max_steps`` means applied steps.
- **the LR scheduler** steps on applied steps only when its interval is ``"step"`` (``lr_scheduler_step`` is held
  back otherwise); an ``"epoch"`` one steps once per epoch whatever the epoch's last batch did. A rollback restores
  it (under DeepSpeed too: Lightning steps it outside the engine).
- **the data**: Lightning's loader cannot seek: after a rollback training goes on with the next batches
  (``recovery.skip_data: stream``).
- **a stop**: :class:`~arc_engine.ArcAbort` ends ``fit`` where the step returns, on every rank: arc_engine closes,
  Lightning finalizes its loggers and tears down (its ``on_exception`` path), and the process ends with the abort's
  exit code (``exit_on_abort=False``: ``fit`` raises the ``ArcAbort``). No validation, checkpoint or epoch-end hook
  runs on the stopped state, and ``min_steps``/``min_epochs`` cannot hold the loop open.
- **checkpoints**: a rollback to global step G removes the trainer checkpoints saved after G (they hold the state
  it undid) and re-arms ``ModelCheckpoint``, so each step's checkpoint is the surviving run's.
- **the logs and validation** follow applied steps: a step not applied (a skip, a rollback) writes no logger row
  and triggers no validation (the weights are those of a step already logged and validated).
- **the watchdog** does not count validation or checkpoint saves.

Strategies: DDP (and a single device) and DeepSpeed ZeRO-1/2/3. Lightning's ``FSDPStrategy`` wraps with FSDP1, which
arc_engine does not take (FSDP2 ``fully_shard`` models: ``ModelParallelStrategy``, through :func:`arc_engine.attach`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from arc_engine.attach import Arc, attach
from arc_engine.compat import Capabilities
from arc_engine.config import ArcConfig, load_config
from arc_engine.integrations.lightning import internals as lightning_internals
from arc_engine.integrations.pytorch.loops import (
    end_with,
    one_resume,
    report_capabilities,
    resume_at,
    stream_config,
)
from arc_engine.policy.decision import ArcAbort

try:
    from lightning.pytorch import Callback
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("arc_engine.integrations.lightning needs lightning (pip install 'arc-engine[lightning]')") \
        from error


class ArcCallback(Callback):
    """arc_engine for a Lightning ``Trainer`` (DDP or DeepSpeed strategies; automatic optimization).

    ``config``: an :class:`ArcConfig`, a YAML path or None (defaults). ``group``: the decision group (default: the
    whole job). ``exit_on_abort``: end the process with the abort's exit code once ``fit`` wound down (default) or
    let ``fit`` raise the ``ArcAbort``. After ``on_train_start``, :attr:`arc` is the attached :class:`~arc_engine.Arc`.
    """

    def __init__(self, config: ArcConfig | str | Path | None = None, *, group: dist.ProcessGroup | None = None,
                 exit_on_abort: bool = True) -> None:
        self.config = config
        self.group = group
        self.exit_on_abort = exit_on_abort
        self.arc: Arc | None = None
        self._abort: ArcAbort | None = None
        self._step_offset = 0
        self._log_offset = 0  # the loggers' step when arc_engine attached
        self._paused: Any = None  # the watchdog's pause during validation
        self._capabilities: Capabilities | None = None
        self._saves: list[tuple[int, str]] = []  # (global step, path) of every trainer.save_checkpoint
        self._rollbacks = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.arc is not None:
            raise RuntimeError("arc_engine ArcCallback: fit ran twice with one callback; give each run a new one")
        if not pl_module.automatic_optimization:
            raise ValueError("arc_engine ArcCallback: manual optimization is not supported; attach arc_engine in "
                             "your training_step with arc_engine.attach")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"arc_engine ArcCallback: one optimizer is supported, this module has "
                             f"{len(trainer.optimizers)}")
        config = self.config if isinstance(self.config, ArcConfig) else load_config(self.config)
        model = trainer.strategy.model
        if type(model).__name__ == "FullyShardedDataParallel":
            raise ValueError("arc_engine ArcCallback: Lightning's FSDPStrategy wraps the model with FSDP1, which "
                             "arc_engine does not support; use DDP, DeepSpeed, or FSDP2 (fully_shard) with "
                             "arc_engine.attach")
        deepspeed = type(model).__module__.startswith("deepspeed.")
        schedulers = trainer.lr_scheduler_configs
        scheduler = schedulers[0].scheduler if schedulers else None
        scaler = lightning_internals.precision_scaler(trainer)
        self.arc = attach(model, None if deepspeed else trainer.optimizers[0],
                          resume_at(stream_config(config), trainer.global_step),
                          group=self.group, lr_scheduler=scheduler, grad_scaler=None if deepspeed else scaler)
        one_resume(self.arc, trainer.global_step, "Lightning (ckpt_path)",
                   lightning_internals.resumed_data_position(trainer))
        self._step_offset = trainer.global_step - self.arc.progress.applied_steps
        self._capabilities = found = lightning_internals.check_trainer(trainer)
        report_capabilities(self.arc, found)
        if found.has("logging_step"):
            self._log_offset = trainer.fit_loop.epoch_loop._batches_that_stepped - self.arc.progress.applied_steps
        self._wrap(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.arc is None:
            return
        try:  # the optimizer step and its loss scaler returned: a step the scaler skipped is closed here
            self.arc.end_step()
        except ArcAbort as abort:
            self._stop(abort)
        if self._capabilities is None or trainer.fit_loop._should_accumulate():
            return
        if self._capabilities.has("step_counter"):
            lightning_internals.step_progress(trainer).completed = self._step_offset + self.arc.progress.applied_steps
        if self._capabilities.has("logging_step"):
            # Lightning adds 1 after this batch's logs: they carry the applied steps before this one's
            trainer.fit_loop.epoch_loop._batches_that_stepped = self._log_offset + self.arc.progress.applied_steps - 1
        if self._capabilities.has("applied_only") and not self.arc.last_step_applied:
            trainer.fit_loop.epoch_loop._skip_next_val = True  # the weights of a step already validated
        if self.arc.progress.rolled_back != self._rollbacks:
            self._rollbacks = self.arc.progress.rolled_back
            if self._capabilities.has("checkpoint_rewind"):
                self._rewind_checkpoints(trainer)

    def _rewind_checkpoints(self, trainer: Any) -> None:
        """After a rollback to global step G: a checkpoint saved at a later step holds a state the rollback undid
        (the run reaches that step again with other weights), and ModelCheckpoint would not save it again (it
        remembers its last saved step). Remove those files (every rank alike; the strategy removes on rank 0), drop
        them from the callbacks' records and re-arm their saves, so each step's checkpoint is the surviving run's."""
        target = trainer.global_step
        stale = [path for step, path in self._saves if step > target]
        self._saves = [(step, path) for step, path in self._saves if step <= target]
        for path in dict.fromkeys(stale):
            trainer.strategy.remove_checkpoint(path)
        for callback in trainer.checkpoint_callbacks:
            callback._last_global_step_saved = min(callback._last_global_step_saved, target)
            for path in stale:
                callback.best_k_models.pop(path, None)
            if callback.best_model_path in stale:
                callback.best_model_path = ""
            if callback.last_model_path in stale:
                callback.last_model_path = ""
        if stale:
            assert self.arc is not None
            self.arc.engine.emit_lifecycle(
                "checkpoints_removed", f"the rollback to step {target} removed {len(stale)} trainer checkpoint(s) "
                f"saved after it (they held the state it undid; they are saved again when their step is reached): "
                f"{', '.join(stale)[:400]}", {"global_step": target, "paths": stale})

    def _stop(self, abort: ArcAbort) -> NoReturn:
        """End ``fit`` now, on every rank alike (the verdict is agreed): Lightning's exception path finalizes the
        loggers and tears down, and nothing of the loop (validation, checkpoints, epoch ends, ``min_steps``) runs on
        the stopped state."""
        self._abort = abort
        if self.arc is not None:
            self.arc.close()
        end_with(abort, exit_on_abort=self.exit_on_abort)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.arc is not None and self._paused is None:  # Arc.watchdog_paused(), held across the two events
            self._paused = self.arc.watchdog_paused()
            self._paused.__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._paused is not None:
            self._paused.__exit__(None, None, None)
            self._paused = None

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.arc is not None:
            self.arc.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.arc is not None and self._abort is None:
            self.arc.close()

    # ------------------------------------------------------------------ what the callback wraps

    def _wrap(self, trainer: Any, pl_module: Any) -> None:
        """On the LightningModule instance only: ``training_step`` records the loss, ``optimizer_step`` runs the
        closure before the step and turns a stop into ``should_stop``, ``lr_scheduler_step`` steps on applied steps;
        the checkpoint save pauses the watchdog."""
        arc = self.arc
        assert arc is not None
        training_step = pl_module.training_step

        @functools.wraps(training_step)
        def recording_training_step(*args: Any, **kwargs: Any) -> Any:
            output = training_step(*args, **kwargs)
            loss = output["loss"] if isinstance(output, dict) else output
            if not isinstance(loss, torch.Tensor):
                return output  # None: Lightning skips this batch's backward
            loss = arc.faults.on_loss(loss)
            arc.record_loss(loss.detach())
            return {**output, "loss": loss} if isinstance(output, dict) else loss

        optimizer_step = pl_module.optimizer_step

        @functools.wraps(optimizer_step)
        def closure_first(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
            if optimizer_closure is not None:
                result = optimizer_closure()  # forward and backward now: the step's pre-hooks see its gradients
                optimizer_closure = functools.partial(lambda value: value, result)
            try:
                return optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            except ArcAbort as abort:
                self._stop(abort)

        scheduler_step = pl_module.lr_scheduler_step

        intervals = {id(config.scheduler): config.interval for config in trainer.lr_scheduler_configs}

        @functools.wraps(scheduler_step)
        def applied_only(scheduler: Any, metric: Any) -> Any:
            # a step-interval scheduler follows applied steps; an epoch-interval one (plateau included) steps once
            # per epoch, whatever the epoch's last batch did
            if intervals.get(id(scheduler), "step") == "step" and not arc.last_step_applied:
                return None
            return scheduler_step(scheduler, metric)

        pl_module.training_step = recording_training_step
        pl_module.optimizer_step = closure_first
        pl_module.lr_scheduler_step = applied_only
        save = trainer.save_checkpoint

        @functools.wraps(save)
        def paused_save(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            self._saves.append((trainer.global_step, str(filepath)))
            with arc.watchdog_paused():
                return save(filepath, *args, **kwargs)

        trainer.save_checkpoint = paused_save
        if self._capabilities is not None and self._capabilities.has("applied_only"):
            step_metrics = trainer._logger_connector.update_train_step_metrics

            @functools.wraps(step_metrics)
            def applied_rows_only() -> None:
                if arc.last_step_applied:  # a skipped or rolled-back step writes no row
                    step_metrics()

            trainer._logger_connector.update_train_step_metrics = applied_rows_only


__all__ = ["ArcCallback"]
