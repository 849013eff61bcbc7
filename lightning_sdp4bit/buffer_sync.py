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

The broadcast is one collective per buffer dtype on the engine's own world communicator, started
without waiting ([B] elements of one dtype, concatenated); the forward pre-hook of each module
that owns buffers waits for it just before that module runs (on NCCL a wait is a stream
dependency, no host synchronisation), and `after_forward` waits for whatever no module read.
No Lightning here: a test drives it with a plain module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sdp4bit import comm

__all__ = ["BufferBroadcast"]


class BufferBroadcast:
    """Rank 0's buffers to every rank before a forward, on DDP's schedule (see the module docstring).

    `enabled=False` is DDP's `broadcast_buffers=False`: each rank keeps its own buffers. `timeouts`
    names the broadcast in the error of a wait that times out (`comm.Timeouts`)."""

    def __init__(
        self, module: nn.Module, group: Any, rank: int, enabled: bool = True, timeouts: comm.Timeouts | None = None
    ):
        self.module, self.group, self.rank, self.enabled = module, group, rank, enabled
        self._timeouts = timeouts if timeouts is not None else comm.Timeouts(rank)
        self._sync_next = True  # DDP's require_forward_param_sync: True before the first forward
        # Per dtype: (the buffers, their concatenation [B] being broadcast, its Work handle).
        self._in_flight: list[tuple[list[Tensor], Tensor, Any]] = []
        # (owner, name) of every buffer, the same on every rank (so the collectives match). The
        # tensor is looked up at each broadcast, since a module may re-assign a buffer
        # (self.buf = new tensor): host cost one lookup per buffer, not a walk over the modules.
        self._slots = [(m, name) for m in module.modules() for name, b in m._buffers.items() if b is not None]
        self._handles = [
            m.register_forward_pre_hook(_BufferWaitHook(self))
            for m in module.modules()
            if enabled and any(True for _ in m.buffers(recurse=False))
        ]

    def before_forward(self) -> None:
        """Start the broadcast if DDP would broadcast before this forward. Collective when it does."""
        if not self.enabled or not self._sync_next or self._in_flight or not self._slots:
            return
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for owner, name in self._slots:
            buffer = owner._buffers.get(name)
            if buffer is not None:  # a buffer set to None since is left out on every rank alike
                by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        with torch.no_grad():
            for buffers in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                work = comm.broadcast(flat, src=0, group=self.group, async_op=True)
                self._in_flight.append((buffers, flat, work))

    def wait(self) -> None:
        """Complete the broadcast and copy rank 0's values into this rank's buffers. Idempotent."""
        if not self._in_flight:
            return  # the usual case in a module's pre-hook: nothing to trace under torch.compile
        in_flight, self._in_flight = self._in_flight, []
        with torch.no_grad():
            for buffers, flat, work in in_flight:
                with self._timeouts.named("the module buffers' broadcast"):
                    work.wait()
                if self.rank == 0:
                    continue  # its buffers are the source, unchanged since the start
                pieces = torch.split(flat, [b.numel() for b in buffers])
                torch._foreach_copy_(buffers, [p.view_as(b) for p, b in zip(pieces, buffers)])

    def after_forward(self, grad_sync: bool) -> None:
        """After the forward: finish the broadcast, and note whether the next forward broadcasts
        (DDP: when this one ran with gradients enabled and `grad_sync`, i.e. outside no_sync)."""
        self.wait()
        self._sync_next = torch.is_grad_enabled() and grad_sync

    def follow_forward(self, grad_sync: Callable[[], bool]) -> None:
        """Run around every forward of the module itself (what DDP's wrapper wraps): for an adapter
        whose forward is the module's (Fabric). `grad_sync()` says whether gradient sync is on."""
        if self.enabled:
            # Prepended: the broadcast must start before the root's own wait hook (if it owns buffers).
            self._handles.append(self.module.register_forward_pre_hook(_BeforeForward(self), prepend=True))
            self._handles.append(self.module.register_forward_hook(_AfterForward(self, grad_sync)))

    def close(self) -> None:
        """Finish what is in flight and remove the hooks."""
        self.wait()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _BufferWaitHook:
    """Forward pre-hook of a module that owns buffers: its buffers must have landed first."""

    def __init__(self, broadcast: BufferBroadcast):
        self.broadcast = broadcast

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.broadcast.wait()

    def __deepcopy__(self, memo: dict) -> _NoWait:
        # A deep copy of the module (an EMA or SWA average) is no replica: it waits for nothing.
        return _NoWait()


class _NoWait:
    def __call__(self, module: nn.Module, *args: Any) -> None:
        return None


class _BeforeForward(_BufferWaitHook):
    """Forward pre-hook of the root module: start the broadcast if DDP would."""

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.broadcast.before_forward()


class _AfterForward(_BufferWaitHook):
    """Forward hook of the root module: finish the broadcast, note DDP's rule for the next one."""

    def __init__(self, broadcast: BufferBroadcast, grad_sync: Callable[[], bool]):
        super().__init__(broadcast)
        self.grad_sync = grad_sync

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.broadcast.after_forward(self.grad_sync())
