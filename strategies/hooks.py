"""What Lightning's hooks see under sdp4bit: complete weights, and gradients on the parameters.

The engine overlaps the weight all-gather with the next forward: after the optimizer step the
model weights are EXCHANGING (`lightning_sdp4bit.schedule`) until each module's forward
pre-hook waits for its buckets. A callback or module hook that runs in between (weight logging,
EMA, SWA, export, an in-place clamp) would read half-written weights. Waiting for every bucket
after each step would cost the overlap for everyone, so the wait is lazy:
- `WeightReadingHooks` wraps, on the instance, every hook that a user's callback or the
  LightningModule overrides, so that it first completes the weight exchange, and runs it with
  writes through `p.data` tracked (`lightning_sdp4bit.weight_access.DataWriteTracker`: an
  average copied in by EMAWeightAveraging reaches the masters even where it equals the weights). Hooks that only
  Lightning's own callbacks define (progress bars, ModelCheckpoint, which saves through the
  strategy, LearningRateMonitor, ...) read no weights and are left alone: with none overridden,
  nothing waits outside the forward pre-hooks. A callback or module whose hooks read no
  weights (a timer, a metrics logger) says so with a class attribute `reads_weights = False`.
- `overrides_hook` tells the adapter whether anyone reads `p.grad` in `on_before_optimizer_step`,
  so that the full gradients (an fp32 all-gather) are put on the parameters only then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import callbacks

from lightning_sdp4bit.strategies.common import callbacks_of

__all__ = ["WeightReadingHooks", "overrides_hook"]

# Lightning's callbacks that read no weights in their hooks (ModelCheckpoint saves through the
# strategy, which waits itself); a user's subclass that overrides a hook is wrapped all the same.
_READS_NO_WEIGHTS: tuple[type, ...] = (
    callbacks.Callback,
    callbacks.DeviceStatsMonitor,
    callbacks.EarlyStopping,
    callbacks.GradientAccumulationScheduler,
    callbacks.LearningRateMonitor,
    callbacks.ModelCheckpoint,
    callbacks.ModelSummary,
    callbacks.ProgressBar,
    callbacks.ThroughputMonitor,
    callbacks.Timer,
)

# Hooks that run while the loss's autograd graph is alive: there a `.data` write handed out as
# `p.detach()` would fail backward's check of saved tensors, where DDP lets it pass.
_GRAPH_ALIVE = frozenset({"on_before_backward"})

# Every hook that can run between an optimizer step and the next forward, or after fit.
# (setup runs before the engine exists; on_before_optimizer_step runs after forward waited.)
_HOOKS = tuple(sorted({name for name in dir(callbacks.Callback) if name.startswith("on_")} | {"teardown"}))


def _defining_class(obj: Any, name: str) -> type | None:
    for cls in type(obj).__mro__:
        if name in cls.__dict__:
            return cls
    return None


def overrides_hook(obj: Any, name: str) -> bool:
    """Whether `obj` (a callback or a LightningModule) has its own `name` hook."""
    owner = _defining_class(obj, name)
    if owner is None:
        return False
    if isinstance(obj, pl.LightningModule):
        return not owner.__module__.startswith("lightning.pytorch")
    return owner not in _READS_NO_WEIGHTS and not owner.__module__.startswith("lightning_sdp4bit")


class WeightReadingHooks:
    """Installs and removes the waiting wrappers around the overridden hooks of a Trainer's
    callbacks and LightningModule."""

    def __init__(self, wait: Callable[[], None], tracking_writes: Callable[[], AbstractContextManager]):
        self._wait = wait
        self._tracking_writes = tracking_writes
        self._wrapped: list[tuple[Any, str]] = []

    def install(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for obj in [*callbacks_of(trainer), module]:
            if getattr(obj, "reads_weights", True) is False:
                continue
            for name in _HOOKS:
                if overrides_hook(obj, name) and name not in vars(obj):
                    setattr(obj, name, self._waiting(getattr(obj, name), track=name not in _GRAPH_ALIVE))
                    self._wrapped.append((obj, name))

    def _waiting(self, hook: Callable[..., Any], track: bool) -> Callable[..., Any]:
        @functools.wraps(hook)
        def wait_then_call(*args: Any, **kwargs: Any) -> Any:
            self._wait()
            with self._tracking_writes() if track else nullcontext():
                return hook(*args, **kwargs)

        return wait_then_call

    def remove(self) -> None:
        for obj, name in self._wrapped:
            obj.__dict__.pop(name, None)
        self._wrapped = []

    @property
    def wrapped(self) -> list[str]:
        return [f"{type(obj).__name__}.{name}" for obj, name in self._wrapped]
