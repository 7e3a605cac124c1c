"""An offline text corpus present on every machine: the Python standard library's own `.py` sources.

Files are listed in sorted relative-path order (deterministic across machines with the same Python), skipping
test suites and installed packages, and assigned to "train" or "validation" by a hash of the relative path,
so a file never changes split when limits change or files are added.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

SPLITS = ("train", "validation")
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class Document:
    id: str  # where the text came from: a relative path, or "file:line" for JSONL records
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: str | Path | None = None) -> list[str]:
    """Relative posix paths of the `.py` files under `root` (default: the stdlib), sorted, tests excluded."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"root={str(root)!r} is not a directory")
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]  # prune: site-packages can be gigabytes
        found.extend(Path(directory, name).relative_to(root).as_posix() for name in files if name.endswith(".py"))
    return sorted(found)


def is_validation(doc_id: str, validation_fraction: float) -> bool:
    """Stable split: the first 64 bits of sha256(doc_id) as a fraction of 2**64, below `validation_fraction`."""
    digest = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return digest / 2**64 < validation_fraction


def stdlib_corpus(split: str = "train", *, validation_fraction: float = 0.05, max_files: int | None = None,
                  max_bytes: int | None = None, root: str | Path | None = None) -> list[Document]:
    """The stdlib sources of one split, in path order, stopping before `max_files` / `max_bytes` (UTF-8) is passed."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: must be one of {SPLITS}")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction!r} is invalid: must be in [0, 1)")
    for name, limit in (("max_files", max_files), ("max_bytes", max_bytes)):
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"{name}={limit!r} is invalid: must be a positive integer or None (no limit)")
    root = Path(root) if root is not None else stdlib_root()
    want_validation = split == "validation"
    documents, total_bytes = [], 0
    for doc_id in stdlib_source_files(root):
        if is_validation(doc_id, validation_fraction) != want_validation:
            continue
        if max_files is not None and len(documents) >= max_files:
            break
        data = (root / doc_id).read_bytes()
        if max_bytes is not None and total_bytes + len(data) > max_bytes:
            break
        total_bytes += len(data)
        documents.append(Document(doc_id, data.decode("utf-8", errors="replace")))
    return documents
