"""The one communication module: every collective the engine issues goes through here.

Why one module: it is the single place that picks between torch's old and new collective names
(torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single; 2.11 has only the old names), and the single place that the compressed
paths and the tests patch. Callers use `comm.<name>(...)` through the module, never a
from-import, so that a patch here is seen everywhere.

Every function takes the process group and `async_op` like torch.distributed, and returns the
Work handle (or None when synchronous).

**Sums in rank order on gloo.** gloo's reduce-scatter is an all-reduce (twice the bytes), and
the order in which its ring adds the ranks' values depends on the chunk and the world size. On a
gloo group the two summing collectives therefore move the rows with a plain all-to-all (or
all-gather) and add them here, in rank order (`sum_rows_into`): the same bytes as a direct
reduce-scatter, and a result that depends only on the ranks' inputs. That is what lets
`lightning_sdp4bit.simulation` run a job of W ranks in one process and agree with the real job
bit for bit. NCCL groups keep NCCL's own reduce-scatter and all-reduce (their order is NCCL's).

**Simulated groups.** A group object with `simulated = True` (`lightning_sdp4bit.simulation`)
stands for one rank's membership of a group of ranks that all live in this process: each
function hands the call to it.

**Timeouts.** A collective that outlasts its group's timeout (a peer stalled or died) fails with
the backend's words, and gloo's depend on where the timeout struck: the operation whose own wait
ran out says "Timed out waiting 10000ms for recv operation to complete", every other one in flight
on the group "Application timeout caused pair closure". Every wait of the engine and the
strategies runs in `Timeouts.named(exchange)`, which turns either wording (`is_timeout`) into one
`CollectiveTimeoutError` naming the exchange, the rank and the timeout, the backend's error
chained; any other error passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveTimeoutError",
    "Timeouts",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "is_timeout",
    "reduce_scatter",
    "sum_rows_into",
    "sum_rows_into_each",
]

# torch >= 2.13 calls the old names from the new ones and warns on the old: prefer the new.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sum_rows_into_each(outputs: Sequence[Tensor], rows: Sequence[Sequence[Tensor]]) -> None:
    """outputs[p] = rows[0][p] + rows[1][p] + ... + rows[P-1][p] for every p, added left to right
    in that order (views need not be contiguous).

    The one definition of a cross-rank sum that gloo groups and simulated groups share: a left
    fold in rank order, so that the result depends on nothing but the rows. Taken for every
    output at once, with one multi-tensor copy and one multi-tensor add per row: on a GPU a
    launch or two each, not one per output (a simulated reduce-scatter over P members has P)."""
    outputs = list(outputs)
    torch._foreach_copy_(outputs, list(rows[0]))
    for row in rows[1:]:
        torch._foreach_add_(outputs, list(row))


def sum_rows_into(output: Tensor, rows: Tensor | Sequence[Tensor]) -> None:
    """output [n] = rows[0] + rows[1] + ... + rows[P-1]: `sum_rows_into_each` of one output.
    rows: [P, n], or P tensors [n]."""
    sum_rows_into_each([output], [[row] for row in rows])


class _SumOnWait:
    """The Work of a summing collective done as a move then a local sum: `wait` adds the rows."""

    def __init__(self, work: Any, finish: Any):
        self._work, self._finish = work, finish

    def is_completed(self) -> bool:
        return self._finish is None or self._work.is_completed()

    def wait(self) -> bool:
        if self._finish is not None:
            self._work.wait()
            self._finish()
            self._finish = self._work = None
        return True

    def returned(self, async_op: bool) -> _SumOnWait | None:
        """What the collective returns: this Work, or None once done when synchronous."""
        if async_op:
            return self
        self.wait()
        return None


def _sums_in_rank_order(group: Any) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


def _simulated(group: Any) -> bool:
    return getattr(group, "simulated", False)


def all_gather(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """output [world * n] = concatenation of every rank's input [n], in rank order."""
    if _simulated(group):
        return group.all_gather(output, input, async_op)
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """output [n] = sum over ranks of input[rank * n : (rank + 1) * n], input [world * n]."""
    if _simulated(group):
        return group.reduce_scatter(output, input, async_op)
    if not _sums_in_rank_order(group):
        return _REDUCE_SCATTER(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    # Row p of `received` [P, n] is rank p's chunk for this rank.
    received = input.new_empty((dist.get_world_size(group), output.numel()))
    work = dist.all_to_all_single(received, input, group=group, async_op=True)
    return _SumOnWait(work, lambda: sum_rows_into(output, received)).returned(async_op)


def all_to_all(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Chunk p of input [P, ...] goes to peer p; chunk p of output comes from peer p (even splits)."""
    if _simulated(group):
        return group.all_to_all(output, input, async_op)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """In-place sum over the ranks of `group`."""
    if _simulated(group):
        return group.all_reduce(tensor, async_op)
    if not _sums_in_rank_order(group):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    rows = tensor.new_empty((dist.get_world_size(group), tensor.numel()))
    work = _ALL_GATHER(rows.view(-1), tensor.reshape(-1).contiguous(), group=group, async_op=True)
    return _SumOnWait(work, lambda: sum_rows_into(tensor.view(-1), rows)).returned(async_op)


def broadcast(tensor: Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """In-place copy of global rank `src`'s tensor to every rank of `group`."""
    if _simulated(group):
        return group.broadcast(tensor, src, async_op)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


# What torch 2.13's backends say when a collective outlasts its group's timeout, looked up in
# their sources (compared in lower case). Each names a timeout and nothing else: "Connection
# timed out" (ETIMEDOUT, a TCP failure that is not the group's timeout) is left out on purpose.
_TIMEOUT_WORDINGS = tuple(
    wording.lower()
    for wording in (
        # gloo, transport/tcp/unbound_buffer.cc: the operation whose own wait ran out ("... 10000ms
        # for recv|send operation to complete"); then every pair of the group's context is closed,
        # and the other operations in flight on it fail with the second wording.
        "Timed out waiting",
        "Application timeout caused pair closure",
        # gloo, transport/tcp/pair.cc and socket.cc: a synchronous pair's socket, a connection.
        "Read timeout",
        "Write timeout",
        "Connect timeout",
        "timed out connecting",
        # NCCL (ProcessGroupNCCL.cpp), raised by a wait under TORCH_NCCL_BLOCKING_WAIT=1 (otherwise
        # its watchdog takes the process down); and c10d's Work.wait(timeout).
        "Watchdog caught collective operation timeout",
        "timed out in blocking wait",
        "Operation timed out",
    )
)


def is_timeout(err: BaseException) -> bool:
    """Whether `err` is a backend's report that a collective outlasted its group's timeout. gloo
    raises RuntimeError, NCCL DistBackendError (a RuntimeError); only the words tell a timeout."""
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(wording in text for wording in _TIMEOUT_WORDINGS)


class CollectiveTimeoutError(RuntimeError):
    """A collective outlasted its group's timeout: a peer rank stalled, hung or died. Names the
    exchange, the rank that gave up and the timeout; the backend's error is its `__cause__`."""

    def __init__(self, exchange: str, rank: int | None, timeout: timedelta | None):
        self.exchange, self.rank, self.timeout = exchange, rank, timeout
        who = "this rank" if rank is None else f"rank {rank}"
        limit = "torch's default timeout" if timeout is None else f"timeout={timeout.total_seconds():g} s"
        super().__init__(
            f"sdp4bit: {who} timed out in {exchange} ({limit}): a peer rank did not take part in time "
            "(it stalled, hung or died); the backend's own error is above"
        )


class Timeouts:
    """This rank and its groups' timeout, for the errors of `named`. One per engine or strategy."""

    __slots__ = ("rank", "timeout")

    def __init__(self, rank: int | None = None, timeout: timedelta | None = None):
        self.rank, self.timeout = rank, timeout

    def named(self, exchange: str, bucket: int | None = None) -> _Named:
        """The context of a wait on `exchange` (of `bucket`, if any): a timeout inside it raises
        CollectiveTimeoutError from the backend's error. A class, not a generator: it sits on
        every bucket's wait, and costs a few hundred nanoseconds there."""
        return _Named(self, exchange, bucket)


class _Named:
    __slots__ = ("_timeouts", "_exchange", "_bucket")

    def __init__(self, timeouts: Timeouts, exchange: str, bucket: int | None):
        self._timeouts, self._exchange, self._bucket = timeouts, exchange, bucket

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> Literal[False]:
        if err is None or isinstance(err, CollectiveTimeoutError) or not is_timeout(err):
            return False  # done, named already (a nested wait), or not a timeout: it goes on as it was
        exchange = self._exchange if self._bucket is None else f"bucket {self._bucket}'s {self._exchange}"
        raise CollectiveTimeoutError(exchange, self._timeouts.rank, self._timeouts.timeout) from err
