"""The blockwise Walsh-Hadamard transform, normalised, in Sylvester order.

`blockwise_hadamard(x, n)` equals `(x.view(-1, n) @ hadamard_matrix(n)).view_as(x)`, where
hadamard_matrix(n) = H_n / sqrt(n) and H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]. The
normalised matrix is symmetric and orthogonal, so the transform is its own inverse.

Why it is there: gradients have outliers, and one outlier sets the absmax scale of its whole
group, crushing the other values to zero. Rotating each block spreads an outlier over the block
first (the paper's "Hadamard smoothing").

The arithmetic is defined exactly, so that the Triton kernels can match it bit for bit: log2(n)
fp32 butterfly stages with h = 1, 2, 4, ..., n/2, each replacing the pair (a, b) = (y[i],
y[i + h]) of every 2h-block by (a + b, a - b), then one multiplication by the fp32 constant
`hadamard_scale(n)`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sdp4bit.config import check_power_of_two

__all__ = ["blockwise_hadamard", "hadamard_matrix", "hadamard_scale", "inverse_blockwise_hadamard"]


def hadamard_scale(block: int) -> float:
    """1/sqrt(block), the normalisation; the kernels multiply by the same fp32 value."""
    return float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))


def hadamard_matrix(block: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """The dense normalised Sylvester Hadamard matrix H_block / sqrt(block), [block, block]."""
    check_power_of_two("block", block)
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < block:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return (matrix / math.sqrt(block)).to(dtype=dtype, device=device)


def blockwise_hadamard(x: Tensor, block: int) -> Tensor:
    """Transform every contiguous `block` elements of `x` (numel divisible by block); fp32 out."""
    check_power_of_two("block", block)
    if x.numel() % block:
        raise ValueError(f"x has {x.numel()} elements, not a multiple of the Hadamard block {block}")
    source = x.reshape(-1, block).float()
    out = butterflies(source, block, torch.empty_like(source))
    return out.mul_(hadamard_scale(block)).view(x.shape)


def butterflies(source: Tensor, block: int, out: Tensor, spare: Tensor | None = None) -> Tensor:
    """The butterfly stages of `blockwise_hadamard` without the final scale: fp32 `source`
    [rows, block] into `out` (contiguous, same shape), which it returns.

    The stages alternate between `out` and `spare` (allocated when None) so that the last one
    writes `out`; `source` is read by the first stage only, so with an odd number of stages it
    may itself be the spare (the caller's scratch, then overwritten). Each stage is one add and
    one subtract over strided halves, with no temporaries. (Complex64 views of the halves would
    loop faster, but torch adds complex numbers as a + alpha * b, which turns an infinity into
    NaN: not the same bits.)
    """
    stages = block.bit_length() - 1
    if stages == 0:
        return out.copy_(source)
    if spare is None:
        spare = torch.empty_like(out)
    y, half = source, 1
    for stage in range(stages):
        target = out if (stages - 1 - stage) % 2 == 0 else spare
        shape = (-1, block // (2 * half), 2, half)
        pairs, result = y.view(shape), target.view(shape)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=result[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=result[:, :, 1])
        y, half = target, 2 * half
    return out


def inverse_blockwise_hadamard(x: Tensor, block: int) -> Tensor:
    """The inverse transform. The normalised Hadamard matrix is orthogonal and symmetric, so this
    is the forward transform again; it has its own name so that call sites read as the math."""
    return blockwise_hadamard(x, block)
