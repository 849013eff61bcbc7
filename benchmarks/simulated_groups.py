"""The host-side cost of one simulated collective (`lightning_sdp4bit.simulation.groups`): what a
simulated job pays to move and sum its ranks' payloads in one process.

    python benchmarks/simulated_groups.py [--device cuda] [--repeats 5]

Every member of a group of P launches the collective on its own [P x n] payload; the table gives
the best of --repeats times of all P launches and the completion (on a GPU, synchronised). The
shapes are those of the accuracy study's two-level exchanges at 16 x 4: 4-rank intra-node groups
and 16-rank inter-node groups, fp32 payloads for the uncompressed gradients and uint8 for codes.
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_sdp4bit.simulation.groups import SimulatedGroup

CASES = [
    ("reduce_scatter", 4, 2_000_000, torch.float32),
    ("reduce_scatter", 16, 500_000, torch.float32),
    ("all_to_all", 4, 2_000_000, torch.uint8),
    ("all_to_all", 16, 500_000, torch.uint8),
]


def best_ms(op: str, members: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    group = SimulatedGroup(members)
    inputs = [torch.randint(0, 100, (members * n,), device=device).to(dtype) for _ in range(members)]
    outputs = [torch.empty(n if op == "reduce_scatter" else members * n, dtype=dtype, device=device) for _ in inputs]
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        works = [getattr(group.member(i), op)(outputs[i], inputs[i], async_op=True) for i in range(members)]
        for work in works:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each case; the best is shown (default 5)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    device = torch.device(args.device)
    print(f"| collective | members x elements | dtype | best of {args.repeats} (ms) |")
    print("|---|---|---|---|")
    for op, members, n, dtype in CASES:
        ms = best_ms(op, members, n, dtype, device, args.repeats)
        print(f"| {op} | {members} x {n:,} | {str(dtype).removeprefix('torch.')} | {ms:.1f} |")


if __name__ == "__main__":
    main()
