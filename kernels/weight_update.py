"""Weight all-gather kernels (qWD, and qW for the ablation).

- `weight_update_encode`, the sender: master shard [S] minus model weights [S], quantized into a
  payload [1, row_bytes(S)], in one pass (the subtraction is fused into the quantizer).
- `weight_update_apply`, every receiver: the gathered payload [W, row_bytes(S)] dequantized and
  added into the model weights [W*S] in place (the addition is fused into the dequantizer). Its
  rows may be in rank order or local-major, as a two-level all-gather lands them (`nodes`), so
  that nothing has to put them in rank order first. Given `applied` [S], it also stores the
  values of rank `rank`'s shard there: the engine's applied shard, which a separate copy from the
  weights would read and write again.

Twins: `torch_weight_update_encode` and `torch_weight_update_apply` in
`lightning_sdp4bit.reference.ops`, which define the semantics and the payload format.

Bytes each moves per weight: encode reads 4 (fp32 master) + 2 (bf16 weights) and writes
bits/8 + 4/group; apply reads bits/8 + 4/group + 2 and writes 2 (bf16 weights), plus 2 per weight
of the own shard into `applied` (2/W per weight of the bucket).
"""

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, check_bits
from lightning_sdp4bit.reference.ops import payload_row_bytes

from ._columns import (
    dequantize_columns,
    load_columns,
    load_per_row,
    pack_columns,
    quantize_columns,
    round_to_bf16,
    store_columns,
    tl,
    triton,
)
from ._common import (
    SPLIT_THREAD_ROW,
    LaunchConfig,
    check_disjoint,
    check_group_and_hadamard,
    check_payload,
    check_rounding,
    check_seed,
    check_tensor,
    eager,
    row_length,
    word_views,
)
from ._launch import launch

__all__ = ["weight_update_apply", "weight_update_encode"]

_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["seed"])
def _encode_kernel(
    master_ptr,  # fp32 or bf16 [S]
    weights_ptr,  # bf16 or fp32 [S]; unused without HAS_WEIGHTS
    words_ptr,  # the payload [1, row_bytes] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    thread_rows,  # S // T
    code_words,  # S * BITS // 32: the word where the scales start
    seed,
    HAS_WEIGHTS: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    first = rows.to(tl.int64) * T  # flat index of each row's first element
    x = load_columns(master_ptr, first, live, T)
    if HAS_WEIGHTS:
        # The difference against what every rank holds: master rounded to the weights' dtype.
        weights = load_columns(weights_ptr, first, live, T)
        difference = ()
        for i in tl.static_range(T):
            if weights_ptr.dtype.element_ty == tl.bfloat16:
                difference = difference + (round_to_bf16(x[i]) - weights[i],)
            else:
                difference = difference + (x[i] - weights[i],)
        x = difference
    codes, scales = quantize_columns(x, seed, first, R, T, GROUP, BITS, STOCHASTIC)
    TW: tl.constexpr = T * BITS // 32
    store_columns(words_ptr, rows.to(tl.int64) * TW, live, pack_columns(codes, T, BITS), TW)
    groups = tl.program_id(0) * (R * T // GROUP) + tl.arange(0, R * T // GROUP)
    tl.store(scales_ptr + code_words + groups, scales, mask=groups < thread_rows // (GROUP // T))


@triton.jit(do_not_specialize=["applied_rank"])
def _apply_kernel(
    words_ptr,  # the gathered payload [W, row_bytes] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    weights_ptr,  # bf16 or fp32 [W * S], updated in place
    applied_ptr,  # the weights' dtype [S]: receives shard `applied_rank`; unused without HAS_APPLIED
    applied_rank,  # in rank order, whatever the payload's row order
    thread_rows,  # W * S // T
    shard_rows,  # S // T: thread rows per payload row
    row_units,  # row_bytes // (4 * ROW_UNIT)
    code_words,  # S * BITS // 32: the word of a row where its scales start
    ranks_per_node,  # L of the payload's local-major rows [L, M]; 1 for rank order
    nodes,  # M = W // L
    ROW_UNIT: tl.constexpr,  # words; see _common.row_length
    ADDITIVE: tl.constexpr,
    HAS_APPLIED: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    rank = rows // shard_rows  # the sender of this thread row's shard: rank m * L + l
    payload_row = ((rank % ranks_per_node) * nodes + rank // ranks_per_node).to(tl.int64)  # l * M + m
    local = rows % shard_rows
    row_words = row_units.to(tl.int64) * ROW_UNIT
    TW: tl.constexpr = T * BITS // 32
    words = load_columns(words_ptr, payload_row * row_words + local * TW, live, TW)
    scale = load_per_row(scales_ptr, payload_row * row_words + code_words + local // (GROUP // T), live)
    values = dequantize_columns(words, scale, T, BITS)
    first = rows.to(tl.int64) * T
    if ADDITIVE:
        weights = load_columns(weights_ptr, first, live, T)
        total = ()
        for i in tl.static_range(T):
            total = total + (weights[i] + values[i],)
        values = total
    store_columns(weights_ptr, first, live, values, T)
    if HAS_APPLIED:
        # The same values again where this thread row is in shard `applied_rank` (cast to the same
        # dtype, so bit for bit): a masked store per row, where a copy after the kernel would read
        # and write 2 x S bytes (bf16) in a launch of its own.
        own = live & (rank == applied_rank)
        store_columns(applied_ptr, local.to(tl.int64) * T, own, values, T)


def _weight_update_encode(
    master: Tensor, weights: Tensor | None, bits: int, group_size: int, rounding: str, seed: int
) -> Tensor:
    numel = master.numel()
    # Up to 64 registers: with its own choice, 54, ptxas made four of a thread row's twelve loads
    # wait for registers that earlier ones freed (86% -> 91% of the copy bandwidth at 1 GiB on
    # the H200; see LaunchConfig). Still so with SPLIT_THREAD_ROW: 96% -> 87% at 256 MiB without.
    config = LaunchConfig(group_size, SPLIT_THREAD_ROW, rows_per_thread=2, max_registers=64)
    payload = torch.empty(1, payload_row_bytes(numel, bits, group_size), dtype=torch.uint8, device=master.device)
    launch(
        _encode_kernel,
        config.grid(numel // config.thread_row),
        master,
        master if weights is None else weights,
        payload.view(torch.int32),
        payload.view(torch.float32),
        numel // config.thread_row,
        numel * bits // 32,
        seed,
        HAS_WEIGHTS=weights is not None,
        BITS=bits,
        GROUP=group_size,
        T=config.thread_row,
        R=config.rows,
        STOCHASTIC=rounding == Rounding.STOCHASTIC.value,
        **config.options(),
    )
    return payload


_weight_update_encode_op = torch.library.custom_op(
    "sdp4bit::weight_update_encode", _weight_update_encode, mutates_args=()
)


@_weight_update_encode_op.register_fake
def _(master, weights, bits, group_size, rounding, seed):
    return master.new_empty(1, payload_row_bytes(master.numel(), bits, group_size), dtype=torch.uint8)


def _weight_update_apply(
    payload: Tensor, weights: Tensor, applied: Tensor, bits: int, group_size: int, additive: bool, nodes: int, rank: int
) -> None:
    # Every argument is required and `applied` is always a tensor (0 elements: none), so that the
    # custom op's schema has no optional mutated argument and no defaults: torch 2.11's
    # functionalization of such an op under torch.compile indexed its arguments past the end.
    has_applied = applied.numel() > 0
    if has_applied:
        check_disjoint("applied", applied, "weights", weights)
    # It only dequantizes, so a thread row can be one 16-byte vector of weights (and at least one
    # word of codes): a warp's accesses are then contiguous, where 64-byte bf16 rows left half of
    # every sector to a later load, and the loads came late enough to miss L1 (61-66% of the
    # copy bandwidth). Four rows per thread keep four vectors in flight.
    thread_row = max(16 // weights.element_size(), 32 // bits)
    config = LaunchConfig(group_size, thread_row, rows_per_thread=4)
    ranks = payload.shape[0]
    shard = weights.numel() // ranks
    row_units, unit = row_length(payload)
    # The layout goes in as runtime integers, not constexprs, so that layouts do not each compile a
    # kernel. Triton compiles an integer argument equal to 1 as that constant, so the rank-order
    # launch (given as L = 1, for nodes = 1 as for nodes = W) folds the remap away: it is the
    # kernel as it was. Local-major, the remap costs two integer divisions per thread row (16 bytes
    # of weights), beside the row's loads. `rank` too (Triton specializes none of its values: one
    # kernel for every rank); only whether there is an `applied` is a constexpr.
    ranks_per_node = ranks // nodes if 1 < nodes < ranks else 1
    launch(
        _apply_kernel,
        config.grid(weights.numel() // config.thread_row),
        *word_views("payload", payload),
        weights,
        applied if has_applied else weights,
        rank,
        weights.numel() // config.thread_row,
        shard // config.thread_row,
        row_units,
        shard * bits // 32,
        ranks_per_node,
        ranks // ranks_per_node,
        ROW_UNIT=unit,
        ADDITIVE=additive,
        HAS_APPLIED=has_applied,
        BITS=bits,
        GROUP=group_size,
        T=config.thread_row,
        R=config.rows,
        **config.options(),
    )


_weight_update_apply_op = torch.library.custom_op(
    "sdp4bit::weight_update_apply", _weight_update_apply, mutates_args=("weights", "applied")
)


@_weight_update_apply_op.register_fake
def _(payload, weights, applied, bits, group_size, additive, nodes, rank):
    return None


def weight_update_encode(
    master: Tensor, weights: Tensor | None, bits: int, group_size: int, rounding: Rounding | str, seed: int
) -> Tensor:
    """Sender side of the weight all-gather: a payload uint8 [1, row_bytes(S)].

    With `weights` (qWD) it quantizes fp32(master rounded to weights.dtype) - fp32(weights); with
    `weights=None` (qW) fp32(master) itself. master: fp32 or bf16 [S], S a multiple of
    group_size; weights: bf16 or fp32 [S]. Equals `torch_weight_update_encode` byte for byte with
    nearest rounding. Raises ValueError, naming the parameter, for bad arguments.
    """
    check_bits("bits", bits)
    check_group_and_hadamard(group_size)
    stochastic = check_rounding(rounding)
    check_seed(seed)
    check_tensor("master", master, (torch.float32, torch.bfloat16), 1)
    if master.numel() == 0 or master.numel() % group_size:
        raise ValueError(f"master has {master.numel()} elements, not a positive multiple of group_size={group_size}")
    if weights is not None:
        check_tensor("weights", weights, _WEIGHT_DTYPES, 1)
        if weights.shape != master.shape or weights.device != master.device:
            raise ValueError(f"weights must match master's shape and device, got {tuple(weights.shape)}")
    rounding = (Rounding.STOCHASTIC if stochastic else Rounding.NEAREST).value
    return eager(_weight_update_encode_op, _weight_update_encode)(master, weights, bits, group_size, rounding, seed)


def weight_update_apply(
    payload: Tensor,
    weights: Tensor,
    bits: int,
    group_size: int,
    additive: bool,
    nodes: int = 1,
    applied: Tensor | None = None,
    rank: int = 0,
) -> Tensor:
    """Receiver side: dequantize the gathered payload [W, row_bytes(S)] into weights [W*S], in place.

    additive (qWD): weights = dtype(fp32(weights) + code * scale); otherwise (qW): weights =
    dtype(code * scale). weights: bf16 or fp32. The payload's rows are local-major [L, M] with
    M = `nodes` and L = W // nodes, as a two-level all-gather lands them: the shard of rank
    m * L + l, `weights[(m*L + l)*S:][:S]`, is payload row l * M + m. nodes = 1 (or W) is rank
    order. With `applied` ([S], the weights' dtype and device, apart from them in memory), the
    values stored into the shard of `rank` (in rank order, whatever `nodes`: `weights[rank*S:][:S]`)
    are stored there too, bit for bit. Returns `weights`. Equals `torch_weight_update_apply` bit
    for bit, so replicas stay identical. Raises ValueError, naming the parameter, for bad
    arguments (an `applied` that overlaps the weights when the op runs: see `check_disjoint`).
    """
    check_bits("bits", bits)
    check_group_and_hadamard(group_size)
    check_tensor("weights", weights, _WEIGHT_DTYPES, 1)
    numel = check_payload("payload", payload, bits, group_size)
    if weights.numel() != payload.shape[0] * numel or weights.device != payload.device:
        raise ValueError(
            f"weights must hold {payload.shape[0]} x {numel} elements (payload rows x shard) on "
            f"{payload.device}, got {weights.numel()} on {weights.device}"
        )
    if not isinstance(additive, bool):
        raise ValueError(f"additive must be True or False, got {additive!r}")
    ranks = payload.shape[0]
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or ranks % nodes:
        raise ValueError(
            f"nodes must be a positive integer that divides the payload's {ranks} rows (1 for rows in rank "
            f"order), got {nodes!r}"
        )
    if applied is not None:
        check_tensor("applied", applied, _WEIGHT_DTYPES, 1)
        if applied.dtype != weights.dtype or applied.numel() != numel or applied.device != weights.device:
            want, got = (str(t.dtype).removeprefix("torch.") for t in (weights, applied))
            raise ValueError(
                f"applied must be one shard of the weights, [{numel}] of {want} on {weights.device}, "
                f"got [{applied.numel()}] of {got} on {applied.device}"
            )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"rank must be an integer in [0, {ranks}) (one of the payload's rows), got {rank!r}")
    none = weights.new_empty(0)  # no applied shard (see _weight_update_apply)
    op = eager(_weight_update_apply_op, _weight_update_apply)
    op(payload, weights, none if applied is None else applied, bits, group_size, additive, nodes, rank)
    return weights
