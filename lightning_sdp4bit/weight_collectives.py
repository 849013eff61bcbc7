"""The weight all-gather: from this rank's master shard [S] to the model weights [N] every rank holds.

`start(bucket, step)` returns a `collectives.Pending`. Uncompressed (the master shards rounded to
the weights' dtype) or quantized (qWD: the 4-bit weight difference from the last exchange; qW:
the weights themselves), and in either case flat over the world or in two levels when there are
several nodes of several ranks (`_RowGather`).

Each exchange also leaves the bucket's applied shard (`Bucket.applied_shard`, [S]): what lands in
this rank's own shard of the weights, against which `WeightAccess.absorb` finds later edits. The
quantized gathers have the dequantization store it beside the weights; the uncompressed one
gathers from it. Either way no copy from the weights follows the landing (one read and one write
of 2 x S bytes a bucket and step, on the compute stream, in the forward's path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lightning_sdp4bit import comm, ops
from lightning_sdp4bit.buffers import Bucket, as_words
from lightning_sdp4bit.collectives import Pending, Seeds, SingleStage, Stage, TwoStage, WeightAllGather, compresses
from lightning_sdp4bit.config import SDP4BitConfig, WeightQuant
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = ["PlainWeightAllGather", "QuantizedWeightAllGather", "weight_collective_for"]


class _RowGather:
    """All-gather one row [R] per rank into rows [W, R]: flat over the world, or in two levels
    when there are several nodes of several ranks (`_TwoLevelGather`). The rows are in rank order,
    or, in two levels for a caller that reads them only through `finish` and takes them so, in
    the local-major order they land in.

    Why two levels: a flat all-gather brings each rank the W - 1 other rows, all charged to the
    network when the group spans nodes. Gathering first across nodes (the M ranks at this local
    index: M - 1 rows over the NIC) and then inside the node (the L ranks' [M, R] blocks over
    NVLink) brings the same rows with 1/L of them crossing the NIC: for 2 nodes x 4 a 4-bit
    weight all-gather moved 7/8 of a bucket's payload over each rank's NIC and now moves 1/8.
    The rows, and so every bit of the weights, are the same.
    """

    def __init__(
        self,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter,
        stream: torch.cuda.Stream | None,
        across_nodes_only: bool = False,
    ):
        self.topology, self.groups, self.meter, self.stream = topology, groups, meter, stream
        self.across_nodes_only = across_nodes_only

    def start(
        self,
        rows: torch.Tensor,
        row: torch.Tensor,
        elements: int,
        uncompressed: int,
        finish: Callable[[int], None] | None = None,
        local_major: bool = False,
    ) -> Pending:
        """`row` [R] (apart from `rows`, and not written until they are complete; the exchange
        keeps it alive) stands for `elements` values that would travel as `uncompressed` bytes;
        `finish(nodes)` runs once `rows` [W, R] is complete (on the side stream where the gather
        has one, `_TwoLevelGather`). With `local_major`, a two-level gather leaves the rows as
        they land, [L, M, R] (rank m * L + l's row at l * M + m), and `nodes` is M; otherwise they
        are in rank order and `nodes` is 1: the layout as `ops.weight_update_apply` takes it."""
        if self.across_nodes_only:
            if self.topology.has_inter_stage:  # with one node nothing travels
                self.meter.record("weight", row.nbytes, elements, uncompressed)
            return self._across_nodes(rows, row, finish)
        self.meter.record("weight", row.nbytes, elements, uncompressed)
        if self.topology.two_level:
            # Counted now, with the step that sends it, although on the CPU it goes out later.
            nodes = self.topology.nodes
            self.meter.record("weight_intra", nodes * row.nbytes, nodes * elements, nodes * uncompressed)
            return _TwoLevelGather(self, rows, row, finish, local_major)
        work = comm.all_gather(rows.view(-1), row, group=self.groups.world, async_op=True)
        in_rank_order = None if finish is None else functools.partial(finish, 1)
        return SingleStage(work, in_rank_order, keepalive=row)

    def _across_nodes(self, rows: torch.Tensor, row: torch.Tensor, finish: Callable[[int], None] | None) -> Pending:
        """weight_sharding="node": only the rows of this rank's local index, [M, R] in node order,
        the node slice's (`node_shards`); with one node, its own row alone."""
        in_node_order = None if finish is None else functools.partial(finish, 1)
        if not self.topology.has_inter_stage:
            rows.view(-1).copy_(row)
            if in_node_order is not None:
                in_node_order()
            return SingleStage(None)
        work = comm.all_gather(rows.view(-1), row, group=self.groups.inter, async_op=True)
        return SingleStage(work, in_node_order, keepalive=row)


class _TwoLevelGather(TwoStage):
    """Stage 1 at start: the inter-node all-gather of `row` -> [M, R] (this local index's rows, by
    node). Stage 2: the intra-node all-gather of those blocks -> [L, M, R] (local-major), then
    `finish`. With `local_major` the blocks land in `rows` itself and `finish` reads them there
    (nodes = M); otherwise they land in a buffer of their own and a transposed copy puts them into
    `rows` viewed [M, L, R] (rank = node * L + local) first: the uncompressed gather's rows are
    the model weights, which must be in rank order. Reading them in place spares the quantized
    gather that copy, a read and a write of every gathered byte (at 1.3B, 0.65 GB of 4-bit rows:
    1.3 GB of memory traffic a step, and a launch per bucket). On a stream, the copy and `finish`
    (the dequantization into the weights) are queued there too, and the caller's stream waits for
    them in `wait`: they run beside the forward's kernels rather than between them (at 1.3B on
    2 x 4 H200s, -0.8 ms a compute-only step)."""

    def __init__(
        self,
        owner: _RowGather,
        rows: torch.Tensor,
        row: torch.Tensor,
        finish: Callable[[int], None] | None,
        local_major: bool,
    ):
        topo = owner.topology
        self._owner, self._rows, self._finish, self._local_major = owner, rows, finish, local_major
        self._sent: torch.Tensor | None = row  # the tensors stay alive until the rows are complete
        self._across: torch.Tensor | None = row.new_empty((topo.nodes, row.numel()))
        self._node: torch.Tensor | None = None
        self._landed: torch.cuda.Event | None = None
        self._work = comm.all_gather(self._across.view(-1), row, group=owner.groups.inter, async_op=True)
        self._begin(owner.stream)

    def _second_stage(self) -> None:
        topo, across = self._owner.topology, self._across
        assert across is not None  # released only in _complete
        # Stage 2's output [L, M, R]: `rows` itself where the caller reads it local-major, else a
        # buffer that `_land` copies into rank order.
        if self._local_major:
            node = self._rows
        else:
            node = across.new_empty((topo.ranks_per_node, topo.nodes, across.shape[1]))
        self._node = node
        group = self._owner.groups.intra
        self._work = comm.all_gather(node.view(-1), across.view(-1), group=group, async_op=True)
        if self._stream is not None:
            self._land()
            self._landed = torch.cuda.Event()
            self._landed.record(self._stream)  # the current stream here (`_begin`)

    def _land(self) -> None:
        """Wait for stage 2 (on the current stream), copy the blocks into rank order unless the
        caller takes them local-major, then run `finish`."""
        self._work.wait()
        topo = self._owner.topology
        if not self._local_major:
            assert self._node is not None  # set by _second_stage
            # As words (as_words says why): as bytes, at 1.3B and W = 64, this copy took 1.49 ms a
            # step, 40 us a bucket, in the chain each forward wait depends on.
            rows, node = as_words(self._rows, self._node)
            rows.view(topo.nodes, topo.ranks_per_node, -1).copy_(node.transpose(0, 1))
        if self._finish is not None:
            self._finish(topo.nodes if self._local_major else 1)
            self._finish = None

    def _complete(self) -> None:
        if self._landed is not None:
            assert self._stream is not None  # _landed is recorded on it
            # All of stage 2 ran on the side stream, after both collectives: once the caller's
            # stream waits for it, the tensors may go back to the allocator in its order.
            torch.cuda.current_stream(self._stream.device_index).wait_event(self._landed)
        else:
            self._land()
        self._sent = self._across = self._node = None


class PlainWeightAllGather:
    """All-gather the master shards, rounded to the weights' dtype, straight into the weights (in
    two levels through one copy into rank order, the weights' own order). The rounded master shard
    is written into the applied shard, and gathered from there: it is what lands in this rank's
    own shard of the weights, byte for byte."""

    def __init__(
        self,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter,
        stream: torch.cuda.Stream | None = None,
        across_nodes_only: bool = False,
    ):
        self._gather = _RowGather(topology, groups, meter, stream, across_nodes_only)

    def start(self, bucket: Bucket, step: int) -> Pending:
        # The applied shard, not a view of the weights (the input must not alias the output),
        # written here on the caller's stream, before the gather reads it. Nothing writes it again
        # before the rows are complete: only the next exchange and a load (`weights_loaded`) do,
        # each after waiting for the weights; `absorb` reads it only after that wait too, so it
        # never compares the new applied shard with the old weights.
        source = bucket.applied_shard.copy_(bucket.master)  # rounded to the weights' dtype as `.to` rounds
        rows = bucket.held_weights.view(-1, bucket.layout.shard_numel)
        return self._gather.start(rows, source, source.numel(), source.nbytes)


class QuantizedWeightAllGather:
    """qWD (additive=True) or qW (additive=False): all-gather quantized codes and scales, then
    every rank, the sender included, dequantizes them into its weights in place, reading the
    gathered rows in the order they land (local-major in two levels), and stores its own shard's
    new values into the applied shard as well."""

    def __init__(
        self,
        config: SDP4BitConfig,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter,
        additive: bool,
        stream: torch.cuda.Stream | None = None,
        across_nodes_only: bool = False,
    ):
        self.config, self._additive = config, additive
        self._gather = _RowGather(topology, groups, meter, stream, across_nodes_only)
        self._seeds = Seeds(config, topology.rank)

    def start(self, bucket: Bucket, step: int) -> Pending:
        config = self.config
        reference = bucket.weight_shard if self._additive else None
        seed = self._seeds(step, bucket, Stage.WEIGHT_ENCODE)
        payload = ops.weight_update_encode(
            bucket.master, reference, config.weight_bits, config.weight_group_size, config.rounding, seed
        )
        shard = bucket.layout.shard_numel
        held = bucket.held_weights  # [W * S], or the node slice [M * S]
        gathered = payload.new_empty((held.numel() // shard, payload.shape[1]))

        def apply(nodes: int) -> None:
            # Where the gather has a side stream, on it: the compute stream waits for its landed
            # event before anything reads the weights or the applied shard (`_TwoLevelGather`).
            # Flat, on the caller's stream inside `wait`.
            ops.weight_update_apply(
                gathered,
                held,
                config.weight_bits,
                config.weight_group_size,
                self._additive,
                nodes,
                applied=bucket.applied_shard,
                rank=bucket.own_row,
            )

        uncompressed = shard * held.element_size()
        return self._gather.start(gathered, payload.view(-1), shard, uncompressed, apply, local_major=True)


def weight_collective_for(
    bucket: Bucket,
    config: SDP4BitConfig,
    topology: Topology,
    groups: ProcessGroups,
    meter: WireMeter,
    stream: torch.cuda.Stream | None = None,
) -> WeightAllGather:
    """The weight exchange `config` asks for this bucket (`stream`: see `_TwoLevelGather`)."""
    across_nodes_only = config.shards_weights
    if config.compresses_weights and compresses(bucket, config, topology):
        additive = config.weight_quant is WeightQuant.DIFF
        return QuantizedWeightAllGather(config, topology, groups, meter, additive, stream, across_nodes_only)
    return PlainWeightAllGather(topology, groups, meter, stream, across_nodes_only)
