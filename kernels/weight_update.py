"""Weight all-gather kernels (qWD, and qW for the ablation).

- `weight_update_encode`, the sender: master shard [S] minus model weights [S], quantized into a
  payload [1, row_bytes(S)], in one pass (the subtraction is fused into the quantizer).
- `weight_update_apply`, every receiver: the gathered payload [W, row_bytes(S)] dequantized and
  added into the model weights [W*S] in place (the addition is fused into the dequantizer).

Twins: `torch_weight_update_encode` and `torch_weight_update_apply` in
`lightning_sdp4bit.reference.ops`, which define the semantics and the payload format.

Bytes each moves per weight: encode reads 4 (fp32 master) + 2 (bf16 weights) and writes
bits/8 + 4/group; apply reads bits/8 + 4/group + 2 and writes 2 (bf16 weights).
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
    load_per_row,
    load_rows,
    pack_rows,
    quantize_rows,
    round_to_bf16,
    store_rows,
    tl,
    triton,
    unpack_rows,
    word_views,
)

__all__ = ["weight_update_apply", "weight_update_encode"]

_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
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
    x = load_rows(master_ptr, first, live, R, T).to(tl.float32)
    if HAS_WEIGHTS:
        # The difference against what every rank holds: master rounded to the weights' dtype.
        if weights_ptr.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16(x)
        x = x - load_rows(weights_ptr, first, live, R, T).to(tl.float32)
    codes, scales = quantize_rows(x, seed, first, R, T, GROUP, BITS, STOCHASTIC)
    TW: tl.constexpr = T * BITS // 32
    store_rows(words_ptr, rows.to(tl.int64) * TW, live, pack_rows(codes, R, T, BITS), R, TW)
    groups = tl.program_id(0) * (R * T // GROUP) + tl.arange(0, R * T // GROUP)
    tl.store(scales_ptr + code_words + groups, scales, mask=groups < thread_rows // (GROUP // T))


@triton.jit
def _apply_kernel(
    words_ptr,  # the gathered payload [W, row_bytes] viewed as int32 words
    scales_ptr,  # the same payload viewed as fp32
    weights_ptr,  # bf16 or fp32 [W * S], updated in place
    thread_rows,  # W * S // T
    shard_rows,  # S // T: thread rows per payload row
    row_words,  # row_bytes // 4
    code_words,  # S * BITS // 32: the word of a row where its scales start
    ADDITIVE: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    R: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < thread_rows
    sender = (rows // shard_rows).to(tl.int64)  # payload row = the rank that sent this shard
    local = rows % shard_rows
    TW: tl.constexpr = T * BITS // 32
    words = load_rows(words_ptr, sender * row_words + local * TW, live, R, TW)
    scale = load_per_row(scales_ptr, sender * row_words + code_words + local // (GROUP // T), live, R)
    values = unpack_rows(words, R, T, BITS) * scale
    first = rows.to(tl.int64) * T
    if ADDITIVE:
        values = load_rows(weights_ptr, first, live, R, T).to(tl.float32) + values
    if weights_ptr.dtype.element_ty == tl.bfloat16:
        values = round_to_bf16(values)
    store_rows(weights_ptr, first, live, values.to(weights_ptr.dtype.element_ty), R, T)


@torch.library.custom_op("sdp4bit::weight_update_encode", mutates_args=())
def _weight_update_encode(
    master: Tensor, weights: Tensor | None, bits: int, group_size: int, rounding: str, seed: int
) -> Tensor:
    numel = master.numel()
    config = LaunchConfig(group_size)
    payload = torch.empty(1, payload_row_bytes(numel, bits, group_size), dtype=torch.uint8, device=master.device)
    _encode_kernel[config.grid(numel // config.thread_row)](
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
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )
    return payload


@_weight_update_encode.register_fake
def _(master, weights, bits, group_size, rounding, seed):
    return master.new_empty(1, payload_row_bytes(master.numel(), bits, group_size), dtype=torch.uint8)


@torch.library.custom_op("sdp4bit::weight_update_apply", mutates_args=("weights",))
def _weight_update_apply(payload: Tensor, weights: Tensor, bits: int, group_size: int, additive: bool) -> None:
    config = LaunchConfig(group_size)
    shard = weights.numel() // payload.shape[0]
    _apply_kernel[config.grid(weights.numel() // config.thread_row)](
        *word_views("payload", payload),
        weights,
        weights.numel() // config.thread_row,
        shard // config.thread_row,
        payload.shape[1] // 4,
        shard * bits // 32,
        ADDITIVE=additive,
        BITS=bits,
        GROUP=group_size,
        T=config.thread_row,
        R=config.rows,
        num_warps=config.num_warps,
        enable_fp_fusion=False,
    )


@_weight_update_apply.register_fake
def _(payload, weights, bits, group_size, additive):
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
    return _weight_update_encode(master, weights, bits, group_size, rounding, seed)


def weight_update_apply(payload: Tensor, weights: Tensor, bits: int, group_size: int, additive: bool) -> Tensor:
    """Receiver side: dequantize the gathered payload [W, row_bytes(S)] into weights [W*S], in place.

    additive (qWD): weights = dtype(fp32(weights) + code * scale); otherwise (qW): weights =
    dtype(code * scale). weights: bf16 or fp32. Returns `weights`. Equals
    `torch_weight_update_apply` bit for bit, so replicas stay identical.
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
    _weight_update_apply(payload, weights, bits, group_size, additive)
    return weights
