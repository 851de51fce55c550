"""The block map's model: one state per block, aggregated into screen cells.

Pure numpy, no Textual: the app builds it off the event loop and the benchmark times it.
Cost is O(blocks) vectorised work per snapshot (a table lookup, one ``bincount``), so a
1,000,000-block pool takes a few milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagectl.engine.telemetry import RequestRow

# Block states, in the order of the legend. Shared blocks are split by refcount.
FREE, CACHED, USED, PARTIAL, SHARED2, SHARED3, SHARED5, SHARED9 = range(8)
NUM_STATES = 8
STATE_LABELS = (
    "free",
    "cached",
    "in use",
    "partial",
    "shared ×2",
    "shared ×3-4",
    "shared ×5-8",
    "shared ×9+",
)

# Cell glyph codes: occupancy levels of an aggregated cell, then the exact-block glyphs.
G_EMPTY, G_QUARTER, G_HALF, G_THREE_QUARTERS, G_FULL, G_PARTIAL = range(6)

# refcount -> state for a block that is not cached (refcount 0 -> FREE, fixed up for hashed).
_REF_LUT = np.empty(256, dtype=np.uint8)
_REF_LUT[0] = FREE
_REF_LUT[1] = USED
_REF_LUT[2] = SHARED2
_REF_LUT[3:5] = SHARED3
_REF_LUT[5:9] = SHARED5
_REF_LUT[9:] = SHARED9


def seq_id(row: RequestRow) -> str:
    """The engine's name for one sequence: ``id`` for index 0, ``id#i`` for the other
    samples, ``id#b<k>`` for a forked beam (an older daemon's rows name no beams)."""
    if row.seq_id:
        return row.seq_id
    return row.request_id if row.index == 0 else f"{row.request_id}#{row.index}"


def block_ids(row: RequestRow) -> np.ndarray:
    """A row's block table as uint32 block ids, in token order."""
    return np.frombuffer(row.block_ids, dtype="<u4")


def classify(
    ref_counts: bytes, hashed: bytes, rows: Sequence[RequestRow], block_size: int
) -> np.ndarray:
    """One state per block (uint8, indexed by block id)."""
    ref = np.frombuffer(ref_counts, dtype=np.uint8)
    states = _REF_LUT[ref]
    if len(hashed):
        h = np.frombuffer(hashed, dtype=np.uint8)
        # refcount 0 and registered in the prefix cache: cached (FREE + 1).
        states += (h != 0) & (ref == 0)
    # The blocks of a table past its last full block hold fewer than block_size live tokens.
    tails = []
    for r in rows:
        if r.num_blocks:
            full = r.num_computed_tokens // block_size
            tails.append(r.block_ids[full * 4 :])
    if tails:
        ids = np.frombuffer(b"".join(tails), dtype="<u4")
        ids = ids[ids < len(states)]
        ids = ids[states[ids] == USED]  # a shared partial block stays "shared"
        states[ids] = PARTIAL
    return states


_NICE_STEPS = (1, 2, 5)


def nice_ceil(x: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that is >= x."""
    if x <= 1:
        return 1
    exp = 10 ** int(math.floor(math.log10(x)))
    for step in (*_NICE_STEPS, 10):
        if step * exp >= x:
            return step * exp
    return 10 * exp


def nice_steps_around(per: int) -> tuple[int, int]:
    """(next finer, next coarser) nice cell size around ``per`` (finer never below 1)."""
    finer = 1
    k = 1
    while k < per:
        finer = k
        k = nice_ceil(k + 1)
    coarser = nice_ceil(per + 1)
    return finer, coarser


@dataclass(frozen=True)
class CellLayout:
    """How the pool maps onto the screen: ``per`` blocks per cell, ``cols`` cells per row."""

    num_blocks: int
    per: int
    cols: int
    # Characters per cell (1; 2 or 3 for a small pool: the glyph, doubled at 3, and a gap)
    # and the gutter's width.
    cell_width: int
    gutter: int

    @property
    def num_cells(self) -> int:
        return -(-self.num_blocks // self.per)

    @property
    def rows(self) -> int:
        return max(1, -(-self.num_cells // self.cols))

    @property
    def width(self) -> int:
        return self.gutter + self.cols * self.cell_width

    def block_range(self, cell: int) -> tuple[int, int]:
        """First and last block (inclusive) of a cell."""
        first = cell * self.per
        return first, min(self.num_blocks, first + self.per) - 1

    def cell_of(self, block_id: int) -> int:
        return block_id // self.per


def fit_layout(num_blocks: int, width: int, height: int, per: int | None = None) -> CellLayout:
    """Lay the pool out in ``width`` x ``height`` characters.

    With ``per`` None the whole pool fits on screen: one block per cell (two characters wide
    when there is room) or, when blocks outnumber cells, the smallest nice aggregation
    (1, 2, 5, 10, 20, ... blocks per cell). An explicit ``per`` (zoom) may need scrolling.
    """
    n = max(1, num_blocks)
    gutter = len(f"{n - 1:,}") + 1
    avail = max(1, width - gutter)
    height = max(1, height)
    if per is None or per <= 1:
        # One block per cell: as wide a cell as fits the whole pool (3 = a square-ish
        # two-character block and a gap), down to 2; an explicit zoom to 1 takes 2 and scrolls.
        for cell_width in (3, 2):
            cols = avail // cell_width
            if cols >= 1 and (n <= cols * height or (per == 1 and cell_width == 2)):
                return CellLayout(num_blocks, 1, _round_cols(cols), cell_width, gutter)
    cols = _round_cols(avail)
    if per is None:
        per = nice_ceil(n / (cols * height))
    return CellLayout(num_blocks, max(1, per), cols, 1, gutter)


def _round_cols(cols: int) -> int:
    """Whole tens (fives for narrow grids) of cells per row: round row-start block numbers."""
    if cols >= 40:
        return cols // 10 * 10
    return cols // 5 * 5 if cols >= 10 else max(1, cols)


@dataclass
class Cells:
    """Per-cell glyph and colour (a block state) for one layout; counts when aggregated."""

    per: int
    glyphs: np.ndarray
    colors: np.ndarray
    # (num_cells, NUM_STATES) blocks per state per cell; None when per == 1.
    counts: np.ndarray | None


# Cache of the (cell index * NUM_STATES) array used to bincount a given (blocks, per) shape.
_BASE_CACHE: dict[tuple[int, int], np.ndarray] = {}


def _cell_base(n: int, per: int) -> np.ndarray:
    key = (n, per)
    base = _BASE_CACHE.get(key)
    if base is None:
        if len(_BASE_CACHE) > 8:
            _BASE_CACHE.clear()
        ncells = -(-n // per)
        base = np.repeat(np.arange(ncells, dtype=np.int32) * NUM_STATES, per)[:n]
        _BASE_CACHE[key] = base
    return base


def aggregate(states: np.ndarray, per: int) -> Cells:
    """Fold block states into cells of ``per`` blocks.

    An aggregated cell's glyph shows how full it is (any state but free, in quarters) and its
    colour the most common non-free state (shared blocks count as one group, shaded by the
    highest refcount present). Ties go to the busier state: shared, in use, partial, cached.
    """
    n = len(states)
    if per <= 1:
        glyphs = np.where(states == FREE, G_EMPTY, G_FULL).astype(np.uint8)
        glyphs[states == PARTIAL] = G_PARTIAL
        return Cells(1, glyphs, states.copy(), None)
    ncells = -(-n // per)
    counts = np.bincount(_cell_base(n, per) + states, minlength=ncells * NUM_STATES)
    counts = counts.reshape(ncells, NUM_STATES)
    sizes = np.full(ncells, per, dtype=np.int64)
    sizes[-1] = n - per * (ncells - 1)
    busy = sizes - counts[:, FREE]
    # 0 -> empty; (0, 1/4] -> quarter; ... ; (3/4, 1] -> full.
    glyphs = np.ceil(busy * 4 / sizes).astype(np.uint8)
    shared = counts[:, SHARED2:].sum(axis=1)
    groups = np.stack([shared, counts[:, USED], counts[:, PARTIAL], counts[:, CACHED]], axis=1)
    winner = np.argmax(groups, axis=1)
    shade = np.where(
        counts[:, SHARED9] > 0,
        SHARED9,
        np.where(
            counts[:, SHARED5] > 0, SHARED5, np.where(counts[:, SHARED3] > 0, SHARED3, SHARED2)
        ),
    )
    group_state = np.array([SHARED2, USED, PARTIAL, CACHED], dtype=np.uint8)[winner]
    colors = np.where(winner == 0, shade, group_state).astype(np.uint8)
    colors[busy == 0] = FREE
    return Cells(per, glyphs, colors, counts)


def state_counts(states: np.ndarray, first: int, last: int) -> list[int]:
    """Blocks per state in [first, last]."""
    return np.bincount(states[first : last + 1], minlength=NUM_STATES).tolist()


@dataclass(frozen=True)
class Owner:
    """A sequence holding blocks in a range."""

    seq_id: str
    # Blocks of the range it holds, and the position in its table of the first of them.
    num_blocks: int
    first_position: int
    # The sequence's num_computed_tokens (how far its table holds live tokens).
    num_computed_tokens: int

    def fill(self, block_size: int) -> int:
        """Live tokens this sequence has in the first block of the range it holds."""
        return max(0, min(block_size, self.num_computed_tokens - self.first_position * block_size))


def owners_in_range(rows: Sequence[RequestRow], first: int, last: int) -> list[Owner]:
    """Sequences whose block tables hold a block in [first, last], in table order."""
    out = []
    for r in rows:
        if not r.num_blocks:
            continue
        ids = block_ids(r)
        hit = np.nonzero((ids >= first) & (ids <= last))[0]
        if len(hit):
            out.append(Owner(seq_id(r), len(hit), int(hit[0]), r.num_computed_tokens))
    return out
