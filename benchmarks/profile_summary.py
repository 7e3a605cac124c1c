"""Where a traced program's device time goes: the events of a `jax.profiler.trace` summed by name, per timeline.

A GPU's profile has one plane per device ("/device:GPU:0") whose lines are timelines: "XLA Modules" (one event per
program run), "XLA Ops" (one per HLO op: fusions, custom calls such as the Pallas kernels, collectives) and the
CUDA streams (one per kernel or copy). Each line's events are summed by name (top `top`, with their count, time per
traced step, share of the line's busy time, and the first event's profiler stats, which name the HLO op and the
JAX operation that made it). Without a device plane (a CPU run) the host plane's threads stand in, which checks
this script rather than measuring anything.
"""

from __future__ import annotations

import collections
import glob
from pathlib import Path

from jax.profiler import ProfileData

HOST_PLANE = "/host:CPU"
DEVICE_PREFIX = "/device:"
STAT_CHARS = 300  # a stat's value is cut to this: HLO text can be long


def xplane_file(trace_dir: str | Path) -> Path:
    """The .xplane.pb a `jax.profiler.trace(trace_dir)` wrote (the newest if several)."""
    found = sorted(glob.glob(str(Path(trace_dir) / "**" / "*.xplane.pb"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: did jax.profiler.trace run there?")
    return Path(found[-1])


def _timelines(data: ProfileData):
    """(plane name, line) for every line of the device planes, or of the host plane if there is none (on CPU a
    small program may run on XLA's threads or on the calling Python thread)."""
    # Device planes with events: libtpu, once loaded (the TPU compile tests), adds an empty "/device:CUSTOM:...".
    planes = [plane for plane in data.planes if plane.name.startswith(DEVICE_PREFIX)
              and any(True for line in plane.lines for _ in line.events)]
    planes = planes or [plane for plane in data.planes if plane.name == HOST_PLANE]
    return [(plane.name, line) for plane in planes for line in plane.lines]


def summarize(trace_dir: str | Path, steps: int, top: int = 25) -> list[dict]:
    """One record per timeline with events: its busy time per step and its `top` event names by total time."""
    data = ProfileData.from_file(str(xplane_file(trace_dir)))
    records = []
    for plane_name, line in _timelines(data):
        totals, counts, stats = collections.Counter(), collections.Counter(), {}
        for event in line.events:
            totals[event.name] += event.duration_ns
            counts[event.name] += 1
            if event.name not in stats:
                stats[event.name] = {str(k): str(v)[:STAT_CHARS] for k, v in event.stats}
        busy = sum(totals.values())
        if busy == 0:
            continue
        records.append({
            "plane": plane_name, "line": line.name, "events": sum(counts.values()),
            "busy_ms_per_step": round(busy / 1e6 / steps, 3),
            "top": [{"name": name[:STAT_CHARS], "ms_per_step": round(ns / 1e6 / steps, 3),
                     "share": round(ns / busy, 4), "count_per_step": counts[name] / steps, "stats": stats[name]}
                    for name, ns in totals.most_common(top)],
        })
    return records
