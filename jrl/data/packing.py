"""Documents -> fixed-length rows: truncation / splitting, packing, and row assembly.

A row of `seq_len` slots holds one or more document pieces back to back, then padding:

    tokens       the piece's tokens; pad_id in padding
    targets      the next token of the same piece (pad_id at a piece's last slot)
    loss_mask    1.0 where the target is a trained token of the same piece, else 0.0
    positions    0, 1, 2, ... restarting at every piece; 0 in padding
    segment_ids  1, 2, 3, ... one per piece; 0 in padding

so attention masked by equal segment ids never crosses documents, and no target ever
comes from another document. Packing is greedy in document order (deterministic); a
piece that does not fit in the current row starts a new one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jrl.data.store import TokenStore

ROW_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


def doc_pieces(length: int, seq_len: int, overflow: str) -> list[tuple[int, int]]:
    """`(start, length)` pieces of a document of `length` tokens under `overflow`:
    `truncate_right` keeps the first `seq_len` tokens, `truncate_left` the last ones,
    `drop` skips long documents, `split` cuts them into consecutive windows that overlap
    by one token, so every target of the document is trained exactly once."""
    if length <= seq_len:
        return [(0, length)]
    if overflow == "truncate_right":
        return [(0, seq_len)]
    if overflow == "truncate_left":
        return [(length - seq_len, seq_len)]
    if overflow == "drop":
        return []
    if overflow == "split":
        pieces, start = [], 0
        while start < length - 1:
            pieces.append((start, min(seq_len, length - start)))
            start += seq_len - 1
        return pieces
    raise ValueError(f"data.overflow: unknown value {overflow!r}")


def keeps_a_trained_target(train: np.ndarray, seq_len: int, overflow: str, *, pack: bool = False,
                           first_piece: bool = False) -> bool:
    """Whether a document with these trained flags keeps a trained target in its rows
    once `overflow` has cut it (`first_piece`: only its first piece is used, as for a
    preference pair). A piece's first token is never a target; pieces of fewer than 2
    tokens are left out (`plan_rows`)."""
    train = np.asarray(train)
    if pack and overflow == "split":  # every target of the document is trained once
        return bool(train[1:].any())
    pieces = doc_pieces(len(train), seq_len, overflow)[:1 if first_piece else None]
    return any(bool(train[a + 1:a + n].any()) for a, n in pieces if n >= 2)


def trained_targets_kept(store: TokenStore, seq_len: int, overflow: str, *, pack: bool = False,
                         first_piece: bool = False, chunk_tokens: int = 1 << 24) -> np.ndarray:
    """`keeps_a_trained_target` of every document of `store` (bool `[n_docs]`), vectorised:
    what `overflow` keeps of a document's targets is one range of it, so the count of
    trained targets in it is a difference of a running sum of the trained flags, taken
    over at most `chunk_tokens` tokens at a time (a memory-mapped store is never read
    into memory whole). `first_piece` as for `keeps_a_trained_target`."""
    lengths = np.asarray(store.lengths, np.int64)
    offsets = np.asarray(store.offsets, np.int64)
    lo, hi = np.ones_like(lengths), lengths.copy()  # targets lo..hi-1 (a piece's first token is none)
    cut = lengths > seq_len
    if overflow == "truncate_right" or (overflow == "split" and first_piece and not pack):
        hi[cut] = seq_len
    elif overflow == "truncate_left":
        lo[cut] = lengths[cut] - seq_len + 1
    elif overflow == "drop":
        hi[cut] = 0
    elif overflow != "split":  # split (packed or not): windows overlapping by one train every target
        raise ValueError(f"data.overflow: unknown value {overflow!r}")
    lo = np.minimum(lo, lengths)
    hi = np.maximum(np.minimum(hi, lengths), lo)
    out = np.zeros(len(lengths), bool)
    d, n = 0, len(lengths)
    while d < n:
        e = min(n, max(d + 1, int(np.searchsorted(offsets, offsets[d] + chunk_tokens, side="right")) - 1))
        running = np.concatenate([[0], np.cumsum(np.asarray(store.train[offsets[d]:offsets[e]]) != 0, dtype=np.int64)])
        base = offsets[d:e] - offsets[d]
        out[d:e] = running[base + hi[d:e]] > running[base + lo[d:e]]
        d = e
    return out


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Which document pieces make up each row (flat arrays; row r owns pieces
    `row_ptr[r]:row_ptr[r + 1]`)."""

    row_ptr: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.row_ptr) - 1


def plan_rows(lengths: np.ndarray, seq_len: int, *, pack: bool, overflow: str) -> RowPlan:
    """Greedy packing plan over documents of `lengths` (pieces shorter than 2 tokens,
    which have no target, are left out). With `pack` and `overflow="split"` a long
    document fills the rest of the current row and continues in the next one (again
    overlapping by one token), so rows are full: the usual pretraining layout."""
    row_ptr, docs, starts, lens = [0], [], [], []
    used = 0

    def add(d: int, start: int, n: int) -> None:
        nonlocal used
        if used and (not pack or used + n > seq_len):
            row_ptr.append(len(docs))
            used = 0
        docs.append(d)
        starts.append(start)
        lens.append(n)
        used += n

    fill = pack and overflow == "split"
    for d, length in enumerate(np.asarray(lengths).tolist()):
        length = int(length)
        if fill:
            start = 0
            while length - start >= 2:
                if seq_len - used < 2:
                    row_ptr.append(len(docs))
                    used = 0
                n = min(seq_len - used, length - start)
                add(d, start, n)
                start += n - 1
                if start + 1 >= length:
                    break
            continue
        for start, n in doc_pieces(length, seq_len, overflow):
            if n >= 2:
                add(d, start, n)
    if used:
        row_ptr.append(len(docs))
    as64 = lambda x: np.asarray(x, np.int64)
    return RowPlan(as64(row_ptr), as64(docs), as64(starts), as64(lens))


def plan_rows_first_fit(lengths: np.ndarray, seq_len: int) -> RowPlan:
    """Tighter packing of whole documents (each <= `seq_len` tokens) when their order in a
    row does not matter: first fit decreasing, longest first (ties: document order), each
    into the first row with room. Within a row documents keep their order; documents of
    fewer than 2 tokens are left out. Deterministic."""
    lengths = np.asarray(lengths, np.int64)
    if (lengths > seq_len).any():
        raise ValueError(f"lengths: a document of {int(lengths.max())} tokens does not fit seq_len={seq_len}")
    rows: list[list[int]] = []
    used: list[int] = []
    for d in sorted((d for d in range(len(lengths)) if lengths[d] >= 2), key=lambda d: (-lengths[d], d)):
        r = next((r for r in range(len(rows)) if used[r] + lengths[d] <= seq_len), len(rows))
        if r == len(rows):
            rows.append([])
            used.append(0)
        rows[r].append(d)
        used[r] += int(lengths[d])
    docs = [d for row in rows for d in sorted(row)]
    row_ptr = np.cumsum([0] + [len(row) for row in rows])
    return RowPlan(np.asarray(row_ptr, np.int64), np.asarray(docs, np.int64), np.zeros(len(docs), np.int64),
                   lengths[np.asarray(docs, np.int64)] if docs else np.zeros(0, np.int64))


def _empty(shape: tuple[int, ...], pad_id: int) -> dict[str, np.ndarray]:
    return {
        "tokens": np.full(shape, pad_id, np.int32),
        "targets": np.full(shape, pad_id, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "positions": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
    }


def _put(out: dict, where: tuple, offset: int, ids: np.ndarray, train: np.ndarray, segment: int) -> None:
    n = len(ids)
    sl = where + (slice(offset, offset + n),)
    out["tokens"][sl] = ids
    out["targets"][where + (slice(offset, offset + n - 1),)] = ids[1:]
    out["loss_mask"][where + (slice(offset, offset + n - 1),)] = train[1:]
    out["positions"][sl] = np.arange(n, dtype=np.int32)
    out["segment_ids"][sl] = segment


def assemble_rows(store: TokenStore, plan: RowPlan, rows: np.ndarray, seq_len: int,
                  pad_id: int) -> dict[str, np.ndarray]:
    """The fields of `rows` (indices into `plan`), each `[len(rows), seq_len]`."""
    out = _empty((len(rows), seq_len), pad_id)
    for i, r in enumerate(np.asarray(rows).tolist()):
        offset = 0
        for k in range(int(plan.row_ptr[r]), int(plan.row_ptr[r + 1])):
            ids, train = store.doc(int(plan.doc[k]))
            a, n = int(plan.start[k]), int(plan.length[k])
            _put(out, (i,), offset, ids[a:a + n], train[a:a + n], k - int(plan.row_ptr[r]) + 1)
            offset += n
    return out


@dataclasses.dataclass(frozen=True)
class PairPlan:
    """Preference pairs kept after overflow handling: pair p is documents
    `2 * pair[p]` (chosen) and `2 * pair[p] + 1` (rejected), cut to `start/length [P, 2]`."""

    pair: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.pair)


def plan_pairs(lengths: np.ndarray, seq_len: int, *, overflow: str) -> PairPlan:
    lengths = np.asarray(lengths)
    if len(lengths) % 2:
        raise ValueError(f"preference data must hold an even number of documents, got {len(lengths)}")
    pairs, starts, lens = [], [], []
    for p in range(len(lengths) // 2):
        cut = [doc_pieces(int(lengths[2 * p + j]), seq_len, overflow) for j in (0, 1)]
        if not all(cut) or any(c[0][1] < 2 for c in cut):
            continue
        pairs.append(p)
        starts.append([cut[0][0][0], cut[1][0][0]])
        lens.append([cut[0][0][1], cut[1][0][1]])
    shape2 = lambda x: np.asarray(x, np.int64).reshape(-1, 2)
    return PairPlan(np.asarray(pairs, np.int64), shape2(starts), shape2(lens))


def assemble_pairs(store: TokenStore, plan: PairPlan, rows: np.ndarray, seq_len: int,
                   pad_id: int) -> dict[str, np.ndarray]:
    """The fields of pair rows, each `[len(rows), 2, seq_len]` (0: chosen, 1: rejected)."""
    out = _empty((len(rows), 2, seq_len), pad_id)
    for i, r in enumerate(np.asarray(rows).tolist()):
        for j in (0, 1):
            ids, train = store.doc(2 * int(plan.pair[r]) + j)
            a, n = int(plan.start[r, j]), int(plan.length[r, j])
            _put(out, (i, j), 0, ids[a:a + n], train[a:a + n], 1)
    return out
