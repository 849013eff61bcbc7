"""How much each SDP4Bit quantizer costs on the wire, and what it does to a gradient.

    python examples/quantization_error.py

Takes a heavy-tailed stand-in for a gradient (Student-t, 3 degrees of freedom: a few large
values set the absmax of their groups, as in real gradients) and prints, for each quantizer the
paper uses, the bits per element on the wire and the signal-to-quantization-noise ratio, with
and without the Hadamard rotation that TLq-HS applies before quantizing.
"""

import torch

from lightning_sdp4bit import dequantize, quantize
from lightning_sdp4bit.reference import blockwise_hadamard, inverse_blockwise_hadamard


def sqnr_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(10 * torch.log10(exact.pow(2).sum() / (approx - exact).pow(2).sum()))


def main() -> None:
    torch.manual_seed(0)
    gradient = torch.distributions.StudentT(3.0).sample((1 << 20,))
    print(f"{'quantizer':<34} {'bits/elem':>9} {'SQNR dB':>8} {'+Hadamard-32':>13}")
    for name, bits, group_size in [
        ("8 bit, group 128 (TLq intra-node)", 8, 128),
        ("4 bit, group 128 (TLq inter-node)", 4, 128),
        ("4 bit, group 2048 (qWD's quantizer)", 4, 2048),
        ("2 bit, group 128", 2, 128),
    ]:
        q = quantize(gradient, bits=bits, group_size=group_size, rounding="stochastic", seed=0)
        plain = sqnr_db(dequantize(q), gradient)
        rotated = quantize(blockwise_hadamard(gradient, 32), bits, group_size, "stochastic", seed=0)
        smoothed = sqnr_db(inverse_blockwise_hadamard(dequantize(rotated), 32), gradient)
        print(f"{name:<34} {q.bits_per_element:>9.3f} {plain:>8.2f} {smoothed:>13.2f}")
    print("bf16 costs 16 bits per element and fp32 32; higher SQNR is better.")


if __name__ == "__main__":
    main()
