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
import dataclasses
import datetime
import gc
import math
import re
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from emulation import LIGHTNING_LANES, Network, Phase, PhaseTimer, spin_accuracy
from gpt_step import VOCAB, build_gpt, engine_step, lm_loss, make_optimizer, plain_step, random_tokens
from torch.utils.data import DataLoader, Dataset

from lightning_sdp4bit import SDP4BitConfig, SDP4BitStrategy, ops
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_embd: int
    batch: int
    seq: int
    n_head: int = 16
    vocab: int = VOCAB

    def build(self, device: torch.device):
        return build_gpt(self.n_layer, self.n_head, self.n_embd, self.seq, device, self.vocab)

    def tokens(self, device: torch.device) -> torch.Tensor:
        return random_tokens(self.batch, self.seq, device, self.vocab)


MODELS = {
    "356m": ModelSpec(24, 1024, batch=8, seq=2048),
    "1.3b": ModelSpec(24, 2048, batch=4, seq=2048),
    "tiny": ModelSpec(2, 64, batch=2, seq=32, n_head=4, vocab=512),  # the dry run's: ~0.1M parameters
}
ENGINE_ROWS = ("baseline", "qwd", "tlq_hs", "sdp4bit", "qw+ulq")
SCENARIOS = ("nvlink", "ib400", "eth100", "custom")
SETTLE = 1  # untimed steps after a rate change: they carry the previous phase's in-flight all-gathers


def scenario_phase(name: str, args: argparse.Namespace) -> Phase:
    """GB/s per GPU: Gb/s / 8. One node has no NIC; eth100's 100 Gb/s is the node's, shared."""
    gbps = {"nvlink": math.inf, "ib400": 400, "eth100": 100 / args.ranks_per_node, "custom": args.link_gbps}[name]
    return Phase(name, args.nvlink_gbs, gbps / 8)


def row_config(row: str, ranks_per_node: int, bucket_numel: int | None) -> SDP4BitConfig:
    extra = {"bucket_numel": bucket_numel} if bucket_numel else {}
    if row == "qw+ulq":
        return SDP4BitConfig.preset("ulq", weight_quant="direct", ranks_per_node=ranks_per_node, **extra)
    return SDP4BitConfig.preset(row, ranks_per_node=ranks_per_node, **extra)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_plain(spec: ModelSpec, args, device, profile: str | None) -> dict:
    model = spec.build(device)
    optimizer, tokens = make_optimizer(model.parameters(), device), spec.tokens(device)
    timer = PhaseTimer(None, [Phase("compute")], args, profile)
    for _ in range(timer.total_steps):
        plain_step(model, optimizer, tokens)
        timer.after_step()
    result = timer.results()["compute"]
    result["params"] = sum(p.numel() for p in model.parameters())
    del model, optimizer
    _free()
    return result


def run_engine(spec: ModelSpec, row: str, topology: Topology, phases, args, device, profile) -> dict:
    network = Network(device, topology, args.lightning_lane)
    with network.install():
        model = spec.build(device)
        config = row_config(row, topology.ranks_per_node, args.bucket_numel)
        engine = ShardedEngine(model, config, topology, network.groups())
        optimizer = make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        tokens = spec.tokens(device)
        timer = PhaseTimer(network, phases, args, profile)
        for _ in range(timer.total_steps):
            engine_step(model, engine, optimizer, tokens)
            timer.after_step()
        results = timer.results()
        engine.close()
    del model, engine, optimizer
    _free()
    return results


class EmulatedStrategy(SDP4BitStrategy):
    """SDP4BitStrategy as rank 0 of `world` ranks, in this one process.

    Lightning sees `world` ranks (so it injects a DistributedSampler of `world` replicas and runs
    its per-batch SIGTERM broadcast); the launcher starts nothing; setup_environment still
    initialises a real one-rank process group, which torch.distributed.is_initialized() needs.
    The engine's groups come from Network.groups (Network.install patches create_process_groups).
    Everything else is the real adapter.
    """

    def __init__(self, config: SDP4BitConfig, world: int):
        super().__init__(config)
        self._emulated_world = world

    @property
    def world_size(self) -> int:
        return self._emulated_world

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self._emulated_world, "rank": 0}

    def _configure_launcher(self) -> None:
        self.config.resolve_ranks_per_node(self._emulated_world)  # fail now, as the real one does
        if self.parallel_devices:
            ops.check_kernel_limits(self.config, self.parallel_devices[0].type)
        self._launcher = None


class _Tokens(Dataset):
    """`length` samples of seq + 1 tokens, cycling through one batch's worth."""

    def __init__(self, spec: ModelSpec, length: int):
        self.tokens, self.length = spec.tokens(torch.device("cpu")), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index % len(self.tokens)]


class _GPTModule(L.LightningModule):
    def __init__(self, spec: ModelSpec, device: torch.device):
        super().__init__()
        self.gpt = spec.build(device)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.gpt, batch)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.device)


class _AfterStep(L.Callback):
    reads_weights = False  # sdp4bit: this hook needs no complete weights, so it costs no overlap

    def __init__(self, timer: PhaseTimer):
        self.timer = timer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.timer.after_step()


def run_trainer(spec: ModelSpec, preset: str, topology: Topology, phases, args, device, profile) -> dict:
    network = Network(device, topology, args.lightning_lane)
    timer = PhaseTimer(network, phases, args, profile)
    strategy = EmulatedStrategy(row_config(preset, topology.ranks_per_node, args.bucket_numel), topology.world_size)
    trainer = L.Trainer(
        accelerator=device.type if device.type == "cpu" else "gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-true",
        max_steps=timer.total_steps,
        gradient_clip_val=1.0,
        callbacks=[_AfterStep(timer)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    # Pinned, as a GPU user's loader is: from pageable memory Lightning's copy of each batch to the
    # GPU synchronises the stream (16.7 ms of host waits in 3 steps of the 1.3B trace).
    data = DataLoader(
        _Tokens(spec, topology.world_size * spec.batch * timer.total_steps),
        spec.batch,
        pin_memory=device.type == "cuda",
    )
    module = _GPTModule(spec, device)
    with network.install():
        trainer.fit(module, data)
    results = timer.results()
    del trainer, module, strategy
    _free()
    return results


# ----------------------------------------------------------------------------------------------
# Tables


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


# ----------------------------------------------------------------------------------------------
# The command line


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
