"""Group-wise symmetric absmax quantization and bit packing, in plain PyTorch.

This is the executable specification. The Triton kernels must reproduce it bit for bit with
nearest rounding; the distributed code is tested against simulations built from it.

Definitions (b = bits, g = group size, qmax = 2^(b-1) - 1):
- a tensor is flattened and cut into groups of g consecutive elements; a short tail is padded
  with zeros, never dropped;
- each group has one fp32 **scale** = absmax(group) / qmax (0 for an all-zero group);
- each element has one integer **code** in [-qmax, qmax]: round(x / scale), where round is
  `torch.round` (half to even) or stochastic, floor(x / scale + u) with u ~ U[0, 1);
- dequantization is code * scale, in fp32;
- **packing** stores codes as b-bit two's complement fields, 8/b per byte, element i of each
  byte in bits [b*i, b*(i+1)) (low bits first). 8-bit codes are the int8 bytes themselves.

Non-finite input gives a non-finite scale (NaN or inf) for its group, so the corruption stays
visible after dequantization instead of turning into finite garbage. The public `quantize`
refuses such input outright.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits, check_power_of_two, coerce_enum

__all__ = [
    "QuantizedTensor",
    "dequantize",
    "dequantize_groups",
    "max_level",
    "pack_codes",
    "quantize",
    "quantize_groups",
    "uniform_noise",
    "unpack_codes",
]


def max_level(bits: int) -> int:
    """Largest code magnitude: 127 for 8 bits, 7 for 4, 1 for 2 (the symmetric levels)."""
    return 2 ** (bits - 1) - 1


def uniform_noise(numel: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """The U[0, 1) fp32 draws that stochastic rounding adds, reproducible from `seed`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(numel, generator=generator, device=device, dtype=torch.float32)


def quantize_groups(
    x: Tensor, bits: int, rounding: Rounding | str = Rounding.NEAREST, noise: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize the rows of `x` (fp32, [groups, group_size]), one scale per row.

    Returns (codes int8 [groups, group_size], scales fp32 [groups]). Stochastic rounding needs
    `noise`, U[0, 1) values of x's shape (or numel), e.g. from `uniform_noise`.
    """
    x = x.float()
    codes, scales = round_groups(x, bits, rounding, noise, out=torch.empty_like(x))
    return codes.to(torch.int8), scales


def round_groups(
    x: Tensor, bits: int, rounding: Rounding | str, noise: Tensor | None, out: Tensor
) -> tuple[Tensor, Tensor]:
    """`quantize_groups` up to the integer cast: (codes as fp32 in `out`, x's shape, which may be
    x itself, then overwritten; scales)."""
    rounding = coerce_enum("rounding", rounding, Rounding)
    qmax = max_level(bits)
    # amax propagates NaN, and an inf absmax gives an inf scale: both stay non-finite. (max(amax,
    # -amin) would skip the |x| copy, but the vectorised reductions give a NaN other bits.) The
    # divisor is a tensor because CUDA divides by a Python number through its reciprocal, which
    # can be an ulp off the IEEE quotient that the CPU and the kernels compute.
    absmax = x.abs().amax(dim=1)
    scales = absmax / torch.full_like(absmax, qmax)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.div(x, safe[:, None], out=out)  # then rounded in place
    if rounding is Rounding.NEAREST:
        codes.round_()
    else:
        if noise is None:
            raise ValueError("rounding='stochastic' needs noise (U[0, 1) draws of the input's shape)")
        codes.add_(noise.reshape(codes.shape)).floor_()
    # |x / scale| <= qmax up to one ulp, so the clamp only catches that ulp.
    return codes.clamp_(-qmax, qmax), scales


def dequantize_groups(codes: Tensor, scales: Tensor) -> Tensor:
    """fp32 [groups, group_size] = codes * scale, row by row (int8 codes promote to fp32 exactly)."""
    return torch.mul(codes, scales[:, None])


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack int8 codes (any shape, flattened) into uint8 bytes, 8/bits codes per byte.

    Output length is ceil(numel * bits / 8); a partial last byte is zero-padded.
    """
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.view(torch.uint8).clone()
    pad = (-flat.numel()) % 4
    if pad or flat.storage_offset() % 4:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    packed = pack_into(flat, bits, torch.empty(flat.numel() * bits // 8, dtype=torch.uint8, device=flat.device))
    return packed[: -(-codes.numel() * bits // 8)]


def pack_into(codes: Tensor, bits: int, out: Tensor) -> Tensor:
    """Pack contiguous int8 codes (numel a multiple of 4, 4-byte aligned) into uint8 `out`
    (any layout of numel * bits / 8 bytes), 4 or 2 bits per code, low fields first.

    Four codes are one int32 word; masking keeps each byte's low b bits, and shifting the word
    right by 8 - b, then 16 - 2b, ORs the fields of neighbouring bytes into the low byte of each
    group of 8/b bytes (an int32 shift moves bits across bytes, which a uint8 shift cannot).
    That byte is then cast out: 4 bits keep bytes 0 and 2 of each word, 2 bits byte 0.
    """
    words = codes.view(torch.int32) & int.from_bytes(bytes([2**bits - 1] * 4), "little")
    fields, shift = 8 // bits, 8 - bits
    while fields > 1:
        words |= words >> shift
        fields, shift = fields // 2, 2 * shift
    carrier = words.view(torch.int16) if bits == 4 else words
    # The integer cast keeps the low byte (two's complement wrap-around).
    return out.copy_(carrier.view(out.shape))


def unpack_codes(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of `pack_codes`: int8 codes [numel], sign-extended from their b-bit fields."""
    if bits == 8:
        return packed.reshape(-1)[:numel].view(torch.int8)
    return unpack_into(packed.reshape(-1), bits).view(-1)[:numel]


def unpack_into(packed: Tensor, bits: int) -> Tensor:
    """int8 codes [*packed.shape, 8/bits] from packed uint8 bytes (any layout): field i of each
    byte, sign-extended. Shifting field i to the top of the byte (uint8 wraps) and back down as
    int8 (the arithmetic shift sign-extends) needs no left shift for the top field."""
    per_byte = 8 // bits
    codes = torch.empty(*packed.shape, per_byte, dtype=torch.int8, device=packed.device)
    for position in range(per_byte):
        left = 8 - bits * (position + 1)
        top = (packed << left) if left else packed
        torch.bitwise_right_shift(top.view(torch.int8), 8 - bits, out=codes[..., position])
    return codes


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized tensor as it travels: packed codes, fp32 scales and what is needed to undo it."""

    codes: Tensor
    """uint8 [ceil(padded_numel * bits / 8)]: packed codes, padded to whole groups."""
    scales: Tensor
    """fp32 [ceil(numel / group_size)]: one absmax scale per group."""
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: codes plus scales (shape and dtype are known to the receiver)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / max(self.numel, 1)


def quantize(
    x: Tensor,
    bits: int = 4,
    group_size: int = 128,
    rounding: Rounding | str = "nearest",
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> QuantizedTensor:
    """Quantize `x` group-wise to `bits`-bit symmetric codes with one fp32 absmax scale per group.

    Args:
        x: a floating-point tensor of any shape; it is flattened, and a short last group is
            zero-padded.
        bits: 2, 4 or 8. The levels are -(2^(bits-1)-1)..+(2^(bits-1)-1).
        group_size: elements per scale, a positive power of two.
        rounding: "nearest" (half to even) or "stochastic" (unbiased: E[dequantize] = x).
        generator: the randomness of stochastic rounding; give at most one of `generator` and
            `seed`. With neither, the draws come from torch's default generator for x's device,
            as `torch.rand` does, so `torch.manual_seed(n)` before the call makes the result
            reproducible.
        seed: the seed of a generator of the call's own, in place of `generator`.

    Returns:
        a `QuantizedTensor`; `dequantize(q)` gives back x's shape and dtype, and `q.nbytes` is
        its cost on the wire.

    Raises:
        ValueError: for bad arguments, or when `x` holds NaN or Inf (its scales would be garbage).
    """
    check_bits("bits", bits)
    check_power_of_two("group_size", group_size)
    rounding = coerce_enum("rounding", rounding, Rounding)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if generator is not None and seed is not None:
        raise ValueError("give at most one of generator= and seed= (seed= builds its own generator)")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x holds NaN or Inf; quantizing it would give meaningless scales")
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % group_size
    groups = torch.nn.functional.pad(flat, (0, pad)).view(-1, group_size)
    noise = None
    if rounding is Rounding.STOCHASTIC:
        if seed is not None:
            generator = torch.Generator(device=x.device).manual_seed(seed)
        # generator=None: torch.rand draws from the default generator of x's device.
        noise = torch.rand(groups.shape, generator=generator, device=x.device, dtype=torch.float32)
    codes, scales = quantize_groups(groups, bits, rounding, noise)
    return QuantizedTensor(pack_codes(codes, bits), scales, x.shape, x.dtype, bits, group_size)


def dequantize(q: QuantizedTensor) -> Tensor:
    """Undo `quantize`: a tensor of the original shape and dtype (codes times their group's scale)."""
    padded = q.scales.numel() * q.group_size
    codes = unpack_codes(q.codes, q.bits, padded).view(-1, q.group_size)
    values = dequantize_groups(codes, q.scales).reshape(-1)[: q.numel]
    return values.view(q.shape).to(q.dtype)
