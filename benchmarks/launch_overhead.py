"""Host time per call of the five compression ops on one CUDA GPU: what the engine pays per
bucket and step before the GPU sees any work.

    python benchmarks/launch_overhead.py [--numel 1048576] [--calls 300] [--markdown out.md]

Each op runs `--calls` times back to back on a small bucket (1 Mi elements by default, a few
microseconds of GPU time), so the loop is bound by the host: wall time / calls is the host's
time per call. Four ways in:
- "custom op": `torch.ops.sdp4bit.<op>`, the dispatcher's way (what torch.compile's graphs call);
- "wrapper": `lightning_sdp4bit.kernels.<op>`, the argument checks plus the Triton launcher (in
  eager mode the wrapper skips the dispatcher, see `kernels._common.eager`);
- "launcher": the launch function alone, no checks;
- "launcher, Triton's path": the same with `kernels._launch` keeping no compiled kernel, so that
  every launch goes through `kernel[grid]` (what every launch cost before `_launch`).
"""

from __future__ import annotations

import argparse
import importlib
import time
from unittest import mock

import torch
from lightning_sdp4bit.kernels import _launch

from lightning_sdp4bit import kernels

# The modules, not the functions of the same names that the package exports.
grad_encode_module = importlib.import_module("lightning_sdp4bit.kernels.grad_encode")
grad_reduce = importlib.import_module("lightning_sdp4bit.kernels.grad_reduce")
weight_update = importlib.import_module("lightning_sdp4bit.kernels.weight_update")


def _calls(numel: int) -> dict[str, tuple]:
    """op -> (custom op, wrapper, launcher, the arguments all three take)."""
    device = "cuda"
    master = torch.randn(numel, device=device)
    weights = master.bfloat16()
    grad = torch.randn(8 * numel, device=device, dtype=torch.bfloat16)
    weight_payload = kernels.weight_update_encode(master, weights, 4, 2048, "stochastic", 1)
    gathered = weight_payload.repeat(8, 1)
    full = torch.empty(8 * numel, device=device, dtype=torch.bfloat16)
    intra = kernels.grad_encode(grad, 2, 4, 32, 8, 128, "stochastic", 1, 0.125)
    inter = kernels.grad_requantize(intra, 8, 4, 128, 2, "stochastic", 1)
    shard = torch.empty(numel, device=device)
    ops = torch.ops.sdp4bit
    return {
        "weight_update_encode": (
            ops.weight_update_encode,
            kernels.weight_update_encode,
            weight_update._weight_update_encode,
            (master, weights, 4, 2048, "stochastic", 1),
        ),
        "weight_update_apply": (
            ops.weight_update_apply,
            kernels.weight_update_apply,
            weight_update._weight_update_apply,
            (gathered, full, 4, 2048, True),
        ),
        "grad_encode": (
            ops.grad_encode,
            kernels.grad_encode,
            grad_encode_module._grad_encode,
            (grad, 2, 4, 32, 8, 128, "stochastic", 1, 0.125),
        ),
        "grad_requantize": (
            ops.grad_requantize,
            kernels.grad_requantize,
            grad_reduce._grad_requantize,
            (intra, 8, 4, 128, 2, "stochastic", 1),
        ),
        "grad_decode_sum": (
            ops.grad_decode_sum,
            kernels.grad_decode_sum,
            grad_reduce._grad_decode_sum,
            (inter, 4, 128, 32, shard),
        ),
    }


class _KeepsNothing(dict):
    """In place of `_launch`'s cache of compiled kernels: nothing is kept, every launch takes Triton's path."""

    def __setitem__(self, key, value) -> None:
        pass


def _host_us(fn, args, calls: int) -> float:
    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements of a shard (the bucket is 8x)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_overhead.py needs a CUDA GPU: it measures the host time of kernel launches")
    lines = [
        f"Host time per call (us), {args.calls} calls of each op on a {args.numel:,}-element shard "
        f"(grad ops: a bucket of 8 shards, 2 nodes x 4), {torch.cuda.get_device_name()}, torch {torch.__version__}.",
        "",
        "| op | custom op | wrapper (eager) | launcher only | launcher, Triton's path |",
        "|---|---|---|---|---|",
    ]
    for name, (*ways, arguments) in _calls(args.numel).items():
        figures = [_host_us(fn, arguments, args.calls) for fn in ways]
        with mock.patch.object(_launch, "_compiled", _KeepsNothing()):
            figures.append(_host_us(ways[-1], arguments, args.calls))
        lines.append(f"| {name} | " + " | ".join(f"{us:.1f}" for us in figures) + " |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
