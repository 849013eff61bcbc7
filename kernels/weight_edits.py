"""Weight-edit check kernel: what was written to the model weights since the last exchange, taken
into the fp32 master shard in one pass (`WeightAccess.absorb`, once per bucket and step).

- `absorb_weight_edits`: master[i] = fp32(weights[i]) where weights[i] != applied[i]; every other
  element of master is left untouched (not even rewritten).

Twin: `torch_absorb_weight_edits` in `lightning_sdp4bit.reference.ops`, which defines the
semantics: torch's `!=`, so a NaN weight counts as an edit and -0.0 against +0.0 does not.

Bytes each moves per element of the shard: reads 2 x the weights' element size (weights and
applied shard: 4 in bf16 or fp16, 8 in fp32) and writes 4 (fp32 master) only where the two
differ; the master is never read. The compare-then-select it replaces moved 16 in bf16 (the
compare read 4 and wrote a 1-byte mask; the select read the mask, the weights and the master
and wrote the whole master).
"""

import torch
from torch import Tensor

from ._columns import tl, triton
from ._common import check_tensor, eager
from ._launch import launch

__all__ = ["absorb_weight_edits"]

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernel's; `ops` sends others to the twin

BLOCK = 2048
"""Elements per program: with NUM_WARPS warps, 16 a thread, i.e. two 16-byte loads of each bf16
shard (four of fp32) in flight per thread. A plain 1-D block: the op does no arithmetic, so the
columns layout of the quantizing kernels buys nothing here."""

NUM_WARPS = 4


@triton.jit
def _absorb_kernel(
    weights_ptr,  # fp32, bf16 or fp16 [S]
    applied_ptr,  # the weights' dtype [S]: what the last exchange left
    master_ptr,  # fp32 [S], written only where the two differ
    numel,  # S
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < numel
    # Compared in fp32, which holds every bf16 and fp16 value exactly: Triton's interpreter
    # compares bf16 by its bits (NaN == NaN, -0.0 != +0.0), which fp32 does not.
    weights = tl.load(weights_ptr + offsets, mask=live).to(tl.float32)
    applied = tl.load(applied_ptr + offsets, mask=live).to(tl.float32)
    # Triton's float `!=` is an unordered compare (fcmp une), as torch's: true where either side
    # is NaN, false for -0.0 against +0.0. The masked store leaves unedited elements unwritten.
    edited = live & (weights != applied)
    tl.store(master_ptr + offsets, weights, mask=edited)


def _absorb_weight_edits(weights: Tensor, applied: Tensor, master: Tensor) -> None:
    numel = weights.numel()
    if numel == 0:
        return  # an empty grid is not a launch
    launch(
        _absorb_kernel,
        (-(-numel // BLOCK),),  # ceiling division in Python (see LaunchConfig.grid)
        weights,
        applied,
        master,
        numel,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


_absorb_weight_edits_op = torch.library.custom_op(
    "sdp4bit::absorb_weight_edits", _absorb_weight_edits, mutates_args=("master",)
)


@_absorb_weight_edits_op.register_fake
def _(weights, applied, master):
    return None


def absorb_weight_edits(weights: Tensor, applied: Tensor, master: Tensor) -> Tensor:
    """Take the elements written to the weights since the exchange into the master shard, in place.

    weights and applied: [S], one dtype of fp32, bf16 and fp16; master: fp32 [S]. Where
    weights != applied (torch's `!=`), master = fp32(weights); elsewhere master keeps its bits
    and is not written. Returns `master`. Equals `torch_absorb_weight_edits` bit for bit. Raises
    ValueError, naming the parameter, for bad arguments.
    """
    check_tensor("weights", weights, WEIGHT_DTYPES, 1)
    check_tensor("applied", applied, WEIGHT_DTYPES, 1)
    if applied.dtype != weights.dtype or applied.shape != weights.shape or applied.device != weights.device:
        raise ValueError(
            f"applied must match weights' dtype, shape and device ({weights.dtype}, {tuple(weights.shape)}, "
            f"{weights.device}), got {applied.dtype}, {tuple(applied.shape)}, {applied.device}"
        )
    check_tensor("master", master, (torch.float32,), 1)
    if master.shape != weights.shape or master.device != weights.device:
        raise ValueError(
            f"master must match weights' shape and device ({tuple(weights.shape)}, {weights.device}), "
            f"got {tuple(master.shape)}, {master.device}"
        )
    eager(_absorb_weight_edits_op, _absorb_weight_edits)(weights, applied, master)
    return master
