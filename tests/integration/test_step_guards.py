"""The per-step guards, on 2 CPU ranks:
- an Inf in one rank's gradient, and a NaN loss on one rank, under nonfinite = "skip" (the step
  is skipped on every rank: weights and optimizer state unchanged, counted in comm_stats, the
  count kept by a checkpoint, replicas identical, training goes on), "error"
  (NonFiniteGradientError on every rank, naming the step) and "propagate" (the weights become
  non-finite); baseline and sdp4bit;
- "propagate" poisons exactly the weights DDP poisons (one Inf element: the same one weight, with
  and without clipping) under the uncompressed preset; under sdp4bit the element's qWD weight
  group (2048 weights), and with clipping every weight;
- a branch unused on every rank on even steps gets grad None there, so AdamW skips it: the fp32
  baseline equals DDPStrategy(find_unused_parameters=True) bit for bit; so does a model that runs
  one block twice in each forward (its gradients are complete when their hooks fire);
- the engine's collectives never run on the default process group, which Lightning's own
  collectives (the per-batch SIGTERM broadcast, sync_dist) use;
- the check before each backward names the parameters frozen at the start that train now.
"""

import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit, weights
from models import WIDTH, TinyLMModule


class InjectsNonFinite(TinyLMModule):
    """Step 1: one Inf gradient element on rank 1. Step 2: a NaN loss on rank 0. With
    `fused`, a fused AdamW, which skips on the device (found_inf) instead of on the host."""

    def __init__(self, fused=False, **kwargs):
        super().__init__(**kwargs)
        self.snapshots, self.handle, self.fused = [], None, fused

    def configure_optimizers(self):
        if not self.fused:
            return super().configure_optimizers()
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        rank = self.trainer.global_rank
        if self.global_step == 1 and rank == 1:
            poison = torch.tensor([0])
            self.handle = self.model.norm.weight.register_hook(lambda g: g.index_fill(0, poison, float("inf")))
        if self.global_step == 2 and rank == 0:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        optimizer = self.trainer.strategy.optimizers[0]
        moments = sum(float(s["exp_avg"].abs().sum()) for s in optimizer.state.values() if "exp_avg" in s)
        masters = torch.cat([b.master.clone() for b in self.trainer.strategy.engine.buckets])
        self.snapshots.append((weights(self), moments, dict(self.trainer.strategy.comm_stats), masters))


class UnusedOnEvenSteps(TinyLMModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.branch = torch.nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(batch)
        if self.global_step % 2 == 1:
            loss = loss + 0.01 * self.branch(self.model.embed(batch[:, :4])).pow(2).mean()
        return loss


class BlockTwice(TinyLMModule):
    def training_step(self, batch, batch_idx):
        model, tokens = self.model, batch[:, :-1]
        x = model.embed(tokens) + model.position[: tokens.shape[1]]
        x = model.blocks[1](model.blocks[0](model.blocks[0](x)))
        logits = model.head(model.norm(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _guards(rank, world, preset, directory):
    import torch.distributed as dist

    import lightning_sdp4bit.comm as comm
    from lightning_sdp4bit.guards import NonFiniteGradientError

    out = {}
    for mode in ("skip", "error", "propagate"):
        module = InjectsNonFinite()
        trainer = make_trainer(world, sdp4bit(preset=preset, nonfinite=mode), max_steps=4)
        try:
            trainer.fit(module)
            out[mode] = module.snapshots
        except NonFiniteGradientError as error:
            out[mode] = str(error)
    module = InjectsNonFinite(fused=True)
    trainer = make_trainer(world, sdp4bit(preset=preset), max_steps=4)
    trainer.fit(module)
    out["skip_on_device"] = module.snapshots
    trainer.save_checkpoint(f"{directory}/skipped")
    resumed = InjectsNonFinite(fused=True)
    make_trainer(world, sdp4bit(preset=preset), max_steps=5).fit(resumed, ckpt_path=f"{directory}/skipped")
    out["skipped_after_resume"] = resumed.snapshots[-1][2]["nonfinite_steps"]

    groups = []
    for name in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast"):
        original = getattr(comm, name)

        def recording(*args, _original=original, **kwargs):
            groups.append(kwargs.get("group"))
            return _original(*args, **kwargs)

        setattr(comm, name, recording)
    for name, strategy in (("ddp", _ddp_finding_unused()), ("ours", sdp4bit(preset=preset))):
        module = UnusedOnEvenSteps()
        make_trainer(world, strategy, max_steps=4).fit(module)
        out[f"unused_{name}"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, strategy in (("ddp", _ddp_finding_unused()), ("ours", sdp4bit(preset=preset))):
        module = BlockTwice()
        make_trainer(world, strategy, max_steps=3).fit(module)
        out[f"twice_{name}"] = weights(module)
    out["engine_groups_default"] = [g is None or g is dist.group.WORLD for g in groups]
    return out


def _ddp_finding_unused():
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(find_unused_parameters=True)


def _assert_finite(snapshot):
    return all(bool(torch.isfinite(w).all()) for w in snapshot.values())


@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_nonfinite_modes_unused_parameters_and_own_groups(preset, tmp_path):
    results = run_workers(_guards, 2, preset, str(tmp_path))
    for result in results:
        skipped = result["skip"]
        assert len(skipped) == 4
        (w0, m0, _, _), (w1, m1, s1, _), (w2, m2, s2, _), (w3, _, s3, _) = skipped
        # Steps 1 and 2 are skipped: nothing changes, the counter says so, training goes on.
        for name, value in w0.items():
            assert torch.equal(w1[name], value) and torch.equal(w2[name], value), name
        assert m0 == m1 == m2
        assert (s1["nonfinite_steps"], s2["nonfinite_steps"], s3["nonfinite_steps"]) == (1, 2, 2)
        assert _assert_finite(w3) and any(not torch.equal(w3[n], w0[n]) for n in w0)
        # A fused optimizer skips on the device: masters and moments unchanged, counted a step late.
        device = result["skip_on_device"]
        assert torch.equal(device[0][3], device[1][3]) and torch.equal(device[1][3], device[2][3])
        assert device[0][1] == device[1][1] == device[2][1] and not torch.equal(device[3][3], device[0][3])
        assert [snapshot[2]["nonfinite_steps"] for snapshot in device] == [0, 0, 1, 2]
        assert result["skipped_after_resume"] == 2  # the count is saved with the checkpoint
        assert isinstance(result["error"], str) and "optimizer step 1" in result["error"]
        assert not _assert_finite(result["propagate"][1][0])
        assert not any(result["engine_groups_default"]) and result["engine_groups_default"]
        if preset == "baseline":
            for name, expected in result["unused_ddp"].items():
                assert torch.equal(result["unused_ours"][name], expected), name
            for name, expected in result["twice_ddp"].items():
                assert torch.equal(result["twice_ours"][name], expected), name
    for name, value in results[0]["skip"][-1][0].items():
        assert torch.equal(results[1]["skip"][-1][0][name], value), name


class CountsPoisoned(InjectsNonFinite):
    """InjectsNonFinite under any strategy: after each step, which weights are non-finite."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.snapshots.append({n: ~torch.isfinite(w) for n, w in weights(self).items()})


def _poisoned_by_one_inf(rank, world):
    """After step 1 (one Inf gradient element on rank 1), the mask of non-finite weights under
    DDP and under nonfinite="propagate" with and without compression, without and with clipping."""
    out = {}
    for clip in (None, 1.0):
        strategies = {"ddp": _ddp_finding_unused()}
        strategies |= {preset: sdp4bit(preset=preset, nonfinite="propagate") for preset in ("baseline", "sdp4bit")}
        for name, strategy in strategies.items():
            module = CountsPoisoned()
            make_trainer(world, strategy, max_steps=2, gradient_clip_val=clip).fit(module)
            out[name, clip] = module.snapshots[1]
    return out


def test_propagate_poisons_what_ddp_poisons_without_compression():
    from lightning_sdp4bit import SDP4BitConfig

    results = run_workers(_poisoned_by_one_inf, 2)
    total = sum(mask.numel() for mask in results[0]["ddp", None].values())
    for result in results:
        count = {key: sum(int(mask.sum()) for mask in masks.values()) for key, masks in result.items()}
        for clip in (None, 1.0):
            assert count["ddp", clip] == 1  # the poisoned element itself
            # Uncompressed: exactly DDP's weights are poisoned, the same elements.
            for name, mask in result["ddp", clip].items():
                assert torch.equal(result["baseline", clip][name], mask), (name, clip)
        # Compressed (README, "Non-finite gradients"): the element's gradient group (128) turns
        # NaN, so does the qWD weight group (2048) that holds those masters; with clipping the
        # global norm is NaN, and so is every weight.
        assert count["sdp4bit", None] == SDP4BitConfig.preset("sdp4bit").weight_group_size
        assert count["sdp4bit", 1.0] == total


def test_unfrozen_since_start_names_only_frozen_parameters_that_now_train():
    """The check before each backward looks up the names frozen at the start: one that requires
    grad now is named, in module order; one still frozen, or no longer a parameter, is not."""
    from lightning_sdp4bit.guards import unfrozen_since_start

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for layer in model:
        layer.weight.requires_grad_(False)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["0.weight", "1.weight", "2.weight"] and unfrozen_since_start(model, frozen) == []
    model[2].weight.requires_grad_(True)
    model[0].weight.requires_grad_(True)
    del model[1].weight  # no longer a parameter of the module: it cannot train
    assert unfrozen_since_start(model, frozen) == ["0.weight", "2.weight"]
