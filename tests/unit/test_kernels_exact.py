"""The Triton kernels equal their reference twins bit for bit with nearest rounding.

Checks, for each of the five ops (weight_update_encode / _apply, grad_encode, grad_requantize,
grad_decode_sum), on a grid that covers bits {2, 4, 8}, group sizes 32..2048, Hadamard blocks
{0, 32, 64, 128, 256}, fp32 and bf16 inputs, and odd sizes (group counts like 37 and 77, several
programs with a partial last one):
- payload bytes (codes, then scales) identical to `lightning_sdp4bit.reference.ops`;
- in-place results (weights, gradient shard) identical, every element written;
- weight_update_apply on payload rows in local-major order (as a two-level all-gather lands them)
  for several (ranks, nodes), rank order (nodes 1 or W) among them;
- weight_update_apply with `applied`: for several (ranks, nodes, rank), the first and last rank
  among them, the shard it receives is the twin's and the weights' own shard of that rank (in
  rank order) bit for bit, and the weights are those of the call without it;
- exact ties round half to even, all-zero groups get scale 0 and codes 0;
- grad_encode_pieces, reading a bucket's gradients where they lie (some below the first, a slot
  with none, padding), gives the bytes of grad_encode of the assembled bucket, with either
  rounding.
Runs on CUDA where there is a GPU, else in Triton's interpreter (tests/support/suite.py), so
sizes are small.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from lightning_sdp4bit import kernels  # noqa: E402
from lightning_sdp4bit.reference import ops as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gradient_like(numel, seed, dtype=torch.float32):
    """Values with a heavy tail (a few outliers per group), like gradients."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator).pow(6) * 10
    values[:: max(1, numel // 7)] *= 50  # outliers
    return values.to(dtype).to(DEVICE)


def _payload(rows, numel, bits, group_size, seed):
    """A realistic payload [rows, row_bytes(numel)] made by the reference encoder."""
    return reference.encode_rows(_gradient_like(rows * numel, seed).view(rows, numel), bits, group_size, "nearest", 0)


def _spec(op, *args):
    """The reference op run on the CPU: the executable spec. On CUDA tensors PyTorch divides by a
    Python number (the reference's `absmax / qmax`) by multiplying with its rounded reciprocal,
    which is not always the IEEE quotient; the kernels compute the IEEE quotient."""
    result = op(*(arg.cpu() if isinstance(arg, torch.Tensor) else arg for arg in args))
    return result.to(DEVICE)


def _bits_equal(a, b):
    """Equal bit patterns (torch.equal would take -0.0 for 0.0 and refuse NaN == NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    assert torch.equal(a.view(as_int), b.view(as_int))


# (bits, group_size, shard numel, master dtype, weights dtype or None for qW)
ENCODE_CASES = [
    (4, 2048, 3 * 2048, torch.float32, torch.bfloat16),  # the paper's qWD
    (2, 32, 37 * 32, torch.float32, torch.float32),
    (8, 128, 77 * 128, torch.bfloat16, torch.bfloat16),  # three programs, the last partial
    (4, 64, 129 * 64, torch.bfloat16, torch.float32),
    (8, 512, 3 * 512, torch.float32, None),  # qW
    (2, 2048, 2 * 2048, torch.bfloat16, None),
]


@pytest.mark.parametrize("bits, group_size, numel, master_dtype, weights_dtype", ENCODE_CASES)
def test_weight_update_encode_matches_reference(bits, group_size, numel, master_dtype, weights_dtype):
    master = _gradient_like(numel, 1, master_dtype)
    weights = None
    if weights_dtype is not None:
        weights = (master.float() + _gradient_like(numel, 2) * 0.01).to(weights_dtype)
    expected = _spec(reference.torch_weight_update_encode, master, weights, bits, group_size, "nearest", 0)
    assert torch.equal(kernels.weight_update_encode(master, weights, bits, group_size, "nearest", 0), expected)


# (bits, group_size, ranks W, shard numel S, weights dtype, additive)
APPLY_CASES = [
    (4, 2048, 3, 2 * 2048, torch.bfloat16, True),  # the paper's qWD
    (2, 32, 4, 37 * 32, torch.float32, True),
    (8, 128, 2, 77 * 128, torch.bfloat16, False),
    (4, 64, 5, 3 * 64, torch.float32, False),
    (8, 512, 1, 9 * 512, torch.bfloat16, True),
]


@pytest.mark.parametrize("bits, group_size, ranks, numel, dtype, additive", APPLY_CASES)
def test_weight_update_apply_matches_reference(bits, group_size, ranks, numel, dtype, additive):
    payload = _payload(ranks, numel, bits, group_size, 3)
    weights = _gradient_like(ranks * numel, 4, dtype)
    expected = _spec(reference.torch_weight_update_apply, payload, weights.clone(), bits, group_size, additive)
    out = weights.clone()
    assert kernels.weight_update_apply(payload, out, bits, group_size, additive) is out
    _bits_equal(out, expected)


# (bits, group_size, ranks W, nodes M, shard numel S, weights dtype, additive)
NODES_CASES = [
    (4, 2048, 8, 2, 2048, torch.bfloat16, True),  # the paper's qWD on 2 nodes x 4
    (2, 32, 6, 3, 37 * 32, torch.float32, True),  # 3 nodes x 2
    (8, 128, 6, 2, 77 * 128, torch.bfloat16, False),  # 2 nodes x 3, three programs a shard
    (4, 64, 8, 4, 3 * 64, torch.float32, False),  # 4 nodes x 2
    (8, 512, 6, 1, 512, torch.float32, True),  # one node: rank order
    (2, 64, 6, 6, 2 * 64, torch.bfloat16, False),  # one rank per node: rank order too
]


@pytest.mark.parametrize("bits, group_size, ranks, nodes, numel, dtype, additive", NODES_CASES)
def test_weight_update_apply_reads_local_major_rows_as_the_reference(
    bits, group_size, ranks, nodes, numel, dtype, additive
):
    payload = _payload(ranks, numel, bits, group_size, 8)
    weights = _gradient_like(ranks * numel, 9, dtype)
    args = (bits, group_size, additive, nodes)
    expected = _spec(reference.torch_weight_update_apply, payload, weights.clone(), *args)
    out = weights.clone()
    assert kernels.weight_update_apply(payload, out, *args) is out
    _bits_equal(out, expected)


# (bits, group_size, ranks W, nodes M, rank, shard numel S, weights dtype, additive)
APPLIED_CASES = [
    (4, 2048, 8, 2, 0, 2048, torch.bfloat16, True),  # the paper's qWD on 2 nodes x 4, the first rank
    (4, 2048, 8, 2, 7, 2048, torch.bfloat16, True),  # ... the last rank
    (2, 32, 6, 3, 1, 37 * 32, torch.float32, True),  # 3 nodes x 2: rank 1's row is payload row 3
    (8, 128, 6, 2, 4, 77 * 128, torch.bfloat16, False),  # 2 nodes x 3, three programs a shard
    (4, 64, 5, 1, 4, 3 * 64, torch.float32, False),  # rank order, the last rank
    (8, 512, 1, 1, 0, 9 * 512, torch.bfloat16, True),  # one rank: the whole payload is its shard
    (2, 64, 6, 6, 2, 2 * 64, torch.bfloat16, False),  # one rank per node: rank order too
    (8, 32, 4, 2, 3, 5 * 32, torch.float32, True),  # shards straddle programs of R thread rows
]


@pytest.mark.parametrize("bits, group_size, ranks, nodes, rank, numel, dtype, additive", APPLIED_CASES)
def test_weight_update_apply_stores_the_own_shard_into_applied_as_the_reference(
    bits, group_size, ranks, nodes, rank, numel, dtype, additive
):
    payload = _payload(ranks, numel, bits, group_size, 10)
    weights = _gradient_like(ranks * numel, 11, dtype)
    args = (bits, group_size, additive, nodes)
    poison = torch.full((numel,), float("nan"), dtype=dtype)  # every element must be written
    expected_applied = poison.clone()
    expected = _spec(reference.torch_weight_update_apply, payload, weights.clone(), *args, expected_applied, rank)
    without = kernels.weight_update_apply(payload, weights.clone(), *args)
    out, applied = weights.clone(), poison.to(DEVICE)
    assert kernels.weight_update_apply(payload, out, *args, applied, rank) is out
    _bits_equal(out, expected)
    _bits_equal(out, without)
    _bits_equal(applied.cpu(), expected_applied)
    _bits_equal(applied, out[rank * numel : (rank + 1) * numel])


# (bits, group_size, hadamard_size, outer, chunks, shard numel S, grad dtype)
GRAD_ENCODE_CASES = [
    (8, 128, 32, 2, 4, 256, torch.float32),  # the paper's intra-node stage
    (4, 128, 32, 1, 3, 384, torch.bfloat16),
    (2, 32, 32, 3, 2, 96, torch.float32),
    (8, 2048, 256, 1, 2, 2048, torch.bfloat16),
    (4, 512, 64, 2, 1, 1536, torch.float32),
    (2, 2048, 0, 2, 2, 4096, torch.bfloat16),
    (8, 64, 0, 1, 5, 31 * 64, torch.float32),
    (4, 256, 128, 2, 3, 768, torch.float32),
    (8, 32, 32, 1, 1, 129 * 32, torch.float32),  # three programs, the last partial
]


@pytest.mark.parametrize("bits, group_size, hadamard_size, outer, chunks, shard, dtype", GRAD_ENCODE_CASES)
def test_grad_encode_matches_reference(bits, group_size, hadamard_size, outer, chunks, shard, dtype):
    grad = _gradient_like(outer * chunks * shard, 5, dtype)
    args = (outer, chunks, hadamard_size, bits, group_size, "nearest", 0)
    assert torch.equal(kernels.grad_encode(grad, *args), _spec(reference.torch_grad_encode, grad, *args))


@pytest.mark.parametrize("scale", [1 / 8, 1 / 3, 1 / 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_encode_folds_the_average_in_as_the_reference_does(scale, dtype):
    """The 1/world of the average, taken inside the kernel, gives the reference's bytes (which are
    those of the gradient multiplied in fp32 first, as the engine once did in a separate pass)."""
    grad = _gradient_like(2 * 3 * 384, 6, dtype)
    args = (2, 3, 32, 8, 128, "nearest", 0)
    expected = _spec(reference.torch_grad_encode, grad, *args, scale)
    assert torch.equal(kernels.grad_encode(grad, *args, scale), expected)
    assert torch.equal(expected, _spec(reference.torch_grad_encode, grad.float() * scale, *args))


# (outer, chunks, shard S, piece sizes in bucket order (None: a slot that got no gradient), dtype)
PIECES_CASES = [
    (2, 4, 384, [1024, None, 16, 48, 1008], torch.bfloat16),  # a missing slot and padding
    (1, 2, 2048, [2048, 1536, 32], torch.float32),  # pieces straddle the shards
    (2, 2, 128 * 33, [16] * 9 + [16720], torch.bfloat16),  # 10 pieces (4 search steps), 3 programs a shard
]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("outer, chunks, shard, sizes, dtype", PIECES_CASES)
def test_grad_encode_of_pieces_gives_the_bytes_of_the_assembled_bucket(rounding, outer, chunks, shard, sizes, dtype):
    """Read where they lie (allocated last to first, so some lie below the first piece, and
    with a slot between them that got no gradient), the pieces encode to the bytes of the bucket
    they make up, stochastic noise included: the noise is keyed by the payload's elements."""
    starts, pieces, at = [], [], 0
    for size in sizes:
        if size is not None:
            starts.append(at)
            pieces.append(size)
        at += size or 64
    made = {index: _gradient_like(size, 20 + index, dtype) for index, size in reversed(list(enumerate(pieces)))}
    pieces = [made[index] for index in range(len(pieces))]
    numel = outer * chunks * shard
    args = (outer, chunks, 32, 4, 128, rounding, 9, 1 / 6)
    bucket = reference.assemble_pieces(pieces, starts, numel)
    assert bucket[at:].eq(0).all() and bucket.ne(0).any()
    assert torch.equal(kernels.grad_encode_pieces(pieces, starts, numel, *args), kernels.grad_encode(bucket, *args))
    if rounding == "nearest":
        expected = _spec(reference.torch_grad_encode_pieces, pieces, starts, numel, *args)
        assert torch.equal(kernels.grad_encode_pieces(pieces, starts, numel, *args), expected)


# (in_bits, out_bits, group_size, peers P, outer, shard numel S)
REQUANTIZE_CASES = [
    (8, 4, 128, 4, 2, 256),  # the paper's stage 2
    (8, 2, 32, 3, 3, 96),
    (4, 8, 2048, 2, 1, 4096),
    (2, 4, 64, 5, 2, 7 * 64),
    (8, 8, 512, 1, 4, 512),
    (4, 4, 128, 3, 1, 77 * 128),
    (8, 4, 128, 8, 2, 256),  # one straight-line step of UNROLLED_PEERS
    (4, 4, 64, 19, 1, 64),  # two loop steps and a tail of 3
]


@pytest.mark.parametrize("in_bits, out_bits, group_size, peers, outer, shard", REQUANTIZE_CASES)
def test_grad_requantize_matches_reference(in_bits, out_bits, group_size, peers, outer, shard):
    payload = _payload(peers, outer * shard, in_bits, group_size, 6)
    args = (in_bits, out_bits, group_size, outer, "nearest", 0)
    expected = _spec(reference.torch_grad_requantize, payload, *args)
    assert torch.equal(kernels.grad_requantize(payload, *args), expected)


# (bits, group_size, hadamard_size, peers P, shard numel S)
DECODE_CASES = [
    (4, 128, 32, 4, 3 * 256),  # the paper's stage 3
    (8, 32, 32, 3, 37 * 32),
    (2, 2048, 256, 2, 4096),
    (4, 64, 0, 5, 7 * 64),
    (8, 512, 64, 1, 3 * 512),
    (4, 256, 128, 2, 9 * 256),
    (2, 128, 32, 3, 77 * 128),
    (4, 128, 32, 16, 256),  # two loop steps of UNROLLED_PEERS, no tail
    (4, 64, 0, 9, 64),  # one loop step and a tail of 1
]


@pytest.mark.parametrize("bits, group_size, hadamard_size, peers, shard", DECODE_CASES)
def test_grad_decode_sum_matches_reference(bits, group_size, hadamard_size, peers, shard):
    payload = _payload(peers, shard, bits, group_size, 7)
    out = torch.full((shard,), float("nan"), device=DEVICE)  # poisoned: every element must be written
    assert kernels.grad_decode_sum(payload, bits, group_size, hadamard_size, out) is out
    expected = _spec(reference.torch_grad_decode_sum, payload, bits, group_size, hadamard_size)
    _bits_equal(out, expected)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ties_round_half_to_even_and_zero_groups_stay_zero(bits):
    qmax = 2 ** (bits - 1) - 1
    # Group 0 has absmax qmax, so its scale is exactly 1 and k + 0.5 are exact ties; group 1 is zero.
    group = torch.cat([torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5, torch.tensor([float(qmax)])])
    master = torch.zeros(2 * 256)
    master[: group.numel()] = group
    master = master.to(DEVICE)
    payload = kernels.weight_update_encode(master, None, bits, 256, "nearest", 0)
    assert torch.equal(payload, _spec(reference.torch_weight_update_encode, master, None, bits, 256, "nearest", 0))
    codes_bytes = 512 * bits // 8
    assert payload[0, codes_bytes:].view(torch.float32).tolist() == [1.0, 0.0]
    codes = reference.unpack_codes(payload[0, :codes_bytes], bits, group.numel()).float()
    assert torch.equal(codes.cpu(), torch.round(group))  # torch.round: half to even


@pytest.mark.parametrize("bits", [4, 8])
def test_division_is_ieee_near_ties_and_at_extreme_scales(bits):
    """Codes are round(RN(x / scale)): values within a few ulps of k + 1/2 steps, at scales from
    2^-100 to 2^100 (outside 2^-60..2^60 the kernels take their slow, div_rn path)."""
    qmax = 2 ** (bits - 1) - 1
    generator = torch.Generator().manual_seed(bits)
    groups, group_size = 64, 128
    steps = torch.rand(groups, generator=generator) + 1
    steps *= 2.0 ** torch.randint(-20, 21, (groups,), generator=generator).float()
    steps[:2] *= torch.tensor([2.0**-80, 2.0**80])  # two extreme scales
    levels = torch.randint(-qmax, qmax, (groups, group_size), generator=generator).float() + 0.5
    x = levels * steps[:, None]
    nudge = torch.randint(-3, 4, x.shape, generator=generator, dtype=torch.int32)
    x = (x.view(torch.int32) + nudge).view(torch.float32)  # a few ulps off the exact ties
    x[:, 0] = qmax * steps  # each group's absmax: its scale is steps (up to rounding)
    master = x.view(-1).to(DEVICE)
    payload = kernels.weight_update_encode(master, None, bits, group_size, "nearest", 0)
    assert torch.equal(
        payload, _spec(reference.torch_weight_update_encode, master, None, bits, group_size, "nearest", 0)
    )
