"""How well the engine hides its communication, measured on ONE GPU over an emulated network.

On the H200 (from the repository root; the whole --quick run, one run per row, takes about 4 minutes):

    python3 -m pip install --no-deps --no-build-isolation -e .
    python3 benchmarks/emulated_network.py --quick --markdown emulated.md          # both models, every row
    python3 benchmarks/emulated_network.py --model 356m --markdown emulated.md     # 3 x 10 timed steps per row
    python3 benchmarks/emulated_network.py --model 356m,1.3b,6.7b --world 64 --ranks-per-node 4 \
        --scenarios ib400,eth100 --json 16x4.json                                  # 16 nodes x 4, raw runs kept
    python3 benchmarks/emulated_network.py --model 356m,1.3b,6.7b --world 64 --ranks-per-node 8 \
        --scenarios ib400 --json 8x8.json                                          # 8 nodes x 8
    python3 benchmarks/emulated_network.py --tables-from 8x8.json                  # its tables again
    python3 benchmarks/emulated_network.py --model 1.3b --presets sdp4bit --scenarios eth100 \
        --trainer-presets none --repeats 1 --profile trace.json.gz                 # one row, with a trace
    python3 benchmarks/trace_summary.py trace_1.3b_plain.json.gz trace_1.3b_sdp4bit_nodes.json.gz  # its GPU time
    python3 benchmarks/emulated_network.py --model 1.3b --presets sdp4bit --scenarios custom --link-gbps inf \
        --nvlink-gbs inf --latency-us off --trainer-presets none --repeats 1 --profile c.json.gz --profile-python
    python3 benchmarks/trace_summary.py c_1.3b_sdp4bit_nodes.json.gz --idle 0.2  # where the GPU waited for the host
    python3 benchmarks/emulated_network.py --link-gbps 200 --scenarios custom      # 200 Gb/s per GPU
    python3 benchmarks/emulated_network.py --dry-run [--model tiny-ckpt]           # CPU, tiny GPT: no timings

One GPU plays rank 0 of --world ranks, --ranks-per-node per node (benchmarks/emulation.py: every
collective becomes a loopback copy on one CUDA stream per link, then a %globaltimer wait for
bytes / bandwidth plus a latency per message step, emulation.message_steps). Models: 356m, 1.3b,
6.7b (32 x 4096, 32 heads, batch 2 x 2048 tokens), 6.7b-ckpt (the same with activation
checkpointing), tiny and tiny-ckpt (the dry run's). Scenarios (bandwidth per GPU, GB/s = 1e9
bytes/s; latency per message step, emulated_runs.SCENARIO_LATENCY_US, or --latency-us):
- nvlink: one node of --world GPUs, NVLink --nvlink-gbs (150 GB/s), 2 us;
- ib400: 400 Gb/s InfiniBand per GPU (50 GB/s) across nodes, 5 us, NVLink inside;
- eth100: 100 Gb/s per node, shared by its --ranks-per-node GPUs (3.125 GB/s each with 4), 10 us;
- custom: --link-gbps Gb/s per GPU across nodes, 8 us.
--bucket-numel 4e6,16e6,... runs every engine and Trainer row once per bucket size ("sdp4bit,
buckets of 4M"; x baseline against the baseline of the same size): how bucket count and size
trade latency against overlap.
Rows: plain (the same model and optimizer without any strategy: the floor); DDP computed from the
plain step and a bf16 ring all-reduce of every gradient, 2(W-1)/W * 2 bytes * params at the world
link's rate plus the latency of its 25 MiB buckets, perfectly overlapped (max) or not (sum); the
engine (lightning_sdp4bit.engine) driven directly per preset, and qw+ulq (ZeRO++-like: qW weights,
ULq 4-bit gradients); and "Trainer + preset": Lightning's Trainer with a SDP4BitStrategy that
believes it is rank 0 of W (EmulatedStrategy in emulated_runs.py: one process, no launcher, a real
one-rank process group), so that the adapter and Lightning's own collectives (the per-batch
SIGTERM broadcast) count too.
Repeats: the GPU's clocks drift over a run by a few percent, as much as the differences the
targets ask about. So every job (the plain row, and each row on each topology) runs --repeats
times (default 3), in rounds that run every job once, each round rotated by one more job and
odd rounds backwards (`interleave`), each run from a fresh state (emulated_runs.fresh_state: no
model, engine or strategy of an earlier run alive, the allocator back where it was and emptied).
Columns: the median step (--steps timed back to back, no synchronize between them, so all-gathers
a step leaves in flight are charged to the next), its min-max over the repeats and the spread
(max - min) / median, rows above 3% listed under the table; the compute-only step (the same run
with no wait); the busy time of each lane, and its latency part; step / max(compute-only, busiest link); speed against
the engine's baseline and the overlapped DDP (>1 is faster), all from medians; peak memory since
the phase began. --json writes every run's raw results (round, position, row, topology, phases)
with the arguments and the header; --tables-from JSON prints the same tables again from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from cli_args import at_least
from emulated_runs import (
    DRY_RUN_MODELS,
    ENGINE_ROWS,
    MODELS,
    SCENARIOS,
    SETTLE,
    fresh_state,
    run_engine,
    run_plain,
    run_trainer,
    scenario_phase,
)
from emulated_tables import host_table, scenario_table, segment_table
from emulation import LIGHTNING_LANES
from gpu_wait import spin_accuracy, spin_cost
from phase_timer import POWER_WARMUP_S, Phase

from lightning_sdp4bit.topology import Topology

T = TypeVar("T")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = f"comma list of {', '.join(MODELS)} (default: 356m,1.3b; the dry run: tiny)"
    parser.add_argument("--model", default=None, help=models)
    parser.add_argument("--world", type=int, default=8, help="ranks of the emulated job (default 8)")
    parser.add_argument("--ranks-per-node", type=int, default=4, help="GPUs per node across nodes (default 4)")
    parser.add_argument("--presets", default=",".join(ENGINE_ROWS), help="engine rows, comma list")
    parser.add_argument("--trainer-presets", default="baseline,sdp4bit", help="Trainer rows, comma list, or none")
    parser.add_argument("--scenarios", default="nvlink,ib400,eth100", help=f"comma list of {', '.join(SCENARIOS)}")
    parser.add_argument("--link-gbps", type=float, default=None, help="the custom scenario: Gb/s per GPU across nodes")
    parser.add_argument("--nvlink-gbs", type=float, default=150.0, help="NVLink GB/s per GPU (default 150)")
    lanes = "own (default): Lightning's collectives on a lane of their own, as the engine runs on communicators of"
    lanes += " its own; shared: they queue on the world lane behind the engine's (one communicator, the engine before"
    lanes += " 2026-12-01)"
    parser.add_argument("--lightning-lane", choices=LIGHTNING_LANES, default="own", help=lanes)
    buckets = "override SDP4BitConfig.bucket_numel; a comma list gives each engine and Trainer row once per size"
    parser.add_argument("--bucket-numel", default=None, help=buckets)
    latency = "latency of one message step, NVLINK,NIC microseconds, for every scenario (default: by scenario,"
    latency += " emulated_runs.SCENARIO_LATENCY_US: 2 us over NVLink, 5 over ib400, 10 over eth100); off = 0,0"
    parser.add_argument("--latency-us", default=None, help=latency)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per phase (default 10; --quick 3)")
    repeats = "runs of every row, interleaved, each from a fresh state (default 3; --quick and --dry-run 1)"
    parser.add_argument("--repeats", type=int, default=None, help=repeats)
    first = "start the interleaved order at this round (engine_ab.py runs its Nth round of processes as round N)"
    parser.add_argument("--first-round", type=at_least(0), default=0, help=first)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="few steps: every row of both models in ~4 min")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny GPT, one step: checks the script only")
    parser.add_argument("--markdown", default=None, help="also append the tables to this file")
    parser.add_argument("--json", default=None, help="also write every run's raw results (each repeat) to this file")
    again = "print the tables of a --json file again (its own arguments; nothing measured, other flags ignored)"
    parser.add_argument("--tables-from", default=None, metavar="JSON", help=again)
    parser.add_argument(
        "--profile", default=None, help="a torch profiler trace per run: PATH.json[.gz] -> PATH_<run>.json[.gz]"
    )
    python = "with --profile: record every Python call on the host too (trace_summary.py --idle then says where"
    python += " the host was while the GPU waited for it; slows the host, so only the trace is worth reading)"
    parser.add_argument("--profile-python", action="store_true", help=python)
    kernels = "with --profile: record the GPU's work only, no host events (the host stays ahead of the GPU, so the"
    kernels += " kernels run beside each other as unprofiled; trace_summary.py's kernel sums, not its --idle split)"
    parser.add_argument("--profile-kernels", action="store_true", help=kernels)
    args = parser.parse_args(argv)
    if args.tables_from:
        if not Path(args.tables_from).is_file():
            parser.error(f"--tables-from: no file {args.tables_from}")
        return args
    few = args.quick or args.dry_run
    args.steps = args.steps if args.steps is not None else 1 if args.dry_run else 3 if few else 10
    args.warmup = args.warmup if args.warmup is not None else 0 if args.dry_run else 2 if few else 3
    args.repeats = args.repeats if args.repeats is not None else 1 if few else 3
    args.settle = 0 if args.dry_run else SETTLE
    args.device = torch.device("cpu" if args.dry_run else "cuda")
    args.model = args.model or ("tiny" if args.dry_run else "356m,1.3b")
    args.models = _names(parser, "--model", args.model, MODELS)
    args.presets = _names(parser, "--presets", args.presets, ENGINE_ROWS)
    none = args.trainer_presets.strip().lower() == "none"
    args.trainer_presets = [] if none else _names(parser, "--trainer-presets", args.trainer_presets, ENGINE_ROWS)
    args.scenarios = _names(parser, "--scenarios", args.scenarios, SCENARIOS)
    if args.link_gbps is not None and "custom" not in args.scenarios:
        args.scenarios.append("custom")
    if "custom" in args.scenarios and not (args.link_gbps or 0) > 0:
        parser.error("the custom scenario needs --link-gbps, a positive number of Gb/s per GPU")
    if args.world < 2:
        parser.error(f"--world must be at least 2 (got {args.world}): one rank has nothing to communicate")
    if args.ranks_per_node < 1 or args.world % args.ranks_per_node:
        parser.error(f"--ranks-per-node={args.ranks_per_node} must divide --world={args.world}")
    if args.ranks_per_node == args.world and set(args.scenarios) - {"nvlink"}:
        parser.error(f"--ranks-per-node={args.world} is one node: the scenarios across nodes need more nodes")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or not args.nvlink_gbs > 0:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0 and --nvlink-gbs > 0")
    args.bucket_numels = _bucket_numels(parser, args.bucket_numel)
    args.latency_us = _latency(parser, args.latency_us)
    if args.dry_run and set(args.models) - set(DRY_RUN_MODELS):
        parser.error(f"--dry-run runs a tiny model on the CPU: {' or '.join(DRY_RUN_MODELS)}, not {args.model}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: this measures a GPU. Use --dry-run for a CPU check of the script (no timings)")
    if (args.profile_python or args.profile_kernels) and not args.profile:
        parser.error("--profile-python and --profile-kernels choose what the trace records: they need --profile PATH")
    if args.profile_python and args.profile_kernels:
        parser.error("--profile-python records the host's calls, --profile-kernels none of them: choose one")
    for flag, path in (("--profile", args.profile), ("--json", args.json), ("--markdown", args.markdown)):
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"{flag}: the folder of {path} does not exist")
    return args


def _names(parser, flag: str, value: str, allowed) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        parser.error(f"{flag}: {', '.join(unknown) or 'nothing'} not among {', '.join(allowed)}")
    return names


def _bucket_numels(parser, value: str | None) -> list[int | None]:
    """--bucket-numel: [None] (the config's default) or the sizes, e.g. "4e6,16e6" -> [4000000, 16000000]."""
    if value is None:
        return [None]
    try:
        sizes = [float(size) for size in value.split(",")]
    except ValueError:
        parser.error(f"--bucket-numel: {value!r} is not a comma list of element counts (e.g. 4e6,16e6)")
    if not sizes or any(size < 1 or size != int(size) for size in sizes):
        parser.error(f"--bucket-numel: {value!r}: every size must be a whole number of elements >= 1")
    return [int(size) for size in sizes]


def _latency(parser, value: str | None) -> tuple[float, float] | None:
    """--latency-us: None (by scenario), (0, 0) for off, or (NVLink us, NIC us)."""
    if value is None:
        return None
    if value.strip().lower() == "off":
        return (0.0, 0.0)
    try:
        nvlink, nic = (float(part) for part in value.split(","))
    except ValueError:
        parser.error(f"--latency-us: {value!r} is not NVLINK,NIC microseconds (e.g. 2,5) or off")
    if not (nvlink >= 0 and nic >= 0):
        parser.error(f"--latency-us: {value!r}: latencies must be >= 0 microseconds")
    return (nvlink, nic)


def engine_rows(args) -> dict[str, tuple[Callable, str, int | None]]:
    """Each measured row but plain: its name -> (run function, preset, bucket_numel). With several
    --bucket-numel sizes every row runs once per size, named "<row>, buckets of <N>M"."""
    sizes = getattr(args, "bucket_numels", [args.bucket_numel])  # --json files from before the list
    kinds = [(row, run_engine, row) for row in args.presets]
    kinds += [(f"Trainer + {preset}", run_trainer, preset) for preset in args.trainer_presets]
    rows = {}
    for name, run, preset in kinds:
        for size in sizes:
            label = name if len(sizes) == 1 else f"{name}, buckets of {size / 1e6:g}M"
            rows[label] = (run, preset, size)
    return rows


def _trace_path(args, *parts: str) -> str | None:
    """--profile's PATH.json or PATH.json.gz (the profiler gzips those) -> PATH_<run>.json[.gz]."""
    if not args.profile:
        return None
    path = Path(args.profile)
    suffix = ".json.gz" if path.name.endswith(".json.gz") else ".json"
    stem = path.name.removesuffix(suffix) if path.name.endswith(suffix) else path.stem
    name = "_".join(re.sub(r"[^A-Za-z0-9.]+", "-", p) for p in parts if p)
    return str(path.with_name(f"{stem}_{name}{suffix}"))


def interleave(jobs: Sequence[T], repeats: int, first: int = 0) -> list[list[T]]:
    """The order of `repeats` rounds, each of which runs every job once (rounds `first` on).

    Odd rounds run backwards, so that no job always follows the same one, and every second round
    rotates by one more job, so that no job always runs first (or at the same point of a drift:
    the GPU's clocks fall within a run). Two jobs run AB, BA, BA, AB, ...: rotating every round
    as well as reversing the odd ones ran two jobs AB in every round, the plain row always first.
    """
    rounds = []
    for r in range(first, first + repeats):
        order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
        shift = (r // 2) % len(order)
        rounds.append(order[shift:] + order[:shift])
    return rounds


def _topologies(args) -> dict[str, tuple[Topology, list[Phase]]]:
    """The topologies a model is run on: one node (the nvlink scenario), and the nodes (the others)."""
    scenarios = {
        "one node": [s for s in args.scenarios if s == "nvlink"],
        "nodes": [s for s in args.scenarios if s != "nvlink"],
    }
    topologies = {}
    for key, names in scenarios.items():
        if names:
            ranks_per_node = args.world if key == "one node" else args.ranks_per_node
            topology = Topology(rank=0, world_size=args.world, ranks_per_node=ranks_per_node)
            topologies[key] = (topology, [Phase("compute")] + [scenario_phase(name, args) for name in names])
    return topologies


def measure_model(model: str, args, device: torch.device) -> list[dict]:
    """Every row of one model, `args.repeats` times, interleaved (see `interleave`), each from a
    fresh state; returns every run's raw results, with its round, position, row and topology."""
    spec, topologies = MODELS[model], _topologies(args)
    rows = engine_rows(args)
    jobs = [("plain", "")] + [(row, key) for key in topologies for row in rows]
    raw = []
    for r, order in enumerate(interleave(jobs, args.repeats, args.first_round)):
        for position, (row, key) in enumerate(order):
            where = f", {key}" if key else ""
            print(f"{model}, round {r + 1}/{args.repeats}: {row}{where}", file=sys.stderr)
            trace = _trace_path(args, model, row, key) if r == 0 else None  # one trace per row
            with fresh_state(f"{model}, round {r + 1}: {row}{where}", device) as watched:
                if row == "plain":
                    result = run_plain(spec, args, device, trace, watched)
                else:
                    run, preset, bucket_numel = rows[row]
                    topology, phases = topologies[key]
                    result = run(spec, preset, bucket_numel, topology, phases, args, device, trace, watched)
            raw.append({"model": model, "round": r, "position": position, "row": row, "topology": key, **result})
    return raw


def tabulate(model: str, raw: list[dict], args) -> list[str]:
    """One Markdown table per scenario of `model`, from the raw runs (measure_model's or a --json file's)."""

    def repeats(row: str, key: str) -> list[dict]:
        return sorted((r for r in raw if (r["model"], r["row"], r["topology"]) == (model, row, key)), key=_round)

    rows, plain = list(engine_rows(args)), repeats("plain", "")
    tables = []
    for key, (_, phases) in _topologies(args).items():
        by_row = {row: repeats(row, key) for row in rows}
        for phase in phases[1:]:
            tables.append(scenario_table(model, phase, plain, by_row, args))
            more = (segment_table, host_table)
            tables += [t for t in (table(model, phase, plain, by_row) for table in more) if t]
    return tables


def _round(run: dict) -> int:
    return run["round"]


def _finite(value):
    """JSON without NaN: the CPU's peak memory is written as null (and read back as NaN)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _report(record: dict, args) -> str:
    """The header and every table: what the script prints, from a record (as --json writes it)."""
    tables = [table for model in record["models"] for table in tabulate(model, record["runs"], args)]
    return "\n".join(record["header"] + tables)


def _wait_note() -> str:
    """The emulation's wait: its accuracy, and what it costs the matrix products beside it."""
    return (
        f" A 20 ms wait of the emulation measured {spin_accuracy():.3f}x; the 1.3B's MLP products ran "
        f"{spin_cost(nap=True):.3f}x their time alone beside a wait ({spin_cost(nap=False):.3f}x beside a wait "
        "that reads the clock back to back, without naps)."
    )


def _measure(args, argv: list[str] | None) -> dict:
    """Every model's runs, and the header that describes them."""
    device = args.device
    started = time.perf_counter()
    if not args.dry_run:
        accuracy = spin_accuracy()
        if not 0.98 < accuracy < 1.05:
            raise SystemExit(f"error: the %globaltimer wait took {accuracy:.3f}x the time asked: the emulation is off")
    raw = [run for model in args.models for run in measure_model(model, args, device)]
    name = "CPU" if args.dry_run else torch.cuda.get_device_name()
    ckpt = [model for model in args.models if MODELS[model].checkpoint]
    checkpointed = f" ({', '.join(ckpt)} with activation checkpointing)" if ckpt else ""
    power = "" if args.dry_run else f" (and {POWER_WARMUP_S} s of matrix products first: the GPU at its power limit)"
    header = [
        f"### Emulated network on {name}, {datetime.date.today()}",
        "",
        f"`python benchmarks/emulated_network.py {' '.join(sys.argv[1:] if argv is None else argv)}`: rank 0 of "
        f"{args.world} ranks, {args.repeats} x {args.steps} timed steps per row after {args.warmup} + {args.settle} "
        f"untimed{power}, bf16 GPT{checkpointed}, "
        f"fused AdamW, clip 1.0; Lightning's collectives on the {args.lightning_lane} lane; torch {torch.__version__}; "
        f"{time.perf_counter() - started:.0f} s in all." + ("" if args.dry_run else _wait_note()),
        "",
    ]
    if args.dry_run:
        header += ["**Dry run on the CPU: a check of the script, not a measurement. No figure here is a timing.**", ""]
    settings = {k: v for k, v in vars(args).items() if k not in ("device", "model")}
    specs = {model: dataclasses.asdict(MODELS[model]) for model in args.models}
    return {
        "header": header,
        "device": name,
        "torch": torch.__version__,
        "args": settings,
        "models": specs,
        "runs": raw,
    }


def _nan(value):
    """_finite's inverse: null back to NaN."""
    if isinstance(value, dict):
        return {k: _nan(v) for k, v in value.items()}
    return math.nan if value is None else value


def _load(path: str) -> tuple[dict, argparse.Namespace]:
    """A --json file: its record (null read back as NaN in the runs) and the arguments it ran with."""
    record = json.loads(Path(path).read_text())
    record["runs"] = [_nan(run) for run in record["runs"]]
    return record, argparse.Namespace(**record["args"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    if args.tables_from:
        record, measured_args = _load(args.tables_from)
        text = _report(record, measured_args)
    else:
        record = _measure(args, argv)
        text = _report(record, args)
        if args.json:
            Path(args.json).write_text(json.dumps(_finite(record), indent=1) + "\n")
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
