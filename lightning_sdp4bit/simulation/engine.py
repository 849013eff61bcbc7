"""A job of W = M x L ranks on one device, with the math of W processes.

`SimulatedEngine` does, in one process and on one copy of the model's weights, what the W
processes of a real job do with `ShardedEngine`: each simulated rank has its own window
gradients (fed by its own backward), its own master shards, gradient shards and optimizer, and
its own stochastic-rounding seeds, and the exchanges are the real ones
(`collectives.grad_collective_for`, `weight_collectives.weight_collective_for`: the same ops,
the same layout, the same seeds) over `simulation.groups`, whose sums are taken in rank order as
gloo's are (`comm.sum_rows_into`). So a simulated job and a real gloo job of the same shape end
with the same weights, masters and optimizer states, bit for bit (tests/test_simulation.py).

One copy of the weights serves every rank: replicas are bit-identical under every preset (qWD
applies the same all-gathered differences everywhere), so only rank 0's weight exchange is
completed and applied; the others encode and send their shards and stop there.

Memory, beside the model and its activations: every rank's window gradients at once before the
exchanges ([N] per bucket and rank, the weights' dtype for one backward, fp32 under gradient
accumulation), that is up to W times the weights' bytes; the masters, gradient shards and
optimizer states of all ranks together cost what one rank of a one-rank job would.

What the driver calls, per optimizer step (the engine's own names where they mean the same):
`receive_grads(rank, accumulating)` after each rank's backward; `finish_grad_sync`;
`clip_grad_norm`; `prepare_step`; every rank's `optimizers` step (`step_other_ranks` steps all but
rank 0's, which the caller steps, as Lightning does); `start_weight_sync`. The next gradient after
an exchange opens a new window.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_sdp4bit.buffers import Bucket, allocate_buckets
from lightning_sdp4bit.collectives import grad_collective_for
from lightning_sdp4bit.comm import sum_rows_into
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import MasterFragment, bucket_layouts, master_fragments
from lightning_sdp4bit.guards import SkippedSteps, StepVerdict, apply_verdict, clip_coefficient, local_squares
from lightning_sdp4bit.optim import shard_optimizer
from lightning_sdp4bit.simulation.groups import SimulatedGroup
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology
from lightning_sdp4bit.weight_collectives import weight_collective_for

__all__ = ["SimulatedEngine", "SimulatedRank", "check_shape", "parse_world"]


def parse_world(spec: str | tuple[int, int]) -> tuple[int, int]:
    """ "16x4" (M nodes x L ranks per node) or (M, L) -> (M, L), checked."""
    if isinstance(spec, str):
        parts = spec.lower().replace(" ", "").split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"simulate={spec!r}: expected 'MxL' (M nodes of L ranks each), e.g. '16x4'")
        spec = (int(parts[0]), int(parts[1]))
    nodes, local = spec
    if nodes < 1 or local < 1 or nodes * local < 2:
        raise ValueError(f"simulate={nodes}x{local}: needs at least 1 node, 1 rank per node and 2 ranks in all")
    return nodes, local


def check_shape(config: SDP4BitConfig, nodes: int, ranks_per_node: int) -> None:
    """A simulated job takes its shape from its world ("MxL"): a `config.ranks_per_node` set to
    another L contradicts it (ignoring it would run another job than the config describes)."""
    if config.ranks_per_node is not None and config.ranks_per_node != ranks_per_node:
        raise ValueError(
            f"ranks_per_node={config.ranks_per_node} contradicts simulate={nodes}x{ranks_per_node}, whose nodes "
            f"have {ranks_per_node} ranks: leave ranks_per_node unset (None) or set it to {ranks_per_node}"
        )


@dataclass
class SimulatedRank:
    """What one simulated rank owns (the model's weights are everyone's)."""

    topology: Topology
    buckets: list[Bucket]
    fragments_by_name: dict[str, list[MasterFragment]]
    grad_collectives: list
    weight_collectives: list
    meter: WireMeter
    skipped: SkippedSteps
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    fragments: list[MasterFragment] = field(init=False)  # every record of fragments_by_name

    def __post_init__(self) -> None:
        self.fragments = [record for records in self.fragments_by_name.values() for record in records]


def _simulated_groups(nodes: int, local: int) -> list[ProcessGroups]:
    """Every rank's groups, shaped as `topology.create_process_groups` shapes them."""
    world = SimulatedGroup(nodes * local, "world")
    intra = [SimulatedGroup(local, f"node {n}") for n in range(nodes)] if local > 1 and nodes > 1 else None
    inter = [SimulatedGroup(nodes, f"local index {i}") for i in range(local)] if nodes > 1 and local > 1 else None
    out = []
    for rank in range(nodes * local):
        node, index = divmod(rank, local)
        member = world.member(rank)
        out.append(
            ProcessGroups(
                world=member,
                # A stage whose group would hold every rank uses the world group; an absent one is None.
                intra=(intra[node].member(index) if intra else member) if local > 1 else None,
                inter=(inter[index].member(node) if inter else member) if nodes > 1 else None,
                host=member,
            )
        )
    return out


class SimulatedEngine:
    """Every rank of an M x L job, on one device. Rank 0's view (`buckets`, `fragments_by_name`,
    `optimizers`, `meter`) is what the engine's users read; `ranks` holds them all."""

    def __init__(self, module: nn.Module, config: SDP4BitConfig, nodes: int, ranks_per_node: int):
        check_shape(config, nodes, ranks_per_node)
        self.module, self.config = module, config
        self.world_size = nodes * ranks_per_node
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require grad: there is nothing to shard")
        layouts = bucket_layouts(named, config, self.world_size)
        with torch.no_grad():
            shared = allocate_buckets(layouts, dict(named), rank=0)  # the one copy of the weights
        self.trained_names = [slot.name for b in shared for slot in b.layout.slots]
        self._trained_params = [p for b in shared for p in b.params]  # in trained_names order
        self.ranks: list[SimulatedRank] = []
        for rank, groups in enumerate(_simulated_groups(nodes, ranks_per_node)):
            topology = Topology(rank, self.world_size, ranks_per_node)
            buckets = shared if rank == 0 else [Bucket(b.layout, rank, b.weights, b.params) for b in shared]
            meter = WireMeter()
            device = buckets[0].weights.device
            self.ranks.append(
                SimulatedRank(
                    topology,
                    buckets,
                    master_fragments(buckets, rank, self.trained_names),
                    # No exchange stream: on a GPU the simulated collectives are copies on the
                    # current stream, launched by the host in the order below.
                    [grad_collective_for(b, config, topology, groups, meter) for b in buckets],
                    [weight_collective_for(b, config, topology, groups, meter) for b in buckets],
                    meter,
                    SkippedSteps(device, rank),
                )
            )
        self.step = 0
        self.verdict: StepVerdict | None = None
        self.optimizer_param_names: list[list[list[str]]] = []
        self._reduced = False  # the window's gradients are exchanged and the verdict taken
        self._decided = False  # prepare_step applied the verdict
        self._skip_on_host = False

    # Rank 0's view, under the names ShardedEngine uses.
    @property
    def buckets(self) -> list[Bucket]:
        return self.ranks[0].buckets

    @property
    def fragments_by_name(self) -> dict[str, list[MasterFragment]]:
        return self.ranks[0].fragments_by_name

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.ranks[0].optimizers

    @property
    def meter(self) -> WireMeter:
        return self.ranks[0].meter

    # ----------------------------------------------------------------------------------------
    # Optimizers

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point `optimizer` at rank 0's master fragments (as `ShardedEngine.shard_optimizer`)
        and give every other rank an optimizer of the same class and options over its own."""
        cls = type(optimizer)  # the user's class (shard_optimizer gives rank 0's a subclass of it)
        shard_optimizer(self, optimizer)  # type: ignore[arg-type]
        names = self.optimizer_param_names[-1]
        # The constructor's own keywords: `defaults` may hold more (AdamW's decoupled_weight_decay).
        accepted = inspect.signature(cls.__init__).parameters
        options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        for rank in self.ranks[1:]:
            groups = [
                {**{k: v for k, v in group.items() if k != "params"}, "params": _masters(rank, group_names)}
                for group, group_names in zip(optimizer.param_groups, names, strict=True)
            ]
            try:
                rank.optimizers.append(cls(groups, **options))
            except TypeError as err:
                raise TypeError(
                    f"simulation: cannot build {cls.__name__} for the other ranks as {cls.__name__}(param_groups, "
                    f"**defaults) ({err}); the simulation supports optimizers whose constructor takes their "
                    "defaults as keyword arguments, as torch.optim's do"
                ) from err

    def step_other_ranks(self) -> None:
        """Step every rank's optimizers but rank 0's (which the caller steps), with rank 0's group
        options (an LR scheduler changes those)."""
        for index, optimizer in enumerate(self.optimizers):
            for rank in self.ranks[1:]:
                other = rank.optimizers[index]
                for mine, theirs in zip(optimizer.param_groups, other.param_groups, strict=True):
                    theirs.update({k: v for k, v in mine.items() if k != "params"})
                other.step()

    # ----------------------------------------------------------------------------------------
    # Gradients

    def receive_grads(self, rank: int, accumulating: bool, grads: list[Tensor | None] | None = None) -> None:
        """After rank `rank`'s backward: its gradients go into its window gradients, as the engine's
        post-accumulate-grad hooks put them. `grads` (one per trained parameter, in `trained_names`
        order; None for one that got none) defaults to the parameters' .grad, which are then
        cleared; a CUDA graph passes its static gradient tensors instead (`simulation.graphed`)."""
        if self._reduced:
            self._open_window()
        params = self._trained_params
        taken = grads if grads is not None else [p.grad for p in params]
        if grads is None:
            for param in params:
                param.grad = None
        offset = 0
        with torch.no_grad():
            for bucket in self.ranks[rank].buckets:
                mine = taken[offset : offset + len(bucket.params)]
                offset += len(bucket.params)
                bucket.receive_grads([(i, g) for i, g in enumerate(mine) if g is not None], accumulating)

    def finish_grad_sync(self) -> None:
        """Every bucket's reduce-scatter on every rank, then the step's verdict (one for all ranks:
        they compute the same one). Idempotent until the next window."""
        if self._reduced:
            return
        with torch.no_grad():
            for index in range(len(self.buckets)):
                pending = [
                    rank.grad_collectives[index].start(
                        rank.buckets[index], rank.buckets[index].take_grads(), 1.0 / self.world_size, self.step
                    )
                    for rank in self.ranks
                ]
                for exchange in pending:  # every rank's second stage, once all first stages are in
                    exchange.progress()
                for exchange in pending:
                    exchange.wait()
            self.verdict = self._decide()
        self._reduced, self._decided = True, False
        for rank in self.ranks:
            for record in rank.fragments:
                record.master.grad = record.grad

    def _decide(self) -> StepVerdict:
        """`guards.decide_step` of every rank at once: the same sums, in rank order."""
        rows = torch.stack([local_squares([b.grad_shard for b in rank.buckets]) for rank in self.ranks])
        squares = torch.empty_like(rows[0])
        sum_rows_into(squares, rows)
        used = [
            any(position in rank.buckets[index].received for rank in self.ranks)
            for index, bucket in enumerate(self.buckets)
            for position in range(len(bucket.params))
        ]
        return StepVerdict(squares, tuple(used))

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """As `ShardedEngine.clip_grad_norm`, on every rank's gradient shards."""
        self.finish_grad_sync()
        assert self.verdict is not None
        coefficient = clip_coefficient(self.verdict.norm, max_norm)
        for rank in self.ranks:
            torch._foreach_mul_([bucket.grad_shard for bucket in rank.buckets], coefficient)
        return self.verdict.norm

    def prepare_step(self) -> None:
        """As `ShardedEngine.prepare_step` on every rank (no weight edits: see `SimulatedEngine`)."""
        self.finish_grad_sync()
        if self._decided:
            return
        self._decided = True
        assert self.verdict is not None
        for rank in self.ranks:
            self._skip_on_host = apply_verdict(
                self.verdict, self.config.nonfinite, rank.optimizers, rank.fragments, rank.skipped, self.step
            )

    def _open_window(self) -> None:
        for rank in self.ranks:
            for bucket in rank.buckets:
                bucket.start_window()
        self.verdict, self._reduced = None, False
        self.discard_grads()

    def discard_grads(self) -> None:
        """What the optimizers' zero_grad calls: the fragments let go of the reduced gradients.

        The windows stay: Lightning calls zero_grad after rank 0's first forward of a window,
        when the other ranks' backward passes have put their gradients in already. A window ends
        when its exchange has run (`receive_grads` opens the next one)."""
        for rank in self.ranks:
            for record in rank.fragments:
                record.master.grad = None

    # ----------------------------------------------------------------------------------------
    # Weights

    def start_weight_sync(self) -> dict[str, float]:
        """After every rank's optimizer step: the weight all-gathers (none on a skipped step), complete
        when this returns. Returns rank 0's communication figures of the step."""
        skipped = self._decided and self._skip_on_host
        if not skipped:
            with torch.no_grad():
                for index in range(len(self.buckets)):
                    pending = [
                        rank.weight_collectives[index].start(rank.buckets[index], self.step) for rank in self.ranks
                    ]
                    for exchange in pending:
                        exchange.progress()
                    pending[0].wait()  # rank 0 applies to the one copy; the others' copies would be the same
        self.step += 1
        for rank in self.ranks[1:]:
            rank.meter.end_step()
        stats = self.meter.end_step()
        stats["nonfinite_steps"] = self.ranks[0].skipped.lagging()
        return stats

    def optimizer_step(self, max_norm: float | None = None) -> dict[str, float]:
        """One whole optimizer step of every rank, for a loop without Lightning, after every rank's
        `receive_grads`: exchanges and verdict, clipping by the global norm (`max_norm`), every
        rank's optimizers, the weight exchange, zero_grad. Returns rank 0's communication figures."""
        self.finish_grad_sync()
        if max_norm is not None:
            self.clip_grad_norm(max_norm)
        self.prepare_step()
        for optimizer in self.optimizers:
            optimizer.step()
        self.step_other_ranks()
        stats = self.start_weight_sync()
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        return stats

    def wait_weights(self, indices=None) -> None:
        """Nothing is ever in flight: `start_weight_sync` completes the exchanges."""


def _masters(rank: SimulatedRank, names: list[str]) -> list[Tensor]:
    return [record.master for name in names for record in rank.fragments_by_name.get(name, [])]
