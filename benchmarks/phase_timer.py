"""Timing one emulated run through phases (settings of the link rates), on the GPU's own clock.

A run is a sequence of steps; `PhaseTimer.after_step()` after each optimizer step sets the rates
(`Network.set_rates`) at the marks, and times each phase's steps back to back with CUDA events
on the compute stream (nothing synchronised until `results()`), so that what a step leaves in
flight (the weight all-gathers) is charged to the next step, as in training.

Segments: a step that calls `mark("forward")` and `mark("backward")` (gpt_step's steps do) is
also timed in SEGMENTS, on the same stream: "forward" from the end of the previous step to the
loss (waits for weights included), "backward" from there to the gradients being final (the wait
for the last gradient exchanges included), "optimizer" from there to the end of the step (clip,
optimizer, the launch of the weight all-gathers). While a phase is timed, the network link (the
NIC across nodes) records when it is busy, and each segment also reports how long that link
sat idle within it (`idle_by_segment`): where in the step the network waits for the GPU.
A `point(name)` within a marked step is reported as its offset from the step's forward mark
(emulated_runs marks when the forward reaches its last bucket and when the backward has
finished its first: the ends of the turn from forward to backward). What the engine does within
a step is read from a profile (`--profile`) by its `sdp4bit::` labels, not timed here.

The host: each mark also reads the host's clock, and the end of a phase ties the two clocks
together (a synchronize, then an event the idle GPU runs at once). So each mark gives how far
the host ran ahead of the GPU when it queued the mark (`host_lead_ms`): near 0, the GPU had
caught up and waited for the host's launches there. A phase also reports each timed step's
length (`steps_ms`: one slow step shows) and the garbage collector's passes while it was timed.
On a GPU also the caching allocator's calls that stall the host or the device while it was timed
(`allocator`): cudaMalloc and cudaFree (a cudaFree waits for the whole device), and its
synchronisations of every stream (when a cudaMalloc fails it frees its cache: a synchronisation
that `torch.cuda.set_sync_debug_mode` does not report).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import statistics
import sys
import time

import torch
from emulation import Network
from trace_summary import covered, merged

__all__ = ["ALLOCATOR_CALLS", "PROFILED", "SEGMENTS", "Phase", "PhaseTimer", "allocator_per_step", "idle_by_segment"]

PROFILED = 3  # steps of the last phase traced under the torch profiler, untimed
# Seconds of matrix products queued before the first phase's settle steps. Why: the GPU's power
# limit acts on a power averaged over about a second. From idle (a run starts after a fresh
# state), the first ~0.7 s of full load run at the full clock; then the average reaches the limit
# (700 W on the H200) and the clock drops to ~1450 MHz for ~0.2 s before it settles near
# 1750 MHz. Timed from a cold start, one step in five ran 15-20 ms (12%) slow, wherever the dip
# fell (2026-12-03, nvidia-smi at 50 ms; benchmarks/results/power_warmup_h200_2026-12-03.md).
# A run of training holds the limit, so the steps are timed there.
POWER_WARMUP_S = 1.5
SEGMENTS = ("forward", "backward", "optimizer")
# torch.cuda.memory_stats() counters -> the names `allocator` reports them under
ALLOCATOR_CALLS = {"num_device_alloc": "cudaMalloc", "num_device_free": "cudaFree", "num_sync_all_streams": "syncs"}


def allocator_per_step(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float]:
    """The allocator's calls (ALLOCATOR_CALLS) per step between two readings of
    torch.cuda.memory_stats(); a counter this torch does not keep is left out."""
    return {name: (after[key] - before[key]) / steps for key, name in ALLOCATOR_CALLS.items() if key in before}


def idle_by_segment(spans: list[tuple[str, float, float]], busy: list[tuple[float, float]]) -> dict[str, float]:
    """Per segment name, the time within its (name, start, end) spans that no (start, end)
    interval of `busy` covers, summed (same units as the clocks; busy intervals may overlap)."""
    covering = merged(busy)
    idle: dict[str, float] = {}
    for name, start, end in spans:
        idle[name] = idle.get(name, 0.0) + (end - start) - covered(start, end, covering)
    return idle


@dataclasses.dataclass(frozen=True)
class Phase:
    """One setting of the links within a run: `compute` (no wait) or a scenario. Bandwidths in GB/s
    per GPU, latencies per message step in microseconds (emulation.message_steps)."""

    name: str
    nvlink_gbs: float = math.inf
    nic_gbs: float = math.inf
    nvlink_us: float = 0.0
    nic_us: float = 0.0


class PhaseTimer:
    """Drives one run through its phases: call `after_step()` after every optimizer step.

    `warmup` steps at the first phase's rates; then per phase `settle` steps at its rates, and
    `steps` steps timed back to back (CUDA events on the compute stream, nothing synchronized
    until `results()`); then, with `profile`, `PROFILED` more steps of the last phase traced.
    """

    def __init__(self, network: Network | None, phases: list[Phase], args, profile: str | None):
        """`args`: warmup, settle, steps (step counts) and device; with `profile`, profile_python
        (the trace records every Python call on the host too)."""
        self.network, self.steps, self.profile_path = network, args.steps, profile
        self.profile_python = bool(getattr(args, "profile_python", False))
        self.profile_kernels = bool(getattr(args, "profile_kernels", False))
        warmup, settle, steps = args.warmup, args.settle, args.steps
        self.cuda = args.device.type == "cuda"
        # The compute stream's device, so that each clock's event skips torch's device lookup
        # (lightning_sdp4bit.streams says why).
        self._device_index = torch.cuda.current_device() if self.cuda else None
        self._marks: list[tuple[int, object]] = [(0, functools.partial(self._set_rates, phases[0]))]
        count = warmup
        if self.cuda:  # before the first phase's settle steps, so that they carry their own exchanges
            self._marks.append((count, self._hold_power_limit))
        for phase in phases:
            self._marks.append((count, functools.partial(self._set_rates, phase)))
            self._marks.append((count + settle, functools.partial(self._start, phase)))
            count += settle + steps
            self._marks.append((count, functools.partial(self._stop, phase)))
        if profile:
            self._marks += [(count, self._start_profile), (count + PROFILED, self._stop_profile)]
            count += PROFILED
        self.total_steps, self._count, self._open = count, 0, {}
        self._done: dict[str, dict] = {}
        self._segments: list[tuple[str, object, object]] = []  # (segment, start clock, end clock)
        self._host_marks: list[int] = []  # time.monotonic_ns() at each segment's end
        self._gc_passes: list[tuple[int, int]] = []  # (generation, ns) of each pass while timed
        self._last_clock = None  # the open phase's last segment boundary
        self._recording_since = None  # the clock the network link's recorded waits are read against
        self._fire()

    def mark(self, segment: str) -> None:
        """The end of `segment` of the current step (counted only while a phase is timed)."""
        if self._last_clock is not None:
            clock = self._clock()
            self._host_marks.append(time.monotonic_ns())
            self._segments.append((segment, self._last_clock, clock))
            self._last_clock = clock

    def point(self, name: str) -> None:
        """A moment of the current step (counted only while a phase is timed, in a step that marks
        its segments): `results()` gives its mean offset from the step's forward mark."""
        if self._last_clock is not None:
            self._points.append((name, len(self._segments), self._clock()))

    def after_step(self) -> None:
        if self._segments and self._segments[-1][0] == SEGMENTS[-2]:  # a step that marks its segments
            self.mark(SEGMENTS[-1])
        self._count += 1
        self._fire()

    def _fire(self) -> None:
        while self._marks and self._marks[0][0] == self._count:
            self._marks.pop(0)[1]()

    def _set_rates(self, phase: Phase) -> None:
        if self.network is not None:
            self.network.set_rates(phase.nvlink_gbs, phase.nic_gbs, phase.nvlink_us, phase.nic_us)
            # From the settle steps on: the exchanges they leave in flight run into the timed steps.
            # Their clocks are read against one taken now, before any of them: every lane waits
            # for the compute stream before its collective, so no difference is negative.
            self.network.record_network_link(True)
            self._recording_since = self._clock()

    def _hold_power_limit(self) -> None:
        """Queue POWER_WARMUP_S seconds of bf16 matrix products on the compute stream (timed from
        one calibration, which synchronizes: the warm-up steps are untimed)."""
        a = torch.randn(8192, 8192, device=f"cuda:{self._device_index}", dtype=torch.bfloat16)  # 1.1 TFLOP a product
        out = torch.empty_like(a)
        torch.mm(a, a, out=out)  # the library's first call (its workspace, its choice of kernel)
        start = self._clock()
        for _ in range(10):
            torch.mm(a, a, out=out)
        end = self._clock()
        end.synchronize()
        per_product_ms = start.elapsed_time(end) / 10
        for _ in range(math.ceil(POWER_WARMUP_S * 1e3 / per_product_ms)):
            torch.mm(a, a, out=out)

    def _clock(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device_index))
        return event

    def _start(self, phase: Phase) -> None:
        if self.network is not None:
            self.network.reset()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._allocator_before = torch.cuda.memory_stats()
        self._open[phase.name] = self._last_clock = self._clock()
        self._wall_start = time.time()  # seconds since the epoch: to match a log of the GPU's clocks
        self._segments, self._points, self._host_marks, self._gc_passes = [], [], [], []
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.monotonic_ns()
        else:
            self._gc_passes.append((info["generation"], time.monotonic_ns() - self._gc_started))

    def _stop(self, phase: Phase) -> None:
        end, network = self._clock(), self.network
        gc.callbacks.remove(self._on_gc)
        self._last_clock = None
        anchor = None
        if self.cuda:  # the two clocks tied: the idle GPU runs this event as the host queues it
            torch.cuda.synchronize()
            anchor = (time.monotonic_ns(), self._clock())
        link_clocks = network.record_network_link(False) if network else []
        since = self._recording_since if network else None
        busy = {k: v / 1e6 / self.steps for k, v in network.link_busy_ns().items()} if network else {}
        self._done[phase.name] = {
            "clocks": (self._open.pop(phase.name), end),
            "wall_s": (self._wall_start, time.time()),
            "busy_ms": busy,
            "lightning_ops": network.lightning_ops / self.steps if network else 0.0,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else math.nan,
            "segment_clocks": self._segments,
            "point_clocks": self._points,
            "link_clocks": (since, link_clocks),
            "host_marks": (anchor, self._host_marks),
            # per timed step, by generation 0, 1, 2 (a list: it reads back from --json as written)
            "gc_passes": [sum(1 for g, _ in self._gc_passes if g == gen) / self.steps for gen in range(3)],
            "gc_ms": sum(ns for _, ns in self._gc_passes) / 1e6 / self.steps,
            "allocator": allocator_per_step(self._allocator_before, torch.cuda.memory_stats(), self.steps)
            if self.cuda
            else {},
        }

    def _start_profile(self) -> None:
        host = [] if self.profile_kernels and self.cuda else [torch.profiler.ProfilerActivity.CPU]
        activities = host + ([torch.profiler.ProfilerActivity.CUDA] * self.cuda)
        self._profiler = torch.profiler.profile(activities=activities, with_stack=self.profile_python)
        self._profiler.start()

    def _stop_profile(self) -> None:
        self._profiler.stop()
        self._profiler.export_chrome_trace(self.profile_path)
        print(f"  wrote {self.profile_path}", file=sys.stderr)

    def results(self) -> dict[str, dict]:
        """Phase name -> step_ms, busy_ms (per lane and per link), lightning_ops, peak_gib,
        segments_ms (SEGMENTS -> ms per step; empty for a step that does not mark them) and
        link_idle_ms (the network link's idle ms per step within each segment; empty likewise),
        points_ms (each `point` name -> its mean ms from its step's forward mark, negative before),
        steps_ms (each marked step's length), step_segments_ms (each step's segments),
        host_lead_ms (per segment, the median ms the GPU ran its end after the host queued it; empty
        on the CPU), step_host_lead_ms (each step's lead at its end; empty on the CPU), wall_s (the
        host's epoch seconds at the phase's start and stop, to match a log of the GPU's clocks),
        gc_passes and gc_ms (per timed step), allocator (`allocator_per_step`; empty on the CPU)."""
        if self._marks:
            raise RuntimeError(f"the run stopped after {self._count} of {self.total_steps} steps")
        if self.cuda:
            torch.cuda.synchronize()
        for result in self._done.values():
            start, end = result.pop("clocks")
            result["step_ms"] = self._elapsed_ms(start, end) / self.steps
            since, link_clocks = result.pop("link_clocks")
            ms = functools.partial(self._elapsed_ms, since if since is not None else start)
            clocks = result.pop("segment_clocks")
            spans = [(name, ms(a), ms(b)) for name, a, b in clocks]
            busy = [(ms(a), ms(b)) for a, b in link_clocks]
            segments = dict.fromkeys(SEGMENTS, 0.0) if spans else {}
            for name, start, stop in spans:
                segments[name] += (stop - start) / self.steps
            result["segments_ms"] = segments
            idle = idle_by_segment(spans, busy) if self.network is not None else {}
            result["link_idle_ms"] = {name: ms / self.steps for name, ms in idle.items()}
            offsets: dict[str, list[float]] = {}
            for name, recorded, clock in result.pop("point_clocks"):
                forward = len(SEGMENTS) * (recorded // len(SEGMENTS))  # the step's first segment
                if forward < len(spans) and spans[forward][0] == SEGMENTS[0]:
                    offsets.setdefault(name, []).append(ms(clock) - spans[forward][2])
            result["points_ms"] = {name: statistics.fmean(values) for name, values in offsets.items()}
            steps = self._step_segments_ms(spans)
            result["step_segments_ms"] = steps
            result["steps_ms"] = [sum(step.values()) for step in steps]  # the segments follow each other
            leads = self._host_leads(clocks, *result.pop("host_marks"))
            result["host_lead_ms"] = {name: statistics.median(values) for name, values in leads.items()}
            result["step_host_lead_ms"] = leads.get(SEGMENTS[-1], [])
        return self._done

    @staticmethod
    def _step_segments_ms(spans: list[tuple[str, float, float]]) -> list[dict[str, float]]:
        """Each step's segments (name -> ms), its last ending the step: which part of a slow step
        was slow. Each segment starts where the one before ended."""
        steps: list[dict[str, float]] = [{}]
        for name, begin, end in spans:
            steps[-1][name] = steps[-1].get(name, 0.0) + end - begin
            if name == SEGMENTS[-1]:
                steps.append({})
        return steps[:-1]

    @staticmethod
    def _host_leads(clocks: list, anchor: tuple | None, host_marks: list[int]) -> dict[str, list[float]]:
        """Per segment, the ms by which the GPU ran each step's end mark of it after the host
        queued that mark, in step order. `anchor`: (host ns, CUDA event) taken together on an
        idle GPU; None on the CPU (no leads)."""
        if anchor is None:
            return {}
        host_anchor, gpu_anchor = anchor
        leads: dict[str, list[float]] = {}
        for (name, _, clock), host in zip(clocks, host_marks):
            # The GPU ran the mark elapsed_time ms before the anchor, which it ran at host_anchor.
            leads.setdefault(name, []).append((host_anchor - host) / 1e6 - clock.elapsed_time(gpu_anchor))
        return leads

    def _elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)
