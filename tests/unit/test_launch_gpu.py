"""kernels._launch on a GPU (skipped elsewhere), against Triton itself.

- Every launch the five ops make, over 16-byte-aligned and 4-byte-aligned payloads, sizes whose
  counts are 1, multiples of 16 and neither, i32 and i64 seeds, both rounding modes, gathered
  weight rows in rank order and local-major (1, 2 and 4 nodes of 8 ranks) and the apply with and
  without an applied shard (of ranks 0, 1 and 3, which Triton must not specialize): the compiled
  kernel `launch` ran is the one Triton's own path picks for the same arguments (its warmup
  run, which compiles or looks up without launching). A signature coarser than Triton's
  specialization would fail here.
- After the first call of a signature, calls skip Triton's path (JITFunction.run is not
  entered), and give the bytes Triton's path gave.
- With a launch hook set (a profiler), every launch takes Triton's path and the hook sees it.
"""

import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: compiled Triton kernels need CUDA")

triton = pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

from lightning_sdp4bit import kernels  # noqa: E402
from lightning_sdp4bit.kernels import _launch  # noqa: E402


def _offset(payload, nbytes):
    """The same bytes `nbytes` into a fresh buffer (16-byte aligned at 0, 4-byte at 4)."""
    buffer = torch.zeros(payload.numel() + 16, dtype=torch.uint8, device=payload.device)
    moved = buffer[nbytes : nbytes + payload.numel()].view(payload.shape)
    moved.copy_(payload)
    return moved


def _every_op(numel, offset, seed, rounding, nodes=2):
    """One call of each op on a bucket of 8 x numel (2 nodes x 4 for the gradients, `nodes` nodes
    of the gathered weight rows' local-major layout), every payload `offset` bytes into its buffer;
    returns their outputs. With the payloads 4 bytes in, the apply also stores rank nodes - 1's
    shard into an applied shard."""
    generator = torch.Generator(device="cuda").manual_seed(numel)
    master = torch.randn(numel, device="cuda", generator=generator)
    weights = (master + 0.01).bfloat16()
    payload = _offset(kernels.weight_update_encode(master, weights, 4, 128, rounding, seed), offset)
    full = torch.randn(8 * numel, device="cuda", generator=generator).bfloat16()
    applied = torch.empty(numel, device="cuda", dtype=torch.bfloat16) if offset else None
    kernels.weight_update_apply(_offset(payload.repeat(8, 1), offset), full, 4, 128, True, nodes, applied, nodes - 1)
    grad = torch.randn(8 * numel, device="cuda", generator=generator)
    intra = _offset(kernels.grad_encode(grad, 2, 4, 32, 8, 128, rounding, seed, 0.125), offset)
    inter = _offset(kernels.grad_requantize(intra, 8, 4, 128, 2, rounding, seed), offset)
    shard = torch.empty(numel, device="cuda")
    kernels.grad_decode_sum(inter, 4, 128, 32, shard)
    return payload, full, intra, inter, shard


# Sizes whose thread-row counts are 1, multiples of 16 and neither; i32 and i64 seeds; weight rows
# in rank order (1 node: the kernel gets L = 1, which Triton compiles as a constant) or not; an
# applied shard of rank nodes - 1 (0, 1 or 3) with the payloads 4 bytes in.
CASES = [
    (numel, offset, seed, rounding, nodes)
    for numel, nodes in ((128, 1), (1536, 2), (4096, 4))
    for offset in (0, 4)
    for seed, rounding in ((3, "nearest"), (3, "stochastic"), (2**40, "stochastic"))
]


def test_the_kernel_launched_is_the_one_triton_picks(monkeypatch):
    launched = []
    fast = _launch.launch

    def recording(kernel, grid, *args, **kwargs):
        fast(kernel, grid, *args, **kwargs)
        launched.append((kernel, grid, args, kwargs))

    monkeypatch.setattr(_launch, "launch", recording)
    for name in ("weight_update", "grad_encode", "grad_reduce"):  # the modules, not the functions
        monkeypatch.setattr(importlib.import_module(f"lightning_sdp4bit.kernels.{name}"), "launch", recording)
    for case in CASES * 2:  # the second pass runs on the compiled kernels kept by the first
        _every_op(*case)
    device = torch.cuda.current_device()
    assert len(launched) == 5 * 2 * len(CASES)
    for kernel, grid, args, kwargs in launched:
        key = (kernel, device, _launch._signature(kernel, args, kwargs))
        assert _launch._compiled[key] is kernel.run(*args, grid=grid, warmup=True, **kwargs)


def test_later_calls_skip_tritons_path_and_give_the_same_bytes(monkeypatch):
    entered = []
    run = JITFunction.run

    def counting(self, *args, **kwargs):
        entered.append(self)
        return run(self, *args, **kwargs)

    case = (2048, 0, 5, "nearest")
    _launch._compiled.clear()
    monkeypatch.setattr(JITFunction, "run", counting)
    first = _every_op(*case)
    assert len(entered) == 5
    for _ in range(3):
        again = _every_op(*case)
    assert len(entered) == 5
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_launch_hook_sees_every_launch():
    seen = []
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(seen.append)
    try:
        for _ in range(3):
            _every_op(512, 0, 1, "nearest")
    finally:
        hook.remove(seen.append)
    assert len(seen) == 15
