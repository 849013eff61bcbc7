"""Speed of the five compression kernels against their reference twins, on one CUDA GPU.

    python benchmarks/kernels.py                        # the table, sizes 1 MiB .. 1 GiB
    python benchmarks/kernels.py --sizes 256,1024       # input sizes in MiB
    python benchmarks/kernels.py --no-compile           # skip torch.compile of the references
    python benchmarks/kernels.py --markdown out.md      # also write the tables as Markdown
    python benchmarks/kernels.py --flush write          # evict the L2 as triton.testing.do_bench does

For each op and input size it times three implementations: the eager reference
(`lightning_sdp4bit.reference.ops`), the same reference under torch.compile(dynamic=True), and
our Triton kernel. Each call is timed alone with CUDA events, after the L2 has been emptied of
its data, and the table gives the median. By default the L2 is emptied by reading a 256 MiB
buffer. `--flush write` zeroes the buffer instead, as triton.testing.do_bench does, which leaves
the L2 full of dirty lines: the timed call then pays for writing them back, 4 to 7 us on the
H200 that are not its own, a visible share of a 100 us call. GB/s counts the fewest bytes each must move:
every input read once and every output written once. "% copy" compares that with a
device-to-device copy of 1 GiB measured in the same run (bytes read + written). Sizes up to
--check-up-to are checked first: the kernel with nearest rounding must give the bytes of the
reference run on the CPU ("exact").

The ops run with the paper's settings and its rounding (stochastic), for 4 nodes of 8 GPUs:
| op | input | settings |
|---|---|---|
| weight_update_encode | master fp32 [S] + weights bf16 [S] | 4 bits, group 2048 |
| weight_update_apply | payload [8, row(S)] + weights bf16 [8 S] | 4 bits, group 2048, in place |
| grad_encode | gradient fp32 [N], as [4 nodes, 8 ranks, S] | Hadamard 32, 8 bits, group 128 |
| grad_requantize | payload [8 peers, row(4 S)], 8 bits | to 4 bits, group 128 |
| grad_decode_sum | payload [4 nodes, row(S)], 4 bits | group 128, inverse Hadamard 32 |
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from lightning_sdp4bit import kernels
from lightning_sdp4bit.reference import ops as reference

NODES, RANKS_PER_NODE = 4, 8
MiB = 2**20


@dataclass
class Case:
    """One op at one size: its two implementations, their arguments and the bytes they must move."""

    inputs: int  # bytes read
    outputs: int  # bytes written
    reference: Callable  # the twin in lightning_sdp4bit.reference.ops
    kernel: Callable  # the Triton kernel in lightning_sdp4bit.kernels
    args: Callable[[str], tuple]  # rounding -> the positional arguments both take


def _elements(size: float, bytes_per_element: float, granule: int) -> int:
    """The most elements, a multiple of `granule`, whose inputs fit in `size` bytes."""
    return max(granule, int(size / bytes_per_element) // granule * granule)


def _data(numel: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(numel, device="cuda") * torch.rand(numel, device="cuda").pow(4)).to(dtype)


def _row_bytes(numel: int, bits: int, group: int) -> int:
    return reference.payload_row_bytes(numel, bits, group)


def weight_update_encode(size: int) -> Case:
    bits, group = 4, 2048
    shard = _elements(size, 6, group)
    master = _data(shard)
    weights = (master + 1e-2 * _data(shard)).bfloat16()
    return Case(
        6 * shard,
        _row_bytes(shard, bits, group),
        reference.torch_weight_update_encode,
        kernels.weight_update_encode,
        lambda r: (master, weights, bits, group, r, 1),
    )


def weight_update_apply(size: int) -> Case:
    bits, group, ranks = 4, 2048, RANKS_PER_NODE
    shard = _elements(size / ranks, 2 + bits / 8 + 4 / group, group)
    payload = reference.encode_rows(1e-3 * _data(ranks * shard).view(ranks, shard), bits, group, "nearest", 0)
    weights = _data(ranks * shard, torch.bfloat16)
    return Case(
        payload.numel() + 2 * weights.numel(),
        2 * weights.numel(),
        reference.torch_weight_update_apply,
        kernels.weight_update_apply,
        lambda r: (payload, weights, bits, group, True),  # no rounding: it only dequantizes
    )


def grad_encode(size: int) -> Case:
    bits, group, hadamard = 8, 128, 32
    grad = _data(_elements(size, 4, NODES * RANKS_PER_NODE * group))
    return Case(
        4 * grad.numel(),
        RANKS_PER_NODE * _row_bytes(grad.numel() // RANKS_PER_NODE, bits, group),
        reference.torch_grad_encode,
        kernels.grad_encode,
        lambda r: (grad, NODES, RANKS_PER_NODE, hadamard, bits, group, r, 1),
    )


def grad_requantize(size: int) -> Case:
    in_bits, out_bits, group, peers = 8, 4, 128, RANKS_PER_NODE
    numel = _elements(size / peers, in_bits / 8 + 4 / group, NODES * group)  # outer * S
    payload = reference.encode_rows(_data(peers * numel).view(peers, numel), in_bits, group, "nearest", 0)
    return Case(
        payload.numel(),
        NODES * _row_bytes(numel // NODES, out_bits, group),
        reference.torch_grad_requantize,
        kernels.grad_requantize,
        lambda r: (payload, in_bits, out_bits, group, NODES, r, 1),
    )


def grad_decode_sum(size: int) -> Case:
    bits, group, hadamard, peers = 4, 128, 32, NODES
    shard = _elements(size / peers, bits / 8 + 4 / group, group)
    payload = reference.encode_rows(_data(peers * shard).view(peers, shard), bits, group, "nearest", 0)
    out = torch.empty(shard, device="cuda")
    return Case(
        payload.numel(),
        4 * shard,
        reference.torch_grad_decode_sum,
        kernels.grad_decode_sum,
        lambda r: (payload, bits, group, hadamard, out),  # no rounding: it only dequantizes
    )


OPS = [weight_update_encode, weight_update_apply, grad_encode, grad_requantize, grad_decode_sum]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns."""
    if a.dtype in (torch.float32, torch.bfloat16):
        as_int = torch.int32 if a.dtype == torch.float32 else torch.int16
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


class Timer:
    """Median milliseconds of one call, each call timed alone with CUDA events after the L2 has
    been emptied of the call's data by streaming a 256 MiB buffer through it (read or written,
    see the module docstring). About 100 ms of calls are timed, at least 10, after about 250 ms of
    warm-up."""

    def __init__(self, flush: str) -> None:
        self._buffer = torch.empty(256 * MiB // 4, dtype=torch.int32, device="cuda")
        self._evict = self._buffer.zero_ if flush == "write" else self._buffer.sum

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(int(250 / estimate)):  # long enough for the clocks to come back up after a compile
            fn()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(max(10, int(100 / estimate)))
        ]
        for start, end in events:
            self._evict()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(timer: Timer) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda: dst.copy_(src)) / 1e6


def check(case: Case) -> bool:
    """Whether the kernel with nearest rounding returns the bytes of the reference run on the CPU,
    the executable spec (on CUDA tensors PyTorch divides by a Python number through its rounded
    reciprocal, so the reference there is not the IEEE quotient the spec means)."""
    expected = case.reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in case.args("nearest")))
    return _same(case.kernel(*case.args("nearest")).cpu(), expected)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64,256,512,1024", help="input sizes in MiB, comma-separated")
    parser.add_argument("--ops", default=",".join(op.__name__ for op in OPS), help="which ops, comma-separated")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    parser.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    parser.add_argument(
        "--check-up-to", type=float, default=16, help="check bytes against the CPU reference up to this size (MiB)"
    )
    parser.add_argument("--markdown", help="also write the tables to this Markdown file")
    parser.add_argument(
        "--flush", default="read", choices=["read", "write"], help="how the L2 is emptied before each timed call"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    timer = Timer(args.flush)
    copy = copy_bandwidth(timer)
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"device-to-device copy: {copy:.0f} GB/s; rounding: {args.rounding}; L2 emptied by a {args.flush}"
    )
    print(header, flush=True)
    lines = [header, ""]
    for op in (op for op in OPS if op.__name__ in args.ops.split(",")):
        compiled = None
        rows = [
            f"### {op.__name__}",
            "",
            "| input MiB | moved MB | exact | eager ms | eager GB/s | eager % | compile ms | compile GB/s "
            "| compile % | kernel ms | kernel GB/s | kernel % |",
            "|" + "---|" * 12,
        ]
        print("\n".join(rows), flush=True)
        for size in sizes:
            case = op(size)
            moved = case.inputs + case.outputs
            exact = "-" if size > args.check_up_to * MiB else "yes" if check(case) else "**NO**"
            cells = [f"{case.inputs / MiB:.1f}", f"{moved / 1e6:.1f}", exact]
            impls = {"eager": case.reference, "compile": None, "kernel": case.kernel}
            if not args.no_compile:
                if compiled is None:  # one compilation per op serves every size (dynamic shapes)
                    start = time.time()
                    compiled = torch.compile(case.reference, dynamic=True)
                    compiled(*case.args(args.rounding))
                    print(f"(torch.compile of the reference: first call {time.time() - start:.0f} s)", flush=True)
                impls["compile"] = compiled
            call = case.args(args.rounding)
            for impl in impls.values():
                if impl is None:
                    cells += ["-", "-", "-"]
                    continue
                ms = timer(lambda impl=impl, call=call: impl(*call))
                gbs = moved / ms / 1e6
                cells += [f"{ms:.3f}", f"{gbs:.0f}", f"{100 * gbs / copy:.0f}"]
            rows.append("| " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
            del case, call
            torch.cuda.empty_cache()
        lines += rows + [""]
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
