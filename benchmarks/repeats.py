"""Timed repeats reported with their spread, and the order in which two or more sides take turns.

Sides alternate ABBA... (round r runs them forwards when r is even, backwards when odd), so a load that drifts
during the run falls on every side alike; each side gets the same number of timed repeats."""

from __future__ import annotations

import statistics


def turn_order(sides: list[str], rounds: int) -> list[tuple[int, str]]:
    """[(round, side), ...]: every side once per round, forwards on even rounds and backwards on odd ones."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} is invalid: must be >= 1")
    return [(r, side) for r in range(rounds) for side in (sides if r % 2 == 0 else sides[::-1])]


def spread_of(seconds: list[float]) -> dict:
    """Median, min and max of timed repeats (seconds), and how many there were."""
    if not seconds:
        raise ValueError("spread_of() needs at least one timed repeat")
    return {"median_s": round(statistics.median(seconds), 4), "min_s": round(min(seconds), 4),
            "max_s": round(max(seconds), 4), "repeats": len(seconds)}
