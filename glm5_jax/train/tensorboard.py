"""A minimal TensorBoard event-file writer for scalars (no TensorFlow needed).

An event file is a sequence of TFRecords (length, masked CRC32C of the length, payload, masked CRC32C of the
payload) whose payloads are `Event` protocol buffers: wall_time (field 1, double), step (2, int64),
file_version (3, string) or summary (5) holding `Summary.Value` entries of tag (1) and simple_value (2).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint((number << 3) | wire_type) + payload


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def _event(step: int, *, summary: bytes | None = None, file_version: str | None = None) -> bytes:
    event = _field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, _varint(step))
    if file_version is not None:
        event += _length_delimited(3, file_version.encode())
    if summary is not None:
        event += _length_delimited(5, summary)
    return event


class SummaryWriter:
    """Append scalar summaries to `<logdir>/events.out.tfevents.<time>.<host>`."""

    def __init__(self, logdir: str | Path):
        path = Path(logdir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._file = open(self.path, "ab")
        self._write(_event(0, file_version="brain.Event:2"))

    def _write(self, payload: bytes) -> None:
        header = struct.pack("<Q", len(payload))
        self._file.write(header + struct.pack("<I", _masked_crc(header)) + payload
                         + struct.pack("<I", _masked_crc(payload)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
            for tag, v in values.items())
        self._write(_event(step, summary=summary))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """Parse an event file back into (step, tag, value) triples, checking every CRC (for tests and tools)."""
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        header = data[pos:pos + 8]
        if struct.unpack_from("<I", data, pos + 8)[0] != _masked_crc(header):
            raise ValueError(f"{path}: corrupt record header at byte {pos}")
        payload = data[pos + 12: pos + 12 + length]
        if struct.unpack_from("<I", data, pos + 12 + length)[0] != _masked_crc(payload):
            raise ValueError(f"{path}: corrupt record payload at byte {pos}")
        pos += 16 + length
        out.extend(_decode_event(payload))
    return out


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes):
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            length, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        yield number, value


def _decode_event(payload: bytes) -> list[tuple[int, str, float]]:
    step, summary = 0, None
    for number, value in _fields(payload):
        if number == 2:
            step = value
        elif number == 5:
            summary = value
    out = []
    for number, value in _fields(summary or b""):
        if number == 1:
            fields = dict(_fields(value))
            out.append((step, fields[1].decode(), struct.unpack("<f", fields[2])[0]))
    return out
