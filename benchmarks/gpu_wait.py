"""A wait of exactly so many nanoseconds on the GPU, on whatever stream it is launched: the
emulated network's stand-in for bytes on a wire (emulation.Lane)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["spin_accuracy", "spin_kernel"]


@functools.cache
def spin_kernel() -> Callable[[int], None]:
    """A one-warp kernel that returns `ns` nanoseconds of %globaltimer after it starts.

    Triton, not a CUDA extension: no nvcc needed. do_not_specialize keeps Triton from compiling
    a variant per value of ns (it still compiles one for int32 and one for int64 values).
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit(do_not_specialize=["ns"])
    def _spin_kernel(ns):
        start = _now()
        now = start
        while now - start < ns:
            now = _now()

    def spin(ns: int) -> None:
        _spin_kernel[(1,)](ns, num_warps=1)

    return spin


@functools.cache
def spin_accuracy(wait_ms: float = 20.0) -> float:
    """Measured / requested time of one wait of `wait_ms`, by CUDA events (1.00 = exact). Run
    once per process, after a first call that compiles the kernel."""
    spin = spin_kernel()
    spin(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    spin(int(wait_ms * 1e6))
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / wait_ms
