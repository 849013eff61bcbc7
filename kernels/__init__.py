"""Triton kernels of the five fused compression ops and of the weight-edit check, installed as
`lightning_sdp4bit.kernels`.

Each public function takes the arguments of its twin `torch_<name>` in
`lightning_sdp4bit.reference.ops` and returns the same bytes with nearest rounding (stochastic
rounding draws its own seeded noise from an integer hash, so it matches the reference in
distribution only; `absorb_weight_edits` does no rounding and equals its twin bit for bit).
"The same bytes" means those of the reference run on the CPU: its `absmax / qmax` is an IEEE
division there, while PyTorch's CUDA kernels divide by a Python number through its rounded
reciprocal, which can differ by an ulp; the kernels divide exactly.
Each is also a `torch.library` custom op (namespace `sdp4bit`) with a fake implementation, so it
composes with torch.compile. `lightning_sdp4bit.ops` routes CUDA tensors here.

| op | file | does, in one pass |
|---|---|---|
| `weight_update_encode` | weight_update.py | master - weights -> quantize -> payload |
| `weight_update_apply` | weight_update.py | payload -> dequantize -> add into the weights (and `applied`), in place |
| `grad_encode` | grad_encode.py | Hadamard -> quantize -> payload in destination order |
| `grad_encode_pieces` | grad_encode.py | the same, reading a bucket's gradients where they lie |
| `grad_requantize` | grad_reduce.py | dequantize -> sum over peers -> re-quantize |
| `grad_decode_sum` | grad_reduce.py | dequantize -> sum over peers -> inverse Hadamard -> shard |
| `absorb_weight_edits` | weight_edits.py | weights != applied -> fp32 weights into the master, only there |

Importing this package raises ImportError where Triton is missing, so that
`lightning_sdp4bit.ops.kernels_available()` is False there and the reference runs. On a machine
without a GPU, the kernels run in Triton's interpreter when TRITON_INTERPRET=1 is set before
Triton is imported (that is how CI tests them); otherwise they take CUDA tensors only.
"""

from .grad_encode import grad_encode, grad_encode_pieces
from .grad_reduce import grad_decode_sum, grad_requantize
from .weight_edits import absorb_weight_edits
from .weight_update import weight_update_apply, weight_update_encode

__all__ = [
    "absorb_weight_edits",
    "grad_decode_sum",
    "grad_encode",
    "grad_encode_pieces",
    "grad_requantize",
    "weight_update_apply",
    "weight_update_encode",
]
