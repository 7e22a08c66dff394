"""The configuration reference page, generated from the schema.

``python -m arc_engine.config.reference > docs/configuration.md`` regenerates the committed page;
``tests/test_docs.py`` fails when the committed page differs from this module's output. The walk starts at
:class:`~arc_engine.config.schema.ArcConfig` and lists every dotted key with its type, default and allowed values
as the schema declares them (``Literal`` choices and booleans are read from the type hints). The schema's fields
carry no per-field text, so the one-line descriptions -- and the numeric ranges that ``__post_init__`` checks --
live in :data:`KEY_DOCS` below, keyed by dotted key. :func:`render` raises when a schema key has no entry there,
or an entry names no schema key, so a new key cannot ship undocumented.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any, Literal, NamedTuple, get_args, get_origin, get_type_hints

from arc_engine.config.schema import ArcConfig, FaultsConfig, FaultSpec

REGENERATE = "python -m arc_engine.config.reference > docs/configuration.md"
FAULT_PREFIX = "faults.injections[]"


class KeyDoc(NamedTuple):
    """What a key means; ``allowed`` only where the type does not say it (ranges, formats)."""

    text: str
    allowed: str | None = None


KEY_DOCS: dict[str, KeyDoc] = {
    # run
    "run.run_id": KeyDoc("Name shared by every rank. Null: `$TORCHELASTIC_RUN_ID` if set (stable across torchrun's "
                         "restarts), else rank 0's timestamp `YYYYmmdd-HHMMSS`, broadcast once at attach.",
                         "letters, digits, `-`, `_`, `.`"),
    "run.run_dir": KeyDoc("Parent folder; the run's files go to `<run_dir>/<run_id>/`.", "a non-empty path"),
    # stats
    "stats.interval": KeyDoc("Monitor every k-th optimizer step. Unmonitored steps run no statistics, no "
                             "collective and no detector: a fault on such a step is applied unseen.", ">= 1"),
    "stats.device": KeyDoc("Where the step's statistics buffer lives: `auto` is CUDA for NCCL groups, else CPU."),
    "stats.optimizer_stats_every": KeyDoc("Per-group weight norms and the prospective Adam update RMS on every "
                                          "k-th monitored step (about one extra Adam step of memory traffic; 0: "
                                          "never). The SDC detector computes the update RMS every monitored step "
                                          "regardless.", ">= 0"),
    "stats.own_work": KeyDoc("Time arc_engine's own work per step, piece by piece (thread CPU time of each hook, "
                             "the decision, snapshots; CUDA event time of its kernels on CUDA), reported in the run "
                             "summary's `own_work` ([performance.md](performance.md)). Off: no timer on the hot "
                             "path; on: about a microsecond per timed call."),
    # detectors
    "detectors.<family>": KeyDoc("The section of a monitor family registered as a plugin "
                                 "([families.md](families.md)), parsed with that family's own "
                                 "config class; `--arc.detectors.<family>.<key>=VALUE` overrides work as for "
                                 "built-in sections.", "a registered family's name and keys"),
    "detectors.non_finite.enabled": KeyDoc("NaN/Inf in any rank's loss or local (pre-reduction) gradient; the "
                                           "finding names the rank and the first parameter group."),
    "detectors.non_finite.action": KeyDoc("What a non-finite step gets."),
    "detectors.loss_spike.enabled": KeyDoc("Loss above a robust running baseline (median and MAD of recent "
                                           "accepted losses)."),
    "detectors.loss_spike.warmup_steps": KeyDoc("Accepted steps before the detector can flag.", ">= 3"),
    "detectors.loss_spike.window": KeyDoc("Accepted losses in the baseline.", ">= `warmup_steps`"),
    "detectors.loss_spike.factor": KeyDoc("Robust standard deviations (1.4826 x MAD) above the median that a "
                                          "spike must exceed.", "> 0"),
    "detectors.loss_spike.min_relative_increase": KeyDoc("And the fraction of the median it must exceed it by.",
                                                         ">= 0"),
    "detectors.loss_spike.action": KeyDoc("What a spike gets."),
    "detectors.loss_spike.level_shift": KeyDoc("The level-shift arm: a one-sided CUSUM of the loss above its recent "
                                               "median, in units of the successive-difference noise scale "
                                               "([detectors.md](detectors.md#loss-level-shifts))."),
    "detectors.loss_spike.level_reference": KeyDoc("Accepted losses whose median is the reference level.",
                                                   "[1, `window`]"),
    "detectors.loss_spike.level_allowance": KeyDoc("Noise units subtracted from each step's distance (the CUSUM's "
                                                   "k).", ">= 0"),
    "detectors.loss_spike.level_cap": KeyDoc("Largest distance one step adds (a single spike cannot trip the arm).",
                                             "> `level_allowance`"),
    "detectors.loss_spike.level_threshold": KeyDoc("The sum that is a level shift (the CUSUM's h).", "> 0"),
    "detectors.loss_spike.level_action": KeyDoc("What a level shift gets (once per episode)."),
    "detectors.grad_norm.enabled": KeyDoc("Explosion and vanishing of the global gradient norm (reduced, before "
                                          "clipping)."),
    "detectors.grad_norm.explosion_threshold": KeyDoc("τ_grad of the ARC paper: a norm above it is an explosion.",
                                                      "> 0"),
    "detectors.grad_norm.vanishing_threshold": KeyDoc("ε_grad: a norm below it is vanishing.",
                                                      ">= 0 and < `explosion_threshold`"),
    "detectors.grad_norm.explosion_action": KeyDoc("What an explosion (either arm) gets."),
    "detectors.grad_norm.relative": KeyDoc("The relative explosion arm: the pre-clip norm far above the run's own "
                                           "robust baseline of log-norms, whatever the clipping threshold "
                                           "([detectors.md](detectors.md#relative-gradient-explosion))."),
    "detectors.grad_norm.warmup_steps": KeyDoc("Accepted steps before the relative arm can fire.", ">= 3"),
    "detectors.grad_norm.window": KeyDoc("Accepted log-norms in the relative arm's baseline.", ">= `warmup_steps`"),
    "detectors.grad_norm.relative_factor": KeyDoc("Robust standard deviations (1.4826 x MAD of the log-norms) above "
                                                  "their median that the relative arm needs.", "> 0"),
    "detectors.grad_norm.relative_min_ratio": KeyDoc("And the norm at least this many times the baseline median's "
                                                     "(clean campaign runs peak at 3x).", ">= 1"),
    "detectors.grad_norm.vanishing_action": KeyDoc("What a vanishing gradient gets."),
    "detectors.sdc.enabled": KeyDoc("The SDC paper's update-RMS rule (on by default); computes the sampled update "
                                    "RMS on every monitored step."),
    "detectors.sdc.alpha": KeyDoc("α of the rule ΔR_t > μ/(α√ΔG_t); larger is more sensitive.", "(0, 1]"),
    "detectors.sdc.warmup_steps": KeyDoc("Applied steps over which μ (the mean update-RMS jump) is learned; also "
                                         "the recomputation gate's warm-up.", ">= 1"),
    "detectors.sdc.localize_factor": KeyDoc("On a flagged step, a rank whose local gradient-norm jump exceeds this "
                                            "many times its peers' median jump is named the suspect.", "> 1"),
    "detectors.sdc.action": KeyDoc("What a flagged step gets."),
    "detectors.sdc.update_sample": KeyDoc("Fraction of each tensor the update RMS is computed on: one contiguous "
                                          "window (at least 256 elements) that moves every monitored step, so every "
                                          "element is covered every ceil(1/update_sample) steps; 1.0 gives the "
                                          "paper's exact R_t.", "(0, 1]"),
    "detectors.sdc.sketch_size": KeyDoc("Numbers per rank in the signed chunk-sum sketch of the local gradient "
                                        "(0: off, the default; e.g. 256: one more pass over each local gradient "
                                        "bucket per step).", ">= 0"),
    "detectors.qk_spectra.enabled": KeyDoc("Attention ΔW and QK-product spectra per head and tensor-parallel shard "
                                           "(Megatron; off elsewhere)."),
    "detectors.qk_spectra.every": KeyDoc("δ: optimizer steps between measurements (W_q, W_k at t − δ are kept).",
                                         "a multiple of `stats.interval`"),
    "detectors.qk_spectra.warmup_measurements": KeyDoc("Accepted measurements before the alarm can fire.", ">= 3"),
    "detectors.qk_spectra.window": KeyDoc("Accepted measurements in each layer's healthy trajectory.",
                                          ">= `warmup_measurements`"),
    "detectors.qk_spectra.allowance": KeyDoc("Relative drop per measurement (mean over layers of each layer's "
                                             "median head below its trend) the accumulated sum absorbs.", "[0, 1)"),
    "detectors.qk_spectra.alarm_drop": KeyDoc("Accumulated drop beyond the allowance that alarms (e.g. 0.5: a "
                                              "sustained 30 % drop alarms on the 3rd measurement).", "> 0"),
    "detectors.qk_spectra.action": KeyDoc("What an alarm gets."),
    "detectors.qk_spectra.logit_growth": KeyDoc("A head's attention-logit bound σ_max(W_q W_kᵀ)/√d_k above its own "
                                                "trend by a factor of more than 1 + this alarms (with "
                                                "`logit_factor`).", "> 0"),
    "detectors.qk_spectra.logit_factor": KeyDoc("... and by more than this many robust standard deviations of the "
                                                "log bound's residuals.", "> 0"),
    "detectors.qk_spectra.logit_warmup_measurements": KeyDoc("Accepted measurements before the logit-growth alarm "
                                                             "can fire (early training moves the bounds fastest).",
                                                             "3 to `window`"),
    "detectors.qk_spectra.logit_action": KeyDoc("What a logit-growth alarm gets."),
    "detectors.router.enabled": KeyDoc("MoE router health per MoE layer over every token of the job (Megatron with "
                                       "experts; off elsewhere)."),
    "detectors.router.every": KeyDoc("Optimizer steps between measurements.", "a multiple of `stats.interval`"),
    "detectors.router.warmup_measurements": KeyDoc("Accepted measurements before the alarms can fire.", ">= 3"),
    "detectors.router.window": KeyDoc("Accepted measurements in each layer's healthy trajectory.",
                                      ">= `warmup_measurements`"),
    "detectors.router.factor": KeyDoc("Robust standard deviations of change (entropy down, similarity up) that "
                                      "alarm.", "> 0"),
    "detectors.router.min_relative_change": KeyDoc("And the fraction of the predicted value the change must exceed.",
                                                   ">= 0"),
    "detectors.router.min_similarity_change": KeyDoc("And, for the similarity (a mean cosine, about 0 for a healthy "
                                                     "router), this absolute rise.", "[0, 2]"),
    "detectors.router.action": KeyDoc("What an entropy or similarity alarm gets."),
    "detectors.router.dead_expert_action": KeyDoc("What an expert gets that was alive in the baseline and "
                                                  "receives no token."),
    "detectors.sdc.recompute.enabled": KeyDoc("Withhold a suspect local gradient before the reduction and recompute "
                                              "it on that rank only (DDP, DeepSpeed ZeRO-1/2; megatron-core: on its "
                                              "replica's model-parallel group; needs `recompute_fn` at attach)."),
    "detectors.sdc.recompute.gate_factor": KeyDoc("A local gradient norm above this many times its running "
                                                  "reference is withheld.", "> 1"),
    "detectors.sdc.recompute.peer_rtol": KeyDoc("Relative tolerance of the peer check: the suspect's recomputation "
                                                "and a healthy peer's agree within it (the data caused it) or not "
                                                "(the device is faulty).", "(0, 1)"),
    "detectors.sdc.recompute.on_faulty_device": KeyDoc("`abort`: every rank stops with exit code 5; `exclude`: the "
                                                       "peer's recomputation replaces the suspect's share and "
                                                       "training goes on."),
    # policy
    "detectors.consistency.enabled": KeyDoc("Cross-worker consistency over the data-parallel ranks: loss and "
                                            "local gradient-norm dispersion every monitored step, direction "
                                            "consistency periodically ([detectors.md](detectors.md)). Off by itself "
                                            "under tensor, pipeline, context or expert parallelism."),
    "detectors.consistency.warmup_steps": KeyDoc("Accepted steps before the alarms can fire.", ">= 3"),
    "detectors.consistency.window": KeyDoc("Accepted values (gradient-norm CV, C_dir) in the baseline.",
                                           ">= warmup_steps"),
    "detectors.consistency.factor": KeyDoc("Robust standard deviations (1.4826 x MAD) from the baseline's median "
                                           "that alarm.", "> 0"),
    "detectors.consistency.min_cv_ratio": KeyDoc("The gradient-norm CV must also exceed this many times its "
                                                 "baseline median.", ">= 1"),
    "detectors.consistency.min_direction_drop": KeyDoc("C_dir must also fall this far below its baseline median "
                                                       "(cosine units).", "[0, 2]"),
    "detectors.consistency.persist": KeyDoc("Consecutive measurements past the limit before an alarm (one alarm per "
                                            "episode); one step's spread has a long tail with few ranks.", ">= 1"),
    "detectors.consistency.direction": KeyDoc("Measure C_dir, the mean pairwise cosine of the ranks' local "
                                              "gradients, from a gradient sketch (one more pass over the local "
                                              "gradient on its steps)."),
    "detectors.consistency.direction_every": KeyDoc("Monitored steps between C_dir measurements (the sketch is "
                                                    "taken only then; on every monitored step when "
                                                    "`detectors.sdc.sketch_size` is set).", ">= 1"),
    "detectors.consistency.sketch_size": KeyDoc("Numbers in each rank's sketch (`detectors.sdc.sketch_size` wins "
                                                "when set): the estimate's error falls as 1/sqrt(size) "
                                                "([detectors.md](detectors.md)).", ">= 2"),
    "detectors.consistency.exact_max_params": KeyDoc("Under DDP and FSDP2, a model with at most this many "
                                                     "trainable elements sends each rank's whole unit gradient "
                                                     "instead of the sketch: "
                                                     "C_dir is then exact, and the all-reduce carries that many more "
                                                     "numbers on every monitored step (small models and tests); 0: "
                                                     "always the sketch. `detectors.sdc.sketch_size` wins when set.",
                                                     ">= 0"),
    "detectors.consistency.detail_every": KeyDoc("Monitored steps between readings of the ranges of the ranks' "
                                                 "loss and local norm and of the rank farthest from its peers; 0: "
                                                 "on alarms only. One MAX reduction of 2 + 2 x positions numbers on "
                                                 "those steps (the extreme ranks), not a per-rank gather.", ">= 0"),
    "detectors.consistency.action": KeyDoc("What an alarm gets."),
    "detectors.data.enabled": KeyDoc("Bad data, found and localized: the ranks' losses on one step parting from "
                                     "each other (the L4 norm of their deviations, from the step's one "
                                     "all-reduce); names the rank with the highest loss and the data position "
                                     "([detectors.md](detectors.md#bad-data)). Needs 2 or more ranks; off under "
                                     "expert parallelism."),
    "detectors.data.warmup_steps": KeyDoc("Accepted steps before the rule can fire.", ">= 3"),
    "detectors.data.window": KeyDoc("Accepted values in the baseline.", ">= `warmup_steps`"),
    "detectors.data.factor": KeyDoc("Robust standard deviations (1.4826 x MAD) above the baseline's median that "
                                    "a step's deviation must exceed.", "> 0"),
    "detectors.data.min_ratio": KeyDoc("And this many times the baseline's median (10: silent on the campaign's "
                                       "clean runs, [results.md](results.md#bad-data)).", ">= 1"),
    "detectors.data.min_excess": KeyDoc("The highest-loss rank is named when its loss is at least this fraction "
                                        "above its peers' mean.", ">= 0"),
    "detectors.data.quarantine": KeyDoc("After a step skipped for a named rank's bad data, drop only that rank's "
                                        "share of the next steps' gradient (before the reduction) and apply them, "
                                        "while the rule keeps naming it (DDP, ZeRO-1/2; elsewhere: skip)."),
    "detectors.data.quarantine_steps": KeyDoc("Quarantined steps in a row at most; past them the findings skip "
                                              "again.", ">= 1"),
    "detectors.data.diverged_action": KeyDoc("What an alarm gets whose data-parallel replicas' weights differ "
                                             "(not bad data; DDP, ZeRO-1/2): rollback restores identical "
                                             "replicas (without recovery: a stop)."),
    "detectors.data.action": KeyDoc("What a finding gets; its skips count apart "
                                    "(`policy.max_consecutive_data_skips`)."),
    "detectors.weight_health.enabled": KeyDoc("Weight-matrix health (Frobenius norm, effective rank, sparsity, a "
                                              "score) and per-layer gradient CV and histogram entropy (ARC paper; "
                                              "[detectors.md](detectors.md#weight-health))."),
    "detectors.weight_health.every": KeyDoc("Optimizer steps between measurements; off the schedule its slots stay "
                                            "zero.", ">= 1, a multiple of `stats.interval`"),
    "detectors.weight_health.max_tensors": KeyDoc("Weight matrices (parameters of 2+ dimensions) tracked: all when "
                                                  "they fit, else this many spread evenly over the model. Sets the "
                                                  "slots' size (8 numbers per matrix).", "[1, 4096]"),
    "detectors.weight_health.max_norm": KeyDoc("Explosion: a matrix's Frobenius norm above this (or not finite).",
                                               "> 0"),
    "detectors.weight_health.collapse_ratio": KeyDoc("Collapse: ‖W‖_F / ‖W₀‖_F below this (W₀: the matrix at the "
                                                     "family's first measurement); 0: off.", "[0, 1)"),
    "detectors.weight_health.sparsity_eps": KeyDoc("Sparsity counts the elements with |w| below this.", "> 0"),
    "detectors.weight_health.sparsity_increase": KeyDoc("Sparsity explosion: a matrix's sparsity above its first "
                                                        "value plus this.", "(0, 1]"),
    "detectors.weight_health.rank_samples": KeyDoc("Matrices whose effective rank (one SVD each) is computed per "
                                                   "measurement, rotating; 0: none. Replicated matrices only.",
                                                   "[0, max_tensors]"),
    "detectors.weight_health.rank_drop": KeyDoc("Alarm when a matrix's effective rank falls by more than this "
                                                "fraction of its reference (`rank_window`).", "(0, 1]"),
    "detectors.weight_health.rank_window": KeyDoc("The rank drop's reference: the largest of the matrix's last this "
                                                  "many measured effective ranks (a collapse is a fall within them, "
                                                  "not learning's slow compression); 0: its first value, the ARC "
                                                  "paper's rule.", "[0, 1000]"),
    "detectors.weight_health.cv_max": KeyDoc("Alarm when a layer's gradient σ/|μ| exceeds this; 0: off (the paper's "
                                             "10 fires on every layer of a healthy model).", ">= 0"),
    "detectors.weight_health.hist_bins": KeyDoc("Equal log2-magnitude bins of the gradient histogram (its normalized "
                                                "entropy is the metric `grad_entropy`).", "[2, 1024]"),
    "detectors.weight_health.hist_min_log2": KeyDoc("Lower edge of the histogram's bins, log2|g|; smaller values "
                                                    "(zeros too) count in the first bin.", "< hist_max_log2"),
    "detectors.weight_health.hist_max_log2": KeyDoc("Upper edge of the histogram's bins, log2|g|; larger values "
                                                    "count in the last bin.", "> hist_min_log2"),
    "detectors.weight_health.norm_weight": KeyDoc("Weight of NormScore (the fraction of matrices with a healthy "
                                                  "norm) in the score.", ">= 0 (the three weights sum > 0)"),
    "detectors.weight_health.rank_weight": KeyDoc("Weight of RankScore (mean of min(1, rank / first rank)) in the "
                                                  "score.", ">= 0"),
    "detectors.weight_health.sparsity_weight": KeyDoc("Weight of SparsityScore (mean of 1 − sparsity rise / "
                                                      "`sparsity_increase`, clipped to [0, 1]) in the score.", ">= 0"),
    "detectors.weight_health.score_min": KeyDoc("Alarm when the weight-health score (in [0, 1]) falls below this; "
                                                "0: off.", "[0, 1]"),
    "detectors.weight_health.action": KeyDoc("What a weight alarm (explosion, collapse, sparsity, rank drop, "
                                             "score) gets; the paper rolls back on a low score."),
    "detectors.weight_health.grad_action": KeyDoc("What a gradient-CV alarm gets."),
    "detectors.dynamics.enabled": KeyDoc("Training dynamics (ARC paper §3.4): the parameter velocity, the online "
                                         "Lyapunov estimate, the phase and an FFT oscillation check "
                                         "([detectors.md](detectors.md#training-dynamics)). Each rank keeps a copy "
                                         "of its part of the parameters (1/N of the model under DDP)."),
    "detectors.dynamics.every": KeyDoc("Optimizer steps between velocity measurements (v = ‖θ_t − θ_{t−every}‖).",
                                       ">= 1, a multiple of `stats.interval`"),
    "detectors.dynamics.lyapunov_window": KeyDoc("Velocities whose mean log-ratio is the Lyapunov estimate "
                                                 "(Algorithm 4's window).", ">= 3"),
    "detectors.dynamics.window": KeyDoc("Velocities kept; the oscillation check's FFT window.",
                                        ">= 4 and >= `lyapunov_window`"),
    "detectors.dynamics.ema": KeyDoc("Smoothing of the Lyapunov estimate: λ̄ ← ema λ̂ + (1 − ema) λ̄.", "in (0, 1]"),
    "detectors.dynamics.divergent": KeyDoc("λ̄ (per optimizer step) above this: divergent, a failure that gets "
                                           "`action` (the paper rolls back).", "> `warning`"),
    "detectors.dynamics.warning": KeyDoc("λ̄ above this: unstable, a warning; below minus this: convergent.",
                                         "> 0"),
    "detectors.dynamics.marginal": KeyDoc("|λ̄| below this: marginal, and the velocity window is checked for an "
                                          "oscillation.", "in (0, `warning`]"),
    "detectors.dynamics.oscillation_factor": KeyDoc("An oscillation: the largest FFT power of the velocity window "
                                                    "(its mean removed) above this many times the mean power (the "
                                                    "paper's 2 fires on white noise).", "> 1"),
    "detectors.dynamics.warmup_measurements": KeyDoc("Velocities before a phase is reported.", ">= 3"),
    "detectors.dynamics.stabilize": KeyDoc("Opt-in (§3.4.6): while λ̄ > `marginal`, scale each monitored step's "
                                           "gradient to g S + (1 − S) clip(g, c), S = exp(−λ̄), on every rank "
                                           "alike."),
    "detectors.dynamics.stabilize_strength": KeyDoc("The stabilisation's intervention strength: the clip norm c = "
                                                    "(1 − strength) + strength e^{−λ̄}.", "in [0, 1]"),
    "detectors.dynamics.attractor_sketch": KeyDoc("Numbers in the random-sign sketch of each displacement (in the "
                                                  "step's one all-reduce) from which the trajectory's positions "
                                                  "are tracked; 0: no attractor detection.", ">= 0"),
    "detectors.dynamics.attractor_ratio": KeyDoc("An attractor (§3.4.5): over the last `window` positions, the "
                                                 "largest distance from their centroid below this times the path "
                                                 "length walked; 0: off.", "in [0, 1)"),
    "detectors.dynamics.attractor_radius": KeyDoc("An attractor: that largest distance below this (parameter-space "
                                                  "units, the paper's τ_attractor); 0: off.", ">= 0"),
    "detectors.dynamics.attractor_steps": KeyDoc("Consecutive measurements inside the attractor rule before it is "
                                                 "reported (an info event).", ">= 1"),
    "detectors.dynamics.action": KeyDoc("What a divergent trajectory gets."),
    "detectors.dynamics.oscillation_action": KeyDoc("What an oscillation gets."),
    "diagnostics.curvature.every": KeyDoc("Optimizer steps between curvature measurements when the training loop "
                                          "asks `arc.curvature_due()`; 0: on demand only "
                                          "([diagnostics.md](diagnostics.md)).", ">= 0"),
    "diagnostics.curvature.probes": KeyDoc("Rademacher vectors of the Hutchinson trace estimate (one "
                                           "Hessian-vector product each).", ">= 1"),
    "diagnostics.curvature.power_iterations": KeyDoc("Power-iteration steps for the largest Hessian eigenvalue (one "
                                                     "Hessian-vector product each).", ">= 1"),
    "diagnostics.curvature.sam_rho": KeyDoc("SAM radius: sharpness = L(θ + ρ g/‖g‖) − L(θ); 0: not measured.",
                                            ">= 0"),
    "diagnostics.curvature.seed": KeyDoc("Seed of the probe vectors (with the step: the same on every rank).",
                                         "any integer"),
    "detectors.conformal.enabled": KeyDoc("Conformal loss-forecast intervals with calibrated coverage (ARC paper "
                                          "§3.5; [detectors.md](detectors.md#conformal-loss-intervals))."),
    "detectors.conformal.alpha": KeyDoc("Miscoverage of the warning interval (1 − alpha of the losses inside).",
                                        "in (0, 1)"),
    "detectors.conformal.failure_alpha": KeyDoc("Miscoverage of the failure interval: a loss above it is a "
                                                "failure.", "in (0, `alpha`)"),
    "detectors.conformal.window": KeyDoc("Scores of accepted steps kept as the calibration set.",
                                         ">= `min_calibration`"),
    "detectors.conformal.min_calibration": KeyDoc("Scores before any verdict.",
                                                  ">= ⌈(1 − failure_alpha) / failure_alpha⌉"),
    "detectors.conformal.level_rate": KeyDoc("The forecast's level smoothing (Holt).", "in (0, 1]"),
    "detectors.conformal.trend_rate": KeyDoc("The forecast's trend smoothing (Holt; 0: no trend).", "in [0, 1]"),
    "detectors.conformal.coverage_window": KeyDoc("Steps over which the warning interval's coverage is measured.",
                                                  ">= 10"),
    "detectors.conformal.coverage_tolerance": KeyDoc("Coverage below 1 − alpha − this recalibrates on the newest "
                                                     "half of the scores.", "in [0, 1)"),
    "detectors.conformal.explosion_loss": KeyDoc("A forecast upper bound above this loss warns ahead (a "
                                                 "preventive checkpoint is advised); 0: off.", ">= 0"),
    "detectors.conformal.signals": KeyDoc("The scalar signals that get conformal intervals: `loss` (the agreed "
                                          "mean loss) and `grad_norm` (the agreed pre-clip global gradient norm, "
                                          "judged in log space; its forecast warns ahead of "
                                          "`detectors.grad_norm.explosion_threshold`). Metrics of a signal other "
                                          "than the loss carry its name as a prefix.", "a list of loss, grad_norm"),
    "detectors.conformal.action": KeyDoc("What a loss above its failure interval gets."),
    "detectors.conformal.forecast_action": KeyDoc("What the forecast's bound crossing `explosion_loss` gets "
                                                  "(`checkpoint`: a preventive checkpoint)."),
    "detectors.fisher.enabled": KeyDoc("Fisher-aware recovery (ARC paper §3.3, §3.6; [detectors.md](detectors.md"
                                       "#fisher-aware-recovery)): a diagonal Fisher estimate of each rank's own "
                                       "part, the Fisher-Rao drift from the last verified state, the Fisher's "
                                       "effective rank. Memory: 8 bytes per element of the rank's own part (DDP: "
                                       "the whole replica)."),
    "detectors.fisher.every": KeyDoc("Applied optimizer steps between Fisher updates (and its statistics).",
                                     ">= 1, a multiple of `stats.interval`"),
    "detectors.fisher.decay": KeyDoc("F ← decay g² + (1 − decay) F (the first update sets F = g²).", "in (0, 1]"),
    "detectors.fisher.warmup_measurements": KeyDoc("Measurements before any verdict.", ">= 1"),
    "detectors.fisher.window": KeyDoc("Healthy Fisher-Rao distances kept; their median scales `drift_factor`.",
                                      ">= 3"),
    "detectors.fisher.drift_threshold": KeyDoc("A Fisher-Rao distance from the last verified-stable state above "
                                               "this gets `drift_action`; 0: off.", ">= 0"),
    "detectors.fisher.drift_factor": KeyDoc("A Fisher-Rao distance above this times the median of the healthy "
                                            "ones gets `drift_action`; 0: off.", "0 or > 1"),
    "detectors.fisher.drift_action": KeyDoc("What a Fisher-Rao drift gets (a preventive checkpoint: the next "
                                            "verified snapshot goes to disk and becomes the new reference)."),
    "detectors.fisher.min_rank_fraction": KeyDoc("The Fisher's effective rank below this fraction of the "
                                                 "parameters: a warning; 0: off.", "in [0, 1)"),
    "detectors.fisher.importance_rollback": KeyDoc("A rollback keeps θ = β θ_ckpt + (1 − β) θ_now, β = "
                                                   "sigmoid(sharpness (F / F̄ − 1)): the important parameters "
                                                   "restored, the others kept. Needs `recovery.enabled`."),
    "detectors.fisher.sharpness": KeyDoc("The importance weights' sharpness (the paper's λ times F̄).", "> 0"),
    "detectors.fisher.ewc_strength": KeyDoc("λ₀ of the EWC penalty (λ_t / 2) Σ F (θ − θ*)² added after a rollback "
                                            "(its gradient, inside the optimizer step); 0: off. Needs "
                                            "`recovery.enabled`.", ">= 0"),
    "detectors.fisher.ewc_decay_steps": KeyDoc("λ_t = λ₀ exp(−t / this), t the applied steps since the rollback.",
                                               "> 0"),
    "detectors.fisher.ewc_steps": KeyDoc("Applied steps the EWC penalty lasts after a rollback.", ">= 1"),
    "detectors.straggler.enabled": KeyDoc("Per-rank straggler scores from each rank's forward-section time "
                                          "(first forward pre-hook to first recorded loss), as "
                                          "nvidia-resiliency-ext scores them ([detectors.md](detectors.md))."),
    "detectors.straggler.every": KeyDoc("Monitored steps per report: every rank scores its window medians "
                                        "against its stage's fastest (fixed-size reductions on that step only, "
                                        "no per-rank gather).", ">= 3"),
    "detectors.straggler.relative_threshold": KeyDoc("A rank whose fastest-rank-median / own-median (forward or "
                                                     "compute, among the ranks of its pipeline stage) falls below "
                                                     "this is a straggler.", "in (0, 1)"),
    "detectors.straggler.individual_threshold": KeyDoc("A rank whose best-median-so-far / current median falls "
                                                       "below this is a straggler (it slowed down); 0: off.",
                                                       "in [0, 1)"),
    "detectors.straggler.min_delay_s": KeyDoc("A straggler is also at least this many seconds slower than its "
                                              "reference (timer noise of fast steps never flags).", ">= 0"),
    "detectors.straggler.warmup_reports": KeyDoc("Reports before ranks can be flagged (the first steps compile "
                                                 "and warm caches).", ">= 0"),
    "detectors.straggler.compute_every": KeyDoc("Monitored steps between samples of each rank's local compute "
                                                "time (modules without a collective; tells a slow "
                                                "tensor/pipeline-parallel peer from the peers that wait for it); "
                                                "0: off.", ">= 0"),
    "detectors.straggler.compute_modules": KeyDoc("At most this many leaf modules are timed on a sampled step "
                                                  "(spread evenly over the model).", ">= 1"),
    "detectors.straggler.action": KeyDoc("What a new straggler gets (the event names the ranks)."),
    "detectors.r_metric.enabled": KeyDoc("The R-Metric early warning: system events λ, worker gradient-norm "
                                         "variance σ², loss drift ΔL, each percentile-normalized "
                                         "([detectors.md](detectors.md))."),
    "detectors.r_metric.lambda_weight": KeyDoc("Weight of norm(λ).", ">= 0"),
    "detectors.r_metric.variance_weight": KeyDoc("Weight of norm(σ²).", ">= 0"),
    "detectors.r_metric.drift_weight": KeyDoc("Weight of norm(ΔL).", ">= 0 (not all three 0)"),
    "detectors.r_metric.threshold": KeyDoc("Alert level of the score.", "> 0"),
    "detectors.r_metric.score": KeyDoc("`normalized`: the weighted sum divided by the weights' sum (0.5 when "
                                       "nothing moves); `paper`: the weighted sum itself, as written (alerts on "
                                       "most steps of a stationary run with the default weights)."),
    "detectors.r_metric.window": KeyDoc("Previous values each percentile rank is taken among.", ">= 2"),
    "detectors.r_metric.ema": KeyDoc("Smoothing of the percentile: s = ema * p + (1 - ema) * s.", "in (0, 1]"),
    "detectors.r_metric.gain": KeyDoc("Slope of the sigmoid: norm = 1 / (1 + exp(-gain * (s - 0.5))).", "> 0"),
    "detectors.r_metric.drift_window": KeyDoc("Previous losses whose mean ΔL is measured from.", ">= 1"),
    "detectors.r_metric.variance_relative": KeyDoc("σ² read as log σ² minus the median log σ² of the previous "
                                                   "`window` values (the ranks' spread grows over a healthy run, "
                                                   "which a percentile against the raw history reads as a warning); "
                                                   "false: the paper's raw σ²."),
    "detectors.r_metric.event_window": KeyDoc("Monitored steps λ counts system events over.", ">= 1"),
    "detectors.r_metric.warmup_steps": KeyDoc("Applied monitored steps before an alert can fire.", ">= 1"),
    "detectors.r_metric.persist": KeyDoc("Monitored steps the alert looks back over (one alert per episode).",
                                         ">= 1"),
    "detectors.r_metric.persist_fraction": KeyDoc("Share of those steps whose score must be above the threshold "
                                                  "(this step's too); 1: every one of them.", "in (0, 1]"),
    "detectors.r_metric.nvml": KeyDoc("Count NVML ECC, XID and clock-slowdown events of the rank's GPU when "
                                      "`nvidia-ml-py` is installed and the statistics live on CUDA (polled every "
                                      "10 monitored steps)."),
    "detectors.r_metric.action": KeyDoc("What an alert gets."),
    "policy.max_consecutive_skips": KeyDoc("More skipped steps in a row than this escalate: the fault is "
                                           "persistent.", ">= 0"),
    "policy.max_consecutive_data_skips": KeyDoc("More steps in a row than this skipped for bad data (a "
                                                "`detectors.data` finding, a data-ledger position) escalate: the bad "
                                                "data does not end; they do not count towards "
                                                "`max_consecutive_skips`.", ">= 0"),
    "policy.max_consecutive_overflow_skips": KeyDoc("More steps in a row than this that a dynamic loss scaler "
                                                    "skipped itself (fp16 overflow at a finite loss) escalate; "
                                                    "they do not count towards `max_consecutive_skips`.", ">= 0"),
    "policy.mode": KeyDoc("`act`: carry the decisions out; `observe`: detect, report and alert only (never skip, "
                          "roll back, recompute, abort or end a rank; refuses `recovery.enabled` and "
                          "`detectors.sdc.recompute.enabled`)."),
    "policy.on_persistent_failure": KeyDoc("What escalation does; `rollback` needs `recovery.enabled`, else it "
                                           "aborts (exit code 3)."),
    # sinks
    "sinks.console.enabled": KeyDoc("Print events to the console."),
    "sinks.console.min_severity": KeyDoc("Lowest severity printed."),
    "sinks.console.color": KeyDoc("ANSI colours: `auto` when the output is a terminal."),
    "sinks.jsonl.enabled": KeyDoc("Append events and metrics as JSON lines in the run directory."),
    "sinks.jsonl.events_file": KeyDoc("File name of the event log.", "a plain file name"),
    "sinks.jsonl.metrics_file": KeyDoc("File name of the metrics log.", "a plain file name"),
    "sinks.jsonl.ranks_file": KeyDoc("File name of the per-rank statistics (the report's per-rank panels).",
                                     "a plain file name"),
    "sinks.jsonl.ranks_max": KeyDoc("Per statistic, the values of at most this many ranks: all in a group no "
                                    "larger, else those farthest from the median.", "an integer >= 1"),
    "sinks.wandb.enabled": KeyDoc("Alerts and `arc/` metrics to Weights & Biases, from one rank."),
    "sinks.wandb.project": KeyDoc("Project of the run arc_engine starts when none is active.", "a non-empty name"),
    "sinks.wandb.entity": KeyDoc("Entity of that run (null: wandb's default)."),
    "sinks.wandb.name": KeyDoc("Display name of that run (null: the arc run id)."),
    "sinks.wandb.group": KeyDoc("W&B group of that run."),
    "sinks.wandb.mode": KeyDoc("W&B mode of that run (null: wandb's default or `WANDB_MODE`)."),
    "sinks.wandb.dir": KeyDoc("Where that run's files go (null: the arc run directory)."),
    "sinks.wandb.reuse_run": KeyDoc("Log into a W&B run already active in the job (on whichever rank holds it)."),
    "sinks.wandb.alert_min_severity": KeyDoc("Events at or above it become W&B alerts."),
    "sinks.wandb.alert_wait_s": KeyDoc("Seconds during which repeats of an alert (same detector and ranks) are "
                                       "counted, not sent; also W&B's `wait_duration`.", ">= 0"),
    "sinks.wandb.queue_size": KeyDoc("Bounded queue to the W&B thread; overflow is dropped and counted.", ">= 1"),
    "sinks.wandb.init_timeout_s": KeyDoc("Bound on `wandb.init`.", "> 0"),
    "sinks.wandb.close_timeout_s": KeyDoc("Bound on the flush at close.", "> 0"),
    "sinks.metrics_interval": KeyDoc("Send the monitors' metrics to the sinks every k monitored steps (0: never).",
                                     ">= 0"),
    "sinks.all_ranks": KeyDoc("Every rank writes its own console and JSONL sinks (files get a `.rank<N>` "
                              "suffix); W&B stays on one rank."),
    # faults
    "faults.injections": KeyDoc("Faults to inject, for tests and demos only; each entry is a fault spec (the "
                                "`faults.injections[]` keys below)."),
    f"{FAULT_PREFIX}.kind": KeyDoc("What to inject (see [faults.md](faults.md))."),
    f"{FAULT_PREFIX}.rank": KeyDoc("Global rank to inject on; -1: every rank.", ">= -1"),
    f"{FAULT_PREFIX}.step": KeyDoc("Step attempt (0-based; keeps counting through rollbacks) at which it starts.",
                                   ">= 0"),
    f"{FAULT_PREFIX}.steps": KeyDoc("Consecutive steps it lasts (1: transient).", ">= 1"),
    f"{FAULT_PREFIX}.param": KeyDoc("`nan_grad` / `inf_grad`: the parameter (a `named_parameters()` name; null: "
                                    "the first)."),
    f"{FAULT_PREFIX}.scale": KeyDoc("`loss_scale` / `lr_scale`: the factor; `router_collapse`: what is added to "
                                    "the chosen expert's logit; `grad_scale` / `weight_corruption`: the factor on "
                                    "the chosen gradient / weight elements; `optimizer_state`: the factor on the "
                                    "optimizer state; `collective_corruption`: the factor on the reduced "
                                    "gradient.", "any number"),
    f"{FAULT_PREFIX}.pattern": KeyDoc("`bitflip`: fnmatch pattern on the names of the `nn.Linear` modules (and "
                                      "megatron-core's parallel linears) to corrupt; `attention_lowbit` / "
                                      "`router_collapse` / `dead_expert`: on the "
                                      "attention (default `*core_attention`) or router (default `*router`) "
                                      "modules; `grad_scale` / `weight_corruption`: on the `named_parameters()` "
                                      "names (default: every parameter).", "required for `bitflip`"),
    f"{FAULT_PREFIX}.where": KeyDoc("`bitflip`: the GEMM output corrupted: forward output, backward-data output "
                                    "(the layer input's gradient) or weight gradient."),
    f"{FAULT_PREFIX}.bit": KeyDoc("`bitflip`: the bit to flip (null: the dtype's default exponent bit); "
                                  "`optimizer_state` / `collective_corruption`: flip this bit in `count` elements "
                                  "of one stepped tensor instead of scaling (null: scale).", "[0, 31] or null"),
    f"{FAULT_PREFIX}.count": KeyDoc("`bitflip`, and `optimizer_state` / `collective_corruption` with `bit`: elements "
                                    "flipped per hit (with neither `count` nor `rate`: one); "
                                    "`hardware_events`: system events per step attempt (null: one).",
                                    ">= 1 or null; not with `rate` for `bitflip`"),
    f"{FAULT_PREFIX}.rate": KeyDoc("`bitflip`: probability that each element is flipped; `grad_scale` / "
                                   "`weight_corruption`: fraction of the elements changed (null: all); "
                                   "`data_corruption`: fraction of the token ids replaced (null: 0.3); "
                                   "`collective_corruption`: probability that a step in the window is corrupted "
                                   "(null: 1).", "(0, 1] or null; not with `count` for `bitflip`"),
    f"{FAULT_PREFIX}.persistent": KeyDoc("`bitflip`: fire on every call from `step` on, recomputations included (a "
                                         "faulty device); else once per step, on the first GEMM. Mechanism and "
                                         "state faults: active on every step from `step` on."),
    f"{FAULT_PREFIX}.seed": KeyDoc("`bitflip` and the state faults: seed of their random choices (mixed with the "
                                   "step).", "any integer"),
    f"{FAULT_PREFIX}.seconds": KeyDoc("`stall`: how long the rank sleeps at the step's first forward.",
                                      "> 0 for `stall`"),
    f"{FAULT_PREFIX}.bits": KeyDoc("`attention_lowbit`: the lowest bits of each BF16 word of the attention output "
                                   "and its gradient that are zeroed (a biased rounding toward zero).", "[1, 7]"),
    f"{FAULT_PREFIX}.expert": KeyDoc("`router_collapse`: the expert whose logit gets `scale` added; `dead_expert`: "
                                     "the expert that receives no token.", ">= 0, below the number of experts"),
    f"{FAULT_PREFIX}.noise": KeyDoc("`grad_scale` / `weight_corruption`: standard deviation of the Gaussian noise "
                                    "added to the chosen elements, in multiples of the tensor's RMS.", ">= 0"),
    f"{FAULT_PREFIX}.state_key": KeyDoc("`optimizer_state`: the optimizer state tensor multiplied by `scale` "
                                        "(Adam's first or second moment)."),
    f"{FAULT_PREFIX}.megabytes": KeyDoc("`memory_leak`: MiB allocated and kept on the model's device per step "
                                        "attempt.", "> 0, finite"),
    # recovery
    "recovery.enabled": KeyDoc("The ARC loop: verified-stable snapshots, rollback, heal, escape, resume."),
    "recovery.checkpoint_freq": KeyDoc("Healthy steps between snapshots; a snapshot becomes verified-stable when "
                                       "the next step is healthy.", ">= 1"),
    "recovery.memory_ring_mb": KeyDoc("Host memory per rank for verified-stable snapshots (0: disk tier only; "
                                      "unset: room for two snapshots of the largest rank, within a quarter of "
                                      "the host's memory shared by its ranks). A state that does not fit is a "
                                      "`memory_ring_off` warning event.", ">= 0, or unset"),
    "recovery.lr_reduction_factor": KeyDoc("Learning rate x this factor per rollback (compounding).", "(0, 1]"),
    "recovery.lr_recovery_steps": KeyDoc("Healthy steps over which the learning rate returns linearly to the "
                                         "schedule; also the length of a recovery episode.", ">= 1"),
    "recovery.skip_data": KeyDoc("`window`: resume the data after the failed batch; `none`: replay the same "
                                 "batches; `stream`: the loader cannot seek, training goes on with its next "
                                 "batches (escapes skip none)."),
    "recovery.heal_clip_grad_norm": KeyDoc("While healing, also scale gradients to at most this global norm "
                                           "(null: no extra clipping).", "> 0 or null"),
    "recovery.max_consecutive_rollbacks": KeyDoc("Rollbacks without a new verified-stable state before the next "
                                                 "failure escapes instead.", ">= 1"),
    "recovery.perturbation_scale": KeyDoc("Escape: Gaussian noise of this many times each parameter's RMS on the "
                                          "restored weights.", ">= 0"),
    "recovery.rollback": KeyDoc("`in_process`: restore the state in the running job; `relaunch`: stop every rank "
                                "(exit code 7) and write `relaunch.json` (the checkpoint to load, the batches to "
                                "skip) for loops that own the iteration counter (Megatron-LM's `pretrain()`)."),
    "recovery.skip_ahead_steps": KeyDoc("Escape: batches skipped.", ">= 0"),
    "recovery.max_escapes": KeyDoc("Escapes in one recovery episode before training stops with exit code 4.",
                                   ">= 0"),
    "recovery.seed": KeyDoc("Seed of the escape noise (the same on every replica).", "any integer"),
    "recovery.checkpoint.enabled": KeyDoc("The disk tier: sharded async checkpoints of verified-stable states."),
    "recovery.checkpoint.dir": KeyDoc("Checkpoint directory, on a filesystem every rank sees (null: "
                                      "`<run_dir>/<run_id>/checkpoints`).", "a non-empty path or null"),
    "recovery.checkpoint.every_steps": KeyDoc("Save a verified-stable state at least this many steps after the "
                                              "previous save (0: never).", ">= 0"),
    "recovery.checkpoint.keep_last": KeyDoc("Committed checkpoints kept, besides pinned ones.", ">= 1"),
    "recovery.checkpoint.commit_timeout_s": KeyDoc("Bound on waiting for every rank's shard before a save is "
                                                   "declared failed.", "> 0"),
    "recovery.checkpoint.resume": KeyDoc("At attach, load the newest committed checkpoint if there is one."),
    "recovery.checkpoint.format": KeyDoc("Files inside a checkpoint: `auto` (the framework's own where arc_engine "
                                         "writes it: megatron-core `dist_checkpointing`; else DCP), `dcp` "
                                         "(arc_engine's DCP layout), `megatron`."),
    "recovery.checkpoint.on_error": KeyDoc("A checkpoint directory that is not writable at attach: `raise` (every "
                                           "rank exits with code 2 after one line) or `continue` (an error event, "
                                           "no disk tier for the run)."),
    # watchdog
    "watchdog.enabled": KeyDoc("A thread per rank that reports a hang when no step completes in time."),
    "watchdog.warmup_steps": KeyDoc("Completed steps before the timeout is derived from step times.", ">= 1"),
    "watchdog.initial_timeout_s": KeyDoc("The timeout until then (compilation, communicator set-up).", "> 0"),
    "watchdog.safety_factor": KeyDoc("Timeout = this factor x the longest step since the warm-up, clamped.", ">= 1"),
    "watchdog.min_timeout_s": KeyDoc("Lower clamp of the derived timeout.", "> 0"),
    "watchdog.max_timeout_s": KeyDoc("Upper clamp of the derived timeout.", ">= `min_timeout_s`"),
    "watchdog.dump_stacks": KeyDoc("On a hang, write every thread's Python stack to "
                                   "`<run_dir>/<run_id>/stacks/rank<N>-iter<I>.txt`."),
    "watchdog.action": KeyDoc("`alert`: report the hang only; `abort`: after `abort_after` timeouts in a row, exit "
                              "with code 6 (every rank's own watchdog does)."),
    "watchdog.abort_after": KeyDoc("Timeouts in a row without a completed step before `abort` ends the process.",
                                   ">= 1"),
}

# The manual page of each section (relative to docs/); a subsection without an entry takes its parent's.
SECTION_PAGES: dict[str, str] = {
    "run": "events.md",
    "stats": "architecture.md",
    "detectors": "detectors.md",
    "detectors.sdc": "sdc.md",
    "policy": "detectors.md",
    "sinks": "events.md",
    "sinks.wandb": "wandb.md",
    "faults": "faults.md",
    "recovery": "recovery.md",
    "watchdog": "watchdog.md",
}

INTRO = f"""\
<!-- Generated from arc_engine/config/schema.py by `{REGENERATE}`. Do not edit by hand: \
tests/test_docs.py fails when this page is stale. -->

# Configuration reference

One typed tree of dataclasses (`arc_engine/config/schema.py`), loaded from YAML with `--arc-config PATH`.
Precedence, later wins: the schema's defaults < the file < `--arc.<key>=VALUE` overrides. Override values are
parsed as YAML, so `--arc.faults.injections='[{{kind: nan_loss, rank: 0, step: 5}}]'` works. Environment
variables set nothing but the run id: `arc_engine/runtime.py`, the one place that reads the environment, takes it
from `TORCHELASTIC_RUN_ID` when `run.run_id` is null (a config value wins) and names devices by `LOCAL_RANK`; W&B
reads its own variables (`WANDB_MODE`, `WANDB_API_KEY`, ...). Unknown keys, wrong types
and out-of-range values are errors that name the file, the key, the value and what is allowed (exit code 2):

```
$ arc-engine validate-config bad.yaml
arc_engine: invalid config: bad.yaml: detectors.loss_spike.factr = 3: unknown key (did you mean `factor`?); \
allowed keys here: action, enabled, factor, min_relative_increase, warmup_steps, window
$ echo $?
2
$ python train.py --arc.detectors.loss_spike.factr=3      # a training script with arc_engine.add_arc_args
arc_engine: invalid config: --arc.detectors.loss_spike.factr: unknown key (did you mean \
`detectors.loss_spike.factor`?); `arc-engine show-config` lists every key
```

`arc-engine show-config [--arc-config F] [--arc.key=value ...]` prints the effective configuration;
`python -m arc_engine ...` is the same command line as `arc-engine ...`. Shipped,
commented examples: [`configs/default.yaml`](../configs/default.yaml) (every key at its default),
[`configs/demo.yaml`](../configs/demo.yaml), [`configs/monitoring_only.yaml`](../configs/monitoring_only.yaml)
(report only, never intervene), [`configs/aggressive_recovery.yaml`](../configs/aggressive_recovery.yaml) (tight
thresholds, short fuse).

Actions (`action` keys): `warn` reports and applies the step; `checkpoint` applies it and takes a preventive
checkpoint (a snapshot at the next step, saved to disk when verified; a warning without `recovery.enabled`); `skip`
applies nothing on any rank; `rollback`
returns every rank to the newest verified-stable state and heals (needs `recovery.enabled`, else it aborts);
`abort` stops every rank with exit code 3 ([events.md](events.md)).
"""


class SchemaKey(NamedTuple):
    key: str
    type_text: str
    default: str
    allowed: str
    text: str


def _origin_args(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    origin = get_origin(hint)
    if origin is types.UnionType:
        origin = typing.Union
    return origin, get_args(hint)


def _without_none(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    origin, args = _origin_args(hint)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        assert len(rest) == 1, f"unsupported union {hint}"
        return rest[0], True
    return hint, False


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def _describe_type(hint: Any) -> tuple[str, str | None]:
    """(type text, allowed values when the type itself says them)."""
    inner, nullable = _without_none(hint)
    suffix = " or null" if nullable else ""
    origin, args = _origin_args(inner)
    if origin is Literal:
        choices = ", ".join(f"`{a}`" for a in args) + (", null" if nullable else "")
        return "choice" + suffix, choices
    if inner is bool:
        return "bool" + suffix, "`true`, `false`"
    if origin is list:
        (item,) = args
        return f"list of {item.__name__}", None
    return inner.__name__ + suffix, None


def _sections(cls: type, prefix: str, instance: Any) -> list[tuple[str, type, list[SchemaKey]]]:
    """One ``(dotted prefix, dataclass, rows)`` per dataclass of the tree, depth first, parents before children."""
    rows: list[SchemaKey] = []
    children: list[tuple[str, type, list[SchemaKey]]] = []
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        hint = hints[field.name]
        if field.metadata.get("plugin_sections"):  # no key of its own: each plugin family reads <prefix>.<name>
            rows.append(_plugin_row(f"{prefix}.<family>"))
        elif dataclasses.is_dataclass(hint):
            children += _sections(hint, key, getattr(instance, field.name))
        else:
            rows.append(_row(key, hint, getattr(instance, field.name)))
    own = [(prefix, cls, rows)] if prefix else []
    if cls is FaultsConfig:
        fault_hints = get_type_hints(FaultSpec)
        own.append((FAULT_PREFIX, FaultSpec, [_row(f"{FAULT_PREFIX}.{f.name}", fault_hints[f.name], f)
                                              for f in dataclasses.fields(FaultSpec)]))
    return own + children


def _row(key: str, hint: Any, value: Any) -> SchemaKey:
    doc = KEY_DOCS.get(key)
    if doc is None:
        raise RuntimeError(f"configuration key {key!r} has no description: add it to KEY_DOCS in "
                           f"arc_engine/config/reference.py, then run `{REGENERATE}`")
    type_text, derived = _describe_type(hint)
    if derived is not None and doc.allowed is not None:
        raise RuntimeError(f"KEY_DOCS[{key!r}].allowed repeats what the type says ({derived}): remove it")
    numeric = _without_none(hint)[0] in (int, float)
    if numeric and doc.allowed is None:
        raise RuntimeError(f"KEY_DOCS[{key!r}] needs `allowed`: the range that __post_init__ checks")
    if isinstance(value, dataclasses.Field):  # a fault spec's field: no instance to read
        has_default = value.default is not dataclasses.MISSING
        default = f"`{_yaml_value(value.default)}`" if has_default else "required"
    else:
        default = f"`{_yaml_value(value)}`"
    return SchemaKey(key, type_text, default, derived or doc.allowed or "any", doc.text)


def _plugin_row(key: str) -> SchemaKey:
    doc = KEY_DOCS.get(key)
    if doc is None:
        raise RuntimeError(f"plugin sections {key!r} have no description: add it to KEY_DOCS in "
                           f"arc_engine/config/reference.py, then run `{REGENERATE}`")
    return SchemaKey(key, "mapping", "none", doc.allowed or "any", doc.text)


def _section_intro(cls: type) -> str:
    """The first sentence of the class docstring, as Markdown (empty when there is none)."""
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = paragraph.find(". ")
    sentence = paragraph if end < 0 else paragraph[: end + 1]
    return sentence.replace("``", "`")


def _table(rows: list[SchemaKey]) -> list[str]:
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    lines += [f"| `{r.key}` | {r.type_text} | {r.default} | {r.allowed} | {r.text} |" for r in rows]
    return lines


def _section(title: str, cls: type, rows: list[SchemaKey]) -> list[str]:
    lines = [f"## `{title}`", ""]
    intro = _section_intro(cls)
    prefix = title.removesuffix("[]")
    while prefix not in SECTION_PAGES and "." in prefix:
        prefix = prefix.rsplit(".", 1)[0]
    page = SECTION_PAGES.get(prefix)
    if page:
        intro = f"{intro} Manual: [{page}]({page}).".strip()
    if intro:
        lines += [intro, ""]
    return [*lines, *_table(rows), ""]


def render() -> str:
    """The whole page. Raises RuntimeError when a key lacks a description or a description names no key."""
    sections = _sections(ArcConfig, "", ArcConfig())
    stale = sorted(set(KEY_DOCS) - {row.key for _, _, rows in sections for row in rows})
    if stale:
        raise RuntimeError(f"KEY_DOCS in arc_engine/config/reference.py describes keys the schema does not have: "
                           f"{stale}")
    lines = [INTRO]
    for title, cls, rows in sections:
        if rows:
            lines += _section(title, cls, rows)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
