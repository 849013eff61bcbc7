"""What the five compression kernels share besides their jit helpers (those are in `_columns`):
the launch settings, the argument checks and the payload views (the weight-edit check uses the
argument checks and `eager`).
"""

import functools

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding
from lightning_sdp4bit.reference.hadamard import hadamard_scale
from lightning_sdp4bit.reference.ops import payload_row_bytes

from ._columns import INTERPRETING

__all__ = [
    "INTERPRETING",
    "LaunchConfig",
    "MAX_GRID_Y",
    "SPLIT_THREAD_ROW",
    "check_disjoint",
    "check_group_and_hadamard",
    "check_payload",
    "check_rounding",
    "check_scale",
    "check_seed",
    "check_tensor",
    "eager",
    "hadamard_constants",
    "row_length",
    "word_views",
]

# ------------------------------------------------------------------------------------------------
# Launch settings: fixed, no autotuning (see benchmarks/results/kernels_h200_*.md).

THREAD_ROW = 32
"""T, elements per thread row, unless a launcher chooses otherwise: 128 bytes of fp32 = 8 vector
loads in flight per thread, and a whole word of codes at every width (32 / bits <= 16 codes)."""

SPLIT_THREAD_ROW = 16
"""T for the two kernels that read fp32 rows (grad_encode, weight_update_encode), with two
thread rows per thread. A warp's 16-byte loads of 128-byte rows touch 32 cache lines per
instruction, and the L1's lookups of them (ncu: 82% of their peak for grad_encode) held those
kernels to 82-87% of the copy bandwidth. Rows of 64 bytes, two lanes to a line, halve the
lookups: 92-98% and 96-102% from 256 MiB on the H200 (benchmarks/results/kernels_h200_*.md).
Still a whole word of codes at every width (16 * 2 bits = 32)."""

NUM_WARPS = 2
"""Warps per program (at least), unless a launcher asks for fewer: 64 threads own R = 64 thread
rows, 2048 elements."""

MIN_GROUP_SIZE = 32
"""One thread row of THREAD_ROW: smaller groups would split a row's codes between scales."""

MAX_GROUP_SIZE = 16384
"""One group must fit in one program: 16384 / 32 = 512 thread rows, 16 warps."""

MAX_HADAMARD_SIZE = 256
"""Blocks above T pair thread rows in other lanes; 256 = 16 rows of 16 elements."""

MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension, which counts shards (grad_encode) or output rows
(grad_requantize)."""


class LaunchConfig:
    """T (elements per thread row), R (thread rows per program), warps and registers for one call.

    A program has at least min_warps warps, and more where a group needs them: a group must
    stay in one program. max_registers becomes ptxas's register limit (Triton's `maxnreg`).
    Without one, ptxas may keep the count low by making a load wait until the data of an earlier
    one has been used, which costs a memory round trip. With a limit, it spends registers up to
    it on loads in flight. Only weight_update_encode sets one, measured on the H200 (see its
    launcher).
    """

    def __init__(
        self,
        group_size: int,
        thread_row: int = THREAD_ROW,
        rows_per_thread: int = 1,
        max_registers: int | None = None,
        min_warps: int = NUM_WARPS,
    ) -> None:
        self.thread_row = thread_row
        self.num_warps = max(min_warps, group_size // thread_row // (32 * rows_per_thread))
        self.rows = 32 * self.num_warps * rows_per_thread
        self.max_registers = max_registers

    def grid(self, thread_rows: int) -> tuple[int]:
        # Ceiling division in Python: triton.cdiv is a ConstexprFunction, 1.9 us a call on the host.
        return (-(-thread_rows // self.rows),)

    def options(self) -> dict:
        """The launch's compile options. FMA contraction stays off: see `_columns` on bit-exactness."""
        return {"num_warps": self.num_warps, "enable_fp_fusion": False, "maxnreg": self.max_registers}


def eager(op, launch):
    """What a public wrapper calls: the custom op `op` while torch.compile traces (it sees the op
    and its fake), the launcher `launch` itself otherwise. The op's dispatch (schema parsing,
    the dispatcher's Python fallback) costs host time on every call; in eager mode the engine
    calls three to five of these per bucket and step, and on a GPU that host time turns into
    idle time of the compute stream (benchmarks/results/launch_overhead_h200_*.md)."""
    return op if torch.compiler.is_compiling() else launch


# ------------------------------------------------------------------------------------------------
# Argument checks: each raises a ValueError that names the offending parameter.


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


def check_scale(scale: float) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


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


def check_disjoint(name: str, tensor: Tensor, other_name: str, other: Tensor) -> None:
    """Raise unless the contiguous `tensor` and `other` share no byte: a kernel that stores into
    both would otherwise leave whichever store came last, in no defined order.

    Called inside the custom ops, as `word_views` (torch.compile's fake tensors have no address).
    """
    start, other_start = tensor.data_ptr(), other.data_ptr()
    if start < other_start + other.nbytes and other_start < start + tensor.nbytes:
        raise ValueError(f"{name} must not overlap {other_name} in memory: the op stores into both")


def word_views(name: str, payload: Tensor) -> tuple[Tensor, Tensor]:
    """The payload as int32 words (for the codes) and as fp32 (for the scales), in place.

    Called inside the custom ops (not traced by torch.compile, which cannot see storage offsets).
    """
    if payload.storage_offset() % 4:
        raise ValueError(f"{name} must start on a 4-byte boundary: its codes and fp32 scales are read as words")
    return payload.view(torch.int32), payload.view(torch.float32)


def row_length(payload: Tensor) -> tuple[int, int]:
    """A payload row's length as (count, unit): count units of `unit` words, where unit is the
    largest of 4, 2 and 1 that divides the row. Kernels take the count as an argument and the unit
    as a constexpr and multiply them, so that Triton knows every row starts aligned for 16-byte
    (or 8-byte) vector accesses, even where the length is not a multiple of 16 (the only
    divisibility Triton detects by itself)."""
    words = payload.shape[1] // 4
    unit = 4 if words % 4 == 0 else 2 if words % 2 == 0 else 1
    return words // unit, unit


@functools.cache
def hadamard_constants(hadamard_size: int) -> dict:
    """The constexpr arguments of `hadamard_columns` (LOG2_H = 0 means no transform). Cached:
    hadamard_scale rounds through a tensor (3 us a call), on every launch that takes these. The
    callers unpack the dict and never change it."""
    return {
        "LOG2_H": max(hadamard_size, 1).bit_length() - 1,
        "H_SCALE": hadamard_scale(hadamard_size) if hadamard_size > 1 else 1.0,
    }
