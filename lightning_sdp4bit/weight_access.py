"""Seeing user code touch the model weights outside the engine's hooks, through torch's function modes.

After an optimizer step the weight all-gathers overlap the next forward; each module's forward
pre-hook waits for its own buckets (`lightning_sdp4bit.module_hooks`). Code written for DDP also
reads weights elsewhere: an L2 penalty over `self.parameters()` before the forward, a functional
model that uses its `nn.Parameter`s directly (`self.emb[x] @ self.w + self.b`, no submodule
forward), a norm logged after it. And callbacks write weights through `.data`, which no version
counter sees (`p.data` is a new tensor with a version counter of its own). Two torch function
modes (`torch.overrides.TorchFunctionMode`: every torch function, tensor method and attribute
read passes through their `__torch_function__`) see both:

- `ReadGuard`, pushed from the optimizer step until the next backward while all-gathers are in
  flight: the first torch operation that touches a parameter whose bucket is still exchanging
  waits for that bucket (and those launched before it) first. Only the buckets that are read
  early lose overlap; a module read only through its forward waits there, as before. Its cost is
  one Python call per torch operation while it is pushed (a dict lookup per tensor argument).
  Once every bucket has landed it pops itself, or, where it cannot (the last one landed inside
  its own handler, or a mode pushed later sits above it), turns inert until the backward.
- `DataWriteTracker`, around the hooks of user callbacks and of the LightningModule
  (`strategies.hooks`): `p.data` of a trained parameter gives `p.detach()`, the same storage
  sharing `p`'s version counter, so that a write through it (EMAWeightAveraging's
  `p.data.copy_(average)`) counts as a write (`WeightAccess.absorb`). Only in hooks, and not in
  `on_before_backward`: between a forward and its backward, a write to a tensor sharing the
  version counter of one that autograd saved would raise, where through `.data` DDP lets it pass.

Code that turns torch function modes off (`torch._C.DisableTorchFunction`) is invisible to both;
the engine notices a read it could not see when a parameter whose bucket was still exchanging at
backward receives a gradient (`WeightAccess.grad_arrived`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_sdp4bit import ops

if TYPE_CHECKING:
    from lightning_sdp4bit.buffers import Bucket

__all__ = ["DataWriteTracker", "ReadGuard", "StackedMode", "WeightAccess", "params_touched", "unseen"]

# What `p.data` calls (equal, not identical, each time); a getset descriptor, not a Tensor.
_DATA_GET = torch._C.TensorBase.data.__get__  # type: ignore[attr-defined]


_Method = TypeVar("_Method", bound=Callable[..., Any])


def unseen(method: _Method) -> _Method:
    """Run `method` with torch function modes off: the engine's own torch calls (on its buffers,
    on the parameters' storage) are not user reads, and a guard that saw them would pay a Python
    call each, thousands in a step (every bucket's encode, decode and bookkeeping). Not for code
    that runs inside a compiled forward (the forward pre-hooks): dynamo would trace the switch."""

    @functools.wraps(method)
    def without_modes(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return method(*args, **kwargs)

    return without_modes  # type: ignore[return-value]


def params_touched(table: dict[int, Any], args: tuple, kwargs: dict) -> list[int]:
    """The ids of the parameters (`table`'s keys: id(parameter)) among a torch call's arguments,
    one level into lists (torch.cat, the foreach ops). Every torch call of a forward comes through
    here while a guard is pushed: plain loops, no generator."""
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, (list, tuple)):
            for item in value:
                if id(item) in table:
                    found.append(id(item))
        elif id(value) in table:
            found.append(id(value))
    return found


class StackedMode(TorchFunctionMode):
    """A mode pushed and popped by calls rather than a `with` block (the guard spans the user's
    loop from one optimizer step to the next backward). It pops only when it is on top of torch's
    mode stack; under a mode the user pushed since, it stays, inert, and is used again."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self._pushed = False

    def open(self) -> None:
        self.active = True
        if not self._pushed:
            self.__enter__()
            self._pushed = True

    def close(self) -> None:
        self.active = False
        size = torch._C._len_torch_function_stack()
        if self._pushed and size and torch._C._get_function_stack_at(size - 1) is self:
            self.__exit__(None, None, None)
            self._pushed = False


class ReadGuard(StackedMode):
    """Waits for a parameter's bucket before any torch operation that touches the parameter."""

    def __init__(self, wait: Callable[[int], None]):
        super().__init__()
        self._wait = wait  # completes one bucket's all-gather (and every one launched before it)
        self.pending: dict[int, int] = {}  # id(parameter) -> its bucket, for buckets still exchanging

    def expect(self, index: int, params: Iterable[nn.Parameter]) -> None:
        """Bucket `index` is exchanging: reads of `params` must wait for it."""
        for param in params:
            self.pending[id(param)] = index

    def landed(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            self.pending.pop(id(param), None)
        if not self.pending and self.active:
            self.close()  # nothing left to wait for: the rest of the step pays nothing

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.active and self.pending:
            for param_id in params_touched(self.pending, args, kwargs):
                index = self.pending.get(param_id)  # None once a wait before it landed the bucket
                if index is not None:
                    self._wait(index)
        return func(*args, **kwargs)


class DataWriteTracker(TorchFunctionMode):
    """Within the block, `p.data` of the parameters whose ids are `param_ids` is `p.detach()`:
    writes through it bump `p._version`. (A new one for each block: modes are pushed per use.)"""

    def __init__(self, param_ids: frozenset[int]):
        super().__init__()
        self._ids = param_ids

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func == _DATA_GET and args and id(args[0]) in self._ids:
            return args[0].detach()
        return func(*args, **kwargs)


class WeightAccess:
    """The engine's account of the model weights between its own exchanges: what each bucket's
    all-gather left (the applied shard [S] and every parameter's version counter), the read
    guard, and whether a read it could not see has made every step wait for all weights.

    The applied shards are written by others: by each weight exchange itself
    (`weight_collectives`: the dequantization stores this rank's shard there too, on the stream
    it runs on; the uncompressed gather writes the rounded master shard there and sends it from
    there), and by the engine where the weights change without one (its setup,
    `ShardedEngine.weights_loaded`). `absorb` reads them only after waiting for every bucket,
    which puts the compute stream behind each exchange's landing.
    """

    def __init__(self, buckets: Sequence[Bucket], rank: int, wait: Callable[[Iterable[int] | None], None]):
        self.buckets, self.rank = buckets, rank
        self.guard = ReadGuard(lambda index: wait([index]))
        self.unread_at_backward: set[int] = set()  # buckets still exchanging when backward began
        self.wait_all_after_step = False
        # Each trained parameter's version counter when its bucket's weights last landed: a write
        # through the parameter since (no_grad in-place, copy_, detach().copy_) bumps it.
        self._versions = [[param._version for param in bucket.params] for bucket in buckets]
        self._ids = frozenset(id(param) for bucket in buckets for param in bucket.params)

    def landed(self, index: int) -> None:
        """Bucket `index`'s weights are current: they are what the next writes are measured from.
        Its applied shard is already theirs (the exchange, or the load, left it); here the guard
        lets its parameters be read and their version counters are taken."""
        bucket = self.buckets[index]
        self.guard.landed(bucket.params)  # first: reading a version counter is a read the guard sees
        self._versions[index] = [param._version for param in bucket.params]

    def open_guard(self, pending: list[int]) -> None:
        for index in pending:
            self.guard.expect(index, self.buckets[index].params)
        if pending:
            self.guard.open()

    def before_backward(self, pending: list[int]) -> None:
        """`pending`: the buckets still exchanging now, which no read the guard saw has waited for."""
        self.guard.close()
        self.unread_at_backward = set(pending)

    def grad_arrived(self, index: int) -> None:
        """A gradient of bucket `index` arrived: if its new weights had not arrived when backward
        began, the forward read the previous step's weights somewhere the guard cannot see."""
        if index not in self.unread_at_backward:
            return
        self.unread_at_backward.clear()  # once per step is enough
        if self.wait_all_after_step:
            return
        self.wait_all_after_step = True
        names = [slot.name for slot in self.buckets[index].layout.slots]
        warnings.warn(
            f"sdp4bit: parameters {names[:8]}{'...' if len(names) > 8 else ''} received gradients although their "
            "updated weights had not arrived when backward began, so this step's forward read the previous "
            "step's weights for them. They were read where torch function modes are off (torch._C."
            "DisableTorchFunction, a C++ extension), which the strategy cannot see. From now on every weight "
            "all-gather completes right after each optimizer step (correct, without overlap with the forward); "
            "read weights through torch operations or module forwards to keep the overlap.",
            stacklevel=4,
        )

    def tracking_data_writes(self) -> DataWriteTracker:
        """A `with` block in which writes through `p.data` of trained parameters count as writes."""
        return DataWriteTracker(self._ids)

    def absorb(self) -> None:
        """Copy what was written to the weights since each bucket landed into the fp32 masters;
        local (each rank its own shard [S]), with every bucket current. Unwritten elements keep
        their masters.

        A parameter whose version counter moved (a write through it: no_grad in-place ops,
        `copy_`, `detach().copy_`, and `.data` inside hooks) is taken in whole, even where the
        value written equals what the exchange left (an average can). A write through `.data`
        elsewhere moves no counter; it is taken in where it changed an element (the weight and
        applied shards differ). One kernel per bucket (`ops.absorb_weight_edits`: it reads the
        two weight shards and writes a master element only where they differ) plus a copy per
        written parameter's range, with no host synchronisation. The applied shards and
        versions stay until the next landing; until then taking the same writes in again
        changes nothing.
        """
        with torch.no_grad():
            for bucket, versions in zip(self.buckets, self._versions, strict=True):
                ops.absorb_weight_edits(bucket.weight_shard, bucket.applied_shard, bucket.master)
                lo, hi = bucket.layout.shard_bounds(self.rank)
                for slot, param, version in zip(bucket.layout.slots, bucket.params, versions, strict=True):
                    start, end = max(slot.start, lo), min(slot.start + slot.numel, hi)
                    if param._version != version and start < end:
                        # Taken in whole, changed or not (where changed, the kernel wrote the same).
                        bucket.master[start - lo : end - lo].copy_(bucket.weight_shard[start - lo : end - lo])

    def close(self) -> None:
        self.guard.close()
