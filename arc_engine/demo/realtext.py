"""Real text of mixed kinds from this machine's own files (nothing is downloaded): the corpus of the long clean runs
and of the campaign's ``realtext`` profile (docs/results.md#real-text).

Two kinds, each a list of documents:

* ``code``: the Python standard library's source (every ``*.py`` under ``sysconfig``'s ``stdlib`` path: code,
  docstrings, comments, doctest output);
* ``prose``: Debian's license texts (``/usr/share/common-licenses``), the packages' copyright files
  (``/usr/share/doc/*/copyright``: prose, file lists, license stanzas), the section-1 manual pages with their roff
  markup taken out, and the system's tables (``/etc/services``, ``/etc/protocols``, ``/usr/share/zoneinfo/*.tab``,
  ``/usr/share/i18n/SUPPORTED``).

A kind's byte budget is shared by its sources (the small ones, tables, take all they have; the others an equal part
of the rest), and each source's documents are taken in a fixed pseudo-random order of their paths (a hash: every
module and package is sampled, not the alphabet's first) until its share is spent; every tenth document of a kind
is held out for evaluation. Tokens are bytes (vocabulary 256), so any text is valid and nothing is normalized. The
per-batch loss of such a corpus is heavy-tailed: a window of license boilerplate is predictable, one of a table of
port numbers or of base64 test data is not. :attr:`Corpus.digest` names what was read: two machines with the same
digest trained on the same text.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

KINDS = ("code", "prose")
SOURCES: dict[str, tuple[tuple[str, str], ...]] = {
    "code": ((sysconfig.get_paths()["stdlib"], "**/*.py"),),
    "prose": (("/usr/share/common-licenses", "*"), ("/usr/share/doc", "*/copyright"),
              ("/usr/share/man/man1", "*.1.gz"), ("/etc", "services"), ("/etc", "protocols"),
              ("/usr/share/zoneinfo", "*.tab"), ("/usr/share/i18n", "SUPPORTED")),
}
"""Kind -> (root, glob) pairs. A root that does not exist contributes nothing."""
BUDGET_BYTES = 4 * 2**20
"""Bytes of each kind (both halves, training and held out) by default."""
HELD_OUT_EVERY = 10

_ROFF_REQUEST = re.compile(r"^[.'][^\n]*\n?", re.MULTILINE)
_ROFF_FONT = re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)")
_ROFF_ESCAPE = re.compile(r"\\(?:\(..|\[[^\]]*\]|[-e&|^%])")


def strip_roff(text: str) -> str:
    """A manual page's words and tables without its markup: requests (lines starting with ``.`` or ``'``) dropped,
    font changes removed, ``\\-`` as ``-``, other escapes removed."""
    text = _ROFF_REQUEST.sub("", text.replace("\\-", "-"))
    return _ROFF_ESCAPE.sub("", _ROFF_FONT.sub("", text))


def read_document(path: Path) -> bytes:
    """A file's text as bytes: gzip-compressed files decompressed, manual pages without roff markup."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    if re.fullmatch(r"man\d\w*", path.parent.name):  # a manual page (man1, man3p...): roff
        data = strip_roff(data.decode("utf-8", errors="replace")).encode("utf-8")
    return data


def _ordered(root: str, pattern: str) -> list[Path]:
    base = Path(root)
    paths = [p for p in base.glob(pattern) if p.is_file()] if base.is_dir() else []
    return sorted(paths, key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())


def _shares(found: list[list[Path]], budget: int) -> list[int]:
    """Each source's byte budget: the smallest sources take what they have (by file size), the others share the
    rest equally, so that no one source (a thousand manual pages) crowds out the others (a few tables)."""
    sizes = [sum(p.stat().st_size for p in paths) for paths in found]
    shares, left = [0] * len(found), budget
    order = sorted(range(len(found)), key=lambda i: sizes[i])
    for position, index in enumerate(order):
        shares[index] = min(sizes[index], left // (len(order) - position))
        left -= shares[index]
    return shares


@dataclass
class Corpus:
    """Each kind's token stream (bytes as int64), training and held-out, and where they came from."""

    train: dict[str, torch.Tensor]
    held_out: dict[str, torch.Tensor]
    documents: dict[str, int]
    digest: str
    sources: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        sizes = ", ".join(f"{kind} {self.train[kind].numel() / 2**20:.2f} MB in {self.documents[kind]} documents"
                          for kind in self.train)
        return f"real-text corpus {self.digest[:12]}: {sizes} (+ held out)"


def build_corpus(sources: Mapping[str, tuple[tuple[str, str], ...]] = SOURCES,
                 budget_bytes: int = BUDGET_BYTES) -> Corpus:
    """Read each kind's documents (see the module docstring) up to ``budget_bytes``. Raises ValueError when a kind
    finds no text at all (its roots are missing on this machine)."""
    train, held_out, counts, used = {}, {}, {}, {}
    digest = hashlib.sha256()
    for kind, kind_sources in sources.items():
        parts: tuple[list[bytes], list[bytes]] = ([], [])
        names: list[str] = []
        found = [_ordered(root, pattern) for root, pattern in kind_sources]
        for paths, share in zip(found, _shares(found, budget_bytes), strict=True):
            taken = 0
            for path in paths:
                if taken >= share:
                    break
                try:
                    text = read_document(path)[: share - taken]
                except (OSError, EOFError, gzip.BadGzipFile):
                    continue  # unreadable here: skipped, and the digest tells
                if not text.strip():
                    continue
                held = len(names) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
                parts[1 if held else 0].append(text + b"\n\n")
                names.append(str(path))
                taken += len(text)
        if not names:
            raise ValueError(f"arc_engine: no {kind} text found under {[root for root, _ in kind_sources]}")
        for stream, chunks in ((train, parts[0]), (held_out, parts[1] or parts[0][-1:])):
            joined = b"".join(chunks)
            digest.update(kind.encode() + len(joined).to_bytes(8, "little") + joined)
            stream[kind] = torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()
        counts[kind], used[kind] = len(names), names
    return Corpus(train, held_out, counts, digest.hexdigest(), used)


Mixture = Callable[[int, int], Mapping[str, float]]
"""``mixture(step, rank)`` -> {kind: weight}: the share of each kind in that step's batch on that rank."""


class MixedText:
    """Batches of byte windows from a corpus's kinds, drawn per sequence by a mixture that may depend on the step and
    the rank (a data-mixture switch, per-rank shards of different kinds). Like
    :class:`arc_engine.demo.corpus.CharDataset`, the batch of (step, rank) is a pure function of both, so a run can
    skip or replay any step's data exactly."""

    vocab_size = 256

    def __init__(self, streams: Mapping[str, torch.Tensor], seq_len: int, mixture: Mixture, seed: int = 0,
                 held_out: Mapping[str, torch.Tensor] | None = None) -> None:
        """``held_out``: each kind's evaluation text (:attr:`Corpus.held_out`), kept for the caller."""
        short = [kind for kind, tokens in streams.items() if tokens.numel() <= seq_len + 1]
        if short:
            raise ValueError(f"arc_engine: the {short} text is shorter than one window of {seq_len + 1} bytes")
        self.streams = dict(streams)
        self.kinds = list(self.streams)
        self.seq_len = seq_len
        self.mixture = mixture
        self.seed = seed
        self.held_out = dict(held_out or {})

    def kinds_of(self, step: int, rank: int, batch_size: int) -> list[str]:
        """The kind of each sequence of (step, rank)'s batch."""
        weights = self.mixture(step, rank)
        probs = torch.tensor([float(weights.get(kind, 0.0)) for kind in self.kinds], dtype=torch.float64)
        if probs.sum() <= 0:
            raise ValueError(f"arc_engine: the mixture at step {step}, rank {rank} gives no kind a weight: {weights}")
        gen = self._generator(step, rank, 1)
        picks = torch.multinomial(probs, batch_size, replacement=True, generator=gen)
        return [self.kinds[i] for i in picks.tolist()]

    def batch(self, step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``[batch_size, seq_len]`` for this step and rank."""
        gen = self._generator(step, rank, 2)
        offsets = torch.arange(self.seq_len + 1)
        windows = []
        for kind in self.kinds_of(step, rank, batch_size):
            tokens = self.streams[kind]
            start = int(torch.randint(0, tokens.numel() - self.seq_len - 1, (1,), generator=gen))
            windows.append(tokens[start + offsets])
        window = torch.stack(windows)
        return window[:, :-1], window[:, 1:]

    def _generator(self, step: int, rank: int, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 4099 + rank) * 7 + salt)


def shards(step: int, rank: int) -> dict[str, float]:
    """A :data:`Mixture` of per-rank shards of different kinds: even ranks read code, odd ranks prose."""
    return {"code": 1.0} if rank % 2 == 0 else {"prose": 1.0}


def windows(tokens: torch.Tensor, seq_len: int, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` evenly spaced, non-overlapping evaluation windows of ``tokens`` (fewer when it is short)."""
    stride = max(seq_len + 1, (tokens.numel() - seq_len - 1) // max(count, 1))
    for start in range(0, tokens.numel() - seq_len - 1, stride)[:count]:
        window = tokens[start:start + seq_len + 1]
        yield window[None, :-1], window[None, 1:]
