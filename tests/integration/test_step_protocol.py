"""What the front ends get from the engine's step protocol, on 2 CPU gloo ranks against DDP (the
Trainer's DDPStrategy, Fabric's "ddp"), preset baseline in fp32, on every rank:
- Fabric: a parameter frozen when the module was set up and unfrozen later is refused at the
  next backward with the Trainer's error (it has no bucket and would never train), on every rank;
- a LightningModule's own buffer, updated and read in training_step (no submodule forward):
  every rank's losses and buffer equal DDP's bit for bit (DDP broadcasts rank 0's before the
  step; the strategy must have it in place before training_step runs, not after);
- manual optimization with gradient accumulation reduces once per optimizer step: it equals DDP
  whose non-final manual_backward calls run under `block_backward_sync` bit for bit, and DDP
  without it (which reduces at every backward and adds the reduced sums) up to the rounding of
  those fp32 sums (bounded below);
- a parameter whose memory layout is not contiguous (channels_last, a transposed view) is
  named in a warning at setup: its values are kept, its strides are not;
- every protocol call runs under its `sdp4bit::` profiler label.
"""

import contextlib
import warnings

import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit
from models import TinyLMModule
from torch import nn

# DDP without no_sync reduces after every manual_backward and adds the reduced sums: fp32 sums in
# another order. After one SGD step of lr 1 the weights have moved by the averaged gradient, so
# the two differ by that sum's rounding and the step's: a few fp32 ulps of the largest weights.
# (AdamW turns such a rounding into differences up to its learning rate where a gradient is near
# 0, which is why the exact comparison is the one with DDP under no_sync.) A dropped or doubled
# micro-batch would move a weight by a whole gradient.
MANUAL_WITHOUT_NO_SYNC_ULPS = 8


# ------------------------------------------------------------------------------------------------
# Fabric: the trained set is fixed at setup


def _fabric_unfreezes(rank, world):
    from fabric_runs import make_fabric
    from fabric_runs import sdp4bit as fabric_sdp4bit
    from models import batch, make_model

    fabric = make_fabric(world, fabric_sdp4bit(preset="baseline"))
    model = make_model(0)
    model.position.requires_grad_(False)  # frozen when the module is set up
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model.module.loss(batch(rank, 0)))
    optimizer.step()
    optimizer.zero_grad()
    model.module.position.requires_grad_(True)  # unfrozen: under DDP it would train from here
    try:
        fabric.backward(model.module.loss(batch(rank, 1)))
    except RuntimeError as caught:
        return str(caught)
    return None


def test_fabric_refuses_a_parameter_unfrozen_after_setup_on_every_rank():
    for said in run_workers(_fabric_unfreezes, 2):
        assert said is not None and "parameters ['position'] were frozen when fit started" in said


# ------------------------------------------------------------------------------------------------
# The LightningModule's own buffer, read in training_step


class _OwnBuffer(TinyLMModule):
    def __init__(self):
        super().__init__(lr=3e-3, dataset_size=64)
        self.register_buffer("rms", torch.ones(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.rms.mul_(0.5).add_(batch.float().square().mean().sqrt(), alpha=0.5)  # this rank's batch
        loss = self.model.loss(batch) * (1 + 0.01 * self.rms)  # read here: the weights see it
        self.seen.append((loss.item(), self.rms.item()))
        return loss


def _own_buffer(rank, world):
    from lightning.pytorch.strategies import DDPStrategy

    out = {}
    for name, strategy in (("ddp", DDPStrategy()), ("sdp4bit", sdp4bit(preset="baseline"))):
        module = _OwnBuffer()
        make_trainer(world, strategy, max_steps=4).fit(module)
        out[name] = (module.seen, {n: p.detach().clone() for n, p in module.named_parameters()})
    return out


def test_a_lightning_modules_own_buffer_read_in_training_step_equals_ddp_on_every_rank():
    results = run_workers(_own_buffer, 2)
    for rank, result in enumerate(results):
        (ddp_seen, ddp_weights), (seen, weights) = result["ddp"], result["sdp4bit"]
        assert seen == ddp_seen, rank
        assert all(torch.equal(weights[n], w) for n, w in ddp_weights.items()), rank
    assert results[0]["ddp"][0] != results[1]["ddp"][0]  # the ranks' batches differ: the comparison can fail


# ------------------------------------------------------------------------------------------------
# Manual optimization with gradient accumulation


class _ManualAccumulation(TinyLMModule):
    def __init__(self, no_sync: bool, sgd: bool = False):
        super().__init__(lr=1.0 if sgd else 3e-3, dataset_size=48)
        self.automatic_optimization = False
        self.no_sync, self.sgd = no_sync, sgd

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        last = batch_idx % 2 == 1
        quiet = self.no_sync and not last
        with self.trainer.strategy.block_backward_sync() if quiet else contextlib.nullcontext():
            self.manual_backward(self.model.loss(batch) / 2)
        if last:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD if self.sgd else torch.optim.AdamW
        return optimizer(self.parameters(), lr=self.lr)


def _manual(rank, world):
    from lightning.pytorch.strategies import DDPStrategy

    out = {}
    for name, strategy, no_sync, sgd, steps in (
        ("ddp-no-sync", DDPStrategy(), True, False, 6),
        ("sdp4bit", sdp4bit(preset="baseline"), False, False, 6),
        ("ddp-sgd", DDPStrategy(), False, True, 1),
        ("sdp4bit-sgd", sdp4bit(preset="baseline"), False, True, 1),
    ):
        module = _ManualAccumulation(no_sync, sgd)
        initial = {n: p.detach().clone() for n, p in module.named_parameters()}
        make_trainer(world, strategy, max_steps=steps).fit(module)
        out[name] = {n: p.detach().clone() for n, p in module.named_parameters()}
        out[f"{name}-update"] = {n: initial[n] - p for n, p in out[name].items()}  # lr 1: the gradient
    return out


def test_manual_accumulation_reduces_once_per_step_as_ddp_under_no_sync():
    for rank, result in enumerate(run_workers(_manual, 2)):
        ours, oracle = result["sdp4bit"], result["ddp-no-sync"]
        assert all(torch.equal(ours[n], w) for n, w in oracle.items()), rank
        # Against DDP reducing every backward, one SGD step: the weights moved by the averaged gradient.
        ulp = torch.finfo(torch.float32).eps
        differing = 0
        for name, weight in result["ddp-sgd"].items():
            error = (result["sdp4bit-sgd"][name] - weight).abs().max().item()
            assert error <= MANUAL_WITHOUT_NO_SYNC_ULPS * ulp * weight.abs().max().item(), (rank, name, error)
            assert result["ddp-sgd-update"][name].abs().max() > 1e3 * error  # far below a gradient's size
            differing += int(error > 0)
        assert differing > 0, rank  # the order of the sums shows: the comparison can see a difference


# ------------------------------------------------------------------------------------------------
# Memory layout


class _Strided(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.transposed = nn.Parameter(torch.randn(6, 5).t())  # [5, 6], strides (1, 5)
        self.plain = nn.Parameter(torch.randn(5))


def test_a_parameters_lost_memory_layout_is_named_at_setup(monkeypatch):
    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.simulation import SimulatedEngine

    module = _Strided()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert not module.conv.weight.is_contiguous() and not module.transposed.is_contiguous()
    with pytest.warns(UserWarning, match=r"parameters \['transposed', 'conv.weight'\] .* contiguous") as caught:
        SimulatedEngine(module, SDP4BitConfig.preset("baseline"), 1, 2)
    assert len(caught) == 1
    for name, param in module.named_parameters():
        assert param.is_contiguous() and torch.equal(param, before[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # contiguous parameters: nothing said
        SimulatedEngine(nn.Linear(4, 4), SDP4BitConfig.preset("baseline"), 1, 2)


# ------------------------------------------------------------------------------------------------
# Profiler labels


def test_every_protocol_call_runs_under_its_label():
    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.simulation import SimulatedEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    engine = SimulatedEngine(model, SDP4BitConfig.preset("sdp4bit", bucket_numel=64), 1, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.shard_optimizer(optimizer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.pre_forward()
        for rank in range(2):
            with engine.running_as(rank):
                engine.zero_grad()
                engine.pre_backward()
                model(torch.randn(4, 8)).square().mean().backward()
                engine.receive_grads()
        engine.post_forward()
        engine.post_backward()
        engine.clip_grad_norm(1.0)
        engine.pre_optimizer_step()
        optimizer.step()
        engine.post_optimizer_step()
    names = {event.name for event in profile.events()}
    expected = {
        "sdp4bit::pre_forward",
        "sdp4bit::zero_grad",
        "sdp4bit::pre_backward",
        "sdp4bit::reduce",
        "sdp4bit::clip_grad_norm",
        "sdp4bit::pre_optimizer_step",
        "sdp4bit::post_optimizer_step",
        "sdp4bit::grad_exchange_start",
        "sdp4bit::grad_exchange_wait",
        "sdp4bit::weight_exchange_start",
        "sdp4bit::weight_exchange_wait",
    }
    assert expected <= names, expected - names
