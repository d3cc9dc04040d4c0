"""From a `DataConfig` to batches: tokenise (optionally into a memory-mapped cache),
split off the held-out records, pack into rows, sample batches resumably."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import warnings
from array import array
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple

import numpy as np

from jrl.config import ConfigError, DataConfig, to_dict
from jrl.data.encode import Document, encode_record
from jrl.data.packing import (
    PairPlan, RowPlan, assemble_pairs, assemble_rows, doc_pieces, keeps_a_trained_target, plan_pairs, plan_rows,
    trained_targets_kept,
)
from jrl.data.records import bundled_source, is_heldout, iter_located_records, source_files, source_label
from jrl.data.sampler import EpochSampler
from jrl.data.store import CorruptStoreError, TokenStore, build_store, content_digest, open_store, write_store
from jrl.data.text import Tokenizer
from jrl.data.wording import agree, counted

Split = Literal["train", "eval"]


Source = str | tuple[str, ...]  # a path, a pattern or a bundled name, or a list of them


def _split_source(config: DataConfig, split: Split) -> tuple[Source, bool, str] | None:
    """(source, filter by the held-out rule?, the config field naming the source) for
    `split`, or None if the split is empty."""
    if split == "eval":
        if config.eval_source is not None:
            return config.eval_source, False, "data.eval_source"
        return (config.source, True, "data.source") if config.eval_fraction > 0 else None
    return config.source, config.eval_source is None and config.eval_fraction > 0, "data.source"


def _shown(source: Source) -> str:
    """A source as messages name it: a path quoted, a list in YAML's flow form."""
    return repr(source) if isinstance(source, str) else source_label(source)


def _records(config: DataConfig, source: Source, key: str) -> Iterator[tuple[str, dict]]:
    """`(where, record)` for every record of `source`, read as the data pipeline reads it
    (a `.txt` file is a raw-text document for `format: text`)."""
    return iter_located_records(source, config.seed, key, config.format, config.text_field)


def iter_split_records(config: DataConfig, split: Split) -> Iterator[tuple[str, dict]]:
    """`(where, record)` for the records of `split`, in source order: the held-out rule
    counts records across all of the source's files, so it does not depend on how the
    records are spread over them."""
    chosen = _split_source(config, split)
    if chosen is None:
        return
    source, filtered, key = chosen
    for index, (where, record) in enumerate(_records(config, source, key)):
        if filtered and is_heldout(index, config.seed, config.eval_fraction) != (split == "eval"):
            continue
        yield where, record


@dataclasses.dataclass
class Untrained:
    """The records of a split that train nothing: every token of their documents is
    context (a chat record without an assistant turn, a sections record whose trained
    fields are empty), or `data.overflow` cuts away every trained one (a prompt longer
    than `data.seq_len` under `truncate_right`). Legitimate beside records that do train,
    but silent: `warn` says how many there are and where the first one is. A preference
    pair cut so is an error instead (`_check_pair_overflow`). Counted for `seq_len`,
    `overflow` and `pack` (kept with the counts in a cached store's meta.json, whose key
    has none of them: `recount` counts again for others, as `Truncated.recount` does)."""

    records: int = 0  # records read
    count: int = 0  # of them, those that train nothing
    first: str | None = None  # where the first one is (file:line or bundled:<name>[index])
    reason: str = ""  # why the first one trains nothing
    seq_len: int = 0  # the settings counted for
    overflow: str = ""
    pack: bool = False

    @classmethod
    def of(cls, config: DataConfig) -> "Untrained":
        return cls(seq_len=config.seq_len, overflow=config.overflow, pack=config.pack)

    def recount(self, config: DataConfig, store: TokenStore,
                locate: Callable[[int], tuple[str, dict]]) -> "Untrained":
        """These counts if they are for `config`'s seq_len, overflow and pack, else the
        counts of the records whose documents are `store`'s (one a record; a preference
        pair, two, trains nothing only where it is an error), the first read again with
        `locate(record index) -> (where, record)` to say why."""
        if (self.seq_len, self.overflow, self.pack) == (config.seq_len, config.overflow, config.pack):
            return self
        out = Untrained.of(config)
        if config.format == "preference":
            out.records = len(store) // 2
            return out
        out.records = len(store)
        untrained = np.flatnonzero(~trained_targets_kept(store, config.seq_len, config.overflow, pack=config.pack))
        out.count = len(untrained)
        if len(untrained):
            index = int(untrained[0])
            ids, train = store.doc(index)
            out.first, record = locate(index)
            out.reason = _untrained_reason(record, [(np.asarray(ids), np.asarray(train, bool))], config)
        return out

    def note(self, where: str, record: dict, docs: list[Document], config: DataConfig) -> None:
        self.records += 1
        if config.format == "preference":
            _check_pair_overflow(docs, config, where)
            return  # a pair without a scored response is refused by encode_record
        if any(keeps_a_trained_target(train, config.seq_len, config.overflow, pack=config.pack)
               for _, train in docs):
            return
        self.count += 1
        if self.first is None:
            self.first, self.reason = where, _untrained_reason(record, docs, config)

    def warn(self, config: DataConfig, split: Split) -> None:
        if not self.count:
            return
        source, _, key = _split_source(config, split)
        rows = "training" if split == "train" else "held-out"
        warnings.warn(f"{key}: {self.count:,} of the {counted(self.records, f'{rows} record')} of {_shown(source)} "
                      f"{agree(self.count, 'trains', 'train')} nothing, "
                      f"the first at {self.first}: {self.reason}", stacklevel=3)


@dataclasses.dataclass
class Truncated:
    """The documents of a split that `data.overflow` 'truncate_right' / 'truncate_left'
    cuts to `data.seq_len` tokens, dropping the rest: with the default overflow, most of
    the text of a corpus of long documents. Silent otherwise: `warn` says how many there
    are, what share of the split's tokens is dropped and where the first is. Counted for
    `seq_len` and `overflow` (kept with the counts in a cached store's meta.json, whose
    key has neither: `recount` counts again for others)."""

    seq_len: int = 0
    overflow: str = ""
    documents: int = 0  # documents read
    tokens: int = 0  # their tokens
    count: int = 0  # of them, those cut
    dropped: int = 0  # the tokens they lose
    first: str | None = None  # where the first one is (file:line, file for a .txt file)
    first_tokens: int = 0  # its length

    @classmethod
    def of(cls, config: DataConfig) -> "Truncated":
        return cls(config.seq_len, config.overflow)

    def note(self, where: str, docs: list[Document]) -> None:
        for ids, _ in docs:
            self._add(where, len(ids))

    def _add(self, where: str | None, length: int) -> None:
        self.documents += 1
        self.tokens += length
        if self.overflow.startswith("truncate") and length > self.seq_len:
            self.count += 1
            self.dropped += length - self.seq_len
            if self.first is None:
                self.first, self.first_tokens = where, length

    def recount(self, config: DataConfig, lengths: np.ndarray, locate: Callable[[int], str]) -> "Truncated":
        """These counts if they are for `config`'s seq_len and overflow, else the counts of
        documents of `lengths`, the first named by `locate(document index)`."""
        if (self.seq_len, self.overflow) == (config.seq_len, config.overflow):
            return self
        out = Truncated.of(config)
        lengths = np.asarray(lengths, np.int64)
        out.documents, out.tokens = len(lengths), int(lengths.sum())
        if config.overflow.startswith("truncate"):
            cut = np.flatnonzero(lengths > config.seq_len)
            out.count, out.dropped = len(cut), int((lengths[cut] - config.seq_len).sum())
            if len(cut):
                out.first, out.first_tokens = locate(int(cut[0])), int(lengths[cut[0]])
        return out

    def warn(self, config: DataConfig, split: Split) -> None:
        if not self.count:
            return
        source, _, key = _split_source(config, split)
        rows = "training" if split == "train" else "held-out"
        share = 100 * self.dropped / self.tokens
        share = f"{share:.1f}%" if share >= 0.1 else "under 0.1%"
        if config.format == "preference":
            advice = "raise data.seq_len to keep them whole"
        else:
            advice = ("set data.overflow: split to train on all of their tokens (windows of data.seq_len), "
                      "or raise data.seq_len")
        warnings.warn(f"{key}: {self.count:,} of the {counted(self.documents, f'{rows} document')} of "
                      f"{_shown(source)} {agree(self.count, 'is', 'are')} longer than data.seq_len={self.seq_len} "
                      f"and data.overflow={self.overflow!r} drops {self.dropped:,} of the "
                      f"{counted(self.tokens, 'token')} ({share}), the first at {self.first} "
                      f"({counted(self.first_tokens, 'token')}); {advice}", stacklevel=3)


def _locate_record(config: DataConfig, split: Split, index: int) -> tuple[str, dict]:
    """`(where, record)` of record `index` of `split`, read again from the source."""
    return next(itertools.islice(iter_split_records(config, split), index, None))


def _locate_document(config: DataConfig, split: Split, index: int) -> str:
    """Where document `index` of `split` comes from (file:line), read again from the source."""
    return _locate_record(config, split, index // 2 if config.format == "preference" else index)[0]


def _check_pair_overflow(docs: list[Document], config: DataConfig, where: str) -> None:
    """Raises a ConfigError naming `where` if `data.overflow` cuts away every scored token
    of a pair's response (a long prompt under `truncate_right`), or keeps the same tokens
    of both (responses that differ only past `data.seq_len`), while the pair is kept:
    it would carry no preference, yet DPO would count it in the loss's average and as a
    wrong preference in `reward_accuracy` (as a pair of two equal responses, refused)."""
    pieces = [doc_pieces(len(ids), config.seq_len, config.overflow) for ids, _ in docs]
    if not all(pieces):
        return  # data.overflow: drop leaves the pair out
    fields, keys = (config.chosen_field, config.rejected_field), ("data.chosen_field", "data.rejected_field")
    for (ids, train), field, key in zip(docs, fields, keys):
        if not keeps_a_trained_target(train, config.seq_len, config.overflow, first_piece=True):
            raise ConfigError(f"{where}: field {field!r} ({key}): the prompt and response are {len(ids)} tokens and "
                              f"data.overflow={config.overflow!r} at data.seq_len={config.seq_len} keeps none of the "
                              f"response, so the pair carries no preference; raise data.seq_len, or set "
                              f"data.overflow to 'truncate_left' (keeps the end) or 'drop'")
    kept = [ids[a:a + n] for (ids, _), [(a, n)] in zip(docs, pieces)]
    if not np.array_equal(*kept) or all(len(k) == len(ids) for k, (ids, _) in zip(kept, docs)):
        return
    raise ConfigError(f"{where}: fields {fields[0]!r} and {fields[1]!r} ({' / '.join(keys)}) differ only in tokens "
                      f"that data.overflow={config.overflow!r} at data.seq_len={config.seq_len} cuts away, so the "
                      f"pair carries no preference; raise data.seq_len, or set data.overflow to 'drop'")


def _untrained_reason(record: dict, docs: list[Document], config: DataConfig) -> str:
    length = max(len(ids) for ids, _ in docs)
    if length == 1:  # e.g. an empty text and its EOS: nothing before the token to predict it from
        return "its document is a single token, and a document's first token is never a target"
    if any(train.any() for _, train in docs):  # trained tokens, all cut away
        if config.overflow == "drop":
            return (f"its {length} tokens are more than data.seq_len={config.seq_len} and "
                    f"data.overflow='drop' leaves it out")
        return (f"its {length} tokens are more than data.seq_len={config.seq_len} and data.overflow="
                f"{config.overflow!r} keeps none of its trained ones")
    if config.format == "chat":
        roles = {m.get("role") for m in record.get(config.messages_field, ())}
        if not roles & set(config.train_roles):
            return f"none of its messages has a role in data.train_roles={list(config.train_roles)}"
        return "its turns of data.train_roles render to no tokens"
    if config.format == "text":
        return f"field {config.text_field!r} (data.text_field) is empty and data.add_eos is false"
    return "its trained sections (data.sections) are empty and data.add_eos is false"


def iter_documents(config: DataConfig, tokenizer: Tokenizer, split: Split,
                   untrained: Untrained | None = None, truncated: Truncated | None = None) -> Iterator[Document]:
    """The documents of `split`, in source order; `untrained` and `truncated` (when given)
    note the records that train nothing and the documents `data.overflow` cuts."""
    for where, record in iter_split_records(config, split):
        docs = encode_record(record, config, tokenizer, where=where)
        if untrained is not None:
            untrained.note(where, record, docs, config)
        if truncated is not None:
            truncated.note(where, docs)
        yield from docs


class CheckedSplit(NamedTuple):
    """What a dry run's check read of a split: its source (as written; a list in YAML's
    flow form), records, document tokens, the rows they plan into and the files read
    (records, tokens, rows and files None for a bundled source, not read)."""

    source: str
    records: int | None
    tokens: int | None = None
    rows: int | None = None
    files: int | None = None


def check_records(config: DataConfig, tokenizer: Tokenizer, split: Split) -> CheckedSplit | None:
    """The `CheckedSplit` of `split` after encoding every record and planning its rows as
    the run will, keeping only document lengths: a dry run's check, so a bad record
    (file:line, field) or data that gives no rows fails with the run's error before the
    run starts. None where the split is empty by config; a bundled source is not read."""
    chosen = _split_source(config, split)
    if chosen is None:
        return None
    source, _, key = chosen
    if bundled_source(source) is not None:
        return CheckedSplit(bundled_source(source), None)
    files = len(source_files(source, key, config.format))
    lengths, untrained, truncated = array("q"), Untrained.of(config), Truncated.of(config)
    for ids, _ in iter_documents(config, tokenizer, split, untrained, truncated):
        lengths.append(len(ids))
    lengths = np.frombuffer(lengths, np.int64)
    plan = plan_split(config, split, lengths, lambda: untrained.count < untrained.records)
    untrained.warn(config, split)
    truncated.warn(config, split)
    return CheckedSplit(source_label(source), untrained.records, int(lengths.sum()), len(plan), files)


def cache_key(config: DataConfig, tokenizer: Tokenizer, split: Split) -> str:
    """Hash of everything that determines the tokenised documents of `split`, every file of
    its source included (a file added to a pattern's matches, or any file changed, gives
    a new key). A source that names no readable file raises its ConfigError."""
    chosen = _split_source(config, split)
    stat = None
    if chosen is not None and bundled_source(chosen[0]) is None:
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
    blob = json.dumps({"split": split, "data": fields, "files": stat,
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
                    split: Split) -> tuple[TokenStore, Untrained, Truncated] | None:
    """`load_documents`, with the split's records that train nothing and its documents
    that `data.overflow` cuts (kept in a cached store's meta.json, so a run that reuses
    the cache hears of them too; counted again from the store where the run's seq_len,
    overflow or pack differ from those they were counted for)."""
    if _split_source(config, split) is None:
        return None
    untrained, truncated = Untrained.of(config), Truncated.of(config)
    if config.cache_dir is None:
        return build_store(iter_documents(config, tokenizer, split, untrained, truncated)), untrained, truncated
    directory = Path(config.cache_dir) / f"{split}-{cache_key(config, tokenizer, split)}"
    if (directory / "meta.json").is_file():
        try:
            store = open_store(directory)
            meta = json.loads((directory / "meta.json").read_text())
            # counted for the seq_len / overflow / pack of the run that wrote the store (not
            # in its key): counted again from the store for others
            untrained = Untrained(**meta.get("untrained", {})).recount(
                config, store, lambda index: _locate_record(config, split, index))
            truncated = Truncated(**meta.get("truncated", {})).recount(
                config, store.lengths, lambda index: _locate_document(config, split, index))
            return store, untrained, truncated
        except CorruptStoreError as e:  # e.g. a file cut short: a cache, so tokenise again
            warnings.warn(f"data.cache_dir: damaged token store, rebuilding it: {e}", stacklevel=2)
    write_store(directory, iter_documents(config, tokenizer, split, untrained, truncated),
                lambda: {"split": split, "data": to_dict(config), "untrained": dataclasses.asdict(untrained),
                         "truncated": dataclasses.asdict(truncated)})
    return open_store(directory), untrained, truncated


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
    documents that `data.overflow` truncates (`Truncated`)."""
    loaded = _load_documents(config, tokenizer, split)
    if loaded is None:
        return None
    store, untrained, truncated = loaded
    plan = plan_split(config, split, store.lengths, lambda: bool(store.train.any()))
    untrained.warn(config, split)
    truncated.warn(config, split)
    return RowDataset(store, plan, config.seq_len, tokenizer.pad_id)


def plan_split(config: DataConfig, split: Split, lengths: np.ndarray,
               has_trained_token: Callable[[], bool]) -> RowPlan | PairPlan:
    """The row plan of `split`'s documents of `lengths`. A training split, or a
    `data.eval_source` file, that yields no rows is an error naming its source, and so
    is chat training data with no trained token (`has_trained_token`, asked only then)."""
    if config.format == "preference":
        plan = plan_pairs(lengths, config.seq_len, overflow=config.overflow)
    else:
        plan = plan_rows(lengths, config.seq_len, pack=config.pack, overflow=config.overflow)
    if len(plan) == 0 and (split == "train" or config.eval_source is not None):
        source, filtered, key = _split_source(config, split)
        if len(lengths):
            why = (f"{agree(len(lengths), 'its document', f'each of its {len(lengths):,} documents')} is longer "
                   f"than data.seq_len={config.seq_len} and data.overflow={config.overflow!r} drops it")
        elif filtered and next(_records(config, source, key), None) is not None:
            # a small file whose every record the pseudo-random hold-out took: it has records
            why = (f"data.eval_fraction={config.eval_fraction} holds out every one of its records; lower it "
                   f"or give the held-out records as data.eval_source")
        else:
            why = "it has no records"
        rows = "training" if split == "train" else "held-out"
        raise ConfigError(f"{key}: {_shown(source)} gives no {rows} rows: {why}")
    if split == "train" and config.format == "chat" and not has_trained_token():
        source, _, key = _split_source(config, split)  # e.g. a misspelt role: the loss would be 0/0
        raise ConfigError(f"{key}: {_shown(source)} has nothing to train on: none of its messages has a role in "
                          f"data.train_roles={list(config.train_roles)}")
    return plan


class DataChangedError(ValueError):
    """A data position saved for other documents than the source's: the training data
    changed since (other files, or other content), though it packs into as many rows."""

    def __init__(self, saved: str, digest: str, rows: int):
        super().__init__(f"the documents' content digest is {digest}, the checkpoint's {saved}")
        self.saved, self.digest, self.rows = saved, digest, rows


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
    """The first `n_batches` batches of rows in dataset order (wrapping around a small
    dataset): the same held-out batches at every evaluation."""
    n = min(n_batches, max(1, -(-len(dataset) // batch_size)))
    return [dataset.rows(np.arange(i * batch_size, (i + 1) * batch_size) % len(dataset)) for i in range(n)]
