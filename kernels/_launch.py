"""Kernel launches that skip Triton's per-call Python once a kernel is compiled.

`kernel[grid](*args, **constexprs)` binds and specializes every argument, builds a cache key,
checks the kernel's globals and looks the device and stream up, on every call: 26-32 us of
host per launch on the H200's host, where the compiled kernel's launcher alone takes 11-13 us
(benchmarks/results/host_path_h200_2026-12-03.md). The engine makes five launches per bucket
and step (185 at 1.3B), and at 2 nodes x 4 its host took about as long as the GPU
(benchmarks/host_time.py), so those microseconds were step time.

`launch` takes Triton's own path the first time it sees an argument signature, keeps the
compiled kernel that path returns, and sends later calls with that signature straight to the
compiled kernel's launcher. The signature must tell apart every pair of calls Triton would
compile apart, or a kernel specialized for 16-byte-aligned pointers could run on others:

- a tensor by its dtype and whether its address is a multiple of 16 (Triton's pointer
  specialization);
- an integer Triton does not specialize (`do_not_specialize`: the seeds) by the type Triton
  gives it (i32, i64 or u64 by range); every other integer, float or bool by its value (a
  finer split than Triton's, which looks at == 1 and multiples of 16: the engine's sizes are the
  same every step, so each bucket settles on one signature);
- constexprs and compile options by value.

tests/unit/test_launch_gpu.py checks that split against the kernel Triton's own path picks for the
same arguments (its warmup run). Triton's path is taken
every time where it must run: in the interpreter (no compiled kernel), and while a launch hook
is set (a profiler such as Proton watches launches through it).
"""

from __future__ import annotations

from typing import Any

import torch

from ._columns import INTERPRETING, triton

__all__ = ["launch"]

_I32, _I64 = 2**31, 2**63
_MAX_SIGNATURES = 4096  # past this many the cache starts over (a job of ever-new sizes)
_compiled: dict[tuple, Any] = {}  # (kernel, device, signature) -> Triton's CompiledKernel
_unspecialized: dict[Any, frozenset[int]] = {}  # kernel -> positions of its do_not_specialize arguments


def _integer_type(value: int) -> str:
    if -_I32 <= value < _I32:
        return "i32"
    return "i64" if -_I64 <= value < _I64 else "u64"


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    unspecialized = _unspecialized.get(kernel)
    if unspecialized is None:
        unspecialized = _unspecialized[kernel] = frozenset(p.num for p in kernel.params if p.do_not_specialize)
    parts: list[Any] = []
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            parts.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif position in unspecialized and type(arg) is int:
            parts.append(_integer_type(arg))
        else:
            parts.append((type(arg), arg))
    parts.extend(kwargs.items())  # keyword arguments come in the call site's fixed order
    return tuple(parts)


def _hooked() -> bool:
    """Whether a launch hook is set: a chain with calls in it (Triton 3.6-3.9), or a function."""
    runtime = triton.knobs.runtime
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)` on the current CUDA device and stream, with its positional
    arguments first and then its constexprs and compile options as keywords, every constexpr
    given (none left to a default)."""
    if INTERPRETING or _hooked():
        kernel[grid](*args, **kwargs)
        return
    driver = triton.runtime.driver.active  # Triton's own device and stream look-ups (torch's)
    device = driver.get_current_device()
    key = (kernel, device, _signature(kernel, args, kwargs))
    compiled = _compiled.get(key)
    if compiled is None:
        if len(_compiled) >= _MAX_SIGNATURES:
            _compiled.clear()
        _compiled[key] = kernel[grid](*args, **kwargs)
        return
    # The compiled launcher takes every parameter in the kernel's order, constexprs included;
    # no launch metadata and no hooks (`_hooked` is False).
    params = [*args, *(kwargs[name] for name in kernel.arg_names[len(args) :])]
    x, y, z = (*grid, 1, 1)[:3]
    stream = driver.get_current_stream(device)
    compiled.run(x, y, z, stream, compiled.function, compiled.packed_metadata, None, None, None, *params)
