"""`buffers.as_words`: rows viewed as the widest integers every tensor allows, without processes:
- the word is the widest that the rows' bytes and each tensor's offset divide into, the same for
  every tensor (a copy between views of different widths would convert values, not move bits);
- a transposed copy through the views moves exactly the bytes a copy of the originals moves.
"""

import pytest
import torch

from lightning_sdp4bit.buffers import as_words


@pytest.mark.parametrize(
    "row_bytes, offset, word",
    [(24, 0, torch.int64), (20, 0, torch.int32), (24, 4, torch.int32), (24, 2, torch.int16), (9, 0, torch.uint8)],
)
def test_the_word_is_the_widest_that_every_row_and_offset_allow(row_bytes, offset, word):
    flat = torch.zeros(offset + 3 * row_bytes, dtype=torch.uint8)
    shifted = flat[offset:].view(3, row_bytes)  # the offset from the storage's start, in bytes
    aligned = torch.zeros(3, row_bytes, dtype=torch.uint8)
    views = as_words(aligned, shifted)
    assert [v.dtype for v in views] == [word, word]
    assert views[1].shape == (3, row_bytes // word.itemsize)


@pytest.mark.parametrize(
    "dtype, offset", [(torch.uint8, 0), (torch.uint8, 4), (torch.bfloat16, 0), (torch.bfloat16, 1)]
)
def test_a_transposed_copy_through_words_moves_the_same_bits(dtype, offset):  # offset: in elements
    """As the two-level weight all-gather puts [L, M, R] blocks into rank order [M, L, R]."""
    local, nodes, row = 4, 2, 48
    blocks = torch.randint(0, 256, (local, nodes, row), dtype=torch.uint8).view(dtype)  # row bytes each
    storage = torch.zeros(offset + blocks.numel(), dtype=dtype)
    rows = storage[offset:].view(nodes * local, -1)
    expected = torch.zeros_like(rows)
    expected.view(nodes, local, -1).copy_(blocks.transpose(0, 1))
    out, into = as_words(rows, blocks)
    out.view(nodes, local, -1).copy_(into.transpose(0, 1))
    assert torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    assert rows.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()  # written in place
