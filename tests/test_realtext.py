"""The real-text corpus (arc_engine/demo/realtext.py) on a hand-made file tree, its mixture sampler, and the pure parts
of scripts/realtext_runs.py (schedule, ramp, the Poisson interval, the alarm's context)."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import pytest
import torch

from arc_engine.demo.realtext import HELD_OUT_EVERY, MixedText, build_corpus, strip_roff, windows
from tests.scripts_loader import load_script

MAN_PAGE = """.TH LS 1 "2026" "GNU" "User Commands"
.SH NAME
ls \\- list directory contents
.SH OPTIONS
.TP
\\fB\\-a\\fR, \\fB\\-\\-all\\fR
do not ignore entries starting with .
"""


def _tree(root: Path, code_files: int = 12) -> dict[str, tuple[tuple[str, str], ...]]:
    (root / "lib" / "pkg").mkdir(parents=True)
    for index in range(code_files):
        (root / "lib" / "pkg" / f"mod{index}.py").write_text(f"def f{index}(x):\n    return x + {index}\n")
    (root / "licenses").mkdir()
    (root / "licenses" / "GPL-1.2").write_text(".. a license line that starts with a dot stays\nTerms.\n")
    (root / "man1").mkdir()
    (root / "man1" / "ls.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode()))
    (root / "etc").mkdir()
    (root / "etc" / "services").write_text("ssh\t22/tcp\nhttp\t80/tcp\n")
    return {"code": ((str(root / "lib"), "**/*.py"),),
            "prose": ((str(root / "licenses"), "*"), (str(root / "man1"), "*.1.gz"), (str(root / "etc"), "services"),
                      (str(root / "missing"), "*"))}


def test_the_corpus_reads_each_kind_holds_every_tenth_document_out_and_names_what_it_read(tmp_path: Path) -> None:
    sources = _tree(tmp_path)
    corpus = build_corpus(sources)
    assert corpus.documents == {"code": 12, "prose": 3}
    code = bytes(corpus.train["code"].tolist()) + bytes(corpus.held_out["code"].tolist())
    held_out = bytes(corpus.held_out["code"].tolist())
    assert code.count(b"def f") == 12 and held_out.count(b"def f") == 12 // HELD_OUT_EVERY
    prose = bytes(corpus.train["prose"].tolist()).decode()
    assert "list directory contents" in prose and "--all" in prose  # the manual page's words and options
    assert ".TH" not in prose and "\\fB" not in prose and ".SH" not in prose  # not its markup
    assert ".. a license line" in prose and "ssh\t22/tcp" in prose  # other files untouched
    assert build_corpus(sources).digest == corpus.digest
    (tmp_path / "etc" / "services").write_text("ssh\t2222/tcp\n")
    assert build_corpus(sources).digest != corpus.digest
    small = build_corpus(sources, budget_bytes=60)
    train, held = bytes(small.train["code"].tolist()), bytes(small.held_out["code"].tolist())
    assert len(train) <= 60 + 2 * small.documents["code"]  # the budget, and each document's blank-line separator
    # fewer than HELD_OUT_EVERY documents: none is held out, and the last one read stands in for the held-out text
    # (the documents are read in an order hashed from their paths: 2 or 3 of them fill 60 bytes)
    assert small.documents["code"] < HELD_OUT_EVERY and held and train.endswith(held)


def test_a_kind_with_no_text_is_an_error_naming_its_roots(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no code text found under .*nowhere"):
        build_corpus({"code": ((str(tmp_path / "nowhere"), "*.py"),)})


def test_strip_roff_keeps_words_and_drops_requests_and_fonts() -> None:
    assert strip_roff(".B bold\n\\fIword\\fP and \\(em dash\n") == "word and  dash\n"


def test_the_mixture_picks_each_sequences_kind_per_step_and_rank_and_batches_are_pure() -> None:
    streams = {"code": torch.full((500,), ord("c")), "prose": torch.full((500,), ord("p"))}
    data = MixedText(streams, 16, lambda step, rank: {"code": 1.0} if step < 10 or rank == 1 else {"prose": 1.0})
    assert (data.batch(3, 0, 4)[0] == ord("c")).all() and (data.batch(12, 0, 4)[0] == ord("p")).all()
    assert (data.batch(12, 1, 4)[0] == ord("c")).all()
    mixed = MixedText({"code": torch.arange(1000) % 7, "prose": torch.arange(1000) % 5 + 100}, 16,
                      lambda step, rank: {"code": 0.5, "prose": 0.5}, seed=3)
    inputs, targets = mixed.batch(5, 1, 64)
    assert inputs.shape == targets.shape == (64, 16) and (inputs[:, 1:] == targets[:, :-1]).all()
    assert torch.equal(mixed.batch(5, 1, 64)[0], inputs) and not torch.equal(mixed.batch(6, 1, 64)[0], inputs)
    kinds = mixed.kinds_of(5, 1, 64)
    assert 16 < kinds.count("code") < 48  # both kinds, about half each
    assert [row[0] >= 100 for row in inputs.tolist()] == [kind == "prose" for kind in kinds]
    with pytest.raises(ValueError, match="no kind a weight"):
        MixedText(mixed.streams, 16, lambda step, rank: {"tables": 1.0}).batch(0, 0, 2)
    with pytest.raises(ValueError, match="shorter than one window"):
        MixedText({"code": torch.zeros(10, dtype=torch.long)}, 16, lambda s, r: {"code": 1.0})


def test_evaluation_windows_are_evenly_spaced_and_disjoint() -> None:
    tokens = torch.arange(1000)
    starts = [int(x[0, 0]) for x, _ in windows(tokens, 16, 8)]
    assert len(starts) == 8 and all(b - a >= 17 for a, b in itertools.pairwise(starts))


def test_the_runs_schedule_ramp_interval_and_context() -> None:
    runs = load_script("realtext_runs")
    steps = 1000
    assert runs.lr_factor(0, steps) == pytest.approx(1 / 50) and runs.lr_factor(49, steps) == pytest.approx(1.0)
    assert runs.lr_factor(steps, steps) == pytest.approx(runs.MIN_LR_RATIO)
    assert [runs.batch_size(s, steps, [4, 6, 8]) for s in (0, 99, 100, 299, 300)] == [4, 4, 6, 6, 8]
    low, high = runs.poisson_interval(0)
    assert low == 0 and high == pytest.approx(3.689, abs=1e-3)
    low, high = runs.poisson_interval(3)
    assert low == pytest.approx(0.619, abs=1e-3) and high == pytest.approx(8.767, abs=1e-3)
    assert runs.context(600, steps, 0, [500]) == "mixture switch"
    assert runs.context(600, steps, 1, [500]) == "-"  # odd seeds: per-rank shards, no switch
    assert runs.context(520, steps, 1, [500]) == "resume" and "warm-up" in runs.context(10, steps, 1, [])
    assert runs.mixture(1, steps)(0, 0) == {"code": 1.0} and runs.mixture(1, steps)(0, 1) == {"prose": 1.0}
    assert runs.mixture(0, steps)(599, 1)["prose"] == 0.8 and runs.mixture(0, steps)(600, 1)["code"] == 0.8
