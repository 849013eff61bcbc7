"""The sharded data-parallel engine: ZeRO-1 with flat buckets, below the Lightning adapter.

Life of one optimizer step (N = bucket elements, S = N / world, per bucket):
1. backward: each parameter's gradient is added, in fp32, into its bucket's gradient
   accumulator [N] by a post-accumulate-grad hook, and the parameter's own .grad is freed. On
   the last micro-batch of an accumulation window, a bucket whose gradients are all in is
   divided by the world size and its reduce-scatter starts, overlapping the rest of backward.
   Buckets start strictly in index order, so every rank issues the same collectives in the
   same order whatever its backward order.
2. `finish_grad_sync`: start what is left, wait for everything, and point every master
   fragment's .grad at its slice of the gradient shard [S].
3. the user's optimizer, re-pointed by `shard_optimizer`, steps the fp32 master fragments.
4. `start_weight_sync`: every bucket's all-gather starts (the first layers' buckets first);
   forward pre-hooks wait for a module's buckets just before it runs, overlapping the rest.

No Lightning here: a test can drive it with a plain module and optimizer.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sdp4bit import comm
from lightning_sdp4bit.buffers import Bucket, Fragment, allocate_buckets, layout_signature, plan_buckets
from lightning_sdp4bit.collectives import (
    GradReduceScatter,
    Pending,
    PlainGradReduceScatter,
    PlainWeightAllGather,
    QuantizedWeightAllGather,
    TwoLevelGradReduceScatter,
    WeightAllGather,
)
from lightning_sdp4bit.config import SDP4BitConfig, WeightQuant
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = ["MasterFragment", "ShardedEngine", "shard_alignment"]

log = logging.getLogger(__name__)

# Shards stay a multiple of this many elements even uncompressed: 32 keeps every packed
# payload row a whole number of 32-bit words (see reference.ops.payload_row_bytes).
_MIN_ALIGNMENT = 32


def shard_alignment(config: SDP4BitConfig) -> int:
    """Elements each shard must be a multiple of, so that it holds whole quantization groups."""
    sizes = [_MIN_ALIGNMENT]
    if config.compresses_weights:
        sizes.append(config.weight_group_size)
    if config.compresses_grads:
        sizes.append(config.grad_group_size)
    return math.lcm(*sizes)


@dataclass(frozen=True)
class MasterFragment:
    """One parameter's slice of this rank's shard: what the optimizer steps."""

    fragment: Fragment
    master: Tensor  # fp32 view into the bucket's master shard
    grad: Tensor  # fp32 view into the bucket's gradient shard


class ShardedEngine:
    """Owns the flat buffers, the master shards, the hooks and the two collectives per bucket.

    Collective at construction: every rank must build it from the same module and config.
    """

    def __init__(
        self,
        module: nn.Module,
        config: SDP4BitConfig,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter | None = None,
    ):
        self.module, self.config, self.topology, self.groups = module, config, topology, groups
        self.meter = meter if meter is not None else WireMeter()
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require grad: there is nothing to shard")
        layouts = plan_buckets(
            [(name, tuple(p.shape), p.dtype) for name, p in named],
            topology.world_size,
            config.bucket_numel,
            shard_alignment(config),
        )
        self._check_ranks_agree(layouts, named[0][1].device)
        with torch.no_grad():
            self.buckets: list[Bucket] = allocate_buckets(layouts, dict(named), topology.rank)
            self._broadcast_from_rank_zero()
            for bucket in self.buckets:
                bucket.master.copy_(bucket.weight_shard)
        self.fragments_by_name: dict[str, list[MasterFragment]] = self._make_fragments()
        self.optimizer_param_names: list[list[list[str]]] = []  # per re-pointed optimizer, per group
        self.grad_collectives = [self._grad_collective(b) for b in self.buckets]
        self.weight_collectives = [self._weight_collective(b) for b in self.buckets]
        self.step = 0
        self.grad_sync_enabled = True
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._next_launch = 0
        self._pending_grads: dict[int, Pending] = {}
        self._pending_weights: dict[int, Pending] = {}
        self._wait_all_before_forward = False
        self._hooks = self._register_hooks()

    # ----------------------------------------------------------------------------------------
    # Setup

    def _check_ranks_agree(self, layouts, device: torch.device) -> None:
        """Fail loudly, on every rank, if ranks built different models or configs: otherwise
        their collectives would not match and the job would hang or silently mix tensors."""
        digest = layout_signature(layouts, extra=repr(sorted(self.config.to_dict().items())))
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        everyone = torch.empty(self.topology.world_size, dtype=torch.int64, device=device)
        comm.all_gather(everyone, mine, group=self.groups.world)
        differing = [rank for rank, value in enumerate(everyone.tolist()) if value != everyone[0].item()]
        if differing:
            raise ValueError(
                f"ranks {differing} built a different model or SDP4BitConfig than rank 0 (parameter "
                "names, shapes, dtypes, requires_grad, bucket layout or config fields differ). Every rank "
                "must build the same LightningModule with the same config."
            )

    def _broadcast_from_rank_zero(self) -> None:
        """Start every rank from rank 0's weights, frozen parameters and buffers, as DDP does."""
        for bucket in self.buckets:
            comm.broadcast(bucket.weights, src=0, group=self.groups.world)
        for p in self.module.parameters():
            if not p.requires_grad:
                comm.broadcast(p.data, src=0, group=self.groups.world)
        for buffer in self.module.buffers():
            comm.broadcast(buffer, src=0, group=self.groups.world)

    def _make_fragments(self) -> dict[str, list[MasterFragment]]:
        """Parameter name -> its fragments in this rank's shards (at most one per parameter,
        since a parameter sits in one bucket and a shard is contiguous)."""
        by_name: dict[str, list[MasterFragment]] = {}
        for bucket in self.buckets:
            for frag in bucket.layout.fragments(self.topology.rank):
                window = slice(frag.shard_start, frag.shard_start + frag.numel)
                by_name.setdefault(frag.name, []).append(
                    MasterFragment(frag, bucket.master[window], bucket.grad_shard[window])
                )
        return by_name

    def _grad_collective(self, bucket: Bucket) -> GradReduceScatter:
        if self._compresses(bucket) and self.config.compresses_grads:
            return TwoLevelGradReduceScatter(self.config, self.topology, self.groups, self.meter, self.topology.rank)
        return PlainGradReduceScatter(self.groups, self.meter)

    def _weight_collective(self, bucket: Bucket) -> WeightAllGather:
        if self._compresses(bucket) and self.config.compresses_weights:
            additive = self.config.weight_quant is WeightQuant.DIFF
            return QuantizedWeightAllGather(self.config, self.groups, self.meter, self.topology.rank, additive)
        return PlainWeightAllGather(self.groups, self.meter)

    def _compresses(self, bucket: Bucket) -> bool:
        """Whether a bucket is quantized. With one rank nothing travels, so nothing is; buckets
        under `min_compress_numel` travel uncompressed, and are logged so as never to be silent."""
        if self.topology.world_size == 1:
            return False
        if bucket.layout.used_numel < self.config.min_compress_numel:
            if self.topology.rank == 0:
                names = ", ".join(slot.name for slot in bucket.layout.slots)
                log.info(
                    "bucket %d (%d elements < min_compress_numel) travels uncompressed: %s",
                    bucket.layout.index,
                    bucket.layout.used_numel,
                    names,
                )
            return False
        return True

    def _register_hooks(self) -> list:
        handles = []
        for bucket in self.buckets:
            for position, param in enumerate(bucket.params):
                hook = _GradReadyHook(self, bucket.layout.index, position)
                handles.append(param.register_post_accumulate_grad_hook(hook))
        bucket_of = {id(p): b.layout.index for b in self.buckets for p in b.params}
        for module in self.module.modules():
            indices = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
            if indices:
                handles.append(module.register_forward_pre_hook(_WeightWaitHook(self, indices)))
        return handles

    # ----------------------------------------------------------------------------------------
    # Optimizer

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point `optimizer`'s parameter groups at this rank's fp32 master fragments.

        Group options (lr, weight decay, ...) stay as they are, so LR schedulers keep working.
        Parameters the module does not train are dropped from the groups. The optimizer must be
        fresh: state created for the full parameters cannot be split.
        """
        if optimizer.state:
            raise ValueError(
                f"{type(optimizer).__name__} already holds state; configure_optimizers must return a fresh "
                "optimizer (the strategy re-points it at the sharded fp32 master weights)"
            )
        name_of = {id(p): slot.name for b in self.buckets for slot, p in zip(b.layout.slots, b.params, strict=True)}
        seen: set[int] = set()
        group_names = []
        for group in optimizer.param_groups:
            new_params, names = [], []
            for param in group["params"]:
                if id(param) in seen:
                    raise ValueError("a parameter appears twice in the optimizer's param_groups")
                seen.add(id(param))
                if id(param) in name_of:
                    names.append(name_of[id(param)])
                    new_params.extend(record.master for record in self.fragments_by_name.get(names[-1], []))
                elif param.requires_grad:
                    raise ValueError(
                        f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a parameter "
                        "of the LightningModule; optimize the module's own parameters"
                    )
            group["params"] = new_params
            group_names.append(names)
        self.optimizer_param_names.append(group_names)

    # ----------------------------------------------------------------------------------------
    # Gradients

    def on_grad_ready(self, index: int, position: int) -> None:
        """Called from a parameter's post-accumulate-grad hook, after its .grad is complete."""
        bucket = self.buckets[index]
        param, slot = bucket.params[position], bucket.layout.slots[position]
        if index in self._pending_grads:
            raise RuntimeError(
                f"parameter {slot.name!r} received a gradient after its bucket's reduce-scatter started "
                "(it was used again later in the same backward); this strategy needs each parameter's "
                "gradient to be final once its hook fires"
            )
        with torch.no_grad():
            bucket.grad_view(slot).add_(param.grad)
        param.grad = None
        if not self.grad_sync_enabled:
            return
        self._ready[index].add(position)
        while self._next_launch < len(self.buckets) and len(self._ready[self._next_launch]) == len(
            self.buckets[self._next_launch].params
        ):
            self._launch(self._next_launch)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        with torch.no_grad():
            bucket.grad_accumulator.mul_(1.0 / self.topology.world_size)
            for pending in self._pending_grads.values():
                pending.progress()
            self._pending_grads[index] = self.grad_collectives[index].start(bucket, self.step)
        self._next_launch = index + 1

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduce-scatter and hand the gradient shards to the fragments.

        Buckets whose parameters got no gradient (unused in this step) are sent now, in order.
        """
        with torch.no_grad():
            while self._next_launch < len(self.buckets):
                self._launch(self._next_launch)
            for pending in self._pending_grads.values():
                pending.progress()
            for pending in self._pending_grads.values():
                pending.wait()
            for bucket in self.buckets:
                bucket.grad_accumulator.zero_()
        self._pending_grads.clear()
        self._ready = [set() for _ in self.buckets]
        self._next_launch = 0
        for records in self.fragments_by_name.values():
            for record in records:
                record.master.grad = record.grad

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Scale the gradient shards so that the global 2-norm is at most `max_norm`.

        The norm is taken over every rank's shard with one all-reduce of the squared sums, and
        the scaling follows torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6),
        capped at 1). Returns the global norm before clipping.
        """
        device = self.buckets[0].grad_shard.device
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        for bucket in self.buckets:
            squares += bucket.grad_shard.pow(2).sum()
        comm.all_reduce(squares, group=self.groups.world)
        norm = squares.sqrt()[0]
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for bucket in self.buckets:
            bucket.grad_shard.mul_(coefficient)
        return norm

    # ----------------------------------------------------------------------------------------
    # Weights

    def start_weight_sync(self) -> dict[str, float]:
        """After the optimizer step: start every bucket's weight all-gather. Returns the step's
        communication figures."""
        self.wait_weights()
        with torch.no_grad():
            # Buckets are in backward order, so the last one holds the first layers: start it first.
            for index in reversed(range(len(self.buckets))):
                self._pending_weights[index] = self.weight_collectives[index].start(self.buckets[index], self.step)
        self.step += 1
        return self.meter.end_step()

    def gather_weight_shards(self) -> None:
        """Make every rank's weights the concatenation of the ranks' own weight shards (after a
        checkpoint restored each rank's slice of the replicas)."""
        with torch.no_grad():
            for bucket in self.buckets:
                comm.all_gather(bucket.weights, bucket.weight_shard.clone(), group=self.groups.world)

    def wait_weights(self, indices: Iterable[int] | None = None) -> None:
        """Complete the pending all-gathers of `indices` (default: all of them)."""
        targets = list(self._pending_weights) if indices is None else indices
        with torch.no_grad():
            for index in targets:
                pending = self._pending_weights.pop(index, None)
                if pending is not None:
                    pending.wait()

    def check_weights_were_waited(self) -> None:
        """Called before backward: every all-gather should have been waited for by a forward
        pre-hook. If one was not, a parameter was read outside its module's forward; finish the
        sync, warn once, and from then on wait for all weights before each forward."""
        if self._pending_weights and not self._wait_all_before_forward:
            names = sorted({slot.name for i in self._pending_weights for slot in self.buckets[i].layout.slots})
            warnings.warn(
                "these parameters were not reached through their modules' forward, so their updated weights "
                f"may have arrived late for this step: {names[:8]}{'...' if len(names) > 8 else ''}. "
                "The strategy now waits for all weights before each forward (less overlap).",
                stacklevel=2,
            )
            self._wait_all_before_forward = True
        self.wait_weights()

    @property
    def waits_for_all_weights_before_forward(self) -> bool:
        return self._wait_all_before_forward

    def close(self) -> None:
        """Finish pending communication and remove the hooks; the module keeps its weights."""
        self.wait_weights()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class _GradReadyHook:
    """Post-accumulate-grad hook of one parameter (a class, so that it pickles and reads well)."""

    def __init__(self, engine: ShardedEngine, index: int, position: int):
        self.engine, self.index, self.position = engine, index, position

    def __call__(self, param: Tensor) -> None:
        self.engine.on_grad_ready(self.index, self.position)


class _WeightWaitHook:
    """Forward pre-hook: wait for the buckets holding this module's own parameters."""

    def __init__(self, engine: ShardedEngine, indices: list[int]):
        self.engine, self.indices = engine, indices

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.engine.wait_weights(None if self.engine.waits_for_all_weights_before_forward else self.indices)
