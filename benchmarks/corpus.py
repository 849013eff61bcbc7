"""A real-text corpus that needs no download: the source and documentation files of the installed
Python packages (on the H200 machine, about 400 MB of .py files), as bytes.

    corpus = build_corpus()                     # every site-packages root of this interpreter
    corpus.train, corpus.val                    # uint8 tensors of byte tokens
    corpus.manifest                             # what to record with results: roots, counts, hashes

Deterministic: the files are taken in sorted order of their path relative to their root, and
the manifest holds a SHA-256 over that list (with sizes) and one over the bytes, so that two runs
can tell whether they trained on the same text. Validation is held-out *files*: a file goes to
validation when the first byte of the SHA-256 of its relative path is below `val_per_256` (about
1 in 64 by default), so no validation text is a continuation of a training file. Files are joined
with a NUL byte, which no source file contains, as a document separator. The tokenizer is the
identity on bytes (vocabulary 256).
"""

from __future__ import annotations

import hashlib
import site
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "build_corpus", "package_roots"]

SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt")
MAX_FILE_BYTES = 1 << 20  # larger files are mostly generated tables and data, not prose or code


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [n_train]
    val: torch.Tensor  # uint8 [n_val]
    manifest: dict


def package_roots() -> list[Path]:
    """The interpreter's site-packages folders (a venv's and the system's), existing and distinct."""
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    roots += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    seen, out = set(), []
    for root in map(Path, roots):
        resolved = root.resolve()
        if resolved.is_dir() and resolved not in seen:
            seen.add(resolved)
            out.append(resolved)
    return sorted(out)


def _files(roots: list[Path]) -> list[tuple[str, Path]]:
    found = []
    for index, root in enumerate(roots):
        for path in root.rglob("*"):
            if path.suffix in SUFFIXES and path.is_file() and not path.is_symlink():
                size = path.stat().st_size
                if 0 < size <= MAX_FILE_BYTES:
                    found.append((f"{index}:{path.relative_to(root).as_posix()}", path))
    return sorted(found)


def build_corpus(roots: list[Path] | None = None, val_per_256: int = 4, limit_bytes: int | None = None) -> Corpus:
    """Read every source and documentation file under `roots` (default: `package_roots()`).

    `limit_bytes` stops after that many bytes (in sorted order), once a file is held out for
    validation (1 in 64: on one machine the first 2 MB held 43 files and none of them): for smoke
    tests."""
    roots = roots or package_roots()
    train, val = bytearray(), bytearray()
    listing, content = hashlib.sha256(), hashlib.sha256()
    files = train_files = 0
    for name, path in _files(roots):
        data = path.read_bytes().replace(b"\0", b"")
        listing.update(f"{name}\t{len(data)}\n".encode())
        content.update(data)
        held_out = hashlib.sha256(name.encode()).digest()[0] < val_per_256
        target = val if held_out else train
        target += data + b"\0"
        files += 1
        train_files += not held_out
        if limit_bytes is not None and len(train) + len(val) >= limit_bytes and val:
            break  # past the limit, but not before a held-out file: a smoke corpus still splits
    if not train or not val:
        raise ValueError(f"the corpus under {[str(r) for r in roots]} has too few files to split ({files} found)")
    manifest = {
        "roots": [str(r) for r in roots],
        "suffixes": list(SUFFIXES),
        "files": files,
        "train_files": train_files,
        "val_files": files - train_files,
        "train_bytes": len(train),
        "val_bytes": len(val),
        "file_list_sha256": listing.hexdigest(),
        "content_sha256": content.hexdigest(),
        "tokenizer": "bytes (vocabulary 256, identity)",
        "python": sys.version.split()[0],
    }
    return Corpus(torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), manifest)
