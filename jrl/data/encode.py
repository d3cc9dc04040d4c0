"""Records -> documents: token ids plus a per-token 'trained' flag, from declarative sections.

A document is `(ids int32 [L], train bool [L])`; `train[t]` says whether token `t` is a
training target (predicted from the tokens before it). Formats:

* `text`: the `text_field`, every token trained;
* `sections`: the pieces of `data.sections` in order — a record field or a literal text,
  each trained or not — e.g. prompt (not trained) then response (trained);
* `chat`: the `messages_field` list of `{"role", "content"}` rendered by the tokenizer's
  chat template; the content of turns whose role is in `train_roles` (and whatever the
  template closes them with, e.g. EOS) is trained, role headers and other turns are not.
  The template places EOS itself, so `add_eos` does not apply;
* `preference`: the sections form the prompt (never trained), then two documents: prompt
  + `chosen_field` and prompt + `rejected_field`, responses trained (two different
  responses, each with something to score).

With `add_eos` an EOS token ends every document, trained like the last piece. With
`add_bos` the tokenizer's BOS token opens every document of the `text`, `sections` and
`preference` formats (as a Hugging Face tokenizer's `tokenizer(text)` puts it, and jrl
serve by default to a text prompt for the run's checkpoints), untrained: it is never a
target (nothing comes before it), and a trained flag on it would count a record whose
trained pieces are empty as one that trains something. The text after it is encoded as the start of a text, as
those encodings do (with a SentencePiece tokenizer's '▁' mark). `chat` ignores it, as it
ignores `add_eos`: the template places BOS itself, so it is never doubled.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from jrl.config import ConfigError, DataConfig, Section
from jrl.data.records import json_type
from jrl.data.text import Tokenizer
from jrl.tokenizer import encode_continuation, template_failure

Document = tuple[np.ndarray, np.ndarray]


def _field(record: dict, field: str, where: str, config_key: str) -> Any:
    """`record[field]`; a ConfigError naming the field, its config key and what the record has if missing."""
    if field not in record:
        raise ConfigError(f"{where}: missing field {field!r} ({config_key}); "
                          f"record has: {', '.join(sorted(record)) or 'nothing'}")
    return record[field]


def _field_text(record: dict, field: str, where: str, config_key: str) -> str:
    """The text of a string or number field. NaN and Infinity (which Python's json reads
    and writes, e.g. for a missing value) are refused rather than trained as 'nan'."""
    value = _field(record, field, where, config_key)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: field {field!r} must be a string or number, got {json_type(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: field {field!r} must be a string or finite number, got {value}")
    return str(value)


def _pieces(record: dict, sections: tuple[Section, ...], where: str) -> list[tuple[str, bool]]:
    out = []
    for i, s in enumerate(sections):
        text = s.text if s.text is not None else _field_text(record, s.field, where, f"data.sections[{i}].field")
        out.append((text, s.train))
    return out


def check_bos(config: DataConfig, tokenizer: Tokenizer) -> None:
    """Raises a ConfigError naming data.add_bos when it is set for a format it applies to
    and the tokenizer has no BOS token (Qwen's, GPT-NeoX's: their tokenizer_config.json
    names no bos_token)."""
    if config.add_bos and config.format != "chat" and tokenizer.bos_id is None:
        raise ConfigError(f"data.add_bos: the tokenizer {config.tokenizer!r} (data.tokenizer) has no BOS token "
                          f"(no bos_token in its tokenizer_config.json); set data.add_bos: false")


def _document(pieces: list[tuple[str, bool]], tokenizer: Tokenizer, add_eos: bool,
              add_bos: bool = False) -> Document:
    """The ids of the pieces one after the other (each encoded on its own, so that the mask
    is exact; each after the first as a continuation, so no start-of-text mark is added at
    a seam) and which of them are trained; with `add_bos` after an untrained BOS."""
    ids: list[int] = [tokenizer.bos_id] if add_bos else []
    train: list[bool] = [False] if add_bos else []
    start = len(ids)  # the text opens at the first piece with tokens, the BOS before it or not
    for text, trained in pieces:
        piece = encode_continuation(tokenizer, text) if len(ids) > start else tokenizer.encode(text)
        ids.extend(piece)
        train.extend([trained] * len(piece))
    if add_eos:
        ids.append(tokenizer.eos_id)
        train.append(pieces[-1][1] if pieces else True)
    return np.asarray(ids, np.int32), np.asarray(train, np.bool_)


def _check_messages(messages: Any, prefix: str) -> None:
    """Raises a ConfigError starting with `prefix` unless `messages` is a non-empty list of
    `{'role': str, 'content': str}`, naming the first message that is not (e.g. an
    assistant turn with `content: null` beside its tool calls)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{prefix} must be a non-empty list of {{'role': str, 'content': str}} messages, "
                          f"got {'an empty list' if messages == [] else json_type(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{prefix}: message {i} must be an object, got {json_type(message)}")
        for key in ("role", "content"):
            if key not in message:
                raise ConfigError(f"{prefix}: message {i} has no {key!r}")
            if not isinstance(message[key], str):
                raise ConfigError(f"{prefix}: message {i}: {key!r} must be a string, got {json_type(message[key])}")


def _turn_header(render, messages: list[dict], i: int) -> str:
    """The rendered conversation up to the content of message i. For an assistant turn
    that is the generation prompt (what the model is given at inference); a template has
    none for other roles, so there it is what two renderings of the turn with different
    contents have in common."""
    if messages[i]["role"] == "assistant":
        return render(messages[:i], add_generation_prompt=True)
    probes = [render(messages[:i] + [{**messages[i], "content": c}]) for c in ("A", "B")]
    return os.path.commonprefix(probes)


def _chat_pieces(record: dict, config: DataConfig, tokenizer: Tokenizer, where: str) -> list[tuple[str, bool]]:
    """Splits the rendered conversation into trained / untrained text by rendering growing
    prefixes of it: turn i is `render(messages[:i+1])` minus `render(messages[:i])`, and
    for a trained turn its header (`_turn_header`) is context."""
    field = config.messages_field
    messages = _field(record, field, where, "data.messages_field")
    _check_messages(messages, f"{where}: field {field!r} (data.messages_field)")
    def render(msgs, **kwargs):
        try:
            return tokenizer.apply_chat_template(msgs, **kwargs)
        except Exception as e:  # e.g. a role the template does not know, a field it reads that a message lacks
            raise ConfigError(f"{where}: field {field!r} (data.messages_field): {template_failure(e)}") from None

    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        full = render(messages[:i + 1])
        cut = done
        if message["role"] in config.train_roles:
            header = _turn_header(render, messages, i)
            if not header.startswith(done) or not full.startswith(header):
                raise ConfigError(f"{where}: the chat template's header of message {i} (role "
                                  f"{message['role']!r}) is not a prefix of it; cannot tell its header "
                                  f"from its content")
            pieces.append((header[len(done):], False))
            cut = header
        if not full.startswith(cut):
            raise ConfigError(f"{where}: the chat template does not render message {i} as an extension "
                              f"of the earlier ones; cannot derive loss masks")
        pieces.append((full[len(cut):], message["role"] in config.train_roles))
        done = full
    return [p for p in pieces if p[0]]


def encode_record(record: dict[str, Any], config: DataConfig, tokenizer: Tokenizer,
                  where: str = "record") -> list[Document]:
    """The documents of one record (one, or two for `preference`: chosen then rejected)."""
    if config.format == "chat":
        return [_document(_chat_pieces(record, config, tokenizer, where), tokenizer, add_eos=False)]
    check_bos(config, tokenizer)
    if config.format == "text":
        return [_document([(_field_text(record, config.text_field, where, "data.text_field"), True)],
                          tokenizer, config.add_eos, config.add_bos)]
    prompt = _pieces(record, config.sections, where)
    if config.format == "sections":
        return [_document(prompt, tokenizer, config.add_eos, config.add_bos)]
    return _preference_documents(record, config, tokenizer, prompt, where)


def _preference_documents(record: dict, config: DataConfig, tokenizer: Tokenizer,
                          prompt: list[tuple[str, bool]], where: str) -> list[Document]:
    """prompt + chosen and prompt + rejected. A pair whose two responses are the same (as
    text, or as the tokens the tokenizer gives them), or one with a response that leaves
    nothing to score, is refused: DPO would count it in the loss's average (and as a wrong
    preference in `reward_accuracy`) while it carries no preference to learn."""
    keys = ("data.chosen_field", "data.rejected_field")
    fields = (config.chosen_field, config.rejected_field)
    for field, key in zip(fields, keys):
        if isinstance(record.get(field), list):  # e.g. a conversational dataset's [{role, content}, ...]
            raise ConfigError(f"{where}: field {field!r} ({key}) is a list; data.format 'preference' takes each "
                              f"response as one text (a string or number), not chat messages")
    chosen, rejected = (_field_text(record, f, where, k) for f, k in zip(fields, keys))
    if chosen == rejected:
        raise ConfigError(f"{where}: fields {fields[0]!r} and {fields[1]!r} ({' / '.join(keys)}) hold the same "
                          f"response {chosen!r}; a preference pair needs two different ones")
    docs = [_document(prompt + [(text, True)], tokenizer, config.add_eos, config.add_bos)
            for text in (chosen, rejected)]
    if np.array_equal(docs[0][0], docs[1][0]):  # e.g. a tokenizer that lowercases, or maps both to <unk>
        raise ConfigError(f"{where}: fields {fields[0]!r} and {fields[1]!r} ({' / '.join(keys)}) hold {chosen!r} and "
                          f"{rejected!r}, which the tokenizer encodes to the same tokens; a preference pair needs two "
                          f"different responses")
    for (_, train), field, key in zip(docs, fields, keys):
        if not train.any():
            raise ConfigError(f"{where}: field {field!r} ({key}) is empty, so there is nothing to score "
                              f"(data.add_eos is false)")
    return docs
