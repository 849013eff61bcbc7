"""Module buffers (BatchNorm's running statistics, any registered buffer) follow DDP's
`broadcast_buffers=True`: before a forward, every replica takes rank 0's buffers.

DDP's rule, which this reproduces step for step so that every rank's buffers equal DDP's bit for
bit: before each forward of the wrapped module, if the previous forward ran with gradients
enabled and gradient sync on (or no forward ran yet), rank 0's buffers are broadcast to every
rank. Under Lightning "a forward" is one `training_step` / `validation_step` / ... call (DDP's
wrapper runs them as its forward), so a validation forward after a training step broadcasts, the
next ones (under no_grad) do not, and the first micro-batch of an accumulation window broadcasts
while the following ones (under no_sync) do not. After the last training step each rank holds
rank 0's buffers of before that step, updated by its own batch, exactly as under DDP.

The broadcast completes before the forward starts, as DDP's does: the step may read a buffer
anywhere (the LightningModule's own buffer in `training_step`, a submodule's buffer read without
its forward). It is one collective per buffer dtype on the engine's own world communicator ([B]
elements of one dtype, concatenated); on NCCL its wait is a stream dependency, so the host does
not stop. `SimulatedBuffers` (`lightning_sdp4bit.simulation`) applies the same rule to the
buffers of every rank of a simulated job. No Lightning here: a test drives it with a plain module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_sdp4bit import comm

__all__ = ["BufferBroadcast", "BufferRule"]


class BufferRule:
    """DDP's schedule of buffer broadcasts (the module docstring): `due()` before a forward,
    `after_forward(grad_sync)` after it. `enabled=False` is DDP's `broadcast_buffers=False`."""

    def __init__(self, module: nn.Module, enabled: bool = True):
        self.module, self.enabled = module, enabled
        self._sync_next = True  # DDP's require_forward_param_sync: True before the first forward
        # (owner, name) of every buffer, the same on every rank (so the collectives match). The
        # tensor is looked up at each broadcast, since a module may re-assign a buffer
        # (self.buf = new tensor): host cost one lookup per buffer, not a walk over the modules.
        self._slots = [(m, name) for m in module.modules() for name, b in m._buffers.items() if b is not None]

    def due(self) -> bool:
        return self.enabled and self._sync_next and bool(self._slots)

    def before_forward(self) -> None:
        """Before a forward: every rank takes rank 0's buffers if `due()` (how is the subclass's)."""
        raise NotImplementedError

    def after_forward(self, grad_sync: bool) -> None:
        """DDP: the next forward broadcasts when this one ran with gradients enabled and
        `grad_sync` (outside no_sync)."""
        self._sync_next = torch.is_grad_enabled() and grad_sync

    def buffers(self) -> list[Tensor]:
        """The module's buffers now, in a fixed order (a buffer set to None since is left out on
        every rank alike)."""
        return [b for b in (owner._buffers.get(name) for owner, name in self._slots) if b is not None]


class BufferBroadcast(BufferRule):
    """Rank 0's buffers to every rank of `group` before a forward, on DDP's schedule. `timeouts`
    names the broadcast in the error of a wait that times out (`comm.Timeouts`)."""

    def __init__(
        self, module: nn.Module, group: Any, rank: int, enabled: bool = True, timeouts: comm.Timeouts | None = None
    ):
        super().__init__(module, enabled)
        self.group, self.rank = group, rank
        self._timeouts = timeouts if timeouts is not None else comm.Timeouts(rank)

    def before_forward(self) -> None:
        """Broadcast rank 0's buffers if DDP would before this forward. Collective when it does."""
        if not self.due():
            return
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for buffer in self.buffers():
            by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        with torch.no_grad():
            in_flight = []
            for buffers in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                in_flight.append((buffers, flat, comm.broadcast(flat, src=0, group=self.group, async_op=True)))
            for buffers, flat, work in in_flight:
                with self._timeouts.named("the module buffers' broadcast"):
                    work.wait()
                if self.rank != 0:  # rank 0's buffers are the source, unchanged
                    pieces = torch.split(flat, [b.numel() for b in buffers])
                    torch._foreach_copy_(buffers, [p.view_as(b) for p, b in zip(pieces, buffers, strict=True)])
