"""Where a profiled step's GPU time goes: a torch profiler trace summed by stream and kernel.

    python benchmarks/trace_summary.py trace_plain.json trace_sdp4bit.json --steps 3

For each trace (a Chrome trace from `torch.profiler`, such as `emulated_network.py --profile`
writes; `.json` or `.json.gz`), the GPU work (kernels, copies, sets) is summed per stream and per
kernel name, in milliseconds per step (the trace's total divided by --steps). A stream's "busy"
is the union of its intervals, so it is the time that stream kept the GPU occupied. With two or
more traces, a table gives each kernel name's time per step in each, largest difference first:
what one configuration adds to another's compute stream.

Beside the waits: the matrix kernels (--matrix, a name pattern) of each trace's compute stream
are paired in order with the first trace's (the reference: a step with no emulated network),
and each pair's time ratio is reported apart for the kernels that ran beside a --beside kernel
(the emulation's waits, on other streams) and for those that did not: whether the instrument
slows the work it measures.

With --gaps MS: the network link's idle gaps of MS or more (between the waits of the stream that
waits longest, the NIC's lane across nodes), each with what the compute stream ran meanwhile:
where, in the step, the network waits for the GPU. With --idle MS: the compute stream's idle
gaps, with what the other streams ran meanwhile: a gap they fill waits for an exchange's kernels,
a gap they leave empty waits for the host; and how much of the gaps waited for the host to queue
the work that ends them (from each kernel's launch call in the trace). If the trace recorded the
host's Python calls (`emulated_network.py --profile-python`), it also says where the host was in
those gaps: per function, and per the innermost frame of this repository's code.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import itertools
import json
import re
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def trace_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def gpu_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") in GPU_CATEGORIES]


def python_calls(events: list[dict]) -> list[dict]:
    """The host's Python calls (a trace recorded with_stack: emulated_network.py --profile-python)
    on the thread that made most of them: the training loop's."""
    calls = [e for e in events if e.get("cat") == "python_function"]
    if not calls:
        return []
    main = collections.Counter(e["tid"] for e in calls).most_common(1)[0][0]
    return [e for e in calls if e["tid"] == main]


def short_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameter list (CUTLASS
    and ATen names run to hundreds of characters)."""
    name = re.sub(r"^void ", "", name.replace("(anonymous namespace)::", ""))
    name = re.sub(r"\(.*\)$", "", name)
    while "<" in name:
        stripped = re.sub(r"<[^<>]*>", "", name)
        if stripped == name:
            break
        name = stripped
    return name.strip()[:90]


def stream_of(event: dict) -> int:
    return int(event.get("args", {}).get("stream", -1))


def compute_stream(events: list[dict], matrix: re.Pattern) -> int | None:
    """The stream that runs most of the matrix kernels: the compute stream."""
    streams = collections.Counter(stream_of(e) for e in events if matrix.search(e["name"]))
    return streams.most_common(1)[0][0] if streams else None


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) intervals, overlapping or not -> the disjoint ones that cover the same time."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def covered(start: float, end: float, disjoint: list[tuple[float, float]]) -> float:
    """How much of [start, end) the `disjoint` intervals (`merged`'s, so sorted) cover, in their units."""
    total = 0.0
    for a, b in itertools.islice(disjoint, bisect.bisect_right(disjoint, start, key=lambda ab: ab[1]), None):
        if a >= end:
            break
        total += min(end, b) - max(start, a)
    return total


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Microsecond (start, end) intervals -> the milliseconds they cover together."""
    return sum(end - start for start, end in merged(intervals)) / 1e3


def summarize(events: list[dict], steps: int) -> dict[int, dict]:
    """Stream -> {"busy_ms", "sum_ms", "kernels": {name: (ms per step, launches per step)}}."""
    by_stream: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_stream[stream_of(e)].append(e)
    out = {}
    for stream, items in sorted(by_stream.items()):
        kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for e in items:
            entry = kernels[short_name(e["name"])]
            entry[0] += e["dur"] / 1e3 / steps
            entry[1] += 1 / steps
        out[stream] = {
            "busy_ms": union_ms([(e["ts"], e["ts"] + e["dur"]) for e in items]) / steps,
            "sum_ms": sum(e["dur"] for e in items) / 1e3 / steps,
            "kernels": {k: tuple(v) for k, v in kernels.items()},
        }
    return out


def stream_table(label: str, summary: dict[int, dict], top: int) -> list[str]:
    header = "| stream | busy (ms/step) | kernel time (ms/step) | largest kernels (ms/step, launches) |"
    lines = [f"### {label}", "", header, "|---|---|---|---|"]
    for stream, s in sorted(summary.items(), key=lambda kv: -kv[1]["busy_ms"]):
        biggest = sorted(s["kernels"].items(), key=lambda kv: -kv[1][0])[:top]
        listed = "; ".join(f"{name} {ms:.2f} ({n:.0f})" for name, (ms, n) in biggest)
        lines.append(f"| {stream} | {s['busy_ms']:.2f} | {s['sum_ms']:.2f} | {listed} |")
    return lines + [""]


def difference_table(labels: list[str], summaries: list[dict[int, dict]], top: int) -> list[str]:
    """Each kernel name's time per step (all streams together) in each trace, largest spread first."""
    totals = []
    for summary in summaries:
        per_name: dict[str, float] = collections.defaultdict(float)
        for s in summary.values():
            for name, (ms, _) in s["kernels"].items():
                per_name[name] += ms
        totals.append(per_name)
    names = set().union(*totals)
    spread = {n: max(t.get(n, 0.0) for t in totals) - min(t.get(n, 0.0) for t in totals) for n in names}
    lines = ["| kernel | " + " | ".join(f"{label} (ms/step)" for label in labels) + " |"]
    lines.append("|---" * (len(labels) + 1) + "|")
    for name in sorted(names, key=lambda n: -spread[n])[:top]:
        lines.append(f"| {name} | " + " | ".join(f"{t.get(name, 0.0):.2f}" for t in totals) + " |")
    return lines + [""]


def beside_table(labels: list[str], traces: list[list[dict]], steps: int, matrix: str, beside: str) -> list[str]:
    """Per trace after the first: its kernels matching `matrix` on the stream that runs most of
    them (the compute stream), paired in order
    with the reference's; the median time ratio and the extra ms per step, for the pairs whose
    kernel ran at least 90% of its time beside a `beside` kernel (other streams) and for those
    that ran at most 10% beside one."""
    pattern = re.compile(matrix)

    def matrix_kernels(events: list[dict]) -> list[dict]:
        compute = compute_stream(events, pattern)
        chosen = [e for e in events if stream_of(e) == compute and pattern.search(e["name"])]
        return sorted(chosen, key=lambda e: e["ts"])

    reference = matrix_kernels(traces[0])
    lines = [
        f"Kernels matching `{matrix}` against {labels[0]}'s, beside `{beside}` or not:",
        "",
        "| trace | beside: kernels, median ratio, extra (ms/step) | not beside: the same |",
        "|---|---|---|",
    ]
    for label, events in zip(labels[1:], traces[1:]):
        kernels = matrix_kernels(events)
        if [e["name"] for e in kernels] != [e["name"] for e in reference]:
            lines.append(f"| {label} | its matrix kernels differ from the reference's | |")
            continue
        waits = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if beside in e["name"]])
        groups: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for ours, theirs in zip(kernels, reference):
            start, end = ours["ts"], ours["ts"] + ours["dur"]
            share = covered(start, end, waits) / max(ours["dur"], 1e-9)
            if share >= 0.9 or share <= 0.1:
                groups[share >= 0.9].append((ours["dur"], theirs["dur"]))
        cells = []
        for pairs in (groups[True], groups[False]):
            if not pairs:
                cells.append("none")
                continue
            ratios = sorted(a / b for a, b in pairs)
            extra = sum(a - b for a, b in pairs) / 1e3 / steps
            cells.append(f"{len(pairs)}, {ratios[len(ratios) // 2]:.3f}, {extra:+.2f}")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return lines + [""]


def activity_rows(gaps: list[tuple[float, float]], work: list[dict], origin: float, top: int = 3) -> list[str]:
    """A table row per gap (start, end in us): its start and length, how long `work` kept the GPU
    busy within it, and the kernels that took most of that time (all in ms)."""
    rows = []
    for start, end in gaps:
        inside: dict[str, float] = collections.defaultdict(float)
        spans = []
        for e in work:
            a, b = max(start, e["ts"]), min(end, e["ts"] + e["dur"])
            if a < b:
                inside[short_name(e["name"])] += (b - a) / 1e3
                spans.append((a, b))
        largest = sorted(inside.items(), key=lambda kv: -kv[1])[:top]
        named = "; ".join(f"{name} {ms:.2f}" for name, ms in largest) or "nothing"
        rows.append(f"| {(start - origin) / 1e3:.1f} | {(end - start) / 1e3:.2f} | {union_ms(spans):.2f} | {named} |")
    return rows


def idle_gaps(intervals: list[tuple[float, float]], min_ms: float) -> list[tuple[float, float]]:
    """The gaps of at least `min_ms` between a stream's merged busy intervals (us)."""
    busy = merged(intervals)
    return [(start, end) for (_, start), (end, _) in zip(busy, busy[1:]) if (end - start) / 1e3 >= min_ms]


def gaps_table(label: str, events: list[dict], matrix: str, beside: str, min_ms: float) -> list[str]:
    """Where the network link waits: the idle gaps of at least `min_ms` between the waits of the
    stream that waits longest on `beside` kernels (the NIC's lane across nodes), each with what
    the compute stream ran meanwhile. Times in ms from the trace's first GPU event."""
    waits_by_stream: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if beside in e["name"]:
            waits_by_stream[stream_of(e)].append(e)
    if not waits_by_stream:
        return [f"{label}: no `{beside}` kernels, no network link to follow", ""]
    link = max(waits_by_stream, key=lambda k: sum(e["dur"] for e in waits_by_stream[k]))
    gaps = idle_gaps([(e["ts"], e["ts"] + e["dur"]) for e in waits_by_stream[link]], min_ms)
    compute = compute_stream(events, re.compile(matrix))
    work = [e for e in events if stream_of(e) == compute]
    lines = [
        f"{label}: the network link (stream {link}) idle for {min_ms:g} ms or more, and the compute stream "
        f"(stream {compute}) meanwhile:",
        "",
        "| from (ms) | idle (ms) | compute busy (ms) | largest kernels in the gap (ms) |",
        "|---|---|---|---|",
    ]
    return lines + activity_rows(gaps, work, min(e["ts"] for e in events)) + [""]


# A frame of this repository's code, as the profiler names it: "PATH(LINE): FUNCTION", PATH
# absolute for the installed packages and bare for the modules of benchmarks/ (on sys.path).
_BENCHMARK_MODULES = "|".join(sorted(path.stem for path in Path(__file__).parent.glob("*.py")))
OURS = re.compile(
    rf"((^|/)(lightning_sdp4bit|strategies|kernels|examples|benchmarks)/.*|^({_BENCHMARK_MODULES}))\.py\(\d+\)"
)


def host_in_gaps(calls: list[dict], gaps: list[tuple[float, float]], steps: int, top: int = 8) -> list[str]:
    """Where the host was while the GPU waited for it: each Python call's own time (less its
    callees') within `gaps` (disjoint, us), summed per function, and per the innermost frame of
    this repository's code that was running (the engine's or the benchmark's step that the time
    belongs to). Milliseconds per step."""
    by_id = {e.get("args", {}).get("Python id"): e for e in calls}
    parent = {key: e.get("args", {}).get("Python parent id") for key, e in by_id.items()}
    # Each call's time within the gaps, once; a parent's own time is its share less its callees'.
    inside = {key: covered(e["ts"], e["ts"] + e["dur"], gaps) for key, e in by_id.items()}
    callees = collections.defaultdict(float)
    for key, share in inside.items():
        callees[parent[key]] += share
    frame_of: dict = {}

    def ours(key) -> str:
        """The innermost frame of this repository's code around call `key` (memoised: the calls
        of one step share their ancestors)."""
        if key not in frame_of:
            e = by_id.get(key)
            if e is None:
                frame_of[key] = "(no frame of this repository)"
            else:
                frame_of[key] = e["name"] if OURS.search(e["name"]) else ours(parent[key])
        return frame_of[key]

    own: dict[str, float] = collections.defaultdict(float)
    frames: dict[str, float] = collections.defaultdict(float)
    for key, share in inside.items():
        if share <= 0:
            continue
        mine = (share - callees[key]) / 1e3 / steps
        own[by_id[key]["name"]] += mine
        frames[ours(key)] += mine
    total = sum(own.values())
    lines = [f"The host's Python calls in those gaps: {total:.2f} ms a step.", ""]
    for title, table in (("function (its own time)", own), ("this repository's innermost frame", frames)):
        lines += [f"| {title} | ms per step in the gaps |", "|---|---|"]
        lines += [f"| {name[:120]} | {ms:.2f} |" for name, ms in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
        lines.append("")
    return lines


def launch_ends(events: list[dict]) -> dict[int, float]:
    """Correlation id -> when the host's call that queued that GPU work returned (us)."""
    return {
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


def waiting_for_launches(own: list[dict], gaps: list[tuple[float, float]], launched: dict[int, float]) -> float:
    """Of the compute stream's idle `gaps` (us), the part before the host had queued the work that
    ends each gap (its launch call had not returned yet): the GPU waiting for the host. The rest of
    a gap, the work was queued and its stream waited for an event of another (or the device)."""
    starting_at = {e["ts"]: e for e in own}
    total = 0.0
    for start, end in gaps:
        queued = launched.get(starting_at[end]["args"].get("correlation"), start)
        total += min(max(queued - start, 0.0), end - start)
    return total


def idle_table(
    label: str,
    events: list[dict],
    matrix: str,
    min_ms: float,
    calls: list[dict] = (),
    steps: int = 1,
    launched: dict[int, float] | None = None,
) -> list[str]:
    """Where the compute stream waits: its idle gaps of at least `min_ms`, each with what every
    other stream ran meanwhile. A gap the other streams fill is a wait for their work (an
    exchange's kernels); a gap they leave empty too is the host's (launches, a sync). With the
    host's launch calls (`launched`, launch_ends), how much of the gaps waited for them. With the
    host's Python `calls` (python_calls), where the host was in those gaps (host_in_gaps)."""
    compute = compute_stream(events, re.compile(matrix))
    if compute is None:
        return [f"{label}: no `{matrix}` kernels (a CPU run?), no compute stream to follow", ""]
    own = [e for e in events if stream_of(e) == compute]
    others = [e for e in events if stream_of(e) != compute]
    gaps = idle_gaps([(e["ts"], e["ts"] + e["dur"]) for e in own], min_ms)
    total = sum(end - start for start, end in gaps) / 1e3
    lines = [
        f"{label}: the compute stream (stream {compute}) idle for {min_ms:g} ms or more ({len(gaps)} gaps, "
        f"{total:.2f} ms in all), and the other streams meanwhile:",
        "",
        "| from (ms) | idle (ms) | other streams busy (ms) | largest kernels in the gap (ms) |",
        "|---|---|---|---|",
    ]
    lines += activity_rows(gaps, others, min(e["ts"] for e in events)) + [""]
    if launched:
        host = waiting_for_launches(own, gaps, launched) / 1e3
        lines += [
            f"Of those {total / steps:.2f} ms a step, {host / steps:.2f} ms waited for the host to queue the work "
            f"that ended the gap and {(total - host) / steps:.2f} ms had it queued, waiting for another stream's "
            "event. Where the same step unprofiled keeps the host ahead (emulated_network.py's host table), gaps "
            "that wait for the host are the profiler's own cost.",
            "",
        ]
    return lines + (host_in_gaps(calls, gaps, steps) if calls else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="steps the trace holds (phase_timer.PROFILED)")
    parser.add_argument("--top", type=int, default=6, help="kernels named per stream")
    parser.add_argument("--matrix", default="nvjet|gemm|sdpa|flash", help="name pattern of the kernels to pair")
    parser.add_argument("--beside", default="_spin_kernel", help="name of the kernels to be beside (the waits)")
    parser.add_argument("--gaps", type=float, default=None, metavar="MS", help="the link's idle gaps of MS or more")
    idle = "the compute stream's idle gaps of MS or more, with what the other streams ran meanwhile"
    parser.add_argument("--idle", type=float, default=None, metavar="MS", help=idle)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    for flag, value in (("--gaps", args.gaps), ("--idle", args.idle)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be a positive number of milliseconds, got {value}")
    for path in args.traces:
        if not path.is_file():
            parser.error(f"no trace file at {path}")
    everything = [trace_events(path) for path in args.traces]
    traces = [gpu_events(events) for events in everything]
    summaries = [summarize(events, args.steps) for events in traces]
    labels = [path.name.removesuffix(".gz").removesuffix(".json") for path in args.traces]
    lines = []
    for label, summary in zip(labels, summaries):
        lines += stream_table(label, summary, args.top)
    if len(summaries) > 1:
        lines += difference_table(labels, summaries, 4 * args.top)
        lines += beside_table(labels, traces, args.steps, args.matrix, args.beside)
    if args.gaps is not None:
        for label, events in zip(labels, traces):
            lines += gaps_table(label, events, args.matrix, args.beside, args.gaps)
    if args.idle is not None:
        for label, events, all_events in zip(labels, traces, everything):
            calls, launched = python_calls(all_events), launch_ends(all_events)
            lines += idle_table(label, events, args.matrix, args.idle, calls, args.steps, launched)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
