"""The two collectives of sharded data parallelism, each behind one small interface, and the
gradient side of them (the weight side is `lightning_sdp4bit.weight_collectives`).

- `GradReduceScatter.start(bucket, grads, scale, step)`: from the window gradients [N] (fp32 or
  the weights' dtype, summed over ranks after multiplying by `scale` = 1/world in fp32) to this
  rank's gradient shard [S], fp32. The exchange owns `grads` from then on. Where it
  `reads_in_place`, `grads` may also be the parameters' gradients as they lie (`HeldGrads`).
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
from lightning_sdp4bit.buffers import Bucket, HeldGrads
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.reference.ops import stage_seed
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.streams import running_on
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = [
    "GradReduceScatter",
    "Pending",
    "PlainGradReduceScatter",
    "Seeds",
    "SingleStage",
    "Stage",
    "TwoLevelGradReduceScatter",
    "WeightAllGather",
    "compresses",
    "grad_collective_for",
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
    reads_in_place: bool  # whether `start` takes HeldGrads

    def start(self, bucket: Bucket, grads: torch.Tensor | HeldGrads, scale: float, step: int) -> Pending: ...


class WeightAllGather(Protocol):
    def start(self, bucket: Bucket, step: int) -> Pending: ...


class SingleStage:
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


class Seeds:
    """Stochastic-rounding seeds, distinct per (step, bucket, rank, stage) and reproducible."""

    def __init__(self, config: SDP4BitConfig, rank: int):
        self._base, self._rank = config.seed, rank

    def __call__(self, step: int, bucket: Bucket, stage: Stage) -> int:
        return stage_seed(self._base, step, bucket.layout.index, self._rank, int(stage))


class TwoStage:
    """The skeleton of an exchange of two collectives on two groups, the second taking the first's
    result. A subclass launches stage 1 (setting `_work`) and calls `_begin(stream)`; it defines
    `_second_stage()` (launch stage 2, setting `_work`) and `_complete()` (what follows stage 2, on
    the caller's stream). With a `stream` (CUDA), stage 2 is queued on it at once behind a
    device-side wait for stage 1: it goes out as soon as the data lands, with neither the host nor
    the compute stream waiting. Without one (the CPU, where a wait blocks the host), `progress`
    launches it once stage 1 has completed, or `wait` does."""

    _work: Any

    def _begin(self, stream: torch.cuda.Stream | None, two_stages: bool = True) -> None:
        """After stage 1 went out; with `two_stages` False there is no second one (`_stream` None)."""
        self._stream = stream if two_stages else None
        self._staged, self._completed = not two_stages, False
        if self._stream is not None:
            with running_on(self._stream):
                self._advance()

    def _advance(self) -> None:
        self._staged = True
        self._work.wait()
        self._second_stage()

    def _second_stage(self) -> None:
        raise NotImplementedError

    def _complete(self) -> None:
        raise NotImplementedError

    def progress(self) -> bool:
        if not self._staged:
            if not self._work.is_completed():
                return False
            self._advance()
        return True

    def wait(self) -> None:
        if not self._staged:
            self._advance()
        if not self._completed:
            self._completed = True
            self._complete()


class PlainGradReduceScatter:
    """fp32 reduce-scatter: the uncompressed path. Over the world, or in two levels when there are
    several nodes of several ranks (`_TwoLevelReduceScatter`)."""

    reads_in_place = False  # fp32 reduce-scatters read one buffer

    def __init__(
        self, topology: Topology, groups: ProcessGroups, meter: WireMeter, stream: torch.cuda.Stream | None = None
    ):
        self.topology, self.groups, self.meter, self.stream = topology, groups, meter, stream

    def start(self, bucket: Bucket, grads: torch.Tensor | HeldGrads, scale: float, step: int) -> Pending:
        if isinstance(grads, HeldGrads):
            raise TypeError(
                "PlainGradReduceScatter.start: grads must be one tensor (reads_in_place is False), got HeldGrads"
            )
        if self.topology.two_level:
            return _TwoLevelReduceScatter(self, bucket, grads, scale)
        source = grads.float()  # the same tensor when it is fp32 already: the exchange owns it
        source.mul_(scale)
        work = comm.reduce_scatter(bucket.grad_shard, source, group=self.groups.world, async_op=True)
        self.meter.record("grad_reduce_scatter", source.nbytes, source.numel(), source.nbytes)
        return SingleStage(work, keepalive=source)


class _TwoLevelReduceScatter(TwoStage):
    """Inside the node, then across nodes. Rank (node m, local l) owns chunk m * L + l of the
    bucket [M, L, S]. Stage 1: the node's L ranks reduce-scatter the bucket laid out local-major
    [L, M, S] (one transposed copy, which is also the conversion to fp32 and the 1/world), so that
    rank l holds the node's sums of chunks (m, l) for every m, [M, S]. Stage 2: the M ranks at
    local index l reduce-scatter those: chunk (m, l) summed over every rank. Each GPU's NIC
    carries (M - 1) / M of [M, S] instead of (W - 1) / W of the whole bucket. The sums are taken in
    another order than a flat reduce-scatter's: equal up to rounding, not bit for bit."""

    def __init__(self, owner: PlainGradReduceScatter, bucket: Bucket, grads: torch.Tensor, scale: float):
        topo = owner.topology
        nodes, local, shard = topo.nodes, topo.ranks_per_node, bucket.layout.shard_numel
        self._owner, self._bucket = owner, bucket
        self._source = torch.empty((local, nodes, shard), dtype=torch.float32, device=grads.device)
        self._source.copy_(grads.view(nodes, local, shard).transpose(0, 1))
        self._source.mul_(scale)
        self._partial = self._source.new_empty(nodes * shard)
        self._work = comm.reduce_scatter(self._partial, self._source.view(-1), group=owner.groups.intra, async_op=True)
        owner.meter.record("grad_reduce_scatter", self._source.nbytes, self._source.numel(), self._source.nbytes)
        # The second stage's input counts too (its uncompressed figure is itself).
        owner.meter.record("grad_reduce_scatter", self._partial.nbytes, self._partial.numel(), self._partial.nbytes)
        self._begin(owner.stream)

    def _second_stage(self) -> None:
        group = self._owner.groups.inter
        self._work = comm.reduce_scatter(self._bucket.grad_shard, self._partial, group=group, async_op=True)

    def _complete(self) -> None:
        self._work.wait()  # on the caller's stream: the shard is read after this
        del self._source, self._partial  # back to the allocator


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
        self.seeds = Seeds(config, rank)
        self.stream = stream

    reads_in_place = True  # stage 1 reads the gradients where they lie (grad_encode_pieces)

    def start(self, bucket: Bucket, grads: torch.Tensor | HeldGrads, scale: float, step: int) -> Pending:
        return _TwoLevelExchange(self, bucket, grads, scale, step)


class _TwoLevelExchange(TwoStage):
    def __init__(
        self, owner: TwoLevelGradReduceScatter, bucket: Bucket, grads: torch.Tensor | HeldGrads, scale: float, step: int
    ):
        config, topo = owner.config, owner.topology
        self._owner, self._bucket, self._step = owner, bucket, step
        intra = topo.has_intra_stage
        self._bits = config.grad_intra_bits if intra else config.grad_inter_bits
        # Intra first: the bucket as [nodes, local, S] goes out by local index; inter only: by node.
        outer, chunks = (topo.nodes, topo.ranks_per_node) if intra else (1, topo.nodes)
        seed = owner.seeds(step, bucket, Stage.GRAD_ENCODE)
        args = (outer, chunks, config.hadamard_size, self._bits, config.grad_group_size, config.rounding, seed, scale)
        if isinstance(grads, HeldGrads):
            payload = ops.grad_encode_pieces(grads.grads, grads.starts, grads.numel, *args)
        else:
            payload = ops.grad_encode(grads, *args)
        self._received = torch.empty_like(payload)
        group = owner.groups.intra if intra else owner.groups.inter
        self._work = comm.all_to_all(self._received, payload, group=group, async_op=True)
        self._sent = payload  # kept alive until the exchange completes
        kind = "grad_intra" if intra else "grad_inter"
        numel = bucket.layout.numel
        owner.meter.record(kind, payload.nbytes, numel, 4 * numel)  # vs fp32
        self._begin(owner.stream, two_stages=topo.two_level)

    def _second_stage(self) -> None:
        config, topo, owner = self._owner.config, self._owner.topology, self._owner
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
        if self._stream is not None:
            # Made on the compute stream, last used on this one (and on the network's, which this
            # one has waited for): the allocator must not hand them out before this stream is done.
            self._received.record_stream(self._stream)
            self._sent.record_stream(self._stream)
        # The first receive buffer is no longer needed: only the new payload and its receive
        # buffer stay alive.
        self._received = torch.empty_like(payload)
        self._work = comm.all_to_all(self._received, payload, group=owner.groups.inter, async_op=True)
        self._sent = payload
        self._bits = config.grad_inter_bits
        # Uncompressed, the second stage would carry the same [M, S] in fp32 (PlainGradReduceScatter).
        elements = topo.nodes * self._bucket.layout.shard_numel
        owner.meter.record("grad_inter", payload.nbytes, elements, 4 * elements)

    def _complete(self) -> None:
        self._work.wait()
        if self._stream is not None:
            # Made on the side stream; the caller's stream is now the one that waited for the
            # network, and it reads the received chunks below.
            current = torch.cuda.current_stream(self._stream.device_index)  # indexed: streams.py says why
            self._received.record_stream(current)
            self._sent.record_stream(current)
        self._work = None
        del self._sent
        config = self._owner.config
        ops.grad_decode_sum(
            self._received, self._bits, config.grad_group_size, config.hadamard_size, self._bucket.grad_shard
        )
        del self._received


def compresses(bucket: Bucket, config: SDP4BitConfig, topology: Topology) -> bool:
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
    if config.compresses_grads and compresses(bucket, config, topology):
        return TwoLevelGradReduceScatter(config, topology, groups, meter, topology.rank, stream)
    return PlainGradReduceScatter(topology, groups, meter, stream)
