"""Request bodies of the OpenAI-compatible endpoints (pydantic), and the error object.

Fields jrl does not implement but clients commonly send are declared so that a value that
would change the result is refused with a 400 naming the field (`logit_bias`, `echo`,
`best_of`, `suffix`, a `response_format` other than text); other fields (`user`,
`metadata`, `store`, or a misspelt name) are ignored, each logged once by the server. Range checks of the sampling values are the
engine's own (`jrl.rollout.SamplingParams`), reported under the OpenAI field name. Numbers
are strict, as OpenAI's: `"max_tokens": "5"`, `5.0` or `true` for an integer is refused, not
converted (an integer is accepted for a float); so are booleans (`"stream": "true"` or `1`).
"""

from __future__ import annotations

import email.message
import functools
import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException


class ServeError(Exception):
    """An error answered as an OpenAI error object: `status`, a message, the offending
    field (`param`) and a `type` / `code`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value


MAX_STOP = 4  # stop strings a request may give (OpenAI's API: "up to 4 sequences")


class _Common(BaseModel):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    # no "5" for 5, as OpenAI's API; fields not declared are kept aside (`ignored_fields`)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # jrl extension (as vLLM's): run to max_tokens, for benchmarks
    # Declared so that a value that would change the answer is refused, not ignored.
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`"temperature": null` (any optional field sent as null) means the field's default,
        as in OpenAI's API, where the optional parameters are nullable; clients that build
        the body from a struct (LangChain, hand-written ones) send nulls for what is unset.
        A required field (`model`, `prompt`, `messages`) sent as null is still refused."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_type(cls, value: Any) -> Any:
        """One message naming `stop` (the union's own errors name `stop.str` and
        `stop.list[str].0`, one per member)."""
        if value is None or isinstance(value, str) or (isinstance(value, list)
                                                       and all(isinstance(s, str) for s in value)):
            return value
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:  # OpenAI's limit; each one is matched against the text after every step
            raise ServeError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
        for i, s in enumerate(stops):
            if s == "":
                raise ServeError(f"stop[{i}]: stop strings must be non-empty", param="stop")
        return stops

    def ignored_fields(self) -> list[str]:
        """The request's fields this server does not read: harmless ones (`user`, `store`)
        and misspellings alike (a `temprature` would otherwise sample at 1.0 unnoticed)."""
        return sorted(self.model_extra or ())

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise ServeError("logit_bias: not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:  # OpenAI's API refuses it too
            raise ServeError("stream_options: only allowed with stream: true", param="stream_options")


class ChatMessage(BaseModel):
    """One chat message. `role` and `content` are checked by `ChatCompletionRequest.check_messages`
    (a 400 naming `messages[i].role` / `messages[i].content`, as OpenAI's API), not by the
    type (whose errors would name only `messages`, or pydantic's union branches)."""

    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, name, ... go to the template

    role: Any = None
    content: Any = None


# OpenAI's chat roles; any other (a "wizard") is refused, not handed to the chat template.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# Arguments the server passes to the tokenizer's apply_chat_template itself.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "template", "bos_token", "eos_token", "tools"})


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_type(cls, value: Any) -> Any:
        """One message naming `tool_choice` (the union's own errors name `tool_choice.str`
        and `tool_choice.dict[str,any]`, and a client saw the first)."""
        if value is None or isinstance(value, (str, dict)):
            return value
        raise PydanticCustomError("tool_choice_type", "must be 'auto', 'none' or a tool choice object")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:  # OpenAI's API refuses it too
            raise ServeError("top_logprobs: only allowed with logprobs: true", param="top_logprobs")
        if self.top_logprobs:
            raise ServeError("top_logprobs: the engine reports only the sampled token's log-probability; "
                             "top alternatives are not available (use top_logprobs 0 or leave it out)",
                             param="top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ServeError("response_format: only {'type': 'text'} is supported (no constrained decoding)",
                             param="response_format")
        if isinstance(self.tool_choice, dict) or self.tool_choice == "required":
            raise ServeError("tool_choice: only 'auto' and 'none' are supported (no forced tool calls)",
                             param="tool_choice")
        if self.tool_choice not in (None, "auto", "none"):  # a typo would otherwise act as 'auto'
            raise ServeError(f"tool_choice: {self.tool_choice!r} is not a tool choice; this server takes 'auto' "
                             "and 'none' (no forced tool calls)", param="tool_choice")
        reserved = sorted(set(self.chat_template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
        if reserved:
            # they would clash with the server's own arguments to the template (a TypeError
            # blamed on `messages`), or replace its chat template or special tokens
            raise ServeError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here (the server sets "
                             f"{', '.join(sorted(_TEMPLATE_ARGUMENTS))} itself; tools go in `tools`)",
                             param="chat_template_kwargs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ServeError("max_completion_tokens: differs from max_tokens; give one of them",
                             param="max_completion_tokens")

    def check_messages(self) -> None:
        """Each message's role is one of OpenAI's, its `name` (if any) a string and its
        content a string or a non-empty list of parts, present unless the role lets it be
        null: an assistant message carrying `tool_calls` (or the legacy `function_call`), a
        `function` message (OpenAI's rule); a `tool` message answers a call of the assistant
        message before it (`_check_tool_answer`). Without this a message with no content
        reached the template as "", an unknown role was rendered as written, and a tool's
        answer to no call reached the model."""
        expected = ", ".join(repr(r) for r in ROLES)
        asked: tuple[int, list[Any]] | None = None  # the assistant message tool messages may answer, its call ids
        for i, m in enumerate(self.messages):
            if m.role is None:
                raise ServeError(f"messages[{i}].role: missing; expected one of {expected}",
                                 param=f"messages[{i}].role")
            if m.role not in ROLES:
                raise ServeError(f"messages[{i}].role: {m.role!r} is not a role; expected one of {expected}",
                                 param=f"messages[{i}].role")
            extra = m.model_extra or {}
            name = extra.get("name")
            if name is not None and not isinstance(name, str):  # as OpenAI's; a template would render it as is
                raise ServeError(f"messages[{i}].name: must be a string, got {_short_repr(name)}",
                                 param=f"messages[{i}].name")
            if m.role == "assistant":
                _check_tool_calls(i, extra.get("tool_calls"))
            if m.role == "tool":
                _check_tool_answer(i, extra.get("tool_call_id"), asked)
            else:
                asked = (i, _call_ids(extra.get("tool_calls"))) if m.role == "assistant" else None
            where = f"messages[{i}].content"
            if m.content is None:
                calls = extra.get("tool_calls") or extra.get("function_call")
                if m.role == "function" or (m.role == "assistant" and calls):
                    continue
                unless = " unless it has tool_calls" if m.role == "assistant" else ""
                raise ServeError(f"{where}: missing; a {m.role!r} message needs content (a string or a list of text "
                                 f"parts){unless}", param=where)
            if isinstance(m.content, list):
                if not m.content:  # OpenAI's API: an array of at least one part
                    raise ServeError(f"{where}: an empty list of content parts; give a string or at least one part",
                                     param=where)
                for j, part in enumerate(m.content):
                    if not isinstance(part, dict):
                        raise ServeError(f"{where}[{j}]: must be a content part object ({{\"type\": \"text\", "
                                         f"\"text\": ...}}), got {part!r}", param=where)
            elif not isinstance(m.content, str):
                raise ServeError(f"{where}: must be a string or a list of content parts, got {m.content!r}",
                                 param=where)

    def tools_to_parse(self) -> list[dict[str, Any]] | None:
        """The tools whose calls are read from the answer: none with `tool_choice: "none"`
        (OpenAI's: the model calls no tool; a call it writes anyway stays in `content`)."""
        return None if self.tool_choice == "none" else self.tools

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: true encodes a text prompt with the tokenizer's special tokens (its BOS), as
    # transformers encodes a text; false: the text's own tokens only. Token ids are sent as
    # given. Absent (or null): the server's default (`Served.add_special_tokens`: true, as
    # vLLM, unless a jrl run encoded its plain text without the BOS).
    add_special_tokens: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, value: Any) -> Any:
        """One message naming `prompt` and the types it takes, with the first value that is
        none of them (the union's own errors name `prompt.str`, `prompt.list[int].0`, ...,
        one per member, and the first of them was all a client saw)."""
        bad = _prompt_type_error(value)
        if bad is None:
            return value
        raise PydanticCustomError("prompt_type", "must be a string, a list of strings, a list of token ids "
                                  "(integers) or a list of lists of token ids, got {got}", {"got": bad})

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise ServeError("logprobs: the engine reports only the sampled token's log-probability; "
                             "top alternatives are not available (use logprobs 0 for the tokens' own)",
                             param="logprobs")
        if self.echo:
            raise ServeError("echo: not supported by this server", param="echo")
        if self.best_of is not None and self.best_of != self.n:
            raise ServeError("best_of: not supported by this server (leave it out or equal to n)", param="best_of")
        if self.suffix:
            raise ServeError("suffix: not supported by this server (no fill-in-the-middle)", param="suffix")


def _call_ids(calls: Any) -> list[Any]:
    """The ids of an assistant message's `tool_calls`."""
    return [c.get("id") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _check_tool_calls(i: int, calls: Any) -> None:
    """Message i's `tool_calls` (an assistant message's), if any: a list of objects, as
    OpenAI's API takes them. A string or an object was taken for calls (the message's missing
    content let through, the chat template given it to iterate)."""
    if calls is None:
        return
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ServeError(f"{where}: must be a list of tool call objects, got {_short_repr(calls)}", param=where)
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ServeError(f"{where}[{j}]: must be a tool call object, got {_short_repr(call)}", param=where)


def _check_tool_answer(i: int, call_id: Any, asked: tuple[int, list[Any]] | None) -> None:
    """Message i, a `tool` message, answers a tool call as OpenAI's API requires: its
    `tool_call_id` is a string, the id of a call of the assistant message before it (with
    only tool messages between). `asked`: that assistant message's index and call ids,
    None when the message before the tool messages is no assistant message."""
    where = f"messages[{i}].tool_call_id"
    if call_id is None:
        raise ServeError(f"{where}: missing; a 'tool' message needs the id of the tool call it answers (one of the "
                         f"tool_calls of the assistant message before it)", param=where)
    if not isinstance(call_id, str):
        raise ServeError(f"{where}: must be a string, got {_short_repr(call_id)}", param=where)
    answered = _short_repr(call_id)
    if asked is None or not asked[1]:
        raise ServeError(f"{where}: {answered} answers no tool call: a 'tool' message must follow an assistant "
                         f"message with tool_calls (or the other tool messages answering it)", param=where)
    if call_id not in asked[1]:
        ids = ", ".join(_short_repr(x) for x in asked[1])
        raise ServeError(f"{where}: {answered} answers no tool call of messages[{asked[0]}] (its tool_calls' "
                         f"ids: {ids})", param=where)


def _is_token_id(x: Any) -> bool:
    return type(x) is int  # not a bool, not 2.0: numbers are strict


def _short_repr(x: Any, limit: int = 40) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _prompt_type_error(value: Any) -> str | None:
    """None for a prompt of an accepted type, else what broke it: the value, or the first
    element that does not fit the kind of list its first element makes it ("3 at prompt[1]")."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):
        return "an object" if isinstance(value, dict) else _short_repr(value)
    if not value:
        return None  # "prompt: must not be empty", later
    first = value[0]
    if isinstance(first, str):
        bad = next(((i, x) for i, x in enumerate(value) if not isinstance(x, str)), None)
    elif isinstance(first, list):
        bad = None
        for i, x in enumerate(value):
            if not isinstance(x, list):
                bad = (i, x)
                break
            j = next((j for j, t in enumerate(x) if not _is_token_id(t)), None)
            if j is not None:
                bad = (f"{i}][{j}", x[j])
                break
    elif _is_token_id(first):
        bad = next(((i, x) for i, x in enumerate(value) if not _is_token_id(x)), None)
    else:
        bad = (0, first)
    return None if bad is None else f"{_short_repr(bad[1])} at prompt[{bad[0]}]"


class WeightsRequest(BaseModel):
    """POST /v1/weights: `checkpoint` is a run directory, its checkpoints/ directory (the
    latest step), a step_<N> directory or hf:<dir>; `version` defaults to the step's
    recorded policy version, else the served version + 1."""

    model_config = ConfigDict(extra="forbid", strict=True)

    checkpoint: str
    version: int | None = Field(None, ge=0)



M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes, content_type: str | None) -> M:
    """The request body `raw` as `model`, read and validated as FastAPI reads a JSON body
    parameter (`fastapi.routing.get_request_handler`, strict content type), with the same
    exceptions: a RequestValidationError (`json_invalid`, a missing body, or the model's
    errors located under "body"), or an HTTPException 400 caused by the decoding error.
    The endpoints take the bytes and call this off the event loop (`Server.prepare_*`):
    a few MB of token ids take half a second to parse and validate."""
    body: Any = None
    try:
        if raw:
            body = raw  # a body that is not declared JSON is validated as bytes (and refused)
            if content_type:
                message = email.message.Message()
                message["content-type"] = content_type
                subtype = message.get_content_subtype()
                if message.get_content_maintype() == "application" and (subtype == "json"
                                                                         or subtype.endswith("+json")):
                    body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg, "position": f"line {e.lineno} column "
                                                                                        f"{e.colno} (char {e.pos})"}}],
                                     body=e.doc) from e
    except Exception as e:  # e.g. a UnicodeDecodeError: the handler names the bytes
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return _adapter(model).validate_python(body, from_attributes=True)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)],
                                     body=body) from None


@functools.cache
def _adapter(model: type[BaseModel]) -> TypeAdapter:
    return TypeAdapter(model)
