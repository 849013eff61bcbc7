"""A job of W = M x L ranks on one device, with the math of W processes.

`SimulatedEngine` is a `ShardedEngine` that holds every rank of the job (`rank.ShardedRank`
each: its own window gradients, master, gradient and applied shards, optimizer, verdict and
stochastic-rounding seeds) over `simulation.groups`, and runs each phase of the step protocol
on all of them, the same code as a real job's engine: only the construction differs. The
exchanges are the real ones (the same ops, layout and seeds), and the simulated groups take
their sums in rank order as gloo's are (`comm.sum_rows_into`), so a simulated job and a real
gloo job of the same shape end with the same weights, masters and optimizer states, bit for
bit (tests/multiprocess/test_simulation.py).

One copy of the weights serves every rank: replicas are bit-identical under every preset (qWD
applies the same all-gathered differences everywhere), so rank 0's weight exchange writes it;
the other ranks send their rows and take their applied shard from it (`_FollowerGather`).

Per rank, the driver runs its forward and backward inside `running_as(rank)`, which also gives
the rank its own RNG state and module buffers (`simulation.ranks.RankStates`), then calls
`receive_grads()`; `post_backward()` once every rank's backward is in. Ranks 1..W-1 run first
and rank 0 last, so that the module holds rank 0's buffers between steps, as the process's RNG
is rank 0's.

Memory, beside the model and its activations: every rank's window gradients at once before the
exchanges ([N] per bucket and rank, the weights' dtype for one backward, fp32 under gradient
accumulation), that is up to W times the weights' bytes; the masters, gradient shards and
optimizer states of all ranks together cost what one rank of a one-rank job would.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_sdp4bit.buffer_sync import BufferRule
from lightning_sdp4bit.buffers import Bucket, allocate_buckets, bucket_layouts
from lightning_sdp4bit.collectives import Pending
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine, trained_parameters
from lightning_sdp4bit.rank import ShardedRank
from lightning_sdp4bit.simulation.groups import SimulatedGroup
from lightning_sdp4bit.simulation.ranks import RankStates
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = ["SimulatedEngine", "check_shape", "parse_world"]


def parse_world(spec: object) -> tuple[int, int]:
    """ "16x4" (M nodes x L ranks per node) or (M, L) -> (M, L), checked: M and L whole numbers
    of at least 1, at least 2 ranks in all."""
    expected = "expected 'MxL' or (M, L): M nodes of L ranks each, whole numbers, e.g. '16x4' or (16, 4)"
    if isinstance(spec, str):
        parts = spec.lower().replace(" ", "").split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"simulate={spec!r}: {expected}")
        spec = (int(parts[0]), int(parts[1]))
    if (
        not isinstance(spec, (tuple, list))
        or len(spec) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in spec)
    ):
        raise ValueError(f"simulate={spec!r}: {expected}")
    nodes, local = spec
    if nodes < 1 or local < 1 or nodes * local < 2:
        raise ValueError(f"simulate={nodes}x{local}: needs at least 1 node, 1 rank per node and 2 ranks in all")
    return nodes, local


def check_shape(config: SDP4BitConfig, nodes: int, ranks_per_node: int) -> None:
    """A simulated job takes its shape from its world ("MxL"): a `config.ranks_per_node` set to
    another L contradicts it (ignoring it would run another job than the config describes). It
    holds the weights replicated."""
    if config.shards_weights:
        raise ValueError(
            "weight_sharding='node' cannot be simulated: a simulated job keeps one copy of the weights for all "
            "its ranks, which the node mode's gathers and releases would swap under each other. Simulate with "
            "weight_sharding='replicated': the numerics are the same bit for bit"
        )
    if config.ranks_per_node is not None and config.ranks_per_node != ranks_per_node:
        raise ValueError(
            f"ranks_per_node={config.ranks_per_node} contradicts simulate={nodes}x{ranks_per_node}, whose nodes "
            f"have {ranks_per_node} ranks: leave ranks_per_node unset (None) or set it to {ranks_per_node}"
        )


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


class _FollowerGather:
    """A rank >= 1's weight exchange in a simulated job: it sends its rows (its peers' exchanges
    need them) and leaves the one copy of the weights to rank 0's, which the engine completes
    first; completing its own then takes its applied shard from that copy."""

    def __init__(self, gather):
        self._gather = gather

    def start(self, bucket: Bucket, step: int) -> Pending:
        return _Following(self._gather.start(bucket, step), bucket)


class _Following:
    def __init__(self, pending: Pending, bucket: Bucket):
        self._pending, self._bucket = pending, bucket

    def progress(self) -> bool:
        return self._pending.progress()

    def wait(self) -> None:
        # Its second stage went out (the engine polled every rank before waiting); the rows'
        # sum into the weights is rank 0's, whose exchange has completed by now.
        self._pending.progress()
        self._bucket.applied_shard.copy_(self._bucket.weight_shard)


class SimulatedEngine(ShardedEngine):
    """Every rank of an M x L job, on one device (see the module docstring). Rank 0's view
    (`buckets`, `fragments_by_name`, `optimizers`, `meter`) is what the engine's users read;
    `ranks` holds them all."""

    def __init__(self, module: nn.Module, config: SDP4BitConfig, nodes: int, ranks_per_node: int):
        check_shape(config, nodes, ranks_per_node)
        world = nodes * ranks_per_node
        named = trained_parameters(module)
        layouts = bucket_layouts(named, config, world)
        with torch.no_grad():
            shared = allocate_buckets(layouts, dict(named), rank=0)  # the one copy of the weights
        ranks = []
        for rank, groups in enumerate(_simulated_groups(nodes, ranks_per_node)):
            buckets = shared if rank == 0 else [Bucket(b.layout, rank, b.weights, b.params) for b in shared]
            topology = Topology(rank, world, ranks_per_node)
            # No exchange stream and no prefetch: on a GPU the simulated collectives are copies on
            # the current stream, and every rank launches each stage before any waits.
            ranks.append(ShardedRank(buckets, config, topology, groups, WireMeter()))
            if rank > 0:
                ranks[-1].weight_collectives = [_FollowerGather(g) for g in ranks[-1].weight_collectives]
        states = RankStates(module, world, shared[0].weights.device)
        self._attach(module, config, ranks, SimulatedBuffers(module, states, config.broadcast_buffers), False)
        self._rank_states = states
        self.weights_loaded()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def optimizer_step(self, max_norm: float | None = None) -> dict[str, float]:
        """The rest of one optimizer step of every rank through the step protocol, for a loop
        without Lightning, once every rank's backward is in (`receive_grads`): the exchanges and
        the verdict, the global clip (`max_norm`), rank 0's optimizers (the caller's) and then the
        others', the weight exchange, and every rank's zero_grad. Returns rank 0's wire figures."""
        self.post_backward()
        if max_norm is not None:
            self.clip_grad_norm(max_norm)
        self.pre_optimizer_step()
        for optimizer in self.optimizers:
            optimizer.step()
        stats = self.post_optimizer_step()
        for index in range(len(self.ranks)):
            with self.running_as(index):
                self.zero_grad()
        return stats

    def share_rng_state(self) -> None:
        """Every rank's RNG state becomes this process's now: each process of a real job runs the
        same seeding and the same set-up, and so holds the same state when its training starts.
        (Taken at construction; a driver whose set-up draws after it calls this again.)"""
        self._rank_states.share_rng_state()


class SimulatedBuffers(BufferRule):
    """DDP's buffer broadcast in a simulated job: when due, every rank's buffers become rank 0's
    (the module's, which hold rank 0's between steps)."""

    def __init__(self, module: nn.Module, states: RankStates, enabled: bool):
        super().__init__(module, enabled)
        self._states = states

    def before_forward(self) -> None:
        if self.due():
            self._states.share_buffers()
