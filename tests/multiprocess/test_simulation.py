"""A job of W ranks simulated on one device against the same job on W gloo processes:
- after 3 optimizer steps of 2 accumulated micro-batches, with clipping by the global norm on,
  every rank's weights, fp32 master shards and optimizer state, and every rank's per-micro-batch
  losses, are equal bit for bit, for presets baseline, qwd, tlq_hs and sdp4bit, at W = 4 as
  2 nodes x 2 and W = 8 as 2 x 4 (bf16 weights, AdamW with weight decay);
- a simulation with another rounding seed ends elsewhere (the comparison can see a difference);
- simulated groups refuse synchronous collectives and a wait before every member launched;
- the simulated reduce-scatter's fold (multi-tensor on a GPU) takes each output's sum in member
  order, bit for bit as a gloo group's.
"""

import contextlib

import pytest
import torch
from distributed import as_one_worker, run_workers
from models import batch, make_model
from states import assert_same_state

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.simulation import SimulatedEngine
from lightning_sdp4bit.simulation.groups import SimulatedGroup

PRESETS = ("baseline", "qwd", "tlq_hs", "sdp4bit")
STEPS, ACCUMULATE, CLIP = 3, 2, 0.05  # the clip is below the tiny model's gradient norm: it scales


def _config(preset: str, seed: int = 0) -> SDP4BitConfig:
    # Small buckets, so that each job has several (the model holds about 19.6K elements).
    return SDP4BitConfig.preset(preset, bucket_numel=4096, first_bucket_numel=2048, seed=seed)


def _setup(preset: str, seed: int = 0):
    module = make_model(0).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
    return module, optimizer


def _train(module, engine, optimizer, ranks, simulated):
    """The loop both jobs run, through the engine's step protocol: `ranks` are the ranks this
    process computes (the engine's ranks 0, 1, ... in turn)."""
    losses = {rank: [] for rank in ranks}
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            with engine.no_sync() if micro < ACCUMULATE - 1 else contextlib.nullcontext():
                for index, rank in enumerate(ranks):
                    with engine.running_as(index):
                        if micro == 0:
                            engine.zero_grad()
                        engine.pre_backward()
                        loss = module.loss(batch(rank, step, micro))
                        (loss / ACCUMULATE).backward()
                        if simulated:
                            engine.receive_grads()
                    losses[rank].append(loss.item())
                engine.post_backward()
        engine.clip_grad_norm(CLIP)
        engine.pre_optimizer_step()
        optimizer.step()
        engine.post_optimizer_step()
    engine.wait_weights()
    return losses


def _state(module, buckets, optimizer):
    return {
        "weights": {name: p.detach().clone() for name, p in module.named_parameters()},
        "masters": [b.master.clone() for b in buckets],
        "optimizer": optimizer.state_dict(),
    }


def _real_job(rank, world, ranks_per_node):
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    out = {}
    for preset in PRESETS:
        module, optimizer = _setup(preset)
        engine = ShardedEngine(module, _config(preset), topology, groups)
        engine.shard_optimizer(optimizer)
        losses = _train(module, engine, optimizer, [rank], simulated=False)
        engine.close()
        out[preset] = {"losses": losses[rank], **_state(module, engine.buckets, optimizer)}
    return out


def _simulate(preset, nodes, ranks_per_node, seed=0):
    module, optimizer = _setup(preset)
    engine = SimulatedEngine(module, _config(preset, seed), nodes, ranks_per_node)
    engine.shard_optimizer(optimizer)
    ranks = range(nodes * ranks_per_node)
    losses = _train(module, engine, optimizer, ranks, simulated=True)
    return engine, [
        {
            "losses": losses[r],
            **_state(
                module, engine.ranks[r].buckets, ([optimizer] + [rank.optimizers[0] for rank in engine.ranks[1:]])[r]
            ),
        }
        for r in ranks
    ]


@pytest.mark.parametrize("nodes,ranks_per_node", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_simulation_matches_the_real_job_bit_for_bit(nodes, ranks_per_node):
    world = nodes * ranks_per_node
    real = run_workers(_real_job, world, ranks_per_node)
    with as_one_worker():
        for preset in PRESETS:
            engine, simulated = _simulate(preset, nodes, ranks_per_node)
            for rank in range(world):
                assert_same_state(simulated[rank], real[rank][preset], f"{preset}, rank {rank}")
        # The comparison sees a difference: another rounding seed moves the compressed job.
        _, reseeded = _simulate("sdp4bit", nodes, ranks_per_node, seed=1)
        assert not torch.equal(reseeded[0]["masters"][0], real[0]["sdp4bit"]["masters"][0])


def test_simulated_groups_refuse_what_one_process_cannot_do():
    group = SimulatedGroup(2)
    first, second = group.member(0), group.member(1)
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="synchronous all_reduce"):
        first.all_reduce(x, async_op=False)
    work = first.all_reduce(x, async_op=True)
    with pytest.raises(RuntimeError, match=r"waited for all_reduce before members \[1\]"):
        work.wait()
    second.all_reduce(torch.full((4,), 2.0), async_op=True)
    assert work.wait() and torch.equal(x, torch.full((4,), 3.0))
    first.all_reduce(x, async_op=True)
    with pytest.raises(RuntimeError, match="launched all_gather where its peers launched all_reduce"):
        second.all_gather(torch.empty(8), x, async_op=True)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
def test_the_simulated_reduce_scatter_folds_each_chunk_in_member_order(device):
    """Member p's output is the left fold of every member's chunk p in member order, bit for bit
    as `comm.sum_rows_into` takes it for a gloo group (on a GPU the fold is multi-tensor: one add
    per member for all outputs). The chunks mix magnitudes, so that another order of the sums
    (or another member's chunk) gives other bits."""
    from lightning_sdp4bit.comm import sum_rows_into

    size, n = 5, 4099
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e8, 1.0, -1e8, 1e-3, 3.0]).repeat_interleave(n)  # per chunk of each input
    inputs = [(torch.randn(size * n, generator=generator) * scales.roll(q * n)).to(device) for q in range(size)]
    group = SimulatedGroup(size)
    outputs = [torch.empty(n, device=device) for _ in range(size)]
    works = [group.member(p).reduce_scatter(outputs[p], inputs[p], async_op=True) for p in range(size)]
    for work in works:
        work.wait()
    for p in range(size):
        expected = torch.empty(n, device=device)
        sum_rows_into(expected, [inputs[q].view(size, n)[p] for q in range(size)])
        assert torch.equal(outputs[p].view(torch.int32), expected.view(torch.int32)), p
        reordered = torch.empty(n, device=device)
        sum_rows_into(reordered, [inputs[q].view(size, n)[p] for q in reversed(range(size))])
        assert not torch.equal(reordered.view(torch.int32), expected.view(torch.int32))  # the order shows
