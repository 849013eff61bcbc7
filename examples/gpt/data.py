"""Tokens for the GPT example: where they come from and how batches are cut from them.

A token is a byte (vocabulary 256), except in a pre-tokenized .bin file. `data.path` may be:
- null: the embedded corpus, the documentation topics that ship with CPython (`pydoc_data`),
  so the example runs on any machine without a download;
- a text file: memory-mapped, one token per byte, so any encoding (or none) works and a file
  larger than memory is fine;
- a directory: every non-hidden file below it, recursively, in sorted path order, joined by a
  newline (read into memory once: concatenate a huge corpus into one file instead);
- a file ending in .bin: uint16 token ids, memory-mapped (as nanoGPT's prepare scripts write).

The last `val_fraction` of the tokens is the validation split. Both splits are cut into
non-overlapping windows of block_size + 1 tokens: the inputs and, shifted by one, the targets.
Lightning's DistributedSampler shuffles the training windows with the run's seed.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .config import ConfigError

BYTE_VOCAB = 256


def embedded_corpus() -> np.ndarray:
    """CPython's documentation topics (about 0.5 MB of English and code) as UTF-8 bytes."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ConfigError(
            "data.path", "is null, but this Python lacks pydoc_data for the embedded corpus; point it at text"
        ) from None
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)


def _directory_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow directory symlinks
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    # sorted by path components, the same order on every machine: a.txt, b/2.txt, c.md
    return sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(root).parts)


def _read_directory(root: Path) -> np.ndarray:
    files = _directory_files(root)
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) == 0:
        raise ConfigError("data.path", f"directory {str(root)!r} holds no non-empty, non-hidden files")
    tokens = np.empty(sum(sizes) + len(files) - 1, dtype=np.uint8)  # files joined by b"\n"
    offset = 0
    for file, size in zip(files, sizes, strict=True):
        with open(file, "rb") as f:  # read straight into the one array: each byte in memory once
            if f.readinto(memoryview(tokens[offset : offset + size])) != size:
                raise ConfigError("data.path", f"{str(file)!r} changed size while being read")
        offset += size
        if offset < len(tokens):
            tokens[offset] = ord("\n")
            offset += 1
    return tokens


def load_tokens(path: str | None) -> np.ndarray:
    """The corpus as a 1-D array of token ids: uint8 for bytes, uint16 for a .bin file."""
    try:
        return _load_tokens(path)
    except OSError as err:  # unreadable files and directories, named in the message
        raise ConfigError("data.path", f"cannot read {err.filename or path!r}: {err.strerror}") from None


def _load_tokens(path: str | None) -> np.ndarray:
    if path is None:
        return embedded_corpus()
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_directory(p)
    if not p.exists():
        raise ConfigError("data.path", f"{path!r} does not exist")
    if not p.is_file():
        raise ConfigError("data.path", f"{path!r} is neither a regular file nor a directory")
    size = p.stat().st_size
    if size == 0:
        raise ConfigError("data.path", f"{path!r} is empty")
    if p.suffix == ".bin":
        if size % 2:
            raise ConfigError("data.path", f"{path!r} has an odd size ({size} bytes): not a file of uint16 tokens")
        return np.memmap(p, dtype=np.uint16, mode="r")
    return np.memmap(p, dtype=np.uint8, mode="r")


def vocab_size_of(tokens: np.ndarray, configured: int | None) -> int:
    """The model's vocabulary: 256 for bytes; for uint16 ids, the largest id + 1 unless configured."""
    if tokens.dtype == np.uint8:
        needed = BYTE_VOCAB
    else:  # scan in 64 MiB chunks so that a memory-mapped file is never read in one piece
        chunk = 32 * 1024 * 1024
        needed = 1 + max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
    if configured is None:
        return needed
    if configured < needed:
        raise ConfigError("model.vocab_size", f"{configured} is too small: the data holds token ids up to {needed - 1}")
    return configured


def val_start(n_tokens: int, val_fraction: float, block_size: int) -> int:
    """Where the validation split starts; each split must hold at least one window of block_size + 1."""
    if n_tokens < 2 * (block_size + 1):
        raise ConfigError(
            "data.path",
            f"the corpus has {n_tokens} tokens, too short for a training and a validation window of "
            f"model.block_size + 1 = {block_size + 1} tokens each",
        )
    start = n_tokens - int(n_tokens * val_fraction)
    for name, length in (("training", start), ("validation", n_tokens - start)):
        if length < block_size + 1:
            raise ConfigError(
                "data.val_fraction",
                f"{val_fraction} leaves {length} tokens for {name}, fewer than model.block_size + 1 = {block_size + 1}",
            )
    return start


class TokenWindows(Dataset):
    """Windows of tokens[start:stop]: item i = (x, y) with x = the T tokens from start + iT and y the
    same shifted by one, as int64 (T = block_size). Windows never cross `stop`."""

    def __init__(self, tokens: np.ndarray, block_size: int, start: int = 0, stop: int | None = None) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.start, self.stop = start, len(tokens) if stop is None else stop
        self.n = (self.stop - self.start - 1) // block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        begin = self.start + i * self.block_size
        window = torch.from_numpy(self.tokens[begin : begin + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]

    # With start_method=spawn the dataset is pickled into every process: a memory-mapped file
    # travels as its name, not as its bytes, so a large corpus is never copied.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (str(self.tokens.filename), self.tokens.dtype.str)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["tokens"], tuple):
            filename, dtype = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r")
        self.__dict__.update(state)


class TokenDataModule(L.LightningDataModule):
    """Training and validation windows; Lightning adds the DistributedSampler for each process."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, val_fraction: float) -> None:
        super().__init__()
        boundary = val_start(len(tokens), val_fraction, block_size)
        self.train_set = TokenWindows(tokens, block_size, stop=boundary)
        self.val_set = TokenWindows(tokens, block_size, start=boundary)
        self.batch_size = batch_size

    def _pin(self) -> bool:
        # A batch in pageable memory is copied to the GPU with a stream synchronisation: the host
        # then waits for the previous step to end before it can launch the next forward, and the
        # weight all-gathers in flight can no longer overlap it. From pinned memory the copy is
        # asynchronous.
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def train_dataloader(self) -> DataLoader:
        # drop_last: every step sees full batches, the same number of tokens on every process
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, pin_memory=self._pin()
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, pin_memory=self._pin())
