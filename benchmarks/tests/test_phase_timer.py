"""benchmarks/phase_timer.py's segments and the network link's idle time within them, with a
clock that ticks one second per reading (no timing is measured here), and
emulated_tables.step_bound.

- a step that marks "forward" and "backward" is timed in three segments that tile it: from the
  previous step's end to the forward mark, to the backward mark, to the end of the step;
- steps of the warm-up, of the settle steps and after the last phase are not counted, and a run
  whose steps mark nothing (a Trainer row) reports no segments;
- the network link's idle time per segment: what its busy intervals (overlapping ones merged,
  those outside every span ignored) leave uncovered; with an emulated network, a collective in
  the forward leaves the rest of the forward, and the backward and the optimizer, idle;
- the bound from the step's order adds the larger of the forward and the weights' busiest link,
  the larger of the backward and the gradients' busiest link, and the optimizer; with an end
  bucket, the forward waits for its share of the weights' link time first, and its share of the
  gradients' crosses after the backward; the turn's forward tail follows the weights, and its
  backward head precedes the gradients; a DDP in its order moves its gradients only during and
  after the backward;
- a point within a marked step is read against that step's forward mark;
- each timed step's length is reported, and the garbage collector's passes while a phase is
  timed (and none outside it); the host's lead over the GPU at each mark is read against an
  anchor taken with both clocks together; the allocator's calls are counted per step.
"""

import gc
import itertools
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import phase_timer  # noqa: E402
from emulated_tables import ddp_step_bound, step_bound  # noqa: E402
from emulation import Network  # noqa: E402
from phase_timer import Phase, PhaseTimer, allocator_per_step, idle_by_segment  # noqa: E402

import lightning_sdp4bit.comm as comm  # noqa: E402
from lightning_sdp4bit.topology import Topology  # noqa: E402

ARGS = Namespace(warmup=1, settle=1, steps=2, device=torch.device("cpu"))


@pytest.fixture
def ticking_clock(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(phase_timer.time, "perf_counter", lambda: float(next(ticks)))


def test_marked_steps_are_timed_in_segments_that_tile_the_step(ticking_clock):
    timer = PhaseTimer(None, [Phase("compute"), Phase("eth100", 1.0, 1.0)], ARGS, None)
    for _ in range(timer.total_steps):
        timer.mark("forward")
        timer.mark("backward")
        timer.after_step()
    results = timer.results()
    for name in ("compute", "eth100"):
        # Per timed step, one reading for each mark and one for its end: 1 s each. The phase's
        # end clock comes one reading after the last step's end.
        assert results[name]["segments_ms"] == {"forward": 1000.0, "backward": 1000.0, "optimizer": 1000.0}
        assert results[name]["step_ms"] == pytest.approx(3000.0 + 1000.0 / ARGS.steps)


def test_a_run_that_marks_nothing_reports_no_segments(ticking_clock):
    timer = PhaseTimer(None, [Phase("compute")], ARGS, None)
    for _ in range(timer.total_steps):
        timer.after_step()
    assert timer.results()["compute"]["segments_ms"] == {}


def test_idle_by_segment_counts_what_no_busy_interval_covers():
    spans = [("forward", 0.0, 10.0), ("backward", 10.0, 30.0), ("forward", 30.0, 40.0)]
    busy = [(2.0, 5.0), (4.0, 8.0), (25.0, 35.0), (50.0, 60.0), (-5.0, 1.0)]  # overlapping, and outside
    # forward: 0-10 less 0-1 and 2-8 -> 3; 30-40 less 30-35 -> 5. backward: 10-30 less 25-30 -> 15.
    assert idle_by_segment(spans, busy) == {"forward": 8.0, "backward": 15.0}
    assert idle_by_segment(spans, []) == {"forward": 20.0, "backward": 20.0}


def test_a_collective_in_the_forward_leaves_the_link_idle_around_it(ticking_clock):
    network = Network(torch.device("cpu"), Topology(0, 8, 4))
    groups = network.groups()
    timer = PhaseTimer(network, [Phase("compute"), Phase("eth100", 1.0, 1.0)], ARGS, None)
    out, mine = torch.empty(8 * 4), torch.ones(4)
    with network.install():
        for _ in range(timer.total_steps):
            comm.all_gather(out, mine, group=groups.world)  # two readings: the wait's start and end
            timer.mark("forward")
            timer.mark("backward")
            timer.after_step()
    for result in timer.results().values():
        # forward: from the boundary, 1 s to the wait, 1 s of wait, 1 s to the mark: 2 s idle.
        assert result["link_idle_ms"] == {"forward": 2000.0, "backward": 1000.0, "optimizer": 1000.0}
        assert result["segments_ms"] == {"forward": 3000.0, "backward": 1000.0, "optimizer": 1000.0}


def test_the_step_bound_takes_each_link_where_it_can_run():
    compute = {"forward": 50.0, "backward": 100.0, "optimizer": 4.0}
    busy = {"nvlink_weights": 10.0, "nic_weights": 57.0, "nvlink_gradients": 12.0, "nic_gradients": 60.0}
    assert step_bound(compute, busy, 0.0) == 57.0 + 100.0 + 4.0  # the weights do not fit under the forward
    busy["nic_weights"] = 30.0
    assert step_bound(compute, busy, 0.0) == 154.0  # everything hides: the compute-only step
    # An end bucket of 10% of the elements: 3 ms of weights before the forward, 6 ms of gradients
    # after the backward.
    assert step_bound(compute, busy, 0.1) == pytest.approx(3.0 + 50.0 + 100.0 + 6.0 + 4.0)
    busy["nic_gradients"] = 200.0  # the gradients' link is the bottleneck: its end share hides in it
    assert step_bound(compute, busy, 0.1) == pytest.approx(3.0 + 50.0 + 200.0 + 4.0)
    # The turn: the forward computes 8 ms after its last bucket crossed, the backward 15 ms
    # before its first bucket's gradients are complete; the link waits through both.
    busy["nic_weights"], busy["nic_gradients"] = 57.0, 90.0
    assert step_bound(compute, busy, 0.0, tail=8.0, head=15.0) == 57.0 + 8.0 + 15.0 + 90.0 + 4.0
    assert step_bound(compute, busy, 0.0, tail=8.0, head=5.0) == 57.0 + 8.0 + 100.0 + 4.0  # the backward hides it


def test_a_ddp_in_its_order_moves_its_gradients_only_during_and_after_the_backward():
    plain = {"forward": 40.0, "backward": 95.0, "optimizer": 10.0}
    # Link-bound (16 x 4, 1.3B): the forward and the optimizer add to the link's time, not hide it.
    assert ddp_step_bound(plain, 27.5, 402.8) == pytest.approx(40.0 + 402.8 + 10.0)
    # Compute-bound: the backward hides both links, and DDP steps as the plain step.
    assert ddp_step_bound(plain, 7.5, 57.5) == pytest.approx(145.0)


def test_points_are_read_against_their_steps_forward_mark(ticking_clock):
    timer = PhaseTimer(None, [Phase("compute"), Phase("eth100", 1.0, 1.0)], ARGS, None)
    for _ in range(timer.total_steps):
        timer.point("last_weights")  # one reading (1 s) before the forward mark
        timer.mark("forward")
        timer.point("first_gradients")
        timer.point("first_gradients")  # a second reading in the step: each counts
        timer.mark("backward")
        timer.after_step()
    for result in timer.results().values():
        assert result["points_ms"] == {"last_weights": -1000.0, "first_gradients": 1500.0}
        assert result["segments_ms"] == {"forward": 2000.0, "backward": 3000.0, "optimizer": 1000.0}
    unmarked = PhaseTimer(None, [Phase("compute")], ARGS, None)
    for _ in range(unmarked.total_steps):
        unmarked.point("last_weights")
        unmarked.after_step()
    assert unmarked.results()["compute"]["points_ms"] == {}


def test_each_timed_steps_length_and_the_collectors_passes_while_timed(ticking_clock):
    timer = PhaseTimer(None, [Phase("compute")], ARGS, None)
    for step in range(timer.total_steps):
        timer.mark("forward")
        if step == timer.total_steps - 1:
            timer.mark("forward")  # one more reading: the last step is 1 s longer
            gc.collect()  # a full pass, while timed
        timer.mark("backward")
        timer.after_step()
        if step == 0:
            gc.collect()  # in the warm-up: not counted
    result = timer.results()["compute"]
    assert result["steps_ms"] == [3000.0, 4000.0]
    segments = [{"forward": 1000.0, "backward": 1000.0, "optimizer": 1000.0}]
    assert result["step_segments_ms"] == segments + [{"forward": 2000.0, "backward": 1000.0, "optimizer": 1000.0}]
    start, stop = result["wall_s"]
    assert 0 < stop - start < 60  # the host's clock, in seconds since the epoch
    assert result["gc_passes"] == [0.0, 0.0, 1 / ARGS.steps]  # by generation
    assert result["gc_ms"] > 0
    assert timer._on_gc not in gc.callbacks  # unhooked when the phase stops
    assert result["host_lead_ms"] == {} and result["step_host_lead_ms"] == []  # the CPU: one clock, no lead


class _Event:
    """A CUDA event's stand-in: its GPU time in ms."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: "_Event") -> float:
        return other.ms - self.ms


def test_the_hosts_lead_is_how_long_after_queueing_a_mark_the_gpu_ran_it():
    # GPU clock = host clock + 100 ms (the anchor: host 1000 ms, GPU 1100 ms). The forward's end
    # was queued at host 200 ms and ran at GPU 310 ms (host 210): 10 ms later; the backward's was
    # queued at 300 and ran at 400.5 (host 300.5) : 0.5 ms later, the GPU had caught up.
    clocks = [("forward", None, _Event(310.0)), ("backward", None, _Event(400.5))]
    leads = PhaseTimer._host_leads(clocks, (1000_000_000, _Event(1100.0)), [200_000_000, 300_000_000])
    assert {name: pytest.approx(values) for name, values in leads.items()} == {"forward": [10.0], "backward": [0.5]}


def test_the_allocators_calls_are_counted_per_step_from_two_readings():
    before = {"num_device_alloc": 10, "num_device_free": 4, "num_sync_all_streams": 1, "allocated_bytes.all.current": 7}
    after = {"num_device_alloc": 16, "num_device_free": 4, "num_sync_all_streams": 3, "allocated_bytes.all.current": 9}
    assert allocator_per_step(before, after, 2) == {"cudaMalloc": 3.0, "cudaFree": 0.0, "syncs": 1.0}
    assert allocator_per_step({}, {}, 2) == {}  # a torch without the counters
