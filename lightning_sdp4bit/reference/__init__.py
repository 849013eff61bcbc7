"""The pure-PyTorch reference of every compression transform: the executable specification.

It imports nothing from the Triton kernels and nothing from torch.distributed, so it runs
anywhere and stays readable. The kernels are tested against it, and the distributed collectives
against the simulations built from it.
"""

from lightning_sdp4bit.reference.hadamard import (
    blockwise_hadamard,
    hadamard_matrix,
    hadamard_scale,
    inverse_blockwise_hadamard,
)
from lightning_sdp4bit.reference.quantize import (
    QuantizedTensor,
    dequantize,
    dequantize_groups,
    max_level,
    pack_codes,
    quantize,
    quantize_groups,
    uniform_noise,
    unpack_codes,
)

__all__ = [
    "QuantizedTensor",
    "blockwise_hadamard",
    "dequantize",
    "dequantize_groups",
    "hadamard_matrix",
    "hadamard_scale",
    "inverse_blockwise_hadamard",
    "max_level",
    "pack_codes",
    "quantize",
    "quantize_groups",
    "uniform_noise",
    "unpack_codes",
]
