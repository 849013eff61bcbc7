"""A/B of engine versions on the emulated network: this checkout's benchmark, several package trees.

Prepare one source tree per version here, carry them to the GPU machine, run there:

    mkdir -p .ab/before .ab/after && git archive 8245186 | tar x -C .ab/before && git archive HEAD | tar x -C .ab/after
    python3 benchmarks/engine_ab.py --out ab8 .ab/before .ab/after -- --world 8 --ranks-per-node 4 \\
        --model 1.3b --presets sdp4bit --trainer-presets none --scenarios eth100 --steps 5 --warmup 2

Each tree is installed on its own (`pip install --no-deps --target`), and each run is a fresh
process of this checkout's `emulated_network.py` (the arguments after `--`, plus `--repeats 1
--json`) with that install first on the path: only the engine differs, and the script checks
that each run imported its own tree. Rounds run every tree once, forwards then backwards in
turn, so that a drift of the machine falls on every tree alike; a tree's Nth run is
`emulated_network.py`'s round N (`--first-round`), so that the plain row, which each run measures
beside the engine's, does not always run first. A run that would start after
--budget-s seconds is skipped, so that one device call brings back what it has. Each run's
tables and raw JSON go to --out; the summary printed at the end gives, per tree, the median and
min-max over its runs of each engine row's step, compute-only step, compute-only step over the
same run's plain step, and the host's lead on the GPU at the end of the backward, and how many
runs were bound by the host (less than 10 ms ahead there: the step followed the host's speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_args import at_least
from emulated_tables import ENGINE_BRACKETS, HOST_BOUND_MS

HERE = Path(__file__).resolve().parent


def install(tree: Path, target: Path) -> None:
    """The package of `tree` into `target` alone (no dependencies: the machine's own are used)."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "--target", str(target), str(tree)], check=True, stdout=subprocess.DEVNULL)
    found = subprocess.run(
        [sys.executable, "-c", "import lightning_sdp4bit; print(lightning_sdp4bit.__file__)"],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=HERE,  # as the benchmark runs: its own folder first on the path, not the checkout
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not found.startswith(str(target)):
        raise SystemExit(f"engine_ab: the install of {tree} is shadowed: lightning_sdp4bit came from {found}")


def summary(results: dict[str, list[dict]]) -> str:
    """Markdown: per tree, engine row, topology and scenario, the median (min-max) over its runs of
    the step, the compute-only step, that over the same run's plain step, and the host's lead at
    the end of the backward; how many runs were bound by the host (a lead under HOST_BOUND_MS at
    the end of the backward), with the network on and compute-only; and, from runs with
    `--brackets on` (whose events cost the step: run the timed A/B without), the medians of the
    compute stream's ms within the engine's calls, compute-only (ENGINE_BRACKETS)."""
    lines = [
        "| tree | row | scenario | runs | step (ms) | compute-only (ms) | compute-only / plain "
        "| host ahead at the end of backward (ms) | runs bound by the host: network / compute-only "
        f"| compute-only, within the engine's calls: {' / '.join(ENGINE_BRACKETS)} (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tree, documents in results.items():
        cells: dict[tuple[str, str], list[tuple[float, ...]]] = {}
        brackets: dict[tuple[str, str], list[dict[str, float]]] = {}
        for document in documents:
            plain = next((run["step_ms"] for run in document["runs"] if run["row"] == "plain"), math.nan)
            for run in document["runs"]:
                scenarios = [key for key, value in run.items() if isinstance(value, dict) and key != "compute"]
                for scenario in scenarios if run["row"] != "plain" else []:
                    lead = _backward_lead(run[scenario])
                    row = f"{run['row']}, {run['topology']}" if run["topology"] else run["row"]
                    compute = run["compute"]["step_ms"]
                    figures = (run[scenario]["step_ms"], compute, compute / plain, lead, _backward_lead(run["compute"]))
                    cells.setdefault((row, scenario), []).append(figures)
                    brackets.setdefault((row, scenario), []).append(run["compute"].get("brackets_ms") or {})
        for (row, scenario), figures in cells.items():
            columns = [[f[i] for f in figures if not math.isnan(f[i])] for i in range(5)]
            text = [_median_and_range(c, "{:.1f}") for c in columns[:2]]
            text += [_median_and_range(columns[2], "{:.3f}"), _median_and_range(columns[3], "{:.1f}")]
            bound = [f"{sum(lead < HOST_BOUND_MS for lead in c)} of {len(c)}" if c else "-" for c in columns[3:]]
            watched = [b for b in brackets[row, scenario] if b]
            within = [_median_and_range([b.get(name, 0.0) for b in watched], "{:.2f}") for name in ENGINE_BRACKETS]
            cells_text = " | ".join([*text, " / ".join(bound), " / ".join(within) if watched else "-"])
            lines.append(f"| {tree} | {row} | {scenario} | {len(figures)} | {cells_text} |")
    return "\n".join(lines)


def _backward_lead(phase: dict) -> float:
    return (phase.get("host_lead_ms") or {}).get("backward", math.nan)


def _median_and_range(values: list[float], form: str) -> str:
    if not values:
        return "-"
    low, middle, high = (form.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{middle} ({low}-{high})"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees of the package, one per version")
    parser.add_argument("--out", type=Path, required=True, help="folder for each run's tables and JSON")
    parser.add_argument("--rounds", type=at_least(1), default=3, help="runs of every tree (default 3)")
    parser.add_argument(
        "--budget-s", type=at_least(0, float), default=480.0, help="start no run after this many seconds"
    )
    args = parser.parse_args(ours)
    names = [tree.resolve().name for tree in args.trees]
    for tree in args.trees:
        if not (tree / "pyproject.toml").is_file():
            parser.error(f"{tree} is not a source tree of the package: it has no pyproject.toml")
    if len(set(names)) != len(names):
        parser.error(f"the trees' folder names name their rows and must differ: {names}")
    if {"--repeats", "--json", "--first-round"} & set(theirs):
        parser.error("engine_ab sets --repeats 1, --first-round and --json itself: leave them out after --")
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="engine_ab_") as scratch:
        sites = {name: Path(scratch) / name for name in names}
        for tree, name in zip(args.trees, names, strict=True):
            install(tree.resolve(), sites[name])
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                if time.monotonic() - start > args.budget_s:
                    print(f"budget spent: skipped {name}, round {round_ + 1}", file=sys.stderr)
                    continue
                stem = args.out / f"{name}_{round_ + 1}"
                # Round N of emulated_network's order, so that the plain row does not always run first.
                command = [sys.executable, str(HERE / "emulated_network.py"), *theirs, "--repeats", "1"]
                command += ["--first-round", str(round_)]
                with open(f"{stem}.md", "w") as printed:
                    subprocess.run(
                        [*command, "--json", f"{stem}.json"],
                        env={**os.environ, "PYTHONPATH": str(sites[name])},
                        stdout=printed,
                        stderr=subprocess.STDOUT,
                        check=True,
                    )
                results[name].append(json.loads(Path(f"{stem}.json").read_text()))
    print(summary(results))


if __name__ == "__main__":
    main()
