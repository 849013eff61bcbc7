"""Bytes per parameter each GPU puts on NVLink and on its NIC in one step, per preset and topology,
and the speed-ups they allow when the network is the bottleneck: the limits of the
emulated-network figures, on the CPU in a minute.

    python benchmarks/link_bytes.py                       # 2 x 4, 16 x 4 and 8 x 8
    python benchmarks/link_bytes.py --topologies 16x4 --markdown out.md

The engine runs one GPT (--layers x --width) on the CPU as rank 0 of the job, over the emulated
network of emulation.py at 1 GB/s on both links and no latency, so that each lane's busy
nanoseconds are its bytes (the ring's bytes per rank, as emulation.py charges them). Compression
works per element (4-bit codes and one scale per group), so bytes per element of the flat buffers
carry over to any model size: an N-parameter model with buckets of millions of elements (whose
padding to whole quantization groups is negligible) puts N times the figure on each link per step.
The small model's own padding is not: per parameter it would read up to 15% higher (at W = 64).

Columns: NVLink and NIC bytes per parameter per step; the step a link alone would allow at
100 Gb/s per 4-GPU node (3.125 GB/s per GPU) or 400 Gb/s per GPU, per billion parameters; and
the NIC-bound speed-up against the baseline preset and against DDP (a flat bf16 ring: 2(W-1)/W x
2 bytes per parameter on each GPU's NIC share; a two-level one: 2(M-1)/M x 2 / L); and the latency
one bucket's exchanges pay on the NIC at eth100's latencies (emulated_runs.SCENARIO_LATENCY_US:
10 us a message step across nodes), and what the step's few small all-reduces pay, which the
emulation adds to the bytes' time. When both sides
are NIC-bound, the step ratio is the NIC bytes' ratio: that is the most the emulated figures can
show; compute that does not hide under the link brings a ratio down towards 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from emulated_runs import SCENARIO_LATENCY_US, row_config  # noqa: E402
from emulation import Network  # noqa: E402
from gpt_step import build_gpt, engine_step, make_optimizer, random_tokens  # noqa: E402

from lightning_sdp4bit.engine import ShardedEngine  # noqa: E402
from lightning_sdp4bit.topology import Topology  # noqa: E402

PRESETS = ("baseline", "qwd", "tlq_hs", "sdp4bit", "qw+ulq")
LINKS_GBS = {"100 Gb/s per 4-GPU node": 100 / 4 / 8, "400 Gb/s per GPU": 400 / 8}


def bytes_per_element(preset: str, topology: Topology, args) -> tuple[float, float, float, float]:
    """(NVLink, NIC) bytes per flat-buffer element per step on rank 0, after --warmup steps, and the
    microseconds of latency the NIC charges at eth100's per-step latencies: per bucket (its
    exchanges across nodes), and per step (the world group's small all-reduces)."""
    device = torch.device("cpu")
    network = Network(device, topology, "own")
    with network.install():
        model = build_gpt(args.layers, 4, args.width, 32, device, vocab=512)  # bf16, as on the GPU
        engine = ShardedEngine(model, row_config(preset, topology.ranks_per_node, None), topology, network.groups())
        optimizer = make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        tokens = random_tokens(2, 32, device, vocab=512)
        for _ in range(args.warmup):
            engine_step(model, engine, optimizer, tokens)
        network.set_rates(1.0, 1.0, *SCENARIO_LATENCY_US["eth100"])  # 1 GB/s = 1 byte per ns
        network.reset()
        engine_step(model, engine, optimizer, tokens)
        busy = network.link_busy_ns()
        per_step = network.world.latency_ns + network.lightning.latency_ns
        engine.close()
    # Per element of the flat buffers, not per parameter: each bucket is zero-padded to whole
    # quantization groups per shard, up to W x 2048 elements (15% more elements than parameters
    # in this small model at W = 64, at most 0.5% of a 25M-element bucket), and the padding
    # travels too. Per element is what a large model pays per parameter.
    elements = sum(bucket.layout.numel for bucket in engine.buckets)
    nvlink, nic = busy["nvlink"] - network.intra.latency_ns, busy["nic"] - network.inter.latency_ns - per_step
    return nvlink / elements, nic / elements, network.inter.latency_ns / 1e3 / len(engine.buckets), per_step / 1e3


def table(topology: Topology, args) -> str:
    world, local = topology.world_size, topology.ranks_per_node
    nodes = world // local
    ddp_flat = 2 * (world - 1) / world * 2
    ddp_two_level = 2 * (nodes - 1) / nodes * 2 / local
    rows = {preset: bytes_per_element(preset, topology, args) for preset in PRESETS}
    lines = [
        f"#### {nodes} nodes x {local} GPUs (W = {world})",
        "",
        "| row | NVLink B/param | NIC B/param | "
        + " | ".join(f"NIC ms per 1B params, {name}" for name in LINKS_GBS)
        + " | x baseline (NIC-bound) | x flat DDP | x two-level DDP | NIC latency per bucket, per step (us) |",
        "|---|---|---|" + "---|" * len(LINKS_GBS) + "---|---|---|---|",
    ]
    for name, nic in (("DDP, flat ring", ddp_flat), ("DDP, two-level", ddp_two_level)):
        link_ms = " | ".join(f"{nic / gbs * 1e3:.0f}" for gbs in LINKS_GBS.values())
        lines.append(f"| {name} | - | {nic:.3f} | {link_ms} | - | - | - | - |")
    for preset, (nvlink, nic, per_bucket, per_step) in rows.items():
        link_ms = " | ".join(f"{nic / gbs * 1e3:.0f}" for gbs in LINKS_GBS.values())
        lines.append(
            f"| {preset} | {nvlink:.3f} | {nic:.3f} | {link_ms} | {rows['baseline'][1] / nic:.2f} "
            f"| {ddp_flat / nic:.2f} | {ddp_two_level / nic:.2f} | {per_bucket:.0f}, {per_step:.0f} |"
        )
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="2x4,16x4,8x8", help="comma list of NODESxGPUS (default 2x4,16x4,8x8)")
    parser.add_argument("--layers", type=int, default=4, help="GPT layers (default 4)")
    parser.add_argument("--width", type=int, default=256, help="GPT width (default 256)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the counted one (default 2)")
    parser.add_argument("--markdown", default=None, help="also append the tables to this file")
    args = parser.parse_args(argv)
    topologies = []
    for spec in args.topologies.split(","):
        try:
            nodes, local = (int(part) for part in spec.lower().split("x"))
        except ValueError:
            parser.error(f"--topologies: {spec!r} is not NODESxGPUS, e.g. 16x4")
        if nodes < 2 or local < 1:
            parser.error(f"--topologies: {spec!r}: at least 2 nodes of at least 1 GPU (one node has no NIC)")
        topologies.append(Topology(0, nodes * local, local))
    if args.layers < 1 or args.width < 64 or args.width % 64 or args.warmup < 1:
        parser.error("--layers >= 1, --width a multiple of 64 and --warmup >= 1")
    torch.manual_seed(0)
    text = "\n".join(table(topology, args) for topology in topologies)
    header = (
        "### Bytes on each link per element of the flat buffers (a large model's per parameter) and step "
        f"(GPT {args.layers} x {args.width}, CPU, "
        f"`python benchmarks/link_bytes.py {' '.join(sys.argv[1:] if argv is None else argv)}`)\n"
    )
    print(header + "\n" + text)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(header + "\n" + text + "\n")


if __name__ == "__main__":
    main()
