"""How well the engine hides its communication, measured on ONE GPU over an emulated network.

On the H200 (from the repository root; the whole --quick run takes about 4 minutes):

    python3 -m pip install --no-deps --no-build-isolation -e .
    python3 benchmarks/emulated_network.py --quick --markdown emulated.md          # both models, every row
    python3 benchmarks/emulated_network.py --model 356m --markdown emulated.md     # 10 timed steps per row
    python3 benchmarks/emulated_network.py --model 1.3b --presets sdp4bit --scenarios eth100 \\
        --trainer-presets none --profile trace.json                                # one row, with a trace
    python3 benchmarks/emulated_network.py --link-gbps 200 --scenarios custom      # 200 Gb/s per GPU
    python3 benchmarks/emulated_network.py --dry-run                               # CPU, tiny GPT: no timings

One GPU plays rank 0 of --world ranks, --ranks-per-node per node (benchmarks/emulation.py: every
collective becomes a loopback copy on one CUDA stream per link, then a %globaltimer wait for
bytes / bandwidth). Scenarios (bandwidth per GPU, GB/s = 1e9 bytes/s):
- nvlink: one node of --world GPUs, NVLink --nvlink-gbs (150 GB/s);
- ib400: 400 Gb/s InfiniBand per GPU (50 GB/s) across nodes, NVLink inside;
- eth100: 100 Gb/s per node, shared by its --ranks-per-node GPUs (3.125 GB/s each with 4);
- custom: --link-gbps Gb/s per GPU across nodes.
Rows: plain (the same model and optimizer without any strategy: the floor), measured first and
again after every other row (the GPU's clocks drift over a run by a few percent); DDP computed from
the plain step and a bf16 ring all-reduce of every gradient, 2(W-1)/W * 2 bytes * params at the
world link's rate, perfectly overlapped (max) or not (sum); the engine (lightning_sdp4bit.engine)
driven directly per preset, and qw+ulq (ZeRO++-like: qW weights, ULq 4-bit gradients); and
"Trainer + preset": Lightning's Trainer with a SDP4BitStrategy that believes it is rank 0 of W
(EmulatedStrategy below: one process, no launcher, a real one-rank process group), so that
the adapter and Lightning's own collectives (the per-batch SIGTERM broadcast) count too.
Columns: the step (--steps timed back to back, no synchronize between them, so all-gathers a
step leaves in flight are charged to the next); the compute-only step (the same run with no
wait); the busy time of each lane; step / max(compute-only, busiest link); speed against the
engine's baseline and the overlapped DDP (>1 is faster); peak memory since the phase began.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
import warnings
from pathlib import Path

import torch
from emulated_runs import ENGINE_ROWS, MODELS, SCENARIOS, SETTLE, run_engine, run_plain, run_trainer, scenario_phase
from emulated_tables import scenario_table
from emulation import LIGHTNING_LANES, spin_accuracy
from phase_timer import Phase

from lightning_sdp4bit.topology import Topology


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="comma list of 356m, 1.3b, tiny (default: 356m,1.3b)")
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
    parser.add_argument("--bucket-numel", type=int, default=None, help="override SDP4BitConfig.bucket_numel")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per phase (default 10; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="few steps: every row of both models in ~4 min")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny GPT, one step: checks the script only")
    parser.add_argument("--markdown", default=None, help="also append the tables to this file")
    parser.add_argument(
        "--profile", default=None, help="write a torch profiler trace per run: PATH.json -> PATH_<run>.json"
    )
    args = parser.parse_args(argv)
    few = args.quick or args.dry_run
    args.steps = args.steps if args.steps is not None else 1 if args.dry_run else 3 if few else 10
    args.warmup = args.warmup if args.warmup is not None else 0 if args.dry_run else 2 if few else 3
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
    if args.steps < 1 or args.warmup < 0 or not args.nvlink_gbs > 0:
        parser.error("--steps must be >= 1, --warmup >= 0 and --nvlink-gbs > 0")
    if args.bucket_numel is not None and args.bucket_numel < 1:
        parser.error(f"--bucket-numel must be positive, got {args.bucket_numel}")
    if args.dry_run and args.models != ["tiny"]:
        parser.error("--dry-run runs the tiny model on the CPU; leave out --model")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: this measures a GPU. Use --dry-run for a CPU check of the script (no timings)")
    if args.profile and not Path(args.profile).resolve().parent.is_dir():
        parser.error(f"--profile: the folder of {args.profile} does not exist")
    return args


def _names(parser, flag: str, value: str, allowed) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        parser.error(f"{flag}: {', '.join(unknown) or 'nothing'} not among {', '.join(allowed)}")
    return names


def _trace_path(args, *parts: str) -> str | None:
    if not args.profile:
        return None
    path = Path(args.profile)
    return str(path.with_name(f"{path.stem}_{'_'.join(re.sub(r'[^A-Za-z0-9.]+', '-', p) for p in parts)}.json"))


def measure_model(model: str, args, device: torch.device) -> list[str]:
    """Every row of one model; returns one Markdown table per scenario."""
    spec = MODELS[model]
    print(f"{model}: plain step", file=sys.stderr)
    plain = run_plain(spec, args, device, _trace_path(args, model, "plain"))
    topologies = {
        "one node": [s for s in args.scenarios if s == "nvlink"],
        "nodes": [s for s in args.scenarios if s != "nvlink"],
    }
    measured = []
    for key, scenarios in topologies.items():
        if not scenarios:
            continue
        ranks_per_node = args.world if key == "one node" else args.ranks_per_node
        topology = Topology(rank=0, world_size=args.world, ranks_per_node=ranks_per_node)
        phases = [Phase("compute")] + [scenario_phase(s, args) for s in scenarios]
        runs: dict[str, dict] = {}
        jobs = [(row, run_engine, row) for row in args.presets]
        jobs += [(f"Trainer + {p}", run_trainer, p) for p in args.trainer_presets]
        for row, run, preset in jobs:
            print(f"{model}: {row}, {key} ({', '.join(scenarios)})", file=sys.stderr)
            trace = _trace_path(args, model, row, scenarios[-1])
            runs[row] = run(spec, preset, topology, phases, args, device, trace)
        measured.append((phases, runs))
    # Again at the end: the GPU's clocks drift over a run by as much as the differences measured.
    print(f"{model}: plain step, again", file=sys.stderr)
    plain_last = run_plain(spec, args, device, None)
    tables = []
    for phases, runs in measured:
        tables += [scenario_table(model, p, plain, runs, args, plain_last) for p in phases[1:]]
    return tables


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    started = time.perf_counter()
    if not args.dry_run:
        accuracy = spin_accuracy()
        if not 0.98 < accuracy < 1.05:
            raise SystemExit(f"error: the %globaltimer wait took {accuracy:.3f}x the time asked: the emulation is off")
    tables = [table for model in args.models for table in measure_model(model, args, device)]
    name = "CPU" if args.dry_run else torch.cuda.get_device_name()
    header = [
        f"### Emulated network on {name}, {datetime.date.today()}",
        "",
        f"`python benchmarks/emulated_network.py {' '.join(sys.argv[1:] if argv is None else argv)}`: rank 0 of "
        f"{args.world} ranks, {args.steps} timed steps per row after {args.warmup} + {args.settle} untimed, bf16 GPT, "
        f"fused AdamW, clip 1.0; Lightning's collectives on the {args.lightning_lane} lane; torch {torch.__version__}; "
        f"{time.perf_counter() - started:.0f} s in all."
        + ("" if args.dry_run else f" A 20 ms wait of the emulation measured {spin_accuracy():.3f}x."),
        "",
    ]
    if args.dry_run:
        header += ["**Dry run on the CPU: a check of the script, not a measurement. No figure here is a timing.**", ""]
    text = "\n".join(header + tables)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
