"""The global batch as `num_shards` independent data streams, of which each process reads only its own.

Shard v reads every num_shards-th document (from v) with its own seed and yields batch_size / num_shards rows;
the global batch is the shards' rows in shard order. The batches therefore depend on `num_shards`, not on how
many processes share the shards, so a run on 2 processes sees exactly the batches of the same run on one, and a
checkpoint's data position (one grain iterator state per shard) restores under any process count.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np


class DataShardError(ValueError):
    """The shard layout does not fit the batch or the processes."""


def owned_shards(num_shards: int, process_index: int, process_count: int) -> range:
    if num_shards % process_count:
        raise DataShardError(f"data.shards={num_shards} is invalid: must be a multiple of the {process_count} "
                             "processes (each process reads whole shards)")
    per_process = num_shards // process_count
    return range(process_index * per_process, (process_index + 1) * per_process)


class ShardedBatches:
    """Iterator over this process's rows of the global batch: its shards' batches, concatenated in order."""

    def __init__(self, make_stream: Callable[[int], Iterable], shards: range):
        self.shards = shards
        self._iters = {shard: iter(make_stream(shard)) for shard in shards}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        parts = [next(self._iters[shard]) for shard in self.shards]
        return {key: np.concatenate([np.asarray(part[key]) for part in parts]) for key in parts[0]}

    def get_state(self) -> dict:
        """{"shards": {"<shard>": grain iterator state}} for this process's shards."""
        return {"shards": {str(shard): self._iters[shard].get_state() for shard in self.shards}}

    def set_state(self, state: dict) -> None:
        """Take this process's shards from a (merged) state; a pre-shard checkpoint is shard 0 of one."""
        shards = state.get("shards") if isinstance(state, dict) and "shards" in state else {"0": state}
        missing = [shard for shard in self.shards if str(shard) not in shards]
        if missing:
            raise DataShardError(f"the checkpoint's data position has shards {sorted(shards, key=int)} but this "
                                 f"run reads shards {list(self.shards)}: resume with the data.shards it was saved "
                                 "with")
        for shard in self.shards:
            self._iters[shard].set_state(shards[str(shard)])


def merge_states(states: list[dict]) -> dict:
    """One data position from every process's `get_state()` (gathered in process order)."""
    merged: dict = {}
    for state in states:
        merged.update(state["shards"])
    return {"shards": merged}
