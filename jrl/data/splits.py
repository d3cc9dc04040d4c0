"""Which records a split reads: its source (a file, a list or a bundled set) and the
held-out rule that divides one source into training and held-out records."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator, Literal

import numpy as np

from jrl.config import DataConfig
from jrl.data.records import bundled_source, is_heldout, iter_located_records, source_files, source_label

Split = Literal["train", "eval"]


Source = str | tuple[str, ...]  # a path, a pattern or a bundled name, or a list of them


def split_source(config: DataConfig, split: Split) -> tuple[Source, bool, str] | None:
    """(source, filter by the held-out rule?, the config field naming the source) for
    `split`, or None if the split is empty."""
    if split == "eval":
        if config.eval_source is not None:
            return config.eval_source, False, "data.eval_source"
        return (config.source, True, "data.source") if config.eval_fraction > 0 else None
    return config.source, config.eval_source is None and config.eval_fraction > 0, "data.source"


def shown_source(source: Source) -> str:
    """A source as messages name it: a path quoted, a list in YAML's flow form."""
    return repr(source) if isinstance(source, str) else source_label(source)


def source_records(config: DataConfig, source: Source, key: str) -> Iterator[tuple[str, dict]]:
    """`(where, record)` for every record of `source`, read as the data pipeline reads it
    (a `.txt` file is a raw-text document for `format: text`)."""
    return iter_located_records(source, config.seed, key, config.format, config.text_field)


# Which records `eval_fraction` holds out, for the cache key of a held-out split's store.
# 2: a held-out record identical to a training record is left out.
HELDOUT_RULE = 2


def record_digest(record: dict) -> int:
    """A 64-bit hash of a record's content (its JSON, keys sorted): equal for identical
    records wherever they stand in the source."""
    text = json.dumps(record, sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _split_of(config: DataConfig, index: int) -> Split:
    return "eval" if is_heldout(index, config.seed, config.eval_fraction) else "train"


def _training_digests(config: DataConfig, source: Source, key: str) -> np.ndarray:
    """The sorted `record_digest`s of the records the held-out rule leaves to training
    (8 bytes a record)."""
    digests = np.fromiter((record_digest(record) for index, (_, record) in enumerate(source_records(config, source, key))
                           if _split_of(config, index) == "train"), np.uint64)
    return np.sort(digests)


def iter_split_records(config: DataConfig, split: Split) -> Iterator[tuple[str, dict]]:
    """`(where, record)` for the records of `split`, in source order: the held-out rule
    counts records across all of the source's files, so it does not depend on how the
    records are spread over them. A record it holds out that is identical to one it leaves
    to training (a duplicate in the source) is left out of the held-out split, which then
    reads the source twice: evaluations measure no record the run trains on."""
    chosen = split_source(config, split)
    if chosen is None:
        return
    source, filtered, key = chosen
    trained = _training_digests(config, source, key) if filtered and split == "eval" else None
    for index, (where, record) in enumerate(source_records(config, source, key)):
        if filtered and _split_of(config, index) != split:
            continue
        if trained is not None:
            digest = np.uint64(record_digest(record))
            at = np.searchsorted(trained, digest)
            if at < len(trained) and trained[at] == digest:
                continue
        yield where, record


def eval_reads_training_records(config: DataConfig) -> list[str]:
    """What `data.eval_source` shares with `data.source`: the files both read (as the
    eval source names them), or the bundled dataset both draw from (`bundled:<name>[:n]`
    gives the first n records of one generator and seed, so a smaller eval set is a part
    of the training set); [] when they share nothing or there is no eval_source."""
    if config.eval_source is None:
        return []
    train, held = bundled_source(config.source), bundled_source(config.eval_source)
    if train is not None or held is not None:
        return [_bundled_name(held)] if train and held and _bundled_name(train) == _bundled_name(held) else []
    trained = {os.path.realpath(f) for f in source_files(config.source, "data.source", config.format)}
    return [f for f in source_files(config.eval_source, "data.eval_source", config.format)
            if os.path.realpath(f) in trained]


def _bundled_name(source: str) -> str:
    """`bundled:<name>` of `bundled:<name>[:<records>]`."""
    return ":".join(source.split(":")[:2])
