"""The reference quantizer: hand-computed codes and scales, the nearest-rounding error bound,
unbiased stochastic rounding within one step of nearest, packing round trips at odd sizes,
non-finite input, and the public quantize/dequantize API (shapes, dtypes, bytes on the wire)."""

import pytest
import torch

from lightning_sdp4bit import dequantize, quantize
from lightning_sdp4bit.reference import max_level, pack_codes, quantize_groups, unpack_codes


def test_max_levels_are_symmetric():
    assert [max_level(b) for b in (2, 4, 8)] == [1, 7, 127]


def test_hand_computed_4bit_codes_and_scale():
    # absmax 7 -> scale 1 exactly; 2.5 rounds half to even (2), -0.5 to -0.
    x = torch.tensor([[7.0, -3.0, 2.5, 0.4, -0.5, -7.0, 1.6, 0.0]])
    codes, scales = quantize_groups(x, bits=4)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[7, -3, 2, 0, 0, -7, 2, 0]]


def test_hand_computed_2bit_and_8bit_codes():
    codes, scales = quantize_groups(torch.tensor([[2.0, -1.2, 0.9, -2.0]]), bits=2)
    assert scales.tolist() == [2.0] and codes.tolist() == [[1, -1, 0, -1]]
    codes, scales = quantize_groups(torch.tensor([[127.0, -63.5, 0.49, -127.0]]), bits=8)
    assert scales.tolist() == [1.0] and codes.tolist() == [[127, -64, 0, -127]]


def test_all_zero_group_has_zero_scale_and_codes():
    q = quantize(torch.zeros(300), bits=4, group_size=128)
    assert q.scales.tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(dequantize(q), torch.zeros(300))


def test_hand_computed_packing():
    assert pack_codes(torch.tensor([1, -1], dtype=torch.int8), 4).tolist() == [0xF1]
    assert pack_codes(torch.tensor([1, -1, 0, 1], dtype=torch.int8), 2).tolist() == [0b01_00_11_01]
    assert pack_codes(torch.tensor([-128, 127], dtype=torch.int8), 8).tolist() == [0x80, 0x7F]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [1, 127, 4097])
def test_packing_round_trips_at_odd_sizes(bits, numel):
    qmax = max_level(bits)
    codes = torch.randint(-qmax, qmax + 1, (numel,), generator=torch.Generator().manual_seed(numel), dtype=torch.int8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-numel * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, numel), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [1, 32, 128, 2048])
@pytest.mark.parametrize("numel", [1, 1000, 4097])
def test_nearest_round_trip_error_is_at_most_half_a_step(bits, group_size, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(bits * numel)) * 3
    q = quantize(x, bits=bits, group_size=group_size)
    step = q.scales.repeat_interleave(group_size)[:numel]
    error = (dequantize(q) - x).abs()
    # Half a step, plus the fp32 rounding of x / scale and code * scale (a few ulps of |x|).
    assert bool((error <= step / 2 + 4 * torch.finfo(torch.float32).eps * x.abs()).all())


def _stochastic_draws(x, bits, group_size, draws):
    return torch.stack([dequantize(quantize(x, bits, group_size, "stochastic", seed=s)) for s in range(draws)])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    draws = 4000
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    samples = _stochastic_draws(x, bits, 64, draws)
    step = quantize(x, bits, 64).scales.repeat_interleave(64)
    # One draw lies within a step of x, so its standard deviation is at most step/2; the mean of
    # `draws` independent draws is within 5 standard errors of x, for every one of 256 elements.
    bound = 5 * (step / 2) / draws**0.5
    assert bool(((samples.mean(0) - x).abs() <= bound).all())
    # And it is really random: not always the nearest level.
    assert (samples != dequantize(quantize(x, bits, 64))).any()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_codes_are_within_one_step_of_nearest(bits):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    nearest, scales = quantize_groups(x, bits, "nearest")
    for seed in range(20):
        noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed))
        codes, stochastic_scales = quantize_groups(x, bits, "stochastic", noise)
        assert torch.equal(stochastic_scales, scales)
        assert int((codes.int() - nearest.int()).abs().max()) <= 1


def test_stochastic_is_reproducible_from_seed_or_generator():
    x = torch.randn(1000)
    a = quantize(x, 4, 128, "stochastic", seed=3)
    b = quantize(x, 4, 128, "stochastic", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, quantize(x, 4, 128, "stochastic", seed=4).codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_restores_shape_and_dtype(dtype):
    x = torch.randn(3, 5, 7).to(dtype)
    y = dequantize(quantize(x, 8, 32))
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.allclose(y.float(), x.float(), atol=0.05)


def test_nbytes_is_codes_plus_scales_with_the_tail_padded():
    q = quantize(torch.randn(1000), bits=4, group_size=128)
    # 8 groups (the last one 104 long, padded to 128): 1024 codes / 2 + 8 scales * 4 bytes.
    assert q.codes.numel() == 512 and q.scales.numel() == 8 and q.nbytes == 544
    assert q.bits_per_element == pytest.approx(544 * 8 / 1000)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_in_the_public_api(bad):
    x = torch.randn(100)
    x[17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x)


def test_non_finite_input_gives_non_finite_scales_in_the_low_level_op():
    x = torch.ones(2, 4)
    x[0, 1], x[1, 2] = float("nan"), float("inf")
    _, scales = quantize_groups(x, 4)
    assert not bool(torch.isfinite(scales).any())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 3}, "bits must be one of 2, 4, 8"),
        ({"group_size": 100}, "group_size must be a positive power of two"),
        ({"rounding": "up"}, "rounding must be one of"),
        ({"rounding": "stochastic", "seed": 1, "generator": torch.Generator()}, "at most one of generator= and seed="),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize(torch.randn(10), **kwargs)


def test_stochastic_without_seed_draws_from_torchs_default_generator():
    """As torch.rand does: torch.manual_seed makes it reproducible, and the draws are the ones the
    default generator would have given (the same codes as an explicit generator seeded alike)."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(7)
    a = quantize(x, 4, 128, "stochastic")
    b = quantize(x, 4, 128, "stochastic")  # the generator moved on: other draws
    torch.manual_seed(7)
    again = quantize(x, 4, 128, "stochastic")
    assert torch.equal(a.codes, again.codes)
    assert not torch.equal(a.codes, b.codes)
    assert torch.equal(a.codes, quantize(x, 4, 128, "stochastic", generator=torch.Generator().manual_seed(7)).codes)


def test_integer_input_raises():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.arange(10))
