"""What Lightning's hooks and manual optimization see under sdp4bit, against DDPStrategy on the
same seed (2 CPU ranks, fp32):
- manual gradient accumulation (`toggle_model(sync_grad=...)`, self.clip_gradients, opt.step()
  every 2 batches) accumulates every micro-batch and sends nothing early;
- a callback reading the weights in on_train_batch_end and on_train_end sees the weights the
  next forward uses, complete; EMAWeightAveraging and StochasticWeightAveraging give DDP's
  averages;
- on_before_optimizer_step sees p.grad: grad_norm gives DDP's norms, and gradient surgery on
  p.grad reaches the step;
- in-place weight edits in a hook (a clamp through no_grad, and through .data) reach the masters;
- BaseFinetuning's unfreezing and a requires_grad flip mid-fit raise at once, naming the fix.
Under baseline each matches DDP bit for bit; under the default compression the tests assert
what still holds (complete weights, the clamp, visible norms, identical replicas).
"""

import pytest
import torch
from distributed import run_workers
from lightning_runs import ddp, make_trainer, sdp4bit, weights
from models import TinyLMModule

CLAMPED = ("blocks.1.mlp.2.weight", "blocks.0.mlp.2.weight")


class ManualAccumulation(TinyLMModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        last = batch_idx % 2 == 1
        with opt.toggle_model(sync_grad=last):
            self.manual_backward(self.model.loss(batch) / 2)
        if last:
            # Large enough that the coefficient is exactly 1: DDP's norm sums in another order.
            self.clip_gradients(opt, gradient_clip_val=100.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


class ReadsAndEditsWeights(TinyLMModule):
    """Clamps one layer after every step (two ways), and reads gradients before each step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norms, self.bias_grads = [], []

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})
        grad = self.model.blocks[0].mlp[0].bias.grad
        self.bias_grads.append(grad.clone())
        grad.mul_(0.5)  # gradient surgery

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            self.model.blocks[1].mlp[2].weight.clamp_(-0.05, 0.05)
        self.model.blocks[0].mlp[2].weight.data.clamp_(-0.05, 0.05)


def _callbacks():
    from lightning.pytorch.callbacks import Callback, EMAWeightAveraging

    class Snapshots(Callback):
        def __init__(self):
            self.after_step, self.at_end = [], None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.after_step.append(weights(module))

        def on_train_end(self, trainer, module):
            self.at_end = weights(module)

    return Snapshots(), EMAWeightAveraging(decay=0.5)


def _run_all(rank, world, preset):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    out = {}
    strategies = {"ddp": ddp, "ours": lambda: sdp4bit(preset=preset)}
    for name, make in strategies.items():
        if preset != "baseline" and name == "ddp":
            continue
        module = ManualAccumulation()
        make_trainer(world, make(), max_steps=3).fit(module)
        out[f"manual_{name}"] = weights(module)

        snapshots, ema = _callbacks()
        module = ReadsAndEditsWeights()
        trainer = make_trainer(world, make(), max_steps=3, callbacks=[snapshots, ema])
        trainer.fit(module)
        out[f"hooks_{name}"] = {
            "after_step": snapshots.after_step,
            "at_end": snapshots.at_end,
            "final": weights(module),
            "ema": {n: p.detach().clone() for n, p in ema._average_model.module.model.named_parameters()},
            "norms": module.norms,
            "bias_grads": module.bias_grads,
        }
        module = TinyLMModule(dataset_size=16)
        swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1)
        make_trainer(world, make(), max_epochs=3, callbacks=[swa]).fit(module)
        out[f"swa_{name}"] = weights(module)
    out["finetuning"] = _refused_changes(world, preset)
    return out


def _refused_changes(world, preset):
    from lightning.pytorch.callbacks import BaseFinetuning

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, module):
            self.freeze(module.model.blocks[0])

        def finetune_function(self, module, epoch, optimizer):
            if module.global_step >= 1:
                self.unfreeze_and_add_param_group(module.model.blocks[0], optimizer)

    class FlipsRequiresGrad(TinyLMModule):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:
                self.model.blocks[0].norm1.weight.requires_grad_(True)

    errors = []
    for module, callbacks in ((TinyLMModule(dataset_size=8), [Unfreeze()]), (FlipsRequiresGrad(), [])):
        if callbacks:
            kwargs = {"max_epochs": 2}
        else:
            module.model.blocks[0].norm1.weight.requires_grad_(False)
            kwargs = {"max_steps": 3}
        try:
            make_trainer(world, sdp4bit(preset=preset), callbacks=callbacks, **kwargs).fit(module)
            errors.append(None)
        except (ValueError, RuntimeError) as error:
            errors.append(str(error))
    return errors


def _assert_current_weights(hooks):
    # What a callback sees after the last step is what the module holds at on_train_end; after
    # fit the module holds the EMA average, which EMAWeightAveraging copies in at on_train_end.
    # (The module's own on_train_batch_end clamps two layers after the callbacks' hooks ran.)
    for name, value in hooks["at_end"].items():
        if name not in CLAMPED:
            assert torch.equal(hooks["after_step"][-1][name], value), name
        assert torch.equal(hooks["final"][name], hooks["ema"][name]), name


@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_hooks_and_manual_optimization(preset):
    results = run_workers(_run_all, 2, preset)
    for result in results:
        ours = result["hooks_ours"]
        _assert_current_weights(ours)
        for key in CLAMPED:
            assert ours["at_end"][key].abs().max() <= 0.05, key
        assert ours["norms"] and all(norms and all(v == v for v in norms.values()) for norms in ours["norms"])
        unfreeze, flip = result["finetuning"]
        assert unfreeze is not None and "Unfreeze (a BaseFinetuning callback) cannot run" in unfreeze
        assert flip is not None and "fixed when fit starts" in flip and "blocks.0.norm1.weight" in flip
        if preset == "baseline":
            for key in ("manual", "swa"):
                for name, expected in result[f"{key}_ddp"].items():
                    assert torch.equal(result[f"{key}_ours"][name], expected), (key, name)
            theirs = result["hooks_ddp"]
            for key in ("final", "at_end", "ema"):
                for name, expected in theirs[key].items():
                    assert torch.equal(ours[key][name], expected), (key, name)
            for mine, reference in zip(ours["after_step"], theirs["after_step"], strict=True):
                assert all(torch.equal(mine[n], reference[n]) for n in reference)
            assert ours["norms"] == theirs["norms"]
            assert all(torch.equal(a, b) for a, b in zip(ours["bias_grads"], theirs["bias_grads"], strict=True))
    # The replicas agree.
    for name, value in results[0]["hooks_ours"]["final"].items():
        assert torch.equal(results[1]["hooks_ours"]["final"][name], value), name
    for key in ("manual_ours", "swa_ours"):
        for name, value in results[0][key].items():
            assert torch.equal(results[1][key][name], value), (key, name)
