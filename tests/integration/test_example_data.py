"""The GPT example's data pipeline (examples/gpt/data.py).

Checks:
- the embedded corpus: present without a download, deterministic, byte tokens;
- a text file: memory-mapped, every byte a token, non-UTF-8 bytes kept as they are;
- a directory: recursive, sorted by path, hidden entries skipped, files joined by a newline;
- a uint16 .bin file: memory-mapped ids, vocabulary from the largest id;
- errors that name the setting: missing, empty or odd-sized files, empty directories, a corpus
  shorter than two windows, a validation fraction that leaves a split too short, a vocabulary too
  small for the ids;
- windows: targets are the inputs shifted by one, int64, the split is train-then-val, and a
  memory-mapped corpus pickles (for start_method=spawn) as its file name, not its bytes;
- with a DistributedSampler (what Lightning injects), processes get disjoint windows, in an order
  fixed by the seed.
"""

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt.config import ConfigError  # noqa: E402
from gpt.data import TokenDataModule, TokenWindows, embedded_corpus, load_tokens, val_start, vocab_size_of  # noqa: E402


def test_embedded_corpus_is_deterministic_bytes():
    tokens = embedded_corpus()
    assert tokens.dtype == np.uint8
    assert len(tokens) > 200_000  # CPython's topics are about 0.5 MB
    assert np.array_equal(tokens, load_tokens(None))
    assert b"assert" in tokens.tobytes()
    assert vocab_size_of(tokens, None) == 256


def test_text_file_is_memory_mapped_bytes(tmp_path):
    raw = "héllo wörld\n".encode("latin-1") + b"\xff\xfe\x80 not utf-8 \x00" * 10
    path = tmp_path / "corpus.txt"
    path.write_bytes(raw)
    tokens = load_tokens(str(path))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8
    assert tokens.tobytes() == raw


def test_directory_is_recursive_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"two")
    (tmp_path / "a.txt").write_bytes(b"one")
    (tmp_path / "c.md").write_bytes(b"three")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref")
    tokens = load_tokens(str(tmp_path))
    assert tokens.tobytes() == b"one\ntwo\nthree"  # a.txt, b/2.txt, c.md


def test_bin_file_is_uint16_ids(tmp_path):
    ids = np.array([0, 5, 50256, 7, 1000], dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    tokens = load_tokens(str(path))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert np.array_equal(tokens, ids)
    assert vocab_size_of(tokens, None) == 50257
    assert vocab_size_of(tokens, 50304) == 50304
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 1000 is too small.*50256"):
        vocab_size_of(tokens, 1000)


def _bad_path(root: Path, case: str) -> Path:
    if case == "missing":
        return root / "missing.txt"
    if case == "empty-file":
        (root / "empty.txt").write_bytes(b"")
        return root / "empty.txt"
    if case == "odd-bin":
        (root / "odd.bin").write_bytes(b"abc")
        return root / "odd.bin"
    (root / "sub").mkdir()
    return root / "sub"


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", r"^data\.path: .*does not exist"),
        ("empty-file", r"^data\.path: .*is empty"),
        ("odd-bin", r"^data\.path: .*odd size"),
        ("empty-directory", r"^data\.path: directory .* holds no"),
    ],
)
def test_bad_paths_name_data_path(tmp_path, case, message):
    with pytest.raises(ConfigError, match=message):
        load_tokens(str(_bad_path(tmp_path, case)))


def test_directory_of_empty_files_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^data\.path: directory"):
        load_tokens(str(tmp_path))


def test_corpus_shorter_than_two_windows_is_an_error():
    tokens = np.arange(100, dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"^data\.path: the corpus has 100 tokens.*block_size \+ 1 = 65"):
        val_start(len(tokens), 0.5, block_size=64)


def test_val_fraction_leaving_a_short_split_is_an_error():
    tokens = np.zeros(1000, dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"^data\.val_fraction: 0.01 leaves 10 tokens for validation"):
        val_start(len(tokens), 0.01, block_size=64)


def test_windows_are_shifted_pairs_and_the_split_is_ordered():
    data = TokenDataModule(np.arange(1000, dtype=np.uint16), block_size=8, batch_size=4, val_fraction=0.1)
    train, val = data.train_set, data.val_set
    assert len(train) == (900 - 1) // 8 and len(val) == (100 - 1) // 8
    x, y = train[3]
    assert x.dtype == torch.int64 and x.shape == (8,)
    assert torch.equal(x, torch.arange(24, 32)) and torch.equal(y, torch.arange(25, 33))
    assert int(train[len(train) - 1][1][-1]) <= 899  # never reads past the training split
    assert int(val[0][0][0]) == 900  # validation is the end of the corpus
    with pytest.raises(IndexError):
        train[len(train)]


def test_memory_mapped_windows_pickle_as_a_file_name(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    windows = TokenWindows(load_tokens(str(path)), block_size=64, start=1000)
    pickled = pickle.dumps(windows)
    assert len(pickled) < 1000  # what start_method=spawn sends each process: not the 1 MiB
    restored = pickle.loads(pickled)
    assert isinstance(restored.tokens, np.memmap)
    assert all(torch.equal(a, b) for a, b in zip(restored[5], windows[5], strict=True))


def test_distributed_sampler_gives_disjoint_seeded_windows():
    data = TokenDataModule(np.arange(10_000, dtype=np.uint16), block_size=16, batch_size=4, val_fraction=0.1)

    def order(rank, seed):
        return list(DistributedSampler(data.train_set, num_replicas=2, rank=rank, shuffle=True, seed=seed))

    rank0, rank1 = order(0, seed=7), order(1, seed=7)
    assert not set(rank0) & set(rank1)
    assert rank0 == order(0, seed=7)  # same seed, same data order: what makes runs comparable
    assert rank0 != order(0, seed=8)
