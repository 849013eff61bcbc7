"""A byte-level BPE vocabulary for the real-text corpus (benchmarks/corpus.py), in place of its
256 byte tokens: GPT-2's kind of tokenizer (the paper's models use GPT-2's 50,257 tokens),
trained here with the `tokenizers` package on the corpus's training files only.

    tokens = bpe_corpus(build_corpus(), BPE_VOCAB, cache=Path("/tmp/state"))
    tokens.train, tokens.val                # int32 tensors of token ids
    tokens.manifest["tokenizer_sha256"]     # SHA-256 of the tokenizer's serialized JSON

Deterministic: the same files give the same tokenizer, bit for bit (the SHA-256 of its JSON file
is recorded; the same in processes with other hash seeds and thread counts, tokenizers 0.23). It is
trained on every `TRAIN_STRIDE`-th training file (held-out validation files are never seen);
then every file is encoded, each followed by the end-of-text token, as the byte corpus puts a NUL
after each. Bytes that are not UTF-8 become U+FFFD before encoding (`tokenizers` takes str).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from corpus import Corpus

__all__ = ["BPE_VOCAB", "END_OF_TEXT", "bpe_corpus", "documents", "encode_documents", "train_tokenizer"]

# GPT-2's 50,257 rounded down to a multiple of 64, so the embedding and output matmuls tile evenly.
BPE_VOCAB = 49_984
END_OF_TEXT = "<|endoftext|>"
# Every 4th training file (about 100 MB of the H200 machine's 400): the merges of a code corpus
# settle long before that, and training on 16 cores stays well under a minute.
TRAIN_STRIDE = 4


def documents(stream: torch.Tensor) -> list[str]:
    """The files of a byte corpus stream (uint8 [n], each file followed by a NUL), decoded."""
    files = stream.numpy().tobytes().split(b"\0")
    return [data.decode("utf-8", errors="replace") for data in files[:-1]]  # the last NUL ends the stream


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer and byte alphabet, one special token)
    trained on `texts`, with `vocab_size` tokens at most (fewer when the texts run out of pairs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen or not
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """int32 [n] token ids: each text's tokens, then the end-of-text token (the NUL's place)."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids = []
    batch = 1024  # texts per encode_batch call (parallel inside); bounds the Python lists alive
    for start in range(0, len(texts), batch):
        for encoding in tokenizer.encode_batch(texts[start : start + batch], add_special_tokens=False):
            ids.append(torch.tensor(encoding.ids + [end], dtype=torch.int32))
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)


def bpe_corpus(corpus: Corpus, vocab_size: int, cache: Path, tokenizer_file: Path | None = None) -> Corpus:
    """`corpus` in BPE tokens: train and val int32 [n] of ids, and its manifest with the tokenizer's.

    The tokenizer is `tokenizer_file` when given, else trained on the training files (kept in
    `cache` under a name with the corpus's content hash, and taken from there next time); the
    encoded streams are kept in `cache` too, keyed by both hashes."""
    from tokenizers import Tokenizer, __version__

    started = time.time()
    cache.mkdir(parents=True, exist_ok=True)
    content = corpus.manifest["content_sha256"][:16]
    train_texts = documents(corpus.train)
    trained_on = "given"
    if tokenizer_file is None:
        tokenizer_file = cache / f"bpe-{vocab_size}-{content}.json"
        sample = train_texts[::TRAIN_STRIDE]
        trained_on = f"every {TRAIN_STRIDE}th training file: {len(sample)} files, {sum(map(len, sample)):,} characters"
        if not tokenizer_file.exists():
            tokenizer = train_tokenizer(sample, vocab_size)
            tokenizer.save(str(tokenizer_file.with_suffix(".tmp")))
            os.replace(tokenizer_file.with_suffix(".tmp"), tokenizer_file)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()  # what `sha256sum` of the file says
    streams = cache / f"tokens-{digest[:16]}-{content}.pt"
    if streams.exists():
        train, val = torch.load(streams, weights_only=True)
    else:
        train = encode_documents(tokenizer, train_texts)
        val = encode_documents(tokenizer, documents(corpus.val))
        torch.save((train, val), streams.with_suffix(".tmp"))
        os.replace(streams.with_suffix(".tmp"), streams)
    manifest = {
        **corpus.manifest,
        "tokenizer": f"byte-level BPE, vocabulary {tokenizer.get_vocab_size()}, SHA-256 {digest}",
        "tokenizer_vocab": tokenizer.get_vocab_size(),
        "tokenizer_sha256": digest,
        "tokenizer_file": str(tokenizer_file),
        "tokenizer_trained_on": trained_on,
        "tokenizers_version": __version__,
        "train_tokens": train.numel(),
        "val_tokens": val.numel(),
        "bytes_per_token": round(corpus.manifest["train_bytes"] / max(train.numel(), 1), 3),
    }
    print(
        f"bpe: vocabulary {manifest['tokenizer_vocab']}, SHA-256 {digest}, {train.numel():,} training and "
        f"{val.numel():,} validation tokens ({time.time() - started:.0f} s)",
        flush=True,
    )
    return Corpus(train, val, manifest)
