"""From a `DataConfig` to batches: tokenise (optionally into a memory-mapped cache),
split off the held-out records, pack into rows, sample batches resumably."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from array import array
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from jrl.config import ConfigError, DataConfig, to_dict
from jrl.data.bundled import generator_version
from jrl.data.diagnostics import Repeated, Truncated, Untrained, locate_document, locate_record
from jrl.data.encode import Document, encode_record
from jrl.data.packing import PairPlan, RowPlan, assemble_pairs, assemble_rows, plan_pairs, plan_rows
from jrl.data.records import bundled_source, source_files, source_label
from jrl.data.sampler import EpochSampler
from jrl.data.splits import HELDOUT_RULE, Split, iter_split_records, shown_source, source_records, split_source
from jrl.data.store import CorruptStoreError, TokenStore, build_store, content_digest, open_store, write_store
from jrl.data.text import Tokenizer
from jrl.data.wording import agree


def iter_documents(config: DataConfig, tokenizer: Tokenizer, split: Split,
                   untrained: Untrained | None = None, truncated: Truncated | None = None,
                   repeated: Repeated | None = None) -> Iterator[Document]:
    """The documents of `split`, in source order; `untrained`, `truncated` and `repeated`
    (when given) note the records that train nothing, the documents `data.overflow` cuts
    and the records that repeat an earlier one."""
    for where, record in iter_split_records(config, split):
        docs = encode_record(record, config, tokenizer, where=where)
        if untrained is not None:
            untrained.note(where, record, docs, config)
        if truncated is not None:
            truncated.note(where, docs)
        if repeated is not None:
            repeated.note(docs)
        yield from docs


class CheckedSplit(NamedTuple):
    """What a dry run's check read of a split: its source (as written; a list in YAML's
    flow form), records, document tokens, the rows they plan into and the files read (1
    for a bundled source, generated as the run generates it)."""

    source: str
    records: int
    tokens: int
    rows: int
    files: int


def check_records(config: DataConfig, tokenizer: Tokenizer, split: Split) -> CheckedSplit | None:
    """The `CheckedSplit` of `split` after encoding every record and planning its rows as
    the run will, keeping only document lengths: a dry run's check, so a bad record
    (file:line, field) or data that gives no rows fails with the run's error before the
    run starts. None where the split is empty by config."""
    chosen = split_source(config, split)
    if chosen is None:
        return None
    source, _, key = chosen
    files = len(source_files(source, key, config.format))
    lengths = array("q")
    untrained, truncated, repeated = Untrained.of(config), Truncated.of(config), Repeated.of(config)
    for ids, _ in iter_documents(config, tokenizer, split, untrained, truncated, repeated):
        lengths.append(len(ids))
    lengths = np.frombuffer(lengths, np.int64)
    plan = plan_split(config, split, lengths, untrained)
    for diagnostic in (untrained, truncated, repeated):
        diagnostic.warn(config, split)
    return CheckedSplit(source_label(source), untrained.records, int(lengths.sum()), len(plan), files)


# How records become documents, for `cache_key`: raised when that changes, so a cached store
# tokenised the old way is built again. 2: numbers as the file writes them (0.50, not 0.5),
# chat templates given tools=None, tojson's arguments in transformers' order. 3: a preference
# pair whose responses the tokenizer encodes to the same tokens is refused (a store written
# before may hold one).
RECORD_ENCODING_VERSION = 3


def cache_key(config: DataConfig, tokenizer: Tokenizer, split: Split) -> str:
    """Hash of everything that determines the tokenised documents of `split` (jrl's own way of
    encoding records by `RECORD_ENCODING_VERSION`), every file of its source included (a file added to a pattern's matches, or any file changed, gives
    a new key). A source that names no readable file raises its ConfigError."""
    chosen = split_source(config, split)
    bundled = None if chosen is None else bundled_source(chosen[0])
    stat = None
    if chosen is not None and bundled is None:
        stat = []
        for path in source_files(chosen[0], chosen[2], config.format):
            st = os.stat(path)
            # the inode and ctime too: a rewrite that keeps the size and restores the mtime (cp -p,
            # rsync -t, tar, touch -r) changes the ctime, which no user call can set back
            stat.append([os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    fields = {k: v for k, v in to_dict(config).items()
              if k in ("source", "eval_source", "eval_fraction", "format", "text_field", "sections",
                       "messages_field", "train_roles", "chosen_field", "rejected_field", "tokenizer",
                       "add_eos", "seed")}
    if bundled is not None:  # the generator's records as of now
        version = generator_version(bundled)
        if version > 1:  # in the key only once raised: stores of unchanged generators are reused
            fields["bundled_version"] = version
    if config.add_bos and config.format != "chat":  # in the key only where it changes the documents: with
        fields["add_bos"] = True                     # it false (the default) a store written before it existed is read
    # the template a record with tools renders, where the tokenizer has one of its own (in the
    # key only then, so a store written before tokenizers had one is read)
    if (tool_use := getattr(tokenizer, "tool_use_template", None)) is not None:
        fields["tool_use_template"] = tool_use
    # the held-out rule's version only in a held-out split's key: a training store's key stays
    heldout = {"heldout_rule": HELDOUT_RULE} if split == "eval" else {}
    blob = json.dumps({"split": split, "data": fields, "files": stat, "encoding": RECORD_ENCODING_VERSION, **heldout,
                       "tokenizer": [type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id,
                                      getattr(tokenizer, "marks_text_start", False),
                                      getattr(tokenizer, "digest", None), getattr(tokenizer, "chat_template", None)]},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_documents(config: DataConfig, tokenizer: Tokenizer, split: Split) -> TokenStore | None:
    """The token store of `split` (memory-mapped from `cache_dir` when set), or None."""
    loaded = _load_documents(config, tokenizer, split)
    return None if loaded is None else loaded[0]


def _load_documents(config: DataConfig, tokenizer: Tokenizer,
                    split: Split) -> tuple[TokenStore, Untrained, Truncated, Repeated] | None:
    """`load_documents`, with the split's records that train nothing, its documents
    that `data.overflow` cuts and its records that repeat an earlier one (kept in
    a cached store's meta.json, so a run that reuses the cache hears of them too; counted
    again from the store where the run's seq_len, overflow or pack differ from those they
    were counted for, or where the store was written before they were kept)."""
    if split_source(config, split) is None:
        return None
    untrained, truncated, repeated = Untrained.of(config), Truncated.of(config), Repeated.of(config)
    if config.cache_dir is None:
        store = build_store(iter_documents(config, tokenizer, split, untrained, truncated, repeated))
        return store, untrained, truncated, repeated
    directory = Path(config.cache_dir) / f"{split}-{cache_key(config, tokenizer, split)}"
    if (directory / "meta.json").is_file():
        try:
            store = open_store(directory)
            meta = json.loads((directory / "meta.json").read_text())
            # counted for the seq_len / overflow / pack of the run that wrote the store (not
            # in its key): counted again from the store for others
            untrained = Untrained(**meta.get("untrained", {})).recount(
                config, store, lambda index: locate_record(config, split, index))
            truncated = Truncated(**meta.get("truncated", {})).recount(
                config, store.lengths, lambda index: locate_document(config, split, index))
            repeated = Repeated.kept(meta, config, store)
            return store, untrained, truncated, repeated
        except CorruptStoreError as e:  # e.g. a file cut short: a cache, so tokenise again
            warnings.warn(f"data.cache_dir: damaged token store, rebuilding it: {e}", stacklevel=2)
    write_store(directory, iter_documents(config, tokenizer, split, untrained, truncated, repeated),
                lambda: {"split": split, "data": to_dict(config), "untrained": dataclasses.asdict(untrained),
                         "truncated": dataclasses.asdict(truncated), "repeated": dataclasses.asdict(repeated)})
    return open_store(directory), untrained, truncated, repeated


@dataclasses.dataclass(frozen=True)
class RowDataset:
    """Fixed-length rows (`[seq_len]` fields, or `[2, seq_len]` for preference pairs)."""

    store: TokenStore
    plan: RowPlan | PairPlan
    seq_len: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.plan)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        if isinstance(self.plan, PairPlan):
            return assemble_pairs(self.store, self.plan, indices, self.seq_len, self.pad_id)
        return assemble_rows(self.store, self.plan, indices, self.seq_len, self.pad_id)


def build_dataset(config: DataConfig, tokenizer: Tokenizer, split: Split) -> RowDataset | None:
    """The rows of `split`, or None where the split is empty by config (no held-out data).
    A training split, or a `data.eval_source` file, that yields no rows is an error naming
    its source; records that train nothing get one warning (`Untrained`), and so do
    documents that `data.overflow` truncates (`Truncated`) and records that repeat an
    earlier one (`Repeated`)."""
    loaded = _load_documents(config, tokenizer, split)
    if loaded is None:
        return None
    store, untrained, truncated, repeated = loaded
    plan = plan_split(config, split, store.lengths, untrained)
    for diagnostic in (untrained, truncated, repeated):
        diagnostic.warn(config, split)
    return RowDataset(store, plan, config.seq_len, tokenizer.pad_id)


def plan_split(config: DataConfig, split: Split, lengths: np.ndarray, untrained: Untrained) -> RowPlan | PairPlan:
    """The row plan of `split`'s documents of `lengths`. A training split, or a
    `data.eval_source` file, that yields no rows is an error naming its source, and so
    is training data none of whose records trains a token in its rows (`untrained`, the
    split's records that train nothing at the config's seq_len and overflow: a
    misspelt role, every response cut away), whose loss would be 0/0."""
    if config.format == "preference":
        plan = plan_pairs(lengths, config.seq_len, overflow=config.overflow)
    else:
        plan = plan_rows(lengths, config.seq_len, pack=config.pack, overflow=config.overflow)
    if len(plan) == 0 and (split == "train" or config.eval_source is not None):
        source, filtered, key = split_source(config, split)
        if len(lengths):
            why = (f"{agree(len(lengths), 'its document', f'each of its {len(lengths):,} documents')} is longer "
                   f"than data.seq_len={config.seq_len} and data.overflow={config.overflow!r} drops it")
        elif filtered and next(source_records(config, source, key), None) is not None:
            # a small file whose every record the pseudo-random hold-out took: it has records
            why = (f"data.eval_fraction={config.eval_fraction} holds out every one of its records; lower it "
                   f"or give the held-out records as data.eval_source")
        else:
            why = "it has no records"
        rows = "training" if split == "train" else "held-out"
        raise ConfigError(f"{key}: {shown_source(source)} gives no {rows} rows: {why}")
    if split == "train" and untrained.count == untrained.records:
        source, _, key = split_source(config, split)
        raise ConfigError(f"{key}: {shown_source(source)} has nothing to train on: none of its records trains a token, "
                          f"the first at {untrained.first}: {untrained.reason}")
    return plan


class DataChangedError(ValueError):
    """A data position saved for other documents than the source's: the training data
    changed since (other files, or other content), though it packs into as many rows.
    `source` names the data by its config field where it is not `data.source` (an RL task's
    file; `rows` None: no row count to match), `what` the content digested. `also`: other
    data that changed with it (an RL task's other splits), each with its `source`: one
    refusal names them all (`source` joins the names, `n_sources` counts them)."""

    def __init__(self, saved: str, digest: str, rows: int | None, *, source: str | None = None,
                 what: str = "documents", also: Sequence[DataChangedError] = ()):
        super().__init__("; ".join([f"the {what}' content digest is {digest}, the checkpoint's {saved}",
                                    *map(str, also)]))
        self.saved, self.digest, self.rows = saved, digest, rows
        names = [source, *(e.source for e in also)] if source is not None else []
        self.source = (f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else source)
        self.n_sources = max(len(names), 1)


class DataSource:
    """Training batches of `batch_size` rows in the sampler's order; resumable. Its state
    holds the sampler's and the `content_digest` of the documents it samples from."""

    def __init__(self, dataset: RowDataset, batch_size: int, *, seed: int, shuffle: bool = True):
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle)
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """The `content_digest` of the dataset's documents (computed once)."""
        if self._digest is None:
            self._digest = content_digest(self.dataset.store)
        return self._digest

    def next_batch(self, state: Any = None) -> dict[str, np.ndarray]:
        """The next rows; `state` (the trainer's, for policy-dependent sources) is unused."""
        return self.dataset.rows(self.sampler.take(self.batch_size))

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "digest": self.digest}

    def load_state_dict(self, state: dict, *, data_changed_ok: bool = False) -> None:
        """Restores the sampler's position. A state for another number of rows raises the
        sampler's ValueError; one saved for other documents (its digest, where it has one)
        raises DataChangedError unless `data_changed_ok`. Either leaves the position as it
        was."""
        cursor = self.sampler.cursor
        self.sampler.load_state_dict(state["sampler"])
        saved = state.get("digest")
        if saved is not None and saved != self.digest and not data_changed_ok:
            self.sampler.cursor = cursor
            raise DataChangedError(saved, self.digest, len(self.dataset))


def fixed_batches(dataset: RowDataset, batch_size: int, n_batches: int) -> list[dict[str, np.ndarray]]:
    """The first `n_batches` batches of rows in dataset order: the same held-out batches at
    every evaluation. A last batch past the end is filled with rows from the start whose
    `loss_mask` is 0, so every held-out row counts once (repeated, the first rows weighed
    twice in eval_loss, which then changed with the batch size)."""
    n = min(n_batches, max(1, -(-len(dataset) // batch_size)))
    batches = []
    for i in range(n):
        index = np.arange(i * batch_size, (i + 1) * batch_size)
        batch = dataset.rows(index % len(dataset))
        repeat = index >= len(dataset)
        if repeat.any():
            mask = batch["loss_mask"].copy()
            mask[repeat] = 0
            batch["loss_mask"] = mask
        batches.append(batch)
    return batches
