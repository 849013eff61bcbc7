"""The blockwise Walsh-Hadamard reference: orthonormal (H.H^T = I), Sylvester order, equal to a
dense-matrix product within twice PyTorch's own fp32 error, self-inverse, and its errors."""

import pytest
import torch

from lightning_sdp4bit.reference import blockwise_hadamard, hadamard_matrix, inverse_blockwise_hadamard

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("block", SIZES)
def test_matrix_is_orthonormal(block):
    h = hadamard_matrix(block, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(block, dtype=torch.float64), atol=1e-12)


def test_sylvester_order():
    h4 = hadamard_matrix(4, torch.float64) * 2
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


@pytest.mark.parametrize("block", SIZES)
def test_blockwise_equals_dense_product_within_twice_torch_error(block):
    x = torch.randn(37 * block, generator=torch.Generator().manual_seed(block))
    exact = (x.double().view(-1, block) @ hadamard_matrix(block, torch.float64)).view(-1)
    torch_error = ((x.view(-1, block) @ hadamard_matrix(block)).view(-1).double() - exact).norm()
    ours = (blockwise_hadamard(x, block).double() - exact).norm()
    assert ours <= 2 * torch_error + 1e-12 * exact.norm()


@pytest.mark.parametrize("block", [2, 32, 256])
def test_inverse_undoes_the_transform(block):
    x = torch.randn(4, 3 * block)
    assert torch.allclose(inverse_blockwise_hadamard(blockwise_hadamard(x, block), block), x, atol=1e-5)
    assert blockwise_hadamard(x, block).shape == x.shape


def test_hadamard_spreads_an_outlier_over_its_block():
    x = torch.zeros(64)
    x[5] = 32.0
    y = blockwise_hadamard(x, 32)
    assert torch.allclose(y[:32].abs(), torch.full((32,), 32.0 / 32**0.5))
    assert torch.equal(y[32:], torch.zeros(32))


def test_bad_blocks_raise():
    with pytest.raises(ValueError, match="block must be a positive power of two"):
        blockwise_hadamard(torch.randn(24), 24)
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block 32"):
        blockwise_hadamard(torch.randn(40), 32)
