"""A collective that outlasts the process groups' timeout ends in the engine's own error
(`comm.CollectiveTimeoutError`), whatever words the backend used; no processes, fake Work handles
whose wait raises what torch 2.13's gloo and NCCL raise:
- each timeout wording, met in a bucket's gradient exchange (its wait, or polling that moves it to
  its next stage) or weight all-gather, becomes one error that names the bucket, the exchange,
  the rank and the timeout in seconds, with the backend's error chained as its cause. gloo's
  wording depends on where the timeout struck: the operation whose own wait ran out says "Timed
  out waiting", every other one in flight on the group "Application timeout caused pair closure"
  (the stall test once failed on the second, expecting the first);
- the buffer broadcast, the engine's step-verdict all-reduce, the strategies' all-reduce
  (sync_dist logging), a checkpoint's agreement all-gather and the address gather at setup are
  named the same way;
- any other error (a peer's crash, an NCCL error) passes through unchanged: the same exception,
  nothing chained; and a wait inside two named contexts is named by the inner one.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_sdp4bit import comm
from lightning_sdp4bit.collectives import SingleStage, TwoStage
from lightning_sdp4bit.comm import CollectiveTimeoutError, Timeouts
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.schedule import BucketSchedule
from lightning_sdp4bit.topology import ProcessGroups, Topology

TIMEOUTS = Timeouts(rank=3, timeout=timedelta(seconds=10))
NAMED = "rank 3 timed out in bucket 1's {} (timeout=10 s)"
GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
TIMEOUT_ERRORS = [
    # gloo (RuntimeError): the operation whose own wait ran out (seen in the stall test's jobs) ...
    RuntimeError(GLOO + "unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"),
    RuntimeError(GLOO + "unbound_buffer.cc:129] Timed out waiting 10000ms for send operation to complete"),
    # ... every other one in flight on that group (the stall test's failing run) ...
    RuntimeError("Application timeout caused pair closure"),
    # ... a synchronous pair's socket, a connection.
    RuntimeError(GLOO + "pair.cc:598] Read timeout [127.0.0.1]:40533"),
    RuntimeError(GLOO + "pair.cc:575] Write timeout [127.0.0.1]:40533"),
    RuntimeError(GLOO + "pair.cc:450] Connect timeout [127.0.0.1]:40533"),
    RuntimeError("timed out connecting: Connection refused"),
    # NCCL (DistBackendError), from a wait under TORCH_NCCL_BLOCKING_WAIT=1.
    dist.DistBackendError(
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLTOALL_BASE, "
        "NumelIn=4096, NumelOut=4096, Timeout(ms)=10000) ran for 10012 milliseconds before timing out."
    ),
    dist.DistBackendError(
        "[PG ID 1 PG GUID 1 Rank 0] Work WorkNCCL(SeqNum=7, OpType=ALLREDUCE) timed out in blocking wait."
    ),
]
OTHER_ERRORS = [
    RuntimeError(
        GLOO + "pair.cc:534] Connection closed by peer [127.0.0.1]:40533. This is typically caused by a remote "
        "worker crashing. Check the logs of the remote worker before reporting an error."
    ),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, NCCL version 2.21.5"),
]


class FailingWork:
    """A gloo Work that completed with `error`: is_completed is True, wait raises it."""

    def __init__(self, error):
        self.error = error

    def is_completed(self):
        return True

    def wait(self):
        raise self.error


class DoneWork:
    def is_completed(self):
        return True

    def wait(self):
        return True


class TwoStages(TwoStage):
    """A two-stage exchange whose first stage failed: polling finds it complete and moves it on."""

    def __init__(self, work):
        self._work = work
        self._begin(None)

    def _second_stage(self):
        self._work = DoneWork()

    def _complete(self):
        self._work.wait()


def _schedule(grads=None, weights=None):
    """Two buckets; bucket 1's gradient exchange (or weight all-gather) is `grads` (`weights`)."""

    def pending(index, given):
        return given if index == 1 and given is not None else SingleStage(DoneWork())

    return BucketSchedule(
        2, lambda i: pending(i, grads), lambda i: pending(i, weights), lambda i: None, timeouts=TIMEOUTS
    )


def _check_named(caught, exchange, error):
    assert NAMED.format(exchange) in str(caught.value)
    assert caught.value.__cause__ is error and caught.value.exchange == f"bucket 1's {exchange}"


@pytest.mark.parametrize("error", TIMEOUT_ERRORS, ids=lambda e: str(e).split("] ")[-1][:40])
def test_each_timeout_wording_becomes_one_error_naming_the_exchange(error):
    assert comm.is_timeout(error)
    schedule = _schedule(grads=SingleStage(FailingWork(error)))  # waited for in finish_grads
    with pytest.raises(CollectiveTimeoutError) as caught:
        schedule.finish_grads()
    _check_named(caught, "gradient reduce-scatter", error)

    schedule = _schedule(grads=TwoStages(FailingWork(error)))  # moved on by polling
    schedule.launch_ready(lambda i: i == 0)
    with pytest.raises(CollectiveTimeoutError) as caught:
        schedule.launch_ready(lambda i: True)  # launches bucket 1, then polls it
    _check_named(caught, "gradient reduce-scatter", error)

    schedule = _schedule(weights=SingleStage(FailingWork(error)))
    schedule.start_weights()
    with pytest.raises(CollectiveTimeoutError) as caught:
        schedule.wait_weights([1])
    _check_named(caught, "weight all-gather", error)


@pytest.mark.parametrize("error", OTHER_ERRORS, ids=["gloo peer crashed", "nccl error"])
def test_other_errors_pass_through_unchanged(error):
    assert not comm.is_timeout(error)
    for grads in (SingleStage(FailingWork(error)), TwoStages(FailingWork(error))):
        schedule = _schedule(grads=grads)
        with pytest.raises(RuntimeError) as caught:
            schedule.finish_grads()
        assert caught.value is error and caught.value.__cause__ is None


def test_the_inner_context_names_a_nested_wait():
    error = RuntimeError("Application timeout caused pair closure")
    with pytest.raises(CollectiveTimeoutError) as caught:
        with TIMEOUTS.named("outer exchange"), TIMEOUTS.named("inner exchange", 5):
            FailingWork(error).wait()
    assert "bucket 5's inner exchange" in str(caught.value) and caught.value.__cause__ is error
    with pytest.raises(CollectiveTimeoutError, match="torch's default timeout"):
        with Timeouts(rank=0).named("an exchange"):
            FailingWork(error).wait()


def test_the_buffer_broadcast_is_named(monkeypatch):
    from lightning_sdp4bit.buffer_sync import BufferBroadcast

    error = RuntimeError("Application timeout caused pair closure")
    monkeypatch.setattr(comm, "broadcast", lambda *args, **kwargs: FailingWork(error))
    sync = BufferBroadcast(nn.BatchNorm1d(4), group=None, rank=3, timeouts=TIMEOUTS)
    with pytest.raises(CollectiveTimeoutError) as caught:
        sync.before_forward()
    assert "rank 3 timed out in the module buffers' broadcast (timeout=10 s)" in str(caught.value)


def _one_rank_comm(monkeypatch):
    """comm's collectives for a job of one rank: every one is complete at once (no process group)."""

    def done(async_op):
        return SingleStage(DoneWork()) if async_op else None

    def all_gather(output, input, group=None, async_op=False):
        output.view(-1).copy_(input.reshape(-1))
        return done(async_op)

    def reduce_scatter(output, input, group=None, async_op=False):
        output.copy_(input)
        return done(async_op)

    monkeypatch.setattr(comm, "all_gather", all_gather)
    monkeypatch.setattr(comm, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(comm, "broadcast", lambda *args, async_op=False, **kwargs: done(async_op))


def test_the_engine_names_its_step_verdict_all_reduce(monkeypatch):
    _one_rank_comm(monkeypatch)
    error = RuntimeError(GLOO + "unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")

    def all_reduce(tensor, group=None, async_op=False):
        raise error  # gloo raises it from the call once the group has timed out

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    groups = ProcessGroups(world=None, intra=None, inter=None, timeout=timedelta(seconds=10))
    model = nn.Linear(8, 4)
    engine = ShardedEngine(model, SDP4BitConfig.preset("baseline"), Topology(0, 1, 1), groups)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(CollectiveTimeoutError) as caught:
        engine.post_backward()
    assert "rank 0 timed out in the step verdict's all-reduces" in str(caught.value)
    assert "(timeout=10 s)" in str(caught.value) and caught.value.__cause__ is error


def test_the_strategies_name_their_all_reduce(monkeypatch):
    from lightning_sdp4bit.strategies import common

    error = RuntimeError("Application timeout caused pair closure")

    def sync(*args, **kwargs):
        raise error

    monkeypatch.setattr(common, "_sync_ddp_if_available", sync)
    with pytest.raises(CollectiveTimeoutError) as caught:
        common.reduce(torch.ones(1), None, "mean", TIMEOUTS)
    assert "rank 3 timed out in the strategy's all-reduce for sync_dist logging or all_reduce" in str(caught.value)
    assert common.reduce("not a tensor", None, "mean", TIMEOUTS) == "not a tensor"


def test_the_checkpoints_agreement_is_named(monkeypatch):
    """A peer that never reaches a save's or a load's agreement (stalled on its disk, or dead):
    with the engine's or the strategy's timeouts the all-gather's timeout is named; without,
    the backend's error passes through as before."""
    from lightning_sdp4bit.checkpoint.files import agree

    error = RuntimeError("Application timeout caused pair closure")

    def all_gather_object(outputs, obj, group=None):
        raise error

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    with pytest.raises(CollectiveTimeoutError) as caught:
        agree(None, "payload", timeouts=TIMEOUTS)
    assert "rank 3 timed out in the checkpoint's agreement all-gather (timeout=10 s)" in str(caught.value)
    assert caught.value.__cause__ is error
    with pytest.raises(RuntimeError) as caught:
        agree(None, "payload")
    assert caught.value is error


def test_the_address_gather_at_setup_is_named(monkeypatch):
    from lightning_sdp4bit.strategies import peers

    error = RuntimeError(GLOO + "unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")

    def all_gather_object(outputs, obj, group=None):
        raise error

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    with pytest.raises(CollectiveTimeoutError) as caught:
        peers.gather_addresses(TIMEOUTS)
    assert "rank 3 timed out in the all-gather of the ranks' addresses at setup (timeout=10 s)" in str(caught.value)
    assert caught.value.__cause__ is error
