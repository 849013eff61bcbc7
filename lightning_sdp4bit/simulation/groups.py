"""Process groups whose ranks all live in one process: the communicators of a simulated job.

A `SimulatedGroup` stands for a group of P ranks; `member(i)` is the handle rank i passes to
`lightning_sdp4bit.comm` (which hands the call here, see its docstring). Each collective is a
rendezvous: every member deposits its input and output, and when the last one arrives the data
moves, by indexing, with the sums taken in rank order, exactly as a gloo group of real
processes sums them (`comm.sum_rows_into`; a reduce-scatter's P outputs at once by
`comm.sum_rows_into_each`). Nothing blocks: the driver (`simulation.engine`) calls the P members
of a group one after another, and waits for a collective only after all of them launched it (a
wait before that is a bug in the driver, and raises).

Only asynchronous collectives are supported: a synchronous one would have to return before the
other members had called it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_sdp4bit.comm import sum_rows_into, sum_rows_into_each

__all__ = ["SimulatedGroup", "SimulatedMember"]


class _Rendezvous:
    """One collective in progress: the members' (input, output) pairs until the last arrives."""

    def __init__(self, size: int, op: str, complete: Callable[[list[tuple[Tensor, Tensor]]], None]):
        self.op, self._complete = op, complete
        self.arrived: list[tuple[Tensor, Tensor] | None] = [None] * size
        self.done = False

    def deposit(self, index: int, pair: tuple[Tensor, Tensor]) -> None:
        if self.arrived[index] is not None:
            raise AssertionError(f"simulated rank {index} launched {self.op} twice")
        self.arrived[index] = pair
        if all(p is not None for p in self.arrived):
            self._complete(self.arrived)  # type: ignore[arg-type]
            self.arrived, self.done = [], True


class _Work:
    """The Work handle a member gets back: done once every member has launched the collective."""

    def __init__(self, rendezvous: _Rendezvous, index: int):
        self._rendezvous, self._index = rendezvous, index

    def is_completed(self) -> bool:
        return self._rendezvous.done

    def wait(self) -> bool:
        if not self._rendezvous.done:
            missing = [i for i, p in enumerate(self._rendezvous.arrived) if p is None]
            raise RuntimeError(
                f"simulation: member {self._index} waited for {self._rendezvous.op} before members {missing} of its "
                "group launched it (the driver must launch a collective on every member before waiting)"
            )
        return True


@dataclass
class SimulatedGroup:
    """A group of `size` simulated ranks. Collectives are matched per member in launch order, as a
    real communicator matches them: member i's k-th collective pairs with every other member's k-th."""

    size: int
    name: str = "group"
    _queues: list[deque[_Rendezvous]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._queues = [deque() for _ in range(self.size)]

    def member(self, index: int) -> SimulatedMember:
        return SimulatedMember(self, index)

    def _join(self, index: int, op: str, pair: tuple[Tensor, Tensor], complete) -> _Work:
        # The oldest collective this member has not joined yet, or a new one.
        queue = self._queues[index]
        if queue:
            rendezvous = queue.popleft()
            if rendezvous.op != op:
                raise RuntimeError(
                    f"simulation: member {index} of {self.name} launched {op} where its peers launched {rendezvous.op}"
                )
        else:
            rendezvous = _Rendezvous(self.size, op, complete)
            for other in range(self.size):
                if other != index:
                    self._queues[other].append(rendezvous)
        rendezvous.deposit(index, pair)
        return _Work(rendezvous, index)


@dataclass(frozen=True)
class SimulatedMember:
    """Member `index` of `group`: what `lightning_sdp4bit.comm` receives as the process group."""

    group: SimulatedGroup
    index: int
    simulated = True

    def _check_async(self, op: str, async_op: bool) -> None:
        if not async_op:
            raise RuntimeError(
                f"simulation: a synchronous {op} on a simulated group cannot return before the other ranks "
                "called it; the simulated job issues only asynchronous collectives"
            )

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool) -> _Work:
        """Chunk p of member q's input lands as chunk q of member p's output."""
        self._check_async("all_to_all", async_op)
        size = self.group.size

        def complete(pairs: list[tuple[Tensor, Tensor]]) -> None:
            sent = [inp.view(size, -1) for inp, _ in pairs]
            for p, (_, out) in enumerate(pairs):  # stacked straight into the output: one copy
                torch.stack([sent[q][p] for q in range(size)], out=out.view(size, -1))

        return self.group._join(self.index, "all_to_all", (input, output), complete)

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool) -> _Work:
        """Every member's output [P * n] = the members' inputs [n] in member order. Outputs that
        are the same tensor (one copy of the weights serving every rank) are written once."""
        self._check_async("all_gather", async_op)

        def complete(pairs: list[tuple[Tensor, Tensor]]) -> None:
            gathered = torch.cat([inp.reshape(-1) for inp, _ in pairs])
            for out in _distinct(out for _, out in pairs):
                out.view(-1).copy_(gathered)

        return self.group._join(self.index, "all_gather", (input, output), complete)

    def reduce_scatter(self, output: Tensor, input: Tensor, async_op: bool) -> _Work:
        """Member p's output [n] = the members' chunk p, summed in member order."""
        self._check_async("reduce_scatter", async_op)
        size = self.group.size

        def complete(pairs: list[tuple[Tensor, Tensor]]) -> None:
            outputs = [out for _, out in pairs]
            # Member q's input, as its P chunks; the fold reads them in place.
            sum_rows_into_each(outputs, [inp.view(size, -1).unbind() for inp, _ in pairs])

        return self.group._join(self.index, "reduce_scatter", (input, output), complete)

    def all_reduce(self, tensor: Tensor, async_op: bool) -> _Work:
        """Every member's tensor = the members' tensors summed in member order."""
        self._check_async("all_reduce", async_op)

        def complete(pairs: list[tuple[Tensor, Tensor]]) -> None:
            rows = [t.reshape(-1) for t, _ in pairs]
            total = torch.empty_like(rows[0])
            sum_rows_into(total, rows)
            for t in _distinct(t for t, _ in pairs):
                t.view(-1).copy_(total)

        return self.group._join(self.index, "all_reduce", (tensor, tensor), complete)

    def broadcast(self, tensor: Tensor, src: int, async_op: bool) -> _Work:
        self._check_async("broadcast", async_op)

        def complete(pairs: list[tuple[Tensor, Tensor]]) -> None:
            source = pairs[src][0].clone()
            for t in _distinct(t for t, _ in pairs):
                t.copy_(source)

        return self.group._join(self.index, "broadcast", (tensor, tensor), complete)


def _distinct(tensors) -> list[Tensor]:
    """The tensors, each storage region once (the same view passed by several members)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
