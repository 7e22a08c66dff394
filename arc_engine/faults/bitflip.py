"""Software bit-flip injection into the results of ``nn.Linear`` GEMMs (and the GEMM modules integrations register,
such as megatron-core's tensor-parallel linears), forward or backward.

The software counterpart of instruction-level SDC injection (NVBit on HMMA instructions, as in
``shared/papers/sdc-in-llm-pretraining.txt``): a faulty GPU flips bits in what a GEMM computes, and only exponent
bits matter (bf16 bits 10-11 raise the loss, 12-14 give NaN; the damage to training comes almost only from the
backward pass). Python cannot reach an instruction's register, so we corrupt the tensor the GEMM produced, through
the hooks torch provides:

* ``where="forward"``: the Linear's output ``Y = X·Wᵀ + b`` (a forward hook). The corruption is straight-through for
  autograd: downstream layers see, and save for backward, the corrupted values, while ``dL/dY`` reaches the Linear
  unchanged, as on hardware, where neither backward GEMM reads ``Y``.
* ``where="backward"``: the Linear's input gradient ``dL/dX = dL/dY·W`` (the backward data GEMM). On an armed step a
  forward pre-hook aliases the input (``view_as``) and puts a gradient hook on the alias, so the hook sees exactly
  this Linear's contribution, not the summed gradient of an input shared with a residual branch; the weight gradient
  is untouched. When the input does not require grad (the first layer fed with data) torch runs no data-gradient
  GEMM, so there is nothing to corrupt and nothing fires.
* ``where="weight_grad"``: the weight gradient ``dL/dW = (dL/dY)ᵀ·X`` (the backward weight GEMM), through
  ``register_hook`` on the weight, which runs before the gradient is accumulated into ``.grad`` and before DDP's
  reduction sees it: the corruption stays local to the chosen rank. Tested on plain tensors, not FSDP2's DTensors.

The bit is flipped in the dtype of the tensor the hook sees: the GEMM's output dtype for ``forward``/``backward``
(bf16 under autocast), the parameter's dtype for ``weight_grad`` (fp32 master weights under autocast).

Hooks must not change numerics when they do not fire: off the chosen rank nothing is registered, and on other steps
each hook runs one step check in Python and returns ``None``, with no host sync and no change to the autograd graph.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Where = Literal["forward", "backward", "weight_grad"]
WHERES: tuple[str, ...] = ("forward", "backward", "weight_grad")

# Float dtype -> (integer dtype of the same width to view it as, word width in bits).
_WORD_FORMATS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 32),
    torch.bfloat16: (torch.int16, 16),
    torch.float16: (torch.int16, 16),
}

EXPONENT_BITS: dict[torch.dtype, range] = {
    torch.float32: range(23, 31),
    torch.bfloat16: range(7, 15),
    torch.float16: range(10, 15),
}
"""Bit positions of the exponent field per dtype; bit 0 is the least significant, the sign bit is the highest."""

DEFAULT_BIT: dict[torch.dtype, int] = {
    torch.bfloat16: 12,
    torch.float32: 28,
    torch.float16: 13,
}
"""The bit flipped when a spec gives none. bf16 bit 12 is the paper's lowest NaN-producing bit: exponent bit 5,
which scales a value by 2^±32. fp32 bit 28 is the same exponent bit with the same effect. fp16 has only 5 exponent
bits; bit 13 (exponent bit 3, 2^±8) is the highest one below the MSB, whose flip turns values in [1, 2) into Inf."""


def _word_format(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    if dtype not in _WORD_FORMATS:
        allowed = ", ".join(str(d) for d in _WORD_FORMATS)
        raise ValueError(f"bit flips support {allowed}; got {dtype}")
    return _WORD_FORMATS[dtype]


def signed_bit_constant(bit: int, width: int) -> int:
    """``1 << bit`` as a signed ``width``-bit integer, so the sign bit fits in int16/int32 (``-2**(width-1)``)."""
    value = 1 << bit
    return value - (1 << width) if bit == width - 1 else value


def flip_bits(tensor: torch.Tensor, bit: int, mask: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``tensor`` whose IEEE word has bit ``bit`` XOR-flipped where ``mask`` is True.

    ``tensor`` is float32 (bits 0-31), bfloat16 or float16 (bits 0-15); ``mask`` is a bool tensor of the same shape
    on the same device. The work is two elementwise kernels on that device (no host sync, no per-element Python), so
    it runs the same on CPU and CUDA. The result is detached from autograd; flipping the same bit with the same mask
    twice restores the input bitwise. Raises ValueError for another dtype, a bit outside the word or a bad mask.
    """
    word_dtype, width = _word_format(tensor.dtype)
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width - 1}] for {tensor.dtype}; got {bit}")
    if mask.dtype != torch.bool or mask.shape != tensor.shape:
        raise ValueError(f"mask must be a bool tensor of shape {tuple(tensor.shape)}; "
                         f"got {mask.dtype} of shape {tuple(mask.shape)}")
    words = tensor.detach().view(word_dtype)
    flipped = torch.where(mask, torch.bitwise_xor(words, signed_bit_constant(bit, width)), words)
    return flipped.view(tensor.dtype)


def choose_elements(shape: torch.Size | tuple[int, ...], rate: float | None, count: int | None,
                    generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """A bool mask of ``shape`` on ``device`` choosing which elements to corrupt.

    Give exactly one of ``count`` (that many distinct positions, uniformly at random; all of them when ``count``
    exceeds the number of elements) or ``rate`` (each element independently with that probability). The draw is
    deterministic given ``generator``'s state and advances it. The mask is drawn on ``generator.device`` and moved to
    ``device``: pass a generator on ``device`` to avoid a copy. Raises ValueError on bad arguments.
    """
    if (rate is None) == (count is None):
        raise ValueError(f"give exactly one of rate or count; got rate={rate}, count={count}")
    numel = math.prod(shape)
    if count is not None:
        if count < 0:
            raise ValueError(f"count must be >= 0; got {count}")
        chosen = torch.randperm(numel, generator=generator, device=generator.device)[: min(count, numel)]
        mask = torch.zeros(numel, dtype=torch.bool, device=generator.device).scatter_(0, chosen, True)
    else:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1]; got {rate}")
        mask = torch.rand(numel, generator=generator, device=generator.device) < rate
    return mask.view(tuple(shape)).to(device)


#: GEMM module types hooked besides ``nn.Linear``, each with the index of the GEMM's result in the tuple its forward
#: returns (megatron-core's parallel linears return ``(output, bias)``). Integrations register theirs.
_GEMM_TYPES: dict[type, int] = {}


def register_gemm_type(cls: type, output_index: int = 0) -> None:
    """Let the bit-flip fault hook modules of ``cls``: a module holding a 2-D ``weight`` whose forward computes
    ``input @ weight.T`` (returning it, or a tuple with it at ``output_index``). Idempotent."""
    _GEMM_TYPES[cls] = output_index


def _is_gemm(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, *_GEMM_TYPES))


def select_linears(model: nn.Module, pattern: str) -> dict[str, nn.Module]:
    """The ``nn.Linear`` (or registered GEMM) modules of ``model`` whose ``named_modules()`` name matches the fnmatch
    ``pattern``.

    Raises ValueError naming the model's Linear modules when none matches. Only Linears called as modules are hooked:
    a weight used directly (a tied LM head ``x @ emb.weight.t()``, ``nn.MultiheadAttention.out_proj``) is not.
    """
    linears = {name: m for name, m in model.named_modules() if _is_gemm(m)}
    selected = {name: m for name, m in linears.items() if fnmatch.fnmatchcase(name, pattern)}
    if not selected:
        raise ValueError(f"bitflip: pattern {pattern!r} matches no nn.Linear; Linear modules: {sorted(linears)}")
    return selected


@dataclass(kw_only=True)
class BitFlipSpec:
    """What to corrupt, and where and when.

    ``pattern`` selects Linear modules (fnmatch against ``named_modules()`` names, e.g. ``"blocks.*.mlp.0"``).
    ``rank`` is the global rank to inject on, -1 for every rank. The injection is due at the steps in ``steps``, or,
    with ``persistent=True``, at every step >= ``start_step``. ``bit=None`` flips ``DEFAULT_BIT`` of the corrupted
    tensor's dtype. Give ``rate`` or ``count`` (neither: one element). ``max_per_step`` bounds the injections per
    module in one step: every call of the module in a due step is a GEMM that can be hit, i.e. each micro-batch under
    gradient accumulation and the recomputation under activation checkpointing; ``max_per_step=1`` hits only the
    first, as a transient fault would.
    """

    pattern: str
    where: Where = "forward"
    rank: int = -1
    steps: Collection[int] | None = None
    persistent: bool = False
    start_step: int = 0
    bit: int | None = None
    rate: float | None = None
    count: int | None = None
    seed: int = 0
    max_per_step: int | None = None

    def __post_init__(self) -> None:
        if self.where not in WHERES:
            raise ValueError(f"bitflip.where must be one of {WHERES}; got {self.where!r}")
        if (self.steps is None) == (not self.persistent):
            raise ValueError(f"bitflip: give steps or persistent=True, not both or neither; "
                             f"got steps={self.steps}, persistent={self.persistent}")
        if self.steps is not None and not isinstance(self.steps, range):
            self.steps = frozenset(self.steps)
        if self.bit is not None and not 0 <= self.bit < 32:
            raise ValueError(f"bitflip.bit must be in [0, 31] (or None for the dtype's default); got {self.bit}")
        if self.rate is not None and self.count is not None:
            raise ValueError(f"bitflip: give rate or count, not both; got rate={self.rate}, count={self.count}")
        if self.rate is not None and not 0.0 < self.rate <= 1.0:
            raise ValueError(f"bitflip.rate must be in (0, 1]; got {self.rate}")
        if self.rate is None and self.count is None:
            self.count = 1
        if self.count is not None and self.count < 1:
            raise ValueError(f"bitflip.count must be >= 1; got {self.count}")
        if self.max_per_step is not None and self.max_per_step < 1:
            raise ValueError(f"bitflip.max_per_step must be >= 1 or None; got {self.max_per_step}")

    def due_at(self, step: int) -> bool:
        """Whether an injection is scheduled at ``step`` (before ``max_per_step`` is applied)."""
        if self.persistent:
            return step >= self.start_step
        return step in self.steps


class _FlipStraightThrough(torch.autograd.Function):
    """Forward: the bit-flipped copy. Backward: the gradient unchanged, as for a GEMM whose output was corrupted."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, bit: int, mask: torch.Tensor) -> torch.Tensor:
        return flip_bits(tensor, bit, mask)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class BitFlipInjector:
    """Flips bits in the chosen Linear GEMM results of this rank, at the chosen steps.

    ``rank`` is this process's global rank; ``current_step()`` returns the step attempt the running forward/backward
    belongs to (the engine's ``iteration``, so a rollback that replays a step does not fire a transient fault again).
    Call :meth:`install` on every rank after building the model; it validates the pattern everywhere and registers
    hooks only where ``spec.rank`` is -1 or ``rank``. Each injection appends to ``fired`` a dict with ``step``,
    ``module``, ``where``, ``bit``, ``dtype`` and ``num_flipped``. An injection with ``rate`` counts its elements with
    one host sync; with ``count`` an injection does not sync. Not thread-safe; one injector per ``where``.
    """

    def __init__(self, spec: BitFlipSpec, *, rank: int, current_step: Callable[[], int]) -> None:
        self.spec = spec
        self.rank = rank
        self.current_step = current_step
        self.armed = spec.rank in (rank, -1)
        self.fired: list[dict[str, Any]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._generators: dict[torch.device, torch.Generator] = {}
        self._counts_step: int | None = None
        self._counts: dict[str, int] = {}

    def install(self, model: nn.Module) -> list[str]:
        """Hook the Linear modules matching ``spec.pattern``; returns their names (also off the armed rank).

        Raises ValueError naming the Linear modules when nothing matches. Not collective.
        """
        linears = select_linears(model, self.spec.pattern)
        if self.armed:
            for name, module in linears.items():
                self._handles.append(self._register(name, module))
        return list(linears)

    def remove(self) -> None:
        """Remove every hook this injector registered; ``fired`` is kept."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _register(self, name: str, module: nn.Module) -> torch.utils.hooks.RemovableHandle:
        if self.spec.where == "forward":
            return module.register_forward_hook(self._forward_hook(name))
        if self.spec.where == "backward":
            return module.register_forward_pre_hook(self._input_grad_pre_hook(name))
        return module.weight.register_hook(self._grad_hook(name))

    def _forward_hook(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            step = self._due(name)
            if step is None:
                return None
            if isinstance(output, tuple):  # a registered GEMM type returning (result, ...)
                index = next(i for cls, i in _GEMM_TYPES.items() if isinstance(module, cls))
                bit, mask = self._plan(name, output[index], step)
                flipped = _FlipStraightThrough.apply(output[index], bit, mask)
                return (*output[:index], flipped, *output[index + 1:])
            bit, mask = self._plan(name, output, step)
            return _FlipStraightThrough.apply(output, bit, mask)

        return hook

    def _input_grad_pre_hook(self, name: str) -> Callable[..., tuple | None]:
        grad_hook = self._grad_hook(name)

        def pre_hook(module: nn.Module, args: tuple) -> tuple | None:
            inputs = args[0]
            if not (torch.is_grad_enabled() and inputs.requires_grad) or self._due(name) is None:
                return None
            alias = inputs.view_as(inputs)
            alias.register_hook(grad_hook)
            return (alias, *args[1:])

        return pre_hook

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            step = self._due(name)
            if step is None:
                return None
            bit, mask = self._plan(name, grad, step)
            return flip_bits(grad, bit, mask)

        return hook

    def _due(self, name: str) -> int | None:
        """The current step if ``name`` is due for an injection now, else None (pure Python, no sync)."""
        step = self.current_step()
        if not self.spec.due_at(step):
            return None
        if self._counts_step != step:
            self._counts_step, self._counts = step, {}
        if self.spec.max_per_step is not None and self._counts.get(name, 0) >= self.spec.max_per_step:
            return None
        return step

    def _plan(self, name: str, tensor: torch.Tensor, step: int) -> tuple[int, torch.Tensor]:
        """Choose the bit and the elements of ``tensor`` to flip, and record the injection."""
        _, width = _word_format(tensor.dtype)
        bit = self.spec.bit if self.spec.bit is not None else DEFAULT_BIT[tensor.dtype]
        if bit >= width:
            raise ValueError(f"bitflip.bit={bit} does not exist in {tensor.dtype} (bits 0-{width - 1}) at {name!r}")
        mask = choose_elements(tensor.shape, self.spec.rate, self.spec.count, self._generator(tensor.device),
                               tensor.device)
        num_flipped = min(self.spec.count, tensor.numel()) if self.spec.count is not None else int(mask.sum().item())
        self._counts[name] = self._counts.get(name, 0) + 1
        self.fired.append({"step": step, "module": name, "where": self.spec.where, "bit": bit,
                           "dtype": str(tensor.dtype).removeprefix("torch."), "num_flipped": num_flipped})
        return bit, mask

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.spec.seed)
        return self._generators[device]
