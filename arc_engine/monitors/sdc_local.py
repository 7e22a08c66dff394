"""Per-rank, pre-reduction parts of the SDC machinery: the gradient sketch and the self-check gate.

Both run on device inside the reduction hooks (DDP comm hook buckets, ZeRO parameter hooks), with no host sync:

* :func:`add_gradient_sketch`: a signed chunk-sum sketch of a rank's local gradient -- each tensor is cut into
  about ``4k`` contiguous chunks, each chunk's elements are summed under a fixed ±1 pattern (:func:`chunk_sums`),
  and each chunk's sum goes with a fixed pseudo-random sign to a fixed pseudo-random slot (seeded by the tensor's
  index, identical on every rank). O(gradient size) to compute, ``k`` numbers to gather. A
  corrupted block dominates the sketch of the rank that holds it, so that rank's sketch points away from its
  peers' (:func:`cosine_to_peers`).
* :class:`LocalGate`: a rank withholds a local gradient slot (a DDP bucket or a ZeRO parameter) from the reduction
  when its norm is not finite or, once warmed up, exceeds ``factor`` times its running reference. Withholding
  means contributing zeros; :mod:`arc_engine.recovery.recompute` adds the rank's recomputed share afterwards.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

#: Sketch plan index base for whole reduction buckets (DDP bucket ``b``: ``BUCKET_SKETCH_INDEX + b``; a ZeRO bucket
#: starting with parameter ``i``: ``BUCKET_SKETCH_INDEX + i``), above any per-parameter index.
BUCKET_SKETCH_INDEX = 1 << 20

#: Running reference of a slot's squared norm: reference <- DECAY * reference + (1 - DECAY) * norm².
REFERENCE_DECAY = 0.9


def _sketch_plan(index: int, blocks: int, size: int, device: torch.device, cache: dict
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and signs of the ``blocks`` block sums of tensor ``index`` in a sketch of ``size`` (seeded by ``index``
    alone: the same on every rank), cached in ``cache``."""
    key = (index, blocks, size, device)
    if key not in cache:
        generator = torch.Generator().manual_seed(0x5D1C + 7919 * index)
        slots = torch.randint(size, (blocks,), generator=generator)
        signs = torch.randint(2, (blocks,), generator=generator).double() * 2.0 - 1.0
        cache[key] = (slots.to(device), signs.to(device))
    return cache[key]


#: Chunks per tensor in :func:`chunk_sums`, per sketch slot: more chunks make the sketch's inner products closer
#: to the gradients' (the cross terms inside one chunk average out over more chunks), and its plan larger.
CHUNKS_PER_SLOT = 4


def _is_prime(value: int) -> bool:
    return value >= 2 and all(value % d for d in range(2, math.isqrt(value) + 1))


@functools.lru_cache(maxsize=1024)
def chunk_length(numel: int, size: int) -> int:
    """The length of :func:`chunk_sums`'s chunks for a tensor of ``numel`` elements and a sketch of ``size``: the
    smallest prime >= numel / (CHUNKS_PER_SLOT x size) (at least 2). A prime, so the chunks never line up with the
    power-of-two rows of a weight matrix. Pure."""
    length = max(2, numel // (CHUNKS_PER_SLOT * size))
    while not _is_prime(length):
        length += 1
    return length


_SIGNS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def _chunk_signs(length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fixed pseudo-random ±1 of ``length`` (seeded by the length alone: the same on every rank)."""
    key = (length, device, dtype)
    signs = _SIGNS.get(key)
    if signs is None:
        if len(_SIGNS) >= 256:
            _SIGNS.clear()
        generator = torch.Generator().manual_seed(0xC4A9 + length)
        signs = _SIGNS[key] = (torch.randint(2, (length,), generator=generator) * 2 - 1).to(device, dtype)
    return signs


@torch.no_grad()
def chunk_sums(grad: torch.Tensor, size: int) -> torch.Tensor | None:
    """``grad`` cut into chunks of :func:`chunk_length` elements, each chunk's elements multiplied by the same
    fixed ±1 pattern and summed (the last, shorter chunk by the pattern's start), in float32; None for an empty
    tensor. One matrix-vector product over the tensor (plus one small reduction for the remainder).

    Why signed: the sketch estimates inner products of the ranks' gradients (the SDC localization's cosines, the
    consistency family's C_dir). Plain block sums estimate the inner products of block-averaged gradients, which
    differ from the gradients' by every within-block cross term, and gradients are smooth within a block. With the
    signs, a cross term's expectation over the pattern is 0, and the sketch's inner products are the gradients'
    plus a noise that averages out over the chunks and slots: at 256 numbers the error of C_dir has half the RMS
    of plain block sums' (0.047 against 0.102 on the test GPT, ``scripts/bench_direction_sketch.py``)."""
    flat = grad.reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return None
    length = chunk_length(numel, size)
    signs = _chunk_signs(length, flat.device, flat.dtype)
    whole = numel // length
    parts = []
    if whole:
        chunks = flat[:whole * length].view(whole, length)
        if flat.dtype == torch.float16:  # a loss-scaled fp16 sum would overflow: accumulate in fp32
            parts.append((chunks * signs).sum(dim=1, dtype=torch.float32))
        else:  # one matrix-vector product (bf16's range is fp32's; its rounding is far below the sketch's noise)
            parts.append(torch.mv(chunks, signs).float())
    if whole * length < numel:
        rest = flat[whole * length:]
        parts.append((rest * signs[:rest.numel()]).sum(dtype=torch.float32).reshape(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


#: Concatenated plans of :func:`add_chunk_sums` kept per cache (one per distinct sequence of tensors).
MAX_BATCH_PLANS = 8


@torch.no_grad()
def add_chunk_sums(sketch_k: torch.Tensor, sums: list[torch.Tensor], indices: list[int],
                   cache: dict | None = None) -> None:
    """Add the signed sketch of tensors already reduced to their :func:`chunk_sums` (``sums[i]`` of the tensor with
    the rank-independent index ``indices[i]``) into the float64 ``sketch_k``: one concatenation and one
    ``index_add_`` for the whole list. ``cache`` keeps the plans between calls."""
    if not sums:
        return
    size = sketch_k.numel()
    cache = {} if cache is None else cache
    batches = cache.setdefault("batches", {})
    key = (tuple(indices), tuple(s.numel() for s in sums), size, sketch_k.device)
    plan = batches.get(key)
    if plan is None:
        parts = [_sketch_plan(index, part.numel(), size, sketch_k.device, cache)
                 for part, index in zip(sums, indices, strict=True)]
        if len(batches) >= MAX_BATCH_PLANS:
            batches.clear()
        plan = batches[key] = (torch.cat([slots for slots, _ in parts]), torch.cat([signs for _, signs in parts]))
    slots, signs = plan
    flat = sums[0] if len(sums) == 1 else torch.cat(sums)
    sketch_k.index_add_(0, slots, flat.to(sketch_k.device, torch.float64) * signs)


@torch.no_grad()
def add_gradient_sketch(sketch_k: torch.Tensor, grads: list[torch.Tensor], indices: list[int],
                        cache: dict | None = None) -> None:
    """Add the signed chunk-sum sketch of ``grads`` (tensor ``i`` has the rank-independent index ``indices[i]``)
    into the float64 vector ``sketch_k``. Linear in the gradient: sketches of summed gradients add up. Non-finite
    values propagate (a NaN gradient gives a NaN sketch). ``cache`` keeps the per-tensor plans between calls."""
    parts = [(sums, index) for grad, index in zip(grads, indices, strict=True)
             if (sums := chunk_sums(grad, sketch_k.numel())) is not None]
    add_chunk_sums(sketch_k, [sums for sums, _ in parts], [index for _, index in parts], cache)


def cosine_to_peers(sketch_rk: np.ndarray) -> np.ndarray:
    """``[ranks]``: the median over the other ranks of the cosine between this rank's sketch and theirs (NaN where
    a sketch is zero or not finite). A rank whose gradient disagrees with every peer has a low value while its
    peers keep high ones (a median, so one corrupted peer does not drag a healthy rank down; with 2 ranks the two
    values are equal). Pure."""
    num_ranks = sketch_rk.shape[0]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        norms = np.linalg.norm(sketch_rk, axis=1)
        cosine_rr = (sketch_rk @ sketch_rk.T) / np.outer(norms, norms)
    cosine_rr[~np.isfinite(cosine_rr)] = np.nan
    result = np.full(num_ranks, np.nan)
    for row in range(num_ranks):
        others = np.delete(cosine_rr[row], row)
        if others.size and np.isfinite(others).all():
            result[row] = float(np.median(others))
    return result


def gate_flags(norm_sq: torch.Tensor, reference_sq: torch.Tensor, seen: torch.Tensor, factor: float,
               warmup: int) -> torch.Tensor:
    """Which slots to withhold: a non-finite squared norm, or, after ``warmup`` observations of that slot, a squared
    norm above ``factor``² times its reference. Device tensors in, a bool tensor out, no sync. Pure."""
    return ~torch.isfinite(norm_sq) | ((seen >= warmup) & (norm_sq > factor * factor * reference_sq))


def updated_reference(norm_sq: torch.Tensor, reference_sq: torch.Tensor, seen: torch.Tensor,
                      withheld: torch.Tensor) -> torch.Tensor:
    """The next reference: the first observation, then an exponential average; withheld slots keep theirs. Pure."""
    blended = torch.where(seen > 0, REFERENCE_DECAY * reference_sq + (1.0 - REFERENCE_DECAY) * norm_sq, norm_sq)
    return torch.where(withheld, reference_sq, blended)


def zero_where(flag: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with every element set to 0 when the 0-dim ``flag`` is true, in place. On CPU a host branch (there
    is no device to sync with); on an accelerator ``masked_fill_`` with the device flag (no host sync)."""
    if tensor.device.type == "cpu":
        if bool(flag):
            tensor.zero_()
        return tensor
    return tensor.masked_fill_(flag.to(tensor.device), 0.0)


class LocalGate:
    """The self-check of one rank's local gradient slots (DDP buckets or ZeRO parameters), on ``device``.

    Slots are dense integers ``0..num_slots-1`` (grown on demand). Per step it records, for each withheld slot, the
    squared norm that was withheld and from which micro-batch on (``withheld_from``); :meth:`reset_step` clears the
    step's record. References move only on observations that were not withheld.
    """

    def __init__(self, factor: float, warmup: int, device: torch.device, num_slots: int = 0) -> None:
        self.factor = factor
        self.warmup = warmup
        self.device = device
        self.reference_sq = torch.zeros(num_slots, dtype=torch.float64, device=device)
        self.seen = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.withheld_sq = torch.zeros(num_slots, dtype=torch.float64, device=device)  # this step
        self.withheld_from = torch.zeros(num_slots, dtype=torch.long, device=device)  # this step
        self.withheld_count = torch.zeros((), dtype=torch.float64, device=device)  # this step, for the stats

    def _grow(self, num_slots: int) -> None:
        extra = num_slots - self.seen.numel()
        if extra > 0:
            self.reference_sq = torch.cat([self.reference_sq, self.reference_sq.new_zeros(extra)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(extra)])
            self.withheld_sq = torch.cat([self.withheld_sq, self.withheld_sq.new_zeros(extra)])
            self.withheld_from = torch.cat([self.withheld_from, self.withheld_from.new_zeros(extra)])

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's history (e.g. DDP rebuilt that bucket with other parameters)."""
        self._grow(slot + 1)
        self.seen[slot] = 0
        self.reference_sq[slot] = 0.0

    @torch.no_grad()
    def check(self, slot: int, norm_sq: torch.Tensor, micro_batch: int = 0) -> torch.Tensor:
        """Judge one slot's squared norm (a 0-dim device tensor) for ``micro_batch`` (0-based, within the step);
        returns the 0-dim withhold flag. A slot withheld earlier in this step stays withheld: its share from the
        first withheld micro-batch on is recomputed."""
        self._grow(slot + 1)
        norm_sq = norm_sq.to(self.device, torch.float64)
        flag = gate_flags(norm_sq, self.reference_sq[slot], self.seen[slot], self.factor, self.warmup)
        already = self.withheld_sq[slot] != 0
        self.withheld_from[slot] = torch.where(flag & ~already, micro_batch, self.withheld_from[slot])
        flag = flag | already
        self.reference_sq[slot] = updated_reference(norm_sq, self.reference_sq[slot], self.seen[slot], flag)
        self.seen[slot] += (~flag).long()
        # A withheld slot's record is > 0 even when its norm is 0 or not finite (abs of NaN stays NaN: != 0).
        self.withheld_sq[slot] += torch.where(flag, torch.where(norm_sq > 0, norm_sq, 1e-300), 0.0)
        self.withheld_count += flag.double()
        return flag

    def would_withhold_t(self, slot: int, norm_sq: torch.Tensor) -> torch.Tensor:
        """:meth:`would_withhold` of a 0-dim device tensor, as a 0-dim bool tensor (no host sync)."""
        self._grow(slot + 1)
        return gate_flags(norm_sq.to(self.device, torch.float64), self.reference_sq[slot], self.seen[slot],
                          self.factor, self.warmup)

    def would_withhold(self, slot: int, norm_sq: float) -> bool:
        """The gate's verdict on one more observation of ``slot``, without recording it (host values)."""
        if not math.isfinite(norm_sq):
            return True
        seen, reference = int(self.seen[slot]), float(self.reference_sq[slot])
        return seen >= self.warmup and norm_sq > self.factor * self.factor * reference

    def withheld(self) -> dict[int, int]:
        """{slot: first withheld micro-batch} for this step (one host sync: call it only on a step whose gathered
        statistics say this rank withheld something)."""
        slots = torch.nonzero(self.withheld_sq != 0).flatten()
        return dict(zip(slots.tolist(), self.withheld_from[slots].tolist(), strict=True))

    def reset_step(self) -> None:
        self.withheld_sq.zero_()
        self.withheld_from.zero_()
        self.withheld_count.zero_()
