"""Megatron-LM's GPT pretraining with arc_engine: the same training, plus ``--arc-config`` and ``--arc.*``.

Two ways to get Megatron-LM's training code, with the arguments you pass to ``pretrain_gpt.py``::

    # the megatron.training package megatron-core >= 0.19 ships (pip install megatron-core): no checkout
    torchrun --nproc-per-node 8 launch/megatron/pretrain_gpt_arc.py <pretrain_gpt.py arguments> --arc-config arc.yaml
    # a Megatron-LM checkout (its pretrain_gpt.py and megatron/training; tags core_v0.16.1 .. core_v0.19.x)
    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 launch/megatron/pretrain_gpt_arc.py ...

With ``MEGATRON_LM_PATH`` (or from a working directory holding ``pretrain_gpt.py``) the forward step, loss and
datasets are the checkout's ``pretrain_gpt.py``; without one they are ``gpt_steps.py`` beside this file
(``pretrain_gpt.py``'s, for a plain GPT). ``pretrain()`` changed its API in 0.19: before it took the providers plus
``extra_args_provider`` and parsed the arguments itself; from 0.19 the entry parses them
(``parse_and_validate_args``) and passes a config container. The launcher takes whichever the installed
``pretrain()`` accepts (read from its signature).

What it adds, and nothing else:

* **the flags**, through Megatron-LM's own ``extra_args_provider`` (its parser exits on an unknown flag; this is
  its extension point), chained after ModelOpt's when a checkout's ``pretrain_gpt.py`` passes it (before 0.19);
* **the attachment**, right after ``setup_model_and_optimizer`` built the DDP model chunks, the optimizer and the
  scheduler (:func:`arc_engine.integrations.megatron.attach_megatron`: statistics per bucket and DistOpt shard,
  the job-wide decision, the veto through Megatron's own skip path -- ``optimizer.step()`` returns
  ``update_successful=False`` and Megatron-LM counts a skipped iteration);
* **the loss**: each training micro-batch's per-token loss from the loss function, recorded on the last pipeline
  stage, after arc_engine's loss faults (``faults.injections`` of kind ``nan_loss`` / ``loss_scale``) are applied to
  the loss Megatron-LM back-propagates (Megatron-LM's own ``lm loss`` report stays the unfaulted one);
* **evaluation** runs with the hang watchdog paused (:meth:`arc_engine.Arc.watchdog_paused`), and its losses are
  not recorded as training losses; so do checkpoint saves;
* **Megatron-LM's NaN check** (``--check-for-nan-in-loss-and-grad``, fatal on a NaN) defaults to off: arc_engine
  skips such a step on every rank;
* **rollback by relaunch**: ``pretrain()`` owns the iteration counter and the data, so with ``recovery.enabled`` a
  rollback stops every rank with exit code 7 once the newest disk checkpoint (Megatron-LM's format) is committed,
  and prints the flags of the relaunch (also in ``relaunch.json``: ``megatron_lm_args``): ``--load``,
  ``--iterations-to-skip`` and :data:`RELAUNCH_LOAD_FLAGS` (the optimizer and the RNG come from arc_engine's own
  resume of the same checkpoint, whose RNG the launcher puts back when the loop starts: :meth:`ArcHooks.loop_starts`).

Four functions of Megatron-LM's ``megatron.training.training`` module are replaced for this process, because no
public hook hands over the optimizer or marks evaluation: ``setup_model_and_optimizer`` (wrapped: it attaches
arc_engine to what it returns), ``evaluate`` (wrapped: the watchdog pause and the evaluation flag),
``save_checkpoint`` (the watchdog pause) and ``dummy_train_step`` (an ``--iterations-to-skip`` iteration moves
arc_engine's step with Megatron-LM's iteration). ``pretrain()`` looks them up in that module at call time. Nothing
else of Megatron-LM is changed.

Megatron-LM's in-process restart is refused (``--inprocess-restart``: a restarted ``pretrain()`` would attach
arc_engine a second time). ``--help`` is Megatron-LM's: 0.16's ``ft_integration.setup()`` answers it before the
extra provider runs (Megatron-LM's flags only), and 0.19.2's parser fails on it (a ``%`` in one of its help
strings); arc_engine's flags are documented with its configuration (``arc-engine show-config``).

"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import shlex
import sys
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import arc_engine
from arc_engine.integrations.pytorch.loops import one_resume, resume_at
from arc_engine.policy.decision import EXIT_RELAUNCH
from arc_engine.recovery.rollback import RELAUNCH_FILE
from arc_engine.recovery.snapshot import rng_state, set_rng_state

HERE = Path(__file__).resolve().parent


class GPTSteps(NamedTuple):
    """What ``pretrain()`` calls back, from a checkout's ``pretrain_gpt.py`` or from ``gpt_steps.py``."""

    forward_step: Any
    datasets_provider: Any
    model_provider: Any = None  # the pre-0.19 API builds the model through it
    get_embedding_ranks: Any = None
    extra_args_provider: Any = None  # ModelOpt's, when a checkout's pretrain_gpt.py passes it (pre-0.19 API)
    source: str = ""


def checkout_path() -> str | None:
    """The Megatron-LM checkout to train from: ``MEGATRON_LM_PATH``, else the working directory when it holds
    ``pretrain_gpt.py``; None: the installed ``megatron.training`` package. Exits when ``MEGATRON_LM_PATH`` names
    no checkout."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if path:
        if not os.path.exists(os.path.join(path, "pretrain_gpt.py")):
            sys.exit(f"pretrain_gpt_arc: no pretrain_gpt.py in MEGATRON_LM_PATH={path}")
        return path
    return os.getcwd() if os.path.exists(os.path.join(os.getcwd(), "pretrain_gpt.py")) else None


def load_gpt_steps() -> GPTSteps:
    """The checkout's ``pretrain_gpt.py`` providers (the checkout goes first on ``sys.path`` unless it is there
    already), or this directory's ``gpt_steps.py`` for the installed package."""
    path = checkout_path()
    if path is not None:
        if path not in sys.path:
            sys.path.insert(0, path)
        import pretrain_gpt  # Megatron-LM's, from the checkout

        model_provider = getattr(pretrain_gpt, "model_provider", None)
        if model_provider is not None and hasattr(pretrain_gpt, "gpt_builder"):  # 0.16: the builder is passed in
            model_provider = partial(model_provider, pretrain_gpt.gpt_builder)
        modelopt = getattr(pretrain_gpt, "add_modelopt_args", None) \
            if getattr(pretrain_gpt, "has_nvidia_modelopt", False) else None
        return GPTSteps(pretrain_gpt.forward_step, pretrain_gpt.train_valid_test_datasets_provider, model_provider,
                        getattr(pretrain_gpt, "get_embedding_ranks", None), modelopt, f"checkout {path}")
    if importlib.util.find_spec("megatron.training") is None:
        sys.exit("pretrain_gpt_arc: no megatron.training package (megatron-core >= 0.19 ships it) and no "
                 "Megatron-LM checkout (set MEGATRON_LM_PATH)")
    spec = importlib.util.spec_from_file_location("arc_gpt_steps", HERE / "gpt_steps.py")
    assert spec is not None and spec.loader is not None
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    return GPTSteps(steps.forward_step, steps.train_valid_test_datasets_provider, source="installed megatron.training")


def arc_args_provider(inner: Any | None = None) -> Any:
    """An ``extra_args_provider`` adding arc_engine's flags after ``inner``'s (if any)."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if inner is not None:
            parser = inner(parser)
        # arc_engine judges NaN/Inf losses and gradients job-wide and skips the step; Megatron-LM's own check is
        # fatal on a NaN, so it is off by default here (its parser has no flag to turn it back on)
        parser.set_defaults(check_for_nan_in_loss_and_grad=False)
        return arc_engine.add_arc_args(parser)

    return provider


class ArcHooks:
    """Holds the attached engine between Megatron-LM's setup and its loop, and whether it is evaluating."""

    def __init__(self) -> None:
        self.arc: arc_engine.Arc | None = None
        self.evaluating = False
        self.resumed_rng: dict[str, Any] | None = None  # arc_engine's resumed RNG, until pretrain()'s loop starts

    def wrap_setup(self, setup: Any) -> Any:
        """``setup_model_and_optimizer`` that attaches arc_engine to what it returns."""

        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            from megatron.training import get_args

            from arc_engine.integrations.megatron import attach_megatron

            if getattr(get_args(), "inprocess_restart", False):
                raise SystemExit("pretrain_gpt_arc: --inprocess-restart is not supported with arc_engine")
            model, optimizer, scheduler = setup(*args, **kwargs)
            start = int(getattr(get_args(), "iteration", 0) or 0)  # the iteration --load resumed (0: none)
            # one resume: arc_engine takes its checkpoint of that iteration (a relaunch: the same checkpoint), none
            # when Megatron-LM's is the newer, or both stop with exit code 2 naming the two steps
            config = resume_at(relaunch_config(arc_engine.config_from_args(get_args())), start, counter="step")
            self.arc = attach_megatron(model, optimizer, config, lr_scheduler=scheduler, checkpoint_args=get_args)
            # (every batch of an iteration, trained or skipped, is consumed: the data position is the iteration)
            one_resume(self.arc, start, "Megatron-LM (--load)", start, counter="step")
            # arc_engine's step s is Megatron-LM's iteration s + 1, also after a --load (whatever arc_engine resumed)
            engine = self.arc.engine
            if engine.progress.step != start:
                engine.rewind(start, start)
            elif start > 0:  # arc_engine resumed the checkpoint Megatron-LM loaded (a relaunch)
                self.resumed_rng = rng_state()
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def wrap_evaluate(self, evaluate: Any) -> Any:
        """``evaluate`` under the watchdog's pause, its losses kept out of arc_engine's."""

        def evaluate_paused(*args: Any, **kwargs: Any) -> Any:
            self.evaluating = True
            try:
                if self.arc is None:
                    return evaluate(*args, **kwargs)
                with self.arc.watchdog_paused():
                    return evaluate(*args, **kwargs)
            finally:
                self.evaluating = False

        return evaluate_paused

    def wrap_save(self, save: Any) -> Any:
        """``save_checkpoint`` under the watchdog's pause (a save can outlast the hang timeout)."""

        def save_paused(*args: Any, **kwargs: Any) -> Any:
            if self.arc is None:
                return save(*args, **kwargs)
            with self.arc.watchdog_paused():
                return save(*args, **kwargs)

        return save_paused

    def loop_starts(self) -> None:
        """At the first iteration of ``pretrain()``'s loop (trained or skipped), the RNG arc_engine resumed is put
        back: between ``setup_model_and_optimizer`` (where it resumed) and the loop ``pretrain()`` builds its data
        iterators, and each ``iter(DataLoader)`` draws a seed from torch's default generator. An uninterrupted
        run makes those draws before its first iteration, so without this a resumed run's dropout would run that
        many draws ahead of it."""
        if self.resumed_rng is not None:
            set_rng_state(self.resumed_rng)
            self.resumed_rng = None

    def wrap_skip(self, dummy_step: Any) -> Any:
        """``dummy_train_step``, Megatron-LM's pass over an iteration of ``--iterations-to-skip``: arc_engine's step
        counter moves with the iteration (no decision: nothing trains)."""

        def skipped(*args: Any, **kwargs: Any) -> Any:
            self.loop_starts()
            result = dummy_step(*args, **kwargs)
            if self.arc is not None:
                engine = self.arc.engine
                engine.rewind(engine.progress.step + 1, engine.progress.data_position + 1)
            return result

        return skipped

    def wrap_forward_step(self, forward_step: Any) -> Any:
        """``forward_step`` whose loss function also records a training micro-batch's per-token loss."""

        def step(*args: Any, **kwargs: Any) -> Any:
            if not self.evaluating:
                self.loop_starts()
            output, loss_func = forward_step(*args, **kwargs)
            if self.arc is None or self.evaluating:
                return output, loss_func

            def loss_with_arc(*loss_args: Any, **loss_kwargs: Any) -> Any:
                result = loss_func(*loss_args, **loss_kwargs)
                if self.arc is not None and isinstance(result, tuple) and len(result) >= 2:
                    loss, num_tokens = self.arc.faults.on_loss(result[0]), result[1]
                    self.arc.record_loss(loss.detach().float() / num_tokens.clamp(min=1).float())
                    result = (loss, *result[1:])
                return result

            return output, loss_with_arc

        return step


def relaunch_config(config: arc_engine.ArcConfig) -> arc_engine.ArcConfig:
    """``pretrain()`` owns the iteration counter, the consumed samples and the data iterator, so a rollback here is
    the Megatron way: ``recovery.rollback: relaunch`` (every rank stops with exit code 7 once the newest disk
    checkpoint is committed; relaunch with ``--load`` and ``--iterations-to-skip``). Refused without the disk tier."""
    recovery = config.recovery
    if not recovery.enabled:
        return config
    if recovery.checkpoint.every_steps <= 0:
        raise SystemExit("pretrain_gpt_arc: recovery.enabled rolls back by relaunching from a disk checkpoint under "
                         "Megatron-LM's pretrain(); set recovery.checkpoint.every_steps (and recovery.checkpoint.dir)")
    return dataclasses.replace(config, recovery=dataclasses.replace(recovery, rollback="relaunch"))


#: What Megatron-LM's ``--load`` leaves to arc_engine in a relaunch. Its load of the optimizer cannot run in a fresh
#: job with torch's Adam (no Transformer Engine or apex: ``DistributedOptimizer.state_dict()`` asserts one Adam
#: ``step`` among parameters that have no state yet, before it reads anything), and the checkpoint keeps each
#: rank's RNG under arc_engine's key, not Megatron-LM's ``rng_state`` (a missing key). arc_engine's own resume
#: (``recovery.enabled``, right after ``setup_model_and_optimizer``) restores the optimizer, the LR scheduler (which
#: ``--no-load-optim`` also leaves out) and the Python / NumPy / torch RNG from the same checkpoint.
RELAUNCH_LOAD_FLAGS = ("--no-load-optim", "--no-load-rng")


def relaunch_flags(plan: dict[str, Any]) -> list[str]:
    """The Megatron-LM flags that carry out a ``relaunch.json`` plan: ``--load`` its checkpoint directory,
    ``--iterations-to-skip`` the iterations of the steps it skips (arc_engine's step s is iteration s + 1), and
    :data:`RELAUNCH_LOAD_FLAGS`."""
    flags = ["--load", plan["checkpoint_dir"]]
    if plan["skip_steps"]:
        flags += ["--iterations-to-skip", *(str(step + 1) for step in plan["skip_steps"])]
    return [*flags, *RELAUNCH_LOAD_FLAGS]


def publish_relaunch_flags(run_dir: Path) -> str:
    """Add the relaunch's Megatron-LM flags to ``relaunch.json`` (``megatron_lm_args``, replaced whole: a reader
    never sees half of it) and return them as one shell-quoted line. First rank only, after it wrote the plan."""
    path = run_dir / RELAUNCH_FILE
    plan = json.loads(path.read_text())
    plan["megatron_lm_args"] = relaunch_flags(plan)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    os.replace(tmp, path)
    return shlex.join(plan["megatron_lm_args"])


def run_pretrain(steps: GPTSteps, forward_step: Any) -> None:
    """Megatron-LM's ``pretrain()`` with arc_engine's flags, in the API the installed release has."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    steps.datasets_provider.is_distributed = True
    if "cfg_container" not in inspect.signature(pretrain).parameters:  # before 0.19: pretrain() parses
        pretrain(steps.datasets_provider, steps.model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=defaults, extra_args_provider=arc_args_provider(steps.extra_args_provider),
                 get_embedding_ranks=steps.get_embedding_ranks)
        return
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=arc_args_provider(), args_defaults=defaults)
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, steps.datasets_provider, ModelType.encoder_or_decoder, forward_step,
             get_embedding_ranks=steps.get_embedding_ranks)


def main() -> None:
    steps = load_gpt_steps()
    if os.environ.get("RANK", "0") == "0":
        print(f"[arc_engine] pretrain_gpt_arc: Megatron-LM's pretrain() with the GPT steps of {steps.source}",
              flush=True)
    from megatron.training import training

    hooks = ArcHooks()
    training.setup_model_and_optimizer = hooks.wrap_setup(training.setup_model_and_optimizer)
    training.evaluate = hooks.wrap_evaluate(training.evaluate)
    training.save_checkpoint = hooks.wrap_save(training.save_checkpoint)
    if hasattr(training, "dummy_train_step"):
        training.dummy_train_step = hooks.wrap_skip(training.dummy_train_step)
    try:
        run_pretrain(steps, hooks.wrap_forward_step(steps.forward_step))
    except arc_engine.ArcAbort as abort:
        print(f"[arc_engine] {abort}", file=sys.stderr, flush=True)
        if abort.exit_code == EXIT_RELAUNCH and hooks.arc is not None and os.environ.get("RANK", "0") == "0":
            # the first rank wrote relaunch.json before it stopped
            print(f"[arc_engine] relaunch with: {publish_relaunch_flags(hooks.arc.engine.run_dir)}\n"
                  "[arc_engine] (--load: the model, the iteration and the data position; arc_engine's resume, with "
                  "the same --arc-config: the optimizer, the LR scheduler and the RNG of the same checkpoint)",
                  file=sys.stderr, flush=True)
        sys.exit(abort.exit_code)
    finally:
        if hooks.arc is not None:
            hooks.arc.close()


if __name__ == "__main__":
    main()
