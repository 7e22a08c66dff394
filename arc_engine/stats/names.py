"""Names of the standard statistic slots shared by producers (integrations) and consumers (monitors).

``G`` below is the number of optimizer parameter groups.
"""

#: [1] PER_RANK: the rank's loss for the step (mean over its recorded micro-batches).
LOSS = "loss"
#: [1] PER_RANK: how many micro-batch losses the rank recorded this step (0: no loss recorded).
LOSS_COUNT = "loss_count"
#: [G] PER_RANK: squared L2 norm of the rank's local gradient per group, before the gradient reduction.
GRAD_SQ_LOCAL = "grad_sq_local"
#: [G] PER_RANK: number of parameter tensors whose local gradient holds NaN/Inf, per group.
GRAD_NONFINITE_LOCAL = "grad_nonfinite_local"
#: [G] SUM (a shard's part, or under DDP the owned parameters' part) or REPLICATED: squared L2 norm of the reduced
#: gradient per group, before clipping.
GRAD_SQ = "grad_sq"
#: [G] SUM or REPLICATED (as GRAD_SQ): squared L2 norm of the weights per group (before this step's update).
WEIGHT_SQ = "weight_sq"
#: [G] SUM or REPLICATED: Σ U² of the Adam update about to be applied, U = m̂/(√v̂+ε) (SDC paper).
UPDATE_SQ = "update_sq"
#: [G] SUM or REPLICATED: number of elements behind UPDATE_SQ (RMS = sqrt(UPDATE_SQ / UPDATE_COUNT)).
UPDATE_COUNT = "update_count"
#: [K] PER_RANK: signed block-sum sketch of the rank's local gradient before the reduction (SDC localization).
GRAD_SKETCH_LOCAL = "grad_sketch_local"
#: [1] PER_RANK: number of local gradient slots the rank withheld from the reduction (SDC recomputation).
SDC_WITHHELD = "sdc_withheld"
