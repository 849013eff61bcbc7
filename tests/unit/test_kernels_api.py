"""The Triton kernels as an API: errors, non-finite input, Hadamard accuracy, torch.compile.

Checks:
- every bad argument raises a ValueError that names the parameter (bits, in_bits, out_bits,
  group_size, hadamard_size, rounding, seed, master, weights, grad, outer, chunks, payload, out,
  additive, nodes, applied, rank);
- a group holding NaN or Inf gets a non-finite scale (the other groups stay exact), and a
  non-finite scale in a received payload stays visible in what is decoded from it;
- the inverse Hadamard transform in grad_decode_sum: its error against an fp64 reference is at
  most twice PyTorch's own fp32 error (x @ H in fp32), for blocks 32, 64, 128 and 256;
- the ops are `torch.library` custom ops with fake implementations: a function calling them
  compiles with torch.compile(fullgraph=True) and gives the same bytes as eager;
- on CUDA, `lightning_sdp4bit.ops` dispatches to these kernels.
"""

import math
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from lightning_sdp4bit import kernels  # noqa: E402
from lightning_sdp4bit import ops as dispatch  # noqa: E402
from lightning_sdp4bit.reference import hadamard_matrix  # noqa: E402
from lightning_sdp4bit.reference import ops as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _scales(payload, bits, numel):
    return payload[:, numel * bits // 8 :].contiguous().view(torch.float32)


# ------------------------------------------------------------------------------------------------
# Bad arguments

MASTER = _randn(256)
PAYLOAD8 = reference.encode_rows(_randn(2, 256), 8, 128, "nearest", 0)


def _misaligned(payload):
    """The same bytes one byte into a buffer: fp32 scales can no longer be read in place."""
    buffer = torch.empty(payload.numel() + 1, dtype=torch.uint8, device=payload.device)
    buffer[1:] = payload.view(-1)
    return buffer[1:].view(payload.shape)


def _bad_calls():
    w = MASTER.bfloat16()
    enc = kernels.weight_update_encode
    app = kernels.weight_update_apply
    genc = kernels.grad_encode
    req = kernels.grad_requantize
    dec = kernels.grad_decode_sum
    out = torch.empty(256, device=DEVICE)
    replicas, own = torch.zeros(512, device=DEVICE), torch.zeros(256, device=DEVICE)  # weights [2 x 256], a shard

    def pieces(grads, starts, numel, scale=1.0):
        return kernels.grad_encode_pieces(grads, starts, numel, 2, 2, 32, 8, 128, "nearest", 0, scale)

    return [
        ("bits", lambda: enc(MASTER, w, 3, 128, "nearest", 0)),
        ("group_size", lambda: enc(MASTER, w, 4, 48, "nearest", 0)),
        ("group_size", lambda: enc(MASTER, w, 4, 16, "nearest", 0)),
        ("rounding", lambda: enc(MASTER, w, 4, 128, "up", 0)),
        ("seed", lambda: enc(MASTER, w, 4, 128, "stochastic", -1)),
        ("master", lambda: enc(MASTER[:200], None, 4, 128, "nearest", 0)),
        ("master", lambda: enc(MASTER.half(), None, 4, 128, "nearest", 0)),
        ("weights", lambda: enc(MASTER, w[:128], 4, 128, "nearest", 0)),
        ("weights", lambda: app(PAYLOAD8, MASTER.half(), 8, 128, True)),
        ("weights", lambda: app(PAYLOAD8, MASTER[:128], 8, 128, True)),
        ("payload", lambda: app(PAYLOAD8[:, :-4], MASTER, 8, 128, True)),
        ("payload", lambda: app(PAYLOAD8.view(-1), MASTER, 8, 128, True)),
        ("payload", lambda: app(_misaligned(PAYLOAD8), torch.zeros(512, device=DEVICE), 8, 128, True)),
        ("additive", lambda: app(PAYLOAD8, torch.zeros(512, device=DEVICE), 8, 128, "yes")),
        ("nodes", lambda: app(PAYLOAD8, torch.zeros(512, device=DEVICE), 8, 128, True, 0)),
        ("nodes", lambda: app(PAYLOAD8, torch.zeros(512, device=DEVICE), 8, 128, True, -2)),
        ("nodes", lambda: app(PAYLOAD8, torch.zeros(512, device=DEVICE), 8, 128, True, 3)),  # 2 rows
        ("nodes", lambda: app(PAYLOAD8, torch.zeros(512, device=DEVICE), 8, 128, True, 2.0)),
        ("nodes", lambda: app(PAYLOAD8, torch.zeros(512, device=DEVICE), 8, 128, True, True)),
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own.bfloat16())),  # not the weights' dtype
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own[:255])),
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, replicas)),  # the whole bucket
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own.view(2, 128))),
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, torch.empty(256, device="meta"))),
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own.tolist())),
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, replicas[256:])),  # the weights' own shard
        ("applied", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, replicas[128:384])),  # straddling two
        ("rank", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own, 2)),  # 2 rows
        ("rank", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own, -1)),
        ("rank", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own, 1.0)),
        ("rank", lambda: app(PAYLOAD8, replicas, 8, 128, True, 1, own, True)),
        ("hadamard_size", lambda: genc(MASTER, 1, 2, 48, 8, 128, "nearest", 0)),
        ("hadamard_size", lambda: genc(MASTER, 1, 2, 256, 8, 128, "nearest", 0)),
        ("hadamard_size", lambda: genc(_randn(1024), 1, 2, 512, 8, 512, "nearest", 0)),
        ("grad", lambda: genc(MASTER, 3, 1, 32, 8, 128, "nearest", 0)),
        ("outer", lambda: genc(MASTER, 0, 2, 32, 8, 128, "nearest", 0)),
        ("chunks", lambda: genc(MASTER, 1, 2.0, 32, 8, 128, "nearest", 0)),
        ("scale", lambda: genc(MASTER, 1, 2, 32, 8, 128, "nearest", 0, 0.0)),
        ("scale", lambda: genc(MASTER, 1, 2, 32, 8, 128, "nearest", 0, float("nan"))),
        ("in_bits", lambda: req(PAYLOAD8, 5, 4, 128, 1, "nearest", 0)),
        ("out_bits", lambda: req(PAYLOAD8, 8, 1, 128, 1, "nearest", 0)),
        ("outer", lambda: req(PAYLOAD8, 8, 4, 128, 3, "nearest", 0)),
        ("payload", lambda: req(PAYLOAD8.float(), 8, 4, 128, 1, "nearest", 0)),
        ("out", lambda: dec(PAYLOAD8, 8, 128, 32, out[:128])),
        ("out", lambda: dec(PAYLOAD8, 8, 128, 32, out.double())),
        ("hadamard_size", lambda: dec(PAYLOAD8, 8, 128, 100, out)),
        ("numel", lambda: pieces([MASTER], [0], 256.0)),
        ("the bucket", lambda: pieces([MASTER], [0], 200)),
        ("pieces and starts", lambda: pieces([MASTER], [0, 16], 512)),
        ("starts must ascend", lambda: pieces([MASTER[:32], MASTER[:32]], [32, 48], 512)),
        ("past numel", lambda: pieces([MASTER], [384], 512)),
        ("pieces\\[1\\] must be a tensor", lambda: pieces([MASTER[:32], [0.0] * 32], [0, 32], 512)),
        ("all fp32 or all bf16", lambda: pieces([MASTER[:32], MASTER[32:64].bfloat16()], [0, 32], 512)),
        ("all fp32 or all bf16", lambda: pieces([MASTER[:32].half()], [0], 512)),
        ("scale", lambda: pieces([MASTER], [0], 512, scale=-1.0)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_raise_value_errors_naming_the_parameter(index):
    name, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=name):
        call()


# ------------------------------------------------------------------------------------------------
# Non-finite values


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns about inf - inf
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_groups_get_non_finite_scales(poison):
    master = _randn(4 * 128)
    master[130] = poison  # group 1
    payload = kernels.weight_update_encode(master, None, 4, 128, "nearest", 0)
    scales = _scales(payload, 4, master.numel()).view(-1)
    assert not torch.isfinite(scales[1])
    assert torch.isfinite(scales[[0, 2, 3]]).all()
    expected = reference.torch_weight_update_encode(master.cpu(), None, 4, 128, "nearest", 0).to(DEVICE)
    keep = torch.ones(payload.shape[1], dtype=torch.bool)
    keep[64:128] = False  # group 1's codes (64 bytes of 4-bit codes per 128 values)
    keep[256 + 4 : 256 + 8] = False  # and its scale
    assert torch.equal(payload[:, keep], expected[:, keep])

    grad_payload = kernels.grad_encode(master, 1, 2, 32, 8, 128, "nearest", 0)
    assert not torch.isfinite(_scales(grad_payload, 8, 256)[0, 1])
    stage2 = kernels.grad_requantize(grad_payload, 8, 4, 128, 1, "nearest", 0)
    assert not torch.isfinite(_scales(stage2, 4, 256)[0, 1])
    out = torch.zeros(256, device=DEVICE)
    kernels.grad_decode_sum(grad_payload, 8, 128, 32, out)
    assert not torch.isfinite(out[128:]).all() and torch.isfinite(out[:128]).all()
    weights = torch.zeros(512, dtype=torch.bfloat16, device=DEVICE)
    kernels.weight_update_apply(payload, weights, 4, 128, True)
    assert not torch.isfinite(weights[128:256]).all() and torch.isfinite(weights[:128]).all()


# ------------------------------------------------------------------------------------------------
# Hadamard accuracy


@pytest.mark.parametrize("hadamard_size", [32, 64, 128, 256])
def test_inverse_hadamard_error_is_within_twice_pytorch_fp32_error(hadamard_size):
    group_size = 256
    payload = reference.encode_rows(_randn(1, 16 * group_size, seed=3), 8, group_size, "nearest", 0)
    # The exact fp32 input of the transform: the dequantized payload (one peer, so no sum).
    x = reference.decode_rows(payload, 8, group_size, 16 * group_size).view(-1, hadamard_size)
    out = torch.empty(16 * group_size, device=DEVICE)
    kernels.grad_decode_sum(payload, 8, group_size, hadamard_size, out)
    exact = x.double() @ hadamard_matrix(hadamard_size, torch.float64, DEVICE)
    framework = x @ hadamard_matrix(hadamard_size, torch.float32, DEVICE)
    kernel_error = (out.view_as(x).double() - exact).norm() / exact.norm()
    framework_error = (framework.double() - exact).norm() / exact.norm()
    assert math.isfinite(kernel_error) and kernel_error <= 2 * framework_error + 1e-12


# ------------------------------------------------------------------------------------------------
# torch.compile and dispatch


def _pipeline(master, weights, grad):
    """Every op once, as one rank's step would call them (two nodes of two ranks, one shard each),
    and the weight apply once more on four local-major rows, storing rank 1's shard apart too."""
    update = kernels.weight_update_encode(master, weights, 4, 128, "nearest", 0)
    weights = kernels.weight_update_apply(update, weights, 4, 128, True)
    stage1 = kernels.grad_encode(grad, 2, 2, 32, 8, 128, "nearest", 0)
    in_place = kernels.grad_encode_pieces([grad[512:], grad[:512]], [0, 512], 1024, 2, 2, 32, 8, 128, "nearest", 0)
    stage2 = kernels.grad_requantize(stage1, 8, 4, 128, 2, "nearest", 0)
    shard = kernels.grad_decode_sum(stage2, 4, 128, 32, torch.empty(256, device=grad.device))
    # Rows [a, b, a, b] as 2 nodes x 2 land them: weights [a, a, b, b] (rank order would give [a, b, a, b]).
    own = torch.empty(512, device=grad.device)  # rank 1's shard: a
    replicas = torch.zeros(2048, device=grad.device)
    replicas = kernels.weight_update_apply(stage1.repeat(2, 1), replicas, 8, 128, False, 2, applied=own, rank=1)
    return update, weights, stage1, in_place, stage2, shard, replicas, own


def test_ops_are_custom_ops_that_compile_in_one_graph():
    names = ("weight_update_encode", "weight_update_apply", "grad_encode", "grad_encode_pieces", "grad_requantize")
    for name in (*names, "grad_decode_sum"):
        assert hasattr(torch.ops.sdp4bit, name)
    master, grad = _randn(256, seed=1), _randn(1024, seed=2)
    weights = (master + 0.01 * _randn(256, seed=4)).bfloat16()
    eager = _pipeline(master, weights.clone(), grad)
    torch._dynamo.reset()
    compiled = torch.compile(_pipeline, backend="aot_eager", fullgraph=True)(master, weights.clone(), grad)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    replicas, own = compiled[-2:]
    assert torch.equal(own, replicas[512:1024]) and torch.equal(own, replicas[:512])


@pytest.mark.gpu
def test_dispatch_sends_cuda_tensors_to_the_kernels(monkeypatch):
    calls = []
    original = kernels.grad_encode
    monkeypatch.setattr(kernels, "grad_encode", lambda *args: calls.append(args) or original(*args))
    grad = _randn(1024)
    payload = dispatch.grad_encode(grad, 2, 2, 32, 8, 128, "nearest", 0)
    assert calls and torch.equal(payload, original(grad, 2, 2, 32, 8, 128, "nearest", 0))


UNREADABLE = {  # pieces the kernel cannot read where they lie, and the bucket of 512 they make
    "not whole rows": ([MASTER[:40]], [0]),
    "starting mid-row": ([MASTER[:32]], [8]),
    "8 bytes into a buffer": ([MASTER[2:34]], [0]),
    "not contiguous": ([MASTER[:64].view(8, 8).t()], [0]),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_pieces_the_kernel_cannot_read_in_place_are_assembled_first_with_the_same_bytes(case, monkeypatch):
    module = sys.modules["lightning_sdp4bit.kernels.grad_encode"]  # the package's name is the function
    assembled = []
    monkeypatch.setattr(module, "assemble_pieces", lambda *a: assembled.append(a) or reference.assemble_pieces(*a))
    args = (2, 2, 32, 8, 128, "nearest", 0)
    grad = _randn(512, seed=5)
    in_place = kernels.grad_encode_pieces([grad[:256], grad[256:]], [0, 256], 512, *args)
    assert not assembled and torch.equal(in_place, kernels.grad_encode(grad, *args))
    pieces, starts = UNREADABLE[case]
    bucket = reference.assemble_pieces(pieces, starts, 512)
    assert torch.equal(kernels.grad_encode_pieces(pieces, starts, 512, *args), kernels.grad_encode(bucket, *args))
    assert len(assembled) == 1


@pytest.mark.gpu
def test_dispatch_sends_cuda_pieces_to_the_kernel(monkeypatch):
    calls = []
    original = kernels.grad_encode_pieces
    monkeypatch.setattr(kernels, "grad_encode_pieces", lambda *args: calls.append(args) or original(*args))
    grad = _randn(1024, seed=5)
    args = (2, 2, 32, 8, 128, "nearest", 0)
    payload = dispatch.grad_encode_pieces([grad[:512], grad[512:]], [0, 512], 1024, *args)
    assert len(calls) == 1 and torch.equal(payload, kernels.grad_encode(grad, *args))


def test_configs_beyond_the_kernels_are_refused_before_launch():
    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.ops import check_kernel_limits

    check_kernel_limits(SDP4BitConfig(grad_group_size=16, hadamard_size=16), "cpu")  # the reference does any size
    with pytest.raises(ValueError, match="grad_group_size must be from 32 to 16384 for the CUDA kernels, got 16"):
        check_kernel_limits(SDP4BitConfig(grad_group_size=16, hadamard_size=16), "cuda")
    with pytest.raises(ValueError, match="hadamard_size must be at most 256 for the CUDA kernels"):
        check_kernel_limits(SDP4BitConfig(grad_group_size=512, hadamard_size=512), "cuda")
    check_kernel_limits(SDP4BitConfig.preset("qwd", grad_group_size=16, hadamard_size=0), "cuda")  # grads uncompressed
