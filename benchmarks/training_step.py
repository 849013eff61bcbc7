"""How much of a GPT training step the compression kernels take, on one GPU.

    python benchmarks/training_step.py                          # GPT ~350M, 8 ranks as 2 nodes x 4
    python benchmarks/training_step.py --n-layer 24 --n-embd 2048 --batch 2   # ~1.3B
    python benchmarks/training_step.py --compile                # the model under torch.compile

One GPU plays rank 0 of a data-parallel job of --world ranks: the engine (lightning_sdp4bit.
engine, the strategy's own) shards the optimizer for that world and runs every compression
kernel on this rank's real sizes, over the emulated network of benchmarks/emulation.py with no
wait (its loopbacks only copy, as if each peer of each group had sent what this rank sent).
Forward, backward, the optimizer on 1/world of the parameters and all five compression kernels
therefore cost what they cost on one GPU of the real job; only the network time is missing, so
the kernels' share printed here is an upper bound of their share in a real step.

Per preset (baseline = no compression, sdp4bit = qWD + TLq-HS) it prints the median step time
(CUDA events) and, from the profiler, the GPU time of the compression kernels per step. With
--compile the model runs under torch.compile, driven as the strategies drive it (their
CompiledRegionWatch: the weight all-gathers complete right after the step), and the table also
gives dynamo's graph breaks and graphs (0 and 1 when the engine's hooks trace cleanly).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch._dynamo.utils
from cli_args import at_least
from emulation import Network
from gpt_step import build_gpt, engine_step, make_optimizer, random_tokens
from lightning_sdp4bit.strategies import common

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology

COMPRESSION_KERNELS = ("weight_update", "grad_encode", "grad_requantize", "grad_decode_sum")
"""Substrings of the Triton kernels' names (kernels/*.py)."""


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a dry run of the script


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(step) -> float:
    """Milliseconds of one call: CUDA events on the GPU, the wall clock on the CPU."""
    if DEVICE != "cuda":
        start = time.perf_counter()
        step()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"


def _measure(args: argparse.Namespace, preset: str, network: Network) -> dict[str, float]:
    device = torch.device(DEVICE)
    model = build_gpt(args.n_layer, args.n_head, args.n_embd, args.seq, device)
    sdp_config = SDP4BitConfig.preset(preset, ranks_per_node=args.ranks_per_node)
    engine = ShardedEngine(model, sdp_config, network.topology, network.groups())
    optimizer = make_optimizer(model.parameters(), device)
    engine.shard_optimizer(optimizer)
    watch = common.CompiledRegionWatch(model)
    forward = torch.compile(model) if args.compile else model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tokens = random_tokens(args.batch, args.seq, device)

    def step() -> None:
        engine_step(forward, engine, optimizer, tokens)
        if watch.seen:  # compiled forwards find the weights complete (common.start_weight_sync)
            engine.wait_weights()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        times.append(_timed(step))
    activities = [torch.profiler.ProfilerActivity.CUDA if DEVICE == "cuda" else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(args.profiled_steps):
            step()
        _synchronize()
    kernel_us = sum(
        event.device_time_total
        for event in profiler.key_averages()
        if any(name in event.key for name in COMPRESSION_KERNELS)
    )
    params = sum(p.numel() for p in model.parameters())
    result = {
        "params": params,
        "step_ms": statistics.median(times),
        "kernel_ms": kernel_us / 1e3 / args.profiled_steps,
        "tokens_per_s": args.batch * args.seq / (statistics.median(times) / 1e3),
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }
    engine.close()
    watch.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=at_least(1), default=8)
    parser.add_argument("--ranks-per-node", type=at_least(1), default=4)
    parser.add_argument("--n-layer", type=at_least(1), default=24)
    parser.add_argument("--n-head", type=at_least(1), default=16)
    parser.add_argument("--n-embd", type=at_least(1), default=1024)
    parser.add_argument("--seq", type=at_least(1), default=2048)
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--profiled-steps", type=at_least(1), default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (warmup >= 2 pays the compile)")
    parser.add_argument("--out", default=None, help="append the Markdown table to this file")
    args = parser.parse_args(argv)
    if args.world % args.ranks_per_node:
        parser.error(f"--ranks-per-node={args.ranks_per_node} must divide --world={args.world}")
    network = Network(torch.device(DEVICE), Topology(0, args.world, args.ranks_per_node))
    rows = []
    for preset in ("baseline", "sdp4bit"):
        with network.install():
            r = _measure(args, preset, network)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        share = 100 * r["kernel_ms"] / r["step_ms"]
        compiled = f" | {r['graph_breaks']} | {r['graphs']}" if args.compile else ""
        rows.append(
            f"| {preset}{' (compiled)' if args.compile else ''} | {r['params'] / 1e6:.0f}M | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['kernel_ms']:.2f} | {share:.2f}%{compiled} |"
        )
    lines = [
        f"### GPT training step on {_device_name()}, {datetime.date.today()}",
        "",
        f"`python benchmarks/training_step.py {' '.join(sys.argv[1:])}`: rank 0 of {args.world} ranks "
        f"({args.world // args.ranks_per_node} nodes x {args.ranks_per_node}), bf16 weights, seq {args.seq}, "
        f"batch {args.batch}, loopback communication (no wait); torch {torch.__version__}.",
        "",
        "| preset | params | step (ms) | tokens/s | compression kernels (ms/step) | share of the step |"
        + (" graph breaks | graphs |" if args.compile else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if args.compile else ""),
        *rows,
        "",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
