"""Ranks that build different models or configs are refused at setup, naming what differs, on 2
ranks building a ShardedEngine each:
- a config field (weight_bits 4 and 8), a parameter's shape (width 32 and 48), its dtype (fp32
  and bf16), a parameter trained on rank 0 and frozen on rank 1, and one block more on rank 1:
  the ValueError, the same on both ranks, names the ranks and the first field or parameter that
  differs with both ranks' values (before, it said only that something differed);
- ranks that agree pay one all-gather of a digest: no object all-gather runs.
"""

import pytest
import torch
from distributed import run_workers
from models import make_model


def _frozen_position(model):
    model.position.requires_grad_(False)
    return model


# case -> (what the error names, (rank, rank 0's model) -> (that rank's config overrides, its model))
MISMATCHES = {
    "config field": (
        "config field weight_bits: 4 on rank 0, 8 on rank 1",
        lambda rank, model: ({"weight_bits": 8} if rank else {}, model),
    ),
    "shape": (
        "parameter norm.bias: shape (32,), torch.float32 on rank 0, shape (48,), torch.float32 on rank 1",
        lambda rank, model: ({}, make_model(0, layers=1, width=48) if rank else model),
    ),
    "dtype": (
        "parameter norm.bias: shape (32,), torch.float32 on rank 0, shape (32,), torch.bfloat16 on rank 1",
        lambda rank, model: ({}, model.to(torch.bfloat16) if rank else model),
    ),
    "frozen": (
        "parameter position: shape (16, 32), torch.float32 on rank 0, not trained (frozen or missing) on rank 1",
        lambda rank, model: ({}, _frozen_position(model) if rank else model),
    ),
    "one block more": (
        "parameter blocks.1.mlp.2.bias: not trained (frozen or missing) on rank 0, shape (32,), torch.float32 "
        "on rank 1",
        lambda rank, model: ({}, make_model(0, layers=1 + rank)),
    ),
}


def _build(rank, world, case):
    import torch.distributed as dist

    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    object_gathers = []
    original = dist.all_gather_object
    dist.all_gather_object = lambda *args, **kwargs: object_gathers.append(1) or original(*args, **kwargs)
    config, model = MISMATCHES[case][1](rank, make_model(0, layers=1)) if case else ({}, make_model(0, layers=1))
    topology = Topology(rank, world, world)
    try:
        ShardedEngine(model, SDP4BitConfig(bucket_numel=3000, **config), topology, create_process_groups(topology))
        message = None
    except ValueError as error:
        message = str(error)
    return message, len(object_gathers)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_what_differs_across_ranks_is_named(case):
    results = run_workers(_build, 2, case)
    for message, gathers in results:
        assert message is not None and message == results[0][0]
        assert message.startswith("ranks [1] built a different model or SDP4BitConfig than rank 0: ")
        assert MISMATCHES[case][0] in message, message
        assert gathers == 1


def test_ranks_that_agree_gather_one_digest_and_no_descriptions():
    assert run_workers(_build, 2, None) == [(None, 0), (None, 0)]
