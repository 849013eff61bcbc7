"""One GPU as rank 0 of a W-rank job: loopback collectives that take the network's time.

`Network.install()` replaces the functions of `lightning_sdp4bit.comm` (every collective the
engine issues) and the tensor collectives of `torch.distributed` that Lightning calls directly
(broadcast, all_reduce, all_gather, barrier) with loopbacks, and `create_process_groups` with
`Network.groups`, so that the engine and the strategy believe they are rank 0 of W ranks.

Words used here:
- link: the physical path a rank's bytes cross. NVLink inside a node; the NIC between nodes.
- lane: one FIFO of collectives on its own CUDA stream, as an NCCL communicator runs its
  operations in order. "intra" takes the engine's intra-node groups (NVLink); "inter" its
  inter-node groups (the NIC); "world" its world group and every group it does not know (it
  crosses the NIC when there are several nodes, so it is charged at the NIC's rate, else at
  NVLink's). Lightning's own calls on the default group take the world lane too (one
  communicator, as today: they queue behind the engine's world-group all-gathers), or a lane of
  their own with `lightning_lane="own"` (the engine on communicators of its own).

A collective on a lane: the lane's stream waits for the caller's current stream (the inputs
are ready), copies (rank 0's share of the result, as if every peer had sent what rank 0 sent),
then waits bytes / bandwidth on the GPU's %globaltimer (gpu_wait.spin; 1 GB/s = 1 byte per ns;
%globaltimer counts nanoseconds whatever the SM clock does, unlike torch.cuda._sleep). `async_op=True`
returns a work handle whose `wait()` makes the caller's current stream wait for the lane's event,
as NCCL's does; a synchronous call waits in place.

Latency: each collective also waits, in sequence, a per-message latency for every step its
algorithm takes on each link (`message_steps`): NVLink steps at `nvlink_us`, steps that cross the
NIC at `nic_us`. A ring all-gather or reduce-scatter over G ranks on M nodes takes G - 1 steps,
M - 1 of them across nodes; an all-to-all sends one message to each of its G - 1 peers (those on
other nodes cross the NIC), charged one after another; an all-reduce takes the cheaper of a ring
(2(G - 1) steps, 2(M - 1) across nodes) and a tree (2((G/M - 1) NVLink steps + ceil(log2 M) NIC
steps)), as NCCL picks trees for small messages; a broadcast is a chain (G - 1 steps); a barrier
an all-reduce of nothing. The step counts are those of NCCL's own cost model (src/graph/tuning.cc,
`ncclTopoTuneModel`), whose per-step latencies for the Simple protocol are 3.4 us over NVLink and
9.6 us over the network (0.5-1.9 us and 2.7-4.0 us for its low-latency protocols).

What the loopbacks write, and the bytes a ring moves per rank for a group of G ranks (the
copies themselves, in 8-byte words where the rows allow, cost a few microseconds of the lane;
they are not counted as busy):
- all_gather(out [G n], in [n]): out = in repeated G times;          (G-1)/G * out bytes
- reduce_scatter(out [n], in [G n]): out = in's first chunk;          (G-1)/G * in bytes
  (the engine divides by the world before it, so this is the mean of identical ranks)
- all_to_all(out, in): out = in;                                      (G-1)/G * in bytes
- all_reduce(t): t *= G (the sum of G identical ranks);               2(G-1)/G * t bytes
  Lightning's all_reduce leaves t as it is: it divides by the real one-rank group's size.
- broadcast(t): t unchanged (rank 0 is the source);                   t bytes
- barrier: nothing;                                                   0 bytes
On the CPU (the dry run) the copies run inline and nothing waits; bytes are still counted. On a
GPU, a collective of host tensors (a gloo group's: the preemption check's flag, the guards'
bitmaps) runs inline too and its time is waited on the host.

Each lane's busy time is also kept by purpose (PURPOSES): the engine's all-gathers carry weights,
its reduce-scatters and all-to-alls gradients, the rest is "other".

phase_timer.py times a run through phases (settings of the link rates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from gpu_wait import spin as gpu_wait_spin

import lightning_sdp4bit.comm as comm
import lightning_sdp4bit.topology as topology_module
from lightning_sdp4bit.buffers import as_words
from lightning_sdp4bit.streams import running_on
from lightning_sdp4bit.topology import ProcessGroups, Topology

__all__ = ["PURPOSES", "FakeGroup", "Lane", "Network", "latency_ns", "message_steps"]

LIGHTNING_LANES = ("shared", "own")
# What a collective carries: the engine's all-gathers carry weights, its reduce-scatters and
# all-to-alls gradients; everything else (all-reduces, broadcasts, Lightning's calls) is "other".
PURPOSES = ("weights", "gradients", "other")


class _Work:
    """The handle of an asynchronous collective: `wait()` orders the caller's stream after it."""

    def __init__(self, done: torch.cuda.Event | None, device_index: int | None = None):
        self._done, self._device_index = done, device_index

    def wait(self, timeout: Any = None) -> bool:
        if self._done is not None:
            torch.cuda.current_stream(self._device_index).wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()


def message_steps(kind: str, ranks: int, nodes: int) -> list[tuple[int, int]]:
    """The algorithms a collective of `kind` over `ranks` ranks spread evenly on `nodes` nodes may
    take, each as (NVLink steps, NIC steps) one rank waits through one after another (see the
    module docstring); the emulation charges the cheapest."""
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise ValueError(f"{ranks} ranks cannot spread evenly on {nodes} nodes")
    local = ranks // nodes
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return [(ranks - 1 - (nodes - 1), nodes - 1)]
    if kind == "all_to_all":
        return [(local - 1, ranks - local)]
    if kind in ("all_reduce", "barrier"):
        ring = (2 * (ranks - 1) - 2 * (nodes - 1), 2 * (nodes - 1))
        return [ring, (2 * (local - 1), 2 * math.ceil(math.log2(nodes)))]
    raise ValueError(f"no step count for a collective of kind {kind!r}")


def latency_ns(kind: str, ranks: int, nodes: int, nvlink_ns: float, nic_ns: float) -> float:
    """What the emulation charges a collective for its messages: its cheapest algorithm's steps,
    each at its link's latency."""
    return min(nvlink * nvlink_ns + nic * nic_ns for nvlink, nic in message_steps(kind, ranks, nodes))


def _wait_on_host(ns: float) -> None:
    """Busy-wait ns nanoseconds on the host, as a blocking gloo collective holds its caller."""
    until = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < until:
        pass


class Lane:
    """One FIFO of collectives: a CUDA stream, its bandwidth and latencies, and what it was charged.

    `nodes`: how many nodes the lane's groups span (1 for NVLink inside a node, M across nodes),
    which decides how many of a collective's steps cross the NIC."""

    def __init__(self, name: str, device: torch.device, spin: Callable[[int], None] | None, nodes: int = 1):
        self.name, self.nodes = name, nodes
        # High priority, as a network does not wait for SMs to free up; it also keeps the lanes
        # out of the low-priority pool that torch.cuda.Stream() hands the engine's own streams from.
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._spin = spin
        self.gbs = math.inf  # GB/s per GPU; inf = no wait (the compute-only phase)
        self.nvlink_ns = self.nic_ns = 0.0  # latency of one step on each link
        self.busy_ns = 0.0  # sum of the waits charged since the last reset, latency included
        self.latency_ns = 0.0  # the part of busy_ns that is latency
        self.ops = 0  # collectives run since the last reset
        self.purpose_ns: dict[str, float] = {}  # busy_ns by what the collectives carried (PURPOSES)
        # While a list: (start, end) clocks of every wait, CUDA events on the lane's stream (host
        # perf_counter readings on the CPU), for where in a step the link idles.
        self.recorded: list[tuple[Any, Any]] | None = None

    def reset(self) -> None:
        self.busy_ns, self.latency_ns, self.ops = 0.0, 0.0, 0
        self.purpose_ns = {}

    def latency_of(self, kind: str, ranks: int) -> float:
        """Nanoseconds of latency a collective of `kind` over `ranks` ranks of this lane waits."""
        if math.isinf(self.gbs) or not (self.nvlink_ns or self.nic_ns):
            return 0.0
        return latency_ns(kind, ranks, self.nodes, self.nvlink_ns, self.nic_ns)

    def run(
        self,
        purpose: str,
        nbytes: float,
        latency_ns: float,
        tensors: tuple,
        loopback: Callable[[], Any],
        async_op: bool,
    ) -> _Work | None:
        """Copy with `loopback`, then wait latency_ns + nbytes / gbs on this lane, charged to
        `purpose` (one of PURPOSES); see the module docstring."""
        ns = (0.0 if math.isinf(self.gbs) else nbytes / self.gbs) + latency_ns  # latency_of: 0 at inf
        self.busy_ns += ns
        self.purpose_ns[purpose] = self.purpose_ns.get(purpose, 0.0) + ns
        self.latency_ns += latency_ns
        self.ops += 1
        if self.stream is None:  # the CPU: in place, at once
            start = time.perf_counter()
            loopback()
            if self.recorded is not None:
                self.recorded.append((start, time.perf_counter()))
            return _Work(None) if async_op else None
        if any(not tensor.is_cuda for tensor in tensors):
            # A host collective (a gloo group's, as the preemption check's one-int flag each
            # batch): the host waits, not a stream, and the GPU's queue is not involved.
            loopback()
            _wait_on_host(ns)
            return _Work(None) if async_op else None
        with running_on(self.stream) as caller:
            self.stream.wait_stream(caller)
            loopback()
            recording = self.recorded is not None
            if recording:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            if ns >= 1:
                self._spin(int(ns))
            if recording:
                end.record(self.stream)
                self.recorded.append((start, end))
            done = torch.cuda.Event()
            done.record(self.stream)
        for tensor in tensors:  # as NCCL stashes them: not reused before the lane is done
            tensor.record_stream(self.stream)
        work = _Work(done, self.stream.device_index)
        if async_op:
            return work
        work.wait()
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class FakeGroup:
    """Stands for one process group of the emulated job; its collectives take `lane`."""

    name: str
    lane: Lane
    ranks: int

    def size(self) -> int:
        return self.ranks

    def rank(self) -> int:
        return 0


class Network:
    """The emulated job seen from rank 0: lanes, their rates, the fake process groups."""

    def __init__(self, device: torch.device, topology: Topology, lightning_lane: str = "shared"):
        if lightning_lane not in LIGHTNING_LANES:
            raise ValueError(f"lightning_lane must be one of {LIGHTNING_LANES}, got {lightning_lane!r}")
        if topology.rank != 0:
            raise ValueError("the emulation plays rank 0")
        self.topology = topology
        spin = gpu_wait_spin if device.type == "cuda" else None
        nodes = topology.world_size // topology.ranks_per_node
        self.intra = Lane("intra", device, spin)
        self.inter, self.world = Lane("inter", device, spin, nodes), Lane("world", device, spin, nodes)
        self.lightning = self.world if lightning_lane == "shared" else Lane("lightning", device, spin, nodes)
        self.lanes = [self.intra, self.inter, self.world] + ([self.lightning] if lightning_lane == "own" else [])
        self.lightning_ops = 0  # torch.distributed calls made outside comm (Lightning, the adapter)

    def set_rates(self, nvlink_gbs: float, nic_gbs: float, nvlink_us: float = 0.0, nic_us: float = 0.0) -> None:
        """GB/s per GPU on each link (math.inf for both gives the compute-only step, which waits
        no latency either), and the latency of one message step on each, in microseconds."""
        self.intra.gbs, self.inter.gbs = nvlink_gbs, nic_gbs
        self.world.gbs = self.lightning.gbs = nic_gbs if self.topology.has_inter_stage else nvlink_gbs
        for lane in self.lanes:
            lane.nvlink_ns, lane.nic_ns = 1e3 * nvlink_us, 1e3 * nic_us

    def reset(self) -> None:
        self.lightning_ops = 0
        for lane in self.lanes:
            lane.reset()

    def link_busy_ns(self) -> dict[str, float]:
        """Busy time per lane and per physical link (the world lanes are charged to the link they
        cross), each link's also by purpose ("nic_weights", ...); "latency": the part of all
        lanes' busy time that was per-message latency."""
        worlds, links = self._world_lanes(), self._links()
        busy = {
            "intra": self.intra.busy_ns,
            "inter": self.inter.busy_ns,
            "world": sum(lane.busy_ns for lane in worlds),
            "latency": sum(lane.latency_ns for lane in self.lanes),
        }
        for link, lanes in links.items():
            busy[link] = sum(lane.busy_ns for lane in lanes)
            for purpose in PURPOSES:
                busy[f"{link}_{purpose}"] = sum(lane.purpose_ns.get(purpose, 0.0) for lane in lanes)
        return busy

    def _world_lanes(self) -> list[Lane]:
        return [self.world] + ([self.lightning] if self.lightning is not self.world else [])

    def _links(self) -> dict[str, list[Lane]]:
        """The lanes on each physical link: the world lanes cross the NIC when there are nodes."""
        worlds = self._world_lanes()
        several_nodes = self.topology.has_inter_stage
        return {
            "nvlink": [self.intra] + ([] if several_nodes else worlds),
            "nic": [self.inter] + (worlds if several_nodes else []),
        }

    def record_network_link(self, on: bool) -> list[tuple[Any, Any]]:
        """Start (on) or stop recording when the network link (the NIC across nodes, NVLink on one
        node) is busy; stopping returns the (start, end) clocks of every wait since the start."""
        lanes = self._links()["nic" if self.topology.has_inter_stage else "nvlink"]
        recorded = [clocks for lane in lanes for clocks in (lane.recorded or [])]
        for lane in lanes:
            lane.recorded = [] if on else None
        return recorded

    # ----------------------------------------------------------------------------------------
    # Process groups

    def groups(self, topology: Topology | None = None, timeout: Any = None) -> ProcessGroups:
        """A ProcessGroups of FakeGroups shaped as create_process_groups shapes the real ones: a
        stage that spans the world uses the world group, an absent stage is None. Fields other
        than world/intra/inter (groups the engine may gain) get a group of their own, on the
        intra or inter lane when their name says so, else on the world lane. `timeout` is
        create_process_groups's: emulated collectives never wait on a peer, so it is unused."""
        topo = topology if topology is not None else self.topology
        if topo != self.topology:
            raise ValueError(f"the network emulates {self.topology}, not {topo}")
        world = FakeGroup("world", self.world, topo.world_size)
        intra = inter = world
        if not topo.has_intra_stage:
            intra = None
        elif topo.has_inter_stage:
            intra = FakeGroup("intra", self.intra, topo.ranks_per_node)
        if not topo.has_inter_stage:
            inter = None
        elif topo.has_intra_stage:
            inter = FakeGroup("inter", self.inter, topo.nodes)
        base = {"world": world, "intra": intra, "inter": inter}
        values = {}
        for field in dataclasses.fields(ProcessGroups):
            if field.name in base:
                values[field.name] = base[field.name]
                continue
            like = base["intra" if "intra" in field.name else "inter" if "inter" in field.name else "world"]
            values[field.name] = None if like is None else FakeGroup(field.name, like.lane, like.ranks)
        return ProcessGroups(**values)

    def _group(self, group: Any, default: Lane) -> tuple[Lane, int]:
        """(lane, ranks) of a collective on `group`: ours, or anything else on `default`."""
        if isinstance(group, FakeGroup):
            return group.lane, group.ranks
        return default, self.topology.world_size

    def _dist_group(self, group: Any) -> tuple[Lane, int]:
        """(lane, ranks) of a torch.distributed call made outside comm, counted."""
        self.lightning_ops += 1
        return self._group(group, self.lightning)

    # ----------------------------------------------------------------------------------------
    # The collectives

    def all_gather(self, output, input, group=None, async_op=False):
        ranks = output.numel() // input.numel()
        lane = self._group(group, self.world)[0]

        def loopback():
            # As words (as_words says why): as bytes it took the lanes 1.5 ms of SMs a step at 1.3B,
            # W = 64, several times what NCCL's vectorised copies would.
            rows, row = as_words(output.view(ranks, input.numel()), input.reshape(1, -1))
            rows.copy_(row.expand(ranks, -1))

        latency = lane.latency_of("all_gather", ranks)
        return lane.run("weights", (ranks - 1) / ranks * output.nbytes, latency, (output, input), loopback, async_op)

    def reduce_scatter(self, output, input, group=None, async_op=False):
        ranks = input.numel() // output.numel()
        lane = self._group(group, self.world)[0]

        def loopback():
            output.copy_(input.reshape(ranks, -1)[0].view_as(output))

        latency = lane.latency_of("reduce_scatter", ranks)
        return lane.run("gradients", (ranks - 1) / ranks * input.nbytes, latency, (output, input), loopback, async_op)

    def all_to_all(self, output, input, group=None, async_op=False):
        lane, ranks = self._group(group, self.world)
        nbytes, latency = (ranks - 1) / ranks * input.nbytes, lane.latency_of("all_to_all", ranks)
        return lane.run("gradients", nbytes, latency, (output, input), lambda: output.copy_(input), async_op)

    def all_reduce(self, tensor, group=None, async_op=False):
        lane, ranks = self._group(group, self.world)
        nbytes, latency = 2 * (ranks - 1) / ranks * tensor.nbytes, lane.latency_of("all_reduce", ranks)
        return lane.run("other", nbytes, latency, (tensor,), lambda: tensor.mul_(ranks), async_op)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        lane, ranks = self._group(group, self.world)
        return lane.run("other", tensor.nbytes, lane.latency_of("broadcast", ranks), (tensor,), lambda: None, async_op)

    # torch.distributed's signatures, for the calls Lightning and the adapter make directly.

    def _dist_broadcast(self, tensor, src=0, group=None, async_op=False, **kwargs):
        lane, ranks = self._dist_group(group)
        return lane.run("other", tensor.nbytes, lane.latency_of("broadcast", ranks), (tensor,), lambda: None, async_op)

    def _dist_all_reduce(self, tensor, op=None, group=None, async_op=False):
        lane, ranks = self._dist_group(group)
        nbytes, latency = 2 * (ranks - 1) / ranks * tensor.nbytes, lane.latency_of("all_reduce", ranks)
        return lane.run("other", nbytes, latency, (tensor,), lambda: None, async_op)

    def _dist_all_gather(self, tensor_list, tensor, group=None, async_op=False):
        lane, _ = self._dist_group(group)
        ranks = len(tensor_list)

        def loopback():
            for out in tensor_list:
                out.copy_(tensor)

        nbytes, latency = (ranks - 1) * tensor.nbytes, lane.latency_of("all_gather", ranks)
        return lane.run("other", nbytes, latency, (tensor, *tensor_list), loopback, async_op)

    def _dist_barrier(self, group=None, async_op=False, device_ids=None):
        lane, ranks = self._dist_group(group)
        return lane.run("other", 0, lane.latency_of("barrier", ranks), (), lambda: None, async_op)

    # ----------------------------------------------------------------------------------------
    # Installing

    @contextlib.contextmanager
    def install(self) -> Iterator[Network]:
        """Patch comm, torch.distributed's tensor collectives and every module of the package
        that holds `create_process_groups`; everything is restored on exit."""
        patches: list[tuple[Any, str, Any]] = []
        for name in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast"):
            patches.append((comm, name, getattr(self, name)))
        for name in ("broadcast", "all_reduce", "all_gather", "barrier"):
            patches.append((dist, name, getattr(self, f"_dist_{name}")))
        original = topology_module.create_process_groups
        for module in list(sys.modules.values()):
            holds = getattr(module, "__name__", "").startswith("lightning_sdp4bit")
            if holds and getattr(module, "create_process_groups", None) is original:
                patches.append((module, "create_process_groups", self.groups))
        saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
        try:
            for target, name, value in patches:
                setattr(target, name, value)
            yield self
        finally:
            for target, name, value in saved:
                setattr(target, name, value)
