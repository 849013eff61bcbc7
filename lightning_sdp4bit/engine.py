"""The sharded data-parallel engine: ZeRO-1 with flat buckets, below the Lightning adapter.

One optimizer step (N = bucket elements, S = N / world, per bucket; the phases are named in
`lightning_sdp4bit.schedule`):
1. backward: a post-accumulate-grad hook puts each parameter's gradient into its bucket's
   window gradients [N] (`Bucket.receive_grad`: the weights' dtype for one backward, fp32 where
   micro-batches are summed; in the synced backward `Bucket.hold_grad` keeps them until the
   bucket's exchange starts, which reads them where they lie when it compresses, else copies
   them in at once) and frees the parameter's own .grad.
   While `grad_sync_enabled` (the last micro-batch of an accumulation window), a bucket whose
   gradients are all in starts its reduce-scatter, overlapping the rest of backward; the
   exchange takes the window gradients (and divides them by the world size as it reads them).
2. `finish_grad_sync` (idempotent): start what is left, wait for everything, and decide the
   step on every rank alike (`lightning_sdp4bit.guards`): global norm, non-finite gradients,
   parameters that got no gradient. Master fragments' .grad point at the gradient shard [S], or
   are None for parameters that got no gradient (and for every one on a skipped step).
3. `absorb_weight_edits`: writes to the model weights since the last exchange (a clamp in a
   hook, an average copied in) are copied into the fp32 masters (`weight_access.WeightAccess`).
4. the user's optimizer, re-pointed by `lightning_sdp4bit.optim.shard_optimizer`, steps the
   fp32 master fragments.
5. `start_weight_sync`: every bucket's all-gather starts (the first layers' buckets first; each
   also leaves this rank's applied shard, what step 3 compares the weights with);
   forward pre-hooks wait for a module's buckets just before it runs, overlapping the rest, and
   until the next backward the read guard (`open_read_guard`) waits for a bucket at the first
   torch operation that reads one of its parameters elsewhere (an L2 penalty, a functional model).

No Lightning here: a test can drive it with a plain module and optimizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sdp4bit import comm
from lightning_sdp4bit.agreement import check_ranks_agree
from lightning_sdp4bit.buffer_sync import BufferBroadcast
from lightning_sdp4bit.buffers import Bucket, Fragment, allocate_buckets, plan_buckets
from lightning_sdp4bit.collectives import Pending, grad_collective_for
from lightning_sdp4bit.config import SDP4BitConfig, auto_bucket_numel
from lightning_sdp4bit.guards import (
    SkippedSteps,
    StepVerdict,
    apply_verdict,
    clip_coefficient,
    decide_step,
    global_squares,
    unfrozen_since_start,
)
from lightning_sdp4bit.module_hooks import register_hooks
from lightning_sdp4bit.optim import shard_optimizer
from lightning_sdp4bit.schedule import BucketSchedule, GradPhase, exchange_stream
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology
from lightning_sdp4bit.weight_access import WeightAccess
from lightning_sdp4bit.weight_collectives import weight_collective_for

__all__ = ["MasterFragment", "ShardedEngine", "bucket_layouts", "master_fragments", "shard_alignment"]

# Shards stay a multiple of this many elements even uncompressed: 32 keeps every packed
# payload row a whole number of 32-bit words (see reference.ops.payload_row_bytes).
_MIN_ALIGNMENT = 32
# Weight all-gathers started ahead of the bucket a forward pre-hook waits for, on a GPU.
_GPU_WEIGHT_PREFETCH = 2


def shard_alignment(config: SDP4BitConfig) -> int:
    """Elements each shard must be a multiple of, so that it holds whole quantization groups."""
    sizes = [_MIN_ALIGNMENT]
    if config.compresses_weights:
        sizes.append(config.weight_group_size)
    if config.compresses_grads:
        sizes.append(config.grad_group_size)
    return math.lcm(*sizes)


def bucket_layouts(named: list[tuple[str, nn.Parameter]], config: SDP4BitConfig, world_size: int) -> list:
    """The buckets of the trained parameters `named` (registration order) for a job of `world_size`."""
    bucket_numel = config.bucket_numel or auto_bucket_numel(sum(p.numel() for _, p in named))
    return plan_buckets(
        [(name, tuple(p.shape), p.dtype) for name, p in named],
        world_size,
        bucket_numel,
        shard_alignment(config),
        config.first_bucket_numel,
    )


@dataclass(frozen=True)
class MasterFragment:
    """One parameter's slice of this rank's shard: what the optimizer steps."""

    fragment: Fragment
    param_index: int  # the parameter's position among the trained parameters (bucket order)
    master: Tensor  # fp32 view into the bucket's master shard
    grad: Tensor  # fp32 view into the bucket's gradient shard


def master_fragments(buckets: list[Bucket], rank: int, trained_names: list[str]) -> dict[str, list[MasterFragment]]:
    """Parameter name -> its fragments in `rank`'s shards (at most one per parameter, since a
    parameter sits in one bucket and a shard is contiguous)."""
    index_of = {name: i for i, name in enumerate(trained_names)}
    by_name: dict[str, list[MasterFragment]] = {}
    for bucket in buckets:
        for frag in bucket.layout.fragments(rank):
            window = slice(frag.shard_start, frag.shard_start + frag.numel)
            by_name.setdefault(frag.name, []).append(
                MasterFragment(frag, index_of[frag.name], bucket.master[window], bucket.grad_shard[window])
            )
    return by_name


class ShardedEngine:
    """Owns the flat buffers, the master shards, the hooks and the two collectives per bucket.
    Collective at construction: every rank must build it from the same module and config."""

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
        self.timeouts = comm.Timeouts(topology.rank, groups.timeout)  # every wait runs in its named()
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require grad: there is nothing to shard")
        self.frozen_names = [name for name, p in module.named_parameters() if not p.requires_grad]
        layouts = bucket_layouts(named, config, topology.world_size)
        self._check_ranks_agree(layouts, named[0][1].device)
        with torch.no_grad():
            self.buckets: list[Bucket] = allocate_buckets(layouts, dict(named), topology.rank)
            self._broadcast_from_rank_zero()
            for bucket in self.buckets:
                bucket.master.copy_(bucket.weight_shard)
        self.trained_names = [slot.name for b in self.buckets for slot in b.layout.slots]
        self.fragments_by_name = master_fragments(self.buckets, topology.rank, self.trained_names)
        self.optimizer_param_names: list[list[list[str]]] = []  # per re-pointed optimizer, per group
        stream = exchange_stream(named[0][1].device)
        self.grad_collectives = [
            grad_collective_for(b, config, topology, groups, self.meter, stream) for b in self.buckets
        ]
        self.weight_collectives = [
            weight_collective_for(b, config, topology, groups, self.meter, stream) for b in self.buckets
        ]
        # Reads and writes of the weights outside the engine's hooks (`lightning_sdp4bit.weight_access`).
        self.access = WeightAccess(self.buckets, topology.rank, self.wait_weights)
        self.weights_loaded()  # rank 0's weights, broadcast: no exchange has left the applied shards
        self.schedule = BucketSchedule(
            len(self.buckets),
            self._start_grad_exchange,
            self._start_weight_exchange,
            self.access.landed,
            # On a GPU a wait costs the host nothing, so exchanges can go out just ahead of forward.
            weight_prefetch=_GPU_WEIGHT_PREFETCH if self.buckets[0].weights.is_cuda else None,
            timeouts=self.timeouts,
        )
        self.step = 0
        self.grad_sync_enabled = True
        self.verdict: StepVerdict | None = None  # the last reduced window's verdict
        self.skipped = SkippedSteps(named[0][1].device, topology.rank)
        self._ready: list[set[int]] = [set() for _ in self.buckets]  # ... in the synced (last) backward
        self._norm_versions: tuple[int, ...] | None = None  # grad shards' versions when verdict.norm was taken
        self._stale_window_warned = False
        self._window_stepped = False  # an optimizer stepped on this window's gradients
        self._decided = False  # prepare_step applied the current verdict
        self._skip_on_host = False
        self.optimizers: list[torch.optim.Optimizer] = []  # re-pointed by shard_optimizer
        self._hooks = register_hooks(self)
        # Module buffers follow DDP's broadcast_buffers: the adapters call before/after_forward.
        self.buffers = BufferBroadcast(module, groups.world, topology.rank, config.broadcast_buffers, self.timeouts)

    # ----------------------------------------------------------------------------------------
    # Setup

    def _check_ranks_agree(self, layouts, device: torch.device) -> None:
        """Fail loudly, on every rank, if ranks built different models or configs: otherwise
        their collectives would not match and the job would hang or silently mix tensors. The
        error names what differs (`lightning_sdp4bit.agreement`)."""
        check_ranks_agree(layouts, self.config, self.topology.world_size, self.groups.world, self.timeouts, device)

    def _broadcast_from_rank_zero(self) -> None:
        """Start every rank from rank 0's weights, frozen parameters and buffers, as DDP does."""
        with self.timeouts.named("the broadcast of rank 0's weights, frozen parameters and buffers"):
            for bucket in self.buckets:
                comm.broadcast(bucket.weights, src=0, group=self.groups.world)
            for p in self.module.parameters():
                if not p.requires_grad:
                    comm.broadcast(p.data, src=0, group=self.groups.world)
            for buffer in self.module.buffers():
                comm.broadcast(buffer, src=0, group=self.groups.world)

    def check_trained_set(self) -> None:
        """Raise if a parameter that was frozen when the engine was built now requires grad:
        it has no bucket, so its gradient would be silently dropped. (Freezing a trained one
        is fine: it gets no gradient, so the optimizer skips it, as under DDP.)"""
        unfrozen = unfrozen_since_start(self.module, self.frozen_names)
        if unfrozen:
            raise RuntimeError(
                f"parameters {unfrozen[:8]} were frozen when fit started and now require grad. Under sdp4bit "
                "the set of trained parameters is fixed when fit starts: set requires_grad before fit (freeze "
                "them by leaving them out of the optimizer or by a zero learning rate instead)."
            )

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point `optimizer` at this rank's master fragments (see `lightning_sdp4bit.optim`)."""
        shard_optimizer(self, optimizer)

    # ----------------------------------------------------------------------------------------
    # Gradients

    def on_grad_ready(self, index: int, position: int) -> None:
        """Called from a parameter's post-accumulate-grad hook, after its .grad is complete."""
        if self.schedule.grads_reduced:
            self._open_window()
        bucket = self.buckets[index]
        param, slot = bucket.params[position], bucket.layout.slots[position]
        self.access.grad_arrived(index)
        if self.schedule.grad_phase[index] is not GradPhase.ACCUMULATING:
            raise RuntimeError(
                f"parameter {slot.name!r} received a gradient after its bucket's reduce-scatter started "
                "(it was used again later in the same backward); this strategy needs each parameter's "
                "gradient to be final once its hook fires"
            )
        with torch.no_grad():
            if self.grad_sync_enabled:
                bucket.hold_grad(position, param.grad)
            else:
                bucket.receive_grad(position, param.grad, accumulating=True)
        param.grad = None
        if self.grad_sync_enabled:
            # Only the synced backward's own gradients count towards a bucket being complete.
            self._ready[index].add(position)
            self.schedule.launch_ready(lambda i: len(self._ready[i]) == len(self.buckets[i].params))

    def _open_window(self) -> None:
        """The first gradient after an optimizer step without `discard_grads` (no zero_grad)."""
        if not self._stale_window_warned:
            warnings.warn(
                "a backward ran after an optimizer step's gradients were reduced, with no zero_grad() in "
                "between. Under sdp4bit each optimizer step's gradients start from zero (DDP would add the "
                "old ones): call optimizer.zero_grad() after each step.",
                stacklevel=3,
            )
            self._stale_window_warned = True
        self._reset_window()

    def before_backward(self) -> None:
        """Called by the adapters before every backward: the weights must be current, and a
        window reduced but not stepped goes on accumulating. A bucket still exchanging now was
        read by nothing the read guard saw: a gradient for it means an unseen read
        (`WeightAccess.grad_arrived`); unused modules get none."""
        self.access.before_backward(self.schedule.exchanging_weights())
        self.wait_weights()
        if self.schedule.grads_reduced and not self._window_stepped:
            self._carry_reduced_grads()

    def _carry_reduced_grads(self) -> None:
        """A backward after a reduction with no step since (Fabric accumulation without
        `no_backward_sync`): as DDP adds each synced backward's gradient to the reduced `p.grad`
        and reduces the sum, the new window starts from the full reduced gradient (one fp32
        all-gather per bucket, [S] -> [N], on this path only). Collective."""
        assert self.verdict is not None
        used, offset = self.verdict.used, 0
        self._reset_window()
        with torch.no_grad():
            for bucket in self.buckets:
                full = torch.empty(bucket.layout.numel, dtype=torch.float32, device=bucket.grad_shard.device)
                with self.timeouts.named("reduced-gradient all-gather", bucket.layout.index):
                    comm.all_gather(full, bucket.grad_shard, group=self.groups.world)
                positions = [i for i in range(len(bucket.params)) if used[offset + i]]
                bucket.carry_grads(full, positions)
                offset += len(bucket.params)
        for records in self.fragments_by_name.values():
            for record in records:
                record.master.grad = None

    def _start_grad_exchange(self, index: int) -> Pending:
        bucket, collective = self.buckets[index], self.grad_collectives[index]
        with torch.no_grad():
            grads = bucket.take_grads(in_place=collective.reads_in_place)
            return collective.start(bucket, grads, 1.0 / self.topology.world_size, self.step)

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduce-scatter, decide the step, and hand the gradient shards to
        the fragments. Idempotent until the next backward or `discard_grads`.

        Buckets whose parameters got no gradient are sent now, in order. Collective.
        """
        if self.schedule.grads_reduced:
            return
        with torch.no_grad():
            self.schedule.finish_grads()
            used_here = [position in b.received for b in self.buckets for position in range(len(b.params))]
            shards = [b.grad_shard for b in self.buckets]
            with self.timeouts.named("the step verdict's all-reduces of the gradient norm and the used parameters"):
                self.verdict = decide_step(shards, used_here, self.groups.world, self.groups.host or self.groups.world)
        self._norm_versions = self._grad_versions()
        self._decided = False
        for records in self.fragments_by_name.values():
            for record in records:
                record.master.grad = record.grad

    def drop_grads(self, param_indices: list[int]) -> None:
        """Hooks set these trained parameters' `.grad` to None (indices in bucket order): the
        optimizer skips them this step, as under DDP."""
        if param_indices:
            assert self.verdict is not None
            used = list(self.verdict.used)
            for index in param_indices:
                used[index] = False
            self.verdict.used = tuple(used)

    def prepare_step(self) -> None:
        """Right before the optimizer steps: take in weight edits, then apply the verdict. A
        parameter that got no gradient on any rank (and every one, on a skipped step) has its
        fragments' .grad set to None, so that the optimizer leaves it alone, as under DDP.
        Raises NonFiniteGradientError on every rank with nonfinite="error"."""
        self.finish_grad_sync()
        self.absorb_weight_edits()
        if self._decided:
            return
        self._decided = True
        assert self.verdict is not None
        fragments = (record for records in self.fragments_by_name.values() for record in records)
        self._skip_on_host = apply_verdict(
            self.verdict, self.config.nonfinite, self.optimizers, fragments, self.skipped, self.step
        )

    @property
    def skips_step(self) -> bool:
        """Whether the host skips this step (non-finite gradients, nonfinite='skip', an optimizer
        that cannot skip on the device): then no weight exchange either."""
        return self._decided and self._skip_on_host

    def discard_grads(self) -> None:
        """zero_grad(): drop every accumulated and reduced gradient; a new window starts."""
        if self.schedule.grads_exchanging:
            with torch.no_grad():
                self.schedule.finish_grads()
        self._reset_window()
        self._decided = False
        for records in self.fragments_by_name.values():
            for record in records:
                record.master.grad = None

    def _reset_window(self) -> None:
        self._window_stepped = False
        self.schedule.restart_grads()
        for bucket in self.buckets:
            bucket.start_window()
        self._ready = [set() for _ in self.buckets]
        self.verdict = None

    def _grad_versions(self) -> tuple[int, ...]:
        return tuple(bucket.grad_shard._version for bucket in self.buckets)

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Scale the gradient shards so that the global 2-norm is at most `max_norm`.

        The norm is the step verdict's (one all-reduce of the squared sums, already done) unless
        the shards changed since; the scaling follows torch.nn.utils.clip_grad_norm_
        (coefficient max_norm / (norm + 1e-6), capped at 1). Returns the global norm before
        clipping (non-finite if a gradient is: then the step is skipped or raises in
        `prepare_step`, whatever clipping did to the shards).
        """
        self.finish_grad_sync()
        assert self.verdict is not None
        norm = self.verdict.norm
        if self._grad_versions() != self._norm_versions:
            with self.timeouts.named("the global gradient norm's all-reduce"):
                norm = global_squares([b.grad_shard for b in self.buckets], self.groups.world).sqrt()[0]
        torch._foreach_mul_([bucket.grad_shard for bucket in self.buckets], clip_coefficient(norm, max_norm))
        self._norm_versions = None
        return norm

    # ----------------------------------------------------------------------------------------
    # Weights

    def absorb_weight_edits(self) -> None:
        """Copy writes to the model weights made since the last exchange (a clamp in a hook, an
        average copied in) into the fp32 masters, so that the next step and a checkpoint start
        from them (`WeightAccess.absorb`: writes are tracked, not inferred from values)."""
        self.wait_weights()
        self.access.absorb()

    def _start_weight_exchange(self, index: int) -> Pending:
        with torch.no_grad():
            return self.weight_collectives[index].start(self.buckets[index], self.step)

    def start_weight_sync(self) -> dict[str, float]:
        """After the optimizer step: start every bucket's weight all-gather (none on a skipped
        step: no master changed). Returns the step's communication figures."""
        if not self.skips_step:
            self.schedule.start_weights()
            if self.access.wait_all_after_step:
                self.wait_weights()
        self._window_stepped = True
        self.step += 1
        stats = self.meter.end_step()
        stats["nonfinite_steps"] = self.skipped.lagging()
        return stats

    def weights_loaded(self) -> None:
        """The weights were written from outside (rank 0's broadcast at setup, a checkpoint): take
        them as the applied ones (no exchange wrote them, so none left the applied shards)."""
        with torch.no_grad():
            for index, bucket in enumerate(self.buckets):
                bucket.applied_shard.copy_(bucket.weight_shard)
                self.access.landed(index)

    def gather_weight_shards(self) -> None:
        """Make every rank's weights the concatenation of the ranks' own weight shards (after a
        checkpoint restored each rank's slice of the replicas)."""
        with torch.no_grad():
            for bucket in self.buckets:
                with self.timeouts.named("weight-shard all-gather", bucket.layout.index):
                    comm.all_gather(bucket.weights, bucket.weight_shard.clone(), group=self.groups.world)
        self.weights_loaded()

    def wait_weights(self, indices: Iterable[int] | None = None) -> None:
        """Complete the pending all-gathers of `indices` (default: all of them)."""
        with torch.no_grad():
            self.schedule.wait_weights(indices)

    def open_read_guard(self) -> None:
        """After the optimizer step: until the next backward, a torch operation that reads a
        parameter whose bucket is still exchanging waits for it first (`weight_access.ReadGuard`)."""
        self.access.open_guard(self.schedule.exchanging_weights())

    def close(self) -> None:
        """Finish pending communication and remove the hooks; the module keeps its weights."""
        self.access.close()
        self.wait_weights()
        self.buffers.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
