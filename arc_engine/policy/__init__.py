"""Decisions and their escalation (the recovery state machine plugs in here)."""

from arc_engine.policy.decision import (
    EXIT_ABORT,
    EXIT_FAULTY_DEVICE,
    EXIT_RECOVERY_EXHAUSTED,
    ArcAbort,
    Decision,
    DecisionPolicy,
)

__all__ = ["EXIT_ABORT", "EXIT_FAULTY_DEVICE", "EXIT_RECOVERY_EXHAUSTED", "ArcAbort", "Decision", "DecisionPolicy"]
