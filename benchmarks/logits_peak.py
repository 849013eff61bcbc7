"""The node mode's memory above the replicated mode's where a GPT's step peaks, predicted on the
CPU: the 6.7B bucket layout at a small width, bf16, rank 0 of an emulated 2 x 4 job.

    python benchmarks/logits_peak.py                          # width 256, gathers 1 and 2 ahead
    python benchmarks/logits_peak.py --prefetch 2 --markdown peak.md

The model is `node_gathers.py`'s (every dimension that sets a bucket scaled from 6.7B), in bf16 as
on the GPU, with 128-wide heads. Per mode (replicated, then node at each `--prefetch`), the third
step runs under the profiler with memory events. The bytes allocated since the step began are
followed between marks set by module hooks:
- the **logits stretch**, from the head's forward until the logits' gradient is computed: the
  logits and their fp32 copies for the loss, the step's largest activations, are alive there,
  with whatever the node mode has gathered;
- the **head's backward**, from there until the head's backward is done: the tied weights are
  gathered again for it, beside the logits' gradient.

Reported per run: the most allocated in each, in MiB here, and the larger in GiB at 6.7B (x (4096
/ width)^2); for the node mode, its excess over the replicated mode's. That excess, added to the
replicated peak minus the held bytes the node mode saves, predicts the node mode's peak on the
GPU.

Why only these stretches:
- **It is where the H200's 6.7B peak is.** Both modes peak the same on NVLink alone and at 100
  Gb/s (`results/node_sharding_runs/`), so the peak does not wait on a link. The node mode's
  excess here matched the H200's within 0.06 GiB, with two gathers ahead and with one
  (`results/logits_peak_cpu_2026-12-05.md`).
- **The backward's stretches are not the GPU's.** On the CPU the engine's reference quantizer
  allocates temporaries the Triton kernels do not, and the backward's level grows with each
  block, in both modes. Read those as a CPU artefact.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import node_gathers
import torch
from cli_args import at_least, each_at_least
from emulation import Network
from gpt_step import engine_step, make_optimizer

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology

NODES, RANKS_PER_NODE = 2, 4  # a small world: buckets padded to (W x 2,048) elements stay near their size
HEAD_WIDTH = 128  # the 6.7B model's: 4096 / 32 heads
STRETCHES = {"logits": ("logits begins", "logits ends"), "head's backward": ("logits ends", "head backward ends")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prefetch", type=each_at_least(0), default=[1, 2], help="comma-separated node_gather_prefetch values"
    )
    parser.add_argument("--width", type=at_least(HEAD_WIDTH), default=256, help="the scaled model's width (6.7B: 4096)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--one", nargs=2, metavar=("MODE", "PREFETCH"), help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args(argv)
    if args.width % HEAD_WIDTH:
        parser.error(f"argument --width: {args.width} is not a multiple of {HEAD_WIDTH} (the heads' width)")
    return args


def stretch_bytes(width: int, mode: str, prefetch: int) -> dict[str, int]:
    """The most bytes allocated since the profiled step began in each of `STRETCHES`, for one mode
    of the scaled model."""
    scaled, layout = node_gathers.scaled_config(width, prefetch)
    spec = dataclasses.replace(scaled, n_head=width // HEAD_WIDTH)
    overrides = {"node_gather_prefetch": prefetch} if mode == "node" else {}
    config = SDP4BitConfig.preset(
        "sdp4bit",
        ranks_per_node=RANKS_PER_NODE,
        weight_sharding=mode,
        bucket_numel=layout.bucket_numel,
        first_bucket_numel=layout.first_bucket_numel,
        **overrides,
    )
    device = torch.device("cpu")
    topology = Topology(0, NODES * RANKS_PER_NODE, RANKS_PER_NODE)
    network = Network(device, topology, "shared")
    with network.install():
        model = spec.build(torch.device("meta") if mode == "node" else device)  # bf16, as on the GPU
        engine = ShardedEngine(model, config, topology, network.groups(), device=device)
        try:
            _mark_the_stretches(model)
            optimizer = make_optimizer(model.parameters(), device)
            engine.shard_optimizer(optimizer)
            tokens = spec.tokens(device)
            for _ in range(2):
                engine_step(model, engine, optimizer, tokens)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                engine_step(model, engine, optimizer, tokens)
        finally:
            engine.close()
    events = _trace_events(prof)
    return {name: _most_between(events, *marks) for name, marks in STRETCHES.items()}


def _mark_the_stretches(model: torch.nn.Module) -> None:
    """Profiler marks at the head's forward, when the logits' gradient is computed, and when the
    head's backward is done."""

    def mark(name: str) -> None:
        with torch.profiler.record_function(name):
            pass

    def on_logits(module, args, logits: torch.Tensor) -> None:
        if logits.requires_grad:
            logits.register_hook(lambda grad: mark("logits ends"))

    model.lm_head.register_forward_pre_hook(lambda module, args: mark("logits begins"))
    model.lm_head.register_forward_hook(on_logits)
    model.lm_head.register_full_backward_hook(lambda module, grad_input, grad_output: mark("head backward ends"))


def _trace_events(prof: torch.profiler.profile) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            return json.load(handle)["traceEvents"]


def _most_between(events: list[dict], begins: str, ends: str) -> int:
    """The most bytes allocated since the profiled step began ("Total Allocated" of the CPU's
    memory events, less its value before the first: the profiler carries it over from earlier
    sessions in the process) from the last `begins` mark to the `ends` mark after it (the level
    just before the first counts: the stretch starts there)."""
    memory = sorted(
        (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    )
    base = memory[0][1] - memory[0][2]
    start = max(e["ts"] for e in events if e.get("name") == begins)
    end = min(e["ts"] for e in events if e.get("name") == ends and e["ts"] >= start)
    times = [time for time, _, _ in memory]
    first = max(bisect.bisect_right(times, start) - 1, 0)
    last = bisect.bisect_right(times, end)
    return max(total for _, total, _ in memory[first:last]) - base


def report(rows: list[dict], width: int) -> str:
    """A row per run: the most allocated in each stretch (MiB), the larger at 6.7B, and the node
    mode's excess over the replicated mode's at 6.7B."""
    to_full_gib = (node_gathers.FULL.n_embd / width) ** 2 / 2**30
    replicated = max(next(row["bytes"] for row in rows if row["mode"] == "replicated").values())
    names = list(STRETCHES)
    lines = [
        f"The 6.7B layout at width {width}, bf16, rank 0 of {NODES} x {RANKS_PER_NODE}; most allocated since the "
        "step began:",
        "",
        f"| mode | gathers ahead | {' (MiB) | '.join(names)} (MiB) | the larger at 6.7B (GiB) "
        "| above replicated at 6.7B (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        most = max(row["bytes"].values())
        above = f"{(most - replicated) * to_full_gib:.2f}" if row["mode"] == "node" else ""
        ahead = row["prefetch"] if row["mode"] == "node" else ""
        stretches = " | ".join(f"{row['bytes'][name] / 2**20:.2f}" for name in names)
        lines.append(f"| {row['mode']} | {ahead} | {stretches} | {most * to_full_gib:.2f} | {above} |")
    return "\n".join(lines)


def measured_alone(width: int, mode: str, prefetch: int) -> dict[str, int]:
    """`stretch_bytes` in a fresh process: the profiler's CPU memory count carries over from
    earlier sessions in a process, and counts the frees of their blocks (an earlier run's,
    collected late) against this one."""
    command = [sys.executable, os.path.abspath(__file__), "--width", str(width), "--one", mode, str(prefetch)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{mode} (gathers ahead {prefetch}) failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        mode, prefetch = args.one
        print(json.dumps(stretch_bytes(args.width, mode, int(prefetch))))
        return
    rows = [{"mode": "replicated", "prefetch": None, "bytes": measured_alone(args.width, "replicated", 0)}]
    for prefetch in args.prefetch:
        rows.append({"mode": "node", "prefetch": prefetch, "bytes": measured_alone(args.width, "node", prefetch)})
    node_gathers.emit(report(rows, args.width), args.markdown)


if __name__ == "__main__":
    sys.exit(main())
