"""The BPE vocabulary of the real-text corpus (benchmarks/bpe.py):
- a trained tokenizer gives back any text it encodes (code, Unicode, tabs and blank lines);
- training is deterministic: the same texts give the same serialized JSON, hence the same SHA-256
  (the recorded one is its file's);
- it learns from the training files only: a word repeated throughout a held-out file never becomes
  a token, while one repeated in the training files does; the validation stream is the held-out
  file's tokens, then the end-of-text token;
- a second call takes the tokenizer and the encoded streams from its cache.
"""

import hashlib

import pytest

TEXT = 'def f(x):\n\treturn {"ключ": x ** 2}  # ünïcødé, 数据\n\n\n    pass\r\n'


@pytest.fixture
def bpe(benchmark_script):
    return benchmark_script("bpe")


def test_a_trained_tokenizer_round_trips_text(bpe):
    tokenizer = bpe.train_tokenizer([TEXT * 20, "import torch\n" * 50], 300)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges were learned and used


def test_training_is_deterministic(bpe):
    texts = [f"value_{i} = compute(value_{i - 1}, {i})\n" * 30 for i in range(50)]
    first, second = bpe.train_tokenizer(texts, 400), bpe.train_tokenizer(texts, 400)
    assert first.to_str() == second.to_str()  # the serialized JSON, whose file's SHA-256 is recorded
    assert first.get_vocab_size() > 300  # merges learned: the bytes and the end-of-text token are 257


def _held_out(name: str) -> bool:
    """benchmarks/corpus.py's rule for the first root's files."""
    return hashlib.sha256(f"0:{name}".encode()).digest()[0] < 4


def test_the_tokenizer_learns_from_training_files_only(tmp_path, benchmark_script, bpe):
    corpus = benchmark_script("corpus")
    names = [f"m{i:03d}.py" for i in range(400)]
    validation = next(n for n in names if _held_out(n))
    training = [n for n in names if not _held_out(n)][:8]
    files = tmp_path / "files"
    files.mkdir()
    (files / validation).write_text("zqxjheldout " * 400)
    for name in training:
        (files / name).write_text("trainingword " * 400)
    built = corpus.build_corpus([files])
    assert built.manifest["val_files"] == 1 and built.manifest["train_files"] == len(training)

    tokens = bpe.bpe_corpus(built, 300, cache=tmp_path / "cache")
    tokenizer = __import__("tokenizers").Tokenizer.from_file(tokens.manifest["tokenizer_file"])
    vocabulary = tokenizer.get_vocab()
    assert not [token for token in vocabulary if "zqxj" in token]
    assert "Ġtrainingword" in vocabulary  # Ġ: byte-level BPE's space
    end = tokenizer.token_to_id(bpe.END_OF_TEXT)
    assert tokens.val[-1].item() == end and tokenizer.decode(tokens.val[:-1].tolist()) == "zqxjheldout " * 400
    assert (tokens.train == end).sum().item() == len(training)  # one end-of-text after each file
    with open(tokens.manifest["tokenizer_file"], "rb") as file:
        assert tokens.manifest["tokenizer_sha256"] == hashlib.sha256(file.read()).hexdigest()
    assert tokens.manifest["tokenizer_vocab"] == tokenizer.get_vocab_size() <= 300

    again = bpe.bpe_corpus(built, 300, cache=tmp_path / "cache")
    assert again.manifest["tokenizer_sha256"] == tokens.manifest["tokenizer_sha256"]
    assert again.train.equal(tokens.train) and again.val.equal(tokens.val)
    assert len(list((tmp_path / "cache").glob("*"))) == 2  # the tokenizer and the streams, nothing more
