"""What a split's records lose on their way into rows, said once at load: records that
train nothing, documents `data.overflow` truncates, preference pairs it leaves without a
preference (an error), and SFT records and preference pairs that repeat an earlier one.
Counted while documents are encoded, kept in a cached store's meta.json and counted again
where a run's settings differ from the store's."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import warnings
from typing import Callable

import numpy as np

from jrl.config import ConfigError, DataConfig
from jrl.data.encode import Document
from jrl.data.packing import doc_pieces, keeps_a_trained_target, trained_targets_kept
from jrl.data.records import bundled_source
from jrl.data.splits import Split, iter_split_records, shown_source, split_source
from jrl.data.store import TokenStore
from jrl.data.wording import agree, counted


@dataclasses.dataclass
class Untrained:
    """The records of a split that train nothing: every token of their documents is
    context (a chat record without an assistant turn, a sections record whose trained
    fields are empty), or `data.overflow` cuts away every trained one (a prompt longer
    than `data.seq_len` under `truncate_right`; a record, or a preference pair, that
    `drop` leaves out). Legitimate beside records that do train, but silent: `warn` says
    how many there are and where the first one is. A preference pair whose response is
    cut away is an error instead (`_check_pair_overflow`). Counted for `seq_len`,
    `overflow` and `pack` (kept with the counts in a cached store's meta.json, whose key
    has none of them: `recount` counts again for others, as `Truncated.recount` does, and
    checks a store's preference pairs again as `_check_pair_overflow` does)."""

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
        pair, two, trains nothing only where it is an error: the ConfigError an uncached
        run raises), the first read again with `locate(record index) -> (where, record)`
        to say why."""
        if (self.seq_len, self.overflow, self.pack) == (config.seq_len, config.overflow, config.pack):
            return self
        out = Untrained.of(config)
        if config.format == "preference":
            out.records = len(store) // 2
            _check_stored_pairs(store, config, locate)
            per_record = 2
            untrained = np.flatnonzero(_pairs_left_out(store.lengths, config))
        else:
            out.records = len(store)
            per_record = 1
            untrained = np.flatnonzero(~trained_targets_kept(store, config.seq_len, config.overflow, pack=config.pack))
        out.count = len(untrained)
        if len(untrained):
            index = int(untrained[0])
            docs = [tuple(np.asarray(a) for a in store.doc(per_record * index + j)) for j in range(per_record)]
            out.first, record = locate(index)
            out.reason = _untrained_reason(record, [(ids, train.astype(bool)) for ids, train in docs], config)
        return out

    def note(self, where: str, record: dict, docs: list[Document], config: DataConfig) -> None:
        self.records += 1
        if config.format == "preference":
            _check_pair_overflow(docs, config, where)  # a pair without a scored response is refused by encode_record
            if not _pairs_left_out(np.array([len(ids) for ids, _ in docs]), config)[0]:
                return
        elif any(keeps_a_trained_target(train, config.seq_len, config.overflow, pack=config.pack)
                 for _, train in docs):
            return
        self.count += 1
        if self.first is None:
            self.first, self.reason = where, _untrained_reason(record, docs, config)

    def warn(self, config: DataConfig, split: Split) -> None:
        if not self.count:
            return
        source, _, key = split_source(config, split)
        rows = "training" if split == "train" else "held-out"
        warnings.warn(f"{key}: {self.count:,} of the {counted(self.records, f'{rows} record')} of {shown_source(source)} "
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
        source, _, key = split_source(config, split)
        rows = "training" if split == "train" else "held-out"
        share = 100 * self.dropped / self.tokens
        share = f"{share:.1f}%" if share >= 0.1 else "under 0.1%"
        if config.format == "preference":
            advice = "raise data.seq_len to keep them whole"
        else:
            advice = ("set data.overflow: split to train on all of their tokens (windows of data.seq_len), "
                      "or raise data.seq_len")
        warnings.warn(f"{key}: {self.count:,} of the {counted(self.documents, f'{rows} document')} of "
                      f"{shown_source(source)} {agree(self.count, 'is', 'are')} longer than data.seq_len={self.seq_len} "
                      f"and data.overflow={self.overflow!r} drops {self.dropped:,} of the "
                      f"{counted(self.tokens, 'token')} ({share}), the first at {self.first} "
                      f"({counted(self.first_tokens, 'token')}); {advice}", stacklevel=3)


# What a repeated record is the same in, and what it weighs once more in, by data.format
# (plain text is not counted: a corpus's repeated documents are a matter of deduplication)
_REPEAT_WORDING = {
    "preference": ("an earlier record's preference pair (the same prompt, chosen and rejected response, as tokens)",
                   "each repeat counts its pair once more in DPO's loss; remove the repeats unless the pair is "
                   "meant to weigh more"),
    "sections": ("an earlier record (the same fields of data.sections, as tokens)",
                 "each repeat counts once more in the loss; remove the repeats unless the record is meant to "
                 "weigh more"),
    "chat": ("an earlier record (the same chat messages, as tokens)",
             "each repeat counts once more in the loss; remove the repeats unless the record is meant to weigh more"),
}


@dataclasses.dataclass
class Repeated:
    """The records of a split that repeat an earlier record of it token for token (an SFT
    record's prompt and response or chat messages, a preference pair's prompt, chosen and
    rejected response, the trained tokens the same): each counts once more in the loss
    (and a pair in DPO's reward_accuracy), and is most often a record written twice while
    the data was prepared. A record may be repeated on purpose, to weigh more, so it is a
    warning, as records that train nothing are (`Untrained`, which alone speaks of those:
    their repeats weigh nothing), not an error: `warn` says how many there are, where the
    first is and which record it repeats. Not said of a bundled dataset's draws (jrl's
    generator, no file to fix). Independent of seq_len and overflow: kept as counted in a
    cached store's meta.json (`kept` counts a store written before they were kept)."""

    counted: bool = False  # whether records of the split's format are counted (not plain text)
    records: int = 0  # records read
    count: int = 0  # of them, those that repeat an earlier one
    first: int = -1  # the first repeat's index among the split's records
    earlier: int = -1  # the index of the record it repeats

    def __post_init__(self) -> None:
        self._seen: dict[bytes, int] = {}  # each record's digest: the index of its first record

    @classmethod
    def of(cls, config: DataConfig) -> "Repeated":
        return cls(counted=config.format in _REPEAT_WORDING)

    @classmethod
    def kept(cls, meta: dict, config: DataConfig, store: TokenStore) -> "Repeated":
        """The counts a cached store's `meta` keeps for `config`'s format, else those of the
        store's documents (a jrl before 'repeated' was kept, or before it counted SFT records,
        wrote none for them; it named `counted` 'pairs')."""
        kept = dict(meta.get("repeated", {}))
        if "pairs" in kept:
            kept["counted"] = kept.pop("pairs")
        fresh = cls.of(config)
        if "counted" not in kept or kept["counted"] != fresh.counted:
            return fresh.count_in(store, config)
        return cls(**kept)

    def note(self, docs: list[Document]) -> None:
        """Counts the record of `docs` (its documents: one, or chosen and rejected)."""
        if not self.counted:
            return
        index, self.records = self.records, self.records + 1
        if not any(np.asarray(train).any() for _, train in docs):
            return  # it weighs nothing in the loss, however often repeated
        earlier = self._seen.setdefault(_record_digest(docs), index)
        if earlier != index:
            self.count += 1
            if self.first < 0:
                self.first, self.earlier = index, earlier

    def count_in(self, store: TokenStore, config: DataConfig) -> "Repeated":
        """These counts (none yet) of the records of `store` (a pair's chosen and rejected
        are documents 2i and 2i + 1)."""
        per_record = 2 if config.format == "preference" else 1
        for record in range(len(store) // per_record if self.counted else 0):
            self.note([store.doc(per_record * record + j) for j in range(per_record)])
        return self

    def warn(self, config: DataConfig, split: Split) -> None:
        source, _, key = split_source(config, split)
        if not self.count or bundled_source(source) is not None:
            return
        rows = "training" if split == "train" else "held-out"
        first, earlier = (locate_record(config, split, i)[0] for i in (self.first, self.earlier))
        what, advice = _REPEAT_WORDING[config.format]
        warnings.warn(f"{key}: {self.count:,} of the {counted(self.records, f'{rows} record')} of "
                      f"{shown_source(source)} {agree(self.count, 'repeats', 'repeat')} {what}, the first at {first}, "
                      f"a repeat of {earlier}: {advice}", stacklevel=3)


def _record_digest(docs: list[Document]) -> bytes:
    """A digest of a record's documents, their tokens and trained flags (each document's
    length first, so the seam between them counts)."""
    digest = hashlib.blake2b(digest_size=16)
    for ids, train in docs:
        ids = np.asarray(ids, np.int32)
        digest.update(np.int64(len(ids)).tobytes() + ids.tobytes() + np.asarray(train, bool).tobytes())
    return digest.digest()


def locate_record(config: DataConfig, split: Split, index: int) -> tuple[str, dict]:
    """`(where, record)` of record `index` of `split`, read again from the source."""
    return next(itertools.islice(iter_split_records(config, split), index, None))


def locate_document(config: DataConfig, split: Split, index: int) -> str:
    """Where document `index` of `split` comes from (file:line), read again from the source."""
    return locate_record(config, split, index // 2 if config.format == "preference" else index)[0]


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


def _pairs_left_out(lengths: np.ndarray, config: DataConfig) -> np.ndarray:
    """Which preference pairs (documents of `lengths`: chosen, rejected, chosen, ...) the
    rows leave out (bool `[pairs]`): `data.overflow: drop` leaves out a pair with a
    response longer than `data.seq_len` (`plan_pairs`)."""
    cut = np.asarray(lengths, np.int64).reshape(-1, 2) > config.seq_len
    return cut.any(axis=1) & (config.overflow == "drop")


def _check_stored_pairs(store: TokenStore, config: DataConfig, locate: Callable[[int], tuple[str, dict]]) -> None:
    """`_check_pair_overflow` of every pair of `store` (chosen, rejected: documents 2i and
    2i + 1), for a cached store reused at other settings than those it was checked for
    when written: raises its ConfigError for the first pair it refuses, named by
    `locate(pair index) -> (where, record)`. Reads the trained flags once (vectorised), and
    the tokens only of pairs whose kept pieces have equal lengths, one of them cut."""
    lengths = np.asarray(store.lengths, np.int64).reshape(-1, 2)
    if not len(lengths):
        return
    seq_len, overflow = config.seq_len, config.overflow
    cut = lengths > seq_len
    checked = ~_pairs_left_out(lengths, config)
    kept = trained_targets_kept(store, seq_len, overflow, first_piece=True).reshape(-1, 2)
    refused = checked & ~kept.all(axis=1)
    # both keep their first piece's tokens: the same tokens although not both whole?
    kept_lengths = np.minimum(lengths, seq_len)
    before = np.arange(len(lengths)) < (np.argmax(refused) if refused.any() else len(lengths))
    for pair in np.flatnonzero(before & checked & cut.any(axis=1) & (kept_lengths[:, 0] == kept_lengths[:, 1])):
        (a, n), (b, m) = (doc_pieces(int(length), seq_len, overflow)[0] for length in lengths[pair])
        if np.array_equal(store.doc(2 * pair)[0][a:a + n], store.doc(2 * pair + 1)[0][b:b + m]):
            refused[pair] = True
            break  # the pairs are checked in order: none before it is refused
    if not refused.any():
        return
    pair = int(np.flatnonzero(refused)[0])
    where, _ = locate(pair)
    docs = [tuple(np.asarray(array) for array in store.doc(2 * pair + i)) for i in range(2)]
    _check_pair_overflow(docs, config, where)  # raises its ConfigError, worded as for an uncached run


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
