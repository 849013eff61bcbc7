"""The torch function modes of lightning_sdp4bit.weight_access, in one process without a Trainer:
- ReadGuard waits for a parameter's bucket at the first torch operation that touches the
  parameter (directly, as a keyword, inside a list), never for other tensors, and pops itself off
  torch's mode stack once every bucket has landed (inert until the next close where the last one
  landed inside its own handler);
- under a mode the user pushed later, closing leaves it inert on the stack, and opening reuses it;
- DataWriteTracker makes writes through `p.data` move `p._version` (outside it they do not), and
  leaves other tensors' `.data` alone;
- WeightAccess.absorb takes into this rank's master shard a written parameter's whole range
  (even a write of the same value) and, of unwritten parameters, only the elements that changed
  (a NaN too; -0.0 over +0.0 is no change); taking the same writes in again changes nothing;
- the engine's own torch calls (each bucket's encode, decode, gathers and releases, in hooks and
  in the step protocol) reach no torch function mode: with the weights sharded inside the node,
  a mode pushed by the user sees the forward's own operations and nothing else of a step.
"""

import math
from types import SimpleNamespace

import torch
from emulated import emulated_engine
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_sdp4bit.buffers import BucketLayout, ParamSlot
from lightning_sdp4bit.weight_access import DataWriteTracker, ReadGuard, WeightAccess


class _UsersMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def test_the_guard_waits_at_the_first_read_and_pops_itself_when_everything_landed():
    a, b, other = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3)), torch.ones(3)
    waited = []
    guard = ReadGuard(lambda index: (waited.append(index), guard.landed([a] if index == 0 else [b])))
    guard.expect(0, [a])
    guard.expect(1, [b])
    guard.open()
    try:
        assert _stack() == [guard]
        other * 2
        assert waited == []
        torch.cat([other, a])  # inside a list
        assert waited == [0] and _stack() == [guard]
        a * 2  # landed: no second wait
        torch.add(other, other=b)  # as a keyword
        assert waited == [0, 1]
        # The last bucket landed inside the guard's own handler: it stays on the stack, inert.
        assert _stack() == [guard] and not guard.active
        guard.open()
        guard.expect(2, [a])
        guard.landed([a])  # a forward pre-hook's wait, outside the handler
        assert _stack() == []  # popped once nothing was pending
    finally:
        guard.close()


def test_under_a_later_mode_the_guard_stays_inert_and_is_reused():
    a = nn.Parameter(torch.ones(3))
    waited = []
    guard = ReadGuard(waited.append)
    guard.expect(0, [a])
    guard.open()
    with _UsersMode() as users:
        guard.close()  # not on top: stays, inert
        assert _stack() == [guard, users]
        a * 2
        assert waited == []
        guard.open()  # reused, not pushed twice
        assert _stack() == [guard, users]
        a * 2
        assert waited == [0]
    guard.close()
    assert _stack() == []


def test_data_writes_move_the_version_counter_inside_the_tracker_only():
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    version = p._version
    p.data.mul_(1.0)
    assert p._version == version  # what torch does: .data has a counter of its own
    with DataWriteTracker(frozenset({id(p)})):
        p.data.mul_(1.0)
        q_version = q._version
        q.data.mul_(1.0)
        assert q._version == q_version  # not tracked
        assert not p.data.requires_grad
    assert p._version == version + 1


def test_absorb_takes_written_parameters_whole_and_changed_elements_of_the_others():
    # One bucket of 2 ranks x 4 elements, seen as rank 1 (elements 4..7): a spans 0..5, b 6..7.
    layout = BucketLayout(0, torch.bfloat16, 2, 4, (ParamSlot("a", (6,), 0), ParamSlot("b", (2,), 6)))
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 8.0], dtype=torch.bfloat16)
    a, b = nn.Parameter(torch.empty(6, dtype=torch.bfloat16)), nn.Parameter(torch.empty(2, dtype=torch.bfloat16))
    a.data, b.data = weights[:6], weights[6:]  # as the buckets do: views, each with its own counter
    shard = weights[4:]
    master = shard.float() + 0.25  # masters apart from the weights, as under qWD
    bucket = SimpleNamespace(
        params=[a, b], layout=layout, weight_shard=shard, applied_shard=shard.clone(), master=master
    )
    access = WeightAccess([bucket], rank=1, wait=lambda indices: None)
    with torch.no_grad():
        a.mul_(1.0)  # a write that leaves the values as they were: a's counter moves
    b.data[0] = -0.0  # no counter moves, and -0.0 == +0.0: no change
    expected = torch.tensor([5.0, 6.0, 0.25, 8.25])
    access.absorb()
    assert torch.equal(master, expected) and not master[2].signbit()
    b.data[1] = float("nan")  # a change no counter sees
    expected[3] = float("nan")
    for _ in range(2):  # the second time: the same writes, nothing changes
        access.absorb()
        assert torch.equal(master.view(torch.int32), expected.view(torch.int32))


class _Recorder(TorchFunctionMode):
    """Records the name of every torch call that reaches it (a user's mode, pushed above the engine's)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_the_engines_own_torch_calls_reach_no_torch_function_mode(benchmark_script):
    def forward(model, x):
        return model(x).square().mean()

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), torch.randn(4, 64)
    with _Recorder() as plain:
        forward(model, x)
    with emulated_engine(benchmark_script, model, bucket_numel=64 * 64 + 64, weight_sharding="node") as engine:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.shard_optimizer(optimizer)
        for _ in range(2):  # the second forward gathers what the first step's exchange wrote
            engine.zero_grad()
            engine.pre_forward()
            with _Recorder() as in_forward:
                loss = forward(model, x)
            engine.post_forward()
            engine.pre_backward()
            with _Recorder() as in_step:
                loss.backward()  # the gradient hooks encode each bucket, the regather hooks gather
                engine.post_backward()
                engine.clip_grad_norm(1.0)
                engine.pre_optimizer_step()
            optimizer.step()
            with in_step:
                stats = engine.post_optimizer_step()  # the weight exchange: encode, send, decode
            assert in_forward.seen == plain.seen  # gathers in the pre-hooks, releases in the hooks: unseen
            assert in_step.seen == ["backward"]
        assert math.isfinite(loss.item()) and stats["weight_gather_bytes"] > 0
