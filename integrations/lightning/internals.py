"""What the Lightning callback reads of Lightning's loop internals: the tested range, what each feature needs
(:func:`check_trainer`), the loop's counters and every read of a member that a release may lack. Local."""

from __future__ import annotations

import math
from typing import Any

from arc_engine.compat import Capabilities, TestedRange

#: The lightning releases the tests run (docs/compatibility.md): others get a warning.
TESTED_LIGHTNING_RANGE = TestedRange("lightning", "2.5.0", "2.7.0", "integrations/lightning/internals.py")

#: What each feature reads of Lightning's loop internals: (what it does, what being off means).
FEATURES = {"step_counter": ("trainer.global_step counts applied steps",
                             "global_step and max_steps count every step, skipped or rolled back"),
            "logging_step": ("the loggers' step counts applied steps",
                             "after a skip or rollback the loggers' rows are numbered by batches"),
            "applied_only": ("a step not applied writes no logger row and runs no validation",
                             "a skipped or rolled-back step is logged and validated like an applied one"),
            "checkpoint_rewind": ("a rollback removes the checkpoints saved after its target and re-arms their saves",
                                  "a checkpoint saved after a rollback's target keeps the state the rollback undid")}


def step_progress(trainer: Any) -> Any:
    """Lightning's count of optimizer steps, the one ``trainer.global_step`` reads (automatic optimization)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total


def resumed_data_position(trainer: Any) -> int:
    """Where Lightning's loader reads next at the start of ``fit``, in data positions (one per optimizer step over
    the epochs): the start of the current epoch, past the batches a resumed checkpoint trained of it only where the
    loader restores its own position (a stateful loader: Lightning restarts any other one at its first batch)."""
    loop = trainer.fit_loop.epoch_loop
    batches = trainer.num_training_batches
    if not isinstance(batches, int):  # an unsized loader: one position per step, epochs not counted
        return trainer.global_step
    per_epoch = max(math.ceil(batches / trainer.accumulate_grad_batches), 1)
    done = loop.batch_progress.current.ready  # the current epoch's batches the checkpoint had trained
    if done >= batches:
        return (trainer.current_epoch + 1) * per_epoch
    loader = trainer.train_dataloader
    stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    return trainer.current_epoch * per_epoch + (math.ceil(done / trainer.accumulate_grad_batches) if stateful else 0)


def check_trainer(trainer: Any) -> Capabilities:
    """What this Lightning trainer holds of what the callback reads. Warns outside the tested range; never raises."""
    import lightning

    version = lightning.__version__
    TESTED_LIGHTNING_RANGE.check(version, UserWarning)
    found = Capabilities(TESTED_LIGHTNING_RANGE, version, dict(FEATURES))
    try:
        step_progress(trainer).completed  # noqa: B018 - read to check it is there
    except AttributeError:
        found.off["step_counter"] = ["fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step"]
    checks = (("fit_loop.epoch_loop._batches_that_stepped",
               isinstance(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None), int)),
              ("fit_loop._should_accumulate", callable(getattr(trainer.fit_loop, "_should_accumulate", None))))
    missing = [name for name, present in checks if not present]
    if missing:
        found.off["logging_step"] = missing
    applied_only = (("_logger_connector.update_train_step_metrics",
                     callable(getattr(trainer._logger_connector, "update_train_step_metrics", None))),
                    ("fit_loop.epoch_loop._skip_next_val",
                     isinstance(getattr(trainer.fit_loop.epoch_loop, "_skip_next_val", None), bool)))
    missing = [name for name, present in applied_only if not present]
    if missing:
        found.off["applied_only"] = missing
    missing = [f"{type(callback).__name__}.{member}" for callback in trainer.checkpoint_callbacks
               for member in ("_last_global_step_saved", "best_k_models", "best_model_path", "last_model_path")
               if not hasattr(callback, member)]
    if missing:
        found.off["checkpoint_rewind"] = missing
    return found


def precision_scaler(trainer: Any) -> Any:
    """The ``GradScaler`` of Lightning's mixed-precision plugin (None without one)."""
    return getattr(trainer.precision_plugin, "scaler", None)
