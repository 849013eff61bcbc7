"""The weight all-gather: from this rank's master shard [S] to the model weights [N] every rank holds.

`start(bucket, step)` returns a `collectives.Pending`. Uncompressed (the master shards rounded to
the weights' dtype) or quantized (qWD: the 4-bit weight difference from the last exchange; qW:
the weights themselves), and in either case flat over the world or in two levels when there are
several nodes of several ranks (`_RowGather`).
"""

from __future__ import annotations

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
    """All-gather one row [R] per rank into rows [W, R], in rank order: flat over the world, or
    in two levels when there are several nodes of several ranks (`_TwoLevelGather`).

    Why two levels: a flat all-gather brings each rank the W - 1 other rows, all charged to the
    network when the group spans nodes. Gathering first across nodes (the M ranks at this local
    index: M - 1 rows over the NIC) and then inside the node (the L ranks' [M, R] blocks over
    NVLink) brings the same rows with 1/L of them crossing the NIC: for 2 nodes x 4 a 4-bit
    weight all-gather moved 7/8 of a bucket's payload over each rank's NIC and now moves 1/8.
    The rows, and so every bit of the weights, are the same.
    """

    def __init__(self, topology: Topology, groups: ProcessGroups, meter: WireMeter, stream: torch.cuda.Stream | None):
        self.topology, self.groups, self.meter, self.stream = topology, groups, meter, stream

    def start(
        self,
        rows: torch.Tensor,
        row: torch.Tensor,
        elements: int,
        uncompressed: int,
        finish: Callable[[], None] | None = None,
    ) -> Pending:
        """`row` [R] (a fresh tensor: the exchange keeps it alive) stands for `elements` values
        that would travel as `uncompressed` bytes; `finish` runs once `rows` [W, R] is complete
        (on the side stream where the gather has one, `_TwoLevelGather`)."""
        self.meter.record("weight", row.nbytes, elements, uncompressed)
        if self.topology.two_level:
            # Counted now, with the step that sends it, although on the CPU it goes out later.
            nodes = self.topology.nodes
            self.meter.record("weight_intra", nodes * row.nbytes, nodes * elements, nodes * uncompressed)
            return _TwoLevelGather(self, rows, row, finish)
        work = comm.all_gather(rows.view(-1), row, group=self.groups.world, async_op=True)
        return SingleStage(work, finish, keepalive=row)


class _TwoLevelGather(TwoStage):
    """Stage 1 at start: the inter-node all-gather of `row` -> [M, R] (this local index's rows, by
    node). Stage 2: the intra-node all-gather of those blocks -> [L, M, R] (local-major), then a
    transposed copy into `rows` viewed [M, L, R] (rank = node * L + local), then `finish`. On a
    stream, the copy and `finish` (the dequantization into the weights) are queued there too, and
    the caller's stream waits for them in `wait`: they run beside the forward's kernels rather
    than between them (at 1.3B on 2 x 4 H200s, -0.8 ms a compute-only step)."""

    def __init__(self, owner: _RowGather, rows: torch.Tensor, row: torch.Tensor, finish: Callable[[], None] | None):
        topo = owner.topology
        self._owner, self._rows, self._finish = owner, rows, finish
        self._sent: torch.Tensor | None = row  # the tensors stay alive until the rows are complete
        self._across: torch.Tensor | None = row.new_empty((topo.nodes, row.numel()))
        self._node: torch.Tensor | None = None
        self._landed: torch.cuda.Event | None = None
        self._work = comm.all_gather(self._across.view(-1), row, group=owner.groups.inter, async_op=True)
        self._begin(owner.stream)

    def _second_stage(self) -> None:
        topo, across = self._owner.topology, self._across
        self._node = across.new_empty((topo.ranks_per_node, topo.nodes, across.shape[1]))
        group = self._owner.groups.intra
        self._work = comm.all_gather(self._node.view(-1), across.view(-1), group=group, async_op=True)
        if self._stream is not None:
            self._place()
            if self._finish is not None:
                self._finish()
                self._finish = None
            self._landed = torch.cuda.Event()
            self._landed.record(self._stream)  # the current stream here (`_begin`)

    def _place(self) -> None:
        """Wait for stage 2 (on the current stream), then copy the blocks into rank order."""
        self._work.wait()
        topo = self._owner.topology
        # As words (as_words says why): as bytes, at 1.3B and W = 64, this copy took 1.49 ms a step,
        # 40 us a bucket, in the chain each forward wait depends on.
        rows, node = as_words(self._rows, self._node)
        rows.view(topo.nodes, topo.ranks_per_node, -1).copy_(node.transpose(0, 1))

    def _complete(self) -> None:
        if self._landed is not None:
            # All of stage 2 ran on the side stream, after both collectives: once the caller's
            # stream waits for it, the tensors may go back to the allocator in its order.
            torch.cuda.current_stream(self._stream.device_index).wait_event(self._landed)
        else:
            self._place()
        self._sent = self._across = self._node = None
        if self._finish is not None:
            self._finish()


class PlainWeightAllGather:
    """All-gather the master shards, rounded to the weights' dtype, straight into the weights."""

    def __init__(
        self, topology: Topology, groups: ProcessGroups, meter: WireMeter, stream: torch.cuda.Stream | None = None
    ):
        self._gather = _RowGather(topology, groups, meter, stream)

    def start(self, bucket: Bucket, step: int) -> Pending:
        # A fresh tensor even when the dtypes match: the input must not alias the output.
        source = bucket.master.to(bucket.weights.dtype, copy=True)
        rows = bucket.weights.view(bucket.layout.world_size, -1)
        return self._gather.start(rows, source, source.numel(), source.nbytes)


class QuantizedWeightAllGather:
    """qWD (additive=True) or qW (additive=False): all-gather quantized codes and scales, then
    every rank, the sender included, dequantizes them into its weights in place."""

    def __init__(
        self,
        config: SDP4BitConfig,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter,
        additive: bool,
        stream: torch.cuda.Stream | None = None,
    ):
        self.config, self._additive = config, additive
        self._gather = _RowGather(topology, groups, meter, stream)
        self._seeds = Seeds(config, topology.rank)

    def start(self, bucket: Bucket, step: int) -> Pending:
        config = self.config
        reference = bucket.weight_shard if self._additive else None
        seed = self._seeds(step, bucket, Stage.WEIGHT_ENCODE)
        payload = ops.weight_update_encode(
            bucket.master, reference, config.weight_bits, config.weight_group_size, config.rounding, seed
        )
        gathered = payload.new_empty((bucket.layout.world_size, payload.shape[1]))
        shard = bucket.layout.shard_numel

        def apply() -> None:
            ops.weight_update_apply(
                gathered, bucket.weights, config.weight_bits, config.weight_group_size, self._additive
            )

        return self._gather.start(gathered, payload.view(-1), shard, shard * bucket.weights.element_size(), apply)


def weight_collective_for(
    bucket: Bucket,
    config: SDP4BitConfig,
    topology: Topology,
    groups: ProcessGroups,
    meter: WireMeter,
    stream: torch.cuda.Stream | None = None,
) -> WeightAllGather:
    """The weight exchange `config` asks for this bucket (`stream`: see `_TwoLevelGather`)."""
    if config.compresses_weights and compresses(bucket, config, topology):
        additive = config.weight_quant is WeightQuant.DIFF
        return QuantizedWeightAllGather(config, topology, groups, meter, additive, stream)
    return PlainWeightAllGather(topology, groups, meter, stream)
