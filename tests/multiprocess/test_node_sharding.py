"""weight_sharding="node" against "replicated", on gloo jobs of 2 nodes x 2 and 2 nodes x 4:
- for presets baseline, qwd, tlq_hs and sdp4bit, after 3 optimizer steps of 2 accumulated
  micro-batches with clipping by the global norm, every rank's losses, weights, fp32 master shards
  and optimizer state are equal bit for bit (bf16 weights, AdamW with weight decay), on the tiny
  tied-embedding model, on the same model with each block under activation checkpointing, on a
  GPT-2-shaped one whose tied bucket the backward releases after the head's backward and gathers
  again for the first block's (which shares it), and on the
  same with every third forward skipping a block (its gathers prefetched by the last pass's
  order, which that pass does not follow);
- between steps each rank holds 1/L of the weights: every bucket is released (its parameters
  NaN placeholders of their shapes) and its node slice holds M of the W shards;
- a NaN written into a weight (through the guard's gather) stops every rank after the first skipped
  step, naming the parameter and the ranks whose node slices hold it;
- a meta-device module is built as node slices on every rank and trains as the same module built
  on the CPU by the same initialization steps; ranks seeded apart are refused on every rank; a
  meta-device module is refused under "replicated";
- the gathers inside the node are counted in comm_stats ("weight_gather"), and the exchange across
  nodes sends what the replicated mode's first stage sends;
- a parameter used again right after its module's forward, before the next module's (where its
  bucket would be released), keeps the bucket for the backward: the same weights as replicated.
"""

import contextlib

import pytest
import torch
from distributed import run_workers
from models import TiedGPT, TinyLM, batch
from states import assert_same_state
from torch.utils.checkpoint import checkpoint

from lightning_sdp4bit import SDP4BitConfig

PRESETS = ("baseline", "qwd", "tlq_hs", "sdp4bit")
STEPS, ACCUMULATE, CLIP = 3, 2, 0.05  # the clip is below the tiny model's gradient norm: it scales


class CheckpointedLM(TinyLM):
    """TinyLM with each block's activations recomputed in backward (non-reentrant checkpoint)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


class SkippingGPT(TiedGPT):
    """TiedGPT whose every third forward skips its second block: control flow that changes from
    one pass to the next, alike on every rank."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for number, block in enumerate(self.blocks):
            if not (number == 1 and self.calls % 3 == 0):
                x = x + block(x)
        return self.head(self.ln_f(x))


MODELS = {"plain": TinyLM, "checkpointed": CheckpointedLM, "gpt": TiedGPT, "gpt-skipping": SkippingGPT}


def _config(preset: str, sharding: str) -> SDP4BitConfig:
    # Small buckets, so that each job has several (the model holds about 19.6K elements).
    return SDP4BitConfig.preset(preset, bucket_numel=4096, first_bucket_numel=2048, weight_sharding=sharding)


def _train(module, engine, optimizer, rank):
    losses, stats = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            with engine.no_sync() if micro < ACCUMULATE - 1 else contextlib.nullcontext():
                if micro == 0:
                    engine.zero_grad()
                engine.pre_forward()
                loss = module.loss(batch(rank, step, micro))
                engine.post_forward()
                engine.pre_backward()
                (loss / ACCUMULATE).backward()
                engine.post_backward()
                losses.append(loss.item())
        engine.clip_grad_norm(CLIP)
        engine.pre_optimizer_step()
        optimizer.step()
        stats.append(engine.post_optimizer_step())
    return losses, stats


def _unguarded_nan(engine) -> list[bool]:
    """Whether each parameter is NaN, read past the engine's guard (which would gather it)."""
    with torch._C.DisableTorchFunction():
        return [bool(p.isnan().all()) for b in engine.buckets for p in b.params]


def _job(rank, world, ranks_per_node):
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    out = {}
    for model in MODELS:
        for preset in PRESETS:
            for sharding in ("replicated", "node"):
                torch.manual_seed(0)  # as make_model(0): both modes start from the same weights
                module = MODELS[model]().to(torch.bfloat16)
                optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
                engine = ShardedEngine(module, _config(preset, sharding), topology, groups)
                engine.shard_optimizer(optimizer)
                losses, stats = _train(module, engine, optimizer, rank)
                engine.wait_weights()
                held = {
                    "released": [not any(engine.primary.node_shards.gathered)] if sharding == "node" else [],
                    "nan_params": _unguarded_nan(engine) if sharding == "node" else [],
                    "held_numel": sum(b.held_weights.numel() for b in engine.buckets),
                    "bucket_numel": sum(b.layout.numel for b in engine.buckets),
                }
                masters = [b.master.clone() for b in engine.buckets]
                engine.close()  # the module whole again
                out[(model, preset, sharding)] = {
                    "losses": losses,
                    "weights": {name: p.detach().clone() for name, p in module.named_parameters()},
                    "masters": masters,
                    "optimizer": optimizer.state_dict(),
                    "stats": stats[-1],
                    "held": held,
                }
    return out


@pytest.mark.parametrize("nodes,ranks_per_node", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_node_sharding_matches_the_replicated_mode_bit_for_bit(nodes, ranks_per_node):
    world = nodes * ranks_per_node
    results = run_workers(_job, world, ranks_per_node)
    for rank in range(world):
        for model in MODELS:
            for preset in PRESETS:
                node = results[rank][(model, preset, "node")]
                replicated = results[rank][(model, preset, "replicated")]
                where = f"{model}, {preset}, rank {rank}"
                assert_same_state(node, replicated, where)
                # Between steps: every bucket released, 1/L of the weights held.
                assert node["held"]["released"] == [True], where
                assert all(node["held"]["nan_params"]), where
                assert node["held"]["held_numel"] * ranks_per_node == node["held"]["bucket_numel"], where
                assert replicated["held"]["held_numel"] == replicated["held"]["bucket_numel"], where
                # The exchange across nodes sends the same bytes; only node mode gathers inside the node.
                assert node["stats"]["weight_bytes"] == replicated["stats"]["weight_bytes"], where
                assert node["stats"]["weight_intra_bytes"] == 0, where
                assert replicated["stats"]["weight_gather_bytes"] == 0, where
                assert node["stats"]["weight_gather_bytes"] > 0, where
    # The comparison can see a difference: the presets end apart.
    first = results[0]
    assert not torch.equal(
        first[("plain", "baseline", "node")]["masters"][0], first[("plain", "sdp4bit", "node")]["masters"][0]
    )


def _meta_model() -> torch.nn.Module:
    """A model every module of which owns a reset_parameters(), built on the meta device."""
    with torch.device("meta"):
        return torch.nn.Sequential(
            torch.nn.Embedding(61, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 61)
        )


def _initialized_like_meta() -> torch.nn.Module:
    """The same model made real by the same steps, module by module, as `materialize` takes them."""
    module = _meta_model()
    for owner in module.modules():
        if any(True for _ in owner.parameters(recurse=False)):
            owner.to_empty(device="cpu", recurse=False)
            owner.reset_parameters()
    return module


def _meta_job(rank, world, ranks_per_node, seeded):
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    config = _config("sdp4bit", "node")
    if not seeded:  # each rank draws its own initial weights
        torch.manual_seed(rank)
        with pytest.raises(RuntimeError, match=r"initialized parameters \['0.weight'.*differently.*seed_everything"):
            ShardedEngine(_meta_model(), config, topology, groups, device=torch.device("cpu"))
        return None
    out = {}
    for sharding in ("replicated", "node"):
        torch.manual_seed(0)
        module = _meta_model() if sharding == "node" else _initialized_like_meta()
        engine = ShardedEngine(module, _config("sdp4bit", sharding), topology, groups, device=torch.device("cpu"))

        def loss_of(step, module=module):
            tokens = batch(rank, step)
            logits = module(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), tokens[:, 1:].reshape(-1))

        out[sharding] = _weights_after_steps(module, engine, loss_of)
    return out


def _weights_after_steps(module, engine, loss_of, steps: int = 2) -> dict:
    """`steps` plain optimizer steps (AdamW) through the step protocol, `loss_of(step)` each
    step's loss; then the engine closed (the module whole again) and its weights."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)  # after the engine: a meta module's parameters are new
    engine.shard_optimizer(optimizer)
    for step in range(steps):
        engine.zero_grad()
        engine.pre_forward()
        loss = loss_of(step)
        engine.post_forward()
        engine.pre_backward()
        loss.backward()
        engine.post_backward()
        engine.pre_optimizer_step()
        optimizer.step()
        engine.post_optimizer_step()
    engine.close()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _assert_the_modes_agree(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name, weight in result["replicated"].items():
            assert not weight.isnan().any() and torch.equal(result["node"][name], weight), f"rank {rank}: {name}"


def test_a_meta_device_module_is_built_as_node_slices_alike_on_every_rank():
    _assert_the_modes_agree(run_workers(_meta_job, 4, 2, True))
    run_workers(_meta_job, 4, 2, False)  # unseeded ranks are refused on every rank


def test_a_meta_device_module_needs_reset_parameters_and_node_sharding():
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import ProcessGroups, Topology

    with torch.device("meta"):
        tiny = TinyLM()  # its own `position` parameter has no reset_parameters()
    topology, groups = Topology(0, 1, 1), ProcessGroups(world=None, intra=None, inter=None)
    with pytest.raises(ValueError, match="only weight_sharding='node' builds it in place"):
        ShardedEngine(tiny, _config("baseline", "replicated"), topology, groups, device=torch.device("cpu"))


class _ReadAfterItsModule(torch.nn.Module):
    """`b.bias` used again right after b's forward: the multiplication saves the parameter itself."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.c(self.b(self.a(x)) * self.b.bias)  # c's forward would release b's bucket


def _read_after_module_job(rank, world, ranks_per_node):
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    out = {}
    for sharding in ("replicated", "node"):
        torch.manual_seed(0)
        module = _ReadAfterItsModule()
        config = SDP4BitConfig.preset("sdp4bit", bucket_numel=16 * 16 + 16, weight_sharding=sharding)
        engine = ShardedEngine(module, config, topology, groups)

        def loss_of(step, module=module):
            return module(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean()

        out[sharding] = _weights_after_steps(module, engine, loss_of)
    return out


def test_a_read_right_after_its_modules_forward_keeps_the_bucket_for_the_backward():
    _assert_the_modes_agree(run_workers(_read_after_module_job, 4, 2))


def _poisoned(rank, world, ranks_per_node):
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.guards import NonFiniteStateError
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, ranks_per_node)
    module = TinyLM().to(torch.bfloat16)
    engine = ShardedEngine(module, _config("sdp4bit", "node"), topology, create_process_groups(topology))
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    engine.shard_optimizer(optimizer)
    with torch.no_grad():
        # A hook's write: it gathers the bucket and is kept. Element 0 is in rank 0's shard, which the
        # node slices of local index 0 hold (ranks 0 and 2), as every rank's replica would.
        module.blocks[1].mlp[0].weight[0, 0] = float("nan")
    with pytest.raises(
        NonFiniteStateError, match=r"'blocks.1.mlp.0.weight' \(masters on ranks \[0\]; weights on ranks \[0, 2\]\)"
    ) as caught:
        _train(module, engine, optimizer, rank)
    return str(caught.value)


def test_a_non_finite_weight_in_a_node_slice_stops_every_rank():
    messages = run_workers(_poisoned, 4, 2)
    assert all("after 1 optimizer step(s) skipped" in message for message in messages)
