"""The fault-injection campaign: the rules arc_engine is measured against (:mod:`.baselines`)."""
