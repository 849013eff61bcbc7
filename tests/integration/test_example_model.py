"""The GPT example's model and LightningModule (examples/gpt/model.py, module.py).

Checks:
- causality: changing tokens at positions >= t leaves the logits at positions < t unchanged;
- weight tying: the head and the token embedding are one tensor, counted and trained once;
- a sequence longer than the context is refused;
- AdamW groups: weight decay on exactly the Linear weights, never on biases, norms, embeddings
  or the tied head; every parameter in exactly one group;
- the schedule: linear warmup up to the peak, cosine down to min_lr at the last step;
- validation: the logged loss is the mean cross-entropy over every validation token, computed
  exactly (fp64 sums), also when precision "bf16-true" casts the module; perplexity is its exp.
"""

import math
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt.data import TokenDataModule  # noqa: E402
from gpt.model import GPT, GPTConfig  # noqa: E402
from gpt.module import GPTModule, decay_groups, warmup_cosine  # noqa: E402

TINY = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0, "bias": True}
OPTIM = {
    "lr": 1e-3,
    "min_lr": 1e-4,
    "warmup_steps": 2,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
}


def test_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = torch.randint(0, 256, (2, 7))
    before, after = gpt(idx), gpt(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)  # same math, same bits
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_weight_tying_is_one_tensor():
    gpt = GPT(GPTConfig(**TINY))
    assert gpt.lm_head.weight is gpt.wte.weight
    assert gpt.num_params() == sum(p.numel() for p in gpt.parameters())
    all_tensors = sum(p.numel() for _, p in gpt.named_parameters(remove_duplicate=False))
    assert all_tensors - gpt.num_params() == 256 * 32  # the (V, C) matrix is counted once
    gpt(torch.randint(0, 256, (1, 8))).sum().backward()
    assert gpt.wte.weight.grad is not None and gpt.lm_head.weight.grad is gpt.wte.weight.grad


def test_context_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="longer than block_size 16"):
        GPT(GPTConfig(**TINY))(torch.zeros(1, 17, dtype=torch.long))


def test_decay_groups_decay_only_linear_weights():
    gpt = GPT(GPTConfig(**TINY))
    decay, no_decay = decay_groups(gpt, weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in gpt.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed == {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "blocks.0.attn.qkv.bias"} <= not_decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(gpt.parameters()))
    assert not decayed & not_decayed


def test_warmup_then_cosine_to_min_lr():
    lr = [warmup_cosine(step, warmup_steps=10, total_steps=100, min_ratio=0.1) for step in range(101)]
    assert lr[0] == pytest.approx(1 / 11)
    assert all(a < b for a, b in zip(lr[:10], lr[1:11], strict=True))  # rising during warmup
    assert lr[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:], strict=False))  # then falling
    assert lr[55] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway down the cosine
    assert lr[100] == pytest.approx(0.1)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_validation_loss_is_the_exact_token_mean(precision):
    L.seed_everything(0, verbose=False)
    module = GPTModule(model=TINY, optim=OPTIM)
    data = TokenDataModule(np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint8), 16, 8, 0.2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
    # the same sum done here in fp64 over the same (possibly bf16) logits
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.val_dataloader():
            log_probs = torch.log_softmax(module(inputs).double(), dim=-1)
            total -= float(log_probs.gather(-1, targets[..., None]).sum())
            count += targets.numel()
    # a bf16 metric state would be off by about 1e-3 here
    assert metrics["val/loss"] == pytest.approx(total / count, rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
