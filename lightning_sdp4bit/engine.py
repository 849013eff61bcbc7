"""The sharded data-parallel engine (ZeRO-1 with flat buckets) and its step protocol.

A front end (the Trainer's strategy, Fabric's, the simulation's, a plain loop) drives the engine
through these calls only, in this order per micro-batch and optimizer step (docs/design.md
draws the same with the window's phases; `schedule.WindowPhase`):

    pre_forward()                  rank 0's buffers to every rank, when DDP would broadcast them
    ... forward ...
    post_forward()                 notes whether the next forward broadcasts
    with no_sync(): ...            micro-batches that only accumulate (not the window's last)
    pre_backward()                 weights current, the window open, the trained set unchanged
    ... backward ...               gradient hooks: buckets' exchanges start as they complete
    post_backward()                the synced backward's exchanges finish, the verdict is taken
    reduced_gradients(), clip_grad_norm(max_norm), clip_grad_value(value)   optional: hooks
                                   see p.grad; the global norm's clip; an elementwise clip
    pre_optimizer_step()           weight edits into the masters; the verdict armed
    ... optimizer.step() ...       the re-pointed optimizers step this rank's master fragments
    post_optimizer_step()          the weight exchanges start; returns the step's wire figures
    zero_grad()                    (the sharded optimizers' zero_grad calls it) the next window

and, outside the step: `shard_optimizer`, `wait_weights` (weights complete for a reader),
`tracking_weight_writes` (a hook's writes through `.data` count), `before_save` (edits in, all
finite), `before_weights_load` / `weights_loaded` / `restore_step` (around a checkpoint's load),
`running_as` (a simulated job's rank), `close`. Every check
of a step (the trained set, the buffers, the read guard, weight edits, the verdict) sits behind
these calls, so no front end can forget one. Each runs under a `sdp4bit::<name>` profiler label.

What one rank owns and does lives in `rank.ShardedRank`; the engine holds one for this process
(`ShardedEngine`) or every rank of a simulated job (`simulation.SimulatedEngine`), and runs each
phase on all of them, starting a collective on every rank before waiting on any. No Lightning
here: a test drives it with a plain module and optimizer.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from lightning_sdp4bit import comm
from lightning_sdp4bit.agreement import check_ranks_agree
from lightning_sdp4bit.buffer_sync import BufferBroadcast, BufferRule
from lightning_sdp4bit.buffers import Bucket, allocate_buckets, bucket_layouts
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.guards import (
    SkippedSteps,
    check_state_finite,
    stop_if_skipping_cannot_recover,
    unfrozen_since_start,
)
from lightning_sdp4bit.materialize import (
    broadcast_untrained,
    broadcast_weights,
    engine_device,
    is_on_meta,
    materialize_node_slices,
)
from lightning_sdp4bit.module_hooks import CompiledRegionWatch, register_hooks
from lightning_sdp4bit.optim import replica_optimizer, shard_optimizer, step_replica
from lightning_sdp4bit.param_grads import gradients_on_parameters
from lightning_sdp4bit.rank import ShardedRank
from lightning_sdp4bit.schedule import WindowPhase, exchange_stream
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology
from lightning_sdp4bit.weight_access import unseen

__all__ = ["ShardedEngine"]

# Weight all-gathers started ahead of the bucket a forward pre-hook waits for, on a GPU.
_GPU_WEIGHT_PREFETCH = 2


def trained_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that requires grad, in registration order."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the module has no parameters that require grad: there is nothing to shard")
    return named


class ShardedEngine:
    """The engine of one rank of a job: this process's buckets, hooks and exchanges. Collective
    at construction: every rank must build it from the same module and config.

    `manual`: Lightning's manual optimization, where no backward is known to be the window's last
    (the gradients are reduced when a clip or the optimizer step needs them) and the step runs
    inside `training_step`, which goes on at once (the weights are complete after it)."""

    _hooks: list[Any]  # this process's gradient and forward hooks (a real job's engine only)
    _compile_watch: CompiledRegionWatch | None  # likewise

    def __init__(
        self,
        module: nn.Module,
        config: SDP4BitConfig,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter | None = None,
        manual: bool = False,
        device: torch.device | None = None,
    ):
        named = trained_parameters(module)
        layouts = bucket_layouts(named, config, topology.world_size)
        timeouts = comm.Timeouts(topology.rank, groups.timeout)
        on_meta = is_on_meta(module)
        device = engine_device(named[0][1], device, on_meta, config)
        check_ranks_agree(layouts, config, topology.world_size, groups.world, timeouts, device)
        with torch.no_grad():
            if on_meta:  # each rank builds only its node slices; every rank initialized alike
                names = {id(param): name for name, param in named}
                buckets = materialize_node_slices(module, layouts, names, topology, groups, timeouts, device)
            else:
                buckets = allocate_buckets(layouts, dict(named), topology.rank, separate=config.shards_weights)
                broadcast_weights(buckets, groups, timeouts)
            broadcast_untrained(module, groups, timeouts)
            for bucket in buckets:
                bucket.master.copy_(bucket.weight_shard)
        rank = ShardedRank(
            buckets,
            config,
            topology,
            groups,
            meter if meter is not None else WireMeter(),
            exchange_stream(device),
            # On a GPU a wait costs the host nothing, so exchanges can go out just ahead of forward.
            weight_prefetch=_GPU_WEIGHT_PREFETCH if device.type == "cuda" else None,
        )
        buffers = BufferBroadcast(module, groups.world, topology.rank, config.broadcast_buffers, timeouts)
        self._attach(module, config, [rank], buffers, manual=manual)
        self.weights_loaded()  # rank 0's weights, broadcast: no exchange has left the applied shards
        self._hooks = register_hooks(self)
        self._compile_watch = CompiledRegionWatch(module, refuse=config.shards_weights)
        if rank.node_shards is not None:
            rank.node_shards.guard.open()  # from here on a read of a released parameter gathers it

    def _attach(
        self, module: nn.Module, config: SDP4BitConfig, ranks: list[ShardedRank], buffers: BufferRule, manual: bool
    ) -> None:
        """What every engine holds besides its ranks' state (`SimulatedEngine` builds its ranks
        its own way and attaches them here)."""
        self.module, self.config, self.ranks = module, config, ranks
        self.primary = ranks[0]  # this process's rank; a simulated job's rank 0
        self.trained_names = self.primary.trained_names
        self.frozen_names = [name for name, p in module.named_parameters() if not p.requires_grad]
        self.optimizer_param_names: list[list[list[str]]] = []  # per re-pointed optimizer, per group
        self._buffers: BufferRule = buffers
        self._manual, self._no_sync = manual, False
        self._current = self.primary  # the rank whose backward runs now (`running_as`)
        self._hooks = []
        self._compile_watch = None
        self._rank_states: Any = None  # a simulated job's `simulation.ranks.RankStates`

    # ----------------------------------------------------------------------------------------
    # What the code below the front ends reads (checkpoints, optimizer re-pointing): this
    # process's rank, or a simulated job's rank 0.

    @property
    def buckets(self) -> list[Bucket]:
        return self.primary.buckets

    @property
    def fragments_by_name(self) -> dict:
        return self.primary.fragments_by_name

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.primary.optimizers

    @property
    def topology(self) -> Topology:
        return self.primary.topology

    @property
    def groups(self) -> ProcessGroups:
        return self.primary.groups

    @property
    def meter(self) -> WireMeter:
        return self.primary.meter

    @property
    def timeouts(self) -> comm.Timeouts:
        return self.primary.timeouts

    @property
    def skipped(self) -> SkippedSteps:
        return self.primary.skipped

    @property
    def step(self) -> int:
        """Optimizer steps so far (every rank's count is the same)."""
        return self.primary.step

    def restore_step(self, step: int) -> None:
        """Continue counting from a checkpoint's step: the stochastic-rounding seeds derive from it."""
        for rank in self.ranks:
            rank.step = step

    # ----------------------------------------------------------------------------------------
    # The forward

    def pre_forward(self) -> None:
        """Before a forward (one Lightning step, one call of the module under Fabric): rank 0's
        buffers reach every rank if DDP would broadcast them now. Collective when it does."""
        with record_function("sdp4bit::pre_forward"):
            self._buffers.before_forward()
            if self.primary.node_shards is not None:
                self.primary.node_shards.before_forward()

    def post_forward(self) -> None:
        self._buffers.after_forward(grad_sync=not self._no_sync)

    # ----------------------------------------------------------------------------------------
    # The backward

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Micro-batches that only accumulate: nothing is sent in their backward."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    @property
    def _reduces_in_backward(self) -> bool:
        return not self._manual and not self._no_sync

    def pre_backward(self) -> None:
        """Before every backward of the running rank: its weights must be current, its window
        open (reduced gradients not stepped on are carried into it, as DDP adds to them), and no
        parameter frozen at setup may require grad now."""
        with record_function("sdp4bit::pre_backward"):
            rank = self._current
            # First: it closes the read guard, which would otherwise see the checks below. A
            # bucket still exchanging now was read by nothing the guard saw (`grad_arrived`).
            rank.access.before_backward(rank.schedule.exchanging_weights())
            rank.wait_weights()
            rank.open_before_backward()
            if rank.node_shards is not None:
                rank.node_shards.before_backward()
            self.check_trained_set()

    @unseen
    def on_grad_ready(self, index: int, position: int) -> None:
        """From a parameter's post-accumulate-grad hook, once its .grad is complete."""
        param = self._current.buckets[index].params[position]
        assert param.grad is not None  # the hook runs once the gradient is accumulated
        self._current.receive(index, position, param.grad, synced=self._reduces_in_backward)
        param.grad = None
        if self._current.node_shards is not None:
            self._current.node_shards.grad_arrived(index)

    def receive_grads(self, grads: list[Tensor | None] | None = None) -> None:
        """The running rank's backward is done, for a driver that runs several ranks' backward
        passes in one process (no gradient hooks): take every trained parameter's .grad (then
        cleared), or `grads` (one per trained parameter in `trained_names` order, None for one
        with none: a CUDA graph's static gradients, `simulation.graphed`)."""
        params = [p for b in self._current.buckets for p in b.params]
        taken = grads if grads is not None else [p.grad for p in params]
        if grads is None:
            for param in params:
                param.grad = None
        self._current.receive_all(taken, synced=self._reduces_in_backward)

    @unseen
    def post_backward(self) -> None:
        """After the backward of every rank this engine runs: in the synced backward (outside
        `no_sync`, automatic optimization) the exchanges finish and the step is decided."""
        for rank in self.ranks:
            rank.release_weights()  # no backward needs them any more
        if self._reduces_in_backward:
            self._reduce()

    def _reduce(self) -> None:
        """Every rank's window OPEN -> REDUCED: start what backward did not, wait for it all, then
        decide the step alike on every rank (`guards`: global norm, non-finite gradients,
        parameters that got none). Idempotent until the next window. Collective."""
        ranks = [rank for rank in self.ranks if rank.window is WindowPhase.OPEN]
        if not ranks:
            return
        with record_function("sdp4bit::reduce"):
            for rank in ranks:
                rank.launch_grads()
            if len(ranks) > 1:  # a simulated job: every first stage is in, so each second stage goes out
                for rank in ranks:
                    rank.poll_grads()
            pending = [rank.start_verdict() for rank in ranks]
            for rank, verdict in zip(ranks, pending, strict=True):
                rank.finish_verdict(verdict)

    # ----------------------------------------------------------------------------------------
    # Between backward and the optimizer step

    def reduced_gradients(self) -> AbstractContextManager:
        """Within the block every trained parameter's .grad is the full averaged gradient, and
        edits to it reach the shards (`param_grads`; one fp32 all-gather). Collective."""
        if len(self.ranks) > 1:
            raise RuntimeError("a simulated job cannot put gradients on the parameters (they would be every rank's)")
        self._reduce()
        return gradients_on_parameters(self.primary)

    @unseen
    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Scale every rank's gradient shards so that the global 2-norm is at most `max_norm`, as
        torch.nn.utils.clip_grad_norm_ does (the verdict's norm, unless the shards changed since);
        returns the norm before clipping (non-finite if a gradient is: the step is then skipped or
        raises in `pre_optimizer_step`). Collective."""
        with record_function("sdp4bit::clip_grad_norm"):
            self._reduce()
            pending = [rank.start_norm() for rank in self.ranks]
            norms = [rank.clip(sums, max_norm) for rank, sums in zip(self.ranks, pending, strict=True)]
        return norms[0]

    @unseen
    def clip_grad_value(self, clip_value: float) -> None:
        """Clamp every rank's reduced gradients to [-clip_value, clip_value], elementwise, as
        torch.nn.utils.clip_grad_value_ does. Collective (it reduces first)."""
        with record_function("sdp4bit::clip_grad_value"):
            self._reduce()
            for rank in self.ranks:
                torch._foreach_clamp_min_([b.grad_shard for b in rank.buckets], -clip_value)
                torch._foreach_clamp_max_([b.grad_shard for b in rank.buckets], clip_value)

    @unseen
    def pre_optimizer_step(self) -> None:
        """Right before the optimizer steps: reduce if nothing did yet, take weight edits into the
        masters (`WeightAccess.absorb`), then arm the verdict: a parameter that got no gradient
        on any rank (and every one, on a skipped step) has its fragments' .grad set to None, so
        the optimizer leaves it alone, as under DDP. Raises NonFiniteGradientError on every rank
        with nonfinite="error"."""
        with record_function("sdp4bit::pre_optimizer_step"):
            self._reduce()
            for rank in self.ranks:
                rank.absorb_weight_edits()
                rank.arm()

    @unseen
    def post_optimizer_step(self) -> dict[str, float]:
        """After the optimizer step: every bucket's weight exchange starts (none on a skipped
        step), the first layers' first. A forward waits for each module's own buckets, and until
        the next backward any other torch operation on a parameter waits for its bucket (the read
        guard). Returns the step's communication figures (`stats.WireMeter`)."""
        with record_function("sdp4bit::post_optimizer_step"):
            for rank in self.ranks[1:]:  # a simulated job: rank 0's optimizers were the caller's to step
                for mine, replica in zip(self.primary.optimizers, rank.optimizers, strict=True):
                    step_replica(mine, replica)
            for rank in self.ranks:
                rank.start_weights()
            watched = self._compile_watch is not None and self._compile_watch.seen
            if len(self.ranks) > 1:
                for rank in self.ranks:  # every rank's rows are in: each second stage goes out
                    rank.poll_weights()
                self.wait_weights()
            elif self._manual or watched or self.primary.access.wait_all_after_step:
                # Compiled forwards then find nothing in flight (no Work.wait traced); manual
                # optimization's training_step goes on after the step and may touch any weight.
                self.wait_weights()
            if self.primary.node_shards is None:  # else a gather waits for the bucket's exchange
                self.primary.access.open_guard(self.primary.schedule.exchanging_weights())
            stats = [rank.end_step() for rank in self.ranks][0]
            stop_if_skipping_cannot_recover(self.ranks, self.config, self.trained_names)
            return stats

    def zero_grad(self) -> None:
        """The running rank's optimizer.zero_grad(): its accumulated and reduced gradients are
        dropped, and a new window opens."""
        with record_function("sdp4bit::zero_grad"):
            self._current.discard()

    # ----------------------------------------------------------------------------------------
    # Outside the step

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point `optimizer` at the master fragments (`lightning_sdp4bit.optim`); a simulated
        job's other ranks get optimizers of the same class and options over their own."""
        shard_optimizer(self, optimizer)
        for rank in self.ranks[1:]:
            rank.optimizers.append(replica_optimizer(optimizer, rank, self.optimizer_param_names[-1]))

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

    def wait_weights(self, indices: Iterable[int] | None = None) -> None:
        """Complete the pending weight all-gathers of `indices` (default: all of them)."""
        selected = None if indices is None else list(indices)
        for rank in self.ranks:
            rank.wait_weights(selected)

    def before_save(self) -> None:
        """Before a checkpoint is written: the weights complete, every write to them since the last
        exchange taken into the masters (as `pre_optimizer_step` does before a step), and the
        masters and weights finite on every rank, or NonFiniteStateError (nothing is written).
        Collective."""
        for rank in self.ranks:
            rank.absorb_weight_edits()
        check_state_finite(self.ranks, self.trained_names, "before a checkpoint is written")

    def tracking_weight_writes(self) -> AbstractContextManager:
        """A `with` block (a user hook) in which writes through `p.data` of trained parameters
        count as writes (`weight_access.DataWriteTracker`)."""
        return self.primary.access.tracking_data_writes()

    def before_weights_load(self) -> None:
        """The weights this rank holds are about to be overwritten from outside (a checkpoint):
        with the weights sharded inside the node, gathered copies are dropped, not written back."""
        self.wait_weights()
        for rank in self.ranks:
            if rank.node_shards is not None:
                rank.node_shards.release(range(len(rank.buckets)), keep=False)

    def weights_loaded(self) -> None:
        """The weights were written from outside (rank 0's broadcast at setup, a checkpoint): take
        them as the applied ones (no exchange wrote them, so none left the applied shards)."""
        self.wait_weights()
        with torch.no_grad():
            for rank in self.ranks:
                rank.release_weights()  # writes to gathered weights are in the node slices now
                for index, bucket in enumerate(rank.buckets):
                    bucket.applied_shard.copy_(bucket.weight_shard)
                    rank.access.landed(index)

    def gather_weight_shards(self) -> None:
        """Make every rank's weights (its node slices, with the weights sharded inside the node) the
        ranks' own weight shards, gathered (after a checkpoint restored each rank's shard). Collective."""
        group = self.groups.world if self.primary.node_shards is None else self.groups.inter
        self.before_weights_load()
        with torch.no_grad():
            for bucket in self.buckets:
                own = bucket.weight_shard.clone()
                with self.timeouts.named("weight-shard all-gather", bucket.layout.index):
                    if group is None:  # one node: the node slice is this rank's shard
                        bucket.held_weights.copy_(own)
                    else:
                        comm.all_gather(bucket.held_weights, own, group=group)
        self.weights_loaded()

    @contextmanager
    def running_as(self, index: int) -> Generator[None, None, None]:
        """Within the block, `pre_backward`, the gradients and `zero_grad` are rank `index`'s, and
        in a simulated job (which runs its ranks' steps one after another in this process) so are
        the RNG state and the module buffers (`simulation.ranks.RankStates`)."""
        previous, self._current = self._current, self.ranks[index]
        if self._rank_states is not None:
            self._rank_states.enter(index)
        try:
            yield
        finally:
            if self._rank_states is not None:
                self._rank_states.leave(index)
            self._current = previous

    def close(self) -> None:
        """Finish pending communication and remove the hooks; the module keeps its weights."""
        for rank in self.ranks:
            rank.access.close()
        self.wait_weights()
        if self.primary.node_shards is not None:
            self.primary.node_shards.close()  # the module whole again where it fits on the device
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._compile_watch is not None:
            self._compile_watch.close()
