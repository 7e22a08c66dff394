"""A generated English-like corpus and a deterministic, rank-sharded batch sampler.

Nothing is downloaded: the text comes from a seeded grammar, so every machine builds the same corpus.
"""

from __future__ import annotations

import random

import torch

_SUBJECTS = ["the model", "a worker", "the optimizer", "each rank", "the engineer", "a gradient", "the cluster",
             "the checkpoint", "a node", "the scheduler", "every layer", "the loss"]
_VERBS = ["reduces", "gathers", "checks", "restores", "skips", "records", "sends", "computes", "watches",
          "repairs", "saves", "measures"]
_OBJECTS = ["the update", "its shard", "a spike", "the norm", "the batch", "every step", "the moments",
            "a bit flip", "the learning rate", "the weights", "its buffer", "the event log"]
_TAILS = ["before the step", "after the reduction", "on every rank", "without a sync", "at step zero",
          "in one collective", "when it drifts", "and moves on"]


def generate_corpus(num_sentences: int = 4000, seed: int = 1234) -> str:
    """Deterministic text of ``num_sentences`` short sentences (about 45 characters each)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.5:
            words.append(rng.choice(_TAILS))
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences) + "\n"


class CharDataset:
    """Character-level tokens of a text and a sampler where the batch of (step, rank) is a pure function of
    both, so a run can skip or replay any step's data exactly (the data position is the step)."""

    def __init__(self, text: str, seq_len: int, seed: int = 0, vocabulary: CharDataset | None = None) -> None:
        """``vocabulary``: tokenize with that dataset's characters (held-out text for a model trained on it; a
        character it lacks is dropped)."""
        if vocabulary is not None:
            text = "".join(c for c in text if c in vocabulary.stoi)
        self.chars = vocabulary.chars if vocabulary is not None else sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``[batch_size, seq_len]`` for this step and rank."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 4099 + rank)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (batch_size,), generator=gen)
        offsets = torch.arange(self.seq_len + 1)
        window = self.tokens[starts[:, None] + offsets]
        return window[:, :-1], window[:, 1:]
