"""Correctness and bus bandwidth of the sdp4bit collectives on several GPUs over NCCL.

    python benchmarks/nccl_check.py --gpus 2
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python benchmarks/nccl_check.py --gpus 2   # network transport

One process per GPU, NCCL, the Triton kernels. Checks, on every topology the GPU count allows
(all ranks on one node, and one rank per node):
- the two-level reduce-scatter equals the CPU reference simulation bit for bit (nearest
  rounding), and the qWD all-gather too (two-level where there are several nodes of several
  ranks);
- the sharded engine with compression off ends with torch DDP's weights bit for bit (fp32,
  AdamW, 4 steps; two ranks sum in either order);
- with sdp4bit's defaults (stochastic rounding) every rank holds bit-identical weights after 8
  steps;
and measures the bus bandwidth of all_gather, reduce_scatter and all_to_all on 256 MiB, as
nccl-tests defines it (algorithm bandwidth x (n - 1) / n).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

from models import batch, make_model  # noqa: E402  (the tests' tiny transformer)

from lightning_sdp4bit import SDP4BitConfig  # noqa: E402
from lightning_sdp4bit.buffers import allocate_buckets, plan_buckets  # noqa: E402
from lightning_sdp4bit.collectives import TwoLevelGradReduceScatter  # noqa: E402
from lightning_sdp4bit.engine import ShardedEngine  # noqa: E402
from lightning_sdp4bit.reference.simulate import (  # noqa: E402
    simulate_two_level_reduce_scatter,
    simulate_weight_all_gather,
)
from lightning_sdp4bit.schedule import exchange_stream  # noqa: E402
from lightning_sdp4bit.stats import WireMeter  # noqa: E402
from lightning_sdp4bit.topology import Topology, create_process_groups  # noqa: E402
from lightning_sdp4bit.weight_collectives import QuantizedWeightAllGather  # noqa: E402


def _bucket(world, rank, numel, dtype, device, alignment):
    param = nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))
    (layout,) = plan_buckets([("p", (numel,), dtype)], world, 10**9, alignment)
    (bucket,) = allocate_buckets([layout], {"p": param}, rank)
    return bucket


def _check_collectives(rank, world, ranks_per_node, device) -> list[str]:
    failures = []
    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    config = SDP4BitConfig(rounding="nearest", ranks_per_node=ranks_per_node)
    bucket = _bucket(world, rank, 300_000, torch.float32, device, 2048)
    grads = [torch.randn(bucket.layout.numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    stream = exchange_stream(device)  # the second stages queued on a side stream, as in the engine
    collective = TwoLevelGradReduceScatter(config, topology, groups, WireMeter(), rank, stream)
    pending = collective.start(bucket, grads[rank].to(device), 1.0, 0)
    pending.wait()
    expected = simulate_two_level_reduce_scatter(
        grads, ranks_per_node, intra_bits=8, inter_bits=4, group_size=128, hadamard_size=32
    )[rank]
    if not torch.equal(bucket.grad_shard.cpu(), expected):
        failures.append(f"two-level reduce-scatter, {ranks_per_node} per node")
    weights = _bucket(world, rank, 300_000, torch.bfloat16, device, 2048)
    start = torch.randn(weights.layout.numel, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    weights.weights.copy_(start)
    shard = weights.layout.shard_numel
    noise = torch.randn(world, shard, generator=torch.Generator().manual_seed(7))  # the same on every rank
    masters = [start[r * shard : (r + 1) * shard].float() + 1e-3 * noise[r] for r in range(world)]
    weights.master.copy_(masters[rank])
    QuantizedWeightAllGather(config, topology, groups, WireMeter(), True, stream).start(weights, 0).wait()
    expected = simulate_weight_all_gather(masters, start, additive=True, bits=4, group_size=2048)
    if not torch.equal(weights.weights.cpu(), expected):
        failures.append(f"qWD all-gather, {ranks_per_node} per node")
    return failures


def _train(rank, world, preset, device, use_ddp, steps):
    torch.manual_seed(0)
    model = make_model(0).to(device)
    topology = Topology(rank, world, world)
    if use_ddp:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        net = model
        engine = ShardedEngine(model, SDP4BitConfig.preset(preset), topology, create_process_groups(topology))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    if not use_ddp:
        engine.shard_optimizer(optimizer)
    for step in range(steps):
        tokens = batch(rank, step).to(device)
        logits = net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if not use_ddp:
            engine.pre_backward()
        loss.backward()
        if not use_ddp:
            engine.post_backward()
            engine.pre_optimizer_step()
        optimizer.step()
        if not use_ddp:
            engine.post_optimizer_step()
        optimizer.zero_grad()
    if not use_ddp:
        engine.wait_weights()
        engine.close()
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _bus_bandwidth(rank, world, device) -> dict[str, float]:
    numel = 256 * 2**20 // 4
    source = torch.randn(numel, device=device)
    shard = torch.empty(numel // world, device=device)
    received = torch.empty_like(source)
    ops = {
        "all_gather": lambda: dist.all_gather_into_tensor(received, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, source),
        "all_to_all": lambda: dist.all_to_all_single(received, source),
    }
    out = {}
    for name, op in ops.items():
        for _ in range(3):
            op()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            op()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 10
        out[name] = 4 * numel / seconds / 1e9 * (world - 1) / world  # GB/s, nccl-tests' busbw
    return out


def _worker(rank, world, port, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        failures = []
        for ranks_per_node in [d for d in range(1, world + 1) if world % d == 0]:
            failures += _check_collectives(rank, world, ranks_per_node, device)
        ddp = _train(rank, world, "baseline", device, True, 4)
        ours = _train(rank, world, "baseline", device, False, 4)
        if world == 2 and not torch.equal(ddp, ours):
            failures.append(f"baseline vs DDP: max difference {(ddp - ours).abs().max().item():.3g}")
        compressed = _train(rank, world, "sdp4bit", device, False, 8)
        everyone = [torch.empty_like(compressed) for _ in range(world)]
        dist.all_gather(everyone, compressed)
        if not all(torch.equal(everyone[0], other) for other in everyone):
            failures.append("sdp4bit replicas differ across ranks")
        queue.put((rank, failures, _bus_bandwidth(rank, world, device)))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, [traceback.format_exc()], {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(r, args.gpus, port, queue)) for r in range(args.gpus)]
    for p in processes:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in processes)
    for p in processes:
        p.join()
    transport = "network only (P2P and SHM off)" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "NVLink/P2P"
    failures = [f for _, rank_failures, _ in results for f in rank_failures]
    print(f"{args.gpus} GPUs, NCCL over {transport}: {'all checks passed' if not failures else 'FAILURES'}")
    for failure in failures:
        print("  -", failure)
    bandwidth = results[0][2]
    if bandwidth:
        print("bus bandwidth, 256 MiB fp32 (GB/s): " + ", ".join(f"{k} {v:.0f}" for k, v in bandwidth.items()))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
