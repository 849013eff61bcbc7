"""Who leaves the applied shard (`Bucket.applied_shard`, the edit check's reference), in a
`ShardedEngine` on 4 gloo processes, bf16 weights, flat (1 node x 4, 4 nodes x 1) and in two
levels (2 nodes x 2), under qWD and qW (with one bucket under `min_compress_numel`, which travels
uncompressed) and uncompressed (baseline):
- after each of two steps every bucket's applied shard equals its weight shard bit for bit,
  although `WeightAccess.landed` writes no applied shard (their version counters stay put across
  it): the exchanges wrote them, the quantized and the uncompressed ones alike;
- taking in edits right after (none were made) leaves every master as it was: masters differ
  from the bf16 weights (qWD's masters by the difference still to send, the uncompressed ones by
  their rounding), so an applied shard that was not refreshed would be taken for an edit;
- after weights are written from outside and `weights_loaded` is called (a checkpoint's load),
  the same: the applied shards are the loaded weights, and the masters stay.
"""

import pytest
import torch
from checkpoint_helpers import train_step
from distributed import run_workers
from models import make_model

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology, create_process_groups
from lightning_sdp4bit.weight_access import WeightAccess
from lightning_sdp4bit.weight_collectives import PlainWeightAllGather

PRESETS = ["qwd", "qw", "baseline"]


def _masters(engine):
    return [bucket.master.clone() for bucket in engine.buckets]


def _applied_equal_weights(engine):
    return all(torch.equal(b.applied_shard.view(torch.int16), b.weight_shard.view(torch.int16)) for b in engine.buckets)


def _run(rank, world, ranks_per_node):
    """Per preset: the kinds of weight exchange, then per check (two steps, a load) whether the
    applied shards equal the weight shards and an edit check left the masters; and the applied
    shards `landed` wrote (version counters moved inside it)."""
    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    written_in_landed = []
    landed = WeightAccess.landed

    def watched(access, index):
        applied = access.buckets[index].applied_shard
        version = applied._version
        landed(access, index)
        if applied._version != version:
            written_in_landed.append(index)

    results = {}
    WeightAccess.landed = watched
    try:
        for preset in PRESETS:
            model = make_model(0, layers=1, width=32).bfloat16()
            config = SDP4BitConfig.preset(preset, bucket_numel=3000, min_compress_numel=3000, weight_group_size=128)
            engine = ShardedEngine(model, config, topology, groups)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            engine.shard_optimizer(optimizer)
            kinds = [
                "plain" if isinstance(c, PlainWeightAllGather) else "quantized"
                for c in engine.primary.weight_collectives
            ]
            checks = []
            for step in range(2):
                train_step(engine, optimizer, 10 * rank + step)
                before = _masters(engine)
                equal = _applied_equal_weights(engine)
                engine.before_save()
                checks.append((equal, all(map(torch.equal, before, _masters(engine)))))
            with torch.no_grad():
                for bucket in engine.buckets:
                    bucket.weights.mul_(0.5)  # a load: every rank's weights written alike, from outside
            engine.weights_loaded()
            before = _masters(engine)
            equal = _applied_equal_weights(engine)
            engine.before_save()
            checks.append((equal, all(map(torch.equal, before, _masters(engine)))))
            engine.close()
            results[preset] = (kinds, checks)
    finally:
        WeightAccess.landed = landed
    return results, written_in_landed


@pytest.mark.parametrize(
    "world, ranks_per_node",
    [
        pytest.param(4, 2, id="2 nodes x 2"),
        pytest.param(4, 4, id="1 node x 4"),
        pytest.param(4, 1, id="4 nodes x 1"),
    ],
)
def test_exchanges_and_loads_leave_the_applied_shards_and_landing_copies_none(world, ranks_per_node):
    for results, written_in_landed in run_workers(_run, world, ranks_per_node):
        assert written_in_landed == []
        for preset, (kinds, checks) in results.items():
            expected_kinds = {"plain"} if preset == "baseline" else {"plain", "quantized"}
            assert set(kinds) == expected_kinds, (preset, kinds)
            assert checks == [(True, True)] * 3, preset
