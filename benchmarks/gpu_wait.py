"""A wait of exactly so many nanoseconds on the GPU, on whatever stream it is launched: the
emulated network's stand-in for bytes on a wire (emulation.Lane).

The waiting warp naps between its reads of the clock while more than 4 us are left (a
nanosleep of 1 us sleeps 0-2 us, so no nap overshoots the wait), then reads it back to back. A
warp that reads the clock back to back takes issue slots from whatever shares its SM: on the
H200 the GEMMs that ran beside such a wait were 11.5% slower (median over 592 of them against the
same GEMMs in a step with no waits, 2026-12-02), so the emulated network charged its own
overhead to the step. `spin_cost` measures it on the machine at hand, napping and not: the
same products alone and beside a wait. Triton, not a CUDA extension: no nvcc needed.
"""

from __future__ import annotations

import functools
import statistics

import torch
import triton
import triton.language as tl

from lightning_sdp4bit.kernels._launch import launch

__all__ = ["spin", "spin_accuracy", "spin_cost"]


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _nap_then_now():
    return tl.inline_asm_elementwise(
        "nanosleep.u32 1000; mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


# do_not_specialize: one compiled variant for every value of ns (else one per value; it still
# compiles one for int32 and one for int64 values). nap=False: the clock read back to back, the
# wait before 2026-12-02, kept to measure what the nap saves (spin_cost).
@triton.jit(do_not_specialize=["ns"])
def _spin_kernel(ns, nap: tl.constexpr):
    start = _now()
    now = start
    if nap:  # a compile-time branch: one loop or the other in the binary
        while now - start < ns:
            if ns - (now - start) > 4000:
                now = _nap_then_now()
            else:
                now = _now()
    else:
        while now - start < ns:
            now = _now()


def spin(ns: int, nap: bool = True) -> None:
    """Launch, on the current CUDA stream, one warp that returns `ns` ns of %globaltimer after it
    starts. Through `launch`: every emulated collective launches one, and Triton's own path (about
    25 us of host a call) would make the emulation's host cost per collective several times NCCL's."""
    launch(_spin_kernel, (1,), ns, nap, num_warps=1)


@functools.cache
def spin_accuracy(wait_ms: float = 20.0) -> float:
    """Measured / requested time of one wait of `wait_ms`, by CUDA events (1.00 = exact). Run
    once per process, after a first call that compiles the kernel."""
    spin(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    spin(int(wait_ms * 1e6))
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / wait_ms


def spin_cost(nap: bool, gemms: int = 40, repeats: int = 5) -> float:
    """How much slower matrix products run beside a wait on another stream than alone: the time
    of `gemms` bf16 products of the 1.3B GPT's MLP shape (8192 tokens x 2048 -> 8192, about
    0.3 ms each on an H200), beside one wait that outlasts them, over their time alone; the
    median of `repeats` pairs (1.00 = no cost)."""
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def products_ms(beside: bool) -> float:
        torch.cuda.synchronize()
        if beside:
            with torch.cuda.stream(side):
                spin(gemms * 1_000_000, nap)  # 1 ms a product: more than any of them takes
        start.record()
        for _ in range(gemms):
            a @ b
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    products_ms(False), products_ms(True)  # compiled and warm
    return statistics.median(products_ms(True) / products_ms(False) for _ in range(repeats))
