"""What the five compression kernels share: the guarded Triton import, the tile convention, the
jit helpers (rounding, quantization, bit packing, noise, the Hadamard butterfly), the argument
checks and the launch settings.

**Tile convention.** A program owns R *thread rows* of T contiguous elements, a tile [R, T]. Each
thread holds whole rows in registers and lanes and warps run along R, so a Hadamard block of up
to T elements, a row's codes and its packed 32-bit words never leave their thread (no shared
memory, no shuffles except for a group's absmax). Triton derives a tensor's register layout from
the contiguity of its pointer tile: loading [T // C, R, C] (C elements = one 16-byte vector), C is
the only contiguous dimension, so the coalescer puts the lanes on R and gives each thread C-wide
vector loads; a permute and reshape to [R, T] then only renames registers. (Loaded as [R, T],
Triton spreads a row over 8 lanes and every butterfly stage past the first two crosses lanes.)
A quantization group is GROUP // T consecutive thread rows of one tile.

**Bit-exactness with the reference** (`lightning_sdp4bit.reference`), on finite input:
- divisions are IEEE (Triton's `/` is approximate): `tl.math.div_rn` once per group, and per
  element a reciprocal refined by two Newton steps, which rounds exactly (see `_divide`);
- round half to even is (v + 1.5 * 2^23) - 1.5 * 2^23, exact for |v| < 2^22 (|v| <= qmax here);
- every kernel is launched with `enable_fp_fusion=False`, so code * scale and the following add
  round twice, as in PyTorch, instead of being contracted into one FMA;
- the Hadamard transform runs the reference's butterfly stages in the reference's order;
- fp32 -> bf16 rounding is written out in integer ops (see `round_to_bf16`).
"""

import os

try:
    import triton
    import triton.language as tl
except ImportError as error:  # lightning_sdp4bit.ops.kernels_available() turns this into False
    raise ImportError("lightning_sdp4bit.kernels needs Triton (pip install triton)") from error

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding
from lightning_sdp4bit.reference.hadamard import hadamard_scale
from lightning_sdp4bit.reference.ops import payload_row_bytes

__all__ = [
    "LaunchConfig",
    "check_group_and_hadamard",
    "check_payload",
    "check_rounding",
    "check_seed",
    "check_tensor",
    "hadamard_rows",
    "hadamard_constants",
    "INTERPRETING",
    "load_per_row",
    "load_rows",
    "pack_rows",
    "quantize_rows",
    "round_to_bf16",
    "store_rows",
    "tl",
    "triton",
    "unpack_rows",
    "word_views",
]

# ------------------------------------------------------------------------------------------------
# Launch settings: fixed, no autotuning; one sweep on the H200 chose them for all five ops (see
# benchmarks/results/kernels_h200_2026-11-29.md).

THREAD_ROW = 32
"""T, elements per thread row: 128 bytes of fp32 = 8 vector loads in flight per thread, and a
whole word of codes at every width (32 / bits <= 16 codes). Hadamard blocks above 32 use T = 64
(so 64-blocks stay in registers; 128 and 256 cross lanes for their last stages: 128 fp32 per
thread would spill)."""

NUM_WARPS = 2
"""Warps per program: 64 threads own R = 64 thread rows, 2048 elements (8 KiB of fp32). In the
H200 sweep 2 warps were best or within 6 points for every op, and well ahead for the gradient
kernels (grad_encode: 53% of the copy bandwidth, against 44% with 4 warps and 36% with 8)."""

MIN_GROUP_SIZE = 32
"""Smaller groups would put less than one 32-bit word of 2-bit codes in a group; 32 is also the
paper's smallest sensible group (one Hadamard block)."""

MAX_GROUP_SIZE = 16384
"""One group must fit in one program: 16384 / 32 = 512 thread rows, 16 warps."""

MAX_HADAMARD_SIZE = 256


class LaunchConfig:
    """T (elements per thread row), R (thread rows per program) and warps for one call."""

    def __init__(self, group_size: int, hadamard_size: int = 0) -> None:
        self.thread_row = THREAD_ROW if hadamard_size <= THREAD_ROW else 2 * THREAD_ROW
        rows_per_group = group_size // self.thread_row
        # One row per thread; a larger group takes more warps so that it stays in one program.
        self.num_warps = max(NUM_WARPS, rows_per_group // 32)
        self.rows = 32 * self.num_warps

    def grid(self, thread_rows: int) -> tuple[int]:
        return (triton.cdiv(thread_rows, self.rows),)


# ------------------------------------------------------------------------------------------------
# Argument checks: each raises a ValueError that names the offending parameter.


INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether Triton runs the kernels in its CPU interpreter, as CI does. Triton reads the variable
when a kernel is defined, i.e. when this package is imported, so this reads it then too."""


def check_tensor(name: str, tensor: Tensor, dtypes: tuple[torch.dtype, ...], ndim: int) -> None:
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"{name} must have dtype {allowed}, got {str(tensor.dtype).removeprefix('torch.')}")
    if tensor.dim() != ndim or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {ndim}-D tensor, got shape {tuple(tensor.shape)}")
    if not (tensor.is_cuda or INTERPRETING):
        raise ValueError(f"{name} must be a CUDA tensor (or run with TRITON_INTERPRET=1), got {tensor.device}")


def check_group_and_hadamard(group_size: int, hadamard_size: int = 0) -> None:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size & (group_size - 1)
        or not MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE
    ):
        raise ValueError(
            f"group_size must be a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE} for the kernels, "
            f"got {group_size!r}"
        )
    if isinstance(hadamard_size, bool) or not isinstance(hadamard_size, int) or hadamard_size < 0:
        raise ValueError(f"hadamard_size must be 0 (off) or a power of two, got {hadamard_size!r}")
    if hadamard_size and (hadamard_size & (hadamard_size - 1) or hadamard_size > min(MAX_HADAMARD_SIZE, group_size)):
        raise ValueError(
            f"hadamard_size must be 0 (off) or a power of two up to {MAX_HADAMARD_SIZE} that divides "
            f"group_size ({group_size}), got {hadamard_size!r}"
        )


def check_rounding(rounding: Rounding | str) -> bool:
    """True for stochastic rounding. (Not config.coerce_enum: torch.compile in torch 2.11 cannot
    trace iterating over an Enum class.)"""
    value = rounding.value if isinstance(rounding, Rounding) else rounding
    if value not in (Rounding.STOCHASTIC.value, Rounding.NEAREST.value):
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    return value == Rounding.STOCHASTIC.value


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")


def check_payload(name: str, payload: Tensor, bits: int, group_size: int, rows: int | None = None) -> int:
    """Check a payload uint8 [P, row_bytes] (P == rows when given) and return its row's numel."""
    check_tensor(name, payload, (torch.uint8,), 2)
    row_bytes = payload.shape[1]
    numel = row_bytes * 8 * group_size // (bits * group_size + 32)
    if rows is not None and payload.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got {payload.shape[0]}")
    if numel == 0 or numel % group_size or payload_row_bytes(numel, bits, group_size) != row_bytes:
        raise ValueError(
            f"{name} rows of {row_bytes} bytes are not a payload of whole groups of {group_size} "
            f"{bits}-bit codes (each group takes {group_size * bits // 8 + 4} bytes)"
        )
    return numel


def word_views(name: str, payload: Tensor) -> tuple[Tensor, Tensor]:
    """The payload as int32 words (for the codes) and as fp32 (for the scales), in place.

    Called inside the custom ops (not traced by torch.compile, which cannot see storage offsets).
    """
    if payload.storage_offset() % 4:
        raise ValueError(f"{name} must start on a 4-byte boundary: its codes and fp32 scales are read as words")
    return payload.view(torch.int32), payload.view(torch.float32)


# ------------------------------------------------------------------------------------------------
# jit helpers


@triton.jit
def _tile_offsets(row_start, R: tl.constexpr, T: tl.constexpr, C: tl.constexpr):
    """Element offsets [T // C, R, C] of R rows of T that start at row_start [R] (see the module doc)."""
    inner = tl.arange(0, T // C)[:, None, None] * C + tl.arange(0, C)[None, None, :]
    return row_start[None, :, None] + inner


@triton.jit
def load_rows(ptr, row_start, live, R: tl.constexpr, T: tl.constexpr):
    """Rows [R, T] of ptr's dtype from ptr + row_start[r]; rows with live[r] False read as 0."""
    C: tl.constexpr = min(T, 128 // ptr.dtype.element_ty.primitive_bitwidth)
    x = tl.load(ptr + _tile_offsets(row_start, R, T, C), mask=live[None, :, None], other=0)
    return tl.reshape(tl.permute(x, (1, 0, 2)), [R, T])


@triton.jit
def store_rows(ptr, row_start, live, x, R: tl.constexpr, T: tl.constexpr):
    """Store rows x [R, T] at ptr + row_start[r] where live[r]."""
    C: tl.constexpr = min(T, 128 // ptr.dtype.element_ty.primitive_bitwidth)
    x = tl.permute(tl.reshape(x, [R, T // C, C]), (1, 0, 2))
    tl.store(ptr + _tile_offsets(row_start, R, T, C), x, mask=live[None, :, None])


@triton.jit
def load_per_row(ptr, offsets, live, R: tl.constexpr):
    """One value per thread row, [R, 1], from ptr + offsets[r] (0 where not live), in the rows'
    own layout: built like a [1, R, 1] tile so that row r lands in the thread that owns row r."""
    x = tl.load(ptr + offsets[None, :, None], mask=live[None, :, None], other=0)
    return tl.reshape(x, [R, 1])


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32.

    Integer ops, because Triton's interpreter truncates fp32 -> bf16 casts; on the GPU this is
    exactly cvt.rn.bf16.f32, what torch's .to(torch.bfloat16) does. NaN stays NaN.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _uniform_rows(seed, row_first, R: tl.constexpr, T: tl.constexpr):
    """U(0, 1) fp32 noise [R, T] for the elements with flat indices row_first[r] + t.

    One Philox4x32-10 call (tl.randint4x) yields 128 random bits; split into 16-bit halves they
    serve 8 elements, keyed by the element's index // 8, so the noise is reproducible from
    (seed, index) whatever the tiling. u = (k + 0.5) / 2^16 for a uniform 16-bit k: E[u] = 1/2
    exactly, and floor(v + u) is biased by at most 2^-17 of a quantization step, less than fp32
    rounds v + u for |v| >= 1. (24-bit draws, one call per 4 elements, cost 1.5x the
    instructions, in kernels whose issue rate is what limits them.)
    """
    octets = (row_first // 8).to(tl.int32)[:, None] + tl.arange(0, T // 8)[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, octets)
    pairs = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [R, T // 8, 2, 2]
    halves = tl.reshape(tl.join(pairs & 0xFFFF, pairs >> 16), [R, T])
    return (halves.to(tl.float32) + 0.5) * (1.0 / 65536.0)


@triton.jit
def _divide(x, divisor):
    """x [G, GROUP] / divisor [G], correctly rounded (IEEE) like torch's division.

    tl.math.div_rn costs ~10 instructions and a branch per element. With y = RN(1/divisor),
    computed once per group, q = x * y and two Newton steps q += (x - divisor * q) * y (two FMAs
    each) give RN(x / divisor): after the first step q is within an ulp of the quotient, and
    then, by Markstein's theorem, the residual is exact and the second step rounds correctly. The
    residuals stay normal, as the theorem needs, while 2^-60 <= divisor <= 2^60 (|x| <= 128 *
    divisor here); a tile with a group outside that range takes div_rn instead.
    """
    d = divisor[:, None]
    normal = (divisor >= 8.673617379884035e-19) & (divisor <= 1.152921504606847e18)
    if tl.min(normal.to(tl.int32), axis=0) == 1:
        y = tl.math.div_rn(1.0, divisor)[:, None]
        q = x * y
        q = tl.fma(tl.fma(-d, q, x), y, q)
        q = tl.fma(tl.fma(-d, q, x), y, q)
    else:
        q = tl.math.div_rn(x, d)
    return q


@triton.jit
def quantize_rows(
    x,
    seed,
    row_first,
    R: tl.constexpr,
    T: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Quantize fp32 rows x [R, T] group-wise: (codes int32 [R, T], scales fp32 [R * T // GROUP]).

    The reference `quantize_groups`: scale = absmax / qmax, code = round(x / scale) clamped to
    +-qmax, with round half to even or, stochastic, floor(x / scale + u) with u drawn for the
    flat element indices row_first[r] + t.
    """
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    groups = tl.reshape(x, [R * T // GROUP, GROUP])
    # |x| compared as int32 bit patterns orders like the floats, and NaN patterns sort above inf,
    # so a NaN survives the max (tl.max on floats is fmax, which drops NaN) and its group's scale
    # stays non-finite, as the reference's amax gives.
    magnitude = groups.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    scales = tl.math.div_rn(tl.max(magnitude, axis=1).to(tl.float32, bitcast=True), QMAX)
    safe = tl.where(scales > 0, scales, 1.0)
    if STOCHASTIC:
        # Its noise differs from the reference's anyway (only its statistics are specified), so
        # the exact division becomes a multiplication by the group's reciprocal (1 instruction
        # instead of 5, within an ulp): that pays for part of the Philox draws.
        v = groups * tl.math.div_rn(1.0, safe)[:, None]
        v = tl.floor(v + tl.reshape(_uniform_rows(seed, row_first, R, T), [R * T // GROUP, GROUP]))
    else:
        v = _divide(groups, safe)
        v = (v + 12582912.0) - 12582912.0  # round half to even: 1.5 * 2^23 leaves no fraction bits
    codes = tl.minimum(tl.maximum(v, -QMAX), QMAX).to(tl.int32)
    return tl.reshape(codes, [R, T]), scales


@triton.jit
def pack_rows(codes, R: tl.constexpr, T: tl.constexpr, BITS: tl.constexpr):
    """int32 codes [R, T] -> int32 words [R, T * BITS // 32] as reference `pack_codes` lays them
    out: BITS-bit two's complement fields, element k of a word in bits [BITS*k, BITS*(k+1)), so the
    words' little-endian bytes are the reference's bytes."""
    K: tl.constexpr = 32 // BITS
    fields = tl.reshape(codes & ((1 << BITS) - 1), [R, T // K, K]) << (tl.arange(0, K) * BITS)[None, None, :]
    return tl.sum(fields, axis=2)  # the fields are disjoint, so their sum is their bitwise or


@triton.jit
def unpack_rows(words, R: tl.constexpr, T: tl.constexpr, BITS: tl.constexpr):
    """int32 words [R, T * BITS // 32] -> fp32 codes [R, T], sign-extended (reference `unpack_codes`)."""
    K: tl.constexpr = 32 // BITS
    # K copies of each word, made by joins so that they stay in the word's thread (a broadcast
    # lets Triton spread the new axis over lanes, and the sums after it through shared memory).
    copies = words
    for _ in tl.static_range(K.bit_length() - 1):
        copies = tl.join(copies, copies)
    copies = tl.reshape(copies, [R, T // K, K])
    # Shift field k to the top, then arithmetic-shift it back down: that sign-extends it.
    to_top = (32 - BITS) - tl.arange(0, K) * BITS
    fields = (copies << to_top[None, None, :]) >> (32 - BITS)
    return tl.reshape(fields, [R, T]).to(tl.float32)


@triton.jit
def hadamard_rows(x, R: tl.constexpr, T: tl.constexpr, H: tl.constexpr, LOG2_H: tl.constexpr, SCALE: tl.constexpr):
    """The reference `blockwise_hadamard` of fp32 rows x [R, T] in blocks of H (H divides R * T).

    Stage h = 1, 2, ..., H/2 replaces each pair (y[i], y[i + h]) of a 2h-block by (a + b, a - b),
    then everything is multiplied by SCALE = 1/sqrt(H): the reference's operations in its order,
    so the result is bit-identical. A stage is a reshape to [blocks, 2, h], a permute that makes
    the pair axis last, tl.split and tl.join; for H <= T all of it stays in one thread's registers.
    """
    N: tl.constexpr = R * T
    y = tl.reshape(x, [N // H, H])
    for stage in tl.static_range(LOG2_H):
        pairs = tl.permute(tl.reshape(y, [N // (2 << stage), 2, 1 << stage]), (0, 2, 1))
        a, b = tl.split(pairs)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [N // H, H])
    return tl.reshape(y * SCALE, [R, T])


def hadamard_constants(hadamard_size: int) -> dict:
    """The constexpr arguments of `hadamard_rows` (H <= 1 means no transform)."""
    return {
        "H": max(hadamard_size, 1),
        "LOG2_H": max(hadamard_size, 1).bit_length() - 1,
        "H_SCALE": hadamard_scale(hadamard_size) if hadamard_size > 1 else 1.0,
    }
