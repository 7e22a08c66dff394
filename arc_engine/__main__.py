"""``python -m arc_engine ...``: the same command line as ``arc-engine ...``."""

from arc_engine.cli import main

raise SystemExit(main())
