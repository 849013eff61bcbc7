"""Full reduced gradients on the module's parameters, for hooks that read or edit `p.grad`.

Under the engine a parameter's `.grad` is None after backward: its gradient lives, reduced,
in the owners' gradient shards [S]. Code written for DDP (Lightning's `grad_norm`, gradient
histograms, gradient surgery in `on_before_optimizer_step`) reads and edits `p.grad`.
`gradients_on_parameters` all-gathers the shards into one fp32 buffer [N] per bucket, sets
every parameter's `.grad` to its slice (None for parameters that got no gradient on any rank,
as DDP leaves them), and afterwards copies edits back into this rank's shard and frees them.
A `.grad` a hook set to None means what it means under DDP: the optimizer skips that parameter
this step (no momentum, no weight decay); its elements of the shard become zero so that a
clip by norm leaves it out.

It costs one fp32 all-gather of the gradients (4 bytes per element on the wire), so the
adapter opens it only around hooks a user overrode.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from lightning_sdp4bit import comm

if TYPE_CHECKING:
    from lightning_sdp4bit.rank import ShardedRank

__all__ = ["gradients_on_parameters"]


@contextmanager
def gradients_on_parameters(rank: ShardedRank) -> Generator[None, None, None]:
    """Within the block, every trained parameter's `.grad` is the averaged gradient; `rank`'s
    window must be reduced (`ShardedEngine.reduced_gradients`). Collective."""
    assert rank.verdict is not None
    used = rank.verdict.used
    exposed = []  # per bucket: the full buffer [N] and each parameter's (grad as set, its version)
    offset = 0
    with torch.no_grad():
        for bucket in rank.buckets:
            full = torch.empty(bucket.layout.numel, dtype=torch.float32, device=bucket.grad_shard.device)
            with rank.timeouts.named("reduced-gradient all-gather", bucket.layout.index):
                comm.all_gather(full, bucket.grad_shard, group=rank.groups.world)
            given = []
            for position, (slot, param) in enumerate(zip(bucket.layout.slots, bucket.params, strict=True)):
                view = full[slot.start : slot.start + slot.numel].view(slot.shape)
                param.grad = view.to(param.dtype) if used[offset + position] else None
                given.append((param.grad, None if param.grad is None else param.grad._version))
            offset += len(bucket.params)
            exposed.append((full, given))
    try:
        yield
    finally:
        dropped = []  # trained-parameter indices whose .grad a hook set to None
        offset = 0
        with torch.no_grad():
            for bucket, (full, given) in zip(rank.buckets, exposed, strict=True):
                edited = False
                for position, (slot, param, (grad, version)) in enumerate(
                    zip(bucket.layout.slots, bucket.params, given, strict=True)
                ):
                    now = param.grad
                    if now is not grad or (now is not None and now._version != version):
                        window = full[slot.start : slot.start + slot.numel]
                        window.copy_(now.reshape(-1) if now is not None else torch.zeros_like(window))
                        edited = True
                    if now is None and grad is not None:
                        dropped.append(offset + position)
                    param.grad = None
                offset += len(bucket.params)
                if edited:
                    lo, hi = bucket.layout.shard_bounds(rank.topology.rank)
                    bucket.grad_shard.copy_(full[lo:hi])
        rank.drop_grads(dropped)
