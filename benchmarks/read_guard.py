"""Host cost of the read guard (lightning_sdp4bit.weight_access.ReadGuard) per torch operation.

    python3 benchmarks/read_guard.py

While weight all-gathers are in flight after an optimizer step, every torch operation passes
through the guard's `__torch_function__` (one Python call and a dict lookup per tensor argument).
This times a small op (torch.add on 4 floats, so that the op itself is a few microseconds of
dispatch) plain, with the guard pushed and `--params` parameters pending, and with the guard
pushed and nothing pending: the three interleaved, best of --repeats runs of --ops ops each,
one thread.
"""

from __future__ import annotations

import argparse
import time

import torch
from cli_args import at_least
from torch import nn

from lightning_sdp4bit.weight_access import ReadGuard


def per_op_us(ops: int) -> float:
    x, y = torch.randn(4), torch.randn(4)
    start = time.perf_counter()
    for _ in range(ops):
        torch.add(x, y)
    return (time.perf_counter() - start) / ops * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=at_least(1), default=20000)
    parser.add_argument("--repeats", type=at_least(1), default=15)
    parser.add_argument("--params", type=at_least(1), default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    params = [nn.Parameter(torch.zeros(1)) for _ in range(args.params)]
    best = {"plain": float("inf"), "pending": float("inf"), "landed": float("inf")}
    # Interleaved, so that a busy machine slows every case alike; best of each.
    for _ in range(args.repeats):
        best["plain"] = min(best["plain"], per_op_us(args.ops))
        for case in ("pending", "landed"):
            guard = ReadGuard(lambda index: None)
            if case == "pending":
                guard.expect(0, params)
            guard.open()
            try:
                best[case] = min(best[case], per_op_us(args.ops))
            finally:
                guard.close()
    plain = best["plain"]
    print("| guard | µs per torch.add | added |")
    print("|---|---:|---:|")
    print(f"| none | {plain:.2f} | |")
    print(f"| pushed, {args.params} parameters pending | {best['pending']:.2f} | {best['pending'] - plain:+.2f} |")
    print(f"| pushed, nothing pending | {best['landed']:.2f} | {best['landed'] - plain:+.2f} |")


if __name__ == "__main__":
    main()
