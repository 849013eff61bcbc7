"""Gradient stage 1: rotate, quantize and lay out a gradient bucket by destination, in one pass.

`grad_encode(grad [N], outer, chunks, hadamard_size, ...)` views the bucket as [outer, chunks, S],
transforms every contiguous `hadamard_size` block with the normalised Walsh-Hadamard matrix,
quantizes group-wise and writes the payload [chunks, row_bytes(outer * S)] whose chunk c holds
grad[:, c, :] (c goes to peer c in the all-to-all). The rotated gradient never exists in memory.

Twin: `torch_grad_encode` in `lightning_sdp4bit.reference.ops`.

Bytes per element: reads 4 (fp32 gradient) or 2 (bf16), writes bits/8 + 4/group. The 1/world of the
average is folded in (`scale`), so that no pass over the bucket has to divide it first.
"""

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits
from lightning_sdp4bit.reference.ops import payload_row_bytes

from ._columns import (
    hadamard_columns,
    load_columns,
    pack_columns,
    quantize_columns,
    scale_columns,
    store_columns,
    tl,
    triton,
)
from ._common import (
    MAX_GRID_Y,
    SPLIT_THREAD_ROW,
    LaunchConfig,
    check_group_and_hadamard,
    check_rounding,
    check_scale,
    check_seed,
    check_tensor,
    eager,
    hadamard_constants,
    row_length,
)
from ._launch import launch

__all__ = ["grad_encode"]


@triton.jit(do_not_specialize=["seed"])
def _grad_encode_kernel(
    grad_ptr,  # fp32 or bf16 [N], N = outer * chunks * S
    words_ptr,  # the payload [chunks, row_bytes(outer * S)] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    payload_rows,  # outer * S // T: thread rows per payload row (chunk)
    shard_rows,  # S // T
    chunks,
    row_units,  # row_bytes // (4 * ROW_UNIT)
    code_words,  # outer * S * BITS // 32: the word of a row where its scales start
    seed,
    grad_scale,  # fp32 factor on every gradient element before the transform (1/world)
    ROW_UNIT: tl.constexpr,  # words; see _common.row_length
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    LOG2_H: tl.constexpr,  # Hadamard block 2^LOG2_H; 0 = no transform
    H_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    # The grid is (tiles of a shard, shard): program (t, s) reads R thread rows of shard s =
    # [block, chunk] of the bucket viewed as [outer, chunks, S], and writes them as thread rows
    # `local` of payload row `chunk` (per-row divisions by run-time values would cost ~20
    # instructions per row).
    shard = tl.program_id(1)
    block = shard // chunks
    chunk = shard % chunks
    in_shard = tl.program_id(0) * R + tl.arange(0, R)
    live = in_shard < shard_rows
    x = scale_columns(load_columns(grad_ptr, (shard.to(tl.int64) * shard_rows + in_shard) * T, live, T), grad_scale, T)
    # The transform's 1/sqrt(H) is left to the quantizer, which saves it per element when rounding
    # is stochastic.
    x = hadamard_columns(x, R, T, LOG2_H, 1.0)
    local = block * shard_rows + in_shard
    # The noise is keyed by the element's index in the payload, chunk-major.
    first = (chunk.to(tl.int64) * payload_rows + local) * T
    codes, scales = quantize_columns(x, seed, first, R, T, GROUP, BITS, STOCHASTIC, H_SCALE)
    TW: tl.constexpr = T * BITS // 32
    chunk_words = chunk.to(tl.int64) * row_units * ROW_UNIT
    store_columns(words_ptr, chunk_words + local.to(tl.int64) * TW, live, pack_columns(codes, T, BITS), TW)
    # One scale per group (groups never straddle shards).
    RPG: tl.constexpr = GROUP // T
    heads = tl.program_id(0) * R + tl.arange(0, R // RPG) * RPG  # each group's first thread row
    scale_at = chunk_words + code_words + (block * shard_rows + heads) // RPG
    tl.store(scales_ptr + scale_at, scales, mask=heads < shard_rows)


def _grad_encode(
    grad: Tensor,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: str,
    seed: int,
    scale: float,
) -> Tensor:
    config = LaunchConfig(group_size, SPLIT_THREAD_ROW, rows_per_thread=2)
    row_numel = grad.numel() // chunks
    payload = torch.empty(chunks, payload_row_bytes(row_numel, bits, group_size), dtype=torch.uint8, device=grad.device)
    T = config.thread_row
    shard_rows = row_numel // outer // T
    row_units, unit = row_length(payload)
    launch(
        _grad_encode_kernel,
        config.grid(shard_rows) + (outer * chunks,),
        grad,
        payload.view(torch.int32),
        payload.view(torch.float32),
        row_numel // T,
        shard_rows,
        chunks,
        row_units,
        row_numel * bits // 32,
        seed,
        scale,
        ROW_UNIT=unit,
        BITS=bits,
        GROUP=group_size,
        T=T,
        R=config.rows,
        STOCHASTIC=rounding == Rounding.STOCHASTIC.value,
        **hadamard_constants(hadamard_size),
        **config.options(),
    )
    return payload


_grad_encode_op = torch.library.custom_op("sdp4bit::grad_encode", _grad_encode, mutates_args=())


@_grad_encode_op.register_fake
def _(grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale):
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
    scale: float = 1.0,
) -> Tensor:
    """Gradient stage 1: payload uint8 [chunks, row_bytes(outer * S)] of grad [N = outer*chunks*S].

    Chunk c holds the rotated, quantized scale * grad[o, c, :] for o = 0..outer-1 (the bucket
    viewed as [outer, chunks, S]; the product is taken in fp32). grad: fp32 or bf16; S must be a
    multiple of group_size; hadamard_size: 0 (off) or a power of two up to 256 dividing
    group_size; scale: positive and finite. Equals `torch_grad_encode` byte for byte with nearest
    rounding. Raises ValueError, naming the parameter, for bad arguments.
    """
    check_bits("bits", bits)
    check_group_and_hadamard(group_size, hadamard_size)
    stochastic = check_rounding(rounding)
    check_seed(seed)
    check_tensor("grad", grad, (torch.float32, torch.bfloat16), 1)
    check_scale(scale)
    for name, value in (("outer", outer), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    shards = outer * chunks
    if shards > MAX_GRID_Y:
        raise ValueError(f"outer x chunks must be at most {MAX_GRID_Y} shards, got {shards}")
    if grad.numel() == 0 or grad.numel() % (shards * group_size):
        raise ValueError(
            f"grad has {grad.numel()} elements: it must split into outer x chunks = {shards} shards "
            f"of whole groups of group_size={group_size}"
        )
    rounding = (Rounding.STOCHASTIC if stochastic else Rounding.NEAREST).value
    return eager(_grad_encode_op, _grad_encode)(
        grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed, float(scale)
    )
