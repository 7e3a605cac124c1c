"""Rollout records (token-in-token-out), their storage, validation, the paper's filters and RL batches.

A record holds exactly what the rollout engine saw and produced: token ids (never text), the logprob of each
response token at the sampling temperature, and which response tokens the model generated (loss mask 1)
versus which came from tools or the environment (0).

Storage. `write_rollouts` / `read_rollouts` pick the format from the file name:
  * `*.jsonl`: one JSON object per line (readable by anything, needs no extra package);
  * anything else: ArrayRecord (the `array_record` package that comes with grain, imported lazily), one
    record per entry, each serialized as `.npz` bytes (numpy only, no pickle; arrays keep their dtypes and
    shapes, e.g. the [layers, tokens, top_k] expert choices). ArrayRecord gives grain random access.
Files are written to a temporary name and renamed, so a crash never leaves a half-written file.

Batch alignment (`make_batch`). For a sample with prompt p[0..P-1] and response r[0..R-1]:
  tokens[t]    = (p + r)[t] for t < P + R, then pad_id;   positions[t] = t;   segment_ids[t] = 1 (0 on pad)
  targets[t]   = tokens[t + 1]: the model output at position t scores the token at t + 1
  loss_mask[P - 1 + j], rollout_logprobs[P - 1 + j], advantages[P - 1 + j] (and old / teacher logprobs)
               belong to response token r[j], i.e. they sit at the position whose output predicts r[j];
               every other position has loss_mask 0 and zeros.
  expert_choices / indexer_topk [B, layers, seq_len, k]: row t is the routing recorded at position t.
So `token_logprobs(hidden, kernel, batch["targets"], temperature=batch["temperature"])` lines up with
`batch["rollout_logprobs"]` and `batch["loss_mask"]` element by element.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np

from glm5_jax.config.rl import RLConfig
from glm5_jax.data.advantages import sample_advantages


class RolloutError(ValueError):
    """A rollout record breaks a rule; the message names the record (rollout id) and the field."""


def _fail(rollout_id, field: str, problem: str):
    raise RolloutError(f"rollout {rollout_id!r}: field {field!r} {problem}")


_ID_ARRAYS = ("prompt_ids", "response_ids")
_LOGPROB_ARRAYS = ("rollout_logprobs", "teacher_logprobs", "old_logprobs")
_ROUTING_ARRAYS = ("expert_choices", "indexer_topk")
# (field, accepted numpy kinds, stored dtype, what the error says is expected)
_ARRAY_TYPES = ([(name, "iu", np.int32, "integers") for name in (*_ID_ARRAYS, *_ROUTING_ARRAYS)]
                + [(name, "fiu", np.float32, "numbers") for name in _LOGPROB_ARRAYS]
                + [("loss_mask", "biu", np.int32, "0/1 integers or booleans")])


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutRecord:
    """One sampled trajectory. Arrays are coerced to int32 (ids, mask, routing) / float32 (logprobs).

    expert_choices [layers, P + R - 1, top_k] and indexer_topk [layers, P + R - 1, index_topk] hold the
    routing of every position whose output is used (the last token is never fed back, so it has none).
    weight_versions lists the trainer versions whose weights produced the tokens (several when weights were
    swapped mid-rollout); staleness is measured from the oldest.
    """

    rollout_id: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    loss_mask: np.ndarray
    reward: float
    temperature: float
    weight_versions: tuple[int, ...]
    env_failed: bool = False
    teacher_logprobs: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    expert_choices: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None

    def __post_init__(self):
        def assign(name, value):
            object.__setattr__(self, name, value)  # coercion of a frozen dataclass's own fields

        rid = self.rollout_id
        assign("rollout_id", str(rid))
        assign("group_id", str(self.group_id))
        for name, kinds, dtype, expected in _ARRAY_TYPES:
            value = getattr(self, name)
            if value is None:
                continue
            array = np.asarray(value)
            if array.size and array.dtype.kind not in kinds:
                _fail(rid, name, f"has dtype {array.dtype}; expected {expected}")
            assign(name, array.astype(dtype))
        for name in ("reward", "temperature"):
            try:
                assign(name, float(getattr(self, name)))
            except (TypeError, ValueError):
                _fail(rid, name, f"is {getattr(self, name)!r}; expected a number")
        versions = self.weight_versions
        versions = (versions,) if isinstance(versions, (int, np.integer)) else versions
        try:
            assign("weight_versions", tuple(int(v) for v in versions))
        except (TypeError, ValueError):
            _fail(rid, "weight_versions", f"is {self.weight_versions!r}; expected a list of integers")
        assign("env_failed", bool(self.env_failed))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# ---------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------

def _check_logprobs(record: RolloutRecord, name: str, loss_tokens: np.ndarray):
    values = getattr(record, name)
    if values is None:
        return
    if values.shape != record.response_ids.shape:
        _fail(record.rollout_id, name, f"has shape {values.shape}; expected one logprob per response token "
                                       f"{record.response_ids.shape}")
    on_loss = values[loss_tokens]
    bad = ~np.isfinite(on_loss) | (on_loss > 0)
    if bad.any():
        index = int(np.flatnonzero(loss_tokens)[np.argmax(bad)])
        _fail(record.rollout_id, name, f"[{index}] = {values[index]!r} on a loss token; logprobs there must be "
                                       f"finite and <= 0")


def validate_record(record: RolloutRecord, *, known_groups: Collection | None = None,
                    vocab_size: int | None = None) -> RolloutRecord:
    """Check one record before training; raises RolloutError naming the rollout id and the field."""
    rid = record.rollout_id
    for name in _ID_ARRAYS:
        ids = getattr(record, name)
        if ids.ndim != 1 or ids.size == 0:
            _fail(rid, name, f"has shape {ids.shape}; expected a non-empty list of token ids")
        if ids.min() < 0:
            _fail(rid, name, f"contains id {ids.min()}; token ids must be >= 0")
        if vocab_size is not None and ids.max() >= vocab_size:
            _fail(rid, name, f"contains id {ids.max()}; valid ids are 0..{vocab_size - 1}")
    if record.loss_mask.shape != record.response_ids.shape:
        _fail(rid, "loss_mask", f"has shape {record.loss_mask.shape}; expected one entry per response token "
                                f"{record.response_ids.shape}")
    if not np.isin(record.loss_mask, (0, 1)).all():
        _fail(rid, "loss_mask", f"contains {sorted(set(record.loss_mask.tolist()) - {0, 1})}; only 0 and 1 "
                                f"are valid")
    if record.rollout_logprobs is None:
        _fail(rid, "rollout_logprobs", "is missing; every response token needs its sampling logprob")
    loss_tokens = record.loss_mask == 1
    for name in _LOGPROB_ARRAYS:
        _check_logprobs(record, name, loss_tokens)
    if not (np.isfinite(record.temperature) and record.temperature > 0):
        _fail(rid, "temperature", f"is {record.temperature!r}; must be finite and > 0")
    if not np.isfinite(record.reward):
        _fail(rid, "reward", f"is {record.reward!r}; must be finite")
    if not record.weight_versions or min(record.weight_versions) < 0:
        _fail(rid, "weight_versions", f"is {record.weight_versions!r}; expected one or more versions >= 0")
    if known_groups is not None and record.group_id not in {str(g) for g in known_groups}:
        _fail(rid, "group_id", f"is {record.group_id!r}, which is not a known group")
    for name in _ROUTING_ARRAYS:
        routing = getattr(record, name)
        if routing is None:
            continue
        if routing.ndim != 3 or routing.shape[1] != record.num_tokens - 1:
            _fail(rid, name, f"has shape {routing.shape}; expected [layers, {record.num_tokens - 1}, k] "
                             f"(one row per position except the last)")
        if routing.size and routing.min() < (0 if name == "expert_choices" else -1):
            _fail(rid, name, f"contains {routing.min()}; indices must be >= 0 (-1 marks an empty indexer slot)")
    return record


def validate_records(records: Sequence[RolloutRecord], *, known_groups: Collection | None = None,
                     vocab_size: int | None = None) -> Sequence[RolloutRecord]:
    """validate_record on each record, plus unique rollout ids."""
    seen = set()
    for record in records:
        if record.rollout_id in seen:
            _fail(record.rollout_id, "rollout_id", "appears twice; rollout ids must be unique")
        seen.add(record.rollout_id)
        validate_record(record, known_groups=known_groups, vocab_size=vocab_size)
    return records


# ---------------------------------------------------------------------------------------------
# Filters from the paper.
# ---------------------------------------------------------------------------------------------

def filter_and_pad(records: Sequence[RolloutRecord], *, current_version: int, max_staleness: int | None,
                   group_size: int | None = None) -> tuple[list[RolloutRecord], dict[str, int]]:
    """Drop environment-failed samples and samples staler than `max_staleness` versions, then repair groups.

    Staleness is `current_version - min(weight_versions)`; None keeps every sample. A sample that is both
    failed and stale is counted once, as failed. A group that lost samples keeps its size by repeating its
    valid samples in order (copies get the id `<rollout_id>#pad<k>`) when more than half of it remains,
    otherwise the whole group is dropped. The group's size is `group_size`, or its number of records here.
    Returns the kept records (groups in order of first appearance) and counts of everything dropped/added.
    """
    groups: dict[str, list[RolloutRecord]] = {}
    for record in records:
        groups.setdefault(record.group_id, []).append(record)
    counts = {"input": len(records), "dropped_env_failed": 0, "dropped_stale": 0, "dropped_groups": 0,
              "dropped_group_samples": 0, "padded": 0}
    kept: list[RolloutRecord] = []
    for group_id, members in groups.items():
        size = len(members) if group_size is None else group_size
        if len(members) > size:
            raise RolloutError(f"group {group_id!r} has {len(members)} records, more than group_size={size}")
        valid = []
        for record in members:
            if record.env_failed:
                counts["dropped_env_failed"] += 1
            elif max_staleness is not None and current_version - min(record.weight_versions) > max_staleness:
                counts["dropped_stale"] += 1
            else:
                valid.append(record)
        if 2 * len(valid) <= size:
            counts["dropped_groups"] += 1
            counts["dropped_group_samples"] += len(valid)
            continue
        repeats = [valid[k % len(valid)] for k in range(size - len(valid))]
        padding = [dataclasses.replace(record, rollout_id=f"{record.rollout_id}#pad{k}")
                   for k, record in enumerate(repeats)]
        counts["padded"] += len(padding)
        kept.extend(valid + padding)
    counts["output"] = len(kept)
    return kept, counts


def require_kept(kept: Sequence[RolloutRecord], counts: dict[str, int], source: str) -> None:
    """Refuse a filtered rollout set with nothing left, listing what each filter dropped."""
    if not kept:
        dropped = ", ".join(f"{name}={n}" for name, n in counts.items() if name != "output")
        raise RolloutError(f"{source}: no rollout left to train on after filtering ({dropped}); "
                           "dropped_env_failed counts env_failed samples, dropped_stale those older than "
                           "rl.max_staleness versions, dropped_groups groups with half or fewer valid samples")


# ---------------------------------------------------------------------------------------------
# Storage.
# ---------------------------------------------------------------------------------------------

_FIELDS = [f.name for f in dataclasses.fields(RolloutRecord)]


def _to_plain(record: RolloutRecord) -> dict:
    return {name: getattr(record, name) for name in _FIELDS if getattr(record, name) is not None}


def _from_plain(data: dict, where: str) -> RolloutRecord:
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise RolloutError(f"{where}: unknown field {unknown[0]!r}; known fields are {_FIELDS}")
    missing = [f.name for f in dataclasses.fields(RolloutRecord)
               if f.default is dataclasses.MISSING and f.name not in data]
    if missing:
        raise RolloutError(f"{where}: rollout {data.get('rollout_id')!r} lacks field {missing[0]!r}")
    return RolloutRecord(**data)


def record_to_bytes(record: RolloutRecord) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.asarray(value) for name, value in _to_plain(record).items()})
    return buffer.getvalue()


def record_from_bytes(data: bytes, where: str = "record") -> RolloutRecord:
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        plain = {name: arrays[name] for name in arrays.files}
    plain = {name: (value.item() if value.ndim == 0 else value) for name, value in plain.items()}
    return _from_plain(plain, where)


def _to_json(record: RolloutRecord) -> str:
    plain = {name: (value.tolist() if isinstance(value, np.ndarray) else value)
             for name, value in _to_plain(record).items()}
    return json.dumps(plain)


def write_rollouts(path: str | os.PathLike, records: Sequence[RolloutRecord]) -> None:
    """Write records to `path` (JSONL for `*.jsonl`, ArrayRecord otherwise), atomically."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    if path.suffix == ".jsonl":
        temporary.write_text("".join(_to_json(record) + "\n" for record in records))
    else:
        from array_record.python import array_record_module

        writer = array_record_module.ArrayRecordWriter(str(temporary), "group_size:1")
        for record in records:
            writer.write(record_to_bytes(record))
        writer.close()
    os.replace(temporary, path)


def _record_from_json_line(line: str, where: str) -> RolloutRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise RolloutError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, dict):
        raise RolloutError(f"{where}: a rollout record must be a JSON object, got {line.strip()[:80]!r}")
    try:
        return _from_plain(data, where)
    except (RolloutError, TypeError, ValueError) as err:
        message = str(err)
        raise RolloutError(message if message.startswith(where) else f"{where}: {message}") from None


def read_rollouts(path: str | os.PathLike) -> list[RolloutRecord]:
    """Read every record written by `write_rollouts`."""
    path = Path(path)
    if not path.is_file():
        raise RolloutError(f"rollout file {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        return [_record_from_json_line(line, f"{path}:{number}")
                for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    from array_record.python import array_record_module

    reader = array_record_module.ArrayRecordReader(str(path))
    try:
        return [record_from_bytes(data, f"{path}[{index}]") for index, data in enumerate(reader.read_all())]
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------------
# Batches.
# ---------------------------------------------------------------------------------------------

def _present(records: Sequence[RolloutRecord], name: str) -> bool:
    """Whether every record has optional field `name`; a mix is an error (a batch needs all or none)."""
    flags = [getattr(record, name) is not None for record in records]
    if any(flags) and not all(flags):
        _fail(records[flags.index(False)].rollout_id, name, "is missing while other records in the batch have it")
    return bool(flags) and all(flags)


def make_batch(records: Sequence[RolloutRecord], *, seq_len: int, config: RLConfig,
               batch_size: int | None = None, advantages: Sequence[float] | None = None,
               pad_id: int = 0) -> dict[str, np.ndarray]:
    """Fixed-shape numpy arrays for the RL step (alignment in the module docstring).

    Advantages come from `config.advantage` over these records' groups unless given per record (use that
    when a group spans several batches). Rows beyond the records (up to `batch_size`) are padding: mask 0,
    temperature 1.
    """
    batch_size = len(records) if batch_size is None else batch_size
    if not records:
        raise RolloutError("make_batch got no records; a batch needs at least one")
    if len(records) > batch_size:
        raise ValueError(f"batch_size={batch_size} is smaller than the {len(records)} records given")
    if advantages is None:
        advantages = sample_advantages([r.reward for r in records], [r.group_id for r in records], config)
    elif len(advantages) != len(records):
        raise ValueError(f"advantages has {len(advantages)} entries; expected one per record ({len(records)})")
    shape = (batch_size, seq_len)
    batch = {
        "tokens": np.full(shape, pad_id, np.int32),
        "targets": np.full(shape, pad_id, np.int32),
        "positions": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "rollout_logprobs": np.zeros(shape, np.float32),
        "advantages": np.zeros(shape, np.float32),
        "temperature": np.ones(batch_size, np.float32),
        "rewards": np.zeros(batch_size, np.float32),
    }
    optional_logprobs = [name for name in ("old_logprobs", "teacher_logprobs") if _present(records, name)]
    for name in optional_logprobs:
        batch[name] = np.zeros(shape, np.float32)
    for name in _ROUTING_ARRAYS:
        if _present(records, name):
            first = getattr(records[0], name)
            batch[name] = np.zeros((batch_size, first.shape[0], seq_len, first.shape[2]), np.int32)
    for row, (record, advantage) in enumerate(zip(records, advantages)):
        n, prompt_len = record.num_tokens, len(record.prompt_ids)
        if n > seq_len:
            _fail(record.rollout_id, "response_ids", f"makes {n} tokens with the prompt; seq_len is {seq_len}")
        tokens = np.concatenate([record.prompt_ids, record.response_ids])
        mask = record.loss_mask.astype(np.float32)
        on_loss = mask > 0
        response_rows = slice(prompt_len - 1, n - 1)
        batch["tokens"][row, :n] = tokens
        batch["targets"][row, :n - 1] = tokens[1:]
        batch["positions"][row, :n] = np.arange(n)
        batch["segment_ids"][row, :n] = 1
        batch["loss_mask"][row, response_rows] = mask
        batch["rollout_logprobs"][row, response_rows] = np.where(on_loss, record.rollout_logprobs, 0.0)
        batch["advantages"][row, response_rows] = advantage * mask
        batch["temperature"][row] = record.temperature
        batch["rewards"][row] = record.reward
        for name in optional_logprobs:
            batch[name][row, response_rows] = np.where(on_loss, getattr(record, name), 0.0)
        for name in _ROUTING_ARRAYS:
            if name in batch:
                routing = getattr(record, name)
                if routing.shape[0] != batch[name].shape[1] or routing.shape[2] != batch[name].shape[3]:
                    _fail(record.rollout_id, name, f"has shape {routing.shape}; other records in the batch have "
                                                   f"[{batch[name].shape[1]}, tokens, {batch[name].shape[3]}]")
                batch[name][row, :, :n - 1] = routing
    return batch


def rollout_dataset(records: Sequence[RolloutRecord], *, batch_size: int, seq_len: int, config: RLConfig,
                    drop_remainder: bool = False):
    """A grain MapDataset of `make_batch` batches over consecutive records.

    Advantages are computed once over all records (so a group split across batches keeps its baseline);
    run `validate_records` and `filter_and_pad` first. The last partial batch is padded to `batch_size`.
    """
    import grain

    if not records:
        raise RolloutError("rollout_dataset got no records; filter_and_pad may have dropped every group")
    advantages = sample_advantages([r.reward for r in records], [r.group_id for r in records], config)
    pairs = list(zip(records, advantages.tolist()))

    def to_batch(chunk):
        return make_batch([record for record, _ in chunk], seq_len=seq_len, config=config,
                          batch_size=batch_size, advantages=[advantage for _, advantage in chunk])

    return grain.MapDataset.source(pairs).batch(batch_size, drop_remainder=drop_remainder, batch_fn=to_batch)
