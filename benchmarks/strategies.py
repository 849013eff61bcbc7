"""Step time, peak memory and bytes on the wire: DDPStrategy, FSDPStrategy and sdp4bit, same GPT.

    python benchmarks/strategies.py                        # CPU: 2 processes, gloo
    python benchmarks/strategies.py --devices 4 --steps 20 --n-layer 6 --n-embd 256
    python benchmarks/strategies.py --accelerator gpu      # GPU: adds FSDPStrategy

Each strategy runs in its own `torch` processes (Lightning's subprocess launcher re-runs this
script with --worker), trains the example GPT (examples/gpt) on random tokens for --steps
optimizer steps and times the last --steps - --warmup of them. Printed per strategy:
- step time: median wall time of an optimizer step (ms), rank 0;
- peak memory: max resident set size (CPU) or max CUDA memory allocated (GPU), per rank (MiB);
- optimizer state: bytes of optimizer state tensors per rank (MiB);
- bytes per step: what one rank passes into the step's collectives (MiB), counted by the
  strategy for sdp4bit (`comm_stats`) and from the gradient/parameter sizes for DDP (all-reduce
  input = fp32 or bf16 gradients) and FSDP (all-gather input + reduce-scatter input per step).
The Markdown table goes to stdout and, with --out, to a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from cli_args import at_least

from lightning_sdp4bit import PRESETS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

STRATEGIES = ["ddp", "fsdp", "sdp4bit-baseline", "sdp4bit"]
"""sdp4bit-<preset> also runs any other preset of SDP4BitConfig (e.g. sdp4bit-qwd, sdp4bit-tlq_hs)."""


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--devices", type=at_least(1), default=2)
    parser.add_argument("--ranks-per-node", type=at_least(1), default=1, help="sdp4bit's virtual node size")
    parser.add_argument("--steps", type=at_least(1), default=12)
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--n-layer", type=at_least(1), default=4)
    parser.add_argument("--n-embd", type=at_least(1), default=256)
    parser.add_argument("--block-size", type=at_least(1), default=256)
    parser.add_argument("--batch-size", type=at_least(1), default=8)
    parser.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-true on GPU")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset to run")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.precision = args.precision or ("32-true" if args.accelerator == "cpu" else "bf16-true")
    return args


def _strategy(name: str, args: argparse.Namespace):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_sdp4bit import SDP4BitStrategy

    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp":
        return FSDPStrategy()
    preset = name.removeprefix("sdp4bit-") if name.startswith("sdp4bit-") else "sdp4bit"
    return SDP4BitStrategy(config={"preset": preset, "ranks_per_node": args.ranks_per_node})


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from gpt.module import GPTModule
    from lightning.pytorch.callbacks import Callback

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if args.accelerator == "gpu":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)

    pl.seed_everything(0)
    model = {"n_layer": args.n_layer, "n_head": 4, "n_embd": args.n_embd, "block_size": args.block_size}
    model.update(vocab_size=256, dropout=0.0, bias=True)
    optim = dict(lr=1e-3, min_lr=1e-4, warmup_steps=2, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    module = GPTModule(model, optim)
    tokens = torch.randint(0, 256, (args.batch_size * args.steps * args.devices, args.block_size + 1))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
    measure = Measure()
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=_strategy(args.worker, args),
        precision=args.precision,
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
    optimizer = trainer.strategy.optimizers[0]
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    n_params = sum(p.numel() for p in module.parameters())
    grad_bytes = n_params * (2 if args.precision == "bf16-true" else 4)
    if args.worker.startswith("sdp4bit"):
        wire = trainer.strategy.comm_stats["step_bytes"]
    elif args.worker == "ddp":
        wire = grad_bytes  # all-reduce input: every gradient
    else:
        wire = 2 * grad_bytes  # all-gather of the parameters + reduce-scatter of the gradients
    if args.accelerator == "gpu":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    mine = {"peak_mib": peak, "state_mib": state_bytes / 2**20, "wire_mib": wire / 2**20}
    everyone = [None] * trainer.world_size
    torch.distributed.all_gather_object(everyone, mine)
    if trainer.global_rank == 0:
        result = {
            "step_ms": 1e3 * statistics.median(measure.times[args.warmup :]),
            "params": n_params,
            "ranks": everyone,
        }
        Path(args.result).write_text(json.dumps(result))
    # DDPStrategy leaves the group up, and gloo's threads can abort the exit otherwise.
    torch.distributed.destroy_process_group()


def _run(name: str, args: argparse.Namespace) -> dict | None:
    with tempfile.TemporaryDirectory() as directory:
        result = Path(directory) / "result.json"
        command = [sys.executable, __file__, "--worker", name, "--result", str(result)] + sys.argv[1:]
        env = {**os.environ, "PYTHONPATH": str(REPO / "examples")}
        completed = subprocess.run(command, env=env, capture_output=True, text=True)
        if completed.returncode != 0 or not result.exists():
            print(f"{name} failed:\n{completed.stderr[-3000:]}", file=sys.stderr)
            return None
        return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return
    names = [n for n in args.strategies.split(",") if n != "fsdp" or args.accelerator == "gpu"]
    unknown = {n for n in names if n not in STRATEGIES and n.removeprefix("sdp4bit-") not in PRESETS}
    if unknown:
        raise SystemExit(f"--strategies: unknown {sorted(unknown)}; choose from {STRATEGIES}")
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else f"{os.cpu_count()}-core CPU"
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        device += ", NCCL over its network transport only (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)"
    lines = [
        f"# Strategies on {device}, {datetime.date.today()}",
        "",
        f"`python benchmarks/strategies.py {' '.join(sys.argv[1:])}` on {platform.node() or 'this machine'}:",
        f"{args.devices} processes ({args.accelerator}), {args.precision}, GPT {args.n_layer} layers x "
        f"{args.n_embd} wide, context {args.block_size}, batch {args.batch_size} per process, "
        f"median of {args.steps - args.warmup} steps; sdp4bit with ranks_per_node={args.ranks_per_node}.",
        "",
        "| strategy | params | step time (ms) | peak memory / rank (MiB) | optimizer state / rank (MiB) "
        "| bytes per step / rank (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        result = _run(name, args)
        if result is None:
            lines.append(f"| {name} | failed | | | | |")
            continue
        ranks = result["ranks"]
        peak = max(r["peak_mib"] for r in ranks)
        state = max(r["state_mib"] for r in ranks)
        wire = max(r["wire_mib"] for r in ranks)
        lines.append(
            f"| {name} | {result['params']:,} | {result['step_ms']:.1f} | {peak:.0f} | {state:.2f} | {wire:.3f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
