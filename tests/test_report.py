"""``arc-engine report``: the run report's data, figures and page (in-process, on hand-written run directories), the
per-rank records behind its per-rank panels, and a real run's report loaded in headless Chromium (Debian's
``chromium``; ``.ci/run`` installs it and sets ARC_REQUIRE_CHROMIUM=1, elsewhere the browser test skips without it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arc_engine.report import load_run, write_report
from arc_engine.report.page import summary_rows
from arc_engine.reporter import farthest_from_median
from arc_engine.sinks.jsonl import JsonlSink

REPO = Path(__file__).resolve().parents[1]


def _event(kind: str, detector: str, action: str, severity: str, iteration: int, **extra: object) -> dict:
    return {"kind": kind, "detector": detector, "action": action, "severity": severity, "step": iteration,
            "iteration": iteration, "ranks": [], "run_id": "unit", "message": f"{detector} {action}", "values": {},
            **extra}


def _run_dir(path: Path, ranks: int = 2, closed: bool = True) -> Path:
    events = [_event("lifecycle", "start", "none", "info", 0, message="arc_engine attached: 2 ranks"),
              _event("detection", "non_finite", "skip", "error", 12),
              _event("action", "recovery", "rollback", "error", 15)]
    if closed:
        events.append(_event("lifecycle", "summary", "none", "info", 30, values={
            "steps": 25, "iterations": 30, "applied_steps": 23, "steps_not_applied": 2, "skipped_by_policy": 1,
            "rolled_back": 1, "skipped_by_framework": 0, "detections": {"non_finite": 1},
            "recovery": {"rollbacks": 1, "escapes": 0}}))
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = [{"step": k, "arc/iteration": float(k), "arc/loss_spike/loss": "nan" if k == 12 else 3.0 - 0.01 * k,
                "arc/grad_norm/norm": 1.0, "arc/consistency/grad_norm_cv": 0.1} for k in range(30)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 3')  # torn
    lines = [{"step": k, "iteration": k, "ranks": ranks,
              "values": {"consistency/grad_norm": {str(r): 1.0 + 0.01 * r + (5.0 if r == 3 else 0.0)
                                                   for r in range(ranks)}}} for k in (10, 20)]
    (path / "ranks.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_run_data_reads_every_file_and_tolerates_a_torn_last_line(tmp_path: Path) -> None:
    data = load_run(_run_dir(tmp_path))
    assert data.run_id == "unit" and data.summary["steps"] == 25
    xs, ys = data.series["arc/loss_spike/loss"]
    assert len(xs) == 30 and ys[12] != ys[12]  # "nan" read back as NaN; the torn line skipped
    assert data.monitors() == {"loss_spike": ["arc/loss_spike/loss"], "grad_norm": ["arc/grad_norm/norm"],
                               "consistency": ["arc/consistency/grad_norm_cv"]}
    assert data.ranks["consistency/grad_norm"][0] == (10, {0: 1.0, 1: 1.01})
    with pytest.raises(FileNotFoundError, match=r"no events\.jsonl"):
        load_run(tmp_path / "elsewhere")


def test_the_page_has_the_summary_the_figures_and_every_finding(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, ranks=20)  # 20 ranks: the per-rank panel draws the band
    (run_dir / "stop.json").write_text(json.dumps({
        "cause": "faulty_device", "exit_code": 5, "step": 30, "message": "SDC on rank 1", "ranks": [1],
        "devices": ["node17:cuda:1"], "evidence": [{"detector": "sdc_recompute", "message": "faulty device"}],
        "excluded_hosts": ["node17"], "suggested": "resume without the faulty host"}))
    page = write_report(run_dir)
    out = page.parent
    assert page == tmp_path / "report" / "index.html"
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["monitor-consistency.png", "monitor-grad_norm.png", "monitor-loss_spike.png",
                     "ranks-consistency_grad_norm.png", "timeline.png"]
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in names)
    text = page.read_text()
    assert all(f'src="{name}"' in text for name in names)
    assert "<th>rollbacks / escapes</th><td>1 / 0</td>" in text
    # why it stopped comes first, before the summary
    assert text.index("Why it stopped") < text.index("<h2>Summary") and "node17:cuda:1" in text
    assert "resume without the faulty host" in text
    assert '<tr class="error"><td>12</td>' in text and "recovery rollback" in text
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    rows = dict(summary_rows(load_run(_run_dir(unfinished, closed=False))))
    assert rows["summary"].startswith("none: the run did not close")


def test_per_rank_records_keep_the_outliers_within_the_limit(tmp_path: Path) -> None:
    values = {rank: 1.0 for rank in range(10)} | {4: 9.0, 7: float("nan"), 2: 0.5}
    assert farthest_from_median(values, 16) == values
    assert list(farthest_from_median(values, 3)) == [2, 4, 7]  # NaN first, then the largest distances
    sink = JsonlSink(tmp_path / "e.jsonl", tmp_path / "m.jsonl", tmp_path / "r.jsonl")
    sink.log_ranks(5, 7, {"consistency/loss": {0: 2.5, 1: float("inf")}}, 2)
    sink.close()
    (line,) = (tmp_path / "r.jsonl").read_text().splitlines()
    assert json.loads(line) == {"step": 5, "iteration": 7, "ranks": 2,
                                "values": {"consistency/loss": {"0": 2.5, "1": "inf"}}}
    quiet = JsonlSink(tmp_path / "e2.jsonl", tmp_path / "m2.jsonl", tmp_path / "r2.jsonl")
    quiet.close()
    assert not (tmp_path / "r2.jsonl").exists()  # no per-rank record, no file


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_a_real_runs_report_loads_in_headless_chromium(tmp_path: Path) -> None:
    """The demo on 2 DDP ranks (its four faults, a rollback; per-rank statistics every 10 steps), then
    ``arc-engine report``; Chromium loads the page from disk: every figure decodes, no console message."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("ARC_REQUIRE_CHROMIUM") == "1":
            pytest.fail("ARC_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    demo = subprocess.run([sys.executable, "-m", "arc_engine", "demo", "--nproc", "2", "--steps", "170",
                           "--log-every", "100", f"--arc.run.run_dir={tmp_path}", "--arc.sinks.wandb.enabled=false",
                           "--arc.detectors.consistency.detail_every=10"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert demo.returncode == 0, demo.stderr[-3000:]
    run_dir = tmp_path / "demo"
    made = subprocess.run([sys.executable, "-m", "arc_engine", "report", str(run_dir)], capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    page = run_dir / "report" / "index.html"
    lines = made.stdout.strip().splitlines()  # why the run stopped first (stop.json), then the page
    assert lines[0].startswith("stopped: completed (exit code 0) at step 170") and lines[-1] == f"report: {page}"
    figures = sorted(p.name for p in page.parent.glob("*.png"))
    assert "timeline.png" in figures and "ranks-consistency_loss.png" in figures
    assert {"monitor-non_finite.png", "monitor-loss_spike.png", "monitor-sdc.png"} <= set(figures)
    browser_run = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert browser_run.returncode == 0, browser_run.stderr[-2000:]
    dom = browser_run.stdout
    loaded = re.search(r'data-figures-loaded="(\d+)"', dom)
    total = re.search(r'data-figures="(\d+)"', dom)
    assert loaded and total, dom[:500]
    assert int(loaded.group(1)) == int(total.group(1)) == len(figures)  # every <img> decoded
    console = [line for line in browser_run.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    assert "rollback" in dom and "non_finite" in dom  # the findings table made it into the rendered page
