"""What the Hugging Face Trainer callback reads of transformers' and Accelerate's internals: the tested range, what
each feature needs of the Trainer's private surface (:func:`check_trainer`), and every read of a member that a
release may lack. Local, no communication."""

from __future__ import annotations

from typing import Any

import torch

from arc_engine.compat import Capabilities, TestedRange

#: The transformers releases the tests run (docs/compatibility.md): others get a warning.
TESTED_TRANSFORMERS_RANGE = TestedRange("transformers", "5.0.0", "5.25.0", "integrations/hf/internals.py")

#: The Trainer's long phases between optimizer steps, whoever calls them: the hang watchdog does not count them.
WATCHDOG_PAUSED_METHODS = ("evaluate", "_evaluate", "predict", "_save_checkpoint", "save_model", "_load_best_model",
                           "_load_from_checkpoint")

#: What each feature reads of the Trainer's private surface: (what it does, what being off means), then the members.
FEATURES: dict[str, tuple[tuple[str, str], tuple[str, ...]]] = {
    "logged_loss": (("the logged loss leaves out the steps arc_engine did not apply",
                     "the logged loss and train_loss include undone steps"), ("_tr_loss",)),
    "log_counter": (("a rollback takes the Trainer's logging counter back with global_step",
                     "the first log after a rollback averages over a wrong number of steps"),
                    ("_globalstep_last_logged",)),
    "watchdog_pauses": (("the hang watchdog does not count evaluation, prediction, checkpoint saves and the best "
                         "model's load, from the Trainer or from any caller (a callback's own evaluate())",
                         "a slow evaluation, save or load counts toward a hang"),
                        WATCHDOG_PAUSED_METHODS),
    "per_token_loss": (("the recorded loss is each rank's per-token loss under num_items_in_batch",
                        "with variable-length batches a rank's recorded loss follows its share of the tokens"),
                       ("compute_loss", "model_accepts_loss_kwargs", "compute_loss_func", "_loss_shifts_labels",
                        "get_tp_size")),
}


def per_token_factor(trainer: Any, inputs: Any, num_items_in_batch: Any) -> torch.Tensor | None:
    """What turns the loss the Trainer hands to ``backward`` for this micro-batch into the micro-batch's own
    per-token loss, when the Trainer normalised it by ``num_items_in_batch`` (the tokens of every micro-batch of the
    step, on every rank): ``num_items_in_batch / (scale x local tokens)``, the local tokens counted as the Trainer
    counts them (shifted labels other than -100) and ``scale`` its multiplier for averaging tokens across devices.
    None where the Trainer did not normalise so (the loss is then the micro-batch's mean, divided by the
    accumulation steps). A device-side scalar: no host read."""
    if num_items_in_batch is None or not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func):
        return None
    if not isinstance(inputs, dict) or ("labels" not in inputs and "shift_labels" not in inputs):
        return None
    labels = inputs["shift_labels"] if "shift_labels" in inputs else \
        inputs["labels"][..., 1:] if trainer._loss_shifts_labels else inputs["labels"]
    scale = trainer.accelerator.num_processes // trainer.get_tp_size() \
        if trainer.args.average_tokens_across_devices else 1
    local = labels.ne(-100).sum().clamp(min=1)
    return torch.as_tensor(num_items_in_batch, device=local.device).double() / (scale * local).double()


def check_trainer(trainer: Any) -> Capabilities:
    """What this Trainer (its installed transformers) holds of what the callback reads. Warns outside the tested
    range; never raises. Local."""
    import transformers

    version = transformers.__version__
    TESTED_TRANSFORMERS_RANGE.check(version, UserWarning)
    found = Capabilities(TESTED_TRANSFORMERS_RANGE, version, {name: info for name, (info, _) in FEATURES.items()})
    for name, (_, members) in FEATURES.items():
        absent = [member for member in members if not hasattr(trainer, member)]
        if absent:
            found.off[name] = [f"Trainer.{member}" for member in absent]
    return found




def accelerator_scaler(trainer: Any) -> Any:
    """The ``GradScaler`` Accelerate keeps for fp16 (None without one)."""
    return getattr(trainer.accelerator, "scaler", None)


def inner_scheduler(scheduler: Any) -> Any:
    """The scheduler inside Accelerate's ``AcceleratedScheduler`` (None for another scheduler)."""
    return getattr(scheduler, "scheduler", None)


def accumulation_steps(trainer: Any) -> int:
    """The gradient accumulation steps of the current step (the last step of an epoch may have fewer)."""
    return getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps
