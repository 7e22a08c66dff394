"""Diagnostics that are too expensive for every step: run on demand or every N steps (``diagnostics.*``)."""
