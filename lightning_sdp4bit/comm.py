"""The one communication module: every collective the engine issues goes through here.

Why one module: it is the single place that picks between torch's old and new collective names
(torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single; 2.11 has only the old names), and the single place that the compressed
paths and the tests patch. Callers use `comm.<name>(...)` through the module, never a
from-import, so that a patch here is seen everywhere.

Every function takes the process group and `async_op` like torch.distributed, and returns the
Work handle (or None when synchronous).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]

# torch >= 2.13 calls the old names from the new ones and warns on the old: prefer the new.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """output [world * n] = concatenation of every rank's input [n], in rank order."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """output [n] = sum over ranks of input[rank * n : (rank + 1) * n], input [world * n]."""
    return _REDUCE_SCATTER(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Chunk p of input [P, ...] goes to peer p; chunk p of output comes from peer p (even splits)."""
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """In-place sum over the ranks of `group`."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def broadcast(tensor: Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """In-place copy of global rank `src`'s tensor to every rank of `group`."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
