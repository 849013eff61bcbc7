"""The emulated network's wait (benchmarks/gpu_wait.py), compiled for the H200 (sm_90) on any
machine: Triton's own ptxas builds it, no GPU needed. On the GPU, a wait never ends early."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import gpu_wait  # noqa: E402

# In a process of its own: the tests run Triton in interpreter mode, which compiles nothing.
PRINT_PTX = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
import gpu_wait
nap = sys.argv[1] == "nap"
source = ASTSource(fn=gpu_wait._spin_kernel, signature={"ns": "i64", "nap": "constexpr"}, constexprs={"nap": nap})
kernel = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
assert kernel.asm["cubin"], "ptxas built no cubin for sm_90"
print(kernel.asm["ptx"])
"""


def test_the_wait_naps_inside_its_clock_loop_and_builds_for_sm90():
    """A warp that reads %globaltimer back to back slowed the GEMMs beside it by 11.5% on the H200:
    the loop must sleep between reads (nanosleep), and must still read the clock after a nap."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ptx, back_to_back = (_ptx(env, variant) for variant in ("nap", "no-nap"))
    naps = [line for line in ptx.splitlines() if "nanosleep" in line]
    assert naps and all(re.search(r"nanosleep\.u32 1000;\s*mov\.u64 %rd\d+, %globaltimer;", line) for line in naps)
    # the loop's back edge: a branch to a label that comes before the nap
    labels = [m.start() for m in re.finditer(r"^\$L__BB0_\d+:", ptx, re.M)]
    assert any(position < ptx.index("nanosleep") for position in labels)
    # spin_cost's other variant reads the clock back to back
    assert "nanosleep" not in back_to_back and "%globaltimer" in back_to_back


def _ptx(env: dict, variant: str) -> str:
    # `python -c` puts its working directory first on sys.path: benchmarks/ gives it gpu_wait, where
    # the repository root would give it the source tree's lightning_sdp4bit, which has no kernels
    # subpackage (only an install maps kernels/ in).
    built = subprocess.run(
        [sys.executable, "-c", PRINT_PTX, variant],
        cwd=BENCHMARKS,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    return built.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: the wait is a CUDA kernel")
def test_a_wait_lasts_at_least_what_it_was_asked_on_a_gpu():
    gpu_wait.spin(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for wait_us in (3, 50, 2000):
        start.record()
        gpu_wait.spin(wait_us * 1000)
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) * 1000 >= 0.99 * wait_us
