"""Token stores: every document's token ids and 'trained' flags in three flat arrays,
in memory or memory-mapped from disk (so corpora larger than RAM can be trained on).

On disk a store is a directory with `tokens.bin` (int32), `train.bin` (uint8),
`offsets.bin` (int64, n_docs + 1 entries) and `meta.json`; it is written into a hidden
sibling directory (`.<store>.staging-<host>-<pid>-<id>`) and published by one rename, so a
crashed preprocessing run never leaves a half-written store that looks complete; a damaged
store a build replaces is moved aside (`.<store>.damaged-<host>-<pid>-<id>`) and removed.
Both names carry the host and pid of the process that made them: one a killed build left
(or whose removal failed) is removed by the next build (`remove_stale_leftovers`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from jrl import leftovers
from jrl.data.encode import Document
from jrl.data.wording import counted

FILES = {"tokens": ("tokens.bin", np.int32), "train": ("train.bin", np.uint8),
         "offsets": ("offsets.bin", np.int64)}


@dataclasses.dataclass(frozen=True)
class TokenStore:
    tokens: np.ndarray  # int32 [total tokens]
    train: np.ndarray  # uint8 [total tokens]
    offsets: np.ndarray  # int64 [n_docs + 1]
    digest: str | None = None  # content_digest, where known (a store an older jrl wrote has none)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.train[a:b]


def _combine(hashes: Iterable[Any]) -> str:
    return hashlib.sha256(b"".join(h.digest() for h in hashes)).hexdigest()[:20]


def content_digest(store: TokenStore) -> str:
    """A fingerprint of what `store` holds: the SHA-256 of its token ids, trained flags and
    document offsets (20 hex digits), so equal documents give equal digests wherever their
    files are and however they were named. Stored in a cached store's meta.json; computed
    (in chunks) for a store without one."""
    if store.digest is not None:
        return store.digest
    hashes = []
    for array in (store.tokens, store.train, store.offsets):
        h, flat = hashlib.sha256(), np.asarray(array).reshape(-1)
        for i in range(0, len(flat), 1 << 24):
            h.update(np.ascontiguousarray(flat[i:i + (1 << 24)]))
        hashes.append(h)
    return _combine(hashes)


def build_store(docs: Iterable[Document]) -> TokenStore:
    """An in-memory store of `docs`."""
    tokens, train, lengths = [], [], [0]
    for ids, trained in docs:
        tokens.append(np.asarray(ids, np.int32))
        train.append(np.asarray(trained, np.uint8))
        lengths.append(len(ids))
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    store = TokenStore(cat(tokens, np.int32), cat(train, np.uint8), np.cumsum(lengths, dtype=np.int64))
    return dataclasses.replace(store, digest=content_digest(store))


# a store being written (staging) or a damaged one moved aside to be removed (damaged);
# an older jrl named them without host and pid
LEFTOVER = re.compile(rf"^\..+\.(?:staging|damaged)-(?:{leftovers.OWNER}|[0-9a-f]{{32}})$")


def _hidden_name(directory: Path, kind: str) -> Path:
    """A fresh hidden sibling of `directory` of `kind` (staging or damaged) naming this
    process (`LEFTOVER`)."""
    return directory.parent / leftovers.owned_name(f".{directory.name}.{kind}-")


def remove_stale_leftovers(parent: str | os.PathLike, now: float | None = None) -> list[Path]:
    """Removes the hidden directories in `parent` that a build left behind, and returns
    them: staging directories of a killed build and damaged stores moved aside whose
    removal did not finish (killed, or files another process still held). One of a live
    process of this host (writing it, or about to remove it) is never touched
    (`jrl.leftovers.remove_stale`)."""
    return leftovers.remove_stale(parent, LEFTOVER, now)


class StoreWriteError(OSError):
    """A token store could not be written (the disk filled up, a quota, a file size limit,
    no permission): nothing of it was published."""


def write_store(directory: str | os.PathLike, docs: Iterable[Document],
                meta: dict[str, Any] | Callable[[], dict[str, Any]]) -> Path:
    """Streams `docs` to disk as a store at `directory` (atomically published), with
    `meta` in its meta.json: a dict, or a function called once `docs` is exhausted (for
    what only reading them tells). A complete store another process published at
    `directory` meanwhile (two runs building the same cache) is kept and this copy
    dropped, so a process reading that store never sees it deleted; a damaged one is
    replaced. A write that fails (disk full, no permission) raises StoreWriteError naming
    the store and the file, with nothing left behind; staging directories a killed build
    left beside it, and damaged stores left moved aside, are removed first
    (`remove_stale_leftovers`)."""
    directory = Path(directory)
    staging = _hidden_name(directory, "staging")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_leftovers(directory.parent)
        staging.mkdir()
    except OSError as e:
        if isinstance(e, FileExistsError) and not directory.parent.is_dir():  # a file where the cache_dir goes
            raise StoreWriteError(f"data.cache_dir: cannot write the token store {directory}: {directory.parent} "
                                  f"is a file, not a directory") from None
        raise StoreWriteError(f"data.cache_dir: cannot write the token store {directory}: "
                              f"{e.strerror or e} ({e.filename or staging})") from None
    try:
        n_docs, n_tokens = 0, 0
        hashes = [hashlib.sha256() for _ in FILES]  # content_digest, as the files are written
        with open(staging / FILES["tokens"][0], "wb") as ft, open(staging / FILES["train"][0], "wb") as fm, \
                open(staging / FILES["offsets"][0], "wb") as fo:
            files = (ft, fm, fo)
            write = lambda i, data: (files[i].write(data), hashes[i].update(data))
            write(2, np.zeros(1, np.int64).tobytes())
            for ids, trained in docs:
                write(0, np.asarray(ids, np.int32).tobytes())
                write(1, np.asarray(trained, np.uint8).tobytes())
                n_tokens += len(ids)
                n_docs += 1
                write(2, np.asarray([n_tokens], np.int64).tobytes())
            for f in files:
                f.flush()
                os.fsync(f.fileno())
        info = {**(meta() if callable(meta) else meta), "n_docs": n_docs, "n_tokens": n_tokens,
                "digest": _combine(hashes)}
        (staging / "meta.json").write_text(json.dumps(info, indent=1) + "\n")
        _publish(staging, directory)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, StoreWriteError):
            raise
        where = f" ({e.filename})" if e.filename else ""
        raise StoreWriteError(f"data.cache_dir: cannot write the token store {directory}: "
                              f"{e.strerror or e}{where}; nothing of it was kept") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _publish(staging: Path, directory: Path) -> None:
    """Renames `staging` to `directory`. Where `directory` already exists it is kept if it
    is a complete store (another process published the same store first: readers may have
    it open) and `staging` is removed; a damaged one is moved aside and removed."""
    try:
        os.rename(staging, directory)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    try:
        open_store(directory)
        shutil.rmtree(staging, ignore_errors=True)  # theirs is complete: keep it
        return
    except (CorruptStoreError, FileNotFoundError):
        pass
    aside = _hidden_name(directory, "damaged")  # if left (killed, or not removable yet): the next build's
    try:
        os.rename(directory, aside)
        os.utime(aside)  # moved aside now: another host's build waits leftovers.STALE_AFTER_S from here
    except FileNotFoundError:
        pass
    try:
        os.rename(staging, directory)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # another process published in between
    shutil.rmtree(aside, ignore_errors=True)


class CorruptStoreError(ValueError):
    """A token store's files do not hold what its meta.json says (e.g. a truncated file)."""


def open_store(directory: str | os.PathLike) -> TokenStore:
    """A store whose arrays are read-only memory maps of the files in `directory`. A file
    whose size is not what meta.json's counts give (cut short, missing) raises
    CorruptStoreError naming it."""
    directory = Path(directory)
    if not (directory / "meta.json").is_file():
        raise FileNotFoundError(f"{directory} is not a token store (no meta.json)")
    try:
        meta = json.loads((directory / "meta.json").read_text())
        counts = {"tokens": int(meta["n_tokens"]), "train": int(meta["n_tokens"]), "offsets": int(meta["n_docs"]) + 1}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptStoreError(f"{directory / 'meta.json'}: unreadable ({e})") from None
    arrays = {}
    for key, (name, dtype) in FILES.items():
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        expected = counts[key] * np.dtype(dtype).itemsize
        if size != expected:
            raise CorruptStoreError(f"{path}: {'missing' if size is None else counted(size, 'byte')}, "
                                    f"expected {expected:,} (meta.json: {counted(counts['offsets'] - 1, 'document')}, "
                                    f"{counted(counts['tokens'], 'token')})")
        arrays[key] = (np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size
                       else np.zeros(0, dtype))
    digest = meta.get("digest")
    return TokenStore(**arrays, digest=digest if isinstance(digest, str) else None)
