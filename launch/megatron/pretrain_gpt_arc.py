"""Megatron-LM's ``pretrain_gpt.py`` with arc_engine: the same training, plus ``--arc-config`` and ``--arc.*``.

Run it from (or point ``MEGATRON_LM_PATH`` at) a Megatron-LM checkout, with the arguments you pass to
``pretrain_gpt.py``::

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 launch/megatron/pretrain_gpt_arc.py \\
        <your pretrain_gpt.py arguments> --arc-config arc.yaml

What it adds, and nothing else:

* **the flags**, through ``pretrain()``'s own ``extra_args_provider`` (Megatron-LM's parser exits on an unknown
  flag; this is its extension point), chained after the provider ``pretrain_gpt.py`` passes (ModelOpt's, when
  installed);
* **the attachment**, right after ``setup_model_and_optimizer`` built the DDP model chunks, the optimizer and the
  scheduler (:func:`arc_engine.integrations.megatron.attach_megatron`: statistics per bucket and DistOpt shard,
  the job-wide decision, the veto through Megatron's own skip path -- ``optimizer.step()`` returns
  ``update_successful=False`` and Megatron-LM counts a skipped iteration);
* **the loss**: each micro-batch's per-token loss from ``pretrain_gpt.loss_func``, recorded on the last pipeline
  stage, after arc_engine's loss faults (``faults.injections`` of kind ``nan_loss`` / ``loss_scale``) are applied to
  the loss Megatron-LM back-propagates (Megatron-LM's own ``lm loss`` report stays the unfaulted one).

It calls ``pretrain()`` as ``pretrain_gpt.py`` does (same providers, ``args_defaults`` and
``get_embedding_ranks``), except for Megatron-LM's in-process restart: ``--inprocess-restart`` is refused (a
restarted ``pretrain()`` would attach arc_engine a second time).

``--help`` lists Megatron-LM's flags only: its ``ft_integration.setup()`` parses (and answers ``--help``) before
``pretrain()`` adds the extra providers. arc_engine's flags are documented with arc_engine's configuration.

Leave Megatron-LM's own ``--check-for-nan-in-loss-and-grad`` as you like: it is fatal on a NaN where arc_engine
skips the step, so with arc_engine you may turn it off (``--no-check-for-nan-in-loss-and-grad``).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Any

import arc_engine


def add_megatron_lm_path() -> None:
    """Make ``pretrain_gpt`` and ``megatron.training`` importable from ``MEGATRON_LM_PATH`` (or the working
    directory when it is a checkout)."""
    path = os.environ.get("MEGATRON_LM_PATH") or os.getcwd()
    if not os.path.exists(os.path.join(path, "pretrain_gpt.py")):
        sys.exit(f"pretrain_gpt_arc: no pretrain_gpt.py in {path}; set MEGATRON_LM_PATH to a Megatron-LM checkout")
    if path not in sys.path:
        sys.path.insert(0, path)


def arc_args_provider(inner: Any | None = None) -> Any:
    """An ``extra_args_provider`` adding arc_engine's flags after ``inner``'s (if any)."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if inner is not None:
            parser = inner(parser)
        return arc_engine.add_arc_args(parser)

    return provider


class ArcHooks:
    """Holds the attached engine between Megatron-LM's setup and its loop."""

    def __init__(self) -> None:
        self.arc: arc_engine.Arc | None = None

    def wrap_setup(self, setup: Any) -> Any:
        """``setup_model_and_optimizer`` that attaches arc_engine to what it returns."""

        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            from megatron.training import get_args

            from arc_engine.integrations.megatron import attach_megatron

            if getattr(get_args(), "inprocess_restart", False):
                raise SystemExit("pretrain_gpt_arc: --inprocess-restart is not supported with arc_engine")
            model, optimizer, scheduler = setup(*args, **kwargs)
            self.arc = attach_megatron(model, optimizer, arc_engine.config_from_args(get_args()),
                                       lr_scheduler=scheduler, checkpoint_args=get_args)
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def wrap_forward_step(self, forward_step: Any) -> Any:
        """``forward_step`` whose loss function also records the micro-batch's per-token loss."""

        def step(*args: Any, **kwargs: Any) -> Any:
            output, loss_func = forward_step(*args, **kwargs)

            def loss_with_arc(*loss_args: Any, **loss_kwargs: Any) -> Any:
                result = loss_func(*loss_args, **loss_kwargs)
                if self.arc is not None and isinstance(result, tuple) and len(result) >= 2:
                    loss, num_tokens = self.arc.faults.on_loss(result[0]), result[1]
                    self.arc.record_loss(loss.detach().float() / num_tokens.clamp(min=1).float())
                    result = (loss, *result[1:])
                return result

            return output, loss_with_arc

        return step


def main() -> None:
    add_megatron_lm_path()
    import pretrain_gpt  # Megatron-LM's, from the checkout
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, training

    hooks = ArcHooks()
    training.setup_model_and_optimizer = hooks.wrap_setup(training.setup_model_and_optimizer)
    model_provider = pretrain_gpt.model_provider
    if hasattr(pretrain_gpt, "gpt_builder"):  # newer Megatron-LM: the builder is passed to the provider
        model_provider = partial(model_provider, pretrain_gpt.gpt_builder)
    inner = pretrain_gpt.add_modelopt_args if getattr(pretrain_gpt, "has_nvidia_modelopt", False) else None
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    try:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                 hooks.wrap_forward_step(pretrain_gpt.forward_step),
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=arc_args_provider(inner),
                 get_embedding_ranks=getattr(pretrain_gpt, "get_embedding_ranks", None))
    except arc_engine.ArcAbort as abort:
        print(f"[arc_engine] {abort}", file=sys.stderr, flush=True)
        sys.exit(abort.exit_code)
    finally:
        if hooks.arc is not None:
            hooks.arc.close()


if __name__ == "__main__":
    main()
