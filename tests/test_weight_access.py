"""The torch function modes of lightning_sdp4bit.weight_access, in one process without a Trainer:
- ReadGuard waits for a parameter's bucket at the first torch operation that touches the
  parameter (directly, as a keyword, inside a list), never for other tensors, and pops itself off
  torch's mode stack once every bucket has landed (inert until the next close where the last one
  landed inside its own handler);
- under a mode the user pushed later, closing leaves it inert on the stack, and opening reuses it;
- DataWriteTracker makes writes through `p.data` move `p._version` (outside it they do not), and
  leaves other tensors' `.data` alone.
"""

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_sdp4bit.weight_access import DataWriteTracker, ReadGuard


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
