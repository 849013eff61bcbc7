"""The two collectives of sharded data parallelism, each behind one small interface.

- `GradReduceScatter.start(bucket, grads, scale, step)`: from the window gradients [N] (fp32 or
  the weights' dtype, summed over ranks after multiplying by `scale` = 1/world in fp32) to this
  rank's gradient shard [S], fp32. The exchange owns `grads` from then on.
- `WeightAllGather.start(bucket, step)`: from this rank's master shard [S] to the model weights
  [N] every rank holds.

`start` launches the communication asynchronously and returns a `Pending`; `Pending.progress()`
moves a multi-stage exchange to its next stage if the current one has completed (it never
blocks; False while it still waits for its current stage), and `Pending.wait()` completes it. The engine
only sees this interface, so the uncompressed and the compressed variants are interchangeable
and each can be tested on its own. All compute goes through `lightning_sdp4bit.ops` (Triton on
CUDA, the reference elsewhere) and all communication through `lightning_sdp4bit.comm`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import IntEnum
from typing import Any, Protocol

import torch

from lightning_sdp4bit import comm, ops
from lightning_sdp4bit.buffers import Bucket
from lightning_sdp4bit.config import SDP4BitConfig, WeightQuant
from lightning_sdp4bit.reference.ops import stage_seed
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = [
    "GradReduceScatter",
    "grad_collective_for",
    "weight_collective_for",
    "Pending",
    "PlainGradReduceScatter",
    "PlainWeightAllGather",
    "QuantizedWeightAllGather",
    "Stage",
    "TwoLevelGradReduceScatter",
    "WeightAllGather",
]


log = logging.getLogger(__name__)


class Stage(IntEnum):
    """Which quantization a stochastic-rounding seed is for."""

    GRAD_ENCODE = 1  # gradient stage 1: Hadamard + quantize before the first all-to-all
    GRAD_REQUANTIZE = 2  # gradient stage 2: re-quantize between the two all-to-alls
    WEIGHT_ENCODE = 3  # the weight difference (or weights) before the all-gather


class Pending(Protocol):
    def progress(self) -> bool: ...

    def wait(self) -> None: ...


class GradReduceScatter(Protocol):
    def start(self, bucket: Bucket, grads: torch.Tensor, scale: float, step: int) -> Pending: ...


class WeightAllGather(Protocol):
    def start(self, bucket: Bucket, step: int) -> Pending: ...


class _Single:
    """A one-stage exchange: wait for the work, then run `finish` (if any)."""

    def __init__(self, work: Any, finish: Callable[[], None] | None = None, keepalive: Any = None):
        self._work, self._finish, self._keepalive = work, finish, keepalive

    def progress(self) -> bool:
        return True

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._finish is not None:
                self._finish()
        self._keepalive = None


class _Seeds:
    """Stochastic-rounding seeds, distinct per (step, bucket, rank, stage) and reproducible."""

    def __init__(self, config: SDP4BitConfig, rank: int):
        self._base, self._rank = config.seed, rank

    def __call__(self, step: int, bucket: Bucket, stage: Stage) -> int:
        return stage_seed(self._base, step, bucket.layout.index, self._rank, int(stage))


class PlainGradReduceScatter:
    """fp32 reduce-scatter over all ranks: the uncompressed path."""

    def __init__(self, groups: ProcessGroups, meter: WireMeter):
        self._group, self._meter = groups.world, meter

    def start(self, bucket: Bucket, grads: torch.Tensor, scale: float, step: int) -> Pending:
        source = grads.float()  # the same tensor when it is fp32 already: the exchange owns it
        source.mul_(scale)
        work = comm.reduce_scatter(bucket.grad_shard, source, group=self._group, async_op=True)
        self._meter.record("grad_reduce_scatter", source.nbytes, source.numel(), source.nbytes)
        return _Single(work, keepalive=source)


class TwoLevelGradReduceScatter:
    """TLq(-HS): quantized all-to-all inside the node, then across nodes (see SDP4BIT.md).

    Stage 1 (scale by 1/world + rotate + quantize to grad_intra_bits + destination layout, one
    kernel reading the window gradients) runs at `start` and the intra-node all-to-all is
    launched. Stage 2 (dequantize + sum + re-quantize to grad_inter_bits, then the inter-node
    all-to-all) follows it:
    - with a `stream` (CUDA), queued at `start` on that stream, behind a device-side wait for the
      intra all-to-all: it runs as soon as the data lands, with neither the host nor the compute
      stream waiting. (Driven from the host, it could only start once the host found the intra
      stage complete, and on a GPU the host is far ahead: it ran after backward's last kernel,
      8 ms of a 356M step at 100 Gb/s; see benchmarks/results/emulated_network_h200_*.md.)
    - without one (the CPU, where a wait blocks the host), when `progress` finds the intra stage
      complete, or at `wait`.
    `wait` runs stage 3 (dequantize + sum + inverse Hadamard) into the gradient shard, on the
    caller's stream. With one node only the intra stage runs, with one rank per node only the
    inter stage (at grad_inter_bits).
    """

    def __init__(
        self,
        config: SDP4BitConfig,
        topology: Topology,
        groups: ProcessGroups,
        meter: WireMeter,
        rank: int,
        stream: torch.cuda.Stream | None = None,
    ):
        if topology.world_size == 1:
            raise ValueError("the two-level reduce-scatter needs at least two ranks")
        self.config, self.topology, self.groups, self.meter = config, topology, groups, meter
        self.seeds = _Seeds(config, rank)
        self.stream = stream

    def start(self, bucket: Bucket, grads: torch.Tensor, scale: float, step: int) -> Pending:
        return _TwoLevelExchange(self, bucket, grads, scale, step)


class _TwoLevelExchange:
    def __init__(self, owner: TwoLevelGradReduceScatter, bucket: Bucket, grads: torch.Tensor, scale: float, step: int):
        config, topo = owner.config, owner.topology
        self._owner, self._bucket, self._step = owner, bucket, step
        intra = topo.has_intra_stage
        self._needs_second_stage = intra and topo.has_inter_stage
        self._bits = config.grad_intra_bits if intra else config.grad_inter_bits
        # Intra first: the bucket as [nodes, local, S] goes out by local index; inter only: by node.
        outer, chunks = (topo.nodes, topo.ranks_per_node) if intra else (1, topo.nodes)
        seed = owner.seeds(step, bucket, Stage.GRAD_ENCODE)
        payload = ops.grad_encode(
            grads, outer, chunks, config.hadamard_size, self._bits, config.grad_group_size, config.rounding, seed, scale
        )
        self._received = torch.empty_like(payload)
        group = owner.groups.intra if intra else owner.groups.inter
        self._work = comm.all_to_all(self._received, payload, group=group, async_op=True)
        self._sent = payload  # kept alive until the exchange completes
        kind = "grad_intra" if intra else "grad_inter"
        owner.meter.record(kind, payload.nbytes, grads.numel(), 4 * grads.numel())  # vs fp32
        self._on_stream = self._needs_second_stage and owner.stream is not None
        if self._on_stream:
            with torch.cuda.stream(owner.stream):
                self._second_stage()

    def progress(self) -> bool:
        """Run stage 2 (host-driven) if the intra-node all-to-all has completed; never blocks.
        False while stage 2 still waits for it."""
        if self._needs_second_stage:
            if not self._work.is_completed():
                return False
            self._second_stage()
        return True

    def _second_stage(self) -> None:
        self._needs_second_stage = False
        config, topo, owner = self._owner.config, self._owner.topology, self._owner
        self._work.wait()
        seed = owner.seeds(self._step, self._bucket, Stage.GRAD_REQUANTIZE)
        payload = ops.grad_requantize(
            self._received,
            config.grad_intra_bits,
            config.grad_inter_bits,
            config.grad_group_size,
            topo.nodes,
            config.rounding,
            seed,
        )
        if self._on_stream:
            # Made on the compute stream, last used on this one (and on the network's, which this
            # one has waited for): the allocator must not hand them out before this stream is done.
            self._received.record_stream(owner.stream)
            self._sent.record_stream(owner.stream)
        # The first receive buffer is no longer needed: only the new payload and its receive
        # buffer stay alive.
        self._received = torch.empty_like(payload)
        self._work = comm.all_to_all(self._received, payload, group=owner.groups.inter, async_op=True)
        self._sent = payload
        self._bits = config.grad_inter_bits
        owner.meter.record("grad_inter", payload.nbytes, topo.nodes * self._bucket.layout.shard_numel, 0)

    def wait(self) -> None:
        if self._needs_second_stage:
            self._second_stage()
        if self._work is None:
            return
        self._work.wait()
        if self._on_stream:
            # Made on the side stream; the caller's stream is now the one that waited for the
            # network, and it reads the received chunks below.
            current = torch.cuda.current_stream()
            self._received.record_stream(current)
            self._sent.record_stream(current)
        self._work = self._sent = None
        config = self._owner.config
        ops.grad_decode_sum(
            self._received, self._bits, config.grad_group_size, config.hadamard_size, self._bucket.grad_shard
        )
        self._received = None


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
        self.two_level = topology.has_intra_stage and topology.has_inter_stage

    def start(
        self,
        rows: torch.Tensor,
        row: torch.Tensor,
        elements: int,
        uncompressed: int,
        finish: Callable[[], None] | None = None,
    ) -> Pending:
        """`row` [R] (a fresh tensor: the exchange keeps it alive) stands for `elements` values
        that would travel as `uncompressed` bytes; `finish` runs once `rows` [W, R] is complete."""
        self.meter.record("weight", row.nbytes, elements, uncompressed)
        if self.two_level:
            # Counted now, with the step that sends it, although on the CPU it goes out later.
            nodes = self.topology.nodes
            self.meter.record("weight_intra", nodes * row.nbytes, nodes * elements, nodes * uncompressed)
            return _TwoLevelGather(self, rows, row, finish)
        work = comm.all_gather(rows.view(-1), row, group=self.groups.world, async_op=True)
        return _Single(work, finish, keepalive=row)


class _TwoLevelGather:
    """Stage 1 at start: the inter-node all-gather of `row` -> [M, R] (this local index's rows, by
    node). Stage 2: the intra-node all-gather of those blocks -> [L, M, R] (local-major), then a
    transposed copy into `rows` viewed [M, L, R] (rank = node * L + local). With a `stream`
    (CUDA) stage 2 is queued on it at start behind a device-side wait for stage 1, as the
    gradients' middle stage is; without one (the CPU) it goes out from `progress` once stage 1
    has completed, or from `wait`."""

    def __init__(self, owner: _RowGather, rows: torch.Tensor, row: torch.Tensor, finish: Callable[[], None] | None):
        topo = owner.topology
        self._owner, self._rows, self._finish = owner, rows, finish
        self._sent: torch.Tensor | None = row  # the tensors stay alive until the rows are complete
        self._across: torch.Tensor | None = row.new_empty((topo.nodes, row.numel()))
        self._node: torch.Tensor | None = None
        self._staged = False  # stage 2 has gone out
        self._work = comm.all_gather(self._across.view(-1), row, group=owner.groups.inter, async_op=True)
        self._landed: torch.cuda.Event | None = None
        if owner.stream is not None:
            with torch.cuda.stream(owner.stream):
                self._second_stage()

    def progress(self) -> bool:
        if not self._staged:
            if not self._work.is_completed():
                return False
            self._second_stage()
        return True

    def _second_stage(self) -> None:
        owner, topo, across = self._owner, self._owner.topology, self._across
        self._staged = True
        self._work.wait()
        self._node = across.new_empty((topo.ranks_per_node, topo.nodes, across.shape[1]))
        self._work = comm.all_gather(self._node.view(-1), across.view(-1), group=owner.groups.intra, async_op=True)
        if owner.stream is not None:
            self._place()
            self._landed = torch.cuda.Event()
            self._landed.record()

    def _place(self) -> None:
        """Wait for stage 2 (on the current stream), then copy the blocks into rank order."""
        self._work.wait()
        topo = self._owner.topology
        self._rows.view(topo.nodes, topo.ranks_per_node, -1).copy_(self._node.transpose(0, 1))

    def wait(self) -> None:
        if not self._staged:
            self._second_stage()
        if self._sent is None:
            return
        if self._landed is not None:
            # All of stage 2 ran on the side stream, after both collectives: once the caller's
            # stream waits for it, the tensors may go back to the allocator in its order.
            torch.cuda.current_stream().wait_event(self._landed)
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
        self._seeds = _Seeds(config, topology.rank)

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


def _compresses(bucket: Bucket, config: SDP4BitConfig, topology: Topology) -> bool:
    """Whether a bucket is quantized. With one rank nothing travels, so nothing is; buckets
    under `min_compress_numel` travel uncompressed, and are logged so as never to be silent."""
    if topology.world_size == 1:
        return False
    if bucket.layout.used_numel < config.min_compress_numel:
        if topology.rank == 0:
            names = ", ".join(slot.name for slot in bucket.layout.slots)
            log.info(
                "bucket %d (%d elements < min_compress_numel) travels uncompressed: %s",
                bucket.layout.index,
                bucket.layout.used_numel,
                names,
            )
        return False
    return True


def grad_collective_for(
    bucket: Bucket,
    config: SDP4BitConfig,
    topology: Topology,
    groups: ProcessGroups,
    meter: WireMeter,
    stream: torch.cuda.Stream | None = None,
) -> GradReduceScatter:
    """The gradient exchange `config` asks for this bucket (`stream`: see TwoLevelGradReduceScatter)."""
    if config.compresses_grads and _compresses(bucket, config, topology):
        return TwoLevelGradReduceScatter(config, topology, groups, meter, topology.rank, stream)
    return PlainGradReduceScatter(groups, meter)


def weight_collective_for(
    bucket: Bucket,
    config: SDP4BitConfig,
    topology: Topology,
    groups: ProcessGroups,
    meter: WireMeter,
    stream: torch.cuda.Stream | None = None,
) -> WeightAllGather:
    """The weight exchange `config` asks for this bucket (`stream`: see `_TwoLevelGather`)."""
    if config.compresses_weights and _compresses(bucket, config, topology):
        additive = config.weight_quant is WeightQuant.DIFF
        return QuantizedWeightAllGather(config, topology, groups, meter, additive, stream)
    return PlainWeightAllGather(topology, groups, meter, stream)
