"""The fault-injection campaign (same as ``arc-engine campaign``; see :mod:`arc_engine.campaign.runner`).

    python scripts/campaign.py --profile quick
    python scripts/campaign.py --profile full --out arc_campaign/full
"""

from __future__ import annotations

import sys

from arc_engine.campaign.runner import main

if __name__ == "__main__":
    sys.exit(main())
