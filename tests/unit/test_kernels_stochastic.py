"""Stochastic rounding in the Triton kernels (weight_update_encode, grad_encode, grad_requantize).

Checks:
- reproducible: the same seed gives the same bytes, another seed other bytes;
- scales are the nearest-rounding scales bit for bit, and every code is within one step of the
  nearest-rounding code;
- unbiased: averaged over seeds and over copies of the same values (each copy draws its own noise),
  the dequantized result equals the input (the rotated input for grad_encode with a Hadamard
  transform), per element within 6 standard errors and on average within a few hundredths of a step,
  including values at 0.3 of a step, which nearest rounding always rounds down.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from lightning_sdp4bit import kernels  # noqa: E402
from lightning_sdp4bit.reference import blockwise_hadamard  # noqa: E402
from lightning_sdp4bit.reference import ops as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEEDS = 8
COPIES = 64  # copies of the same group in one call: 8 * 64 = 512 draws per value


def _split(payload, bits, group_size, numel):
    """(codes int8 [rows, numel], scales fp32 [rows, numel // group_size]) of a payload."""
    code_bytes = numel * bits // 8
    rows = payload.shape[0]
    codes = reference.unpack_codes(payload[:, :code_bytes].contiguous(), bits, rows * numel).view(rows, numel)
    return codes, payload[:, code_bytes:].contiguous().view(torch.float32)


def _one_step_group(bits, group_size):
    """One group whose scale is exactly 1: qmax, then values k + 0.3 and random ones in [-qmax, qmax]."""
    qmax = 2 ** (bits - 1) - 1
    generator = torch.Generator().manual_seed(bits)
    values = (torch.rand(group_size, generator=generator) * 2 - 1) * qmax
    values[1::2] = torch.randint(-qmax, qmax, (group_size // 2,), generator=generator).float() + 0.3
    values[0] = qmax
    return values


def _check_unbiased(mean, exact, step, copies=COPIES):
    """mean of N = SEEDS * copies dequantized draws of `exact`, quantization step `step` (elementwise)."""
    error = (mean - exact) / step
    standard_error = 0.5 / (SEEDS * copies) ** 0.5  # a draw is one of two levels: variance <= step^2 / 4
    assert error.abs().max() < 6 * standard_error
    assert error.mean().abs() < 0.02


# The 2048-group case has 16 copies (128 draws per value: 6 standard errors are 0.27 of a step, still
# below the 0.3 that nearest rounding would miss by); 64 copies of it took 107 s in the interpreter.
@pytest.mark.parametrize("bits, group_size, copies", [(4, 2048, 16), (2, 32, COPIES), (8, 128, COPIES)])
def test_weight_update_encode_is_unbiased_and_within_one_step(bits, group_size, copies):
    group = _one_step_group(bits, group_size)
    master = group.repeat(copies).to(DEVICE)
    numel = master.numel()
    nearest_codes, nearest_scales = _split(
        kernels.weight_update_encode(master, None, bits, group_size, "nearest", 0), bits, group_size, numel
    )
    total = torch.zeros(numel, dtype=torch.float64, device=DEVICE)
    for seed in range(SEEDS):
        payload = kernels.weight_update_encode(master, None, bits, group_size, "stochastic", seed)
        assert torch.equal(payload, kernels.weight_update_encode(master, None, bits, group_size, "stochastic", seed))
        codes, scales = _split(payload, bits, group_size, numel)
        assert torch.equal(scales, nearest_scales)
        assert (codes.int() - nearest_codes.int()).abs().max() <= 1
        total += reference.decode_rows(payload, bits, group_size, numel).view(-1).double()
    other = kernels.weight_update_encode(master, None, bits, group_size, "stochastic", SEEDS)
    assert not torch.equal(other, payload)
    mean = (total / SEEDS).view(copies, group_size).mean(0).cpu()
    _check_unbiased(mean, group.double(), 1.0, copies)


@pytest.mark.parametrize("bits, group_size, hadamard_size", [(8, 128, 32), (4, 64, 0), (2, 256, 64)])
def test_grad_encode_is_unbiased_in_the_hadamard_domain(bits, group_size, hadamard_size):
    generator = torch.Generator().manual_seed(11)
    grad = torch.randn(2 * group_size, generator=generator).repeat(COPIES).to(DEVICE)  # outer=1, chunks=1
    args = (1, 1, hadamard_size, bits, group_size)
    exact = blockwise_hadamard(grad, hadamard_size) if hadamard_size else grad.clone()
    nearest_codes, nearest_scales = _split(
        kernels.grad_encode(grad, *args, "nearest", 0), bits, group_size, grad.numel()
    )
    total = torch.zeros(grad.numel(), dtype=torch.float64, device=DEVICE)
    for seed in range(SEEDS):
        payload = kernels.grad_encode(grad, *args, "stochastic", seed)
        codes, scales = _split(payload, bits, group_size, grad.numel())
        assert torch.equal(scales, nearest_scales)
        assert (codes.int() - nearest_codes.int()).abs().max() <= 1
        total += reference.decode_rows(payload, bits, group_size, grad.numel()).view(-1).double()
    step = nearest_scales.view(-1).repeat_interleave(group_size).double()
    mean = (total / SEEDS).view(COPIES, -1).mean(0)
    _check_unbiased(mean.cpu(), exact.view(COPIES, -1)[0].double().cpu(), step.view(COPIES, -1)[0].cpu())


@pytest.mark.parametrize("in_bits, out_bits, group_size", [(8, 4, 128), (4, 2, 32)])
def test_grad_requantize_is_unbiased(in_bits, out_bits, group_size):
    generator = torch.Generator().manual_seed(12)
    # P = 3 peers send copies of one group; outer = 2 halves of COPIES copies each.
    rows = torch.randn(3, group_size, generator=generator).repeat(1, 2 * COPIES).to(DEVICE)
    payload = reference.encode_rows(rows, in_bits, group_size, "nearest", 0)
    exact = reference.decode_rows(payload, in_bits, group_size, rows.shape[1]).double().sum(0)[:group_size]
    args = (in_bits, out_bits, group_size, 2)
    numel = COPIES * group_size
    nearest_codes, nearest_scales = _split(
        kernels.grad_requantize(payload, *args, "nearest", 0), out_bits, group_size, numel
    )
    total = torch.zeros(2 * numel, dtype=torch.float64, device=DEVICE)
    for seed in range(SEEDS):
        out = kernels.grad_requantize(payload, *args, "stochastic", seed)
        codes, scales = _split(out, out_bits, group_size, numel)
        assert torch.equal(scales, nearest_scales)
        assert (codes.int() - nearest_codes.int()).abs().max() <= 1
        total += reference.decode_rows(out, out_bits, group_size, numel).view(-1).double()
    mean = (total / SEEDS).view(2 * COPIES, group_size).mean(0)
    _check_unbiased(mean.cpu(), exact.cpu(), float(nearest_scales[0, 0]))
