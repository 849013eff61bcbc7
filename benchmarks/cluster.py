"""DDP against sdp4bit and its ablations on a real multi-host cluster: hosts in network namespaces
joined by a shaped link (tests/support/namespace_cluster.py), one torchrun agent per host, gloo over
TCP, on CPU.

    python benchmarks/cluster.py --out benchmarks/results/cluster_cpu_<date>.md   # needs root and iproute2
    python benchmarks/cluster.py --topologies 2x1 --links 1gbit --steps 6         # one corner

For each topology (hosts x processes per host), link rate (tbf on both directions of every host's
link; "none" = unshaped veth) and strategy, it trains the example GPT on random tokens and reports:
- step: median wall time of an optimizer step on rank 0 (s), after --warmup steps;
- tokens/s: the global batch's tokens over that median step;
- bytes per step per rank: the library's count (`comm_stats["step_bytes"]`: what a rank passes to
  its collectives; for DDP the all-reduce input, every fp32 gradient) and the veth's own tx
  counter (/sys/class/net/eth0/statistics/tx_bytes inside the host's namespace, over the timed
  steps, divided by the processes per host; traffic between two processes of one host goes over
  loopback and is not in it);
- the speedup against DDP and against sdp4bit-baseline on the same topology and link.
The compute floor is the same model in 1 process without any communication. The compression
cost is the reference ops' CPU time for one step of this model's bucket (what a rank runs on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "tests" / "support"))

STRATEGIES = ["ddp", "sdp4bit-baseline", "sdp4bit-qwd", "sdp4bit-tlq_hs", "sdp4bit"]
TX_COUNTER = "/sys/class/net/eth0/statistics/tx_bytes"


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="2x1,2x2", help="hosts x processes per host, comma-separated")
    parser.add_argument("--links", default="100mbit,1gbit,none", help="tc rates, or none (unshaped)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _module(args: argparse.Namespace):
    from gpt.module import GPTModule

    model = {"n_layer": args.n_layer, "n_head": 4, "n_embd": args.n_embd, "block_size": args.block_size}
    model.update(vocab_size=256, dropout=0.0, bias=True)
    optim = dict(lr=1e-3, min_lr=1e-4, warmup_steps=2, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    return GPTModule(model, optim)


def _strategy(name: str):
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from lightning_sdp4bit import SDP4BitStrategy

    if name == "floor":
        return SingleDeviceStrategy(device="cpu")
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    preset = name.removeprefix("sdp4bit-") if name.startswith("sdp4bit-") else "sdp4bit"
    return SDP4BitStrategy(config={"preset": preset})


def _worker(args: argparse.Namespace) -> None:
    """One rank (or the lone floor process): train, time, count, and save the figures."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from namespace_cluster import save_result

    torch.set_num_threads(1)
    local = int(os.environ.get("LOCAL_RANK", "0"))

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tx: list[int] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if len(self.times) == args.warmup and local == 0 and os.path.exists(TX_COUNTER):
                self.tx.append(int(Path(TX_COUNTER).read_text()))
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self._start)
            if len(self.times) == args.steps and self.tx:
                self.tx.append(int(Path(TX_COUNTER).read_text()))

    pl.seed_everything(0)
    module = _module(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = torch.randint(0, 256, (args.batch_size * args.steps * world, args.block_size + 1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size
    )
    measure = Measure()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local_world,
        num_nodes=world // local_world,
        strategy=_strategy(args.worker),
        precision="32-true",
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[measure],
    )
    trainer.fit(module, train_dataloaders=loader)
    params = sum(p.numel() for p in module.parameters())
    if args.worker.startswith("sdp4bit"):
        library = trainer.strategy.comm_stats["step_bytes"]
    else:
        library = 4 * params if args.worker == "ddp" else 0  # DDP: the fp32 all-reduce input
    tx = (measure.tx[1] - measure.tx[0]) / (args.steps - args.warmup) / local_world if len(measure.tx) == 2 else None
    save_result(
        {
            "step_s": statistics.median(measure.times[args.warmup :]),
            "params": params,
            "library_bytes": library,
            "tx_bytes": tx,
            "tokens_per_step": world * args.batch_size * args.block_size,
        }
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _worker_args(args: argparse.Namespace, name: str) -> list[str]:
    keep = ["--steps", args.steps, "--warmup", args.warmup, "--n-layer", args.n_layer, "--n-embd", args.n_embd]
    keep += ["--block-size", args.block_size, "--batch-size", args.batch_size, "--worker", name]
    return [str(v) for v in keep]


def _floor(args: argparse.Namespace) -> dict:
    """The compute floor: the same model in one process, no communication."""
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "CLUSTER_RESULT_DIR": directory, "RANK": "0", "PYTHONPATH": str(REPO / "examples")}
        completed = subprocess.run(
            [sys.executable, __file__, *_worker_args(args, "floor")], env=env, capture_output=True, text=True
        )
        if completed.returncode:
            raise RuntimeError(f"the floor run failed:\n{completed.stdout[-3000:]}{completed.stderr[-3000:]}")
        return torch.load(Path(directory, "rank_00000.pt"))


def _cluster_run(args: argparse.Namespace, hosts: int, nproc: int, link: str, name: str) -> dict | None:
    from namespace_cluster import Cluster

    with tempfile.TemporaryDirectory() as directory, Cluster(hosts, rate=None if link == "none" else link) as cluster:
        run = cluster.torchrun(
            __file__, _worker_args(args, name), nproc, env={"PYTHONPATH": str(REPO / "examples")}, result_dir=directory
        )
        codes = run.wait(timeout=900)
        results = run.results()
        if any(codes) or 0 not in results:
            print(f"{hosts}x{nproc} {link} {name} failed {codes}:\n{run.log_text()[-4000:]}", file=sys.stderr)
            return None
    first = results[0]
    tx = [r["tx_bytes"] for r in results.values() if r["tx_bytes"] is not None]
    return {**first, "tx_bytes": statistics.mean(tx) if tx else None}


def compression_cost(numel: int, world: int, ranks_per_node: int) -> dict[str, float]:
    """CPU seconds (best of 5, one thread) of the reference ops one rank runs per step of sdp4bit's
    defaults on a bucket of `numel` elements: {op: seconds}."""
    from lightning_sdp4bit.reference import ops

    torch.set_num_threads(1)
    nodes = world // ranks_per_node
    unit = 2048 * world  # whole weight and gradient groups in every shard
    numel = -(-numel // unit) * unit
    shard = numel // world
    grad, master, weights = torch.randn(numel), torch.randn(shard), torch.randn(numel)
    calls = {}
    if ranks_per_node > 1:
        intra = ops.torch_grad_encode(grad, nodes, ranks_per_node, 32, 8, 128, "stochastic", 1)
        inter_in = intra[:1].repeat(ranks_per_node, 1)
        calls["grad_encode"] = lambda: ops.torch_grad_encode(grad, nodes, ranks_per_node, 32, 8, 128, "stochastic", 1)
        calls["grad_requantize"] = lambda: ops.torch_grad_requantize(inter_in, 8, 4, 128, nodes, "stochastic", 2)
        decode_in = ops.torch_grad_requantize(inter_in, 8, 4, 128, nodes, "stochastic", 2)[:1].repeat(nodes, 1)
    else:
        calls["grad_encode"] = lambda: ops.torch_grad_encode(grad, 1, nodes, 32, 4, 128, "stochastic", 1)
        decode_in = ops.torch_grad_encode(grad, 1, nodes, 32, 4, 128, "stochastic", 1)
    out = torch.empty(shard)
    calls["grad_decode_sum"] = lambda: ops.torch_grad_decode_sum(decode_in, 4, 128, 32, out)
    payload = ops.torch_weight_update_encode(master, weights[:shard], 4, 2048, "stochastic", 3)
    gathered = payload.repeat(world, 1)
    calls["weight_update_encode"] = lambda: ops.torch_weight_update_encode(
        master, weights[:shard], 4, 2048, "stochastic", 3
    )
    calls["weight_update_apply"] = lambda: ops.torch_weight_update_apply(gathered, weights, 4, 2048, True)
    cost = {}
    for name, call in calls.items():
        times = []
        for _ in range(5):
            start = time.process_time()
            call()
            times.append(time.process_time() - start)
        cost[name] = min(times)
    return cost


def _load() -> str:
    return ", ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return
    from namespace_cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"benchmarks/cluster.py cannot build a cluster here: {reason}")
    names = args.strategies.split(",")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"--strategies: unknown {unknown}; choose from {STRATEGIES}")
    topologies = [tuple(int(v) for v in t.split("x")) for t in args.topologies.split(",")]
    links = args.links.split(",")
    load_before = _load()
    floor = _floor(args)
    rows = []
    for hosts, nproc in topologies:
        for link in links:
            results = {name: _cluster_run(args, hosts, nproc, link, name) for name in names}
            for name, result in results.items():
                rows.append((hosts, nproc, link, name, result, results.get("ddp"), results.get("sdp4bit-baseline")))
    load_after = _load()
    lines = [
        f"# sdp4bit on a network-namespace cluster, CPU, {datetime.date.today()}",
        "",
        f"`python benchmarks/cluster.py {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} CPU cores, torch {torch.__version__}, gloo).",
        f"GPT {args.n_layer} layers x {args.n_embd} wide ({floor['params']:,} parameters, fp32), context "
        f"{args.block_size}, batch {args.batch_size} per process; median of {args.steps - args.warmup} steps "
        f"after {args.warmup} warm-up steps; one thread per process. Load average (1, 5, 15 min) before: "
        f"{load_before}, after: {load_after}.",
        "",
        f"Compute floor (1 process, no communication): {floor['step_s']:.3f} s/step, "
        f"{floor['tokens_per_step'] / floor['step_s']:,.0f} tokens/s.",
        "",
    ]
    for hosts, nproc in topologies:
        world = hosts * nproc
        cost = compression_cost(floor["params"], world, nproc)
        detail = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in cost.items())
        lines.append(
            f"Reference compression CPU time per step and rank, {hosts}x{nproc}: {1e3 * sum(cost.values()):.0f} ms "
            f"({100 * sum(cost.values()) / floor['step_s']:.0f}% of the floor; ms: {detail})."
        )
    lines += [
        "",
        "| hosts x procs | link | strategy | step (s) | tokens/s | MB/step/rank, library | MB/step/rank, veth tx "
        "| vs DDP | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for hosts, nproc, link, name, result, ddp, baseline in rows:
        if result is None:
            lines.append(f"| {hosts}x{nproc} | {link} | {name} | failed | | | | | |")
            continue
        step = result["step_s"]
        tx = f"{result['tx_bytes'] / 1e6:.2f}" if result["tx_bytes"] is not None else "n/a"
        vs_ddp = f"{ddp['step_s'] / step:.2f}x" if ddp else ""
        vs_base = f"{baseline['step_s'] / step:.2f}x" if baseline else ""
        lines.append(
            f"| {hosts}x{nproc} | {link} | {name} | {step:.3f} | {result['tokens_per_step'] / step:,.0f} "
            f"| {result['library_bytes'] / 1e6:.2f} | {tx} | {vs_ddp} | {vs_base} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
