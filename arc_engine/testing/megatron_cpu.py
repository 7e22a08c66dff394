"""Run megatron-core (0.16.1 .. 0.19.x) on CPU ranks over gloo: every CUDA-to-CPU shim it needs, in one place.

Imported only by tests and by ``scripts/train_megatron_gpt.py --cpu``; the library never imports it. Call
:func:`install` in each rank process before building any megatron model (megatron may already be imported). It
patches process-wide torch and megatron state, cannot be undone and is idempotent: install it in spawned ranks or
subprocesses, never in the pytest process itself. Without Transformer Engine or apex, megatron-core assumes CUDA in
these places:

- ``torch.cuda.current_device`` -> ``"cpu"``: grad buffers, GlobalMemoryBuffer, TP layers and the router allocate
  with ``device=torch.cuda.current_device()``.
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and ``tensor_parallel.random``'s
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> the CPU default generator: the RNG tracker and
  ``model_parallel_cuda_manual_seed`` fork "the CUDA generator" around dropout and init; on a CPU-only torch the
  setter is silently queued forever and the getter raises. The tracker's "CPU RNG state changed" warning is then
  expected on every fork, so it is filtered out.
- A :class:`~torch.overrides.TorchFunctionMode` entered for the rest of the process (it stays at the bottom of the
  mode stack; nothing pops it): ``device="cuda"`` / ``device=<int>`` arguments and ``Tensor.to("cuda")`` go to the
  CPU, ``Tensor.cuda()`` returns the tensor, and ``Tensor.type()`` reports ``torch.cuda.*Tensor``, because
  optimizer.py, distrib_optimizer.py, grad_scaler.py, clip_grads.py, utils.py, schedules.py, transformer/utils.py
  and rerun_state_machine.py hard-code CUDA devices and compare ``param.type()`` to CUDA type names.
- ``moe_utils.te_general_gemm = None``: the router's gating GEMM reads that name, which is only bound when
  Transformer Engine imports (NameError otherwise).
- ``torch.cuda.synchronize`` -> no-op: pipeline P2P with ``batch_p2p_comm`` (PP > 1) calls it after every exchange,
  and from 0.19 on ``Timer.start`` (``core/timers.py``) calls it on every run. On a CUDA build of torch without a
  GPU the real one fails with "Found no NVIDIA driver".
- ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` / ``Event`` -> inert stand-ins, and
  ``token_dispatcher.maybe_move_tensor_to_cpu`` returns numpy split sizes: the alltoall MoE dispatcher copies its
  split sizes device-to-host on a side stream and only converts them to numpy when the tensor ``is_cuda``; from 0.19
  on Megatron-LM's ``_ddp_wrap`` creates a ``torch.cuda.Stream()`` for plain DDP too.
- ``WrappedTorchNorm`` accepts ``sequence_parallel`` and tags its parameters ``.sequence_parallel = True``: TP with
  MoE requires sequence parallelism, the local spec's torch norm asserts it off (apex's norm would allow it), and
  ``finalize_model_grads`` all-reduces norm grads over TP only for parameters carrying that tag.

Megatron-LM's own training code (``megatron/training``: from a checkout, or the package the megatron-core 0.19
wheel ships) needs a few more: :func:`install_megatron_lm`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def install() -> None:
    """Install every shim below (idempotent). Call before building any megatron model, on every rank."""
    global _installed
    if _installed:
        return
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe()
    _patch_torch_norm()
    _CudaToCpuMode().__enter__()  # never exited: the mode stays active for the whole process
    _installed = True


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def _as_cpu_device(device: Any) -> Any:
    """``device`` with CUDA devices (names, ``torch.device``, bare indices) replaced by the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU and reports CPU tensors' ``type()`` as CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _as_cpu_device(kwargs["device"])}
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _as_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _StreamStandIn:
    """A CUDA stream on the CPU: work is already ordered, so waiting and recording do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _EventStandIn:
        return event if event is not None else _EventStandIn()

    def synchronize(self) -> None:
        pass


class _EventStandIn:
    """A CUDA event on the CPU: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _StreamStandIn()


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _StreamStandIn
    torch.cuda.Event = _EventStandIn
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    tp_random._get_cuda_rng_state = get_rng_state
    tp_random._set_cuda_rng_state = set_rng_state
    logging.getLogger(tp_random.__name__).addFilter(lambda record: record.getMessage() != _RNG_WARNING)


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


def _patch_torch_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build_norm = WrappedTorchNorm.__new__

    def build_sequence_parallel_norm(cls, config, hidden_size, *args, **kwargs):  # type: ignore[no-untyped-def]
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # only to pass the assert; restored before anyone else reads it
        try:
            norm = build_norm(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = staticmethod(build_sequence_parallel_norm)


_megatron_lm_installed = False


def install_megatron_lm() -> None:
    """Everything :func:`install` does, plus what Megatron-LM's own training code (``megatron/training`` from a
    checkout at tag ``core_v0.16.1``, or the package megatron-core 0.19.2 ships) needs on CPU ranks over gloo
    (idempotent; same rules as :func:`install`):

    - ``pretrain()`` calls ``initialize_megatron`` without ``allow_no_cuda``, which asserts
      ``torch.cuda.is_available()``: ``training.initialize_megatron`` is wrapped to pass ``allow_no_cuda=True``
      (``is_available`` itself stays False for torch and everyone else).
    - ``_initialize_distributed`` creates the model-parallel groups and ``_set_random_seed`` seeds the model-parallel
      RNG tracker only when ``torch.cuda.device_count() > 0``: it reports one device, and ``torch.cuda.set_device``
      is a no-op. ``torch.cuda.is_available`` is pinned to False: torch answers it from ``device_count()`` when
      ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (which importing DeepSpeed sets), and a True would make the data loader
      pin memory on a CUDA device that is not there.
    - ``validate_args`` reads the GPU's architecture (``get_device_arch_version``, from
      ``torch.cuda.get_device_properties``): it reports 0, i.e. not Blackwell, so TP > 1 still asserts
      ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment. The function lives in ``training/utils.py`` (0.16) or
      ``training/utils/common_utils.py`` (0.19); every module that imported it gets the stand-in.
    - ``_compile_dependencies`` runs ``make`` on ``megatron/core/datasets`` (pybind11, a compiler, a writable
      source tree) and, before 0.19, builds the fused CUDA kernels with nvcc: the dataset helpers are taken as built
      when ``helpers_cpp`` imports (the installed megatron-core wheel ships them), and the fused kernels (where
      ``megatron.legacy`` still has them) are not loaded.
    - ``initialize.py`` imports ``enable_batch_invariant_mode`` from megatron-core's Triton kernels, which import
      ``triton`` (a CUDA-only package): without Triton, that module is replaced by a stand-in whose functions
      raise (``--batch-invariant-mode`` is unavailable on CPU).
    - ``set_jit_fusion_options`` warms up the ``torch.compile``-d bias-GeLU / bias-dropout-add fusions on CUDA
      tensors: the warm-up is skipped (pass ``--no-bias-gelu-fusion --no-bias-dropout-fusion`` so the model does
      not compile them either). 0.19 passes it ``tp_size=``: the stand-in takes any arguments.
    """
    global _megatron_lm_installed
    if _megatron_lm_installed:
        return
    install()
    _stand_in_batch_invariant_kernels()
    import importlib
    import sys
    from functools import partial

    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize, training
    from megatron.training import utils as training_utils

    torch.cuda.device_count = lambda: 1
    torch.cuda.is_available = lambda: False
    torch.cuda.set_device = lambda device: None
    with contextlib.suppress(ImportError):  # 0.19: training/utils is a package
        importlib.import_module("megatron.training.utils.common_utils")
    for module in [arguments, training_utils, *(m for name, m in list(sys.modules.items())
                                                 if name.startswith("megatron.training.utils."))]:
        if "get_device_arch_version" in vars(module):
            module.get_device_arch_version = lambda: 0
    training.initialize_megatron = partial(initialize.initialize_megatron, allow_no_cuda=True)
    build_helpers = dataset_utils.compile_helpers

    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            build_helpers()

    dataset_utils.compile_helpers = compile_helpers
    try:  # 0.16: _compile_dependencies builds them with nvcc; 0.19 has no megatron.legacy
        from megatron.legacy import fused_kernels
    except ImportError:
        pass
    else:
        fused_kernels.load = lambda args: None
    initialize._warmup_jit_function = lambda *args, **kwargs: None
    _megatron_lm_installed = True


def _stand_in_batch_invariant_kernels() -> None:
    import importlib.util
    import sys
    import types

    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("batch-invariant mode needs Triton (not installed)")

    stand_in = types.ModuleType(name)
    for function in ("set_batch_invariant_mode", "enable_batch_invariant_mode", "disable_batch_invariant_mode"):
        setattr(stand_in, function, unavailable)
    stand_in.is_batch_invariant_mode_enabled = lambda: False  # type: ignore[attr-defined]
    sys.modules[name] = stand_in
