"""The R-Metric's false alarms on clean runs and its delay on a drift, as written and in arc_engine's reading.

    .venv/bin/python scripts/bench_r_metric.py                       # 5 seeds x 20,000 steps per stream
    .venv/bin/python scripts/bench_r_metric.py --steps 5000 --seeds 2

The monitor (:class:`arc_engine.monitors.r_metric.RMetricMonitor`, driven through its ``judge`` / ``commit``, so
the normalization, the weights and the persistence are the shipped ones) is fed synthetic agreed inputs of a run
with no fault: a training loss 3 + noise, the ranks' gradient-norm variance σ² log-normal, and no system event
(λ = 0) or rare ones (Poisson, one per 200 steps). Two kinds of noise: independent per step, and autocorrelated
(AR(1), φ = 0.9), closer to a real run's. Reported per score reading (``paper``: R against 0.57 as written;
``normalized``: R / Σw, the default): the fraction of steps above the threshold, and the alerts per 1,000 steps of
each persistence rule (``persist`` steps looked back over, ``persist_fraction`` of them above: 1.0 means
consecutive). Then a healthy run's trends (:func:`healthy`: a falling loss with a phase change, the ranks' spread
growing 100x), read with the paper's raw σ² and with the default's σ² relative to its recent level. Then the
delay of the default (40, 0.8) on faults: the loss drifting up by 0.02 per step (a slow
divergence), the ranks' norms parting (σ² growing 5% per step), both from step 300 -- steps from the fault's start
to the alert.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arc_engine.config import load_config
from arc_engine.monitors.family import section_of
from arc_engine.monitors.r_metric import RMetricFamily, RMetricMonitor

#: (persist, persist_fraction) rules compared; (40, 0.8) is the default.
RULES = ((1, 1.0), (20, 1.0), (20, 0.8), (30, 0.8), (40, 0.8), (60, 0.8))


def noise(rng: np.random.Generator, steps: int, phi: float) -> np.ndarray:
    """Unit-variance noise, AR(1) with coefficient ``phi`` (0: independent)."""
    white = rng.normal(size=steps)
    if not phi:
        return white
    out = np.empty(steps)
    out[0] = white[0]
    scale = np.sqrt(1.0 - phi * phi)
    for t in range(1, steps):
        out[t] = phi * out[t - 1] + scale * white[t]
    return out


def stream(rng: np.random.Generator, steps: int, phi: float, events_rate: float, drift_from: int = -1,
           spread_from: int = -1) -> list[dict[str, float]]:
    """The monitor's raw agreed inputs per step."""
    t = np.arange(steps)
    loss = 3.0 + 0.05 * noise(rng, steps, phi) + 0.02 * np.maximum(t - drift_from, 0) * (drift_from >= 0)
    variance = np.exp(0.3 * noise(rng, steps, phi)) * 0.01 * 1.05 ** (np.maximum(t - spread_from, 0)
                                                                        * (spread_from >= 0))
    events = rng.poisson(events_rate, steps) if events_rate else np.zeros(steps)
    return [{"events": float(e), "variance": float(v), "loss": float(x), "source": 0.0}
            for e, v, x in zip(events, variance, loss, strict=True)]


def healthy(rng: np.random.Generator, steps: int, phi: float) -> list[dict[str, float]]:
    """A short healthy run's trends, no fault, shaped like the campaign's 360-step clean runs: the loss falls from
    3.4 towards 0.6 (time constant ``steps`` / 3) with one phase change (at a random step the descent speeds up
    by a further 0.3 drop over about 60 steps), noise 0.03; the ranks' gradient-norm variance grows 100x as the loss
    falls (gradient noise outgrowing the signal), log-normal noise 0.3 -- the shapes that made the paper's reading
    warn on clean campaign runs (docs/results.md)."""
    t = np.arange(steps)
    loss = 0.6 + 2.8 * np.exp(-t / (steps / 3))
    loss -= 0.3 * 0.5 * (1.0 + np.tanh((t - rng.uniform(0.2 * steps, 0.8 * steps)) / 20.0))
    loss += 0.03 * noise(rng, steps, phi)
    variance = 0.001 * 100.0 ** (1.0 - (loss - loss.min()) / (loss.max() - loss.min())) * \
        np.exp(0.3 * noise(rng, steps, phi))
    return [{"events": 0.0, "variance": float(v), "loss": float(x), "source": 0.0}
            for v, x in zip(variance, loss, strict=True)]


#: The readings compared on a healthy run: the paper's raw σ², and the default (σ² relative to its recent level).
READINGS = (("raw σ² (`variance_relative: false`)", ("detectors.r_metric.variance_relative=false",)),
            ("default: σ² relative to its recent level", ()))


def run(inputs: list[dict[str, float]], score: str, persist: int = 40,
        fraction: float = 0.8, overrides: tuple[str, ...] = ()) -> tuple[list[int], list[bool]]:
    """(the monitor's alert steps, whether each step's score was above the threshold after the warm-up)."""
    loaded = load_config(None, [f"detectors.r_metric.score={score}", f"detectors.r_metric.persist={persist}",
                                f"detectors.r_metric.persist_fraction={fraction}",
                                "detectors.r_metric.nvml=false", *overrides])
    config = section_of(loaded, RMetricFamily())
    monitor = RMetricMonitor(config, variance=True)
    alerts, above = [], []
    for step, raw in enumerate(inputs):
        if monitor.judge(raw):
            alerts.append(step)
        above.append(bool(monitor._pending is not None and monitor._pending["above"]))
        monitor.commit(step, True)
    return alerts, above


def episodes(above: list[bool], persist: int, fraction: float) -> list[int]:
    """The steps a (``persist``, ``fraction``) rule alerts at on this sequence -- the monitor's own rule (this step
    above, and at least ``fraction`` of the last ``persist``; again only after fewer were above), which leaves the
    scores themselves unchanged, so one run serves every rule."""
    required = math.ceil(fraction * persist - 1e-9)
    alerts, window, armed = [], deque(maxlen=persist), True
    for step, flag in enumerate(above):
        window.append(flag)
        if flag and armed and len(window) == persist and sum(window) >= required:
            alerts.append(step)
            armed = False
        if sum(window) < required:
            armed = True
    return alerts


def false_alarms(steps: int, seeds: int) -> list[str]:
    lines = ["| noise | λ events | score | steps above | " + " | ".join(f"{p} x {f}" for p, f in RULES) + " |",
             "|---" * (4 + len(RULES)) + "|"]
    for phi, label in ((0.0, "independent"), (0.9, "AR(1) 0.9")):
        for rate in (0.0, 0.005):
            inputs = [stream(np.random.default_rng(seed), steps, phi, rate) for seed in range(seeds)]
            for score in ("paper", "normalized"):
                sequences = [run(one, score)[1] for one in inputs]
                counted = sum(len(s) for s in sequences)
                cells = [f"{1000 * sum(len(episodes(s, p, f)) for s in sequences) / counted:.2f}" for p, f in RULES]
                fraction = sum(sum(s) for s in sequences) / counted
                lines.append(f"| {label} | {'none' if not rate else f'{rate}/step'} | {score} | {fraction:.1%} | "
                             + " | ".join(cells) + " |")
    return lines


def trends(runs: int, steps: int = 360) -> list[str]:
    lines = ["| noise | reading | runs that warned | alerts per 1,000 steps |", "|---|---|---|---|"]
    for phi, label in ((0.0, "independent"), (0.9, "AR(1) 0.9")):
        inputs = [healthy(np.random.default_rng(seed), steps, phi) for seed in range(runs)]
        for reading, overrides in READINGS:
            alerts = [len(run(one, "normalized", overrides=overrides)[0]) for one in inputs]
            lines.append(f"| {label} | {reading} | {sum(a > 0 for a in alerts)}/{runs} | "
                         f"{1000 * sum(alerts) / (steps * runs):.2f} |")
    return lines


def delays(seeds: int) -> list[str]:
    lines = ["| fault (from step 300) | noise | alerted runs | delay, steps (median, max) |", "|---|---|---|---|"]
    for fault, kwargs in (("loss drift +0.02/step", {"drift_from": 300}), ("σ² +5%/step", {"spread_from": 300})):
        for phi, label in ((0.0, "independent"), (0.9, "AR(1) 0.9")):
            found = []
            for seed in range(seeds):
                alerts, _ = run(stream(np.random.default_rng(100 + seed), 500, phi, 0.0, **kwargs), "normalized")
                after = [a - 300 for a in alerts if a >= 300]
                if after:
                    found.append(after[0])
            spread = f"{int(np.median(found))}, {max(found)}" if found else "-"
            lines.append(f"| {fault} | {label} | {len(found)}/{seeds} | {spread} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--healthy-runs", type=int, default=100)
    args = parser.parse_args()
    print(f"False alarms on clean runs ({args.seeds} seeds x {args.steps} steps, threshold 0.57; alerts per 1,000 "
          "steps per rule, persist x persist_fraction):\n")
    print("\n".join(false_alarms(args.steps, args.seeds)))
    print(f"\nFalse alarms on a healthy run's trends ({args.healthy_runs} runs x 360 steps; the normalized score, "
          "80% of 40 steps):\n")
    print("\n".join(trends(args.healthy_runs)))
    print("\nDelay of the default (normalized, 80% of 40 steps) on a fault:\n")
    print("\n".join(delays(args.seeds)))


if __name__ == "__main__":
    main()
