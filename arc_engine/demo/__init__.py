"""The demo job: a small GPT trained on a generated corpus with 2 ranks over gloo, faults injected."""
