"""The GPT training step the one-GPU benchmarks time (training_step.py, emulated_network.py).

One place for the model, the optimizer, the tokens and the two steps (with and without the
engine), so that both benchmarks time exactly the same work: the example GPT in bf16, fused
AdamW (lr 1e-4, weight decay 0.1), fp32 cross-entropy, gradients clipped to a 2-norm of 1.0.
With `checkpoint_blocks`, each transformer block's activations are recomputed in the backward.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt.model import GPT, GPTConfig  # noqa: E402

__all__ = ["VOCAB", "build_gpt", "engine_step", "lm_loss", "make_optimizer", "plain_step", "random_tokens"]

VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 64, as nanoGPT does
MAX_NORM = 1.0  # gradient clipping, 2-norm


def build_gpt(
    n_layer: int,
    n_head: int,
    n_embd: int,
    seq: int,
    device: torch.device,
    vocab: int = VOCAB,
    checkpoint_blocks: bool = False,
) -> GPT:
    """The example GPT in bf16 on `device`, seeded. Initialised on the device itself: a 1.3B
    model initialised on the CPU first takes tens of seconds.

    `checkpoint_blocks`: each block keeps only its input for the backward, which runs the block's
    forward again (activation checkpointing, as large jobs run; the `6.7b-ckpt` model of
    emulated_runs.py). The block's own `forward` is replaced, not the block wrapped, so that
    parameter names stay those of the example."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with torch.device(device):
        model = GPT(config).to(torch.bfloat16)
    if checkpoint_blocks:
        for block in model.blocks:
            block.forward = functools.partial(_recomputed, block.forward)  # an instance attribute
    return model


def _recomputed(forward, x: torch.Tensor) -> torch.Tensor:
    # Non-reentrant: gradients reach the parameters' post-accumulate-grad hooks as usual, and the
    # forward pre-hooks of the block's modules fire again during the recomputation.
    return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)


def make_optimizer(params, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")


def random_tokens(batch: int, seq: int, device: torch.device, vocab: int = VOCAB) -> torch.Tensor:
    """[batch, seq + 1] token ids: inputs are [:, :-1], targets [:, 1:]."""
    return torch.randint(0, vocab, (batch, seq + 1), device=device)


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _no_mark(segment: str) -> None:
    pass


def engine_step(
    model, engine, optimizer, tokens: torch.Tensor, mark: Callable[[str], None] = _no_mark
) -> tuple[torch.Tensor, dict[str, float]]:
    """One optimizer step through the sharded engine's step protocol, as the Lightning adapter
    drives it. `mark(segment)` at the end of the forward and of the backward (phase_timer.SEGMENTS).
    Returns the loss (detached) and the step's communication figures."""
    engine.pre_forward()
    loss = lm_loss(model, tokens)
    engine.post_forward()
    mark("forward")
    engine.pre_backward()
    loss.backward()
    engine.post_backward()
    mark("backward")
    engine.clip_grad_norm(MAX_NORM)
    engine.pre_optimizer_step()
    optimizer.step()
    stats = engine.post_optimizer_step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), stats


def plain_step(model, optimizer, tokens: torch.Tensor, mark: Callable[[str], None] = _no_mark) -> None:
    """The same step in plain PyTorch, without any strategy: the floor."""
    loss = lm_loss(model, tokens)
    mark("forward")
    loss.backward()
    mark("backward")
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
