"""Gradient stage 1: rotate, quantize and lay out a gradient bucket by destination, in one pass.

`grad_encode(grad [N], outer, chunks, hadamard_size, ...)` views the bucket as [outer, chunks, S],
transforms every contiguous `hadamard_size` block with the normalised Walsh-Hadamard matrix,
quantizes group-wise and writes the payload [chunks, row_bytes(outer * S)] whose chunk c holds
grad[:, c, :] (c goes to peer c in the all-to-all). The rotated gradient never exists in memory.

Twin: `torch_grad_encode` in `lightning_sdp4bit.reference.ops`.

Bytes per element: reads 4 (fp32 gradient) or 2 (bf16), writes bits/8 + 4/group. The 1/world of the
average is folded in (`scale`), so that no pass over the bucket has to divide it first.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits
from lightning_sdp4bit.reference.ops import assemble_pieces, payload_row_bytes

from ._columns import (
    INTERPRETING,
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

__all__ = ["grad_encode", "grad_encode_pieces"]


@triton.jit
def _piece_rows(table_ptr, pieces, at, live, SEARCH: tl.constexpr, ALIGN: tl.constexpr):
    """Where the thread rows starting at bucket elements `at` [R] lie, as element offsets from
    the first piece, and which of them lie in a piece at all (the rest read as 0).

    The table is int64 [3, pieces]: each piece's first element in the bucket (ascending), its
    end, and its offset from the first piece in elements. A branchless binary search of SEARCH
    steps (pieces < 2^SEARCH) finds each row's piece: the last one starting at or before it.
    """
    piece = tl.zeros_like(at)
    for step in tl.static_range(SEARCH):
        probe = piece + (1 << (SEARCH - 1 - step))
        inside = probe < pieces
        start = tl.load(table_ptr + probe, mask=inside, other=0)
        piece = tl.where(inside & (start <= at), probe, piece)
    start = tl.load(table_ptr + piece)
    end = tl.load(table_ptr + pieces + piece)
    offset = tl.load(table_ptr + 2 * pieces + piece)
    # Pieces start at multiples of 16 bytes and rows at multiples of T elements within them, so
    # the 16-byte loads stay vectorized (the table's values are unknown to the compiler).
    return tl.multiple_of(offset + at - start, ALIGN), live & (at >= start) & (at < end)


@triton.jit(do_not_specialize=["seed", "pieces"])
def _grad_encode_kernel(
    grad_ptr,  # fp32 or bf16 [N], N = outer * chunks * S; with SEARCH, the first piece
    table_ptr,  # with SEARCH: int64 [3, pieces], see _piece_rows (else unused)
    pieces,
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
    SEARCH: tl.constexpr,  # 0: grad_ptr holds the bucket; else its pieces are found in SEARCH steps
    ALIGN: tl.constexpr,  # elements per 16 bytes
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
    at = (shard.to(tl.int64) * shard_rows + in_shard) * T  # the rows' first elements in the bucket
    present = live  # rows read from memory; the others (outside every piece) are zeros
    if SEARCH:
        at, present = _piece_rows(table_ptr, pieces, at, live, SEARCH, ALIGN)
    x = scale_columns(load_columns(grad_ptr, at, present, T), grad_scale, T)
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


def _encode(
    source: Tensor,
    table: Tensor,
    pieces: int,
    numel: int,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: str,
    seed: int,
    scale: float,
) -> Tensor:
    """The launch: the bucket of `numel` elements is `source` itself (pieces == 0) or the
    `pieces` tensors of `table` (see _piece_rows), the first of which is `source`."""
    config = LaunchConfig(group_size, SPLIT_THREAD_ROW, rows_per_thread=2)
    row_numel = numel // chunks
    row_bytes = payload_row_bytes(row_numel, bits, group_size)
    payload = torch.empty(chunks, row_bytes, dtype=torch.uint8, device=source.device)
    T = config.thread_row
    shard_rows = row_numel // outer // T
    row_units, unit = row_length(payload)
    launch(
        _grad_encode_kernel,
        config.grid(shard_rows) + (outer * chunks,),
        source,
        table,
        pieces,
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
        SEARCH=pieces.bit_length(),
        ALIGN=16 // source.element_size(),
        **config.options(),
    )
    return payload


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
    args = (outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale)
    return _encode(grad, grad, 0, grad.numel(), *args)


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
    rounding = _check_encode(grad.numel(), "grad", outer, chunks, hadamard_size, bits, group_size, rounding, seed)
    check_tensor("grad", grad, (torch.float32, torch.bfloat16), 1)
    check_scale(scale)
    return eager(_grad_encode_op, _grad_encode)(
        grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed, float(scale)
    )


def _check_encode(
    numel: int, name: str, outer: int, chunks: int, hadamard_size: int, bits: int, group_size: int, rounding, seed: int
) -> str:
    """Check what both encoders take; returns the rounding's name."""
    check_bits("bits", bits)
    check_group_and_hadamard(group_size, hadamard_size)
    stochastic = check_rounding(rounding)
    check_seed(seed)
    for what, value in (("outer", outer), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    shards = outer * chunks
    if shards > MAX_GRID_Y:
        raise ValueError(f"outer x chunks must be at most {MAX_GRID_Y} shards, got {shards}")
    if numel <= 0 or numel % (shards * group_size):
        raise ValueError(
            f"{name} has {numel} elements: it must split into outer x chunks = {shards} shards "
            f"of whole groups of group_size={group_size}"
        )
    return (Rounding.STOCHASTIC if stochastic else Rounding.NEAREST).value


# ------------------------------------------------------------------------------------------------
# The bucket in pieces: the gradients where autograd left them, read in place where they can be.


def _readable_in_place(pieces: Sequence[Tensor], starts: Sequence[int]) -> bool:
    """Whether the kernel can read these pieces (of one dtype) where they lie: each contiguous,
    starting at a multiple of 16 bytes, and starting and ending on thread rows (multiples of 16
    elements in the bucket). A GPT's gradients are."""
    T = SPLIT_THREAD_ROW
    return all(
        piece.is_contiguous() and piece.data_ptr() % 16 == 0 and start % T == 0 and piece.numel() % T == 0
        for piece, start in zip(pieces, starts, strict=True)
    )


def _piece_table(pieces: Sequence[Tensor], starts: Sequence[int]) -> Tensor:
    """The int64 table [3, pieces] of `_piece_rows`, on the pieces' device. Made for every call:
    autograd's gradients seldom lie where they lay the step before (on the H200 at 1.3B, 490 of
    518 tables differed from every earlier one). From pinned memory, the copy does not hold
    the host up; the caching host allocator keeps the pinned block until the copy has run."""
    base, size = pieces[0].data_ptr(), pieces[0].element_size()
    values = (
        *starts,
        *(start + piece.numel() for piece, start in zip(pieces, starts, strict=True)),
        *((piece.data_ptr() - base) // size for piece in pieces),
    )
    device = pieces[0].device
    if device.type != "cuda":  # the interpreter reads host memory
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def _grad_encode_pieces(
    pieces: list[Tensor],
    starts: list[int],
    numel: int,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: str,
    seed: int,
    scale: float,
) -> Tensor:
    args = (outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale)
    # Decided here, where compiled code runs too: addresses are not known while tracing.
    if _readable_in_place(pieces, starts):
        return _encode(pieces[0], _piece_table(pieces, starts), len(pieces), numel, *args)
    return _grad_encode(assemble_pieces(pieces, starts, numel), *args)


_grad_encode_pieces_op = torch.library.custom_op("sdp4bit::grad_encode_pieces", _grad_encode_pieces, mutates_args=())


@_grad_encode_pieces_op.register_fake
def _(pieces, starts, numel, outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale):
    row_numel = numel // chunks
    return pieces[0].new_empty(chunks, payload_row_bytes(row_numel, bits, group_size), dtype=torch.uint8)


def grad_encode_pieces(
    pieces: Sequence[Tensor],
    starts: Sequence[int],
    numel: int,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: Rounding | str,
    seed: int,
    scale: float = 1.0,
) -> Tensor:
    """`grad_encode` of a bucket of `numel` elements given in pieces: elements starts[i] to
    starts[i] + pieces[i].numel() are pieces[i] (any shape, flattened), ascending and not
    overlapping; every other element is 0; all fp32 or all bf16. The pieces are read where they
    lie, with no copy into one buffer, when each is contiguous, at a 16-byte address, and starts
    and ends on a multiple of 16 elements of the bucket (a GPT's gradients do); otherwise they are
    assembled into one buffer first (`assemble_pieces`). Equals `grad_encode` of the assembled
    bucket byte for byte, with either rounding. Raises ValueError, naming the parameter, for bad
    arguments.
    """
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise ValueError(f"numel must be an integer, got {numel!r}")
    rounding = _check_encode(numel, "the bucket", outer, chunks, hadamard_size, bits, group_size, rounding, seed)
    check_scale(scale)
    pieces, starts = list(pieces), [int(start) for start in starts]
    if len(pieces) != len(starts) or not pieces:
        raise ValueError(
            f"pieces and starts must be as long as each other and not empty, got {len(pieces)} and {len(starts)}"
        )
    end = 0
    for index, (piece, start) in enumerate(zip(pieces, starts, strict=True)):
        if not isinstance(piece, Tensor) or piece.device != pieces[0].device:
            raise ValueError(f"pieces[{index}] must be a tensor on {pieces[0].device}")
        if piece.dtype != pieces[0].dtype or piece.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"pieces must be all fp32 or all bf16, got {piece.dtype} at pieces[{index}]")
        if start < end:
            raise ValueError(f"starts must ascend, no piece overlapping the next: starts[{index}] = {start} < {end}")
        end = start + piece.numel()
    if end > numel:
        raise ValueError(f"the last piece ends at element {end}, past numel = {numel}")
    if not (pieces[0].is_cuda or INTERPRETING):
        raise ValueError(f"pieces must be CUDA tensors (or run with TRITON_INTERPRET=1), got {pieces[0].device}")
    return eager(_grad_encode_pieces_op, _grad_encode_pieces)(
        pieces, starts, numel, outer, chunks, hadamard_size, bits, group_size, rounding, seed, float(scale)
    )
