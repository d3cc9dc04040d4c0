"""Tokenizers: a Hugging Face `tokenizer.json` wrapper, a built-in byte tokenizer, chat templates.

Every tokenizer here satisfies the `Tokenizer` protocol the data pipeline and the rollout
engine use:

    tok = load_tokenizer("bytes")                 # or a tokenizer.json path / HF directory
    ids = tok.encode("hello")                     # no BOS/EOS added unless asked
    text = tok.decode(ids)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)

`encode` never adds special tokens by default: chat templates already place them, and the
data pipeline appends EOS itself. Special-token strings inside the text (e.g. "<eos>" or
"<|im_end|>") are encoded as their single special ids, as Hugging Face tokenizers do.

Chat templates are Jinja, rendered in a sandbox with the same conventions as transformers
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, a `tojson` that keeps non-ASCII,
`{% generation %}` blocks), so the `chat_template` of a Hugging Face `tokenizer_config.json`
renders as it does there.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as RawTokenizer

from jrl.json_files import read_json_object

# A role marker per turn, each turn closed by the EOS token; generation prompts end with the
# assistant marker, so a model trained on this format stops by emitting EOS. Each message
# renders on its own (nothing depends on later messages), so a multi-turn episode can be
# continued token-exactly from the per-message pieces (jrl.rl.environments). A `tool`
# message (a tool's answer) is `<|tool|>\n...`; the byte tokenizer has no special token for
# that marker (one would change its vocabulary, and every model sized to it) and encodes it
# as its 8 bytes. `tools=` schemas are not rendered.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('default chat template: unknown role ' ~ message['role'] ~ "
    "'; allowed: system, user, assistant, tool') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What jrl needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None
    chat_template: str | None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = False, template: str | None = None,
                            **context: Any) -> str: ...


# ----------------------------------------------------------------------------- chat templates


class ChatTemplateError(ValueError):
    """A chat template or its messages are invalid (raised by templates via raise_exception)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def template_failure(e: Exception) -> str:
    """What a chat template's failure to render says: a ChatTemplateError's own words (the
    template's raise_exception, the messages' checks), else the error's type and text (the
    template's own failure: jinja's UndefinedError for a message field the template reads
    that the messages lack, a template that does not compile, ...)."""
    return str(e) if isinstance(e, ChatTemplateError) else f"{type(e).__name__}: {e}"


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` filter, its arguments in its order: non-ASCII kept by default,
    and no HTML escaping (Jinja's own filter escapes `<`, `>`, `&`, `'`)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlocks(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (its AssistantTracker, which
    templates written for assistant-only losses carry): it marks the assistant's text and
    renders as its body, in a scope of its own as there."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlocks, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def apply_chat_template(messages: Sequence[Mapping[str, Any]], template: str | None = None, *,
                        add_generation_prompt: bool = False, bos_token: str | None = None,
                        eos_token: str | None = None, **context: Any) -> str:
    """Renders `messages` (dicts with at least a `role`) with a Jinja chat template
    (`DEFAULT_CHAT_TEMPLATE` when None). Extra keyword arguments (e.g. `tools`,
    `enable_thinking`) are passed to the template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages: must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}]: must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}]: needs a string 'role', got {m.get('role')!r}")
    # tools and documents are None unless given, as transformers renders them: templates
    # test `tools is not none`, which an undefined variable passes
    context = {"tools": None, "documents": None, **context}
    return _compile(template or DEFAULT_CHAT_TEMPLATE).render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "", eos_token=eos_token or "", **context)


# ----------------------------------------------------------------------------- continuations

CONTINUATION_ANCHOR = "\n"  # a text that no tokenizer marks as a word start, and rarely merges with what follows


def starts_texts_with_a_mark(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` encodes the start of every text differently from the same text
    inside a longer one: SentencePiece tokenizers with a dummy prefix (Llama-2, Mistral
    v0.1, TinyLlama) put '▁' (a space) before every text they encode."""
    anchor = tokenizer.encode(CONTINUATION_ANCHOR)
    ids = tokenizer.encode(CONTINUATION_ANCHOR + "a")
    return ids[:len(anchor)] != anchor or ids[len(anchor):] != tokenizer.encode("a")


def encode_continuation(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text`'s ids where it continues a sequence rather than opens one (a response after
    its prompt, a tool's answer inside an episode): for a tokenizer that marks the start of
    every text (`starts_texts_with_a_mark`, asked once a tokenizer through its
    `marks_text_start`) it is encoded after `CONTINUATION_ANCHOR`, whose ids are dropped,
    so that no '▁' appears at the seam; any other tokenizer encodes it as it is."""
    if not text or not getattr(tokenizer, "marks_text_start", False):
        return list(tokenizer.encode(text))
    anchor = tokenizer.encode(CONTINUATION_ANCHOR)
    ids = tokenizer.encode(CONTINUATION_ANCHOR + text)
    return list(ids[len(anchor):]) if ids[:len(anchor)] == anchor else list(tokenizer.encode(text))


# ----------------------------------------------------------------------------- byte tokenizer


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then special tokens from id 256 (see `SPECIAL_TOKENS`).

    Needs no files, so demos and tests run offline. Its chat format is DEFAULT_CHAT_TEMPLATE,
    whose role markers are single special tokens here.
    """

    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>")
    marks_text_start = False  # bytes are bytes wherever they are

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self.special_ids.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIAL_TOKENS) + ")")
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)
        self.pad_id = self.special_ids["<pad>"]
        self.bos_id = self.special_ids["<bos>"]
        self.eos_id = self.special_ids["<eos>"]
        self.chat_template = DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes, special-token strings as their ids; `add_special_tokens` prepends <bos>."""
        ids = [self.bos_id] if add_special_tokens else []
        for piece in self._split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD. Special ids render as their strings."""
        out: list[str] = []
        pending = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < 256:
                pending.append(i)
                continue
            if i not in self._special_by_id:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocab [0, {self.vocab_size})")
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self._special_by_id[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes:
        """The bytes `token_id` adds to a decoded text: its byte (a piece of a multi-byte
        character alone, which `decode` would show as U+FFFD), or a special token's text."""
        i = int(token_id)
        if 0 <= i < 256:
            return bytes([i])
        return self.decode([i], skip_special_tokens=skip_special_tokens).encode("utf-8")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = False, template: str | None = None,
                            **context: Any) -> str:
        return apply_chat_template(messages, template or self.chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token="<bos>", eos_token="<eos>", **context)


# ----------------------------------------------------------------------------- Hugging Face


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _pick_template(value: Any, where: str) -> tuple[str | None, dict[str, str]]:
    """(the template, the named templates beside it) of a tokenizer_config.json
    `chat_template`: a string, or a list of named templates whose `default` entry is the
    template (transformers renders its `tool_use` entry for a call with tools)."""
    if value is None or isinstance(value, str):
        return value, {}
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"], named
        raise ValueError(f"{where}: chat_template has no 'default' entry (has {sorted(map(str, named))})")
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")


def _byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table: byte-level BPE vocabularies write
    each byte as one printable character (printable ASCII and Latin-1 as themselves, the
    other bytes as U+0100 onwards, in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(moved)}}


def _register_special_tokens(tokenizer: Any, tokens: Sequence[str | None]) -> None:
    """Makes the vocabulary tokens among `tokens` that `tokenizer` (loaded here, not the
    caller's) does not list as added special tokens, as transformers does with the special
    tokens tokenizer_config.json names: their text then encodes as their single id wherever
    it stands (a chat template's `</s>` after a word) and `skip_special_tokens` drops them.
    A token outside the vocabulary is left for the caller to refuse by name."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    missing = [t for t in dict.fromkeys(tokens) if t and t not in added and tokenizer.token_to_id(t) is not None]
    if missing:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece
_GIL_FREE_CHARS = 4096  # texts at least this long are encoded with the GIL released (HFTokenizer.encode)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (tokenizer.json) with its special tokens and chat template."""

    def __init__(self, tokenizer: Any, *, eos_token: str, pad_token: str | None = None,
                 bos_token: str | None = None, chat_template: str | None = None,
                 tool_use_template: str | None = None):
        self._tok = tokenizer
        self.eos_token, self.bos_token = eos_token, bos_token
        self.pad_token = pad_token or eos_token  # common practice when a vocab has no pad token
        self.eos_id = self._id(eos_token, "eos_token")
        self.pad_id = self._id(self.pad_token, "pad_token")
        self.bos_id = self._id(bos_token, "bos_token") if bos_token else None
        self.chat_template = chat_template
        # what a call with tools renders in place of chat_template (a named list's `tool_use`
        # entry, as transformers picks it), or None
        self.tool_use_template = tool_use_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str, field: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{field}: token {token!r} is not in the tokenizer's vocabulary")
        return i

    @classmethod
    def from_file(cls, tokenizer_json: str, tokenizer_config: str | None = None, *,
                  special_tokens_map: str | None = None, chat_template: str | None = None,
                  tool_use_template: str | None = None, eos_token: str | None = None,
                  pad_token: str | None = None, bos_token: str | None = None) -> HFTokenizer:
        """Loads `tokenizer.json`, plus special tokens and chat_template from an optional
        `tokenizer_config.json`, and the special tokens it does not name from an optional
        `special_tokens_map.json` (where older model directories keep them); keyword
        arguments override all of them (`chat_template` the file's named templates too).
        `tool_use_template` (or a named template list's `tool_use` entry) renders calls with tools."""
        tokenizer_json = os.fspath(tokenizer_json)
        try:
            tok = RawTokenizer.from_file(tokenizer_json)
        except Exception as e:  # the tokenizers library's own error names no file
            raise ValueError(f"{tokenizer_json}: not a readable tokenizer.json ({e})") from None
        # a tokenizer saved after a call with truncation or padding keeps them in the file;
        # transformers turns them off for a call that asks for neither, as every call here is
        tok.no_truncation()
        tok.no_padding()
        cfg = {} if tokenizer_config is None else read_json_object(tokenizer_config)
        named = {} if special_tokens_map is None else read_json_object(special_tokens_map)

        def special(given: str | None, key: str) -> str | None:
            return given or _token_content(cfg.get(key)) or _token_content(named.get(key))

        eos = special(eos_token, "eos_token")
        if not eos:
            raise ValueError(f"eos_token: {tokenizer_json} has no eos_token in a tokenizer_config.json or "
                             "special_tokens_map.json; pass eos_token=...")
        specials = [special(pad_token, "pad_token"), special(bos_token, "bos_token")]
        _register_special_tokens(tok, [eos, *specials])
        # a template given here replaces the file's, named ones included (as chat_template.jinja does)
        template, templates = (chat_template, {}) if chat_template else _pick_template(cfg.get("chat_template"),
                                                                                       str(tokenizer_config))
        return cls(tok, eos_token=eos, pad_token=specials[0], bos_token=specials[1], chat_template=template,
                   tool_use_template=tool_use_template or templates.get("tool_use"))

    @classmethod
    def from_dir(cls, path: str, **overrides: Any) -> HFTokenizer:
        """A Hugging Face model directory: tokenizer.json, tokenizer_config.json if present, and
        chat_template.jinja and additional_chat_templates/tool_use.jinja (newer transformers
        keep the templates there) if present."""
        path = os.fspath(path)
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tokenizer_json):
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        return cls._from_file_and_siblings(tokenizer_json, **overrides)

    @classmethod
    def _from_file_and_siblings(cls, tokenizer_json: str, **overrides: Any) -> HFTokenizer:
        """`tokenizer_json` with the `tokenizer_config.json`, `special_tokens_map.json`,
        `chat_template.jinja` and `additional_chat_templates/tool_use.jinja` beside it, if
        present (what `from_dir` reads; `load_tokenizer` given the file's path). Newer
        transformers save a named template list's `default` entry as chat_template.jinja and
        the others into additional_chat_templates/."""
        folder = os.path.dirname(os.fspath(tokenizer_json))
        config, named = (os.path.join(folder, name) for name in ("tokenizer_config.json", "special_tokens_map.json"))
        for key, file in (("chat_template", "chat_template.jinja"),
                          ("tool_use_template", os.path.join("additional_chat_templates", "tool_use.jinja"))):
            jinja = os.path.join(folder, file)
            if key not in overrides and os.path.exists(jinja):
                with open(jinja, encoding="utf-8") as f:
                    overrides[key] = f.read()
        return cls.from_file(tokenizer_json, config if os.path.exists(config) else None,
                             special_tokens_map=named if os.path.exists(named) else None, **overrides)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the serialised tokenizer (vocabulary, merges, normaliser, ...): what
        the data cache keys on, so a tokenizer.json edited in place is not mistaken for the old one."""
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()

    @functools.cached_property
    def marks_text_start(self) -> bool:
        """`starts_texts_with_a_mark(self)`: how `encode_continuation` encodes for it."""
        return starts_texts_with_a_mark(self)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids; `add_special_tokens` runs the tokenizer's post-processor (e.g. adds BOS).
        A long text is encoded with the GIL released: `tokenizers`' `encode` holds it
        throughout (0.6 s for a MB of text, during which no other thread of the process runs:
        `jrl serve`'s event loop, tokenizing a large prompt on a thread of its own), its
        `encode_batch_fast` lets it go (the same ids; no character offsets, which are not
        read here, and so no costly freeing of them either)."""
        if len(text) < _GIL_FREE_CHARS:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes:
        """The bytes `token_id` adds to a decoded text. A vocabulary piece of a byte-level BPE
        (GPT-2, Qwen, Llama 3: each byte written as one character of GPT-2's table) or a
        byte-fallback piece (`<0xE2>`, SentencePiece) gives its raw bytes, which may be part
        of a multi-byte character (`decode` of it alone is U+FFFD); any other token (added
        and special tokens included) the UTF-8 of its decoded text."""
        i = int(token_id)
        piece = self._tok.id_to_token(i)
        if piece is not None and i not in self._added_ids:
            if "ByteLevel" in self._decoder_kinds and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            match = _BYTE_PIECE.fullmatch(piece) if "ByteFallback" in self._decoder_kinds else None
            if match:
                return bytes([int(match[1], 16)])
        return self.decode([i], skip_special_tokens=skip_special_tokens).encode("utf-8")

    @functools.cached_property
    def _decoder_kinds(self) -> frozenset[str]:
        """The types of the tokenizer's decoder (a Sequence's members too)."""
        decoder = {} if self._tok.decoder is None else json.loads(self._tok.decoder.__getstate__())
        return frozenset([decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or ()])

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        """Ids of added tokens, whose text is written as is (not byte-level encoded)."""
        return frozenset(self._tok.get_added_tokens_decoder())

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = False, template: str | None = None,
                            **context: Any) -> str:
        """Renders `messages` with `template`, else the tokenizer's: its `tool_use_template`
        when `tools` are given and it has one (as transformers chooses), else `chat_template`."""
        if template is None and context.get("tools") is not None:
            template = self.tool_use_template
        return apply_chat_template(messages, template or self.chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token, **context)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """`"bytes"` -> ByteTokenizer; a directory -> HFTokenizer.from_dir; a tokenizer.json file ->
    HFTokenizer._from_file_and_siblings (with the tokenizer_config.json and chat_template.jinja
    beside it, if any, as from_dir reads them)."""
    if spec == "bytes":
        return ByteTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer.from_dir(spec)
    if os.path.isfile(spec):
        return HFTokenizer._from_file_and_siblings(spec)
    raise ValueError(f"tokenizer: {spec!r} is neither 'bytes' nor an existing tokenizer.json or directory")


__all__ = [
    "DEFAULT_CHAT_TEMPLATE", "ByteTokenizer", "ChatTemplateError", "HFTokenizer", "Tokenizer",
    "apply_chat_template", "load_tokenizer", "template_failure",
]
