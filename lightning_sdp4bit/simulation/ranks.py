"""What a simulated rank keeps between its turns: its RNG state and its module buffers.

A real job's processes each have their own torch generators and their own copy of the module's
buffers. A simulated job runs every rank in one process, one after another, so it keeps ranks
1..W-1's and swaps each in for that rank's turn (`ShardedEngine.running_as`): the process's own
generators and the module's buffers are rank 0's, which runs last in each step. So every rank
draws its own stream: the same seeding and set-up as rank 0 (`share_rng_state`), then its own
draws (its dropout masks, its DataLoader iterators' base seeds, its validation) in order, as
its process would. Draws made outside any rank's turn (a callback's) are rank 0's alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RankStates"]

_RngState = tuple[Tensor, Tensor | None]  # the CPU generator's state, and the device's (CUDA) or None


def _rng_state(device: torch.device) -> _RngState:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: _RngState, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class RankStates:
    """Ranks 1..W-1's RNG states and buffer values; rank 0's are the process's and the module's."""

    def __init__(self, module: nn.Module, world: int, device: torch.device):
        self._module, self._device, self._world = module, device, world
        self._rng: list[_RngState | None] = [None] * world
        self._buffers: list[list[Tensor] | None] = [None] * world
        self._held: tuple[_RngState, list[Tensor]] | None = None  # rank 0's, during another rank's turn
        self.share_rng_state()
        self.share_buffers()

    def share_rng_state(self) -> None:
        """Every rank's RNG state becomes the process's now."""
        state = _rng_state(self._device)
        self._rng = [None] + [state] * (self._world - 1)

    def share_buffers(self) -> None:
        """Every rank's buffers become rank 0's, the module's now: DDP's broadcast."""
        values = [b.detach().clone() for b in self._module.buffers()]
        self._buffers = [None] + [values] * (self._world - 1)  # read-only until a rank's turn replaces its own

    def enter(self, rank: int) -> None:
        """Rank `rank`'s turn begins: its generators and buffers replace rank 0's (kept aside)."""
        if rank == 0:
            return
        buffers = list(self._module.buffers())
        self._held = (_rng_state(self._device), [b.detach().clone() for b in buffers])
        state = self._rng[rank]
        assert state is not None  # ranks 1..W-1 always hold one
        _set_rng_state(state, self._device)
        self._copy_into(buffers, self._buffers[rank])

    def leave(self, rank: int) -> None:
        """Rank `rank`'s turn ends: its generators and buffers are kept, rank 0's come back."""
        if rank == 0:
            return
        assert self._held is not None
        buffers = list(self._module.buffers())
        self._rng[rank] = _rng_state(self._device)
        self._buffers[rank] = [b.detach().clone() for b in buffers]
        rng, mine = self._held
        _set_rng_state(rng, self._device)
        self._copy_into(buffers, mine)
        self._held = None

    @staticmethod
    def _copy_into(buffers: list[Tensor], values: list[Tensor] | None) -> None:
        if values is None:
            return
        if len(values) != len(buffers):
            raise RuntimeError(
                f"simulation: the module has {len(buffers)} buffers now and {len(values)} when they were shared; "
                "a simulated job needs the same buffers throughout (register them before fit)"
            )
        with torch.no_grad():
            for buffer, value in zip(buffers, values, strict=True):
                buffer.copy_(value)
