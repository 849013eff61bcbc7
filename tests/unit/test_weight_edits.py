"""The weight-edit check (`absorb_weight_edits`): the Triton kernel against its twin, bit for bit.

Checks:
- the twin's semantics are torch's `!=`: a NaN on either side (or both) is an edit, -0.0 against
  +0.0 (either way round) and equal infinities are not, and an edit takes the weight's own bits
  (fp32(-0.0) is -0.0);
- the kernel equals the twin (run on the CPU, as in test_kernels_exact.py) bit for bit in the
  fp32 master, for weights in fp32, bf16 and fp16, sizes from 1 element to several programs of
  BLOCK with a partial last one, edits at random positions (one-ulp changes and new values),
  NaN and +-inf on either side, signed zeros, and masters holding NaNs with payloads and -0.0
  where nothing was edited (where an fp16 NaN weight was taken in, both hold a NaN: torch
  defines no one NaN there, see `_masters_equal`);
- unedited master elements keep a sentinel bit pattern, and edited ones hold fp32(weights);
- every bad argument raises a ValueError that names the parameter (weights, applied, master);
- the op is a `torch.library` custom op that compiles in one graph, and `lightning_sdp4bit.ops`
  sends CPU tensors to the twin and, on CUDA, CUDA tensors to the kernel.
Runs on CUDA where there is a GPU, else in Triton's interpreter (tests/support/suite.py).
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from lightning_sdp4bit import kernels  # noqa: E402
from lightning_sdp4bit import ops as dispatch  # noqa: E402
from lightning_sdp4bit.reference import ops as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = kernels.weight_edits.BLOCK  # elements per program
NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_AS_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (weight, applied, edited?) pairs that torch's `!=` decides in the corners.
SPECIAL_PAIRS = [
    (NAN, 1.0, True),
    (1.0, NAN, True),
    (NAN, NAN, True),  # NaN != NaN
    (INF, 1.0, True),
    (-INF, 1.0, True),
    (INF, -INF, True),
    (-0.0, 1.0, True),  # taken in as -0.0
    (INF, INF, False),
    (-INF, -INF, False),
    (-0.0, 0.0, False),  # -0.0 == +0.0
    (0.0, -0.0, False),
]
# Master bit patterns that must survive where nothing was edited: NaNs with payloads, -0.0.
MASTER_PATTERNS = [0x7FC00123, 0x7FC00001, -0x00400000, -0x80000000]  # as int32: 0xFFC00000 (-NaN), -0.0


def _bits_equal(a, b):
    """Equal bit patterns (torch.equal would take -0.0 for 0.0 and refuse NaN == NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(_AS_INT[a.dtype]).cpu(), b.view(_AS_INT[b.dtype]).cpu())


def _masters_equal(out, expected, weights):
    """Masters equal bit for bit, except where an fp16 NaN weight was taken in: there both must be
    NaN. Which NaN is not defined even within torch: on the CPU its element-wise conversion gives
    0x7FFFFFFF for every fp16 NaN, its vectorized loop (as Triton's interpreter, through numpy)
    keeps the payload, quieted (0x7E00 -> 0x7FC00000). bf16 converts by a shift everywhere."""
    loose = weights.isnan().cpu() if weights.dtype == torch.float16 else torch.zeros(out.shape, dtype=torch.bool)
    out, expected = out.cpu(), expected.cpu()
    _bits_equal(out[~loose], expected[~loose])
    assert out[loose].isnan().all() and expected[loose].isnan().all()


def _spec(weights, applied, master):
    """The twin run on the CPU on copies: the executable spec."""
    return reference.torch_absorb_weight_edits(weights.cpu(), applied.cpu(), master.cpu().clone())


def _shards(numel, dtype, seed):
    """(weights, applied, master) on the CPU: about a quarter of the elements edited, half of those
    by one ulp, the special pairs at random positions, and NaN or -0.0 masters where unedited."""
    generator = torch.Generator().manual_seed(seed)
    applied = torch.randn(numel, generator=generator).to(dtype)
    weights = applied.clone()
    edits = torch.randperm(numel, generator=generator)[: max(1, numel // 4)]
    ulp, fresh = edits[: len(edits) // 2], edits[len(edits) // 2 :]
    weights.view(_AS_INT[dtype])[ulp] ^= 1  # the smallest change a weight can see
    weights[fresh] = torch.randn(len(fresh), generator=generator).to(dtype)
    places = torch.randperm(numel, generator=generator)[: len(SPECIAL_PAIRS)]
    for place, (weight, value, _) in zip(places.tolist(), SPECIAL_PAIRS):
        weights[place], applied[place] = weight, value
    master = torch.randn(numel, generator=generator)
    unedited = (weights == applied).nonzero().view(-1)  # NaN pairs are edits, so never here
    for place, pattern in zip(unedited.tolist(), MASTER_PATTERNS):
        master.view(torch.int32)[place] = pattern
    return weights, applied, master


def test_twin_follows_torch_not_equal_in_the_corners():
    weights = torch.tensor([pair[0] for pair in SPECIAL_PAIRS])
    applied = torch.tensor([pair[1] for pair in SPECIAL_PAIRS])
    edited = torch.tensor([pair[2] for pair in SPECIAL_PAIRS])
    sentinel = 0x7FC0DEAD  # a NaN with a payload: bits no conversion of a weight produces
    master = torch.full((len(SPECIAL_PAIRS),), sentinel, dtype=torch.int32).view(torch.float32)
    assert reference.torch_absorb_weight_edits(weights, applied, master) is master
    _bits_equal(master[edited], weights[edited])  # the weight's own bits, -0.0 and NaN included
    assert (master.view(torch.int32)[~edited] == sentinel).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 2, 37, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 77])
def test_kernel_matches_the_twin_bit_for_bit(numel, dtype):
    weights, applied, master = _shards(numel, dtype, seed=numel)
    expected = _spec(weights, applied, master)
    weights, applied, out = weights.to(DEVICE), applied.to(DEVICE), master.to(DEVICE, copy=True)
    assert kernels.absorb_weight_edits(weights, applied, out) is out
    _masters_equal(out, expected, weights)
    if numel > 2 * len(MASTER_PATTERNS):  # the masters' NaNs and -0.0 were really there, unedited
        kept = torch.isin(master.view(torch.int32), torch.tensor(MASTER_PATTERNS, dtype=torch.int32))
        assert kept.sum() == len(MASTER_PATTERNS)
        assert torch.equal(out.view(torch.int32).cpu()[kept], master.view(torch.int32)[kept])


@pytest.mark.parametrize("dtype", DTYPES)
def test_unedited_elements_keep_a_sentinel_and_edited_ones_take_the_weights(dtype):
    numel = 2 * BLOCK + 5
    weights, applied, _ = _shards(numel, dtype, seed=11)
    sentinel = 0x7FC0DEAD
    master = torch.full((numel,), sentinel, dtype=torch.int32, device=DEVICE).view(torch.float32)
    kernels.absorb_weight_edits(weights.to(DEVICE), applied.to(DEVICE), master)
    edited = weights != applied
    assert 0 < edited.sum() < numel
    assert (master.view(torch.int32).cpu()[~edited] == sentinel).all()
    _masters_equal(master.cpu()[edited], weights[edited].float(), weights[edited])


def test_nothing_edited_leaves_the_master_as_it_was():
    weights = torch.randn(BLOCK + 3, device=DEVICE).bfloat16()
    master = torch.randn(BLOCK + 3, device=DEVICE)
    before = master.clone()
    kernels.absorb_weight_edits(weights, weights.clone(), master)
    _bits_equal(master, before)


# ------------------------------------------------------------------------------------------------
# Bad arguments


def _bad_calls():
    w = torch.randn(64, device=DEVICE).bfloat16()
    a, m = w.clone(), torch.zeros(64, device=DEVICE)
    op = kernels.absorb_weight_edits
    return [
        ("weights", lambda: op(w.double(), a, m)),
        ("weights", lambda: op(w.view(8, 8), a, m)),
        ("weights", lambda: op(w[::2], a[:32], m[:32])),  # not contiguous
        ("weights", lambda: op(w.tolist(), a, m)),
        ("applied", lambda: op(w, a.float(), m)),  # another dtype than the weights'
        ("applied", lambda: op(w, a.int(), m)),
        ("applied", lambda: op(w, a[:63], m)),
        ("applied", lambda: op(w, a.view(8, 8), m)),
        ("applied", lambda: op(w, torch.empty(64, dtype=w.dtype, device="meta"), m)),
        ("master", lambda: op(w, a, m.bfloat16())),
        ("master", lambda: op(w, a, m[:63])),
        ("master", lambda: op(w, a, m.view(8, 8))),
        ("master", lambda: op(w[:32], a[:32], m[::2])),
        ("master", lambda: op(w, a, None)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_raise_value_errors_naming_the_parameter(index):
    name, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()


# ------------------------------------------------------------------------------------------------
# torch.compile and dispatch


def _absorb_twice(weights, applied, master):
    kernels.absorb_weight_edits(weights, applied, master)
    return kernels.absorb_weight_edits(weights * 2, applied * 2, master) + 1  # the same edits again


def test_op_is_a_custom_op_that_compiles_in_one_graph():
    assert hasattr(torch.ops.sdp4bit, "absorb_weight_edits")
    weights, applied, master = (t.to(DEVICE) for t in _shards(300, torch.bfloat16, seed=5))
    eager_master, compiled_master = master.clone(), master.clone()
    eager = _absorb_twice(weights, applied, eager_master)
    torch._dynamo.reset()
    compiled = torch.compile(_absorb_twice, backend="aot_eager", fullgraph=True)(weights, applied, compiled_master)
    _bits_equal(compiled, eager)
    _bits_equal(compiled_master, eager_master)  # the mutation reached the caller's tensor
    assert not torch.equal(eager_master.view(torch.int32), master.view(torch.int32))


def test_dispatch_sends_cpu_tensors_to_the_twin(monkeypatch):
    weights, applied, master = _shards(100, torch.bfloat16, seed=6)
    # Patched where the dispatch looks it up (lightning_sdp4bit.ops imports it from its module).
    monkeypatch.setattr(
        kernels.weight_edits, "absorb_weight_edits", lambda *args: pytest.fail("kernel called for CPU tensors")
    )
    expected = _spec(weights, applied, master)
    assert dispatch.absorb_weight_edits(weights, applied, master) is master
    _bits_equal(master, expected)


@pytest.mark.gpu
def test_dispatch_sends_cuda_tensors_to_the_kernel(monkeypatch):
    calls = []
    original = kernels.weight_edits.absorb_weight_edits
    monkeypatch.setattr(
        kernels.weight_edits, "absorb_weight_edits", lambda *args: calls.append(args) or original(*args)
    )
    weights, applied, master = (t.cuda() for t in _shards(100, torch.bfloat16, seed=7))
    expected = _spec(weights, applied, master)
    assert dispatch.absorb_weight_edits(weights, applied, master) is master
    assert calls
    _bits_equal(master, expected)
