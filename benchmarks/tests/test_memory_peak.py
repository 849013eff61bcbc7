"""benchmarks/memory_peak.py on a hand-made allocator history: the peak is the largest sum of live
bytes after the last marker (an earlier step's higher one does not count), blocks allocated before
the history began count until the history frees them, and what is alive at the peak is grouped by
the repository's frames of each allocation's stack; no marker is an error that says to mark."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import memory_peak  # noqa: E402

MiB = 2**20


def frames(*names):
    """A stack, innermost first: a torch frame, then ours."""
    return [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}] + [
        {"filename": f"/repo/lightning_sdp4bit/{name}.py", "line": 10, "name": name} for name in names
    ]


def alloc(addr, size, *names):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames(*names)}


def free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size}


def marker(addr):
    return [alloc(addr, memory_peak.MARK_BYTES), free(addr, memory_peak.MARK_BYTES)]


def test_the_peak_of_the_last_step_and_what_was_alive_at_it():
    events = [
        *marker(1),
        alloc(10, 500 * MiB, "step_one"),  # the first step's higher peak: not this step's
        free(10, 500 * MiB),
        alloc(11, 40 * MiB, "kept"),  # alive across steps
        *marker(2),
        free(99, 30 * MiB),  # allocated before the history began (100 MiB of them)
        alloc(12, 64 * MiB, "node_shards", "gather"),
        alloc(13, 4 * MiB, "node_shards", "gather"),
        free(13, 4 * MiB),
        alloc(14, 8 * MiB, "engine"),  # the peak: 70 + 40 + 64 + 8 MiB
        free(12, 64 * MiB),
        alloc(15, 32 * MiB, "engine"),
    ]
    result = memory_peak.breakdown(events, before_bytes=100 * MiB)
    assert result["peak_bytes"] == (70 + 40 + 64 + 8) * MiB
    assert result["peak_made_by"] == "engine.py:10 engine"
    assert dict(result["groups"]) == {
        "allocated before recording": 70 * MiB,
        "this step: node_shards.py:10 node_shards < gather.py:10 gather": 64 * MiB,
        "earlier: kept.py:10 kept": 40 * MiB,
        "this step: engine.py:10 engine": 8 * MiB,
    }
    table = memory_peak.format_breakdown("6.7B node", result)
    assert "peak 0.178 GiB" in table
    assert "| 0.062 | this step: node_shards.py:10 node_shards < gather.py:10 gather |" in table


def test_a_history_without_a_marker_is_refused():
    with pytest.raises(ValueError, match="call mark"):
        memory_peak.breakdown([alloc(1, MiB, "engine")])
