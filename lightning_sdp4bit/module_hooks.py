"""The engine's hooks on the module: where autograd and forward hand control to the engine.

- A post-accumulate-grad hook per trained parameter: its gradient is complete, so the engine
  puts it into the bucket's window gradients and may start the bucket's exchange.
- A forward pre-hook per module that owns trained parameters: the engine completes the weight
  all-gathers of that module's buckets just before its forward reads them (with the weights
  sharded inside the node, gathers them; a forward hook then says the module is done,
  `node_shards`).
- `CompiledRegionWatch`: learns whether those pre-hooks run inside torch.compile-d code.

Hooks are small classes, not closures, so that they pickle and read well. A deep copy of the
module (an EMA or SWA average, say) is no replica: its forward pre-hooks become inert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_sdp4bit.engine import ShardedEngine

__all__ = ["CompiledRegionWatch", "register_hooks"]


def register_hooks(engine: ShardedEngine) -> list[Any]:
    """Register both kinds of hook for every bucket; returns the handles (for `remove()`)."""
    handles = []
    for bucket in engine.buckets:
        for position, param in enumerate(bucket.params):
            hook = _GradReadyHook(engine, bucket.layout.index, position)
            handles.append(param.register_post_accumulate_grad_hook(hook))
    bucket_of = {id(p): b.layout.index for b in engine.buckets for p in b.params}
    shards = engine.primary.node_shards
    for module in engine.module.modules():
        indices = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
        if not indices:
            continue
        handles.append(module.register_forward_pre_hook(_WeightWaitHook(engine, indices)))
        if shards is not None:
            shards.add_user(module, indices)
            release = _ReleaseHook(shards.after_module_forward, indices)
            handles.append(module.register_forward_hook(release, with_kwargs=True))
    return handles


class _GradReadyHook:
    """Post-accumulate-grad hook of one parameter."""

    def __init__(self, engine: ShardedEngine, index: int, position: int):
        self.engine, self.index, self.position = engine, index, position

    def __call__(self, param: Tensor) -> None:
        self.engine.on_grad_ready(self.index, self.position)


class _WeightWaitHook:
    """Forward pre-hook: wait for the buckets holding this module's own parameters (with the
    weights sharded inside the node, gather them)."""

    def __init__(self, engine: ShardedEngine, indices: list[int]):
        self.engine, self.indices = engine, indices

    def __call__(self, module: nn.Module, args: tuple) -> None:
        shards = self.engine.primary.node_shards
        if shards is None:
            self.engine.wait_weights(self.indices)
        else:
            shards.before_module_forward(module, self.indices)

    def __deepcopy__(self, memo: dict) -> _InertHook:
        return _InertHook()


class _ReleaseHook:
    """Forward hook (weights sharded inside the node): this module's forward is done; its inputs
    (one tensor, most often) and output go with it."""

    def __init__(self, done: Callable[[nn.Module, list[int], Any, Any], None], indices: list[int]):
        self.done, self.indices = done, indices

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.done(module, self.indices, args[0] if len(args) == 1 and not kwargs else (args, kwargs), output)

    def __deepcopy__(self, memo: dict) -> _InertHook:
        return _InertHook()


class _InertHook:
    def __call__(self, module: nn.Module, *args: Any) -> None:
        return None


class CompiledRegionWatch:
    """Learns whether the engine's forward pre-hooks run inside torch.compile-d code.

    Under compile, a forward pre-hook that waits on an all-gather cannot be traced (dynamo graph-
    breaks on `Work.wait`) and its check of the pending set guards the graph, which recompiles
    whenever that set changes. Both go away when nothing is pending by the time compiled code
    runs: the hooks then trace as no-ops over an empty set. This watch sits beside each hooked
    module; dynamo runs its hook at trace time (is_compiling() is True only then) and replays
    the attribute store on every call of the graph, so `seen` turns True from the first compiled
    forward on, and the engine's `post_optimizer_step` then completes the all-gathers at once.
    """

    def __init__(self, module: nn.Module, refuse: bool = False):
        self.seen = False
        self._refuse = refuse  # weight_sharding="node": not under compile (yet); say so at trace time
        self._handles = [
            m.register_forward_pre_hook(self._hook)
            for m in module.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]

    def _hook(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            if self._refuse:
                raise RuntimeError(
                    'sdp4bit: weight_sharding="node" does not run under torch.compile yet (its gathers and '
                    "releases swap the parameters' storage between forwards, which a compiled graph would not "
                    'see): train this module eagerly, or with weight_sharding="replicated"'
                )
            self.seen = True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
