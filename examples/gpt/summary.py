"""The run's closing summary: throughput, final losses, bytes on the wire, and a generated sample.

`RunSummary` is a Lightning callback. It measures training time without validation, and at the
end of training sums every process's figures (the strategy's `comm_stats` are per process), then
has rank 0 print them, write them to summary.json in the log directory, and sample some text.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque

import lightning as L
import torch

LOSS_WINDOW = 20  # the "final" training loss is the mean of the last 20 batches: one is noisy


class RunSummary(L.Callback):
    def __init__(self, sample_bytes: int = 0, byte_tokens: bool = True) -> None:
        self.sample_bytes = sample_bytes if byte_tokens else 0  # ids of a .bin have no decoding here
        self.recent_losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.summary: dict = {}
        self.start = self.validation_start = self.validation_seconds = 0.0
        self.tokens = 0  # training tokens seen by this process

    def on_train_start(self, trainer, pl_module) -> None:
        self.start, self.validation_seconds = time.perf_counter(), 0.0

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validation_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validation_seconds += time.perf_counter() - self.validation_start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # what training_step logged: outputs["loss"] is divided by accumulate_grad_batches
        self.recent_losses.append(float(trainer.callback_metrics["train/loss"]))
        self.tokens += batch[0].numel()
        # Ask Lightning to stop after the last step: it validates once more before stopping, so
        # the final validation loss is always measured on the final weights.
        if trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        seconds = time.perf_counter() - self.start - self.validation_seconds
        stats = trainer.strategy.comm_stats
        local = [
            sum(self.recent_losses),
            len(self.recent_losses),
            self.tokens,
            stats["total_bytes"],
            stats["total_uncompressed_bytes"],
        ]
        loss_sum, loss_count, tokens, wire, uncompressed = trainer.strategy.reduce(
            torch.tensor(local, dtype=torch.float64, device=pl_module.device), reduce_op="sum"
        ).tolist()
        # A simulated job (sdp4bit.simulate) runs its ranks in this one process, each with as many
        # tokens and (the collectives being symmetric) as many bytes on the wire as rank 0.
        ranks = getattr(trainer.strategy, "simulated_world_size", 1)
        tokens, wire, uncompressed = tokens * ranks, wire * ranks, uncompressed * ranks
        val_loss = float(trainer.callback_metrics.get("val/loss", math.nan))
        self.summary = {
            "processes": trainer.world_size,
            "simulated_ranks": getattr(trainer.strategy, "simulated_world_size", None),
            "steps": trainer.global_step,
            "train_tokens": int(tokens),
            "train_seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "final_train_loss": loss_sum / loss_count,
            "final_val_loss": val_loss,
            "final_val_ppl": float(trainer.callback_metrics.get("val/ppl", math.nan)),
            "wire_bytes": wire,
            "uncompressed_bytes": uncompressed,
            # bits per element of each collective that ran, e.g. {"weight": 4.016, "grad_inter": 4.25}
            "bits_per_element": {
                key.removesuffix("_bits_per_element"): value
                for key, value in stats.items()
                if key.endswith("_bits_per_element") and value
            },
        }
        log_dir = trainer.log_dir  # a collective: every process must ask
        # Every rank samples (rank 0 prints): with sdp4bit.weight_sharding=node each forward gathers
        # weights inside the node, which all of the node's ranks must do together.
        sample = generate_text(pl_module.gpt, "The ", self.sample_bytes) if self.sample_bytes else None
        if trainer.is_global_zero:
            if log_dir is not None:
                with open(os.path.join(log_dir, "summary.json"), "w") as f:
                    json.dump(self.summary, f, indent=2)
            print(format_summary(self.summary))
            if sample is not None:
                print(f"\nsample from the trained model ({self.sample_bytes} bytes after 'The '):\n")
                print(sample)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} GB"


def format_summary(s: dict) -> str:
    saved = s["uncompressed_bytes"] - s["wire_bytes"]
    ratio = s["uncompressed_bytes"] / s["wire_bytes"] if s["wire_bytes"] else math.nan
    ran_on = (
        f"{s['simulated_ranks']} simulated ranks in 1 process"
        if s["simulated_ranks"]
        else f"{s['processes']} processes"
    )
    return "\n".join(
        [
            f"\n=== summary: {s['steps']} steps on {ran_on} ===",
            f"throughput   {s['tokens_per_second']:,.0f} tokens/s ({s['train_tokens']:,} training tokens "
            f"in {s['train_seconds']:.1f} s, validation excluded)",
            f"train loss   {s['final_train_loss']:.4f} (mean of the last {LOSS_WINDOW} batches, all processes)",
            f"val loss     {s['final_val_loss']:.4f} (perplexity {s['final_val_ppl']:.2f}, final weights)",
            f"on the wire  {human_bytes(s['wire_bytes'])} sent by all processes, against "
            f"{human_bytes(s['uncompressed_bytes'])} uncompressed: {human_bytes(saved)} saved ({ratio:.2f}x less)",
            "bits/element " + ", ".join(f"{kind} {bits:.3f}" for kind, bits in s["bits_per_element"].items()),
        ]
    )


@torch.no_grad()
def generate_text(gpt: torch.nn.Module, prompt: str, n_bytes: int) -> str:
    """Sample `n_bytes` bytes after `prompt` from a byte-level model; undecodable bytes show as U+FFFD."""
    was_training = gpt.training
    gpt.eval()
    device = next(gpt.parameters()).device
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    out = gpt.generate(idx, n_bytes)[0].tolist()
    gpt.train(was_training)
    return bytes(out).decode("utf-8", errors="replace")
