"""Pretrain a small litgpt GPT with Lightning Fabric and SDP4Bit (about 4-bit communication).

    pip install ".[litgpt]"                                 # in the repository: litgpt is an optional extra
    python examples/fabric_litgpt.py                        # all GPUs, or 2 CPU processes
    python examples/fabric_litgpt.py --steps 200 --preset baseline      # uncompressed, for comparison
    python examples/fabric_litgpt.py --compile --precision bf16-true     # on GPUs: torch.compile'd model
    python examples/fabric_litgpt.py --save out/fabric.ckpt              # a sharded checkpoint at the end

The model is `litgpt.GPT` built from a `litgpt.Config` (no download); the tokens are bytes of the
documentation text that ships with CPython (examples/gpt/data.py). The loop is a plain Fabric
loop: gradient accumulation under `fabric.no_backward_sync`, clipping by the global norm, and
`Fabric(strategy=SDP4BitFabricStrategy(...))` (or `strategy="sdp4bit"`) doing the rest.
Without a GPU, 2 CPU processes act as 2 virtual nodes, so both gradient stages (int8 inside a
node, int4 across nodes) run.
"""

import argparse
import sys
import time

import lightning as L
import torch
from gpt.data import BYTE_VOCAB, TokenWindows, load_tokens, val_start
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_sdp4bit import SDP4BitFabricStrategy

try:
    from litgpt import GPT, Config
except ImportError:
    sys.exit('error: this example needs litgpt: pip install ".[litgpt]" in the repository (or pip install litgpt)')


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    parser.add_argument("--devices", default=None, help="processes (default: all GPUs, or 2 on CPU)")
    parser.add_argument("--precision", default=None, help="bf16-true on GPU, 32-true on CPU by default")
    parser.add_argument("--preset", default="sdp4bit", help="SDP4Bit preset: baseline qw qwd ulq tlq tlq_hs sdp4bit")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128, help="tokens per window")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per micro-batch and process")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--save", default=None, help="write a sharded checkpoint directory here at the end")
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    on_gpu = args.accelerator in ("gpu", "cuda") or (args.accelerator == "auto" and torch.cuda.is_available())
    devices = args.devices or ("auto" if on_gpu else 2)
    sdp4bit = {"preset": args.preset}
    if not on_gpu:
        sdp4bit["ranks_per_node"] = 1  # 2 CPU processes as 2 virtual nodes
    fabric = L.Fabric(
        accelerator="gpu" if on_gpu else "cpu",
        devices=int(devices) if str(devices).isdigit() else devices,
        strategy=SDP4BitFabricStrategy(config=sdp4bit),
        precision=args.precision or ("bf16-true" if on_gpu else "32-true"),
    )
    fabric.launch()
    fabric.seed_everything(0)

    # Data: byte windows; Fabric adds the DistributedSampler, so each process sees its own part.
    tokens = load_tokens(None)
    boundary = val_start(len(tokens), 0.05, args.block_size)
    pin = fabric.device.type == "cuda"  # pageable batches are copied to the GPU with a stream synchronisation
    windows = TokenWindows(tokens, args.block_size, stop=boundary)
    train = DataLoader(windows, batch_size=args.batch_size, shuffle=True, drop_last=True, pin_memory=pin)
    val = DataLoader(TokenWindows(tokens, args.block_size, start=boundary), batch_size=args.batch_size, pin_memory=pin)
    train, val = fabric.setup_dataloaders(train, val)

    config = Config(
        block_size=args.block_size,
        vocab_size=BYTE_VOCAB,
        padded_vocab_size=BYTE_VOCAB,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        bias=False,
    )
    with fabric.init_module():
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if args.compile:
        model = torch.compile(model)  # Fabric re-applies compile around the set-up module
    model, optimizer = fabric.setup(model, optimizer)
    fabric.print(
        f"litgpt GPT, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, preset {args.preset}"
    )

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    batches, losses, started = iter(train), [], time.perf_counter()
    for step in range(args.steps):
        total = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(train)
                x, y = next(batches)
            # Nothing is sent on the non-final micro-batches: the gradients only accumulate.
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = loss_of(x, y) / args.accumulate
                fabric.backward(loss)
            total += loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm over all shards
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(total, reduce_op="mean").item())
        if step % args.log_every == 0 or step == args.steps - 1:
            fabric.print(f"step {step:4d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - started

    model.eval()
    with torch.no_grad():
        val_losses = [loss_of(x, y) for (x, y), _ in zip(val, range(8), strict=False)]
    val_loss = fabric.all_reduce(torch.stack(val_losses).mean(), reduce_op="mean").item()
    processed = args.steps * args.accumulate * args.batch_size * args.block_size * fabric.world_size
    fabric.print(
        f"done: {args.steps} steps in {elapsed:.1f} s ({processed / elapsed:,.0f} tokens/s); "
        f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation loss {val_loss:.4f}"
    )
    sent, uncompressed = fabric.strategy.meter.total_bytes, fabric.strategy.meter.total_uncompressed_bytes
    fabric.print(  # this process's bytes on the wire, and what the uncompressed collectives would send
        f"bytes sent by rank 0: {sent / 1e6:.2f} MB, uncompressed {uncompressed / 1e6:.2f} MB "
        f"({uncompressed / max(sent, 1):.2f}x less)"
    )
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})
        fabric.print(f"saved {args.save}")


if __name__ == "__main__":
    main(sys.argv[1:])
