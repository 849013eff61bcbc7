"""The one dispatch point between the reference ops and the Triton kernels.

The engine calls only these functions: the five compression ops (the gradient encoder also as
`grad_encode_pieces`, which reads a bucket's gradients where they lie) and the weight-edit check
(`absorb_weight_edits`). Each takes the arguments of its reference twin in
`lightning_sdp4bit.reference.ops` (see there for shapes and the payload format) and runs the
Triton kernel for CUDA tensors when Triton is importable, else the reference. Both produce the
same bytes with nearest rounding; stochastic rounding draws its noise from a different generator
on each path, so the two paths are each reproducible but not equal to each other.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import Tensor

from lightning_sdp4bit.config import Rounding, SDP4BitConfig
from lightning_sdp4bit.reference import ops as reference

__all__ = [
    "absorb_weight_edits",
    "check_kernel_limits",
    "grad_decode_sum",
    "grad_encode",
    "grad_encode_pieces",
    "grad_requantize",
    "kernels_available",
    "weight_update_apply",
    "weight_update_encode",
]


@functools.cache
def kernels_available() -> bool:
    """Whether the Triton kernels can be imported here (Triton installed, with a GPU backend)."""
    try:
        import lightning_sdp4bit.kernels  # noqa: F401
    except ImportError:
        return False
    return True


def check_kernel_limits(config: SDP4BitConfig, device_type: str) -> None:
    """Raise a ValueError naming the field when `config` asks for more than the kernels that
    would run on `device_type` support (the reference supports any power-of-two size; the
    kernels need groups of 32 or more and Hadamard blocks of at most 256)."""
    if device_type != "cuda" or not kernels_available():
        return
    from lightning_sdp4bit.kernels._common import MAX_GROUP_SIZE, MAX_HADAMARD_SIZE, MIN_GROUP_SIZE

    sizes = []
    if config.compresses_weights:
        sizes.append(("weight_group_size", config.weight_group_size))
    if config.compresses_grads:
        sizes.append(("grad_group_size", config.grad_group_size))
        if config.hadamard_size > MAX_HADAMARD_SIZE:
            raise ValueError(
                f"hadamard_size must be at most {MAX_HADAMARD_SIZE} for the CUDA kernels, got {config.hadamard_size}"
            )
    for name, value in sizes:
        if not MIN_GROUP_SIZE <= value <= MAX_GROUP_SIZE:
            raise ValueError(
                f"{name} must be from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE} for the CUDA kernels, got {value}"
            )


def _on_kernels(tensor: Tensor) -> bool:
    return tensor.is_cuda and kernels_available()


def weight_update_encode(
    master: Tensor, weights: Tensor | None, bits: int, group_size: int, rounding: Rounding, seed: int
) -> Tensor:
    """Quantize this rank's weight difference (or weights, when `weights` is None): payload [1, row]."""
    if _on_kernels(master):
        from lightning_sdp4bit.kernels import weight_update_encode as kernel

        return kernel(master, weights, bits, group_size, rounding, seed)
    return reference.torch_weight_update_encode(master, weights, bits, group_size, rounding, seed)


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
    """Dequantize the gathered payload [W, row] into the weights [W*S], in place; its rows in rank
    order (nodes = 1) or local-major [L, M] over M = `nodes` nodes, as a two-level gather lands them.
    `applied` [S], if given, receives what was stored into rank `rank`'s shard (rank order)."""
    args = (payload, weights, bits, group_size, additive, nodes, applied, rank)
    if _on_kernels(weights):
        from lightning_sdp4bit.kernels import weight_update_apply as kernel

        return kernel(*args)
    return reference.torch_weight_update_apply(*args)


def grad_encode(
    grad: Tensor,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: Rounding,
    seed: int,
    scale: float = 1.0,
) -> Tensor:
    """Gradient stage 1: scale (fp32), rotate, quantize, lay out by destination: payload [chunks, row]."""
    if _on_kernels(grad):
        from lightning_sdp4bit.kernels import grad_encode as kernel

        return kernel(grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale)
    return reference.torch_grad_encode(grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale)


def grad_encode_pieces(
    pieces: Sequence[Tensor],
    starts: Sequence[int],
    numel: int,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: Rounding,
    seed: int,
    scale: float = 1.0,
) -> Tensor:
    """`grad_encode` of a bucket given in pieces (the gradients where autograd left them; zero
    elsewhere): the kernel reads them in place where it can."""
    args = (outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale)
    if _on_kernels(pieces[0]):
        from lightning_sdp4bit.kernels import grad_encode_pieces as kernel

        return kernel(pieces, starts, numel, *args)
    return reference.torch_grad_encode_pieces(pieces, starts, numel, *args)


def grad_requantize(
    payload: Tensor, in_bits: int, out_bits: int, group_size: int, outer: int, rounding: Rounding, seed: int
) -> Tensor:
    """Gradient stage 2: dequantize + sum the peers' chunks + re-quantize: payload [outer, row]."""
    if _on_kernels(payload):
        from lightning_sdp4bit.kernels import grad_requantize as kernel

        return kernel(payload, in_bits, out_bits, group_size, outer, rounding, seed)
    return reference.torch_grad_requantize(payload, in_bits, out_bits, group_size, outer, rounding, seed)


def grad_decode_sum(payload: Tensor, bits: int, group_size: int, hadamard_size: int, out: Tensor) -> Tensor:
    """Gradient stage 3: dequantize + sum + inverse Hadamard into the fp32 gradient shard `out`."""
    if _on_kernels(payload):
        from lightning_sdp4bit.kernels import grad_decode_sum as kernel

        return kernel(payload, bits, group_size, hadamard_size, out)
    return reference.torch_grad_decode_sum(payload, bits, group_size, hadamard_size, out)


def absorb_weight_edits(weights: Tensor, applied: Tensor, master: Tensor) -> Tensor:
    """Where the weights [S] differ from what the exchange left (`applied`), their fp32 values into
    the master shard [S], in place; one pass, no host synchronisation."""
    if _on_kernels(weights):
        from lightning_sdp4bit.kernels.weight_edits import WEIGHT_DTYPES, absorb_weight_edits

        # Other weight dtypes (fp64) take the reference: the engine does not limit the module's
        # dtype where weights are not compressed, and the reference takes any.
        if weights.dtype in WEIGHT_DTYPES:
            return absorb_weight_edits(weights, applied, master)
    return reference.torch_absorb_weight_edits(weights, applied, master)
