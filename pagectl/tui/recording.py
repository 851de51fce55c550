"""The telemetry recording format written by ``pagectl top --record FILE``.

A recording is a stream of telemetry frames exactly as they arrived, each with its receive
time, so that ``--replay`` shows an incident as the operator saw it.

Layout (all integers little-endian)::

    magic   8 bytes   b"PCTLREC1"
    record  repeated:
        received_at  float64   time.time() when the console received the frame
        codec        uint8     0 = raw, 1 = zlib
        length       uint32    bytes that follow
        payload      length    msgpack(TelemetrySnapshot), compressed per ``codec``

A truncated last record (the console was killed mid-write) is ignored on reading. zlib (level 1)
is cheap and shrinks a large pool's frame several times over: the 1,000,000-block frame of
``benchmarks/tui_render.py`` goes from 4.4 MB to 0.88 MB (its block tables compress least).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import BinaryIO

MAGIC = b"PCTLREC1"
_HEADER = struct.Struct("<dBI")
CODEC_RAW = 0
CODEC_ZLIB = 1


class RecordWriter:
    """Appends frames to a recording file. Not thread-safe: one writer thread at a time."""

    def __init__(self, path: str, *, compress: bool = True) -> None:
        self.path = path
        self.compress = compress
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(MAGIC)
        self._file.flush()

    def write(self, received_at: float, data: bytes) -> None:
        codec = CODEC_RAW
        if self.compress:
            data = zlib.compress(data, 1)
            codec = CODEC_ZLIB
        self._file.write(_HEADER.pack(received_at, codec, len(data)))
        self._file.write(data)
        # Flushed per frame so that a killed console leaves a readable file.
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RecordingIndex:
    """Offsets and receive times of every complete record in a file (headers only are read)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offsets: list[int] = []
        self.times: list[float] = []
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{path} is not a pagectl telemetry recording")
            pos = len(MAGIC)
            f.seek(0, 2)
            end = f.tell()
            while pos + _HEADER.size <= end:
                f.seek(pos)
                t, _codec, n = _HEADER.unpack(f.read(_HEADER.size))
                if pos + _HEADER.size + n > end:
                    break  # truncated tail
                self.offsets.append(pos)
                self.times.append(t)
                pos += _HEADER.size + n

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, f: BinaryIO, i: int) -> tuple[float, bytes]:
        """Record ``i`` as (received_at, msgpack frame); ``f`` is the file opened "rb"."""
        f.seek(self.offsets[i])
        t, codec, n = _HEADER.unpack(f.read(_HEADER.size))
        payload = f.read(n)
        if codec == CODEC_ZLIB:
            payload = zlib.decompress(payload)
        elif codec != CODEC_RAW:
            raise ValueError(f"unknown codec {codec} in record {i}")
        return t, payload


def read_recording(path: str) -> Iterator[tuple[float, bytes]]:
    """Every (received_at, frame) of a recording, in order."""
    index = RecordingIndex(path)
    with open(path, "rb") as f:
        for i in range(len(index)):
            yield index.read(f, i)
