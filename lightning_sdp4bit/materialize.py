"""Where each rank's initial weights come from: rank 0's, broadcast as DDP does, or, for a module
built on the meta device (a model too large for one device), each rank's own node slices: under
weight_sharding="node" each rank allocates only the weights it holds.

Module by module, in registration order, each rank materializes the module's own parameters and
buffers on the device (`to_empty`), initializes them with the module's `reset_parameters()`,
copies the pieces of its trained parameters that fall in this rank's node-slice rows
(`node_shards`: rows m * L + local of each bucket, [M, S]) and lets the rest go: the parameter
becomes a NaN placeholder of its shape, as after a release. At most one module's parameters are
whole at a time (at 70B, a [28672, 8192] MLP matrix: 470 MB in bf16).

Every rank runs the same initialization with the same RNG state, so the replicas agree only if
the job seeded every rank alike (`seed_everything`): a sum of every parameter, compared across
the ranks, catches a job that did not, before any step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_sdp4bit import comm
from lightning_sdp4bit.buffers import Bucket, BucketLayout, node_slice_pieces
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = ["broadcast_untrained", "broadcast_weights", "engine_device", "is_on_meta", "materialize_node_slices"]


def is_on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def engine_device(
    first: nn.Parameter, device: torch.device | None, on_meta: bool, config: SDP4BitConfig
) -> torch.device:
    """Where the engine's tensors go: the parameters' device, or `device` for a meta-device module."""
    if not on_meta:
        return first.device
    if not config.shards_weights:
        raise ValueError(
            "the module is on the meta device: only weight_sharding='node' builds it in place (each rank "
            "materializes what it holds); with weight_sharding='replicated' every rank holds the whole model, "
            "so build it on the device (or call module.to_empty(device=...) and initialize it first)"
        )
    if device is None or device.type == "meta":
        raise ValueError("a meta-device module needs the engine's `device` (where its node slices go)")
    return device


def materialize_node_slices(
    module: nn.Module,
    layouts: Sequence[BucketLayout],
    names: dict[int, str],
    topology: Topology,
    groups: ProcessGroups,
    timeouts: comm.Timeouts,
    device: torch.device,
) -> list[Bucket]:
    """Buckets whose node slices hold this rank's rows of the initialized weights. `names`: the
    trained parameters' names by id, as the module holds them on the meta device. Their
    Parameter objects are replaced (a meta tensor cannot take a device's storage in place), tied
    ones by one new Parameter; each is left as a NaN placeholder. Build the optimizer after."""
    nodes, local_ranks = topology.nodes, topology.ranks_per_node
    slices = [torch.zeros(nodes, layout.shard_numel, dtype=layout.dtype, device=device) for layout in layouts]
    slot_of = {slot.name: (layout, slot) for layout in layouts for slot in layout.slots}
    pieces = [node_slice_pieces(layout, topology.rank, rows) for layout, rows in zip(layouts, slices, strict=True)]
    made: dict[int, nn.Parameter] = {}  # id(meta parameter) -> the parameter that replaces it
    sums: dict[str, Tensor] = {}
    for name, owner in module.named_modules():
        metas = [(key, p) for key, p in owner._parameters.items() if p is not None and p.is_meta]
        buffers = [(key, b) for key, b in owner._buffers.items() if b is not None and b.is_meta]
        if not metas and not buffers:
            continue
        reset = getattr(owner, "reset_parameters", None)
        if reset is None:
            raise ValueError(
                f"module {name or '(root)'!r} ({type(owner).__name__}) has parameters or buffers on the meta device "
                "and no reset_parameters(): under weight_sharding='node' each rank initializes a meta-device module "
                "module by module through reset_parameters(); give it one, or build the module on a real device"
            )
        for key, old in metas:
            if id(old) not in made:
                made[id(old)] = nn.Parameter(torch.empty_like(old, device=device), requires_grad=old.requires_grad)
            elif made[id(old)].stride() != old.stride():  # a tied parameter, let go by the module before
                made[id(old)].data = torch.empty_like(old, device=device)
            owner._parameters[key] = made[id(old)]
        for key, old in buffers:
            owner._buffers[key] = torch.empty_like(old, device=device)
        with torch.no_grad():
            reset()
            for _, old in metas:
                if id(old) in names:
                    layout, slot = slot_of[names[id(old)]]
                    flat = made[id(old)].detach().reshape(-1)
                    for position, start, piece in pieces[layout.index]:
                        if layout.slots[position] is slot:  # this rank's rows of it
                            piece.copy_(flat[start : start + piece.numel()])
                    sums[slot.name] = made[id(old)].detach().double().sum()
                    made[id(old)].data = _nan(layout.dtype, device).expand(slot.shape)
    _check_alike(sums, groups, timeouts)
    by_name = {names[key]: param for key, param in made.items() if key in names}
    buckets = []
    for layout, node_slice in zip(layouts, slices, strict=True):
        bucket = Bucket(
            layout,
            topology.rank,
            _nan(layout.dtype, device).expand(layout.numel),
            [by_name[s.name] for s in layout.slots],
        )
        bucket.hold_node_slice(nodes, local_ranks, rows=node_slice)
        buckets.append(bucket)
    return buckets


def _nan(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((1,), float("nan"), dtype=dtype, device=device)


def _check_alike(sums: dict[str, Tensor], groups: ProcessGroups, timeouts: comm.Timeouts) -> None:
    """Raise on every rank if the ranks initialized any parameter differently."""
    if not sums:
        return
    local = torch.stack(list(sums.values()))
    every = local.new_empty((groups.world.size(), local.numel()))
    with timeouts.named("the all-gather that checks every rank initialized the same weights"):
        comm.all_gather(every.view(-1), local, group=groups.world)
    lowest, highest = every.min(dim=0).values, every.max(dim=0).values
    differ = [name for name, hi, lo in zip(sums, highest.tolist(), lowest.tolist(), strict=True) if hi != lo]
    if differ:
        raise RuntimeError(
            f"sdp4bit: the ranks initialized parameters {differ[:8]} of the meta-device module differently "
            "(each rank initializes its own copy): seed every rank alike before building the engine "
            "(lightning.seed_everything(seed) on every rank, before fit)"
        )


def broadcast_weights(buckets: list[Bucket], groups: ProcessGroups, timeouts: comm.Timeouts) -> None:
    """Start every rank from rank 0's trained weights, as DDP does."""
    with timeouts.named("the broadcast of rank 0's weights"):
        for bucket in buckets:
            comm.broadcast(bucket.weights, src=0, group=groups.world)


def broadcast_untrained(module: nn.Module, groups: ProcessGroups, timeouts: comm.Timeouts) -> None:
    """Rank 0's frozen parameters and buffers to every rank, as DDP does."""
    with timeouts.named("the broadcast of rank 0's frozen parameters and buffers"):
        for p in module.parameters():
            if not p.requires_grad:
                comm.broadcast(p.data, src=0, group=groups.world)
        for buffer in module.buffers():
            comm.broadcast(buffer, src=0, group=groups.world)
