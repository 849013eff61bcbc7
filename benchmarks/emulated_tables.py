"""The emulated-network benchmark's Markdown tables: one per model and scenario.

Every measured row was run `--repeats` times, interleaved with the other rows; a table shows the
median step, its min-max and its spread ((max - min) / median), and lists the rows whose spread
is above SPREAD_LIMIT. Columns: the step; the compute-only step (the same run with no wait); the
busy time of each lane, and how much of all lanes' busy time was per-message latency; step /
max(compute-only, busiest link); speed against the engine's baseline, the overlapped DDP and the
two-level DDP in its step's order (>1 is faster); peak memory since the phase began. Every derived
column is computed from medians. The DDP rows are computed, not measured: the plain step and a
bf16 all-reduce of every gradient at the link's rate, in DDP's 25 MiB buckets, each paying the
latency of its steps as the emulation charges them (emulation.latency_ns). Overlapped, they
assume the gradients cross during the whole step, the forward included, which no DDP does: its
optimizer needs every gradient, and the next forward follows it. The row in its order
(`ddp_step_bound`) lets them cross during the backward and after it only.

`segment_table`: where each engine row's step goes (phase_timer.SEGMENTS), against the bound
that the step's order sets (`step_bound`). The weights can cross a link only after the optimizer
step, which needs every gradient (clipping takes their global norm); the forward computes nothing
before the first bucket it needs has crossed, and the last bucket's gradients cannot cross before
the backward ends. That bucket is the same one (the first layers and the embedding: 9% of the
1.3B GPT's elements, as its embedding is tied to the output layer). Between the last bucket the
forward needs and the first whose gradients the backward completes lies the turn (the last
layers, the output layer and the loss, forward and backward), when the link has nothing to send.
max(compute, link) ignores all four.

`host_table`: whether the host kept ahead of the GPU. The slowest timed step against the median
one (a single host stall, such as a garbage collector's full pass, shows there); how far ahead
of the GPU the host queued the end of each segment (near 0: the GPU waited for the host's
launches); the garbage collector's passes while the phases were timed; and the caching
allocator's cudaMalloc, cudaFree and synchronisations of every stream (each stalls the host or
the GPU; none is expected once the allocator has warmed up).
"""

from __future__ import annotations

import math
import statistics

from emulation import latency_ns
from phase_timer import ALLOCATOR_CALLS, SEGMENTS, Phase

SPREAD_LIMIT = 0.03  # the targets ask about differences of ~3%: a row that moves more cannot show them
# A run whose host ends the backward closer than this to the GPU ran at the host's pace: at 1.3B, 2 x 4
# on the H200 such runs read 170-231 ms against 156-158 ms for runs whose host stayed 28-47 ms ahead
# (results/emulated_network_h200_2026-12-03.md).
HOST_BOUND_MS = 10.0
LANES = ("intra", "inter", "world", "nvlink", "nic", "latency")
EXCHANGES = ("nvlink_weights", "nic_weights", "nvlink_gradients", "nic_gradients")
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
DDP_IN_ORDER = "DDP, two-level all-reduce, in its order"


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def spread(steps: list[float]) -> float:
    """(max - min) / median of one row's steps: 0 for one run."""
    return (max(steps) - min(steps)) / statistics.median(steps)


def _medians(results: list[dict], key: str, names) -> dict[str, float]:
    """name -> the median over `results` of result[key][name], a missing one counting as 0."""
    return {n: statistics.median(r.get(key, {}).get(n, 0.0) for r in results) for n in names}


def _summary(name: str, repeats: list[dict], compute: list[dict]) -> dict:
    """One measured row from its repeats: `repeats` the scenario's results, `compute` the
    compute-only phase's (the same for the plain row)."""
    return {
        "name": name,
        "steps": [r["step_ms"] for r in repeats],
        "compute": statistics.median(r["step_ms"] for r in compute),
        "busy": _medians(repeats, "busy_ms", LANES),
        "peak": max(r["peak_gib"] for r in repeats),
    }


def scenario_table(model: str, scenario: Phase, plain: list[dict], runs: dict[str, list[dict]], args) -> str:
    """`plain`: the plain row's repeats; `runs`: row -> its repeats, each {"compute": result,
    scenario.name: result}, for the scenario's topology."""
    world, one_node = args.world, scenario.name == "nvlink"
    world_gbs = scenario.nvlink_gbs if one_node else scenario.nic_gbs
    params = plain[0]["params"]
    plain_ms = statistics.median(p["step_ms"] for p in plain)
    buckets = math.ceil(2 * params / DDP_BUCKET_BYTES)
    nodes = 1 if one_node else world // args.ranks_per_node
    ddp_latency = buckets * _latency_ms("all_reduce", world, nodes, scenario)
    ddp_comm = 2 * (world - 1) / world * 2 * params / world_gbs / 1e6 + ddp_latency  # ms
    ddp_ideal = max(plain_ms, ddp_comm)
    zero = dict.fromkeys(LANES, 0.0)
    rows = [_summary("plain (no strategy)", plain, plain)]
    computed = [
        ("DDP, overlapped", ddp_ideal, {**zero, "world": ddp_comm, "latency": ddp_latency}),
        ("DDP, not overlapped", plain_ms + ddp_comm, {**zero, "world": ddp_comm, "latency": ddp_latency}),
    ]
    hierarchical = None if one_node else _hierarchical_ddp(scenario, params, args)
    in_order = math.nan  # the two-level DDP's step in its order, where the plain row marked its segments
    if hierarchical is not None:
        busy = {**zero, "intra": hierarchical[0], "inter": hierarchical[1], "latency": hierarchical[2]}
        computed.append(("DDP, two-level all-reduce, overlapped", max(plain_ms, *hierarchical[:2]), busy))
        if all(p.get("segments_ms") for p in plain):
            in_order = ddp_step_bound(_medians(plain, "segments_ms", SEGMENTS), *hierarchical[:2])
            computed.append((DDP_IN_ORDER, in_order, busy))
    rows += [{"name": n, "steps": [step], "compute": plain_ms, "busy": b, "peak": math.nan} for n, step, b in computed]
    notes = []
    for row, repeats in runs.items():
        rows.append(_summary(row, [r[scenario.name] for r in repeats], [r["compute"] for r in repeats]))
        if row.startswith("Trainer"):
            ops = statistics.median(r[scenario.name]["lightning_ops"] for r in repeats)
            notes.append(f"{row}: {ops:.1f} Lightning collectives per step")
    medians = {r["name"]: statistics.median(r["steps"]) for r in rows}
    lines = [
        f"#### {model}, {scenario.name}: {_describe(scenario, args)}",
        "",
        "| row | step (ms) | min-max (ms) | spread | compute-only (ms) | busy intra / inter / world (ms) "
        "| of which latency (ms) | step / max(compute, link) | x baseline | x ideal DDP "
        "| x two-level DDP in its order | peak (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        name, busy, step = row["name"], row["busy"], statistics.median(row["steps"])
        ddp = name.startswith("DDP")
        link = max(busy["world"], busy["intra"], busy["inter"]) if ddp else max(busy["nvlink"], busy["nic"])
        lanes = " / ".join(_fmt(busy[k]) for k in ("intra", "inter", "world"))
        low_high = "-" if ddp else f"{_fmt(min(row['steps']))}-{_fmt(max(row['steps']))}"
        spread_pct = "-" if ddp else f"{100 * spread(row['steps']):.1f}%"
        lines.append(
            f"| {name} | {_fmt(step)} | {low_high} | {spread_pct} | {_fmt(row['compute'])} | {lanes} "
            f"| {_fmt(busy['latency'], 2)} "
            f"| {_fmt(step / max(row['compute'], link), 2)} | {_fmt(_baseline_of(name, medians) / step, 2)} "
            f"| {_fmt(ddp_ideal / step, 2)} | {_fmt(in_order / step, 2)} | {_fmt(row['peak'], 2)} |"
        )
    lines += [
        "",
        f"DDP: {params / 1e6:.0f}M bf16 gradients all-reduced in {buckets} buckets, {ddp_comm:.1f} ms at "
        f"{world_gbs:g} GB/s ({ddp_latency:.2f} ms of it latency). "
        "The link bound charges the world lane to the link it crosses (NVLink on one node, else the NIC).",
        _spread_note([r for r in rows if not r["name"].startswith("DDP")], len(plain)),
        *([] if hierarchical is None else [_HIERARCHICAL_NOTE]),
        *notes,
        "",
    ]
    return "\n".join(lines)


def ddp_step_bound(plain: dict[str, float], nvlink_ms: float, nic_ms: float) -> float:
    """The least a DDP step can take in its order, in ms, from the plain step's segments: its
    gradients all-reduce during the backward (`nvlink_ms` and `nic_ms` on each link), and the
    optimizer needs all of them, so nothing crosses during the forward or the optimizer:
    forward + max(backward, busiest link) + optimizer. `step_bound` with no weights to move and
    no end bucket (at least DDP's last bucket, the first layers', crosses after the backward):
    a bound in DDP's favour."""
    busy = {"nvlink_weights": 0.0, "nic_weights": 0.0, "nvlink_gradients": nvlink_ms, "nic_gradients": nic_ms}
    return step_bound(plain, busy, 0.0)


def step_bound(
    compute: dict[str, float], busy: dict[str, float], end_share: float, tail: float = 0.0, head: float = 0.0
) -> float:
    """The least a step can take given its order, in ms: `compute` the compute-only segments,
    `busy` the links' busy time by purpose, `end_share` the elements' share of the bucket at both
    ends (the first the forward needs, the last whose gradients are final), whose link time is
    taken as that share of its purpose's (compression works per element); `tail` the forward's
    compute after it waits for its last bucket, `head` the backward's before its first bucket's
    gradients are complete (the turn, when the link has nothing to send):

        max(s W + forward, W + tail) + max(backward + s G, head + G) + optimizer,

    W and G the busiest link's time for weights and for gradients."""
    weights = max(busy["nvlink_weights"], busy["nic_weights"])
    gradients = max(busy["nvlink_gradients"], busy["nic_gradients"])
    forward = max(end_share * weights + compute["forward"], weights + tail)
    backward = max(compute["backward"] + end_share * gradients, head + gradients)
    return forward + backward + compute["optimizer"]


def _by_row(scenario: Phase, plain: tuple[list, list], runs: dict[str, list[dict]]) -> dict[str, tuple[list, list]]:
    """Row name -> (its repeats' results in the scenario's phase, in the compute-only phase);
    `plain`: the plain row's pair."""
    measured = {"plain (no strategy)": plain}
    measured.update({row: ([r[scenario.name] for r in rs], [r["compute"] for r in rs]) for row, rs in runs.items()})
    return measured


def segment_table(model: str, scenario: Phase, plain: list[dict], runs: dict[str, list[dict]]) -> str:
    """Where the step goes, for the plain row and the engine and Trainer rows that marked their
    segments (runs written before segments were timed, or before the Trainer's were, did not). A
    link that a row does not use (the plain row's) counts as busy 0 ms (`_medians`)."""

    lines = [
        "| row | forward (ms) | backward + gradient wait (ms) | clip + optimizer (ms) "
        "| compute-only: forward / backward / optimizer (ms) | weights on NVLink / NIC (ms) "
        "| gradients on NVLink / NIC (ms) | network link idle in forward / backward / optimizer (ms) "
        "| end bucket | the turn: forward tail / backward head (ms) | bound from the step's order (ms) "
        "| step / that bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    measured = _by_row(scenario, (plain, plain), runs)
    for name, (results, compute_results) in measured.items():
        if not all(r.get("segments_ms") for r in results + compute_results):
            continue
        segments = _medians(results, "segments_ms", SEGMENTS)
        compute = _medians(compute_results, "segments_ms", SEGMENTS)
        busy = _medians(results, "busy_ms", EXCHANGES)
        idle = "-"
        if all(r.get("link_idle_ms") for r in results):
            idle = " / ".join(_fmt(v) for v in _medians(results, "link_idle_ms", SEGMENTS).values())
        share = statistics.median(r.get("end_bucket_share", 0.0) for r in results)
        turn = "-"
        tail = head = 0.0
        if all({"last_weights", "first_gradients"} <= set(r.get("points_ms", {})) for r in compute_results):
            tail = -statistics.median(r["points_ms"]["last_weights"] for r in compute_results)
            head = statistics.median(r["points_ms"]["first_gradients"] for r in compute_results)
            turn = f"{_fmt(tail)} / {_fmt(head)}"
        bound = step_bound(compute, busy, share, tail, head)
        step = statistics.median(r["step_ms"] for r in results)
        lines.append(
            f"| {name} | {' | '.join(_fmt(segments[n]) for n in SEGMENTS)} "
            f"| {' / '.join(_fmt(compute[n]) for n in SEGMENTS)} "
            f"| {_fmt(busy['nvlink_weights'])} / {_fmt(busy['nic_weights'])} "
            f"| {_fmt(busy['nvlink_gradients'])} / {_fmt(busy['nic_gradients'])} | {idle} "
            f"| {100 * share:.1f}% | {turn} | {_fmt(bound)} "
            f"| {_fmt(step / bound, 2)} |"
        )
    if len(lines) == 2:
        return ""
    note = (
        "Medians: forward from the previous step's end to the loss, the wait for the weights included; backward "
        "to the gradients being final; then clip, optimizer and the launch of the weight all-gathers. The bound: "
        "the weights move only after the optimizer step, which needs every gradient; the forward starts once the "
        "end bucket (its share of the elements: the first the forward needs, the last the backward finishes) has "
        "crossed, and that bucket's gradients cross after the backward; the forward still computes after its last "
        "bucket has crossed (its tail), and the backward before its first bucket's gradients are complete (its "
        "head), both in the compute-only phase: max(s W + forward, W + tail) + max(backward + s G, head + G) + "
        "optimizer, W and G the busiest link's time for weights and gradients, s the end bucket's share. "
        "Network link idle: within each segment, the time no wait of the network link's lanes (the NIC across "
        "nodes, NVLink on one node) was running: where the network waits for the GPU."
    )
    return "\n".join([f"#### {model}, {scenario.name}: where the step goes", "", *lines, "", note, ""])


def _collector(results: list[dict]) -> tuple[float, float, float]:
    """The garbage collector's full passes, all its passes and its ms, per timed step, over the
    repeats."""
    return (
        statistics.fmean(r["gc_passes"][2] for r in results),
        statistics.fmean(sum(r["gc_passes"]) for r in results),
        statistics.fmean(r["gc_ms"] for r in results),
    )


def _allocator(results: list[dict]) -> str:
    """The allocator's calls per timed step over the repeats (phase_timer.ALLOCATOR_CALLS; "-" for
    a counter this torch does not keep); "-" where a run has none (the CPU, --json files from
    before)."""
    if not all(r.get("allocator") for r in results):
        return "-"
    means = (statistics.fmean(r["allocator"].get(name, math.nan) for r in results) for name in ALLOCATOR_CALLS.values())
    return " / ".join(_fmt(mean) for mean in means)


def _host_cells(results: list[dict]) -> tuple[str, str, str, str]:
    """One phase's cells of host_table: the slowest step / the median, the host's lead at each
    segment's end, the collector's passes, the allocator's calls; "-" for a phase the row did not
    run."""
    if not results:
        return "-", "-", "-", "-"
    steps = [step for r in results for step in r["steps_ms"]]
    leads = _medians(results, "host_lead_ms", SEGMENTS) if all(r["host_lead_ms"] for r in results) else {}
    full, every, ms = _collector(results)
    return (
        _fmt(max(steps) / statistics.median(steps), 2),
        " / ".join(_fmt(v, 2) for v in leads.values()) or "-",
        f"{full:.2f} / {every:.2f} ({ms:.1f})",
        _allocator(results),
    )


def host_table(model: str, scenario: Phase, plain: list[dict], runs: dict[str, list[dict]]) -> str:
    """Per row that timed its steps one by one (phase_timer's steps_ms; not the runs of --json
    files written before): in the scenario's phase and the compute-only one, the slowest step
    against the median, the host's lead over the GPU at each segment's end (medians) and the
    garbage collector's passes and the allocator's calls. The plain row has only the compute-only
    phase."""
    lines = [
        "| row | slowest step / median: network / compute-only | host ahead of the GPU at the end of forward / "
        "backward / optimizer: network (ms) | the same: compute-only (ms) | collector's passes per timed step, "
        "full / all (their ms): network; compute-only | allocator per timed step, cudaMalloc / cudaFree / "
        "syncs: network; compute-only |",
        "|---|---|---|---|---|---|",
    ]
    measured = _by_row(scenario, ([], plain), runs)
    for name, phases in measured.items():
        if not all(r.get("steps_ms") for results in phases for r in results):
            continue
        network, compute = (_host_cells(results) for results in phases)
        lines.append(
            f"| {name} | {network[0]} / {compute[0]} | {network[1]} | {compute[1]} | {network[2]}; {compute[2]} "
            f"| {network[3]}; {compute[3]} |"
        )
    if len(lines) == 2:
        return ""
    bound = _host_bound_runs(measured)
    note = (
        "Host ahead: how long after the host queued a segment's end the GPU ran it (median over the timed steps; "
        "the two clocks tied together on an idle GPU at the end of each phase). Near 0, the GPU had caught up and "
        "waited for the host's launches. A single slow step (a stall of the host, such as a full pass of the "
        "garbage collector) shows as the slowest step well above the median. Allocator: the caching allocator's "
        "calls that stall the host or the GPU (a cudaFree waits for the whole GPU; a sync of every stream follows a "
        "failed cudaMalloc), per timed step."
    )
    return "\n".join([f"#### {model}, {scenario.name}: the host", "", *lines, "", note, *bound, ""])


def _host_bound_runs(measured: dict[str, tuple[list, list]]) -> list[str]:
    """A note naming, per row and phase, the runs whose host ended the backward within
    HOST_BOUND_MS of the GPU (the medians above hide a minority of them); none if there are none."""
    counts = []
    for name, phases in measured.items():
        for label, results in zip(("network", "compute-only"), phases, strict=True):
            leads = [r["host_lead_ms"]["backward"] for r in results if r.get("host_lead_ms")]
            if bound := sum(lead < HOST_BOUND_MS for lead in leads):
                counts.append(f"{name}, {label}: {bound} of {len(leads)}")
    if not counts:
        return []
    return [
        f"Runs bound by the host (less than {HOST_BOUND_MS:g} ms ahead of the GPU at the end of the backward, so "
        f"that the step followed the host's speed, which differs between processes and machines): "
        + "; ".join(counts)
        + "."
    ]


def _baseline_of(name: str, medians: dict[str, float]) -> float:
    """The baseline row's median step for row `name`: in a sweep of bucket sizes, the baseline's at
    the same size ("sdp4bit, buckets of 4M" -> "baseline, buckets of 4M")."""
    suffix = name[name.index(", buckets of") :] if ", buckets of" in name else ""
    return medians.get("baseline" + suffix, math.nan)


def _spread_note(rows: list[dict], repeats: int) -> str:
    if repeats < 2:
        return "One run per row (--repeats 1): no spread measured, and rows a few percent apart may be even."
    wide = [f"{r['name']} ({100 * spread(r['steps']):.1f}%)" for r in rows if spread(r["steps"]) > SPREAD_LIMIT]
    head = (
        f"Each row: the median of {repeats} runs interleaved with the other rows' (every derived column from "
        f"medians). Spread above {100 * SPREAD_LIMIT:g}%: "
    )
    return head + ("; ".join(wide) + ": differences smaller than their spread are noise." if wide else "none.")


_HIERARCHICAL_NOTE = (
    "The DDP rows above charge the flat ring's every byte to each GPU's NIC share, as the world lane does; "
    "a ring or two-level all-reduce puts only 1/L of them on each NIC. The two-level row: reduce-scatter "
    "and all-gather inside the node (NVLink), all-reduce of each GPU's 1/L across nodes (NIC), pipelined; "
    "x ideal DDP stays against the flat one. Overlapped, DDP's rows assume its gradients cross during the "
    "whole step; they cross only during the backward and after it (the optimizer needs all of them, and the "
    "forward follows the optimizer), so the in-its-order row takes the plain step's forward + max(backward, "
    "busiest link) + optimizer (ddp_step_bound): the least any DDP of this network takes, as the bound from "
    "the step's order is for the engine's rows."
)


def _latency_ms(kind: str, ranks: int, nodes: int, scenario: Phase) -> float:
    """One collective's latency as the emulation charges it, in milliseconds."""
    return latency_ns(kind, ranks, nodes, 1e3 * scenario.nvlink_us, 1e3 * scenario.nic_us) / 1e6


def _hierarchical_ddp(scenario: Phase, params: int, args) -> tuple[float, float, float]:
    """(NVLink ms, NIC ms, of which latency ms) of a two-level bf16 all-reduce of every gradient
    per GPU, in DDP's buckets: inside the node, then each GPU's 1/L across nodes."""
    local, nodes = args.ranks_per_node, args.world // args.ranks_per_node
    nbytes, buckets = 2 * params, math.ceil(2 * params / DDP_BUCKET_BYTES)
    intra_latency = buckets * _latency_ms("all_reduce", local, 1, scenario)
    inter_latency = buckets * _latency_ms("all_reduce", nodes, nodes, scenario)
    intra = 2 * (local - 1) / local * nbytes / scenario.nvlink_gbs / 1e6 + intra_latency
    inter = 2 * (nodes - 1) / nodes * nbytes / local / scenario.nic_gbs / 1e6 + inter_latency
    return intra, inter, intra_latency + inter_latency


def _describe(scenario: Phase, args) -> str:
    if scenario.name == "nvlink":
        latency = f", {scenario.nvlink_us:g} us per message step" if scenario.nvlink_us else ", no latency"
        return f"one node of {args.world} GPUs, NVLink {scenario.nvlink_gbs:g} GB/s per GPU{latency}"
    nodes = args.world // args.ranks_per_node
    latency = (
        f"; latency per message step {scenario.nvlink_us:g} us over NVLink, {scenario.nic_us:g} us across nodes"
        if scenario.nvlink_us or scenario.nic_us
        else "; no latency"
    )
    return (
        f"{nodes} nodes x {args.ranks_per_node} GPUs, NIC {scenario.nic_gbs:g} GB/s per GPU "
        f"({scenario.nic_gbs * 8:g} Gb/s), NVLink {scenario.nvlink_gbs:g} GB/s{latency}"
    )
