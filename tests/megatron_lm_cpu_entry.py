"""Run ``launch/megatron/pretrain_gpt_arc.py`` on CPU ranks over gloo, for the tests of Megatron-LM's ``pretrain()``.

``torchrun --nproc-per-node 2 tests/megatron_lm_cpu_entry.py <pretrain_gpt.py arguments> --arc-config arc.yaml``.
Each rank installs the CPU shims of :mod:`arc_engine.testing.megatron_cpu` (megatron-core and Megatron-LM's
``megatron/training``), then runs the launcher's ``main()`` unchanged. The launcher itself holds no CPU code.

Megatron-LM's training code comes from the installed ``megatron.training`` package (megatron-core 0.19 ships it) or,
with ``MEGATRON_LM_PATH`` set, from that checkout. The checkout goes on ``sys.path`` after site-packages, so
``megatron.training``, ``pretrain_gpt`` and ``gpt_builders`` come from the checkout and ``megatron.core`` from the
installed megatron-core wheel (the same version: its Python sources match the checkout's tag, and it ships the
compiled dataset helpers the checkout would build with ``make``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "launch" / "megatron" / "pretrain_gpt_arc.py"


def main() -> None:
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if checkout and checkout not in sys.path:
        sys.path.append(checkout)  # after site-packages: the launcher keeps it where it is
    if str(ROOT) not in sys.path:
        sys.path.insert(1, str(ROOT))
    try:
        import regex  # noqa: F401
    except ImportError:  # only the GPT-2 BPE tokenizer uses it (at construction); these runs use NullTokenizer
        sys.modules["regex"] = re

    from arc_engine.testing import megatron_cpu

    megatron_cpu.install_megatron_lm()
    spec = importlib.util.spec_from_file_location("pretrain_gpt_arc", LAUNCHER)
    assert spec is not None and spec.loader is not None
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    launcher.main()


if __name__ == "__main__":
    main()
