"""The SDC study (docs/sdc.md#detection-against-harm): bit flips by site and bit class on DDP and ZeRO-2, harm,
detection with intervals, false alarms per 1,000 clean steps. See :mod:`arc_engine.campaign.sdc_study`.

    python scripts/sdc_study.py --seeds 8 --out arc_campaign/sdc
"""

import sys

from arc_engine.campaign.sdc_study import main

if __name__ == "__main__":
    sys.exit(main())
