"""The engine's control path on the host: what a step costs besides the kernels' own work.

    python benchmarks/control_path.py --world 64 --layers 64          # CPU, about 30 s

On the CPU, a small GPT (--layers x 64 wide, one bucket per parameter: 4 + 12 x layers buckets)
runs the engine's step as rank 0 of --world ranks over the emulated network
(benchmarks/emulation.py; 4 ranks per node), with the five quantization ops replaced by their
first output for each input shape, so that neither they nor the CPU reference's arithmetic
count. What is left is the engine's own Python: the schedule, the buckets, the hooks, the
collectives' bookkeeping, and the model's own ops. Printed: the plain step (no strategy), the
engine's step, the difference per bucket, and the Python calls a step (cProfile's count,
deterministic, unlike the times on a shared machine). The GPU runs the same Python with kernels
instead of the CPU reference: the host time it adds there is of this order.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from emulated_runs import ModelSpec, row_config
from emulation import Network
from gpt_step import engine_step, make_optimizer, plain_step

from lightning_sdp4bit import ops
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology

QUANTIZATION_OPS = {  # name -> the argument returned in place (None: a fresh tensor)
    "weight_update_encode": None,
    "weight_update_apply": 1,
    "grad_encode": None,
    "grad_requantize": None,
    "grad_decode_sum": 4,
}


def replace_quantization_ops() -> None:
    """Each op returns, after its first call per input shape, an empty tensor of that call's
    output shape (or its in-place argument): the control path runs as before, the work is gone."""
    for name, in_place in QUANTIZATION_OPS.items():
        op, outputs = getattr(ops, name), {}

        def cached(*args, _op=op, _outputs=outputs, _in_place=in_place, **kwargs):
            key = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
            if key not in _outputs:
                _outputs[key] = _op(*args, **kwargs)
            return args[_in_place] if _in_place is not None else torch.empty_like(_outputs[key])

        setattr(ops, name, cached)


def _ms_per_step(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _calls_per_step(step, steps: int) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return pstats.Stats(profile).total_calls / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=64, help="ranks of the emulated job, 4 per node (default 64)")
    parser.add_argument("--layers", type=int, default=24, help="GPT blocks (default 24)")
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after 3 untimed (default 20)")
    args = parser.parse_args()
    if args.world < 4 or args.world % 4 or args.layers < 1 or args.steps < 1:
        parser.error("--world must be a multiple of 4 (4 ranks per node); --layers and --steps at least 1")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    replace_quantization_ops()
    device, topology = torch.device("cpu"), Topology(0, args.world, 4)
    spec = ModelSpec(args.layers, 64, batch=1, seq=8, n_head=4, vocab=256)
    tokens = spec.tokens(device)
    model = spec.build(device)
    optimizer = make_optimizer(model.parameters(), device)
    plain = lambda: plain_step(model, optimizer, tokens)  # noqa: E731
    _ms_per_step(plain, 3)
    plain_ms, plain_calls = _ms_per_step(plain, args.steps), _calls_per_step(plain, args.steps)
    network = Network(device, topology, "own")
    with network.install():
        model = spec.build(device)
        engine = ShardedEngine(model, row_config(args.preset, 4, 1), topology, network.groups())
        optimizer = make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        step = lambda: engine_step(model, engine, optimizer, tokens)  # noqa: E731
        _ms_per_step(step, 3)
        engine_ms, engine_calls = _ms_per_step(step, args.steps), _calls_per_step(step, args.steps)
        buckets = len(engine.buckets)
        engine.close()
    print(f"{args.preset}, rank 0 of {args.world} (4 a node), {args.layers} x 64 GPT, {buckets} buckets, CPU")
    print("| step | host ms (median) | Python calls a step |")
    print("|---|---|---|")
    print(f"| plain | {plain_ms:.2f} | {plain_calls:,.0f} |")
    print(f"| engine | {engine_ms:.2f} | {engine_calls:,.0f} |")
    per_bucket = (engine_ms - plain_ms) / buckets
    print(f"| engine - plain, per bucket | {per_bucket:.3f} | {(engine_calls - plain_calls) / buckets:,.0f} |")


if __name__ == "__main__":
    main()
