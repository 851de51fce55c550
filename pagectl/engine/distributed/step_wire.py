"""The per-step message from rank 0 to the other ranks, as two int64 tensors.

Each message is one broadcast of a fixed-size header, then (when the header says so) one
broadcast of a payload: never a pickled object. Header fields (int64):

    [op, T rows, S sequences, W block-table width, R logits rows, C block copies,
     num_decodes, has token_seq_lens, payload length]

A step's payload is every ``StepArrays`` field and the copy-on-write pairs, concatenated:

    token_ids[T] positions[T] slot_mapping[T] query_start_loc[S+1] seq_lens[S]
    block_tables[S*W] logits_rows[R] copies[2C] token_seq_lens[T, if flagged]

A step with copies but no sequences has S = T = 0 (only the copies travel). ``OP_ENGINE``
carries a JSON document (uint8 payload) describing the engine to build.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagectl.engine.runner.input_batch import StepArrays

OP_STEP = 1
OP_ENGINE = 2
OP_END_ENGINE = 3
OP_SHUTDOWN = 4

HEADER_LEN = 9
_I64 = np.int64


def pack_step(
    arrays: StepArrays | None, copies: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """Header and payload for one step (``arrays`` None: block copies only)."""
    pairs = np.asarray(copies, _I64).reshape(-1)
    if arrays is None:
        header = np.array([OP_STEP, 0, 0, 0, 0, len(copies), 0, 0, len(pairs)], _I64)
        return header, pairs
    a = arrays
    tables = a.block_tables
    parts = [
        a.token_ids,
        a.positions,
        a.slot_mapping,
        a.query_start_loc,
        a.seq_lens,
        tables.reshape(-1),
        a.logits_rows,
        pairs,
    ]
    if a.token_seq_lens is not None:
        parts.append(a.token_seq_lens)
    payload = np.concatenate(parts).astype(_I64, copy=False)
    header = np.array(
        [
            OP_STEP,
            len(a.token_ids),
            len(a.seq_lens),
            tables.shape[1],
            len(a.logits_rows),
            len(copies),
            a.num_decodes,
            a.token_seq_lens is not None,
            len(payload),
        ],
        _I64,
    )
    return header, payload


def unpack_step(
    header: np.ndarray, payload: np.ndarray
) -> tuple[StepArrays | None, list[tuple[int, int]]]:
    """Inverse of ``pack_step`` (the arrays are views into ``payload``)."""
    _, t, s, w, r, c, num_decodes, has_tsl, _ = (int(v) for v in header)
    sizes = [t, t, t, s + 1 if s else 0, s, s * w, r, 2 * c, t if has_tsl else 0]
    bounds = np.cumsum([0, *sizes])
    parts = [payload[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    copies = [(int(a), int(b)) for a, b in parts[7].reshape(-1, 2).tolist()]
    if s == 0:
        return None, copies
    arrays = StepArrays(
        token_ids=parts[0],
        positions=parts[1],
        slot_mapping=parts[2],
        query_start_loc=parts[3],
        seq_lens=parts[4],
        block_tables=parts[5].reshape(s, w),
        logits_rows=parts[6],
        num_decodes=num_decodes,
        token_seq_lens=parts[8] if has_tsl else None,
    )
    return arrays, copies


def control_header(op: int, payload_len: int = 0) -> np.ndarray:
    header = np.zeros(HEADER_LEN, _I64)
    header[0] = op
    header[-1] = payload_len
    return header


class StepChannel:
    """Broadcasts from rank 0 over ``group`` (a gloo group: host tensors, no device copy)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)

    def send(self, header: np.ndarray, payload: np.ndarray | bytes = b"") -> None:
        """Rank 0: one header broadcast, then the payload's (int64 array or raw bytes)."""
        import torch.distributed as dist

        dist.broadcast(torch.from_numpy(header), 0, group=self.group)
        if int(header[-1]):
            if isinstance(payload, bytes):
                t = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            else:
                t = torch.from_numpy(np.ascontiguousarray(payload))
            dist.broadcast(t, 0, group=self.group)

    def recv(self) -> tuple[np.ndarray, np.ndarray | bytes]:
        """Other ranks: the next header and its payload (bytes for ``OP_ENGINE``)."""
        import torch.distributed as dist

        dist.broadcast(self._header, 0, group=self.group)
        header = self._header.numpy().copy()
        n = int(header[-1])
        if int(header[0]) == OP_ENGINE:
            raw = torch.empty(n, dtype=torch.uint8)
            if n:
                dist.broadcast(raw, 0, group=self.group)
            return header, raw.numpy().tobytes()
        payload = torch.empty(n, dtype=torch.int64)
        if n:
            dist.broadcast(payload, 0, group=self.group)
        return header, payload.numpy()
