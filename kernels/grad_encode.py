"""Gradient stage 1: rotate, quantize and lay out a gradient bucket by destination, in one pass.

`grad_encode(grad [N], outer, chunks, hadamard_size, ...)` views the bucket as [outer, chunks, S],
transforms every contiguous `hadamard_size` block with the normalised Walsh-Hadamard matrix,
quantizes group-wise and writes the payload [chunks, row_bytes(outer * S)] whose chunk c holds
grad[:, c, :] (c goes to peer c in the all-to-all). The rotated gradient never exists in memory.

Twin: `torch_grad_encode` in `lightning_sdp4bit.reference.ops`.

Bytes per element: reads 4 (fp32 gradient) or 2 (bf16), writes bits/8 + 4/group.
"""

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits
from lightning_sdp4bit.reference.ops import payload_row_bytes

from ._common import (
    LaunchConfig,
    check_group_and_hadamard,
    check_rounding,
    check_seed,
    check_tensor,
    hadamard_constants,
    hadamard_rows,
    load_rows,
    pack_rows,
    quantize_rows,
    store_rows,
    tl,
    triton,
)

__all__ = ["grad_encode"]


@triton.jit
def _grad_encode_kernel(
    grad_ptr,  # fp32 or bf16 [N], N = outer * chunks * S
    words_ptr,  # the payload [chunks, row_bytes(outer * S)] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    thread_rows,  # N // T
    payload_rows,  # outer * S // T: thread rows per payload row (chunk)
    shard_rows,  # S // T
    chunks,
    row_words,  # row_bytes // 4
    code_words,  # outer * S * BITS // 32: the word of a row where its scales start
    seed,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    H: tl.constexpr,  # Hadamard block; 1 = no transform
    LOG2_H: tl.constexpr,
    H_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    # The program walks the payload in order: thread row `rows` is row `local` of chunk `chunk`.
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    chunk = rows // payload_rows
    local = rows % payload_rows
    # Its source: shard [outer block, chunk] of the bucket viewed as [outer, chunks, S].
    block = local // shard_rows
    source = ((block * chunks + chunk).to(tl.int64) * shard_rows + local % shard_rows) * T
    x = load_rows(grad_ptr, source, live, R, T).to(tl.float32)
    if H > 1:
        x = hadamard_rows(x, R, T, H, LOG2_H, H_SCALE)
    codes, scales = quantize_rows(x, seed, rows.to(tl.int64) * T, R, T, GROUP, BITS, STOCHASTIC)
    TW: tl.constexpr = T * BITS // 32
    chunk_words = chunk.to(tl.int64) * row_words
    store_rows(words_ptr, chunk_words + local * TW, live, pack_rows(codes, R, T, BITS), R, TW)
    # One scale per group, at the group's first thread row (groups never straddle chunks).
    RPG: tl.constexpr = GROUP // T
    heads = tl.program_id(0) * R + tl.arange(0, R // RPG) * RPG
    scale_at = (heads // payload_rows).to(tl.int64) * row_words + code_words + (heads % payload_rows) // RPG
    tl.store(scales_ptr + scale_at, scales, mask=heads < thread_rows)


@torch.library.custom_op("sdp4bit::grad_encode", mutates_args=())
def _grad_encode(
    grad: Tensor,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: str,
    seed: int,
) -> Tensor:
    config = LaunchConfig(group_size, hadamard_size)
    row_numel = grad.numel() // chunks
    payload = torch.empty(chunks, payload_row_bytes(row_numel, bits, group_size), dtype=torch.uint8, device=grad.device)
    T = config.thread_row
    _grad_encode_kernel[config.grid(grad.numel() // T)](
        grad,
        payload.view(torch.int32),
        payload.view(torch.float32),
        grad.numel() // T,
        row_numel // T,
        row_numel // outer // T,
        chunks,
        payload.shape[1] // 4,
        row_numel * bits // 32,
        seed,
        BITS=bits,
        GROUP=group_size,
        T=T,
        R=config.rows,
        STOCHASTIC=rounding == Rounding.STOCHASTIC.value,
        **hadamard_constants(hadamard_size),
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )
    return payload


@_grad_encode.register_fake
def _(grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed):
    row_numel = grad.numel() // chunks
    return grad.new_empty(chunks, payload_row_bytes(row_numel, bits, group_size), dtype=torch.uint8)


def grad_encode(
    grad: Tensor,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: Rounding | str,
    seed: int,
) -> Tensor:
    """Gradient stage 1: payload uint8 [chunks, row_bytes(outer * S)] of grad [N = outer*chunks*S].

    Chunk c holds the rotated, quantized grad[o, c, :] for o = 0..outer-1 (the bucket viewed as
    [outer, chunks, S]). grad: fp32 or bf16; S must be a multiple of group_size; hadamard_size:
    0 (off) or a power of two up to 256 dividing group_size. Equals `torch_grad_encode` byte for
    byte with nearest rounding. Raises ValueError, naming the parameter, for bad arguments.
    """
    check_bits("bits", bits)
    check_group_and_hadamard(group_size, hadamard_size)
    stochastic = check_rounding(rounding)
    check_seed(seed)
    check_tensor("grad", grad, (torch.float32, torch.bfloat16), 1)
    for name, value in (("outer", outer), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    shards = outer * chunks
    if grad.numel() == 0 or grad.numel() % (shards * group_size):
        raise ValueError(
            f"grad has {grad.numel()} elements: it must split into outer x chunks = {shards} shards "
            f"of whole groups of group_size={group_size}"
        )
    rounding = (Rounding.STOCHASTIC if stochastic else Rounding.NEAREST).value
    return _grad_encode(grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed)
