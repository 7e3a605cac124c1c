"""DP-aware routing of rollouts to data-parallel inference engine ranks.

Every turn of a multi-turn rollout should land on the engine that already holds its prefix KV cache, so a
rollout id is pinned to one rank:

* Consistent hashing: each rank owns `virtual_nodes` points on a 64-bit hash ring (blake2b, stable across
  processes and Python versions, unlike `hash()`); an id goes to the first point clockwise from its own hash.
  Adding or removing one of n ranks moves only about 1/n of the ids (those whose arc changed owner).
* Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a rank may hold at most
  ceil((1 + load_epsilon) * active / n) rollouts in flight, counting the one being placed; a full rank
  passes the id on to the next rank clockwise on the ring.
* Sticky assignment: a rollout in flight keeps its rank for all its turns until `release`, even when the
  ring changes; only rollouts on a removed rank are moved (their cache is gone anyway).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Hashable, Iterable


def stable_hash(key: str) -> int:
    """64-bit hash of a string, identical on every machine and run."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHashRouter:
    """Maps rollout ids to ranks with consistent hashing, bounded loads and sticky in-flight assignment."""

    def __init__(self, ranks: Iterable[int], *, virtual_nodes: int = 160, load_epsilon: float = 0.25):
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int) or virtual_nodes <= 0:
            raise ValueError(f"virtual_nodes={virtual_nodes!r} is invalid: must be a positive integer")
        if not load_epsilon > 0:
            raise ValueError(f"load_epsilon={load_epsilon!r} is invalid: must be > 0 (ranks may exceed the "
                             f"average load by this fraction)")
        self.virtual_nodes = virtual_nodes
        self.load_epsilon = load_epsilon
        self._ranks: set[int] = set()
        self._assigned: dict[str, int] = {}
        self._loads: dict[int, int] = {}
        ranks = list(ranks)
        if not ranks:
            raise ValueError("ranks=[] is invalid: the router needs at least one engine rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks={ranks} is invalid: ranks must be distinct")
        for rank in ranks:
            self._ranks.add(rank)
            self._loads[rank] = 0
        self._build_ring()

    def _build_ring(self):
        points = sorted((stable_hash(f"rank-{rank}#{node}"), rank)
                        for rank in self._ranks for node in range(self.virtual_nodes))
        self._ring_hashes = [point for point, _ in points]
        self._ring_ranks = [rank for _, rank in points]

    def _walk(self, rollout_id: str):
        """Distinct ranks in ring order starting from the id's hash."""
        start = bisect.bisect_right(self._ring_hashes, stable_hash(rollout_id))
        seen = set()
        for step in range(len(self._ring_ranks)):
            rank = self._ring_ranks[(start + step) % len(self._ring_ranks)]
            if rank not in seen:
                seen.add(rank)
                yield rank
                if len(seen) == len(self._ranks):
                    return

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._ranks))

    @property
    def loads(self) -> dict[int, int]:
        """Rollouts in flight per rank."""
        return dict(self._loads)

    def capacity(self, active: int) -> int:
        """Most rollouts a rank may hold when `active` are in flight in total."""
        return math.ceil((1 + self.load_epsilon) * active / len(self._ranks))

    def preferred_rank(self, rollout_id: Hashable) -> int:
        """The rank plain consistent hashing gives the id, ignoring loads."""
        return next(self._walk(str(rollout_id)))

    def route(self, rollout_id: Hashable) -> int:
        """The rank serving this rollout: its current rank if in flight, else a new bounded-load choice."""
        rollout_id = str(rollout_id)
        if rollout_id in self._assigned:
            return self._assigned[rollout_id]
        return self._place(rollout_id)

    def _place(self, rollout_id: str) -> int:
        limit = self.capacity(len(self._assigned) + 1)
        # Total capacity n * limit >= active + 1, so some rank always has room.
        rank = next(rank for rank in self._walk(rollout_id) if self._loads[rank] < limit)
        self._assigned[rollout_id] = rank
        self._loads[rank] += 1
        return rank

    def release(self, rollout_id: Hashable) -> None:
        """The rollout finished: free its slot and forget its pin."""
        rank = self._assigned.pop(str(rollout_id), None)
        if rank is None:
            raise KeyError(f"rollout_id={rollout_id!r} is not in flight")
        self._loads[rank] -= 1

    def add_rank(self, rank: int) -> None:
        """New engine: later rollouts hashing onto its arcs go there; in-flight rollouts stay where they are."""
        if rank in self._ranks:
            raise ValueError(f"rank={rank!r} is already routed to")
        self._ranks.add(rank)
        self._loads[rank] = 0
        self._build_ring()

    def remove_rank(self, rank: int) -> list[str]:
        """Engine gone: its in-flight rollouts are placed again on the remaining ranks; returns their ids."""
        if rank not in self._ranks:
            raise ValueError(f"rank={rank!r} is not routed to; ranks are {self.ranks}")
        if len(self._ranks) == 1:
            raise ValueError(f"rank={rank!r} is the last rank; the router needs at least one")
        self._ranks.remove(rank)
        del self._loads[rank]
        self._build_ring()
        moved = sorted(rid for rid, owner in self._assigned.items() if owner == rank)
        for rollout_id in moved:
            del self._assigned[rollout_id]
        for rollout_id in moved:
            self._place(rollout_id)
        return moved
