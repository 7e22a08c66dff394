"""Names of the standard statistic slots shared by producers (integrations) and consumers (monitors).

``G`` below is the number of optimizer parameter groups. The kind after the size is how the slot combines across
the decision group (:class:`arc_engine.stats.layout.Reduce`).
"""

from arc_engine.stats.layout import Reduce

#: [1] SUM: the rank's loss for the step (mean over its recorded micro-batches; 0 when it recorded none).
LOSS = "loss"
#: [1] SUM: micro-batch losses recorded this step (per rank: 0 means no loss recorded).
LOSS_COUNT = "loss_count"
#: [1] SUM: ranks that recorded a loss this step (per rank: 0 or 1); LOSS / LOSS_RANKS is the mean loss.
LOSS_RANKS = "loss_ranks"
#: [G] DETAIL: squared L2 norm of the rank's local gradient per group, before the gradient reduction.
GRAD_SQ_LOCAL = "grad_sq_local"
#: [G] SUM: number of parameter tensors whose local gradient holds NaN/Inf, per group.
GRAD_NONFINITE_LOCAL = "grad_nonfinite_local"
#: [G] SUM (a shard's part, or a replicated parameter's on its owner) or REPLICATED: squared L2 norm of the reduced
#: gradient per group, before clipping.
GRAD_SQ = "grad_sq"
#: [G] SUM or REPLICATED (as GRAD_SQ): squared L2 norm of the weights per group (before this step's update).
WEIGHT_SQ = "weight_sq"
#: [G] SUM or REPLICATED: Σ U² of the Adam update about to be applied, U = m̂/(√v̂+ε) (SDC paper).
UPDATE_SQ = "update_sq"
#: [G] SUM or REPLICATED: number of elements behind UPDATE_SQ (RMS = sqrt(UPDATE_SQ / UPDATE_COUNT)).
UPDATE_COUNT = "update_count"
#: [K] DETAIL: signed block-sum sketch of the rank's local gradient before the reduction (SDC localization).
GRAD_SKETCH_LOCAL = "grad_sketch_local"
#: [1] SUM: number of local gradient slots the rank withheld from the reduction (SDC recomputation).
SDC_WITHHELD = "sdc_withheld"
#: [1] DETAIL: the rank's local gradient norm at its previous applied monitored step (SDC localization), written by
#: the SDC monitor itself before the reduction.
SDC_LOCAL_NORM_PREV = "sdc_local_norm_prev"

#: The slots that describe the reduced gradient and the update (rewritten after an SDC correction).
REDUCED_GRADIENT_SLOTS = (GRAD_SQ, WEIGHT_SQ, UPDATE_SQ, UPDATE_COUNT)


def adapter_statistics(num_groups: int, shard_reduce: Reduce) -> list[tuple[str, int, Reduce]]:
    """The slots every adapter (DDP, FSDP2, DeepSpeed, ...) fills on a monitored step, whatever families are on:
    the loss, the local gradient's norms and non-finite counts, the reduced gradient's norms. ``shard_reduce``: how
    the adapter's reduced-gradient parts combine (SUM of shards or owned parts, or REPLICATED)."""
    return [(LOSS, 1, Reduce.SUM), (LOSS_COUNT, 1, Reduce.SUM), (LOSS_RANKS, 1, Reduce.SUM),
            (GRAD_SQ_LOCAL, num_groups, Reduce.DETAIL), (GRAD_NONFINITE_LOCAL, num_groups, Reduce.SUM),
            (GRAD_SQ, num_groups, shard_reduce)]
