"""The engine's hooks on the module: where autograd and forward hand control to the engine.

- A post-accumulate-grad hook per trained parameter: its gradient is complete, so the engine
  puts it into the bucket's window gradients and may start the bucket's exchange.
- A forward pre-hook per module that owns trained parameters: the engine completes the weight
  all-gathers of that module's buckets just before its forward reads them.

Hooks are small classes, not closures, so that they pickle and read well. A deep copy of the
module (an EMA or SWA average, say) is no replica: its forward pre-hooks become inert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_sdp4bit.engine import ShardedEngine

__all__ = ["register_hooks"]


def register_hooks(engine: ShardedEngine) -> list[Any]:
    """Register both kinds of hook for every bucket; returns the handles (for `remove()`)."""
    handles = []
    for bucket in engine.buckets:
        for position, param in enumerate(bucket.params):
            hook = _GradReadyHook(engine, bucket.layout.index, position)
            handles.append(param.register_post_accumulate_grad_hook(hook))
    bucket_of = {id(p): b.layout.index for b in engine.buckets for p in b.params}
    for module in engine.module.modules():
        indices = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
        if indices:
            handles.append(module.register_forward_pre_hook(_WeightWaitHook(engine, indices)))
    return handles


class _GradReadyHook:
    """Post-accumulate-grad hook of one parameter."""

    def __init__(self, engine: ShardedEngine, index: int, position: int):
        self.engine, self.index, self.position = engine, index, position

    def __call__(self, param: Tensor) -> None:
        self.engine.on_grad_ready(self.index, self.position)


class _WeightWaitHook:
    """Forward pre-hook: wait for the buckets holding this module's own parameters."""

    def __init__(self, engine: ShardedEngine, indices: list[int]):
        self.engine, self.indices = engine, indices

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.engine.wait_weights(self.indices)

    def __deepcopy__(self, memo: dict) -> _InertHook:
        return _InertHook()


class _InertHook:
    def __call__(self, module: nn.Module, args: tuple) -> None:
        return None
