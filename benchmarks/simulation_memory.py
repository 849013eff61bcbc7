"""Peak memory of a simulated job on the CPU, per parameter: how large a model a laptop can simulate.

    python benchmarks/simulation_memory.py                       # 2 x 2, sdp4bit and baseline, 3 sizes
    python benchmarks/simulation_memory.py --world 2x2 --layers 4,12 --presets sdp4bit

Each row runs in a fresh process: the GPT of the GPU accuracy study (768 wide, 12 heads, byte
tokens) with --layers layers, in fp32, trained for two simulated steps of one 256-token sequence per
rank (`lightning_sdp4bit.simulation` through benchmarks/accuracy_gpu.py's `build` and eager
`RankPasses`). The figure is the process's peak resident memory less what it held after importing
torch, divided by the parameters; the slope between sizes removes what does not grow with them.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

from cli_args import simulated_world

HERE = Path(__file__).resolve().parent


def _row(preset: str, layers: int, world: str) -> tuple[int, float]:
    """In this process: (parameters, MiB of peak resident memory above the import)."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    import torch
    from accuracy_gpu import RankPasses, Study, build

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    study = Study(n_layer=layers, n_embd=768, n_head=12, block_size=256, world=world)
    model, engine, _, _ = build(study, preset, 0, torch.device("cpu"))
    tokens = torch.randint(0, 256, (study.ranks, 1, study.block_size + 1), generator=torch.Generator().manual_seed(0))
    passes, losses = RankPasses(model, engine, tokens[0], graphed=False), torch.zeros(())
    for _ in range(2):
        passes.step(tokens, losses)
        engine.optimizer_step(1.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return sum(p.numel() for p in model.parameters()), peak - before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world", type=simulated_world, default="2x2", help="the simulated job, NODESxRANKS (default 2x2)"
    )
    parser.add_argument("--layers", default="4,8,12", help="comma list of layer counts (default 4,8,12)")
    parser.add_argument("--presets", default="sdp4bit,baseline", help="comma list (default sdp4bit,baseline)")
    parser.add_argument("--child", nargs=3, metavar=("PRESET", "LAYERS", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        params, mib = _row(args.child[0], int(args.child[1]), args.child[2])
        print(f"{params} {mib}")
        return
    try:
        layers = [int(n) for n in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers: {args.layers!r} is not a comma list of integers")
    if not layers or min(layers) < 1:
        parser.error("--layers: every count must be at least 1")
    print(f"Simulated {args.world} on the CPU, fp32, two steps of one 256-token sequence per rank:\n")
    print("| preset | layers | parameters | peak above import (MiB) | bytes per parameter |")
    print("|---|---|---|---|---|")
    for preset in args.presets.split(","):
        rows = []
        for n in layers:
            command = [sys.executable, __file__, "--child", preset, str(n), args.world]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{preset}, {n} layers failed:\n{done.stderr[-3000:]}")
            params, mib = done.stdout.split()[-2:]
            rows.append((int(params), float(mib)))
            per_param = float(mib) * 2**20 / int(params)
            print(f"| {preset} | {n} | {int(params) / 1e6:.1f}M | {float(mib):.0f} | {per_param:.1f} |")
        if len(rows) > 1:
            slope = (rows[-1][1] - rows[0][1]) * 2**20 / (rows[-1][0] - rows[0][0])
            print(f"| {preset} | slope | | | **{slope:.1f}** |")


if __name__ == "__main__":
    main()
