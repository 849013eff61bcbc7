"""The jit helpers the five kernels are built from: a tile held as *columns*, and the loads,
stores, Hadamard butterflies, quantization, noise and bit packing that work on it.

**Tile convention.** A program owns R *thread rows* of T contiguous elements (32, or 16 where
a launcher says why), one thread row per thread and lane, the lanes, then the warps, then
repeats running along the rows: thread row r is in lane r % 32. The tile is a Python tuple of T tensors
[R], its *columns*: column t holds element t of every thread row. All arithmetic is then
element-wise on [R] tensors that share one layout, so Triton never moves data between
threads or through shared memory, whatever its version; a butterfly, a group's absmax within
a row, or packing codes into words is plain register code.

Memory still moves in 16-byte vectors: a row's elements are loaded as [C, R] tiles (C elements
per vector, rows along the lanes), and column c is picked out of one with an integer sum over
the C axis in which every term but the c-th is 0. That axis lives
in one thread's registers and the masks are constants, so after folding the pick costs nothing.
Stores assemble [C, R] tiles with constant selects the same way.

A quantization group is GROUP // T consecutive thread rows; its absmax is a per-thread max over
the columns, then a max across GROUP // T lanes (or warps). Hadamard blocks above T pair rows in
other lanes: one shuffle each on the GPU, masked sums across lanes in the interpreter.

**Bit-exactness with the reference** (`lightning_sdp4bit.reference`), on finite input:
- the Hadamard transform runs the reference's butterfly stages in its order, then one
  multiplication by the same fp32 constant;
- scales are IEEE quotients (`tl.math.div_rn`), and nearest rounding divides exactly too (see
  `_divide_exactly`);
- round half to even is an addition of 1.5 * 2^23, which leaves the integer, two's complement,
  in the sum's low mantissa bits (exact for |v| < 2^22; |v| <= qmax here): no float -> int
  conversion, which runs at a fraction of the FP32 rate;
- kernels are launched with `enable_fp_fusion=False`, so code * scale and a following add round
  twice, as in PyTorch, instead of being contracted into one FMA;
- fp32 -> bf16 rounding is the GPU's cast, written out in integer ops for the interpreter
  (see `round_to_bf16`).
"""

import os

try:
    import triton
    import triton.language as tl
except ImportError as error:  # lightning_sdp4bit.ops.kernels_available() turns this into False
    raise ImportError("lightning_sdp4bit.kernels needs Triton (pip install triton)") from error

__all__ = [
    "INTERPRETING",
    "dequantize_columns",
    "hadamard_columns",
    "load_columns",
    "load_per_row",
    "pack_columns",
    "quantize_columns",
    "round_to_bf16",
    "scale_columns",
    "store_columns",
    "store_rows_coalesced",
    "tl",
    "triton",
]

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether Triton runs the kernels in its CPU interpreter, as CI does. Triton reads the variable
when a kernel is defined, i.e. when this package is imported, so this reads it then too."""

_INTERPRETING = tl.constexpr(INTERPRETING)
_ROUNDING_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23; its bit pattern is 0x4B400000


# ------------------------------------------------------------------------------------------------
# Moving columns


@triton.jit
def _pick(tile, lane, c: tl.constexpr):
    """Row c of an integer tile [C, R] as [R]: a sum whose other terms are 0 (see module doc)."""
    return tl.sum(tl.where(lane == c, tile, 0), axis=0)


@triton.jit
def load_columns(ptr, row_start, live, T: tl.constexpr):
    """T columns [R] of the rows at ptr + row_start[r] (int64 [R]); 0 where live is False.

    Floating-point data comes back as fp32, integer data in its own dtype. (Floats are picked
    as their int32 bit patterns: some Triton versions start a float sum from +0.0, which costs an
    addition and would turn -0.0 into +0.0.)
    """
    C: tl.constexpr = min(T, 128 // ptr.dtype.element_ty.primitive_bitwidth)
    lane = tl.arange(0, C)[:, None]
    columns = ()
    for vector in tl.static_range(T // C):
        tile = tl.load(ptr + row_start[None, :] + (vector * C) + lane, mask=live[None, :], other=0)
        if tile.dtype.is_floating():
            tile = tile.to(tl.float32).to(tl.int32, bitcast=True)
            for c in tl.static_range(C):
                columns = columns + (_pick(tile, lane, c).to(tl.float32, bitcast=True),)
        else:
            for c in tl.static_range(C):
                columns = columns + (_pick(tile, lane, c),)
    return columns


@triton.jit
def scale_columns(x, factor, T: tl.constexpr):
    """Each of the T columns [R] times a run-time fp32 factor (one rounding per element)."""
    y = ()
    for i in tl.static_range(T):
        y = y + (x[i] * factor,)
    return y


@triton.jit
def _stack(columns, first: tl.constexpr, C: tl.constexpr):
    """Columns first .. first + C - 1 as a tile [C, R], by constant selects that fold away."""
    lane = tl.arange(0, C)[:, None]
    tile = columns[first + C - 1][None, :]
    for c in tl.static_range(C - 1):
        tile = tl.where(lane == c, columns[first + c][None, :], tile)
    return tile


@triton.jit
def store_columns(ptr, row_start, live, columns, T: tl.constexpr):
    """Store T columns [R] as rows at ptr + row_start[r] where live, cast to ptr's dtype."""
    C: tl.constexpr = min(T, 128 // ptr.dtype.element_ty.primitive_bitwidth)
    lane = tl.arange(0, C)[:, None]
    for vector in tl.static_range(T // C):
        tile = _cast(_stack(columns, vector * C, C), ptr.dtype.element_ty)
        tl.store(ptr + row_start[None, :] + (vector * C) + lane, tile, mask=live[None, :])


@triton.jit
def store_rows_coalesced(ptr, rows, live, columns, T: tl.constexpr):
    """Store T columns [R] as the contiguous rows ptr[rows[r] * T : (rows[r] + 1) * T] where live.

    Built as one [R, T] tile, which Triton stores in its own coalesced layout (through shared
    memory): a warp then writes whole sectors, where 16-byte pieces of rows 128 bytes apart
    (`store_columns` of fp32 rows) made the L2 take every sector in two halves.
    """
    offsets = rows.to(tl.int64)[:, None] * T + tl.arange(0, T)[None, :]
    tl.store(ptr + offsets, _cast(tl.trans(_stack(columns, 0, T)), ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def load_per_row(ptr, offsets, live):
    """One value per thread row, [R], from ptr + offsets[r] (0 where not live)."""
    return tl.load(ptr + offsets, mask=live, other=0)


@triton.jit
def per_row(per_group, R: tl.constexpr, RPG: tl.constexpr):
    """[R // RPG] -> [R]: each group's value for each of its RPG thread rows."""
    return tl.reshape(tl.broadcast_to(per_group[:, None], [R // RPG, RPG]), [R])


# ------------------------------------------------------------------------------------------------
# Hadamard


@triton.jit
def _butterfly_across_rows(column, R: tl.constexpr, M: tl.constexpr):
    """One butterfly stage between thread rows M apart, pairs in 2M-row blocks: (a, b) -> (a + b, a - b)."""
    if _INTERPRETING:
        pairs = tl.reshape(column.to(tl.int32, bitcast=True), [R // (2 * M), 2, M])
        side = tl.arange(0, 2)[None, :, None]
        # Each side's value reaches both rows of a pair by an integer sum with 0 (exact, -0.0 too).
        a = tl.sum(tl.where(side == 0, pairs, 0), axis=1)[:, None, :].to(tl.float32, bitcast=True)
        b = tl.sum(tl.where(side == 1, pairs, 0), axis=1)[:, None, :].to(tl.float32, bitcast=True)
        return tl.reshape(tl.where(side == 0, a + b, a - b), [R])
    # Thread row r is in lane r % 32 (the tile convention), so its partner r ^ M (M < 32) is in
    # lane ^ M: one shuffle, where the masked sums cost two shuffles and four selects. Then
    # a + b = fma(a, 1, b) and a - b = fma(b, -1, a), each rounded once, as the sum itself.
    tl.static_assert(M < 32, "Hadamard partners must be in one warp")
    rows = tl.arange(0, R)
    sign = tl.where((rows & M) == 0, 1.0, -1.0)
    partner = tl.inline_asm_elementwise(
        "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;",
        "=r,r,r",
        [column, tl.full([R], M, tl.int32)],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )
    return tl.fma(column, sign, partner)


@triton.jit
def hadamard_columns(x, R: tl.constexpr, T: tl.constexpr, LOG2_H: tl.constexpr, SCALE: tl.constexpr):
    """The reference `blockwise_hadamard` in blocks of H = 2^LOG2_H, on columns x (T of [R]).

    Stage h = 1, 2, ..., H/2 replaces each pair (y[i], y[i + h]) of a 2h-block by (a + b, a - b);
    then everything is multiplied by SCALE = 1/sqrt(H) (1.0: left to the caller). Stages with h < T
    pair two columns of one thread; larger ones pair the same column of rows h / T apart.
    """
    for stage in tl.static_range(LOG2_H):
        y = ()
        for i in tl.static_range(T):
            if (1 << stage) >= T:
                y = y + (_butterfly_across_rows(x[i], R, (1 << stage) // T),)
            elif (i >> stage) % 2 == 0:
                y = y + (x[i] + x[i + (1 << stage)],)
            else:
                y = y + (x[i - (1 << stage)] - x[i],)
        x = y
    if SCALE != 1.0:
        y = ()
        for i in tl.static_range(T):
            y = y + (x[i] * SCALE,)
        x = y
    return x


# ------------------------------------------------------------------------------------------------
# Quantization


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32; NaN stays NaN.

    On the GPU that is the cast itself (cvt.rn.bf16.f32, what torch's .to(torch.bfloat16) does).
    Triton's interpreter truncates such casts, so there it is written out in integer ops.
    """
    if _INTERPRETING:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 x to dtype, rounding to nearest even in the interpreter too (see `round_to_bf16`)."""
    if dtype == tl.bfloat16:
        x = round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def _hash32(x, key):
    """A keyed 32-bit integer hash (two multiply-xorshift rounds, the key mixed in before each);
    uint32 [R] -> uint32 [R] whose bits pass for independent uniform ones."""
    x = x ^ key
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ key ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _centred_noise(seed, row_first, T: tl.constexpr):
    """u - 1/2 for u ~ U(0, 1), fp32, as T columns: element t of row r is flat index row_first[r] + t.

    One 32-bit hash of (seed, index // 2) serves two elements, 16 bits each, so the noise depends
    on (seed, index) only, not on the tiling. A 16-bit k becomes the float 1 + k / 2^16 by bit
    operations (no int -> float conversion), and u = (k + 1/2) / 2^16: E[u] = 1/2 exactly, and
    floor(v + u) is biased by at most 2^-17 of a quantization step.
    """
    key = _hash32(seed.to(tl.uint32), 0x2545F491)  # seed: a run-time int (do_not_specialize)
    pair = (row_first // 2).to(tl.uint32)
    noise = ()
    for i in tl.static_range(T // 2):
        bits = _hash32(pair + i, key)
        low = (((bits << 7) & 0x007FFF80) | 0x3F800000).to(tl.float32, bitcast=True)
        high = (((bits >> 9) & 0x007FFF80) | 0x3F800000).to(tl.float32, bitcast=True)
        noise = noise + (low - (1.5 - 1.0 / 131072.0), high - (1.5 - 1.0 / 131072.0))
    return noise


@triton.jit
def _divide_exactly(x, divisor):
    """x / divisor rounded like IEEE division (torch's), for the |x| <= 128 * divisor that matter.

    tl.math.div_rn costs ~10 instructions and a branch per element. Instead both sides are
    scaled by the power of two p that brings the divisor into [1, 2) (into [2^-23, 4) at the
    ends of the fp32 range; exact either way), y = RN(1/dp) is
    computed once, and q = xp * y with two Newton steps q += (xp - dp * q) * y gives RN(xp / dp)
    = RN(x / d): after the first step q is within an ulp, and then, by Markstein's theorem, the
    residual is exact and the second step rounds correctly. Where xp is so small that it loses
    bits, x / d is far below 1/2 and rounds to 0 either way.
    """
    exponent = (divisor.to(tl.int32, bitcast=True) >> 23) & 0xFF
    power = ((254 - tl.minimum(tl.maximum(exponent, 1), 253)) << 23).to(tl.float32, bitcast=True)
    d = divisor * power
    y = tl.math.div_rn(1.0, d)
    xp = x * power
    q = xp * y
    q = tl.fma(tl.fma(-d, q, xp), y, q)
    return tl.fma(tl.fma(-d, q, xp), y, q)


@triton.jit
def quantize_columns(
    x,
    seed,
    row_first,
    R: tl.constexpr,
    T: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PRESCALE: tl.constexpr = 1.0,
):
    """Quantize the columns x * PRESCALE (x: T fp32 [R]) group-wise: (codes, scales fp32 [R * T // GROUP]).

    The reference `quantize_groups`: scale = absmax / qmax, code = round(x / scale) clamped to
    +-qmax, with round half to even or, stochastic, floor(x / scale + u), u drawn for the flat
    indices row_first[r] + t (int64 [R]). A code comes back as int32 columns whose low BITS bits
    are its two's complement (all that `pack_columns` keeps).

    PRESCALE (a Hadamard transform's 1/sqrt(H)) is applied per element with nearest rounding,
    where the products must be the reference's; with stochastic rounding it goes into the
    group's absmax, which gives the same scale bit for bit (rounding is monotonic), and into the
    reciprocal, one multiplication per group instead of one per element.
    """
    if not STOCHASTIC and PRESCALE != 1.0:
        scaled = ()
        for i in tl.static_range(T):
            scaled = scaled + (x[i] * PRESCALE,)
        x = scaled
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    RPG: tl.constexpr = GROUP // T
    # NaN-propagating maxima (tl.max drops NaN), so that a group holding NaN gets a NaN scale.
    magnitude = tl.abs(x[0])
    for i in tl.static_range(1, T):
        magnitude = tl.maximum(magnitude, tl.abs(x[i]), propagate_nan=tl.PropagateNan.ALL)
    if RPG > 1:
        # Across the group's rows, as int32 bit patterns: they order like non-negative floats,
        # and NaN patterns sort above inf.
        patterns = tl.reshape(magnitude.to(tl.int32, bitcast=True), [R // RPG, RPG])
        absmax = tl.max(patterns, axis=1).to(tl.float32, bitcast=True)
    else:
        absmax = magnitude
    if STOCHASTIC and PRESCALE != 1.0:
        absmax = absmax * PRESCALE
    scales = tl.math.div_rn(absmax, QMAX)
    safe = tl.where(scales > 0, scales, 1.0)
    codes = ()
    if STOCHASTIC:
        # Only the noise's statistics are specified, so the exact division becomes a multiply by
        # the reciprocal (within an ulp), fused with adding u - 1/2: floor(v + u) is computed as
        # round(v + u - 1/2), the same level except at ties, a bias below the noise's resolution.
        reciprocal = tl.math.div_rn(1.0, safe)
        if PRESCALE != 1.0:
            reciprocal = reciprocal * PRESCALE
        reciprocal = per_row(reciprocal, R, RPG)
        noise = _centred_noise(seed, row_first, T)
        for i in tl.static_range(T):
            v = tl.minimum(tl.maximum(tl.fma(x[i], reciprocal, noise[i]), -QMAX), QMAX)
            codes = codes + ((v + _ROUNDING_MAGIC).to(tl.int32, bitcast=True),)
    else:
        divisor = per_row(safe, R, RPG)
        for i in tl.static_range(T):
            # Clamping before rounding gives the same integer (qmax is one).
            v = tl.minimum(tl.maximum(_divide_exactly(x[i], divisor), -QMAX), QMAX)
            codes = codes + ((v + _ROUNDING_MAGIC).to(tl.int32, bitcast=True),)
    return codes, scales


@triton.jit
def pack_columns(codes, T: tl.constexpr, BITS: tl.constexpr):
    """T code columns -> T * BITS // 32 int32 word columns, laid out as reference `pack_codes`:
    BITS-bit two's complement fields, element k of a word in bits [BITS*k, BITS*(k+1)), so the
    words' little-endian bytes are the reference's bytes."""
    K: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    words = ()
    for w in tl.static_range(T // K):
        word = codes[w * K] & MASK
        for k in tl.static_range(1, K):
            field = codes[w * K + k]
            if k < K - 1:  # the last field's excess bits are shifted out
                field = field & MASK
            word = word + (field << (BITS * k))  # disjoint fields: + is |, and fuses with the shift
        words = words + (word,)
    return words


@triton.jit
def _mask_or(x, mask, pattern):
    """(x & mask) | pattern, uint32, in one instruction.

    Written plainly, the compiler emits two LOP3s, because one LOP3 takes only one immediate.
    PTX's lop3 with both constants in registers lets ptxas keep one of them in a register for
    the whole kernel: grad_decode_sum then runs 928 instructions per thread row instead of 1040,
    91-95% -> 94-95% of the copy bandwidth on the H200. (Triton's interpreter cannot run PTX.)
    """
    if _INTERPRETING:
        return (x & mask) | pattern
    m = tl.full(x.shape, mask, tl.uint32)
    p = tl.full(x.shape, pattern, tl.uint32)
    return tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [x, m, p], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def dequantize_columns(words, scale, T: tl.constexpr, BITS: tl.constexpr):
    """Word columns (T * BITS // 32 int32 [R]) and the rows' scales [R] -> T fp32 columns code * scale.

    A field with its sign bit flipped holds u = code + 2^(BITS-1) as an unsigned number. Left
    where it is, at bit p, and ORed with the exponent of 2^(23-p), its bits are the float
    2^(23-p) + u; subtracting 2^(23-p) + 2^(BITS-1) leaves the code exactly. A field needs only
    a mask and an OR that way, no shift and no int -> float conversion (reference
    `unpack_codes`), as long as p + BITS <= 23. The word's top field is shifted down to p = 0
    instead, and the others above bit 23 are shifted down by 12, once per word. The two middle
    bytes of 8-bit words go to the conversion unit (see below).
    """
    K: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    SIGNS: tl.constexpr = 0x80808080 if BITS == 8 else (0x88888888 if BITS == 4 else 0xAAAAAAAA)
    values = ()
    for w in tl.static_range(T // K):
        biased = words[w].to(tl.uint32, bitcast=True) ^ SIGNS
        high = biased >> 12
        for k in tl.static_range(K):
            if BITS == 8 and (k == 1 or k == 2):
                # The middle bytes take the conversion unit instead (one I2F.S8 with a byte
                # selector each, a pipe otherwise idle): the integer and FP32 pipes are what
                # limit grad_requantize, which unpacks 8 peers (76% -> 85% of the copy
                # bandwidth at 1 GiB on the H200).
                values = values + (((words[w] << (24 - 8 * k)) >> 24).to(tl.float32) * scale,)
            else:
                if k == K - 1:  # p = 0 after the shift, which leaves nothing above the field
                    field = (biased >> (32 - BITS)) | (150 << 23)
                    code = field.to(tl.float32, bitcast=True) - (2.0**23 + (1 << (BITS - 1)))
                elif BITS * k + BITS <= 23:  # p = BITS * k
                    field = _mask_or(biased, MASK << (BITS * k), (150 - BITS * k) << 23)
                    code = field.to(tl.float32, bitcast=True) - (2.0 ** (23 - BITS * k) + (1 << (BITS - 1)))
                else:  # p = BITS * k - 12, in `high`
                    field = _mask_or(high, MASK << (BITS * k - 12), (162 - BITS * k) << 23)
                    code = field.to(tl.float32, bitcast=True) - (2.0 ** (35 - BITS * k) + (1 << (BITS - 1)))
                values = values + (code * scale,)
    return values
