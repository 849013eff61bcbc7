"""Gradient stages 2 and 3: dequantize the chunks received from P peers and sum them, in one pass.

- `grad_requantize` (stage 2, between the two all-to-alls): intra-node payload [L, row(outer*S)]
  -> sum over the L peers -> re-quantized inter-node payload [outer, row(S)], chunk m for node m.
  It stays in the Hadamard domain: the transform is linear, so it commutes with the sum.
- `grad_decode_sum` (stage 3): payload [P, row(S)] -> sum over P -> inverse Hadamard -> the fp32
  gradient shard `out` [S].

The P rows are summed strictly in order 0, 1, ..., P-1, starting from row 0, as the reference's
`_sum_rows` does, so that the sums are bit-identical. Twins: `torch_grad_requantize` and
`torch_grad_decode_sum` in `lightning_sdp4bit.reference.ops`.

Bytes per element of the sum: both read P * (bits/8 + 4/group); requantize writes
out_bits/8 + 4/group, decode_sum writes 4.
"""

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits
from lightning_sdp4bit.reference.ops import payload_row_bytes

from ._common import (
    LaunchConfig,
    check_group_and_hadamard,
    check_payload,
    check_rounding,
    check_seed,
    check_tensor,
    hadamard_constants,
    hadamard_rows,
    load_per_row,
    load_rows,
    pack_rows,
    quantize_rows,
    store_rows,
    tl,
    triton,
    unpack_rows,
    word_views,
)

__all__ = ["grad_decode_sum", "grad_requantize"]


@triton.jit
def _dequantize_rows(
    words_ptr, scales_ptr, row, word_at, scale_at, live, BITS: tl.constexpr, T: tl.constexpr, R: tl.constexpr
):
    """fp32 [R, T]: thread rows of payload row `row` (a word offset), code * scale."""
    codes = unpack_rows(load_rows(words_ptr, row + word_at, live, R, T * BITS // 32), R, T, BITS)
    return codes * load_per_row(scales_ptr, row + scale_at, live, R)


@triton.jit
def _sum_rows(
    words_ptr,
    scales_ptr,
    rows,
    live,
    peers,
    row_words,
    code_words,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
):
    """fp32 [R, T]: thread rows `rows` of the P payload rows, dequantized and summed in row order."""
    word_at = rows.to(tl.int64) * (T * BITS // 32)
    scale_at = code_words + rows // (GROUP // T)
    row_words = row_words.to(tl.int64)
    total = _dequantize_rows(words_ptr, scales_ptr, 0, word_at, scale_at, live, BITS, T, R)
    # Two peers per iteration: both rows' loads are issued before either is added, which doubles
    # the bytes each warp has in flight (the loop waits on memory, not on arithmetic). The adds
    # stay in peer order; each is code * scale, then a separate add (the launch disables FMA
    # contraction), like PyTorch.
    for peer in range(1, peers - 1, 2):
        first = _dequantize_rows(words_ptr, scales_ptr, peer * row_words, word_at, scale_at, live, BITS, T, R)
        second = _dequantize_rows(words_ptr, scales_ptr, (peer + 1) * row_words, word_at, scale_at, live, BITS, T, R)
        total += first
        total += second
    if peers % 2 == 0:
        total += _dequantize_rows(words_ptr, scales_ptr, (peers - 1) * row_words, word_at, scale_at, live, BITS, T, R)
    return total


@triton.jit
def _requantize_kernel(
    in_words_ptr,  # the intra-node payload [P, row_bytes(outer * S)] viewed as int32 words
    in_scales_ptr,  # the same payload viewed as fp32
    out_words_ptr,  # the inter-node payload [outer, row_bytes(S)] viewed as int32 words
    out_scales_ptr,  # the same payload viewed as fp32
    peers,  # P
    thread_rows,  # outer * S // T
    shard_rows,  # S // T: thread rows per output row
    in_row_words,
    in_code_words,  # outer * S * IN_BITS // 32
    out_row_words,
    out_code_words,  # S * OUT_BITS // 32
    seed,
    IN_BITS: tl.constexpr,
    OUT_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    total = _sum_rows(in_words_ptr, in_scales_ptr, rows, live, peers, in_row_words, in_code_words, IN_BITS, GROUP, T, R)
    codes, scales = quantize_rows(total, seed, rows.to(tl.int64) * T, R, T, GROUP, OUT_BITS, STOCHASTIC)
    # Output row (destination node) and thread row within it.
    node = (rows // shard_rows).to(tl.int64)
    TW: tl.constexpr = T * OUT_BITS // 32
    store_rows(
        out_words_ptr, node * out_row_words + (rows % shard_rows) * TW, live, pack_rows(codes, R, T, OUT_BITS), R, TW
    )
    RPG: tl.constexpr = GROUP // T
    heads = tl.program_id(0) * R + tl.arange(0, R // RPG) * RPG  # each group's first thread row
    scale_at = (heads // shard_rows).to(tl.int64) * out_row_words + out_code_words + (heads % shard_rows) // RPG
    tl.store(out_scales_ptr + scale_at, scales, mask=heads < thread_rows)


@triton.jit
def _decode_sum_kernel(
    words_ptr,  # the inter-node payload [P, row_bytes(S)] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    out_ptr,  # fp32 [S], the gradient shard
    peers,  # P
    thread_rows,  # S // T
    row_words,
    code_words,  # S * BITS // 32
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    H: tl.constexpr,  # Hadamard block; 1 = no transform
    LOG2_H: tl.constexpr,
    H_SCALE: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    total = _sum_rows(words_ptr, scales_ptr, rows, live, peers, row_words, code_words, BITS, GROUP, T, R)
    if H > 1:
        total = hadamard_rows(total, R, T, H, LOG2_H, H_SCALE)  # normalised: its own inverse
    store_rows(out_ptr, rows.to(tl.int64) * T, live, total, R, T)


@torch.library.custom_op("sdp4bit::grad_requantize", mutates_args=())
def _grad_requantize(
    payload: Tensor, in_bits: int, out_bits: int, group_size: int, outer: int, rounding: str, seed: int
) -> Tensor:
    config = LaunchConfig(group_size)
    T = config.thread_row
    numel = payload.shape[1] * 8 * group_size // (in_bits * group_size + 32)  # outer * S
    shard = numel // outer
    out = torch.empty(outer, payload_row_bytes(shard, out_bits, group_size), dtype=torch.uint8, device=payload.device)
    _requantize_kernel[config.grid(numel // T)](
        *word_views("payload", payload),
        out.view(torch.int32),
        out.view(torch.float32),
        payload.shape[0],
        numel // T,
        shard // T,
        payload.shape[1] // 4,
        numel * in_bits // 32,
        out.shape[1] // 4,
        shard * out_bits // 32,
        seed,
        IN_BITS=in_bits,
        OUT_BITS=out_bits,
        GROUP=group_size,
        T=T,
        R=config.rows,
        STOCHASTIC=rounding == Rounding.STOCHASTIC.value,
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )
    return out


@_grad_requantize.register_fake
def _(payload, in_bits, out_bits, group_size, outer, rounding, seed):
    shard = payload.shape[1] * 8 * group_size // (in_bits * group_size + 32) // outer
    return payload.new_empty(outer, payload_row_bytes(shard, out_bits, group_size), dtype=torch.uint8)


@torch.library.custom_op("sdp4bit::grad_decode_sum", mutates_args=("out",))
def _grad_decode_sum(payload: Tensor, bits: int, group_size: int, hadamard_size: int, out: Tensor) -> None:
    config = LaunchConfig(group_size, hadamard_size)
    T = config.thread_row
    _decode_sum_kernel[config.grid(out.numel() // T)](
        *word_views("payload", payload),
        out,
        payload.shape[0],
        out.numel() // T,
        payload.shape[1] // 4,
        out.numel() * bits // 32,
        BITS=bits,
        GROUP=group_size,
        T=T,
        R=config.rows,
        **hadamard_constants(hadamard_size),
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )


@_grad_decode_sum.register_fake
def _(payload, bits, group_size, hadamard_size, out):
    return None


def grad_requantize(
    payload: Tensor,
    in_bits: int,
    out_bits: int,
    group_size: int,
    outer: int,
    rounding: Rounding | str,
    seed: int,
) -> Tensor:
    """Gradient stage 2: intra-node payload [P, row_bytes(outer*S)] -> inter-node payload
    [outer, row_bytes(S)]: dequantize, sum over P in order, re-quantize to out_bits (no Hadamard).

    S must be a multiple of group_size. Equals `torch_grad_requantize` byte for byte with nearest
    rounding. Raises ValueError, naming the parameter, for bad arguments.
    """
    check_bits("in_bits", in_bits)
    check_bits("out_bits", out_bits)
    check_group_and_hadamard(group_size)
    stochastic = check_rounding(rounding)
    check_seed(seed)
    numel = check_payload("payload", payload, in_bits, group_size)
    if isinstance(outer, bool) or not isinstance(outer, int) or outer < 1 or numel % (outer * group_size):
        raise ValueError(
            f"outer must be a positive integer that splits a payload row of {numel} elements into "
            f"shards of whole groups of {group_size}, got {outer!r}"
        )
    rounding = (Rounding.STOCHASTIC if stochastic else Rounding.NEAREST).value
    return _grad_requantize(payload, in_bits, out_bits, group_size, outer, rounding, seed)


def grad_decode_sum(payload: Tensor, bits: int, group_size: int, hadamard_size: int, out: Tensor) -> Tensor:
    """Gradient stage 3: payload [P, row_bytes(S)] -> fp32 gradient shard `out` [S]: dequantize,
    sum over P in order, inverse Hadamard (blocks of hadamard_size; 0 = off). Returns `out`.

    Equals `torch_grad_decode_sum` bit for bit. Raises ValueError, naming the parameter, for bad
    arguments.
    """
    check_bits("bits", bits)
    check_group_and_hadamard(group_size, hadamard_size)
    numel = check_payload("payload", payload, bits, group_size)
    check_tensor("out", out, (torch.float32,), 1)
    if out.numel() != numel or out.device != payload.device:
        raise ValueError(
            f"out must hold the {numel} elements of a payload row on {payload.device}, "
            f"got {out.numel()} on {out.device}"
        )
    _grad_decode_sum(payload, bits, group_size, hadamard_size, out)
    return out
