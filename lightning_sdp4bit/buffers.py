"""Flat buffers and sharding, as in Megatron's distributed optimizer. No torch.distributed here.

Trainable parameters are laid out, in backward order (the reverse of registration order), in one
contiguous buffer per dtype. Each buffer is cut into buckets of about `bucket_numel` elements (a
parameter never spans two buckets) and each bucket is zero-padded to `world * S` elements, S
being a multiple of the shard alignment, so that it splits into W equal shards of whole
quantization groups. Rank r owns elements [r*S, (r+1)*S) of every bucket: its **master shard**
(fp32) and its **gradient shard** (fp32) cover exactly that range. A **fragment** is the part of
one parameter that falls inside one rank's shard; the optimizer steps fragments.

Per bucket (N = W * S elements):
- model weights: [N] in the module's dtype; the parameters are views into it. With
  weight_sharding="node" they exist only while gathered, and the rank keeps its node slice
  [M, S] in between (`node_shards`);
- window gradients: [N], what one optimizer step reduce-scatters. In the module's dtype when one
  backward gives each gradient (as DDP's buckets), in fp32 when micro-batches are summed. They
  exist from the bucket's first gradient of a window until its exchange takes them (in the
  synced backward the bucket holds the parameters' own gradients until then, `Bucket.hold_grad`,
  and the compressed exchange reads them where they lie, `HeldGrads`), so that during backward
  only the buckets between those two moments hold any (the peak is the start of backward, when
  none do yet);
- master shard, gradient shard: [S] fp32 each;
- applied shard: [S] in the module's dtype, the weight shard as the last exchange left it,
  written by that exchange itself (or by the engine where weights change without one: its setup,
  a checkpoint load), never copied from the weights after a landing.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sdp4bit.config import SDP4BitConfig, auto_bucket_numel

__all__ = [
    "Bucket",
    "BucketLayout",
    "Fragment",
    "HeldGrads",
    "ParamSlot",
    "allocate_buckets",
    "as_words",
    "bucket_layouts",
    "layout_signature",
    "node_slice_pieces",
    "plan_buckets",
    "shard_alignment",
]

# Shards stay a multiple of this many elements even uncompressed: 32 keeps every packed
# payload row a whole number of 32-bit words (see reference.ops.payload_row_bytes).
_MIN_ALIGNMENT = 32


def as_words(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each of `tensors` [..., R] (rows of the same bytes, last dimension contiguous) viewed as
    the widest integers (8, 4 or 2 bytes, else 1) that the rows' bytes and every tensor's offset
    divide into: the same for all, so that a copy between the views moves the same bits. A
    strided copy runs one element per thread whatever the dtype, so fewer, wider elements make it
    faster."""
    sizes = [t.element_size() * n for t in tensors for n in (t.shape[-1], t.storage_offset())]
    common = math.gcd(*sizes)  # bytes every row and offset is a multiple of (gcd(0, n) = n)
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if common % word.itemsize == 0:
            break
    return tuple([t.view(word) for t in tensors])


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its bucket."""

    name: str
    shape: tuple[int, ...]
    start: int  # first element in the bucket

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fragment:
    """The elements of one parameter inside one rank's shard of a bucket."""

    name: str
    bucket: int
    param_start: int  # first element within the flattened parameter
    shard_start: int  # first element within the shard
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    index: int
    dtype: torch.dtype
    world_size: int
    shard_numel: int  # S
    slots: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        """Padded elements, W * S."""
        return self.world_size * self.shard_numel

    @property
    def used_numel(self) -> int:
        """Elements that belong to parameters (the rest is padding)."""
        return sum(slot.numel for slot in self.slots)

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def fragments(self, rank: int) -> list[Fragment]:
        """Every parameter's overlap with `rank`'s shard, in bucket order."""
        lo, hi = self.shard_bounds(rank)
        out = []
        for slot in self.slots:
            start, end = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if start < end:
                out.append(Fragment(slot.name, self.index, start - slot.start, start - lo, end - start))
        return out


@dataclass(frozen=True)
class HeldGrads:
    """A bucket's window gradients where autograd left them (`Bucket.take_grads(in_place=True)`):
    grads[i] fills elements starts[i] to starts[i] + grads[i].numel() of the bucket's `numel`
    (N), in bucket order; every other element is 0."""

    numel: int
    starts: list[int]
    grads: list[Tensor]


def plan_buckets(
    named_shapes: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    world_size: int,
    bucket_numel: int,
    shard_alignment: int,
    first_bucket_numel: int | None = None,
) -> list[BucketLayout]:
    """Cut parameters (given in registration order) into buckets, per dtype, in backward order.

    Gradients of the last layers are ready first in backward, so they fill bucket 0, whose
    reduce-scatter can start while the rest of backward runs; `first_bucket_numel` (at most
    `bucket_numel`) keeps that first bucket of each dtype small, so that it starts early.
    """
    first_target = min(bucket_numel, first_bucket_numel or bucket_numel)
    buckets: list[BucketLayout] = []
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape, dtype in reversed(list(named_shapes)):
        by_dtype.setdefault(dtype, []).append((name, tuple(shape)))

    def close(dtype: torch.dtype, slots: list[ParamSlot], used: int) -> None:
        unit = world_size * shard_alignment
        padded = max(unit, -(-used // unit) * unit)
        buckets.append(BucketLayout(len(buckets), dtype, world_size, padded // world_size, tuple(slots)))

    for dtype, params in by_dtype.items():
        slots: list[ParamSlot] = []
        used, target = 0, first_target
        for name, shape in params:
            slots.append(ParamSlot(name, shape, used))
            used += math.prod(shape)
            if used >= target:
                target = bucket_numel
                close(dtype, slots, used)
                slots, used = [], 0
        if slots:
            close(dtype, slots, used)
    return buckets


def shard_alignment(config: SDP4BitConfig) -> int:
    """Elements each shard must be a multiple of, so that it holds whole quantization groups."""
    sizes = [_MIN_ALIGNMENT]
    if config.compresses_weights:
        sizes.append(config.weight_group_size)
    if config.compresses_grads:
        sizes.append(config.grad_group_size)
    return math.lcm(*sizes)


def bucket_layouts(named: Sequence[tuple[str, nn.Parameter]], config: SDP4BitConfig, world_size: int) -> list:
    """The buckets of the trained parameters `named` (registration order) for a job of `world_size`."""
    bucket_numel = config.bucket_numel or auto_bucket_numel(sum(p.numel() for _, p in named))
    return plan_buckets(
        [(name, tuple(p.shape), p.dtype) for name, p in named],
        world_size,
        bucket_numel,
        shard_alignment(config),
        config.first_bucket_numel,
    )


def layout_signature(layouts: Sequence[BucketLayout], extra: str = "") -> int:
    """A 63-bit digest of the layout (and of `extra`, e.g. the config): ranks compare it to
    catch different models or configs. Stable across processes, unlike hash()."""
    text = repr([(b.dtype, b.shard_numel, [(s.name, s.shape, s.start) for s in b.slots]) for b in layouts]) + extra
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class Bucket:
    """The runtime tensors of one bucket on one rank (see the module docstring for shapes)."""

    def __init__(self, layout: BucketLayout, rank: int, weights: Tensor, params: Sequence[nn.Parameter]):
        self.layout = layout
        self.rank = rank
        self.weights = weights
        self.params = list(params)
        self.dtype = weights.dtype
        self.device = device = weights.device
        # weight_sharding="node" (`node_shards`): the rows of the bucket this rank keeps, [M, S],
        # and which of them is its own shard; None in the replicated mode.
        self.node_slice: Tensor | None = None
        self.own_row = rank  # this rank's row of `held_weights` viewed [rows, S]
        self.grads: Tensor | None = None  # the window gradients [N], see receive_grad
        self.received: set[int] = set()  # positions that got a gradient this window
        self.held: dict[int, Tensor] = {}  # position -> gradient not yet in `grads`, in arrival order; see hold_grad
        lo, hi = layout.shard_bounds(rank)
        self.master = weights[lo:hi].float().clone()
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        # What the last weight exchange left in this rank's weight shard [S], in the weights'
        # dtype: a difference from it is an in-place edit the masters must take in. The exchange
        # writes it (`weight_collectives`), as it writes the weights; see the module docstring.
        self.applied_shard = weights[lo:hi].clone()

    @property
    def weight_shard(self) -> Tensor:
        """This rank's shard of the weights [S]: a view of the weights, or of the node slice."""
        if self.node_slice is not None:
            return self.node_slice[self.own_row]
        lo, hi = self.layout.shard_bounds(self.rank)
        return self.weights[lo:hi]

    @property
    def held_weights(self) -> Tensor:
        """The weights this rank keeps between uses, which the weight exchange writes: all of them
        [N], or the node slice [M * S] (`node_shards`)."""
        return self.weights if self.node_slice is None else self.node_slice.view(-1)

    def held_pieces(self) -> list[tuple[int, int, Tensor]]:
        """(position, first element within the flattened parameter, values) of every parameter
        piece in `held_weights`: each parameter whole, or the fragments of the node slice's rows."""
        if self.node_slice is None:
            return [(p, 0, self.weights[s.start : s.start + s.numel]) for p, s in enumerate(self.layout.slots)]
        return node_slice_pieces(self.layout, self.rank, self.node_slice)

    def hold_node_slice(self, nodes: int, local_ranks: int, rows: Tensor | None = None) -> None:
        """Keep rows rank % L, L + rank % L, ... of the (full) weights as the node slice [M, S]
        (or `rows`, those rows built elsewhere: `materialize`)."""
        if rows is None:
            rows = self.weights.view(nodes, local_ranks, -1)[:, self.rank % local_ranks].clone()
        self.node_slice = rows
        self.own_row = self.rank // local_ranks
        self._nan = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)

    def attach_weights(self, full: Tensor) -> None:
        """Make `full` [N] the weights, and the parameters views of it."""
        self.weights = full
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = full[slot.start : slot.start + slot.numel].view(slot.shape)

    def detach_weights(self) -> None:
        """Let the full weights go: the weights and parameters become NaN of their shapes (one
        element, expanded), so that a read the engine did not see shows as NaN."""
        self.weights = self._nan.expand(self.layout.numel)
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = self._nan.expand(slot.shape)

    def receive_grad(self, position: int, grad: Tensor, accumulating: bool) -> None:
        """Put parameter `position`'s gradient into the window gradients: copied on its first
        arrival in the window, added after. The buffer is made at the bucket's first gradient, in
        fp32 when micro-batches will be summed (`accumulating`) and in the weights' dtype
        otherwise; a second gradient for a position turns it into fp32 first, so that sums are
        always taken in fp32 (the conversion of a single bf16 gradient is exact)."""
        first = position not in self.received
        self.received.add(position)
        if self.grads is None:
            self._make_grads(accumulating)
        elif not first and self.grads.dtype != torch.float32:
            self.grads = self.grads.float()
        view = self._view(position)
        if first:
            view.copy_(grad)
        else:
            view.add_(grad)

    def _make_grads(self, accumulating: bool) -> Tensor:
        dtype = torch.float32 if accumulating else self.dtype
        self.grads = torch.empty(self.layout.numel, dtype=dtype, device=self.device)
        self.grads[self.layout.used_numel :].zero_()  # the padding
        return self.grads

    def receive_grads(self, arrivals: list[tuple[int, Tensor]], accumulating: bool) -> None:
        """`receive_grad` for several (position, gradient) pairs at once: the same result, with one
        concatenation when they are every parameter's first gradient of the window, else one
        multi-tensor copy for first arrivals and one add for the others, instead of a launch per
        parameter (a simulated job takes every rank's gradients this way, the synced backward
        its held ones)."""
        if not arrivals:
            return
        fresh = [(p, g) for p, g in arrivals if p not in self.received]
        again = [(p, g) for p, g in arrivals if p in self.received]
        if self.grads is None:
            grads = self._make_grads(accumulating)  # the window's first gradients
            if not again and sorted(p for p, _ in fresh) == list(range(len(self.layout.slots))):
                # The slots lie back to back from 0, so one concatenation writes them all. In the
                # engine at 1.3B on the H200 this took the gradient hooks' compute-stream time
                # from 4.68-4.91 to 4.35-4.58 ms a step (six runs each); alone, on freshly made
                # tensors, it was the slower of the two (benchmarks/results/power_warmup_h200_2026-12-03.md).
                by_position = dict(fresh)
                ordered = [by_position[p].reshape(-1) for p in range(len(by_position))]
                torch.cat(ordered, out=grads[: self.layout.used_numel])  # to fp32 exactly, if accumulating
                self.received.update(by_position)
                return
        elif again and self.grads.dtype != torch.float32:
            self.grads = self.grads.float()  # sums in fp32, as receive_grad takes them
        if fresh:
            torch._foreach_copy_([self._view(p) for p, _ in fresh], [g for _, g in fresh])
            self.received.update(p for p, _ in fresh)
        if again:
            torch._foreach_add_([self._view(p) for p, _ in again], [g for _, g in again])

    def hold_grad(self, position: int, grad: Tensor) -> None:
        """Keep parameter `position`'s gradient of the synced backward until the exchange takes
        the window gradients (`take_grads`): hand them over as they lie (`in_place`), or put the
        bucket's in at once, as `receive_grad` would one by one (copied, or added to an fp32
        window): one concatenation or multi-tensor
        copy where a copy per parameter cost a launch each (292 a step at 1.3B, where the host's
        step was as long as the GPU's). The held gradients take the memory their copies in
        `grads` would; while they are put in, the bucket has both for a moment. A second
        gradient for a held position puts the held ones in first, so that it is added to them."""
        if position in self.held:
            self._receive_held()
            self.receive_grad(position, grad, accumulating=False)
        else:
            self.held[position] = grad

    def _receive_held(self) -> None:
        if self.held:
            held, self.held = self.held, {}
            self.receive_grads(list(held.items()), accumulating=False)

    def _view(self, position: int) -> Tensor:
        slot = self.layout.slots[position]
        assert self.grads is not None
        return self.grads[slot.start : slot.start + slot.numel].view(slot.shape)

    def take_grads(self, in_place: bool = False) -> Tensor | HeldGrads:
        """The window gradients [N] for the exchange, zero where a parameter got none (its slot
        still holds whatever the allocator gave); the bucket lets go of them (`received` stays
        until the next window). With `in_place`, when every gradient of the window is held (none
        was put in `grads`), those gradients as they lie: the exchange reads them there, with no
        copy into the bucket (at 1.3B on 2 x 4 H200s the copies took 1.45 ms a step)."""
        if in_place and self.grads is None and self.held:
            held, self.held = self.held, {}
            self.received.update(held)
            order = sorted(held)
            return HeldGrads(self.layout.numel, [self.layout.slots[p].start for p in order], [held[p] for p in order])
        self._receive_held()
        grads = self.grads
        if grads is None:
            grads = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        else:
            for position, slot in enumerate(self.layout.slots):
                if position not in self.received:
                    grads[slot.start : slot.start + slot.numel].zero_()
        self.grads = None
        return grads

    def carry_grads(self, full: Tensor, positions: list[int]) -> None:
        """Start the window from the reduced gradients `full` [N] fp32 (all ranks' shards) of the
        parameters at `positions`: later gradients are added to them, in fp32."""
        self.grads = full
        self.received = set(positions)
        self.held = {}

    def start_window(self) -> None:
        """A new accumulation window: no gradients yet (any not exchanged are dropped)."""
        self.grads = None
        self.received = set()
        self.held = {}


def node_slice_pieces(layout: BucketLayout, rank: int, node_slice: Tensor) -> list[tuple[int, int, Tensor]]:
    """(slot position, first element within the flattened parameter, view) of every parameter
    fragment in `rank`'s node slice [M, S] of `layout` (`node_shards`: row m is shard m * L + rank % L)."""
    position = {slot.name: p for p, slot in enumerate(layout.slots)}
    local_ranks = layout.world_size // len(node_slice)
    return [
        (position[frag.name], frag.param_start, row[frag.shard_start : frag.shard_start + frag.numel])
        for node, row in enumerate(node_slice)
        for frag in layout.fragments(node * local_ranks + rank % local_ranks)
    ]


def allocate_buckets(
    layouts: Sequence[BucketLayout], params: dict[str, nn.Parameter], rank: int, separate: bool = False
) -> list[Bucket]:
    """Copy the parameters into one flat weight buffer per dtype and make them views into it
    (`separate`: one buffer per bucket, which `node_shards` lets go bucket by bucket).

    The parameters keep their identity (optimizers and user code that hold them still work);
    only their storage moves, and with it their memory layout: each becomes a contiguous view of
    its bucket (a bucket holds every parameter in its logical order, which the exchanges, the
    checkpoints and the optimizer's fragments all rely on). Padding is zero.
    """
    _warn_of_lost_layouts(params)
    buckets: list[Bucket] = []
    by_dtype: dict[torch.dtype, list[BucketLayout]] = {}
    for layout in layouts:
        by_dtype.setdefault(layout.dtype, []).append(layout)
    for dtype, group in by_dtype.items():
        device = params[group[0].slots[0].name].device
        flat = None if separate else torch.zeros(sum(b.numel for b in group), dtype=dtype, device=device)
        offset = 0
        for layout in group:
            if flat is None:
                weights = torch.zeros(layout.numel, dtype=dtype, device=device)
            else:
                weights = flat[offset : offset + layout.numel]
            offset += layout.numel
            bucket_params = []
            for slot in layout.slots:
                param = params[slot.name]
                view = weights[slot.start : slot.start + slot.numel].view(slot.shape)
                view.copy_(param.detach())
                param.data = view
                bucket_params.append(param)
            buckets.append(Bucket(layout, rank, weights, bucket_params))
    return sorted(buckets, key=lambda bucket: bucket.layout.index)


def _warn_of_lost_layouts(params: dict[str, nn.Parameter]) -> None:
    """Name the parameters whose strides the buckets change (a channels_last convolution's weight,
    a parameter created as a transposed view): their values stay, their layout does not."""
    strided = [name for name, param in params.items() if not param.is_contiguous()]
    if strided:
        warnings.warn(
            f"sdp4bit: parameters {strided[:8]}{'...' if len(strided) > 8 else ''} are not contiguous in memory "
            "(channels_last, a transposed view); under sdp4bit every trained parameter becomes a contiguous view of "
            "its bucket, with the same values (DDP keeps the strides). Operations that pick a kernel by layout "
            "(channels_last convolutions) may run slower; results are unchanged.",
            stacklevel=4,
        )
