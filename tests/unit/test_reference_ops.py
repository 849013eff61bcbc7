"""The reference fused ops and the simulations of the compressed collectives: the payload wire
format (codes then scales, b + 32/g bits per element), destination-order chunk layout, sums over
peers, the two-level reduce-scatter on every topology (its shards approximate the exact
reduce-scatter, and the Hadamard transform helps with outliers), and the weight all-gather (its
apply reads local-major rows as the same rows put in rank order)."""

import pytest
import torch

from lightning_sdp4bit.reference import blockwise_hadamard, quantize_groups
from lightning_sdp4bit.reference.ops import (
    decode_rows,
    encode_rows,
    payload_row_bytes,
    stage_seed,
    torch_grad_decode_sum,
    torch_grad_encode,
    torch_grad_requantize,
    torch_weight_update_apply,
    torch_weight_update_encode,
)
from lightning_sdp4bit.reference.simulate import simulate_two_level_reduce_scatter, simulate_weight_all_gather


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sqnr_db(approx, exact):
    return float(10 * torch.log10(exact.pow(2).sum() / (approx - exact).pow(2).sum()))


@pytest.mark.parametrize("bits, group_size", [(2, 32), (4, 128), (8, 128), (4, 2048)])
def test_payload_rows_are_codes_then_scales(bits, group_size):
    x = _randn(3, 4096)
    payload = encode_rows(x, bits, group_size, "nearest", seed=0)
    assert payload.shape == (3, payload_row_bytes(4096, bits, group_size))
    assert payload.shape[1] * 8 / 4096 == bits + 32 / group_size
    codes, scales = quantize_groups(x.reshape(-1, group_size), bits)
    code_bytes = 4096 * bits // 8
    assert torch.equal(payload[:, code_bytes:].contiguous().view(torch.float32).reshape(-1), scales)
    assert torch.equal(decode_rows(payload, bits, group_size, 4096), (codes.float() * scales[:, None]).view(3, -1))


def test_payload_rows_must_hold_whole_groups_and_words():
    with pytest.raises(ValueError, match="whole groups of 128"):
        payload_row_bytes(100, 4, 128)
    with pytest.raises(ValueError, match="whole 32-bit words"):
        payload_row_bytes(4, 2, 1)


def test_grad_encode_lays_chunks_out_in_destination_order():
    # Bucket viewed as [outer=2 nodes, chunks=3 local peers, S=128]; element value = its shard id.
    grad = torch.arange(6).repeat_interleave(128).float() + 1
    payload = torch_grad_encode(grad, 2, 3, 0, 8, 128, "nearest", 0)
    rows = decode_rows(payload, 8, 128, 256)
    for chunk in range(3):
        expected = torch.cat([torch.full((128,), float(node * 3 + chunk + 1)) for node in range(2)])
        assert torch.equal(rows[chunk], expected)


def test_grad_encode_rotates_before_quantizing():
    grad = _randn(1024)
    plain = decode_rows(torch_grad_encode(grad, 1, 2, 32, 8, 128, "nearest", 0), 8, 128, 512).view(-1)
    assert _sqnr_db(plain, blockwise_hadamard(grad, 32)) > 35


def test_requantize_sums_peers_in_the_hadamard_domain():
    rows = _randn(3, 2 * 256)
    payload = encode_rows(rows, 8, 128, "nearest", 0)
    out = torch_grad_requantize(payload, 8, 4, 128, outer=2, rounding="nearest", seed=0)
    assert out.shape == (2, payload_row_bytes(256, 4, 128))
    assert _sqnr_db(decode_rows(out, 4, 128, 256).view(-1), rows.sum(0)) > 15


def test_decode_sum_inverts_the_hadamard_transform():
    shards = _randn(4, 256)
    payload = encode_rows(blockwise_hadamard(shards, 32), 8, 128, "nearest", 0)
    out = torch.empty(256)
    assert torch_grad_decode_sum(payload, 8, 128, 32, out=out) is out
    assert _sqnr_db(out, shards.sum(0)) > 35


TOPOLOGIES = [(4, 2), (4, 1), (4, 4), (6, 2), (6, 3), (2, 1), (1, 1)]


@pytest.mark.parametrize("world, ranks_per_node", TOPOLOGIES)
@pytest.mark.parametrize("hadamard", [0, 32])
def test_two_level_reduce_scatter_approximates_the_exact_one(world, ranks_per_node, hadamard):
    shard = 512
    grads = [_randn(world * shard, seed=r) / world for r in range(world)]
    exact = torch.stack(grads).sum(0).view(world, shard)
    shards = simulate_two_level_reduce_scatter(
        grads, ranks_per_node, intra_bits=8, inter_bits=8, group_size=128, hadamard_size=hadamard
    )
    assert len(shards) == world
    for rank, got in enumerate(shards):
        assert got.shape == (shard,) and got.dtype == torch.float32
        assert _sqnr_db(got, exact[rank]) > 30


def test_hadamard_smoothing_helps_heavy_tailed_gradients():
    # Gradients are heavy-tailed: a few large values set the absmax of their groups. Student-t
    # with 3 degrees of freedom gives such tails; the rotation should buy several dB at 8/4 bits.
    world, shard = 4, 4096
    torch.manual_seed(0)
    grads = [torch.distributions.StudentT(3.0).sample((world * shard,)) for _ in range(world)]
    exact = torch.stack(grads).sum(0).view(world, shard)
    settings = dict(intra_bits=8, inter_bits=4, group_size=128)
    plain = simulate_two_level_reduce_scatter(grads, 2, hadamard_size=0, **settings)
    smoothed = simulate_two_level_reduce_scatter(grads, 2, hadamard_size=32, **settings)
    plain_db = min(_sqnr_db(p, e) for p, e in zip(plain, exact))
    smoothed_db = min(_sqnr_db(s, e) for s, e in zip(smoothed, exact))
    assert smoothed_db > plain_db + 3


def test_stochastic_two_level_is_reproducible_from_its_seeds():
    grads = [_randn(4 * 256, seed=r) for r in range(4)]
    settings = dict(intra_bits=8, inter_bits=4, group_size=128, hadamard_size=32, rounding="stochastic")
    a = simulate_two_level_reduce_scatter(grads, 2, seed_fn=lambda r, s: stage_seed(1, r, s), **settings)
    b = simulate_two_level_reduce_scatter(grads, 2, seed_fn=lambda r, s: stage_seed(1, r, s), **settings)
    c = simulate_two_level_reduce_scatter(grads, 2, seed_fn=lambda r, s: stage_seed(2, r, s), **settings)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_stage_seeds_are_deterministic_31_bit_and_distinct():
    seeds = {
        stage_seed(0, step, bucket, rank, stage)
        for step in range(10)
        for bucket in range(3)
        for rank in range(4)
        for stage in (1, 2)
    }
    assert len(seeds) == 240 and max(seeds) < 2**31
    assert stage_seed(5, 1) == stage_seed(5, 1) != stage_seed(1, 5)


def test_weight_difference_encode_is_relative_to_the_weights():
    master = _randn(2048)
    weights = master.to(torch.bfloat16)
    payload = torch_weight_update_encode(master, weights, 4, 2048, "nearest", 0)
    # The weights already hold bf16(master): the difference, and so every scale, is zero.
    assert torch.equal(decode_rows(payload, 4, 2048, 2048), torch.zeros(1, 2048))


@pytest.mark.parametrize("additive", [True, False])
def test_weight_all_gather_moves_weights_towards_the_masters(additive):
    world, shard = 4, 4096
    weights = _randn(world * shard).to(torch.bfloat16)
    masters = [weights[r * shard : (r + 1) * shard].float() + 1e-2 * _randn(shard, seed=r + 1) for r in range(world)]
    new = simulate_weight_all_gather(masters, weights, additive=additive, bits=8, group_size=2048)
    target = torch.cat(masters)
    assert new.dtype == torch.bfloat16
    assert (new.float() - target).norm() < (weights.float() - target).norm()


def test_weight_apply_is_in_place_and_identical_for_every_receiver():
    weights = _randn(2 * 2048).to(torch.bfloat16)
    payload = torch.cat(
        [torch_weight_update_encode(_randn(2048, seed=r), None, 4, 2048, "nearest", 0) for r in range(2)]
    )
    a, b = weights.clone(), weights.clone()
    assert torch_weight_update_apply(payload, a, 4, 2048, additive=False) is a
    torch_weight_update_apply(payload, b, 4, 2048, additive=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("ranks, nodes", [(4, 2), (6, 2), (6, 3), (8, 4), (6, 1), (6, 6)])
@pytest.mark.parametrize("additive", [True, False])
def test_weight_apply_of_local_major_rows_is_the_apply_of_those_rows_in_rank_order(ranks, nodes, additive):
    """Rank m * L + l's row lies at l * M + m (M = nodes, L = ranks // nodes): moved to row
    m * L + l, the rank-order apply gives the same weights, bit for bit."""
    shard, local = 256, ranks // nodes
    payload = encode_rows(_randn(ranks, shard, seed=ranks), 4, 128, "nearest", 0)
    weights = _randn(ranks * shard, seed=1).to(torch.bfloat16)
    rank_order = payload[[(rank % local) * nodes + rank // local for rank in range(ranks)]]
    expected = torch_weight_update_apply(rank_order, weights.clone(), 4, 128, additive)
    got = torch_weight_update_apply(payload, weights.clone(), 4, 128, additive, nodes=nodes)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    if 1 < nodes < ranks:  # the order matters: read in rank order, these rows give other weights
        assert not torch.equal(torch_weight_update_apply(payload, weights.clone(), 4, 128, additive), expected)
