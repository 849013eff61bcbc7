"""Memory and step time of weight_sharding="node" against "replicated", on ONE GPU as rank 0 of an
emulated job (benchmarks/emulation.py: every collective a loopback that takes the link's time).

On the H200 (from the repository root, the package installed or on PYTHONPATH):

    python3 benchmarks/node_sharding.py --models 6.7b-ckpt --nodes 16 --ranks-per-node 4 \
        --scenarios nvlink,eth100 --repeat 3 --json 6.7b.json           # both modes, medians of 3
    python3 benchmarks/node_sharding.py --models 70b-ckpt --nodes 16 --ranks-per-node 8 \
        --modes node,replicated --scenarios nvlink,eth100,ib400 --bucket-numel 1e8 --json 70b.json
    python3 benchmarks/node_sharding.py --models 6.7b-ckpt --modes node --node-gather-prefetch 1 \
        --scenarios nvlink,eth100 --repeat 3                            # fewer gathers ahead
    python3 benchmarks/node_sharding.py --models 6.7b-ckpt --scenarios nvlink --steps 1 --settle 0 \
        --peak-profile                                                 # what is alive at the peak
    python3 benchmarks/node_sharding.py --dry-run                      # CPU, tiny GPT: no timings

Per model and mode, --repeat runs (the modes interleaved; the table gives the median step and
each run's): the model built on the meta device (under "node" each rank builds only its node
slices; under "replicated" it is made real on the GPU in bf16, and a model that does not fit is
reported as such with the bytes its weights alone need, and not run again), the engine with the
sdp4bit preset, fused AdamW, then --warmup steps and, per scenario, --settle untimed and --steps
timed steps back to back (phase_timer.PhaseTimer). Reported per run: the trained parameters, the
memory held between steps (weights, masters, optimizer state, every buffer of the engine), its
bytes per parameter, the peak over the timed steps, and per scenario the step, the busiest link's
time and step / max(compute, busiest link), where compute is the nvlink scenario's step (give it
first).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import weakref

import memory_peak
import torch
from cli_args import at_least
from emulated_runs import MODELS, SETTLE, ModelSpec, fresh_state, scenario_phase
from emulation import Network
from gpt_step import engine_step, make_optimizer
from phase_timer import PhaseTimer

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology

# The 70B shape the issue names: 80 layers, 8192 wide, 64 heads, one 2048-token sequence per rank,
# each block's activations recomputed (65B parameters with the example GPT's 4x MLP and vocabulary).
SHAPES = {**MODELS, "70b-ckpt": ModelSpec(80, 8192, batch=1, seq=2048, n_head=64, checkpoint=True)}
MODES = ("replicated", "node")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="6.7b-ckpt", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of replicated, node")
    parser.add_argument("--nodes", type=at_least(1), default=16)
    parser.add_argument("--ranks-per-node", type=at_least(2), default=4)
    parser.add_argument("--scenarios", default="nvlink,eth100", help="emulated_runs scenarios; nvlink first")
    parser.add_argument("--bucket-numel", type=lambda text: int(float(text)), default=None)
    parser.add_argument(
        "--node-gather-prefetch", type=at_least(0), default=None, help="SDP4BitConfig.node_gather_prefetch (node mode)"
    )
    parser.add_argument("--nvlink-gbs", type=at_least(1.0, float), default=150.0)
    parser.add_argument(
        "--link-gbps", type=at_least(1.0, float), default=math.inf, help="the custom scenario's Gb/s per GPU"
    )
    parser.add_argument("--warmup", type=at_least(1), default=1)
    parser.add_argument("--settle", type=at_least(0), default=SETTLE)
    parser.add_argument("--steps", type=at_least(1), default=3)
    parser.add_argument("--repeat", type=at_least(1), default=1, help="runs of each model and mode (medians reported)")
    parser.add_argument("--json", help="write the runs' results here")
    parser.add_argument(
        "--peak-profile",
        action="store_true",
        help="record the allocator's history and print what is alive at the last step's peak (slower: no timings)",
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny-ckpt GPT, 2 nodes x 2: no timings")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.models, args.nodes, args.ranks_per_node, args.scenarios = "tiny-ckpt", 2, 2, "nvlink"
    for flag, value, allowed in (("--models", args.models, SHAPES), ("--modes", args.modes, MODES)):
        unknown = [name for name in value.split(",") if name not in allowed]
        if unknown:
            parser.error(f"argument {flag}: unknown {unknown}; allowed: {', '.join(allowed)}")
    args.device = torch.device("cpu" if args.dry_run else "cuda")
    args.latency_us, args.lightning_lane = None, "shared"
    return args


def held_bytes(engine: ShardedEngine, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What rank 0 keeps between steps, by kind, in bytes."""
    buckets = engine.buckets
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "weights": sum(b.held_weights.nbytes for b in buckets),
        "masters": sum(b.master.nbytes for b in buckets),
        "grad_shards": sum(b.grad_shard.nbytes for b in buckets),
        "applied_shards": sum(b.applied_shard.nbytes for b in buckets),
        "optimizer_state": sum(t.nbytes for t in state),
    }


def run(spec: ModelSpec, mode: str, topology: Topology, args, watched: list) -> dict:
    network = Network(args.device, topology, args.lightning_lane)
    extra = {"bucket_numel": args.bucket_numel} if args.bucket_numel else {}
    if mode == "node" and args.node_gather_prefetch is not None:
        extra["node_gather_prefetch"] = args.node_gather_prefetch
    config = SDP4BitConfig.preset("sdp4bit", ranks_per_node=topology.ranks_per_node, weight_sharding=mode, **extra)
    with network.install():
        try:
            return _measure(spec, mode, topology, config, network, args, watched)
        except torch.OutOfMemoryError as error:
            return {"fits": False, "weights_gib": _weights_gib(spec), "error": str(error).splitlines()[0]}


def _measure(spec: ModelSpec, mode: str, topology: Topology, config, network: Network, args, watched: list) -> dict:
    model = _build(spec, mode, args.device)
    engine = ShardedEngine(model, config, topology, network.groups(), device=args.device)
    watched += [weakref.ref(model), weakref.ref(engine)]
    optimizer = make_optimizer(model.parameters(), args.device)
    engine.shard_optimizer(optimizer)
    tokens = spec.tokens(args.device)
    phases = [scenario_phase(name, args) for name in args.scenarios.split(",")]
    timer = PhaseTimer(network, phases, args, None)
    held, peak = None, None
    profiling = args.peak_profile and args.device.type == "cuda"
    before = torch.cuda.memory_allocated() if profiling else 0
    with memory_peak.recording() if profiling else contextlib.nullcontext():
        for step in range(timer.total_steps):
            if profiling:
                memory_peak.mark(args.device)
            engine_step(model, engine, optimizer, tokens, timer.mark)
            timer.after_step()
            if step == 0:
                held = held_bytes(engine, optimizer)
                if args.device.type == "cuda":
                    torch.cuda.synchronize()
                    held["allocated"] = torch.cuda.memory_allocated()
        if profiling:
            peak = memory_peak.breakdown(memory_peak.trace(), before)
            title = f"{mode}, {spec.n_layer} x {spec.n_embd}"
            print(memory_peak.format_breakdown(title, peak), file=sys.stderr, flush=True)
    results = timer.results()
    engine.close()
    params = sum(b.layout.used_numel for b in engine.buckets)
    return {"fits": True, "params": params, "held": held, "phases": results, "peak_profile": peak}


def _build(spec: ModelSpec, mode: str, device: torch.device) -> torch.nn.Module:
    """The model on the meta device ("node": the engine materializes each rank's node slices), or
    made real on the device in bf16 by the same steps (reset_parameters module by module), never
    whole in fp32: a 65B model built in fp32 first would need 260 GB."""
    model = spec.build(torch.device("meta"))
    if mode == "node":
        return model
    model.to_empty(device=device)
    model.lm_head.weight = model.wte.weight  # to_empty makes a Parameter per module: tie them again
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
                module.reset_parameters()
    return model


def _weights_gib(spec: ModelSpec) -> float:
    model = spec.build(torch.device("meta"))
    return sum(p.numel() for p in model.parameters()) * 2 / 2**30


def report(runs: list[dict]) -> str:
    """A row per model, mode and scenario: with several runs of each (--repeat), the median of their
    steps (each run's step is the mean of its timed steps), every run's beside it, the highest peak."""
    lines = [
        "| model | mode | parameters | held between steps (GiB) | bytes / parameter | peak (GiB) | scenario "
        "| step (ms) | runs' steps (ms) | busiest link (ms) | step / max(compute, link) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    grouped: dict[tuple[str, str], list[dict]] = {}
    for entry in runs:
        grouped.setdefault((entry["model"], entry["mode"]), []).append(entry["result"])
    for (model, mode), results in grouped.items():
        fitted = [result for result in results if result["fits"]]
        if not fitted:
            need = f"does not fit: its bf16 weights alone are {results[0]['weights_gib']:.1f} GiB"
            lines.append(f"| {model} | {mode} | | {need} | | | | | | | |")
            continue
        first = fitted[0]
        held = sum(v for k, v in first["held"].items() if k != "allocated")
        steps = {name: [r["phases"][name]["step_ms"] for r in fitted] for name in first["phases"]}
        compute = statistics.median(next(iter(steps.values())))
        for scenario, phase in first["phases"].items():
            link = max(phase["busy_ms"].values(), default=0.0)
            step = statistics.median(steps[scenario])
            peak = max(r["phases"][scenario]["peak_gib"] for r in fitted)
            each = ", ".join(f"{ms:.1f}" for ms in steps[scenario])
            lines.append(
                f"| {model} | {mode} | {first['params'] / 1e9:.2f}B | {held / 2**30:.1f} "
                f"| {held / first['params']:.2f} | {peak:.1f} | {scenario} | {step:.1f} | {each} "
                f"| {link:.1f} | {step / max(compute, link):.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    topology = Topology(0, args.nodes * args.ranks_per_node, args.ranks_per_node)
    runs: list[dict] = []
    unfit: set[tuple[str, str]] = set()  # not run again: it will not fit the next time either
    # Repeats interleave the modes, so that a drift of the machine (clocks, temperature) reaches both alike.
    for repeat, model, mode in itertools.product(range(args.repeat), args.models.split(","), args.modes.split(",")):
        if (model, mode) in unfit:
            continue
        print(f"{model}, {mode}, {args.nodes} x {args.ranks_per_node}, run {repeat + 1}", file=sys.stderr, flush=True)
        result: dict = {}
        try:
            with fresh_state(f"{model} {mode}", args.device) as watched:
                result = run(SHAPES[model], mode, topology, args, watched)
        except RuntimeError as error:
            if result.get("fits", True):  # a run that fitted left something behind: a real leak
                raise
            result["after"] = str(error)  # what an out-of-memory run left allocated
        if not result["fits"]:
            unfit.add((model, mode))
        runs.append({"model": model, "mode": mode, "result": result})
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, handle, indent=1)
    print(report(runs))


if __name__ == "__main__":
    main()
