"""lightning_sdp4bit.streams on a GPU (skipped elsewhere): the cheap current-stream calls behave as
torch's own, and `running_on` gives the previous stream back even when its block raises."""

import pytest
import torch

from lightning_sdp4bit.streams import current_stream, running_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: CUDA streams exist only on a GPU")


def test_current_stream_of_a_device_is_torchs_current_stream():
    side = torch.cuda.Stream()
    index = torch.cuda.current_device()
    assert current_stream(index) == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert current_stream(index) == side


def test_running_on_switches_the_stream_and_restores_it_after_an_exception():
    before, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with running_on(side):
        assert torch.cuda.current_stream() == side
        work = torch.ones(1 << 20, device="cuda") * 2  # queued on `side`
    assert torch.cuda.current_stream() == before
    with pytest.raises(RuntimeError, match="inside"), running_on(side):
        assert torch.cuda.current_stream() == side
        raise RuntimeError("inside")
    assert torch.cuda.current_stream() == before
    torch.cuda.current_stream().wait_stream(side)
    assert work.sum().item() == 2 * (1 << 20)
