"""Where a GPU's peak memory goes: the allocations alive at the peak of one step, grouped by the
code that made them.

torch's caching allocator records every allocation and free, with the Python stack of each
allocation, while `recording()` is on (`torch.cuda.memory._record_memory_history`; a few percent
slower, so never in a timed run). `mark()` puts a marker allocation of an unlikely size into that
history before each step; `breakdown()` replays the history, finds the largest sum of live bytes
after the last marker, and groups what was alive then by the first frames of this repository's
code (the engine, the example model, the benchmark) in the stack that allocated it. Blocks
allocated before recording began are not in the history: the caller passes their bytes
(`torch.cuda.memory_allocated()` then) and they appear as one line.

Used by `node_sharding.py --peak-profile`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

MARK_BYTES = 1_234_567 * 512  # a marker's size: a multiple of the allocator's 512-byte rounding
OURS = ("lightning_sdp4bit", "examples", "benchmarks")  # the frames a stack is named by
FRAMES = 3  # of ours, innermost first


@contextlib.contextmanager
def recording(max_entries: int = 4_000_000) -> Iterator[None]:
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def mark(device: torch.device) -> None:
    """A marker in the history: the next step starts here."""
    torch.empty(MARK_BYTES, dtype=torch.uint8, device=device)


def trace() -> list[dict]:
    """The history of the current device since recording began (allocator events, oldest first)."""
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def stack_name(frames: list[dict]) -> str:
    ours = [f for f in frames if any(part in Path(f["filename"]).parts for part in OURS)]
    chosen = ours[:FRAMES] or frames[:1]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in chosen) or "(no stack)"


def breakdown(events: list[dict], before_bytes: int = 0, top: int = 12) -> dict:
    """The peak of live bytes after the last marker in `events` and what was alive at it, grouped
    by `stack_name`. `before_bytes`: allocated before the history began (freeing one of those
    blocks, an address the history never allocated, takes its bytes off them)."""
    marks = [i for i, e in enumerate(events) if e["action"] == "alloc" and e["size"] == MARK_BYTES]
    if not marks:
        raise ValueError("no marker in the allocator's history: call mark() before the step")
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, event index of its allocation)
    older, current = before_bytes, before_bytes
    peak, peak_at, alive_at_peak, older_at_peak = -1, -1, {}, 0
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], index)
            current += event["size"]
            if index > marks[-1] and current > peak:
                peak, peak_at, alive_at_peak, older_at_peak = current, index, dict(live), older
        elif event["action"] == "free_completed":
            if event["addr"] in live:
                current -= live.pop(event["addr"])[0]
            else:  # allocated before the history began
                older -= event["size"]
                current -= event["size"]
    groups: Counter[str] = Counter({"allocated before recording": older_at_peak})
    for size, index in alive_at_peak.values():
        when = "this step" if index > marks[-1] else "earlier"
        groups[f"{when}: {stack_name(events[index].get('frames', []))}"] += size
    made_by = stack_name(events[peak_at].get("frames", []))
    return {"peak_bytes": peak, "peak_made_by": made_by, "groups": groups.most_common(top)}


def format_breakdown(title: str, result: dict) -> str:
    lines = [
        f"{title}: peak {result['peak_bytes'] / 2**30:.3f} GiB, reached by an allocation of {result['peak_made_by']}",
        "| GiB | allocated by |",
        "|---|---|",
    ]
    lines += [f"| {size / 2**30:.3f} | {name} |" for name, size in result["groups"]]
    return "\n".join(lines)
