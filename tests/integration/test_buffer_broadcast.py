"""Module buffers under sdp4bit follow DDP's, on 2 CPU ranks, against DDPStrategy, the oracle,
rank by rank:
- Trainer: with compression off and fp32, every rank's buffers (BatchNorm1d's running mean,
  variance and batch count, and a custom buffer that forward updates) and weights equal DDP's
  on that rank, bit for bit, after a fit with gradient accumulation (DDP's no_sync schedule) and validation
  mid-fit, and again after a resume from a checkpoint; the ranks' data differ, so rank 1's
  buffers differ from rank 0's at the end under DDP too (the comparison can fail);
- Fabric: the same against Fabric's DDP, with no_backward_sync micro-batches and a no-grad
  forward between steps, the module itself owning a buffer;
- `broadcast_buffers=False` equals `DDPStrategy(broadcast_buffers=False)`: each rank keeps its own;
- `Trainer(sync_batchnorm=True)` converts the BatchNorm layers to SyncBatchNorm for the fit and
  back afterwards, as DDPStrategy does; on CPU torch's SyncBatchNorm cannot train (it needs a
  GPU), and both strategies refuse it at setup with an error that says so;
- `trainer.fit(torch.compile(module))`: buffers and weights equal DDP's, with no graph break and
  as many graphs as under DDPStrategy (the broadcast is waited for before compiled code runs);
- without a Trainer: the engine's broadcast runs only when DDP's would (counted through a
  patched collective), and every rank holds rank 0's values once it returns.
"""

import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit
from torch import nn

STEPS = 5  # 10 batches: validation after batches 4 and 8, training last


class BufferNet(nn.Module):
    """Linear -> BatchNorm1d -> Linear, and a buffer of its own that forward updates (an input EMA)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.register_buffer("input_ema", torch.zeros(8))

    def forward(self, x):
        self.input_ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.net(x + self.input_ema)  # the buffer feeds the output, so the weights see it


def _data(seed, rank=None):
    g = torch.Generator().manual_seed(seed if rank is None else 100 * seed + rank)
    x = torch.randn(64 if rank is None else 4, 8, generator=g) + 1
    return x, x.mean(1, keepdim=True)


def _module_class():
    import lightning.pytorch as pl

    class BufferModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = BufferNet()

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val", nn.functional.mse_loss(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def _loader(self, seed):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(seed)), batch_size=4)

        def train_dataloader(self):
            return self._loader(0)

        def val_dataloader(self):
            return self._loader(1)

    return BufferModule


def _state(module):
    return {
        "buffers": {n: b.clone() for n, b in module.named_buffers()},
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
    }


def _compare_with_ddp(rank, world, directory):
    from lightning.pytorch.strategies import DDPStrategy

    BufferModule = _module_class()
    out = {}
    for name, make in (
        ("ddp", lambda: DDPStrategy()),
        ("sdp4bit", lambda: sdp4bit(preset="baseline")),
        ("ddp-off", lambda: DDPStrategy(broadcast_buffers=False)),
        ("sdp4bit-off", lambda: sdp4bit(preset="baseline", broadcast_buffers=False)),
    ):
        module = BufferModule()
        trainer = make_trainer(
            world, make(), max_steps=STEPS, accumulate_grad_batches=2, limit_val_batches=2, val_check_interval=4
        )
        trainer.fit(module)
        out[name] = _state(module)
        if name in ("ddp", "sdp4bit"):
            path = f"{directory}/{name}.ckpt"
            trainer.save_checkpoint(path)
            resumed = BufferModule()
            make_trainer(
                world,
                make(),
                max_steps=STEPS + 4,
                accumulate_grad_batches=2,
                limit_val_batches=2,
                val_check_interval=4,
            ).fit(resumed, ckpt_path=path)
            out[f"{name}-resumed"] = _state(resumed)
    out["sync_batchnorm"] = _sync_batchnorm(world, BufferModule)
    return out


def _sync_batchnorm(world, BufferModule):
    """Per strategy: the BatchNorm class after fit, and the error of the fit."""
    from lightning.pytorch.strategies import DDPStrategy

    seen = {}
    for name, strategy in (("ddp", DDPStrategy()), ("sdp4bit", sdp4bit(preset="baseline"))):
        module, error = BufferModule(), None
        try:
            make_trainer(world, strategy, max_steps=1, sync_batchnorm=True).fit(module)
        except ValueError as caught:
            error = str(caught)
        seen[name] = (type(module.model.net[1]).__name__, error)
    return seen


def test_buffers_and_sync_batchnorm_equal_ddp_on_every_rank(tmp_path):
    results = run_workers(_compare_with_ddp, 2, str(tmp_path))
    for rank, result in enumerate(results):
        for ours, oracle in (
            ("sdp4bit", "ddp"),
            ("sdp4bit-resumed", "ddp-resumed"),
            ("sdp4bit-off", "ddp-off"),
        ):
            for kind in ("buffers", "weights"):
                for name, expected in result[oracle][kind].items():
                    assert torch.equal(result[ours][kind][name], expected), (rank, ours, kind, name)
    # The oracle is not trivial: the ranks' buffers differ under DDP (rank 1 updated rank 0's
    # with its own last batch), and without the broadcast each rank's differ from DDP's.
    ddp0, ddp1 = results[0]["ddp"]["buffers"], results[1]["ddp"]["buffers"]
    assert not torch.equal(ddp0["model.net.1.running_mean"], ddp1["model.net.1.running_mean"])
    assert not torch.equal(ddp1["model.input_ema"], results[1]["ddp-off"]["buffers"]["model.input_ema"])
    for result in results:  # sync_batchnorm=True
        seen = result["sync_batchnorm"]
        # Converted (the error finds SyncBatchNorm layers), then reverted after fit, as under DDP.
        assert seen["sdp4bit"][0] == seen["ddp"][0] == "_BatchNormXd"
        assert "SyncBatchNorm layers only work with GPU modules" in seen["ddp"][1]
        assert "SyncBatchNorm layers (Trainer(sync_batchnorm=True)" in seen["sdp4bit"][1]


def _fabric_with_ddp(rank, world):
    """Fabric: accumulation (no_backward_sync), steps, and a no-grad forward between steps."""
    from fabric_runs import make_fabric
    from fabric_runs import sdp4bit as fabric_sdp4bit

    out = {}
    for name, strategy in (("ddp", "ddp"), ("sdp4bit", fabric_sdp4bit(preset="baseline"))):
        fabric = make_fabric(world, strategy)
        net = BufferNet()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        for step in range(3):
            for micro in range(2):
                x, y = _data(10 * step + micro, rank)
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                model(_data(99, rank)[0])
        out[name] = {n: b.clone() for n, b in net.named_buffers()}
    return out


def test_fabric_buffers_equal_ddp_on_every_rank():
    results = run_workers(_fabric_with_ddp, 2)
    for rank, result in enumerate(results):
        for name, expected in result["ddp"].items():
            assert torch.equal(result["sdp4bit"][name], expected), (rank, name)
    assert not torch.equal(results[0]["ddp"]["input_ema"], results[1]["ddp"]["input_ema"])


# ------------------------------------------------------------------------------------------------
# Without a Trainer


def _schedule(rank, world):
    from lightning_sdp4bit import comm
    from lightning_sdp4bit.buffer_sync import BufferBroadcast
    from lightning_sdp4bit.topology import Topology, create_process_groups

    groups = create_process_groups(Topology(rank, world, world))
    torch.manual_seed(rank)  # each rank starts with its own buffers
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.normal_()
    broadcasts, broadcast = [], comm.broadcast

    def counting(*args, **kwargs):
        broadcasts.append(1)
        return broadcast(*args, **kwargs)

    comm.broadcast = counting
    try:
        sync = BufferBroadcast(model, groups.world, rank)
        seen, agreed = [], []
        for grad_enabled, grad_sync in ((True, False), (True, True), (False, True), (False, True), (True, True)):
            with torch.set_grad_enabled(grad_enabled):
                before = len(broadcasts)
                sync.before_forward()
                seen.append(len(broadcasts) > before)
                gathered = [torch.empty(4) for _ in range(world)]
                torch.distributed.all_gather(gathered, model[1].running_mean.clone())
                agreed.append(all(torch.equal(g, gathered[0]) for g in gathered))
                model(torch.randn(8, 4))  # BatchNorm updates rank 0's values with this rank's batch
                sync.after_forward(grad_sync)
        off = BufferBroadcast(model, groups.world, rank, enabled=False)
        before = len(broadcasts)
        off.before_forward()
        seen.append(len(broadcasts) > before)
    finally:
        comm.broadcast = broadcast
    return seen, agreed


def test_the_broadcast_runs_on_ddps_schedule():
    # First forward: always. After a no_sync forward: not. After a synced training forward: yes.
    # After an evaluation forward (no grad): not. Disabled: never.
    # Right after a broadcast, every rank holds rank 0's values; after a skipped one, its own.
    expected = ([True, False, True, False, False, False], [True, False, True, False, False])
    assert run_workers(_schedule, 2) == [expected] * 2


def _compiled(rank, world):
    """trainer.fit(torch.compile(module)) under both strategies: buffers, graph breaks, graphs."""
    import torch._dynamo
    from lightning.pytorch.strategies import DDPStrategy
    from torch._dynamo.utils import counters

    out = {}
    for name, strategy in (("ddp", DDPStrategy()), ("sdp4bit", sdp4bit(preset="baseline"))):
        torch._dynamo.reset()
        counters.clear()
        module = _module_class()()
        make_trainer(world, strategy, max_steps=3, accumulate_grad_batches=2).fit(torch.compile(module))
        out[name] = {
            **_state(module),
            "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"],
        }
    return out


def test_compiled_module_buffers_equal_ddp_with_no_graph_break_or_recompile():
    for rank, result in enumerate(run_workers(_compiled, 2)):
        ours, oracle = result["sdp4bit"], result["ddp"]
        assert ours["graph_breaks"] == oracle["graph_breaks"] == {}, (ours["graph_breaks"], oracle["graph_breaks"])
        assert ours["graphs"] == oracle["graphs"] > 0, (ours["graphs"], oracle["graphs"])
        for kind in ("buffers", "weights"):
            for name, expected in oracle[kind].items():
                assert torch.equal(ours[kind][name], expected), (rank, kind, name)
