"""Pretraining corpus and packing pipeline: packing layout, no lost tokens, resumable state, bad input."""

import collections
import hashlib
import json

import numpy as np
import pytest

from glm5_jax.data.corpus import Document, is_validation, stdlib_corpus, stdlib_source_files
from glm5_jax.data.pretrain import DataError, pretrain_dataset, read_jsonl

EOS = 0
SEQ_LEN, BATCH = 16, 3


def numbered_documents(lengths):
    """Documents whose tokens are globally unique numbers, so every token can be traced."""
    documents, next_token = [], 1
    for length in lengths:
        documents.append(" ".join(str(t) for t in range(next_token, next_token + length)))
        next_token += length
    return documents


def encode_numbers(text):
    return [int(word) for word in text.split()]


LENGTHS = [5, 0, 40, 15, 16, 1, 3, 0, 9, 12, 7, 30, 2, 6]  # 0 = empty; 40, 16, 30 (+ EOS) > seq_len; 15 + EOS = seq_len


def segments_of(batch):
    """(tokens, positions) of every packed segment, checking the row layout on the way."""
    found = []
    for tokens, segment_ids, positions, loss_mask in zip(*(batch[k] for k in ("tokens", "segment_ids",
                                                                             "positions", "loss_mask"))):
        used = segment_ids > 0
        assert not (np.diff(used.astype(np.int32)) > 0).any(), "padding only at the row end"
        np.testing.assert_array_equal(loss_mask, used.astype(np.int32))
        assert (tokens[~used] == 0).all() and (positions[~used] == 0).all()
        ids = segment_ids[used]
        np.testing.assert_array_equal(np.unique(ids), np.arange(1, ids.max() + 1) if len(ids) else [])
        assert (np.diff(ids) >= 0).all(), "segments are contiguous and numbered left to right"
        for segment in np.unique(ids):
            where = segment_ids == segment
            np.testing.assert_array_equal(positions[where], np.arange(where.sum()))
            found.append(tuple(tokens[where]))
    return found


def expected_chunks(lengths):
    chunks, next_token = [], 1
    for length in lengths:
        if length:
            ids = list(range(next_token, next_token + length)) + [EOS]
            chunks.extend(tuple(ids[i:i + SEQ_LEN]) for i in range(0, len(ids), SEQ_LEN))
        next_token += length
    return chunks


def test_packing_layout_and_no_token_lost():
    dataset, stats = pretrain_dataset(numbered_documents(LENGTHS), encode_numbers, eos_id=EOS, seq_len=SEQ_LEN,
                                      batch_size=BATCH, num_epochs=1, seed=3)
    assert stats.as_dict() == {"documents": 14, "empty_documents": 2, "long_documents": 3, "chunks": 16,
                               "tokens": sum(LENGTHS) + 12}
    batches = list(dataset)
    assert all(b[k].shape == (BATCH, SEQ_LEN) and b[k].dtype == np.int32 for b in batches for k in b)
    packed = [segment for batch in batches for segment in segments_of(batch)]
    assert collections.Counter(packed) == collections.Counter(expected_chunks(LENGTHS))
    real_tokens = sum(int(b["loss_mask"].sum()) for b in batches)
    assert real_tokens == stats.tokens


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_same_seed_same_batches_and_state_resumes_exactly():
    build = lambda seed: pretrain_dataset(numbered_documents(LENGTHS), encode_numbers, eos_id=EOS, seq_len=SEQ_LEN,
                                          batch_size=BATCH, seed=seed)[0]
    iterator = iter(build(7))
    _take(iterator, 5)
    state = json.loads(json.dumps(iterator.get_state()))  # what a checkpoint stores
    continued = _take(iterator, 8)  # crosses epoch boundaries: one epoch is about 4 batches
    resumed = iter(build(7))
    resumed.set_state(state)
    for a, b in zip(continued, _take(resumed, 8)):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    first = lambda seed: next(iter(build(seed)))["tokens"]
    np.testing.assert_array_equal(first(7), first(7))
    assert not np.array_equal(first(7), first(8))


def test_epochs_are_reshuffled_and_complete():
    dataset, stats = pretrain_dataset(numbered_documents(LENGTHS), encode_numbers, eos_id=EOS, seq_len=SEQ_LEN,
                                      batch_size=1, num_packing_bins=1, num_epochs=2, seed=1)
    rows = [segments_of(batch) for batch in dataset]
    order = [segment for row in rows for segment in row]
    assert collections.Counter(order) == collections.Counter(expected_chunks(LENGTHS) * 2)
    first_epoch_len = len(expected_chunks(LENGTHS))
    assert order[:first_epoch_len] != order[first_epoch_len:]


def test_input_errors_name_the_problem(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n\n{"text": "", "source": "x"}\n')
    documents = read_jsonl(good)
    assert documents == [Document(f"{good}:1", "hello"), Document(f"{good}:3", "")]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    with pytest.raises(DataError, match=rf"{broken}:3: malformed JSON"):
        read_jsonl([good, broken])
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(DataError, match=rf"{no_text}:2: expected an object with a 'text' field"):
        read_jsonl(no_text)
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="all 2 documents are empty"):
        pretrain_dataset(["", ""], encode_numbers, eos_id=EOS, seq_len=8, batch_size=2)
    with pytest.raises(DataError, match="seq_len=0"):
        pretrain_dataset(["1"], encode_numbers, eos_id=EOS, seq_len=0, batch_size=2)
    with pytest.raises(DataError, match="eos_id=None"):
        pretrain_dataset(["1"], encode_numbers, seq_len=8, batch_size=2)
    with pytest.raises(DataError, match=r"document 1: token id 99 is outside the vocabulary \[0, 50\)"):
        pretrain_dataset(["1", "2 99"], encode_numbers, eos_id=EOS, seq_len=8, batch_size=2, vocab_size=50)


def test_stdlib_corpus_split_is_stable_and_excludes_tests():
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 500
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.split("/"))
    assert "json/decoder.py" in files
    fraction = 0.1
    reference = lambda path: int(hashlib.sha256(path.encode()).hexdigest()[:16], 16) / 2**64 < fraction
    assert all(is_validation(f, fraction) == reference(f) for f in files)
    train = stdlib_corpus("train", validation_fraction=fraction, max_files=12)
    validation = stdlib_corpus("validation", validation_fraction=fraction, max_files=5)
    assert [d.id for d in train] == [f for f in files if not reference(f)][:12]
    assert [d.id for d in validation] == [f for f in files if reference(f)][:5]
    capped = stdlib_corpus("train", validation_fraction=fraction, max_bytes=60_000)
    assert sum(len(d.text.encode()) for d in capped) <= 60_000
    assert [d.id for d in capped] == [d.id for d in train][:len(capped)]
    with pytest.raises(ValueError, match="split='dev'"):
        stdlib_corpus("dev")


def test_stdlib_corpus_through_byte_tokenizer():
    from glm5_jax.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    documents = stdlib_corpus("train", max_files=6)
    dataset, stats = pretrain_dataset(documents, tokenizer, seq_len=256, batch_size=4, num_epochs=1)
    batches = list(dataset)
    tokens = np.concatenate([b["tokens"][b["loss_mask"] > 0] for b in batches])
    assert len(tokens) == stats.tokens == sum(len(d.text.encode()) + 1 for d in documents if d.text)
    assert (tokens == tokenizer.eos_id).sum() == stats.documents - stats.empty_documents
