"""Switching the current CUDA stream at the host cost the hot paths can afford.

Each bucket's exchange asks for the current stream and switches to a side stream several times
(`collectives.TwoStage`), 37 buckets a step at 1.3B. `torch.cuda.current_stream()` without a
device, and the `torch.cuda.stream(s)` context (which asks for the current device itself, twice),
look the device up on every call: the driver's device count, then the current device. At 1.3B,
W = 8, the forward called `torch.cuda.current_stream` 387 times (the engine's exchanges and the
emulated network's lanes), 7.6 us a call on the H200's host against 3.4 us with the device index
given (benchmarks/results/host_path_h200_2026-12-03.md; cProfile had put it at 32 us). With the
index (`torch.cuda.current_stream(index)`, `running_on`) the lookup is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["running_on"]


@contextlib.contextmanager
def running_on(stream: torch.cuda.Stream) -> Iterator[torch.cuda.Stream]:
    """Within, `stream` is its device's current stream; the previous one again after (as
    `torch.cuda.stream(stream)`, which also leaves the current device as it is). Yields the
    previous stream, which callers that order `stream` after it would otherwise look up again."""
    previous = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    try:
        yield previous
    finally:
        torch.cuda.set_stream(previous)
