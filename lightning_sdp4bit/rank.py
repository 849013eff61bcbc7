"""One rank's share of the sharded step: its shards, its two exchanges per bucket, and where its
accumulation window is (`schedule.WindowPhase`). The words are those of docs/design.md.

`ShardedRank` holds what one rank of the job owns (N = bucket elements, S = N / world):
- per bucket (`buffers.Bucket`): the window gradients [N], the master shard, gradient shard and
  applied shard [S]; the model weights [N] are the module's (in a simulated job, one copy
  serves every rank);
- per bucket, its gradient reduce-scatter and weight all-gather (`collectives`,
  `weight_collectives`) and their phases (`schedule.BucketSchedule`);
- the step's verdict (`guards.StepVerdict`), the optimizers that step its master fragments, its
  count of skipped steps, and its account of the weights (`weight_access.WeightAccess`).

Its methods are the phases of the step, each local to the rank or one half of a collective
(`start_*` launches, `finish_*` / `wait_*` completes), so that `engine.ShardedEngine` runs the
same phases for the one rank of a process and for every rank of a simulated job, starting a
collective on every rank before it waits on any. No Lightning here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sdp4bit import comm
from lightning_sdp4bit.buffers import Bucket, Fragment
from lightning_sdp4bit.collectives import Pending, grad_collective_for
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.guards import (
    PendingSum,
    PendingVerdict,
    SkippedSteps,
    StepVerdict,
    apply_verdict,
    clip_coefficient,
    finite_flags,
    local_squares,
    start_sum,
    start_verdict,
)
from lightning_sdp4bit.node_shards import NodeShards
from lightning_sdp4bit.schedule import BucketSchedule, GradPhase, WindowPhase
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology
from lightning_sdp4bit.weight_access import WeightAccess
from lightning_sdp4bit.weight_collectives import weight_collective_for

__all__ = ["MasterFragment", "ShardedRank", "master_fragments"]

# The window phases in which the reduced gradients are held and not yet stepped on.
_REDUCED_NOT_STEPPED = (WindowPhase.REDUCED, WindowPhase.ARMED, WindowPhase.SKIPPING)
# What a timeout in the verdict's, the clip's and the state check's sums names (`comm.Timeouts.named`).
_VERDICT = "the step verdict's all-reduces of the gradient norm and the used parameters"
_NORM = "the global gradient norm's all-reduce"
_FINITE = "the all-reduce that checks the masters and weights are finite"


@dataclass(frozen=True)
class MasterFragment:
    """One parameter's slice of this rank's shard: what the optimizer steps."""

    fragment: Fragment
    param_index: int  # the parameter's position among the trained parameters (bucket order)
    master: Tensor  # fp32 view into the bucket's master shard
    grad: Tensor  # fp32 view into the bucket's gradient shard


def master_fragments(buckets: list[Bucket], rank: int) -> dict[str, list[MasterFragment]]:
    """Parameter name -> its fragments in `rank`'s shards (at most one per parameter, since a
    parameter sits in one bucket and a shard is contiguous)."""
    index_of = {slot.name: i for i, slot in enumerate(slot for b in buckets for slot in b.layout.slots)}
    by_name: dict[str, list[MasterFragment]] = {}
    for bucket in buckets:
        for frag in bucket.layout.fragments(rank):
            window = slice(frag.shard_start, frag.shard_start + frag.numel)
            by_name.setdefault(frag.name, []).append(
                MasterFragment(frag, index_of[frag.name], bucket.master[window], bucket.grad_shard[window])
            )
    return by_name


class ShardedRank:
    """One rank's buckets, exchanges, window and optimizers (see the module docstring).

    `stream`: the engine's exchange stream on a GPU (`schedule.exchange_stream`), or None;
    `weight_prefetch`: see `schedule.BucketSchedule`."""

    def __init__(
        self,
        buckets: list[Bucket],
        config: SDP4BitConfig,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter,
        stream: torch.cuda.Stream | None = None,
        weight_prefetch: int | None = None,
    ):
        self.buckets, self.config, self.topology, self.groups, self.meter = buckets, config, topology, groups, meter
        self.timeouts = comm.Timeouts(topology.rank, groups.timeout)  # every wait runs in its named()
        self.trained_names = [slot.name for bucket in buckets for slot in bucket.layout.slots]  # bucket order
        self.fragments_by_name = master_fragments(buckets, topology.rank)
        self.fragments = [record for records in self.fragments_by_name.values() for record in records]
        self.grad_collectives = [grad_collective_for(b, config, topology, groups, meter, stream) for b in buckets]
        self.weight_collectives = [weight_collective_for(b, config, topology, groups, meter, stream) for b in buckets]
        # Reads and writes of the weights outside the engine's hooks (`lightning_sdp4bit.weight_access`).
        self.access = WeightAccess(buckets, topology.rank, self.wait_weights)
        # weight_sharding="node": the node slices and which buckets are gathered (`node_shards`).
        self.node_shards = (
            NodeShards(buckets, topology, groups, self.timeouts, meter, self.wait_weights, config.gathers_ahead)
            if config.shards_weights
            else None
        )
        self.schedule = BucketSchedule(
            len(buckets),
            self._start_grad_exchange,
            self._start_weight_exchange,
            self.access.landed,
            weight_prefetch=weight_prefetch,
            timeouts=self.timeouts,
        )
        self.window = WindowPhase.OPEN
        self.verdict: StepVerdict | None = None  # the window's verdict, from REDUCED on
        self.step = 0  # optimizer steps so far: the stochastic-rounding seeds derive from it
        self.skipped = SkippedSteps(buckets[0].weights.device, topology.rank)
        self.optimizers: list[torch.optim.Optimizer] = []  # re-pointed at this rank's master fragments
        self._synced: list[set[int]] = [set() for _ in buckets]  # per bucket: positions in by the synced backward
        self._norm_versions: tuple[int, ...] | None = None  # the gradient shards' versions when verdict.norm was taken
        self._warned_no_zero_grad = False

    # ----------------------------------------------------------------------------------------
    # Gradients into the window

    def receive(self, index: int, position: int, grad: Tensor, synced: bool) -> None:
        """Parameter `position` of bucket `index` has its complete gradient for this backward.
        In the synced backward (`synced`: the window's last) it is held until its bucket is
        complete, whose exchange then starts (in bucket order); otherwise added to the window."""
        self._check_open(index)
        bucket = self.buckets[index]
        if self.schedule.grad_phase[index] is not GradPhase.ACCUMULATING:
            raise RuntimeError(
                f"parameter {bucket.layout.slots[position].name!r} received a gradient after its bucket's "
                "reduce-scatter started (it was used again later in the same backward); this strategy needs each "
                "parameter's gradient to be final once its hook fires"
            )
        with torch.no_grad():
            if synced:
                bucket.hold_grad(position, grad)
            else:
                bucket.receive_grad(position, grad, accumulating=True)
        if synced:
            self._synced[index].add(position)  # only the synced backward's gradients complete a bucket
            self.schedule.launch_ready(lambda i: len(self._synced[i]) == len(self.buckets[i].params))

    def receive_all(self, grads: list[Tensor | None], synced: bool) -> None:
        """Every trained parameter's gradient of one backward at once (None: it got none), in
        bucket order: what `receive` does one by one, with one copy per bucket, and no exchange
        started (a simulated job starts every rank's together)."""
        offset = 0
        with torch.no_grad():
            for index, bucket in enumerate(self.buckets):
                mine = grads[offset : offset + len(bucket.params)]
                offset += len(bucket.params)
                arrivals = [(position, grad) for position, grad in enumerate(mine) if grad is not None]
                if arrivals:
                    self._check_open(index)
                    bucket.receive_grads(arrivals, accumulating=not synced)

    def _check_open(self, index: int) -> None:
        self.access.grad_arrived(index)
        if self.window is not WindowPhase.OPEN:
            self.open_after_step()  # a backward the engine was not told of (no pre_backward)

    def open_before_backward(self) -> None:
        """Before a backward: the window must be OPEN. Reduced gradients not stepped on (a
        backward after the synced one, as a Fabric loop without no_backward_sync runs) are
        carried into it; after a step without zero_grad the window starts afresh."""
        if self.window in _REDUCED_NOT_STEPPED:
            self._carry_reduced()
        elif self.window is WindowPhase.STEPPED:
            self.open_after_step()

    def open_after_step(self) -> None:
        if not self._warned_no_zero_grad:
            warnings.warn(
                "a backward ran after an optimizer step's gradients were reduced, with no zero_grad() in "
                "between. Under sdp4bit each optimizer step's gradients start from zero (DDP would add the "
                "old ones): call optimizer.zero_grad() after each step.",
                stacklevel=4,
            )
            self._warned_no_zero_grad = True
        self._reset_window()

    def _carry_reduced(self) -> None:
        """As DDP adds each synced backward's gradient to the reduced `p.grad` and reduces the sum,
        the new window starts from the full reduced gradient (one fp32 all-gather per bucket,
        [S] -> [N], on this path only). Collective."""
        assert self.verdict is not None
        used, offset = self.verdict.used, 0
        self._reset_window()
        with torch.no_grad():
            for bucket in self.buckets:
                full = torch.empty(bucket.layout.numel, dtype=torch.float32, device=bucket.grad_shard.device)
                with self.timeouts.named("reduced-gradient all-gather", bucket.layout.index):
                    comm.all_gather(full, bucket.grad_shard, group=self.groups.world)
                bucket.carry_grads(full, [i for i in range(len(bucket.params)) if used[offset + i]])
                offset += len(bucket.params)
        self._release_fragment_grads()

    def discard(self) -> None:
        """zero_grad: drop every accumulated and reduced gradient; the window is OPEN again."""
        if self.schedule.grads_exchanging:
            with torch.no_grad():
                self.schedule.finish_grads()
        self._reset_window()
        self._release_fragment_grads()

    def _reset_window(self) -> None:
        self.schedule.restart_grads()
        for bucket in self.buckets:
            bucket.start_window()
        self._synced = [set() for _ in self.buckets]
        self.verdict, self.window = None, WindowPhase.OPEN

    def _release_fragment_grads(self) -> None:
        for record in self.fragments:
            record.master.grad = None

    # ----------------------------------------------------------------------------------------
    # Reduction and the verdict (OPEN -> REDUCED)

    def _start_grad_exchange(self, index: int) -> Pending:
        bucket, collective = self.buckets[index], self.grad_collectives[index]
        with torch.no_grad():
            grads = bucket.take_grads(in_place=collective.reads_in_place)
            return collective.start(bucket, grads, 1.0 / self.topology.world_size, self.step)

    def launch_grads(self) -> None:
        """Start the gradient exchanges not started during backward (in bucket order)."""
        with torch.no_grad():
            self.schedule.launch_all_grads()

    def poll_grads(self) -> None:
        with torch.no_grad():
            self.schedule.poll()

    def start_verdict(self) -> PendingVerdict:
        """Wait for every gradient exchange, then start the verdict's sums. Collective."""
        with torch.no_grad():
            self.schedule.finish_grads()
            used_here = [position in b.received for b in self.buckets for position in range(len(b.params))]
            shards = [b.grad_shard for b in self.buckets]
            with self.timeouts.named(_VERDICT):
                return start_verdict(shards, used_here, self.groups.world, self.groups.host or self.groups.world)

    def finish_verdict(self, pending: PendingVerdict) -> None:
        with self.timeouts.named(_VERDICT):
            self.verdict = pending.finish()
        self._norm_versions = self._grad_versions()
        self.window = WindowPhase.REDUCED
        for record in self.fragments:
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

    # ----------------------------------------------------------------------------------------
    # Clipping, edits and arming (REDUCED -> ARMED | SKIPPING)

    def _grad_versions(self) -> tuple[int, ...]:
        return tuple(bucket.grad_shard._version for bucket in self.buckets)

    def start_norm(self) -> PendingSum | None:
        """The global squared norm's sum, if the gradient shards changed since the verdict took
        it (a hook edited them, or they were clipped); None: the verdict's holds. Collective."""
        if self._grad_versions() == self._norm_versions:
            return None
        with self.timeouts.named(_NORM):
            return start_sum(local_squares([b.grad_shard for b in self.buckets]), self.groups.world)

    def clip(self, pending: PendingSum | None, max_norm: float) -> Tensor:
        """Scale the gradient shards so that the global 2-norm is at most `max_norm`, as
        torch.nn.utils.clip_grad_norm_ does; returns the norm before clipping."""
        assert self.verdict is not None
        if pending is None:
            norm = self.verdict.norm
        else:
            with self.timeouts.named(_NORM):
                norm = pending.finish().sqrt()[0]
        torch._foreach_mul_([bucket.grad_shard for bucket in self.buckets], clip_coefficient(norm, max_norm))
        self._norm_versions = None
        return norm

    def absorb_weight_edits(self) -> None:
        """Copy writes to the model weights made since the last exchange (a clamp in a hook, an
        average copied in) into the fp32 masters (`WeightAccess.absorb`); with the weights
        sharded inside the node, from the node slices, into which releasing puts them."""
        self.wait_weights()
        self.release_weights()
        self.access.absorb()

    def release_weights(self) -> None:
        """weight_sharding="node": let every gathered bucket go (its rows kept in the node slice)."""
        if self.node_shards is not None:
            self.node_shards.release_all()

    def arm(self) -> None:
        """Apply the verdict to this rank's optimizers and fragments, once per reduction (a second
        step on the same gradients steps them as they were armed). Raises NonFiniteGradientError
        with nonfinite="error"."""
        if self.window is not WindowPhase.REDUCED:
            return
        assert self.verdict is not None
        skip = apply_verdict(
            self.verdict, self.config.nonfinite, self.optimizers, self.fragments, self.skipped, self.step
        )
        self.window = WindowPhase.SKIPPING if skip else WindowPhase.ARMED

    # ----------------------------------------------------------------------------------------
    # Weights (-> STEPPED)

    def _start_weight_exchange(self, index: int) -> Pending:
        with torch.no_grad():
            return self.weight_collectives[index].start(self.buckets[index], self.step)

    def start_weights(self) -> bool:
        """After the optimizer step: start every bucket's weight exchange, unless the host skipped
        the step (no master changed). Returns whether they were started."""
        started = self.window is not WindowPhase.SKIPPING
        self.release_weights()  # the exchange writes the node slices: no gathered copy may outlive it
        if started:
            with torch.no_grad():
                self.schedule.start_weights()
        self.window = WindowPhase.STEPPED
        self.step += 1
        return started

    def poll_weights(self) -> None:
        with torch.no_grad():
            self.schedule.poll_weights()

    def wait_weights(self, indices: Iterable[int] | None = None) -> None:
        """Complete the pending all-gathers of `indices` (default: all of them)."""
        with torch.no_grad():
            self.schedule.wait_weights(indices)

    def end_step(self) -> dict[str, float]:
        """The step's communication figures (`stats.WireMeter`) and the skipped steps so far."""
        stats = self.meter.end_step()
        stats["nonfinite_steps"] = self.skipped.lagging(self.step - 1)
        return stats

    def start_finite_check(self) -> PendingSum:
        """Start summing `guards.finite_flags` of this rank's masters and replica over the ranks
        (on the host group: CPU tensors). Collective."""
        params = sum(len(bucket.params) for bucket in self.buckets)
        flags = finite_flags(self.fragments, self.buckets, self.topology.world_size, self.topology.rank, params)
        with self.timeouts.named(_FINITE):
            return start_sum(flags, self.groups.host or self.groups.world)

    def finish_finite_check(self, pending: PendingSum) -> Tensor:
        with self.timeouts.named(_FINITE):
            return pending.finish()
