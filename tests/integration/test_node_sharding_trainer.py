"""weight_sharding="node" through the Trainer and Fabric, on 4 gloo processes as 2 nodes x 2,
against "replicated", bit for bit:
- a fit with accumulation 2, clipping, validation, a callback that reads every gradient in
  on_before_optimizer_step, every weight after each batch, and clamps them (a write the masters
  take in); its checkpoint resumes in the other mode (and the other's in it) to the same weights
  as a resume in the same mode; after fit the module holds its whole weights again;
- a module built in configure_model is on the meta device under "node" and trains to the weights
  of the same module built on the CPU by the same initialization steps;
- Fabric with no_backward_sync accumulation and clipping;
- a checkpoint of 4 ranks resumes on 2 (the full-state path, written into the node slices) with
  the weights consolidate_checkpoint gives;
- a bad weight_sharding names the field; a compiled module is refused before the engine exists.
"""

import os

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit, weights
from models import TinyLMModule

STEPS, MORE = 4, 6
DATA = dict(dataset_size=1, repeat=64)  # one window repeated: a resume replays nothing else


class ReadAndClamp(pl.Callback):
    """Reads every gradient before each step, and every weight after each batch (norms, as a
    logger would), then clamps the weights (as a constraint would): the read gathers released
    buckets, the clamp is an edit to keep."""

    def __init__(self):
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.norms.append(float(sum(p.grad.float().square().sum() for p in module.parameters())))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.norms.append(float(sum(p.detach().float().square().sum() for p in module.parameters())))
        with torch.no_grad():
            for p in module.parameters():
                p.clamp_(-0.2, 0.2)


def _fit(world, sharding, steps, ckpt_path=None, save_to=None):
    module = TinyLMModule(**DATA)
    callback = ReadAndClamp()
    trainer = make_trainer(
        world,
        sdp4bit(preset="sdp4bit", ranks_per_node=2, weight_sharding=sharding),
        max_steps=steps,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        limit_val_batches=1,
        val_check_interval=4,
        callbacks=[callback],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {"weights": weights(module), "norms": callback.norms, "gathered": trainer.strategy.comm_stats}


def _fits(rank, world, directory):
    out = {}
    for sharding in ("replicated", "node"):
        path = os.path.join(directory, f"{sharding}.ckpt")
        out[sharding] = _fit(world, sharding, STEPS, save_to=path)
    for saved in ("replicated", "node"):
        for resumed in ("replicated", "node"):
            path = os.path.join(directory, f"{saved}.ckpt")
            out[(saved, resumed)] = _fit(world, resumed, MORE, ckpt_path=path)
    return out


def test_node_sharding_through_the_trainer_matches_the_replicated_mode(tmp_path):
    results = run_workers(_fits, 4, str(tmp_path))
    for rank, result in enumerate(results):
        replicated, node = result["replicated"], result["node"]
        assert len(node["norms"]) == 2 * STEPS + STEPS and node["norms"] == replicated["norms"], rank
        assert node["gathered"]["weight_gather_bytes"] > 0 == replicated["gathered"]["weight_gather_bytes"]
        for name, weight in replicated["weights"].items():
            assert not weight.isnan().any(), name
            assert torch.equal(node["weights"][name], weight), f"rank {rank}: {name}"
        # A checkpoint resumes in either mode to the same bits.
        expected = result[("replicated", "replicated")]["weights"]
        for pair in (("replicated", "node"), ("node", "replicated"), ("node", "node")):
            for name, weight in expected.items():
                assert torch.equal(result[pair]["weights"][name], weight), f"rank {rank}, {pair}: {name}"
    # The runs trained: the resumed weights moved from the saved ones.
    assert not torch.equal(results[0]["node"]["weights"]["embed.weight"], expected["embed.weight"])


@pytest.mark.parametrize("bad", ["nodes", 2])
def test_a_bad_weight_sharding_is_refused_naming_the_field(bad):
    from lightning_sdp4bit import SDP4BitConfig

    with pytest.raises(ValueError, match=r"weight_sharding must be one of 'replicated', 'node'"):
        SDP4BitConfig(weight_sharding=bad)


class ConfiguredLM(pl.LightningModule):
    """Built in configure_model: on the meta device under weight_sharding="node" (the strategy's
    model_sharded_context), where fit initializes it module by module through reset_parameters();
    on the CPU otherwise, initialized by the same steps."""

    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self):
        layers = [torch.nn.Embedding(61, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 61)]
        self.model = torch.nn.Sequential(*layers)
        torch.manual_seed(7)
        self.built_on_meta = self.model[0].weight.is_meta
        if not self.built_on_meta:
            for layer in layers:
                layer.reset_parameters()

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        from models import TokenDataset

        return torch.utils.data.DataLoader(TokenDataset(32), batch_size=4)


def _configured(rank, world):
    out = {}
    for sharding in ("replicated", "node"):
        module = ConfiguredLM()
        strategy = sdp4bit(preset="sdp4bit", ranks_per_node=2, weight_sharding=sharding)
        trainer = make_trainer(world, strategy, max_steps=3)
        trainer.fit(module)
        out[sharding] = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        out[sharding, "meta"] = module.built_on_meta
    return out


def test_configure_model_builds_on_the_meta_device_and_trains_as_the_replicated_mode():
    for rank, result in enumerate(run_workers(_configured, 4)):
        assert result["node", "meta"] and not result["replicated", "meta"]
        for name, weight in result["replicated"].items():
            assert not weight.isnan().any(), name
            assert torch.equal(result["node"][name], weight), f"rank {rank}: {name}"


def _fabric_runs(rank, world):
    import fabric_runs

    out = {}
    for sharding in ("replicated", "node"):
        fabric = fabric_runs.make_fabric(
            world, fabric_runs.sdp4bit(preset="sdp4bit", ranks_per_node=2, weight_sharding=sharding)
        )
        model, optimizer, schedule = fabric_runs.setup(fabric)
        fabric_runs.train(fabric, model, optimizer, schedule, range(3))
        out[sharding] = fabric_runs.weights(fabric, model)
    return out


def test_fabric_trains_as_the_replicated_mode():
    for rank, result in enumerate(run_workers(_fabric_runs, 4)):
        for name, weight in result["replicated"].items():
            assert not weight.isnan().any(), name
            assert torch.equal(result["node"][name], weight), f"rank {rank}: {name}"


def _fit_compiled(rank, world):
    trainer = make_trainer(world, sdp4bit(weight_sharding="node", ranks_per_node=2), max_steps=1)
    with pytest.raises(ValueError, match="weight_sharding='node' does not run under torch.compile") as caught:
        trainer.fit(torch.compile(TinyLMModule()))
    return str(caught.value)


def test_a_compiled_module_is_refused_before_the_engine_is_built():
    assert all("uncompiled" in message for message in run_workers(_fit_compiled, 2))


def _save_node(rank, world, path):
    _fit(world, "node", STEPS, save_to=path)


def _resume_elsewhere(rank, world, path):
    """Resume on 2 ranks (1 node of 2) what 4 saved: the full-state path, written into the node
    slices; what the engine holds before the first step, gathered."""
    module = TinyLMModule(**DATA)
    trainer = make_trainer(
        world, sdp4bit(preset="sdp4bit", ranks_per_node=2, weight_sharding="node"), max_steps=STEPS + 1
    )
    loaded = {}

    def grab(*args):
        loaded.update({n: p.detach().float().clone() for n, p in module.model.named_parameters()})

    module.on_train_start = grab
    trainer.fit(module, ckpt_path=path)
    return loaded


def test_a_node_checkpoint_resumes_on_another_world_size_with_its_weights(tmp_path):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    path = str(tmp_path / "node4.ckpt")
    run_workers(_save_node, 4, path)
    saved = consolidate_checkpoint(path, str(tmp_path / "plain.ckpt"), weights="module")["state_dict"]
    for loaded in run_workers(_resume_elsewhere, 2, path):
        for name, weight in loaded.items():
            assert torch.equal(weight, saved[f"model.{name}"].float()), name
