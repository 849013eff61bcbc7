"""Host time per phase of a training step against the GPU's step, for the engine and the plain step.

On the H200 (repository root; about 40 s per model):

    python3 benchmarks/host_time.py --model 356m
    python3 benchmarks/host_time.py --model 1.3b --nodes 2
    python3 benchmarks/host_time.py --model 1.3b --world 64 --nodes 16   # rank 0 of 16 x 4
    python3 benchmarks/host_time.py --model 1.3b --nodes 2 --cprofile 4  # and where the host goes

One GPU plays rank 0 of --world ranks (8) over the emulated network of benchmarks/emulation.py
(NVLink 150 GB/s; with --nodes above 1, world / nodes GPUs per node and a 50 GB/s NIC per GPU),
sdp4bit's defaults. The
engine's step is the order the Lightning adapter drives it (benchmarks/gpt_step.py); each phase
is timed on the host with perf_counter, with nothing synchronised, and the GPU's step with CUDA
events recorded back to back. Host time equal to the GPU's means the host waits for the GPU
somewhere (a full launch queue, a synchronisation); far below it, the host runs ahead and the
GPU never waits for a launch. Then the plain step (no strategy), in the same process. Medians
over --steps steps after --warmup. With --cprofile N, N more engine steps run under cProfile, and
the functions that took the most host time in the forward and the backward are printed (cProfile
slows Python-heavy code more than torch's calls: read the shares, not the milliseconds).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from cli_args import at_least
from emulated_runs import MODELS
from emulation import Network
from gpt_step import MAX_NORM, lm_loss, make_optimizer

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology

ENGINE_PHASES = ("forward", "backward", "finish_grad_sync", "clip", "prepare_step", "optimizer", "start_weight_sync")
PLAIN_PHASES = ("forward", "backward", "clip", "optimizer")


def _timed(phases: tuple[str, ...], calls, steps: int, warmup: int) -> tuple[dict[str, float], float]:
    """Median host ms per phase and median GPU ms per step of `calls` (one callable per phase)."""
    host: dict[str, list[float]] = {name: [] for name in phases}
    events = []
    for step in range(warmup + steps + 1):
        for name, call in zip(phases, calls, strict=True):
            start = time.perf_counter()
            call()
            if step >= warmup:
                host[name].append((time.perf_counter() - start) * 1e3)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events.append(event)
    torch.cuda.synchronize()
    gpu = [events[i].elapsed_time(events[i + 1]) for i in range(warmup, len(events) - 1)]
    return {name: statistics.median(values) for name, values in host.items()}, statistics.median(gpu)


def _profiled(phases: tuple[str, ...], calls, steps: int, shown: tuple[str, ...], top: int = 30) -> str:
    """cProfile's cumulative-time listing of each phase in `shown`, over `steps` more steps."""
    profiles = {name: cProfile.Profile() for name in phases}
    for _ in range(steps):
        for name, call in zip(phases, calls, strict=True):
            profiles[name].enable()
            call()
            profiles[name].disable()
    torch.cuda.synchronize()
    listings = []
    for name in shown:
        out = io.StringIO()
        pstats.Stats(profiles[name], stream=out).sort_stats("cumulative").print_stats(top)
        heading = f"## {name}, {steps} steps under cProfile, by cumulative time"
        listings.append(f"{heading}\n\n```\n{out.getvalue().strip()}\n```")
    return "\n\n".join(listings)


def _engine_calls(model, engine, optimizer, tokens):
    state = {}

    def forward():
        state["loss"] = lm_loss(model, tokens)
        engine.before_backward()

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return (
        forward,
        lambda: state.pop("loss").backward(),
        engine.finish_grad_sync,
        lambda: engine.clip_grad_norm(MAX_NORM),
        engine.prepare_step,
        step,
        engine.start_weight_sync,
    )


def _plain_calls(model, optimizer, tokens):
    state = {}

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return (
        lambda: state.__setitem__("loss", lm_loss(model, tokens)),
        lambda: state.pop("loss").backward(),
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
        step,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="356m", choices=[m for m in MODELS if m != "tiny"])
    parser.add_argument("--world", type=int, default=8, help="ranks of the emulated job (default 8)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes they are spread over (default 1)")
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--warmup", type=at_least(0), default=4)
    parser.add_argument("--cprofile", type=at_least(0), default=0, help="engine steps to profile after (default 0)")
    parser.add_argument(
        "--bucket-numel", type=at_least(1, float), default=None, help="elements a bucket (default: the config's)"
    )
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.world < 1 or args.world % args.nodes:
        parser.error(f"--nodes={args.nodes} must be >= 1 and divide --world={args.world}")
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a GPU: it times the host against the GPU")
    device, spec = torch.device("cuda"), MODELS[args.model]
    ranks_per_node = args.world // args.nodes
    topology = Topology(0, args.world, ranks_per_node)
    network = Network(device, topology, "own")
    network.set_rates(150.0, 150.0 if args.nodes == 1 else 50.0)
    with network.install():
        model = spec.build(device)
        buckets = {} if args.bucket_numel is None else {"bucket_numel": int(args.bucket_numel)}
        config = SDP4BitConfig.preset("sdp4bit", ranks_per_node=ranks_per_node, **buckets)
        engine = ShardedEngine(model, config, topology, network.groups())
        optimizer = make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        tokens = spec.tokens(device)
        calls = _engine_calls(model, engine, optimizer, tokens)
        engine_host, engine_gpu = _timed(ENGINE_PHASES, calls, args.steps, args.warmup)
        listing = _profiled(ENGINE_PHASES, calls, args.cprofile, ("forward", "backward")) if args.cprofile else ""
        bucket_count = len(engine.buckets)
        engine.close()
    del model, engine, optimizer
    torch.cuda.empty_cache()
    model = spec.build(device)
    optimizer = make_optimizer(model.parameters(), device)
    plain_host, plain_gpu = _timed(PLAIN_PHASES, _plain_calls(model, optimizer, tokens), args.steps, args.warmup)
    print(
        f"{args.model}, {args.nodes} node(s) of {ranks_per_node}, {bucket_count} buckets, "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print("| step | phase | host (ms) |")
    print("|---|---|---|")
    for label, host, gpu in (("sdp4bit", engine_host, engine_gpu), ("plain", plain_host, plain_gpu)):
        for name, value in host.items():
            print(f"| {label} | {name} | {value:.2f} |")
        print(f"| {label} | **whole step, host** | **{sum(host.values()):.1f}** |")
        print(f"| {label} | **whole step, GPU** | **{gpu:.1f}** |")
    if listing:
        print("\n" + listing)


if __name__ == "__main__":
    main()
