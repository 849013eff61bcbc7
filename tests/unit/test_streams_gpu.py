"""lightning_sdp4bit.streams on a GPU (skipped elsewhere): `running_on` switches to its stream, hands
over the previous one, and gives it back even when its block raises."""

import pytest
import torch

from lightning_sdp4bit.streams import running_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: CUDA streams exist only on a GPU")


def test_running_on_switches_the_stream_and_restores_it_after_an_exception():
    before, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with running_on(side) as previous:
        assert previous == before and torch.cuda.current_stream() == side
        work = torch.ones(1 << 20, device="cuda") * 2  # queued on `side`
    assert torch.cuda.current_stream() == before
    with pytest.raises(RuntimeError, match="inside"), running_on(side):
        assert torch.cuda.current_stream() == side
        raise RuntimeError("inside")
    assert torch.cuda.current_stream() == before
    torch.cuda.current_stream().wait_stream(side)
    assert work.sum().item() == 2 * (1 << 20)
