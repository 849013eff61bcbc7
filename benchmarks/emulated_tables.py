"""The emulated-network benchmark's Markdown tables: one per model and scenario.

Columns: the step; the compute-only step (the same run with no wait); the busy time of each lane;
step / max(compute-only, busiest link); speed against the engine's baseline and the overlapped
DDP (>1 is faster); peak memory since the phase began. The DDP rows are computed, not measured:
the plain step and a bf16 all-reduce of every gradient at the link's rate.
"""

from __future__ import annotations

import math

from phase_timer import Phase


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def scenario_table(model: str, scenario: Phase, plain: dict, runs: dict[str, dict], args, plain_last: dict) -> str:
    """`runs`: row -> {"compute": result, scenario.name: result} for the scenario's topology;
    `plain_last`: the plain step measured again after every row (the run's drift)."""
    world, one_node = args.world, scenario.name == "nvlink"
    world_gbs = scenario.nvlink_gbs if one_node else scenario.nic_gbs
    ddp_comm = 2 * (world - 1) / world * 2 * plain["params"] / world_gbs / 1e6  # ms
    ddp_ideal = max(plain["step_ms"], ddp_comm)
    baseline = runs.get("baseline", {}).get(scenario.name, {}).get("step_ms", math.nan)
    zero = {"intra": 0.0, "inter": 0.0, "world": 0.0, "nvlink": 0.0, "nic": 0.0}
    rows = [
        ("plain (no strategy)", plain["step_ms"], plain["step_ms"], zero, plain["peak_gib"]),
        ("plain, again after every row", plain_last["step_ms"], plain_last["step_ms"], zero, plain_last["peak_gib"]),
        ("DDP, overlapped", ddp_ideal, plain["step_ms"], {**zero, "world": ddp_comm}, math.nan),
        ("DDP, not overlapped", plain["step_ms"] + ddp_comm, plain["step_ms"], {**zero, "world": ddp_comm}, math.nan),
    ]
    hierarchical = None if one_node else _hierarchical_ddp(scenario, plain, args)
    if hierarchical is not None:
        busy = {**zero, "intra": hierarchical[0], "inter": hierarchical[1]}
        step = max(plain["step_ms"], *hierarchical)
        rows.append(("DDP, two-level all-reduce, overlapped", step, plain["step_ms"], busy, math.nan))
    notes = []
    for row, result in runs.items():
        measured = result[scenario.name]
        rows.append((row, measured["step_ms"], result["compute"]["step_ms"], measured["busy_ms"], measured["peak_gib"]))
        if row.startswith("Trainer"):
            notes.append(f"{row}: {measured['lightning_ops']:.1f} Lightning collectives per step")
    lines = [
        f"#### {model}, {scenario.name}: {_describe(scenario, args)}",
        "",
        "| row | step (ms) | compute-only (ms) | busy intra / inter / world (ms) | step / max(compute, link) "
        "| x baseline | x ideal DDP | peak (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, step, compute, busy, peak in rows:
        link = (
            max(busy["world"], busy["intra"], busy["inter"])
            if name.startswith("DDP")
            else max(busy["nvlink"], busy["nic"])
        )
        lanes = " / ".join(_fmt(busy[k]) for k in ("intra", "inter", "world"))
        lines.append(
            f"| {name} | {_fmt(step)} | {_fmt(compute)} | {lanes} | {_fmt(step / max(compute, link), 2)} "
            f"| {_fmt(baseline / step, 2)} | {_fmt(ddp_ideal / step, 2)} | {_fmt(peak, 2)} |"
        )
    lines += [
        "",
        f"DDP: {plain['params'] / 1e6:.0f}M bf16 gradients all-reduced, {ddp_comm:.1f} ms at {world_gbs:g} GB/s. "
        "The link bound charges the world lane to the link it crosses (NVLink on one node, else the NIC).",
        f"The plain step took {plain['step_ms']:.1f} ms before the other rows and {plain_last['step_ms']:.1f} ms "
        "after them: rows closer than that drift are even.",
        *([] if hierarchical is None else [_HIERARCHICAL_NOTE]),
        *notes,
        "",
    ]
    return "\n".join(lines)


_HIERARCHICAL_NOTE = (
    "The DDP rows above charge the flat ring's every byte to each GPU's NIC share, as the world lane does; "
    "a ring or two-level all-reduce puts only 1/L of them on each NIC. The two-level row: reduce-scatter "
    "and all-gather inside the node (NVLink), all-reduce of each GPU's 1/L across nodes (NIC), pipelined; "
    "x ideal DDP stays against the flat one."
)


def _hierarchical_ddp(scenario: Phase, plain: dict, args) -> tuple[float, float]:
    """(NVLink ms, NIC ms) of a two-level bf16 all-reduce of every gradient, per GPU."""
    local, nodes = args.ranks_per_node, args.world // args.ranks_per_node
    nbytes = 2 * plain["params"]
    intra = 2 * (local - 1) / local * nbytes / scenario.nvlink_gbs / 1e6
    inter = 2 * (nodes - 1) / nodes * nbytes / local / scenario.nic_gbs / 1e6
    return intra, inter


def _describe(scenario: Phase, args) -> str:
    if scenario.name == "nvlink":
        return f"one node of {args.world} GPUs, NVLink {scenario.nvlink_gbs:g} GB/s per GPU"
    nodes = args.world // args.ranks_per_node
    return (
        f"{nodes} nodes x {args.ranks_per_node} GPUs, NIC {scenario.nic_gbs:g} GB/s per GPU "
        f"({scenario.nic_gbs * 8:g} Gb/s), NVLink {scenario.nvlink_gbs:g} GB/s"
    )
