"""Where each rank sits: nodes, local indices, and the process groups of the two-level all-to-all.

Ranks are numbered rank = node * L + local, with L ranks per node and M = world / L nodes, as
torchrun and SLURM number them. The intra-node group of a rank holds its node's L ranks; its
inter-node group holds the M ranks that share its local index. `ranks_per_node` may be smaller
than the real node to emulate several nodes on one host ("virtual nodes").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["ProcessGroups", "Topology", "create_process_groups"]


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must divide the world size {self.world_size}")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_index(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def has_intra_stage(self) -> bool:
        """Whether the node has peers to exchange with (more than one rank per node)."""
        return self.ranks_per_node > 1

    @property
    def has_inter_stage(self) -> bool:
        """Whether there is more than one node."""
        return self.nodes > 1

    @property
    def two_level(self) -> bool:
        """Whether the exchanges go in two levels (inside the node, across nodes): several nodes
        of several ranks each."""
        return self.has_intra_stage and self.has_inter_stage

    def node_ranks(self, node: int) -> list[int]:
        return [node * self.ranks_per_node + local for local in range(self.ranks_per_node)]

    def local_index_ranks(self, local: int) -> list[int]:
        return [node * self.ranks_per_node + local for node in range(self.nodes)]


@dataclass(frozen=True)
class ProcessGroups:
    world: Any  # every rank, on a communicator of the engine's own (not the default group)
    intra: Any  # this rank's node; None with one rank per node
    inter: Any  # this rank's peers at the same local index; None with one node
    host: Any = None  # every rank, for CPU tensors (gloo): host-side agreement with no GPU sync
    timeout: timedelta | None = None  # what bounds each collective on them (None: torch's default)


def create_process_groups(topology: Topology, timeout: timedelta | None = None) -> ProcessGroups:
    """Create the engine's groups. Collective: every rank must call it, in the same order.

    `timeout` bounds every collective on them (the strategy's `timeout=`): a group made without
    one keeps torch's default of 30 minutes, whatever the default group was given, so a rank
    waiting on a stalled peer in the engine's exchanges would wait that long. None: torch's default.

    The world group is a new communicator over every rank, not the default group: collectives
    on one communicator run in issue order, so Lightning's own (the per-batch SIGTERM broadcast,
    `sync_dist` logging, barriers) would otherwise queue behind the weight all-gathers still in
    flight, and the next batch could not start before they ended. A stage whose group would
    hold every rank uses that world group; an absent stage gets None. The host group carries
    CPU tensors (the world group itself on gloo, a gloo group of its own beside NCCL).
    """
    world = dist.new_group(ranks=list(range(topology.world_size)), timeout=timeout)

    def subgroup(present: bool, spans_world: bool, members: list[list[int]]) -> Any:
        if not present:
            return None
        return world if spans_world else dist.new_subgroups_by_enumeration(members, timeout=timeout)[0]

    nodes = [topology.node_ranks(node) for node in range(topology.nodes)]
    local_indices = [topology.local_index_ranks(local) for local in range(topology.ranks_per_node)]
    intra = subgroup(topology.has_intra_stage, not topology.has_inter_stage, nodes)
    inter = subgroup(topology.has_inter_stage, not topology.has_intra_stage, local_indices)
    ranks = list(range(topology.world_size))
    host = world if dist.get_backend() == "gloo" else dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    return ProcessGroups(world=world, intra=intra, inter=inter, host=host, timeout=timeout)
