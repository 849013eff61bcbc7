"""Gradient stages 2 and 3: dequantize the chunks received from P peers and sum them, in one pass.

- `grad_requantize` (stage 2, between the two all-to-alls): intra-node payload [L, row(outer*S)]
  -> sum over the L peers -> re-quantized inter-node payload [outer, row(S)], chunk m for node m.
  It stays in the Hadamard domain: the transform is linear, so it commutes with the sum.
- `grad_decode_sum` (stage 3): payload [P, row(S)] -> sum over P -> inverse Hadamard -> the fp32
  gradient shard `out` [S].

The P rows are summed strictly in order 0, 1, ..., P-1, as the reference's `_sum_rows` does, so
that the sums are bit-identical. P is a constexpr: see UNROLLED_PEERS. Twins: `torch_grad_requantize` and
`torch_grad_decode_sum` in `lightning_sdp4bit.reference.ops`.

Bytes per element of the sum: both read P * (bits/8 + 4/group); requantize writes
out_bits/8 + 4/group, decode_sum writes 4.
"""

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits
from lightning_sdp4bit.reference.ops import payload_row_bytes

from ._columns import (
    dequantize_columns,
    hadamard_columns,
    load_columns,
    load_per_row,
    pack_columns,
    quantize_columns,
    store_columns,
    store_rows_coalesced,
    tl,
    triton,
)
from ._common import (
    MAX_GRID_Y,
    LaunchConfig,
    check_group_and_hadamard,
    check_payload,
    check_rounding,
    check_seed,
    check_tensor,
    eager,
    hadamard_constants,
    row_length,
    word_views,
)
from ._launch import launch

__all__ = ["grad_decode_sum", "grad_requantize"]


LOADS_AHEAD = tl.constexpr(4)
"""Peers whose rows are loaded before any of them is added. Measured on the H200 (paper
settings, 1 GiB, before P became a constexpr): 4 beat 2 and 8."""

UNROLLED_PEERS = tl.constexpr(8)
"""Peers per step of the loop over P. P is a constexpr (one compilation per peer count, which a
job keeps), so up to this many peers the summing code is straight-line and ptxas can put all
their loads in flight. With P a run-time loop bound it issued each peer's loads only after the
previous peer's adds, one memory round trip per peer (grad_requantize, 8 peers: 85% -> 93% of the
H200's copy bandwidth at 1 GiB). A larger step would only lengthen compilation: 16 peers
unrolled compile in 11 s, 64 in two minutes."""


@triton.jit
def _add_peers(
    total,
    words_ptr,
    scales_ptr,
    first,
    count: tl.constexpr,
    word_at,
    scale_at,
    live,
    row_words,
    BITS: tl.constexpr,
    T: tl.constexpr,
):
    """total (T fp32 columns) plus payload rows first, ..., first + count - 1 of the thread rows
    at word_at / scale_at, added in row order; each LOADS_AHEAD rows are loaded before the first
    of them is added."""
    TW: tl.constexpr = T * BITS // 32
    for ahead in tl.static_range(0, count, LOADS_AHEAD):
        words = ()
        scales = ()
        for step in tl.static_range(LOADS_AHEAD):
            if ahead + step < count:
                offset = (first + ahead + step) * row_words
                words = words + (load_columns(words_ptr, offset + word_at, live, TW),)
                scales = scales + (load_per_row(scales_ptr, offset + scale_at, live),)
        for step in tl.static_range(LOADS_AHEAD):
            if ahead + step < count:
                term = dequantize_columns(words[step], scales[step], T, BITS)
                added = ()
                for i in tl.static_range(T):
                    added = added + (total[i] + term[i],)
                total = added
    return total


@triton.jit
def _sum_rows(
    words_ptr,
    scales_ptr,
    rows,
    live,
    row_words,  # int64
    code_words,
    PEERS: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
):
    """fp32 columns: thread rows `rows` of the PEERS payload rows, dequantized and summed in row order.

    Each term is code * scale, then a separate add (the launch disables FMA contraction), like
    PyTorch. The sum starts from +0.0, which adds exactly to the first term because no term is
    -0.0 (a zero code gives +0.0, and a zero scale comes only with zero codes).
    """
    TW: tl.constexpr = T * BITS // 32
    word_at = rows.to(tl.int64) * TW
    scale_at = code_words + rows // (GROUP // T)
    total = ()
    for _ in tl.static_range(T):
        total = total + (tl.zeros([R], tl.float32),)
    LOOPED: tl.constexpr = PEERS // UNROLLED_PEERS * UNROLLED_PEERS
    for first in range(0, LOOPED, UNROLLED_PEERS):
        total = _add_peers(
            total, words_ptr, scales_ptr, first, UNROLLED_PEERS, word_at, scale_at, live, row_words, BITS, T
        )
    return _add_peers(total, words_ptr, scales_ptr, LOOPED, PEERS - LOOPED, word_at, scale_at, live, row_words, BITS, T)


@triton.jit(do_not_specialize=["seed"])
def _requantize_kernel(
    in_words_ptr,  # the intra-node payload [P, row_bytes(outer * S)] viewed as int32 words
    in_scales_ptr,  # the same payload viewed as fp32
    out_words_ptr,  # the inter-node payload [outer, row_bytes(S)] viewed as int32 words
    out_scales_ptr,  # the same payload viewed as fp32
    shard_rows,  # S // T: thread rows per output row
    in_row_units,  # in row_bytes // (4 * IN_UNIT)
    in_code_words,  # outer * S * IN_BITS // 32
    out_row_units,  # out row_bytes // (4 * OUT_UNIT)
    out_code_words,  # S * OUT_BITS // 32
    seed,
    PEERS: tl.constexpr,  # P
    IN_UNIT: tl.constexpr,  # words; see _common.row_length
    OUT_UNIT: tl.constexpr,
    IN_BITS: tl.constexpr,
    OUT_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    # The grid is (tiles of a shard, output row = destination node): no per-row division.
    node = tl.program_id(1)
    in_shard = tl.program_id(0) * R + tl.arange(0, R)
    live = in_shard < shard_rows
    rows = node * shard_rows + in_shard  # thread rows of the input payload's rows
    in_row_words = in_row_units.to(tl.int64) * IN_UNIT
    total = _sum_rows(in_words_ptr, in_scales_ptr, rows, live, in_row_words, in_code_words, PEERS, IN_BITS, GROUP, T, R)
    codes, scales = quantize_columns(total, seed, rows.to(tl.int64) * T, R, T, GROUP, OUT_BITS, STOCHASTIC)
    TW: tl.constexpr = T * OUT_BITS // 32
    out_row = node.to(tl.int64) * out_row_units * OUT_UNIT
    store_columns(out_words_ptr, out_row + in_shard.to(tl.int64) * TW, live, pack_columns(codes, T, OUT_BITS), TW)
    RPG: tl.constexpr = GROUP // T
    heads = tl.program_id(0) * R + tl.arange(0, R // RPG) * RPG  # each group's first thread row
    tl.store(out_scales_ptr + out_row + out_code_words + heads // RPG, scales, mask=heads < shard_rows)


@triton.jit
def _decode_sum_kernel(
    words_ptr,  # the inter-node payload [P, row_bytes(S)] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    out_ptr,  # fp32 [S], the gradient shard
    thread_rows,  # S // T
    row_units,  # row_bytes // (4 * ROW_UNIT)
    code_words,  # S * BITS // 32
    PEERS: tl.constexpr,  # P
    ROW_UNIT: tl.constexpr,  # words; see _common.row_length
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    LOG2_H: tl.constexpr,  # Hadamard block 2^LOG2_H; 0 = no transform
    H_SCALE: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    row_words = row_units.to(tl.int64) * ROW_UNIT
    total = _sum_rows(words_ptr, scales_ptr, rows, live, row_words, code_words, PEERS, BITS, GROUP, T, R)
    total = hadamard_columns(total, R, T, LOG2_H, H_SCALE)  # normalised: its own inverse
    store_rows_coalesced(out_ptr, rows, live, total, T)


def _grad_requantize(
    payload: Tensor, in_bits: int, out_bits: int, group_size: int, outer: int, rounding: str, seed: int
) -> Tensor:
    # One warp per program (32 thread rows, 1024 elements): 81% -> 86-87% of the copy bandwidth
    # at 256 MiB on the H200, 93% -> 95% at 1 GiB, in every run of four sessions. Why is not
    # established: per-program clock stamps show the same start-up (the first waves finishing
    # in step) with one warp and with two, and a two-warp copy with the stamps added ran at 86%.
    config = LaunchConfig(group_size, min_warps=1)
    T = config.thread_row
    numel = payload.shape[1] * 8 * group_size // (in_bits * group_size + 32)  # outer * S
    shard = numel // outer
    out = torch.empty(outer, payload_row_bytes(shard, out_bits, group_size), dtype=torch.uint8, device=payload.device)
    (in_units, in_unit), (out_units, out_unit) = row_length(payload), row_length(out)
    launch(
        _requantize_kernel,
        config.grid(shard // T) + (outer,),
        *word_views("payload", payload),
        out.view(torch.int32),
        out.view(torch.float32),
        shard // T,
        in_units,
        numel * in_bits // 32,
        out_units,
        shard * out_bits // 32,
        seed,
        PEERS=payload.shape[0],
        IN_UNIT=in_unit,
        OUT_UNIT=out_unit,
        IN_BITS=in_bits,
        OUT_BITS=out_bits,
        GROUP=group_size,
        T=T,
        R=config.rows,
        STOCHASTIC=rounding == Rounding.STOCHASTIC.value,
        **config.options(),
    )
    return out


_grad_requantize_op = torch.library.custom_op("sdp4bit::grad_requantize", _grad_requantize, mutates_args=())


@_grad_requantize_op.register_fake
def _(payload, in_bits, out_bits, group_size, outer, rounding, seed):
    shard = payload.shape[1] * 8 * group_size // (in_bits * group_size + 32) // outer
    return payload.new_empty(outer, payload_row_bytes(shard, out_bits, group_size), dtype=torch.uint8)


def _grad_decode_sum(payload: Tensor, bits: int, group_size: int, hadamard_size: int, out: Tensor) -> None:
    config = LaunchConfig(group_size)
    T = config.thread_row
    row_units, unit = row_length(payload)
    launch(
        _decode_sum_kernel,
        config.grid(out.numel() // T),
        *word_views("payload", payload),
        out,
        out.numel() // T,
        row_units,
        out.numel() * bits // 32,
        PEERS=payload.shape[0],
        ROW_UNIT=unit,
        BITS=bits,
        GROUP=group_size,
        T=T,
        R=config.rows,
        **hadamard_constants(hadamard_size),
        **config.options(),
    )


_grad_decode_sum_op = torch.library.custom_op("sdp4bit::grad_decode_sum", _grad_decode_sum, mutates_args=("out",))


@_grad_decode_sum_op.register_fake
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
    if (
        isinstance(outer, bool)
        or not isinstance(outer, int)
        or not 1 <= outer <= MAX_GRID_Y
        or numel % (outer * group_size)
    ):
        raise ValueError(
            f"outer must be an integer from 1 to {MAX_GRID_Y} that splits a payload row of {numel} elements into "
            f"shards of whole groups of {group_size}, got {outer!r}"
        )
    rounding = (Rounding.STOCHASTIC if stochastic else Rounding.NEAREST).value
    return eager(_grad_requantize_op, _grad_requantize)(payload, in_bits, out_bits, group_size, outer, rounding, seed)


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
    eager(_grad_decode_sum_op, _grad_decode_sum)(payload, bits, group_size, hadamard_size, out)
    return out
