"""benchmarks/phase_timer.py's segments, with a clock that ticks one second per reading (no timing
is measured here), and emulated_tables.step_bound.

- a step that marks "forward" and "backward" is timed in three segments that tile it: from the
  previous step's end to the forward mark, to the backward mark, to the end of the step;
- steps of the warm-up, of the settle steps and after the last phase are not counted, and a run
  whose steps mark nothing (a Trainer row) reports no segments;
- the bound from the step's order adds the larger of the forward and the weights' busiest link,
  the larger of the backward and the gradients' busiest link, and the optimizer; with an end
  bucket, the forward waits for its share of the weights' link time first, and its share of the
  gradients' crosses after the backward.
"""

import itertools
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import phase_timer  # noqa: E402
from emulated_tables import step_bound  # noqa: E402
from phase_timer import Phase, PhaseTimer  # noqa: E402

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
