"""A bucket's window gradients (`Bucket.receive_grad` / `take_grads`), without processes:
- one backward's gradients stay in the weights' dtype (bf16: half the bytes of fp32, and the
  exchange reads them as they are), micro-batches are summed in fp32, and a second gradient for
  a position turns a bf16 buffer into fp32 first, so every sum equals the fp32 sum bit for bit;
- the exchange gets zeros where a parameter got no gradient and in the padding, whatever the
  allocator left there, and the bucket holds no gradients once the exchange took them;
- gradients held in the synced backward (`Bucket.hold_grad`) reach the exchange as the ones put
  in one by one would, bit for bit: one concatenation when every parameter's is held, else one
  multi-tensor copy for the bucket; a second gradient for a held position is added in fp32; a
  new window drops what was held.
"""

from unittest import mock

import pytest
import torch
from emulated import emulated_engine
from torch import nn

from lightning_sdp4bit.buffers import HeldGrads, allocate_buckets, plan_buckets
from lightning_sdp4bit.reference.ops import assemble_pieces

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2)}


def _bucket(dtype):
    params = {name: nn.Parameter(torch.zeros(shape, dtype=dtype)) for name, shape in SHAPES.items()}
    (layout,) = plan_buckets([(n, tuple(p.shape), dtype) for n, p in params.items()], 2, 10**6, 32)
    (bucket,) = allocate_buckets([layout], params, rank=0)
    return bucket


def _grad(position, bucket, seed):
    shape = bucket.layout.slots[position].shape
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(bucket.weights.dtype)


def _slot(tensor, bucket, position):
    slot = bucket.layout.slots[position]
    return tensor[slot.start : slot.start + slot.numel].view(slot.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_backward_keeps_the_weights_dtype_and_the_exchange_gets_zeros_elsewhere(dtype):
    bucket = _bucket(dtype)
    grads = {p: _grad(p, bucket, p) for p in (0, 2)}
    for position, grad in grads.items():
        bucket.receive_grad(position, grad, accumulating=False)
        if position == 0:
            _slot(bucket.grads, bucket, 1).fill_(float("nan"))  # what the allocator may leave there
    assert bucket.grads.dtype == dtype
    assert bucket.received == set(grads)
    taken = bucket.take_grads()
    assert bucket.grads is None
    for position, grad in grads.items():
        assert torch.equal(_slot(taken, bucket, position), grad)
    assert not _slot(taken, bucket, 1).any()
    assert not taken[bucket.layout.used_numel :].any() and not taken.isnan().any()


def test_micro_batches_are_summed_in_fp32():
    bucket = _bucket(torch.bfloat16)
    first, second = _grad(0, bucket, 1), _grad(0, bucket, 2)
    bucket.receive_grad(0, first, accumulating=True)
    assert bucket.grads.dtype == torch.float32
    bucket.receive_grad(0, second, accumulating=False)
    assert torch.equal(_slot(bucket.take_grads(), bucket, 0), first.float() + second.float())


def test_a_second_gradient_into_a_bf16_buffer_is_summed_in_fp32():
    bucket = _bucket(torch.bfloat16)
    grads = [_grad(position, bucket, position) for position in range(3)]
    for position, grad in enumerate(grads):
        bucket.receive_grad(position, grad, accumulating=False)
    extra = _grad(1, bucket, 9)
    bucket.receive_grad(1, extra, accumulating=False)
    taken = bucket.take_grads()
    assert taken.dtype == torch.float32
    assert torch.equal(_slot(taken, bucket, 1), grads[1].float() + extra.float())
    assert torch.equal(_slot(taken, bucket, 2), grads[2].float())


def test_a_bucket_that_got_nothing_sends_zeros():
    bucket = _bucket(torch.bfloat16)
    taken = bucket.take_grads()
    assert taken.dtype == torch.bfloat16 and taken.numel() == bucket.layout.numel and not taken.any()


def test_a_new_window_forgets_the_old_gradients():
    bucket = _bucket(torch.bfloat16)
    bucket.receive_grad(0, _grad(0, bucket, 1), accumulating=True)
    bucket.start_window()
    assert bucket.grads is None and bucket.received == set()
    fresh = _grad(0, bucket, 2)
    bucket.receive_grad(0, fresh, accumulating=False)  # a first arrival again: copied, not added
    assert bucket.grads.dtype == torch.bfloat16 and torch.equal(_slot(bucket.take_grads(), bucket, 0), fresh)


@pytest.mark.parametrize("earlier_micro_batch", [False, True])
def test_held_gradients_reach_the_exchange_as_received_ones_with_one_multi_tensor_copy(earlier_micro_batch):
    held, received = _bucket(torch.bfloat16), _bucket(torch.bfloat16)
    if earlier_micro_batch:  # an fp32 window from an earlier micro-batch: the held ones are added
        for bucket in (held, received):
            bucket.receive_grad(1, _grad(1, bucket, 7), accumulating=True)
    grads = {
        p: _grad(p, held, p) for p in (2, 0, 1)
    }  # in backward order; nothing for position 1 without the micro-batch
    if not earlier_micro_batch:
        del grads[1]
    for position, grad in grads.items():
        held.hold_grad(position, grad)
        received.receive_grad(position, grad, accumulating=False)
    assert held.received == ({1} if earlier_micro_batch else set())  # nothing is in until the exchange takes it
    with mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as copies:
        taken = held.take_grads()
    assert copies.call_count == 1 and held.held == {} and held.received == received.received
    expected = received.take_grads()
    assert taken.dtype == expected.dtype and torch.equal(taken, expected)


def test_a_bucket_whose_every_gradient_is_held_takes_them_in_with_one_concatenation():
    held, received = _bucket(torch.bfloat16), _bucket(torch.bfloat16)
    for position in (2, 0, 1):  # backward order
        grad = _grad(position, held, position)
        held.hold_grad(position, grad)
        received.receive_grad(position, grad, accumulating=False)
    empty = torch.empty  # the buffer as the allocator gives it: not zeros
    with (
        mock.patch.object(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))),
        mock.patch.object(torch, "cat", wraps=torch.cat) as cats,
        mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as copies,
    ):
        taken = held.take_grads()
    assert cats.call_count == 1 and copies.call_count == 0
    assert held.held == {} and held.received == {0, 1, 2}
    expected = received.take_grads()
    assert taken.dtype == torch.bfloat16 and torch.equal(taken, expected)  # the padding zeros too


@pytest.mark.parametrize("accumulating", [False, True])
def test_every_first_gradient_at_once_is_one_concatenation_equal_to_receiving_each(accumulating):
    batched, single = _bucket(torch.bfloat16), _bucket(torch.bfloat16)
    arrivals = [(p, _grad(p, batched, p)) for p in (1, 2, 0)]
    for position, grad in arrivals:
        single.receive_grad(position, grad, accumulating)
    with mock.patch.object(torch, "cat", wraps=torch.cat) as cats:
        batched.receive_grads(arrivals, accumulating)
    assert cats.call_count == 1 and batched.received == {0, 1, 2}
    taken, expected = batched.take_grads(), single.take_grads()
    assert taken.dtype == expected.dtype == (torch.float32 if accumulating else torch.bfloat16)
    assert torch.equal(taken, expected)


def test_a_second_gradient_for_a_held_position_is_added_in_fp32():
    bucket = _bucket(torch.bfloat16)
    first, other, second = _grad(0, bucket, 1), _grad(2, bucket, 2), _grad(0, bucket, 3)
    bucket.hold_grad(0, first)
    bucket.hold_grad(2, other)
    bucket.hold_grad(0, second)
    taken = bucket.take_grads()
    assert taken.dtype == torch.float32
    assert torch.equal(_slot(taken, bucket, 0), first.float() + second.float())
    assert torch.equal(_slot(taken, bucket, 2), other.float())


def test_a_new_window_drops_held_gradients():
    bucket = _bucket(torch.bfloat16)
    bucket.hold_grad(0, _grad(0, bucket, 1))
    bucket.start_window()
    assert bucket.held == {} and not bucket.take_grads().any()


def _two_layers() -> nn.Module:
    """A two-layer MLP that the config below puts in two buckets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))


_TWO_BUCKETS = {"bucket_numel": 64 * 64 + 64}


def test_the_engine_holds_a_synced_backwards_gradients_and_copies_each_bucket_in_once(benchmark_script, monkeypatch):
    """Wiring: the engine's hooks hold the synced backward's gradients (no copy per parameter)
    and each bucket takes its own in once, when its exchange starts; a micro-batch outside the
    sync still puts each gradient in as it comes, in fp32."""
    from lightning_sdp4bit.buffers import Bucket

    calls = {"receive_grad": 0, "receive_grads": 0}
    for name in calls:
        method = getattr(Bucket, name)

        def counting(self, *args, _method=method, _name=name, **kwargs):
            calls[_name] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(Bucket, name, counting)
    model = _two_layers()
    with emulated_engine(benchmark_script, model, **_TWO_BUCKETS) as engine:
        buckets, params = len(engine.buckets), sum(len(b.params) for b in engine.buckets)
        assert buckets == 2 and params == 4
        with engine.no_sync():  # a micro-batch outside the sync
            engine.pre_backward()
            model(torch.randn(8, 64)).square().mean().backward()
            engine.post_backward()
        assert calls == {"receive_grad": params, "receive_grads": 0}
        assert all(bucket.grads.dtype == torch.float32 and not bucket.held for bucket in engine.buckets)
        engine.pre_backward()
        model(torch.randn(8, 64)).square().mean().backward()
        engine.post_backward()
        assert calls == {"receive_grad": params, "receive_grads": buckets}
        assert all(bucket.received == set(range(len(bucket.params))) for bucket in engine.buckets)


def test_a_bucket_whose_every_gradient_is_held_hands_them_over_where_they_lie():
    held, received = _bucket(torch.bfloat16), _bucket(torch.bfloat16)
    grads = {p: _grad(p, held, p) for p in (2, 0)}  # backward order; position 1 gets none
    for position, grad in grads.items():
        held.hold_grad(position, grad)
        received.receive_grad(position, grad, accumulating=False)
    with mock.patch.object(torch, "cat", wraps=torch.cat) as cats:
        taken = held.take_grads(in_place=True)
    assert isinstance(taken, HeldGrads) and cats.call_count == 0 and held.grads is None
    assert taken.grads[0] is grads[0] and taken.grads[1] is grads[2]  # no copy, in bucket order
    assert taken.starts == [held.layout.slots[0].start, held.layout.slots[2].start]
    assert taken.numel == held.layout.numel and held.held == {} and held.received == {0, 2}
    assert torch.equal(assemble_pieces(taken.grads, taken.starts, taken.numel), received.take_grads())


def test_gradients_already_in_the_bucket_are_taken_as_one_buffer_even_in_place():
    bucket = _bucket(torch.bfloat16)
    bucket.receive_grad(1, _grad(1, bucket, 7), accumulating=True)  # an earlier micro-batch
    bucket.hold_grad(0, _grad(0, bucket, 0))
    taken = bucket.take_grads(in_place=True)
    assert isinstance(taken, torch.Tensor) and taken.dtype == torch.float32 and bucket.received == {0, 1}


def test_the_compressed_exchange_reads_held_gradients_in_place_with_the_bytes_of_one_buffer(
    benchmark_script, monkeypatch
):
    """Wiring: in the synced backward the two-level exchange gets each bucket's gradients where
    they lie (no concatenation) and reduces them to the same gradient shards, bit for bit, as
    when it reads them from the bucket's buffer."""
    from lightning_sdp4bit.collectives import TwoLevelGradReduceScatter

    def shards(in_place):
        monkeypatch.setattr(TwoLevelGradReduceScatter, "reads_in_place", in_place)
        model = _two_layers()
        with emulated_engine(benchmark_script, model, **_TWO_BUCKETS) as engine:
            engine.pre_backward()
            with mock.patch.object(torch, "cat", wraps=torch.cat) as cats:
                model(torch.randn(8, 64)).square().mean().backward()
                engine.post_backward()
            result = [bucket.grad_shard.clone() for bucket in engine.buckets]
        return result, cats.call_count

    (in_place, in_place_cats), (buffered, buffered_cats) = shards(True), shards(False)
    assert in_place_cats == 0 and buffered_cats == len(buffered) == 2
    assert all(torch.equal(a, b) for a, b in zip(in_place, buffered, strict=True))
    assert any(shard.abs().sum() > 0 for shard in in_place)
