"""Pretraining data: documents -> tokens + EOS -> chunks of <= seq_len -> first-fit packed rows -> batches.

Every document is tokenized once up front (so the statistics are exact and reported before training) and split
into chunks of at most `seq_len` tokens; grain then shuffles the chunks (a new order every epoch), packs them
first-fit into rows of `seq_len` and batches the rows. A batch is a dict of int32 [batch, seq_len] arrays:
  tokens       token ids, 0 in padding
  segment_ids  1, 2, 3, ... for the chunks inside a row, 0 for padding
  positions    0, 1, 2, ... restarting at every chunk, 0 in padding
  loss_mask    1 on real tokens, 0 on padding (next-token targets must also stay inside one segment)
A chunk is one segment: a document longer than `seq_len` continues in later segments with positions from 0.
The dataset's iterator is a grain `DatasetIterator`: `get_state()` returns a JSON-able dict that
`set_state()` takes back to continue exactly where it stopped. grain is imported only when a dataset is built.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from glm5_jax.data.corpus import Document


class DataError(ValueError):
    """Input data is missing, malformed or empty."""


def read_jsonl(paths: str | Path | Sequence[str | Path], *, text_key: str = "text") -> list[Document]:
    """Documents from JSONL files with one `{"text": ...}` object per line (blank lines are skipped)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise DataError("paths is empty: give at least one JSONL file")
    documents = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"data path {str(path)!r} does not exist or is not a file")
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from err
                if not isinstance(record, dict) or text_key not in record:
                    raise DataError(f"{where}: expected an object with a {text_key!r} field, got {line.strip()[:80]!r}")
                if not isinstance(record[text_key], str):
                    raise DataError(f"{where}: field {text_key!r} must be a string, got "
                                    f"{type(record[text_key]).__name__}")
                documents.append(Document(where, record[text_key]))
    if not documents:
        raise DataError(f"{', '.join(map(str, paths))}: no documents (every line is blank): nothing to train on")
    return documents


@dataclasses.dataclass(frozen=True)
class PackingStats:
    documents: int  # documents given
    empty_documents: int  # tokenized to nothing: dropped (their EOS too)
    long_documents: int  # longer than seq_len (with EOS): split into several chunks
    chunks: int  # segments to pack
    tokens: int  # tokens to pack, EOS included

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _encoder(tokenizer) -> Callable[[str], Sequence[int]]:
    if hasattr(tokenizer, "encode"):
        return tokenizer.encode
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"tokenizer must have an encode(text) method or be a callable, got {type(tokenizer).__name__}")


def tokenize_and_chunk(documents: Sequence[str | Document], tokenizer, *, eos_id: int, seq_len: int,
                       vocab_size: int | None = None) -> tuple[list[np.ndarray], PackingStats]:
    """Each non-empty document's tokens plus EOS, cut into int32 chunks of at most `seq_len` tokens."""
    encode = _encoder(tokenizer)
    chunks, empty, long, tokens = [], 0, 0, 0
    for index, document in enumerate(documents):
        text = document.text if isinstance(document, Document) else document
        if not isinstance(text, str):
            raise DataError(f"documents must be strings or Documents, got {type(text).__name__}")
        ids = np.asarray(list(encode(text)) + [eos_id], dtype=np.int64)
        if len(ids) == 1:
            empty += 1
            continue
        if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            name = document.id if isinstance(document, Document) else f"document {index}"
            raise DataError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        long += len(ids) > seq_len
        tokens += len(ids)
        chunks.extend(ids[start:start + seq_len].astype(np.int32) for start in range(0, len(ids), seq_len))
    stats = PackingStats(documents=len(documents), empty_documents=empty, long_documents=long, chunks=len(chunks),
                         tokens=tokens)
    return chunks, stats


def _to_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids = packed["tokens_segment_ids"]
    return {"tokens": packed["tokens"], "segment_ids": segment_ids, "positions": packed["tokens_positions"],
            "loss_mask": (segment_ids > 0).astype(np.int32)}


def _pad_rows(batch_size: int):
    """The last batch of a finite run can be short; pad it with empty rows so shapes never change."""
    def pad(batch):
        missing = batch_size - len(batch["tokens"])
        return batch if missing == 0 else {k: np.pad(v, ((0, missing), (0, 0))) for k, v in batch.items()}
    return pad


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DataError(f"{name}={value!r} is invalid: must be a positive integer")


def pretrain_dataset(documents: Sequence[str | Document], tokenizer, *, seq_len: int, batch_size: int,
                     eos_id: int | None = None, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
                     num_packing_bins: int | None = None, vocab_size: int | None = None):
    """A grain IterDataset of packed [batch_size, seq_len] batches, and the PackingStats of `documents`.

    `tokenizer` is an object with `encode(text) -> list[int]` (its `eos_id` and `vocab_size` are used when the
    arguments are not given) or a plain encode callable. `num_epochs=None` repeats forever. Same arguments and
    seed give the same batches. Packing waits for `num_packing_bins` rows (default `batch_size`) at a time.
    """
    _positive_int("seq_len", seq_len)
    _positive_int("batch_size", batch_size)
    num_packing_bins = batch_size if num_packing_bins is None else num_packing_bins
    _positive_int("num_packing_bins", num_packing_bins)
    if num_epochs is not None:
        _positive_int("num_epochs", num_epochs)
    eos_id = getattr(tokenizer, "eos_id", None) if eos_id is None else eos_id
    if not isinstance(eos_id, int) or isinstance(eos_id, bool) or eos_id < 0:
        raise DataError(f"eos_id={eos_id!r} is invalid: pass a non-negative token id (or a tokenizer with eos_id)")
    vocab_size = getattr(tokenizer, "vocab_size", None) if vocab_size is None else vocab_size
    if vocab_size is not None and eos_id >= vocab_size:
        raise DataError(f"eos_id={eos_id} is invalid: must be < vocab_size={vocab_size}")
    if len(documents) == 0:
        raise DataError("documents is empty: the pretraining corpus has no documents")
    chunks, stats = tokenize_and_chunk(documents, tokenizer, eos_id=eos_id, seq_len=seq_len, vocab_size=vocab_size)
    if not chunks:
        raise DataError(f"all {stats.documents} documents are empty after tokenization: nothing to train on "
                        f"({json.dumps(stats.as_dict())})")

    import grain  # lazily: the model and training step must import without grain installed

    dataset = grain.MapDataset.source(chunks)
    if shuffle:
        dataset = dataset.shuffle(seed=seed)  # before repeat: a fresh permutation every epoch
    dataset = dataset.repeat(num_epochs).map(lambda chunk: {"tokens": chunk})
    # Chunks are already tokenized in memory: reading them needs no prefetch threads.
    chunk_stream = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    packed = grain.experimental.FirstFitPackIterDataset(
        chunk_stream, length_struct={"tokens": seq_len}, num_packing_bins=num_packing_bins, seed=seed,
        shuffle_bins=shuffle)
    batches = packed.map(_to_batch).batch(batch_size, drop_remainder=False).map(_pad_rows(batch_size))
    return batches, stats
