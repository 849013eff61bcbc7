"""What Lightning promises a LightningModule and its callbacks, kept under sdp4bit, against
DDPStrategy on the same seed (2 CPU ranks, fp32; one set of processes for every case):
- `p.grad = None` set in on_before_optimizer_step makes the optimizer skip that parameter that
  step, as under DDP (AdamW with weight decay shows the difference), bit for bit under baseline;
- weights read in training_step outside a module's forward are the current ones, under the
  default compression (several buckets): an L2 penalty before the forward equals the same
  penalty once every all-gather has completed, and bit for bit DDP's run under baseline; a
  functional model (parameters used directly, no submodule forward) reads current weights; an
  unused submodule draws no warning; a read hidden from torch function modes warns once, naming
  the parameters, and from then on the weights are complete right after each step;
- a checkpoint holds what was written: after StochasticWeightAveraging (`detach().copy_`),
  EMAWeightAveraging (`.data.copy_`) and a no_grad in-place write, each of a value that may
  equal the weights the exchange left, the consolidated masters equal the module's weights,
  while unwritten parameters keep masters apart from the weights (qWD); `weights="module"`
  gives the module's weights;
- `LightningModule.load_from_checkpoint` reads a sharded directory (the consolidated masters),
  and a damaged one raises the CheckpointError that names the file.
"""

import os
import warnings

import pytest
import torch
from distributed import run_workers
from lightning_runs import ddp, make_trainer, sdp4bit, weights
from models import VOCAB, TinyLMModule
from torch import nn
from torch.nn import functional as F

_UNSEEN = "received gradients although their updated weights had not arrived"


class DropsEmbeddingGrad(TinyLMModule):
    """Sets the tied embedding's gradient to None on odd steps: AdamW must skip it then."""

    def on_before_optimizer_step(self, optimizer):
        if self.global_step % 2 == 1:
            self.model.embed.weight.grad = None


class L2BeforeForward(TinyLMModule):
    """An L2 penalty over every parameter, computed before the forward."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.penalties = []  # (read before the forward, read with every all-gather complete)

    def training_step(self, batch, batch_idx):
        penalty = sum((p**2).sum() for p in self.parameters())
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            engine.wait_weights()  # the oracle: every all-gather complete
        self.penalties.append((penalty.item(), sum((p**2).sum() for p in self.parameters()).item()))
        return self.model.loss(batch) + 1e-3 * penalty


class Functional(TinyLMModule):
    """A bigram model on nn.Parameters used directly (no submodule forward), beside an unused
    submodule; `hidden` reads the parameters with torch function modes off."""

    def __init__(self, hidden=False, **kwargs):
        super().__init__(**kwargs)
        del self.model
        self.hidden = hidden
        generator = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(VOCAB, 16, generator=generator) * 0.1)
        self.w = nn.Parameter(torch.randn(16, VOCAB, generator=generator) * 0.1)
        self.b = nn.Parameter(torch.zeros(VOCAB))
        self.unused = nn.Linear(16, 16)
        self.reads = []  # per step: the weights read equal the complete ones after backward

    def training_step(self, batch, batch_idx):
        if self.hidden:
            with torch._C.DisableTorchFunction():
                self.seen = [p.clone() for p in (self.emb, self.w, self.b)]
        else:
            self.seen = [p.detach().clone() for p in (self.emb, self.w, self.b)]
        x, y = batch[:, :-1], batch[:, 1:]
        if self.hidden:
            with torch._C.DisableTorchFunction():
                logits = self.emb[x] @ self.w + self.b
        else:
            logits = self.emb[x] @ self.w + self.b
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def on_after_backward(self):
        # Every all-gather completed before backward: these are the step's current weights.
        self.reads.append(all(torch.equal(s, p) for s, p in zip(self.seen, (self.emb, self.w, self.b), strict=True)))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class WritesEqualValues(TinyLMModule):
    """At the end of fit, writes three parameters with the values they hold, three ways."""

    WRITTEN = ("model.norm.weight", "model.position", "model.blocks.0.mlp.0.weight")

    def on_before_backward(self, loss):
        # The graph is alive: a .data write must not trip backward's check of saved tensors.
        self.model.norm.weight.data.mul_(1.0)

    def on_train_end(self):
        with torch.no_grad():
            self.model.norm.weight.mul_(1.0)
            self.model.position.copy_(self.model.position.clone())
        self.model.blocks[0].mlp[0].weight.data.copy_(self.model.blocks[0].mlp[0].weight.data.clone())


def _fit_caught(world, strategy, module, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(world, strategy, **kwargs).fit(module)
    return [str(w.message) for w in caught if _UNSEEN in str(w.message)]


def _saved(directory, name, trainer, module):
    """The module's weights (by state_dict name) and the consolidated checkpoint, both ways."""
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    path = os.path.join(directory, f"{name}.ckpt")
    trainer.save_checkpoint(path)
    state = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {
        "module": state,
        "masters": {n: consolidate_checkpoint(path)["state_dict"][n] for n in state},
        "weights": {n: consolidate_checkpoint(path, weights="module")["state_dict"][n] for n in state},
    }


def _contracts(rank, world, directory):
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

    out = {}
    for name, make in (("ddp", ddp), ("baseline", lambda: sdp4bit(preset="baseline"))):
        module = DropsEmbeddingGrad()
        make_trainer(world, make(), max_steps=4).fit(module)
        out[f"grad_none_{name}"] = weights(module)
        module = L2BeforeForward()
        make_trainer(world, make(), max_steps=4).fit(module)
        out[f"l2_{name}"] = weights(module)

    module = L2BeforeForward()
    out["l2_warnings"] = _fit_caught(world, sdp4bit(), module, max_steps=4)
    out["l2_penalties"] = module.penalties
    module = Functional()
    out["functional_warnings"] = _fit_caught(world, sdp4bit(), module, max_steps=4)
    out["functional_reads"] = module.reads
    module = Functional(hidden=True)
    out["hidden_warnings"] = _fit_caught(world, sdp4bit(), module, max_steps=4)
    out["hidden_reads"] = module.reads

    for name, module, kwargs in (
        ("swa", TinyLMModule(dataset_size=16), {"max_epochs": 3, "callbacks": [StochasticWeightAveraging(5e-3, 1)]}),
        ("ema", TinyLMModule(), {"max_steps": 3, "callbacks": [EMAWeightAveraging(decay=0.5)]}),
        ("written", WritesEqualValues(), {"max_steps": 3}),
    ):
        trainer = make_trainer(world, sdp4bit(), **kwargs)
        trainer.fit(module)
        out[name] = _saved(directory, name, trainer, module)
    return out


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("contracts")


@pytest.fixture(scope="module")
def results(directory):
    return run_workers(_contracts, 2, str(directory))


def test_grad_set_to_none_skips_the_parameter_as_under_ddp(results):
    for result in results:
        for name, expected in result["grad_none_ddp"].items():
            assert torch.equal(result["grad_none_baseline"][name], expected), name


def test_weights_read_outside_a_forward_are_current(results):
    for result in results:
        for name, expected in result["l2_ddp"].items():
            assert torch.equal(result["l2_baseline"][name], expected), name
        assert len(result["l2_penalties"]) == 4
        assert all(before == complete for before, complete in result["l2_penalties"]), result["l2_penalties"]
        assert result["functional_reads"] == [True] * 4
        assert result["l2_warnings"] == [] and result["functional_warnings"] == []  # `unused` draws none


def test_a_read_hidden_from_the_strategy_warns_once_then_weights_are_complete_after_each_step(results):
    for result in results:
        # Step 0 reads the initial weights (nothing in flight); step 1 reads stale ones, unseen.
        assert result["hidden_reads"] == [True, False, True, True]
        (message,) = result["hidden_warnings"]
        assert "'emb'" in message and "DisableTorchFunction" in message and "right after each optimizer step" in message


@pytest.mark.parametrize("name", ["swa", "ema", "written"])
def test_a_checkpoint_holds_what_was_written(results, name):
    for result in results:
        saved = result[name]
        written = WritesEqualValues.WRITTEN if name == "written" else saved["module"]
        for key in written:
            assert torch.equal(saved["masters"][key], saved["module"][key]), key
        for key, value in saved["module"].items():
            assert torch.equal(saved["weights"][key], value), key
        if name == "written":  # the others keep their fp32 masters, apart from the weights after qWD
            assert any(not torch.equal(saved["masters"][k], v) for k, v in saved["module"].items() if k not in written)


def test_load_from_checkpoint_reads_a_sharded_directory(results, directory):
    import lightning_sdp4bit  # noqa: F401  (hooks Lightning's checkpoint loader)
    from lightning_sdp4bit.checkpoint import CheckpointError

    loaded = WritesEqualValues.load_from_checkpoint(directory / "written.ckpt")
    for name, expected in results[0]["written"]["masters"].items():
        assert torch.equal(dict(loaded.named_parameters())[name], expected), name
    shard = next((directory / "written.ckpt").glob("gen_*/shard_00001.pt"))
    shard.write_bytes(shard.read_bytes()[:-8])  # damaged: the error names the file
    with pytest.raises(CheckpointError, match="shard_00001.pt"):
        WritesEqualValues.load_from_checkpoint(directory / "written.ckpt")
