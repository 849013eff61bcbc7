"""kernels._launch's argument signature, on any machine: the calls it treats as one compiled
kernel must be calls Triton compiles as one (the GPU test checks that against Triton itself;
here, the rules): tensors apart by dtype and 16-byte alignment, integers by value except the
kernel's unspecialized ones (by Triton's integer type), keywords by value. In the interpreter,
`launch` always takes Triton's path."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from lightning_sdp4bit.kernels import _launch  # noqa: E402


class _Kernel:
    """A stand-in with the one attribute `_signature` reads: params, each a position and flag."""

    def __init__(self, unspecialized=()):
        self.params = [SimpleNamespace(num=i, do_not_specialize=i in unspecialized) for i in range(4)]


def test_tensors_differ_by_dtype_and_by_16_byte_alignment_not_by_address():
    kernel, buffer = _Kernel(), torch.zeros(64, dtype=torch.float32)
    assert buffer.data_ptr() % 16 == 0
    aligned, also_aligned, off_by_4 = buffer[:8], buffer[4:12], buffer[1:9]

    def signature(tensor):
        return _launch._signature(kernel, (tensor,), {})

    assert signature(aligned) == signature(also_aligned)
    assert signature(aligned) != signature(off_by_4)
    assert signature(aligned) != signature(buffer[:8].view(torch.int32))


def test_integers_differ_by_value_unless_unspecialized_then_by_triton_type():
    kernel = _Kernel(unspecialized=(1,))

    def signature(size, seed):
        return _launch._signature(kernel, (size, seed), {})

    assert signature(16, 1) != signature(32, 1)  # both multiples of 16 to Triton: finer is safe
    assert signature(16, 1) == signature(16, 2**31 - 1)  # both i32 seeds
    assert signature(16, 1) != signature(16, 2**31)  # an i64 seed is another compiled kernel
    assert signature(16, 2**31) == signature(16, 2**63 - 1)
    assert signature(16, 2**63 - 1) != signature(16, 2**63)  # u64
    assert signature(16, -(2**31)) != signature(16, -(2**31) - 1)
    assert signature(16, True) != signature(16, 1)  # a bool is not typed as an int


def test_keywords_and_floats_differ_by_value():
    kernel = _Kernel()
    base = _launch._signature(kernel, (0.5,), {"BITS": 4, "num_warps": 2})
    assert base == _launch._signature(kernel, (0.5,), {"BITS": 4, "num_warps": 2})
    assert base != _launch._signature(kernel, (0.25,), {"BITS": 4, "num_warps": 2})
    assert base != _launch._signature(kernel, (0.5,), {"BITS": 8, "num_warps": 2})
    assert base != _launch._signature(kernel, (0.5,), {"BITS": 4, "num_warps": 4})


@pytest.mark.skipif(not _launch.INTERPRETING, reason="the interpreter's path: TRITON_INTERPRET=1 is not set")
def test_the_interpreter_always_takes_tritons_path():
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    for _ in range(3):
        _launch.launch(Kernel(), (2,), 7, BITS=4)
    assert calls == [((2,), (7,), {"BITS": 4})] * 3 and not _launch._compiled
