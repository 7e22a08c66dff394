"""``float32_norms``: every gradient norm arc_engine takes, float32-accumulated; bf16/fp16 CPU tensors go through a
small reused buffer (long bf16 tensors: their rows' norms) instead of a whole-tensor float32 copy."""

from __future__ import annotations

import math

import pytest
import torch

from arc_engine.stats import grad_stats
from arc_engine.stats.grad_stats import CPU_UPCAST_CHUNK, float32_norms


def exact(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor.double()))


def test_low_precision_tensors_are_upcast_chunk_by_chunk_in_their_order() -> None:
    gen = torch.Generator().manual_seed(0)
    long = torch.randn(3 * CPU_UPCAST_CHUNK + 17, generator=gen)
    long[-17:] = 1000.0  # the tail carries most of the norm: a chunk left out would show
    tensors = [long.bfloat16(),                                                    # several chunks and a tail
               torch.randn(40, 7, generator=gen),                                   # float32: the fused kernel
               torch.randn(5, generator=gen).half(),
               torch.randn(8, 6, generator=gen).bfloat16().t(),                     # not contiguous
               torch.zeros(0, dtype=torch.bfloat16)]
    norms = float32_norms(tensors)
    assert [n.dtype for n in norms] == [torch.float32] * 5 and all(n.dim() == 0 for n in norms)
    for tensor, norm in zip(tensors, norms, strict=True):
        assert float(norm) == pytest.approx(exact(tensor), rel=1e-4, abs=0.0)  # float32 sums of 1M terms
    # float32 tensors alone: unchanged, bitwise, from the fused kernel
    alone = float32_norms([tensors[1]])
    assert torch.equal(alone[0], torch._foreach_norm([tensors[1]], 2, dtype=torch.float32)[0])


def test_non_finite_values_propagate_and_fp16_norms_do_not_overflow() -> None:
    big = torch.full((4 * CPU_UPCAST_CHUNK,), 60000.0, dtype=torch.float16)  # norm 1.2e8, far over fp16's range
    with_nan = torch.ones(CPU_UPCAST_CHUNK + 3, dtype=torch.bfloat16)
    with_nan[-1] = float("nan")
    with_inf = torch.ones(10, dtype=torch.bfloat16)
    with_inf[2] = float("inf")
    norms = float32_norms([big, with_nan, with_inf])
    assert float(norms[0]) == pytest.approx(60000.0 * math.sqrt(4 * CPU_UPCAST_CHUNK), rel=1e-3)
    assert math.isnan(float(norms[1])) and math.isinf(float(norms[2]))


def test_the_buffer_is_one_per_thread_and_reused() -> None:
    float32_norms([torch.ones(10, dtype=torch.bfloat16)])
    first = grad_stats._scratch.get()
    float32_norms([torch.ones(2 * CPU_UPCAST_CHUNK, dtype=torch.bfloat16)])
    assert grad_stats._scratch.get() is first and first.numel() == CPU_UPCAST_CHUNK

    import threading

    seen = []
    thread = threading.Thread(target=lambda: (float32_norms([torch.ones(3, dtype=torch.half)]),
                                              seen.append(grad_stats._scratch.get())))
    thread.start()
    thread.join()
    assert seen and seen[0] is not first


def test_long_bf16_tensors_take_their_rows_norms_without_an_upcast_copy() -> None:
    import threading

    gen = torch.Generator().manual_seed(1)
    whole_rows = torch.randn(grad_stats.BF16_ROW_MIN_ROWS * grad_stats.BF16_ROW * 3, generator=gen).bfloat16()
    with_tail = torch.randn(grad_stats.BF16_ROW_MIN_ROWS * grad_stats.BF16_ROW + 5, generator=gen).bfloat16()
    with_tail[-5:] = 300.0  # the tail carries most of the norm: left out, it would show
    too_short = torch.randn(grad_stats.BF16_ROW * 3, generator=gen).bfloat16()  # under the rows' minimum: upcast
    seen: list[tuple[list[torch.Tensor], int]] = []

    def run(tensors: list[torch.Tensor]) -> None:
        norms = float32_norms(tensors)
        seen.append((norms, grad_stats._scratch.buffer.numel()))

    for tensors in ([whole_rows], [with_tail, too_short]):
        thread = threading.Thread(target=run, args=(tensors,))  # a fresh thread: a fresh, empty upcast buffer
        thread.start()
        thread.join()
    (rows_only, rows_buffer), (mixed, mixed_buffer) = seen
    assert rows_buffer == 0  # whole rows: no float32 copy of any part
    assert mixed_buffer == CPU_UPCAST_CHUNK  # the tail and the short tensor went through the buffer
    for tensor, norm in zip([whole_rows, with_tail, too_short], rows_only + mixed, strict=True):
        assert norm.dtype == torch.float32 and norm.dim() == 0
        assert float(norm) == pytest.approx(exact(tensor), rel=1e-4, abs=0.0)  # each row rounded to bf16 at most
    # non-finite values in the rows propagate
    bad = whole_rows.clone()
    bad[7 * grad_stats.BF16_ROW + 3] = float("inf")
    assert math.isinf(float(float32_norms([bad])[0]))
    bad[9] = float("nan")
    assert math.isnan(float(float32_norms([bad])[0]))
