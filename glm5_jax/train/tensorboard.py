"""TensorBoard scalars through tensorboardX, with resumed runs that do not repeat steps.

A resumed run starts its event file with TensorBoard's purge marker (a `SessionLog.START` event at the first
step it will log): TensorBoard then drops every earlier-written point at or after that step, the ones a
crashed run logged past its last checkpoint, so each step is drawn once. `read_scalars` applies the same rule.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

# tensorboardX imports torch whenever torch is installed (the test extra brings it), only to accept torch
# tensors, which this module never passes: a second of start-up and a few hundred MB in every process that
# logs. While tensorboardX loads, `import torch` fails unless something had loaded torch already.
_HIDE_TORCH = "torch" not in sys.modules
if _HIDE_TORCH:
    sys.modules["torch"] = None  # type: ignore[assignment]
try:
    from tensorboardX import SummaryWriter as _TensorboardXWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.record_writer import masked_crc32c
finally:
    if _HIDE_TORCH:
        del sys.modules["torch"]


class SummaryWriter:
    """Scalars for one run (or one resumed leg of it) under `logdir`; `first_step` > 1 marks a resume."""

    def __init__(self, logdir: str | Path, *, first_step: int = 1):
        # Unique, ordered file names: legs started within one second must not overwrite each other.
        self._writer = _TensorboardXWriter(str(logdir), purge_step=first_step if first_step > 1 else None,
                                           filename_suffix=f".{first_step:010d}.{os.getpid()}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _records(path: Path):
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        header, payload = data[pos:pos + 8], data[pos + 12:pos + 12 + length]
        if (struct.unpack_from("<I", data, pos + 8)[0] != masked_crc32c(header)
                or struct.unpack_from("<I", data, pos + 12 + length)[0] != masked_crc32c(payload)):
            raise ValueError(f"{path}: corrupt record at byte {pos}")
        pos += 16 + length
        yield Event.FromString(payload)


def read_scalars(logdir: str | Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) as TensorBoard shows them: files in write order, purge markers applied."""
    points: list[tuple[int, str, float]] = []
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for event in _records(path):
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                points = [point for point in points if point[0] < event.step]
            for value in event.summary.value:
                points.append((event.step, value.tag, value.simple_value))
    return points
