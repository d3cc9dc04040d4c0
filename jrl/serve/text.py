"""From sampled token ids to the text a client sees: incremental decoding, stop strings.

`TextStream` takes a choice's tokens as the engine hands them over and keeps:

* `text`: the decoded completion so far (special tokens skipped), grown only by whole
  characters (a token that ends inside a multi-byte UTF-8 character waits for the next one);
* `offsets[i]`: where token i's text starts in `text` (`text_offset` of the completions
  API, and what decides which tokens' log-probabilities survive a stop-string cut);
* the stop strings: the first one found cuts the text before it (`stopped` is set); text
  that could still become the start of a stop string is held back from `emit()` until
  the next tokens settle it.

Decoding is incremental: each new token decodes a window of a few tokens before it
(`decode(window + new)` minus `decode(window)`), so long completions cost O(tokens), and
tokenizers whose output depends on the neighbouring token (byte-level BPE, SentencePiece
spaces) still join correctly. Where a new token changes the window's own text (a byte piece
that makes Llama's decoder turn a run of bytes into U+FFFDs), the text already there stays
and only what follows the part both decodes share is added: nothing is sent twice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

_CONTEXT = 6  # tokens of left context decoded with each new token


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_ids = frozenset(int(i) for i in skip_ids)  # end-of-turn / EOS: never shown
        self.ids: list[int] = []
        self.offsets: list[int] = []
        self.text = ""
        self.stopped = False  # an end-of-turn id or a stop string ended the text
        self.cut = False  # a stop string was found (text is cut before it)
        self._pending = 0  # ids[-pending:] are not in `text` yet (an incomplete character)
        self._emitted = 0  # characters handed out by emit()
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, ids: Sequence[int]) -> None:
        """Appends sampled tokens (skipped ids end the text: nothing after them is shown)."""
        for tok in ids:
            if self.stopped:
                return
            tok = int(tok)
            if tok in self.skip_ids:
                self._flush_pending()  # before `stopped`: a stop string may end in the flushed text
                self.stopped = True
                return
            self.ids.append(tok)
            self.offsets.append(len(self.text))
            self._pending += 1
            self._decode_pending(final=False)
            self._check_stop()

    def _decode_pending(self, final: bool) -> None:
        start = len(self.ids) - self._pending
        window = self.ids[max(0, start - _CONTEXT):start]
        before = self._decode(window) if window else ""
        full = self._decode(window + self.ids[start:])
        if full.startswith(before):
            new = full[len(before):]
        else:  # the new tokens changed the window's text (Llama's byte pieces decode as a run):
            # what is sent stays, and what follows the text both decodes share is added
            new = full[len(os.path.commonprefix([before, full])):]
        if new.endswith("\ufffd") and not final:
            return  # the last token ends inside a character: wait for the next one
        self.text += new  # the pending tokens' offsets (set on add) are where `new` starts
        self._pending = 0

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    def _flush_pending(self) -> None:
        if self._pending and not self.cut:
            self._decode_pending(final=True)
            self._check_stop()

    def _check_stop(self) -> None:
        if not self.stop or self.stopped:
            return
        start = max(0, self._emitted - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = self.cut = True

    def finish(self) -> None:
        """The engine has finished the choice: whatever is pending is decoded."""
        self._flush_pending()

    def emit(self, final: bool = False) -> str:
        """The text not handed out yet that no stop string can still cut (all of it once
        `final` or stopped)."""
        if final:
            self.finish()
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    @property
    def emitted(self) -> int:
        """Characters of `text` handed out by `emit()` so far."""
        return self._emitted

    def kept_tokens(self) -> int:
        """How many tokens' text is (at least partly) in `text`: the tokens whose
        log-probabilities a response reports (a token that starts at or after a stop
        cut is dropped)."""
        return sum(1 for o in self.offsets if o < len(self.text)) if self.cut else len(self.ids)


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """`ids` as text, special tokens skipped; ids past the tokenizer's vocabulary (a model's
    padded embedding rows) decode to nothing."""
    vocab = tokenizer.vocab_size
    return tokenizer.decode([i for i in ids if i < vocab], skip_special_tokens=True)


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes `token` adds to the text (OpenAI's logprobs `bytes`): a token holding part
    of a multi-byte character has just its part, so a client joins them to rebuild it;
    special tokens skipped (none), as ids past the tokenizer's vocabulary."""
    if token >= tokenizer.vocab_size:
        return b""
    return tokenizer.token_bytes(token, skip_special_tokens=True)


def token_str(tokenizer: Any, token: int) -> str:
    """`token` as logprobs show it (chat `token`, completions `tokens`): its text, or, for a
    token holding part of a multi-byte character (alone it decodes to U+FFFD), `bytes:` and
    its bytes escaped, as OpenAI writes it (`bytes:\\xe2\\x80`)."""
    raw = token_bytes(tokenizer, token)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return decode(tokenizer, [token])
