"""TLq-HS's kernels at the largest bucket the accuracy study trains, against the reference.

The bucket: the 125M GPT with a 49,984-token vocabulary (benchmarks/accuracy_gpu.py --tokenizer
bpe), its second bucket, 121,872,384 elements in 144 parameters, for a job of 16 nodes x 4, the
bf16 gradients in pieces where the parameters' gradients would lie. The kernel tests run at a few
thousand elements; sizes like this one are where an index would overflow. On CUDA only: Triton's
interpreter cannot run this size (skipped elsewhere, with the reason).
- nearest rounding: the three stages (grad_encode_pieces, grad_requantize of four peers' first
  chunks, grad_decode_sum of the result's sixteen rows) give the reference's bytes and shard bit
  for bit, with and without the rotation;
- stochastic rounding: stage 1's codes, decoded, err from the exact (rotated) values as much as
  the reference's do (within 1%) and without bias (the mean error within 5 standard errors of 0).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt.model import GPT, GPTConfig  # noqa: E402

from lightning_sdp4bit.buffers import bucket_layouts  # noqa: E402
from lightning_sdp4bit.config import SDP4BitConfig  # noqa: E402
from lightning_sdp4bit.reference import blockwise_hadamard  # noqa: E402
from lightning_sdp4bit.reference import ops as reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="gpu: the kernels at 10^8 elements run on CUDA only"
)

NODES, LOCAL, VOCAB = 16, 4, 49_984
CONFIG = SDP4BitConfig.preset("tlq_hs", bucket_numel=100_000_000)  # the study's buckets


@pytest.fixture(scope="module")
def bucket():
    """(pieces bf16 on CUDA, their starts, the bucket's numel) of the study's largest bucket."""
    with torch.device("meta"):
        named = list(GPT(GPTConfig(VOCAB, 1024, 12, 12, 768)).named_parameters())
    layout = max(bucket_layouts(named, CONFIG, NODES * LOCAL), key=lambda b: b.numel)
    assert layout.numel == 121_872_384 and len(layout.slots) == 144
    generator = torch.Generator(device="cuda").manual_seed(0)
    pieces = []
    for slot in layout.slots:  # heavy-tailed, as gradients are; each its own allocation
        values = torch.randn(slot.numel, generator=generator, device="cuda")
        values *= torch.rand(slot.numel, generator=generator, device="cuda").pow(6) * 1e-3
        pieces.append(values.bfloat16())
    return pieces, [slot.start for slot in layout.slots], layout.numel


def _on_cpu(op, *args):
    """The reference on the CPU: on CUDA, PyTorch divides by a Python number through its rounded
    reciprocal, not always the IEEE quotient the kernels take (tests/unit/test_kernels_exact.py)."""
    return op(*(arg.cpu() if isinstance(arg, torch.Tensor) else arg for arg in args))


@pytest.mark.parametrize("hadamard_size", [0, 32])
def test_the_three_stages_give_the_references_bytes(bucket, hadamard_size):
    from lightning_sdp4bit import kernels

    pieces, starts, numel = bucket
    encode = (NODES, LOCAL, hadamard_size, 8, 128, "nearest", 0, 1 / (NODES * LOCAL))
    sent = kernels.grad_encode_pieces(pieces, starts, numel, *encode)
    expected = _on_cpu(reference.torch_grad_encode_pieces, [p.cpu() for p in pieces], starts, numel, *encode)
    assert torch.equal(sent.cpu(), expected)
    del expected
    # Stage 2's input: the four rows of this payload stand for four peers' chunks (any rows do).
    received = torch.stack([sent[0], sent[1], sent[2], sent[3]])
    requantize = (8, 4, 128, NODES, "nearest", 0)
    sixteen = kernels.grad_requantize(received, *requantize)
    assert torch.equal(sixteen.cpu(), _on_cpu(reference.torch_grad_requantize, received, *requantize))
    shard = torch.empty(numel // (NODES * LOCAL), device="cuda")
    kernels.grad_decode_sum(sixteen, 4, 128, hadamard_size, shard)
    expected = _on_cpu(reference.torch_grad_decode_sum, sixteen, 4, 128, hadamard_size)
    assert torch.equal(shard.view(torch.int32).cpu(), expected.view(torch.int32))


@pytest.mark.parametrize("hadamard_size", [0, 32])
def test_stochastic_stage_one_errs_as_the_reference_does(bucket, hadamard_size):
    from lightning_sdp4bit import kernels

    pieces, starts, numel = bucket
    whole = reference.assemble_pieces(pieces, starts, numel).float() / (NODES * LOCAL)
    # The payload's layout: chunk c holds the bucket's [o, c, :] for every o, rotated.
    exact = whole.view(NODES, LOCAL, -1).transpose(0, 1).reshape(LOCAL, -1)
    if hadamard_size:
        exact = blockwise_hadamard(exact.reshape(-1), hadamard_size).view(LOCAL, -1)
    encode = (NODES, LOCAL, hadamard_size, 8, 128, "stochastic", 7, 1 / (NODES * LOCAL))
    errors = {}
    for name, payload in (
        ("kernel", kernels.grad_encode_pieces(pieces, starts, numel, *encode)),
        ("reference", reference.torch_grad_encode_pieces(pieces, starts, numel, *encode)),
    ):
        error = (reference.decode_rows(payload, 8, 128, exact.shape[1]) - exact).double()
        errors[name] = (error.norm() / exact.double().norm()).item()
        standard_error = error.std() / error.numel() ** 0.5
        assert error.mean().abs() < 5 * standard_error, name
    assert errors["kernel"] == pytest.approx(errors["reference"], rel=0.01)
