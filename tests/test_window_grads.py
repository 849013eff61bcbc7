"""A bucket's window gradients (`Bucket.receive_grad` / `take_grads`), without processes:
- one backward's gradients stay in the weights' dtype (bf16: half the bytes of fp32, and the
  exchange reads them as they are), micro-batches are summed in fp32, and a second gradient for
  a position turns a bf16 buffer into fp32 first, so every sum equals the fp32 sum bit for bit;
- the exchange gets zeros where a parameter got no gradient and in the padding, whatever the
  allocator left there, and the bucket holds no gradients once the exchange took them.
"""

import pytest
import torch
from torch import nn

from lightning_sdp4bit.buffers import allocate_buckets, plan_buckets

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
