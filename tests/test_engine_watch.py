"""benchmarks/emulated_runs.watch_the_engine, the emulated-network benchmark's view of the engine:
- within it, each of the engine's entries the model's hooks and the step call is bracketed by its
  name, and the turn's points are marked; on leaving, even by an exception, the engine's own
  methods and torch's Stream.wait_event are back;
- on a GPU, a wait of the compute stream for another stream's event inside an engine call is
  bracketed as "stream waits", and the bracket ends only after the other stream's work (an
  order of events, not a timing); a wait outside the engine's calls, or one another stream
  makes, is not.
"""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from emulated_runs import watch_the_engine  # noqa: E402


class _Timer:
    """PhaseTimer's bracket and point, recorded in order (host clock on the CPU, events on a GPU)."""

    def __init__(self):
        self.entered, self.points, self.spans = [], [], []

    @contextlib.contextmanager
    def bracket(self, name):
        self.entered.append(name)
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((name, start, end))
        else:
            yield

    def point(self, name):
        self.points.append(name)


class _Engine:
    """The engine's entries watch_the_engine wraps, recording their calls; `wait` runs inside
    wait_weights (a stand-in for an exchange's wait)."""

    def __init__(self, device, wait=lambda: None):
        self.calls, self._wait = [], wait
        self.buckets = [type("Bucket", (), {"params": [0, 1], "weights": torch.zeros(2, device=device)})()]

    def wait_weights(self, indices=None):
        self.calls.append(("wait_weights", indices))
        self._wait()

    def on_grad_ready(self, index, position):
        self.calls.append(("on_grad_ready", index, position))

    def finish_grad_sync(self):
        self.calls.append(("finish_grad_sync",))


def test_every_entry_is_bracketed_and_the_engine_and_torch_are_restored_on_leaving():
    engine, timer = _Engine("cpu"), _Timer()
    original = torch.cuda.Stream.wait_event
    with pytest.raises(RuntimeError, match="a failing step"), watch_the_engine(engine, timer) as new_step:
        assert torch.cuda.Stream.wait_event is not original
        new_step()
        engine.wait_weights([0])
        engine.on_grad_ready(0, 0)
        engine.on_grad_ready(0, 1)
        engine.finish_grad_sync()
        raise RuntimeError("a failing step")
    assert engine.calls == [
        ("wait_weights", [0]),
        ("on_grad_ready", 0, 0),
        ("on_grad_ready", 0, 1),
        ("finish_grad_sync",),
    ]
    assert timer.entered == ["weights", "gradient hooks", "gradient hooks", "gradient finish"]
    assert timer.points == ["last_weights", "first_gradients"]  # bucket 0's weights; both its gradients
    assert torch.cuda.Stream.wait_event is original
    assert not {"wait_weights", "on_grad_ready", "finish_grad_sync"} & set(vars(engine))  # the class's own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: only a GPU's compute stream waits for other streams")
def test_a_compute_stream_wait_inside_an_engine_call_is_bracketed_until_the_other_stream_is_done():
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    done: list[torch.cuda.Event] = []

    def busy_side_stream() -> torch.cuda.Event:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(20):  # tens of ms of work
                a @ a
            done.append(torch.cuda.Event())
            done[-1].record()
        return done[-1]

    def wait_for_the_side_stream():
        torch.cuda.current_stream().wait_event(busy_side_stream())

    engine, timer = _Engine("cuda", wait_for_the_side_stream), _Timer()
    with watch_the_engine(engine, timer):
        engine.wait_weights([0])
        torch.cuda.current_stream().wait_event(busy_side_stream())  # outside the engine's calls
        with torch.cuda.stream(side):
            engine.wait_weights([0])  # inside, but the side stream's own wait for itself
    assert timer.entered == ["weights", "stream waits", "weights"]
    (waits, _, end), (call, _, _) = timer.spans[:2]  # the inner bracket ends first
    assert (waits, call) == ("stream waits", "weights")
    # The bracket ends behind the wait: by the time its end has run, the side stream's work has.
    end.synchronize()
    assert done[0].query()
    torch.cuda.synchronize()
