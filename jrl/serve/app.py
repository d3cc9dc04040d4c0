"""The HTTP side: a FastAPI app over one engine loop (see docs/serve.md), in a process of
its own (`EngineProcess`, what `jrl serve` runs) or on a thread of this one (`EngineWorker`).

Every handler runs on the event loop and never blocks it: a request is parsed, validated
and tokenized (`Server.prepare_chat` / `prepare_completion`: on a small thread pool unless
its body is small), queued to the engine loop as one engine request per choice, and its
tokens come back through asyncio queues. Errors are OpenAI error objects naming the field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from jrl.rl.prompts import end_of_turn_ids
from jrl.rollout import Engine, SamplingParams
from jrl.serve.loading import Served
from jrl.serve.protocol import (ChatCompletionRequest, CompletionRequest, ServeError, WeightsRequest,
                                error_body, parse_body, _Common, _short_repr)
from jrl.serve.text import TextStream, token_bytes, token_str
from jrl.serve.tools import ToolCallStream, parse_tool_calls
from jrl.serve.worker import DoneEvent, EngineWorker, ErrorEvent, Handle, TokenEvent, WeightsRefused
from jrl.tokenizer import ChatTemplateError

log = logging.getLogger("jrl.serve")

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "error": "error"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                    "repetition_penalty")

# Work bigger than these runs on the server's thread pool (`Server.offload`) instead of the
# event loop, where it held every other client: parsing, validating and tokenizing a request
# body over OFFLOAD_BYTES (0.4 to 0.7 s a MB of text), decoding a plain answer of more than
# OFFLOAD_TOKENS tokens (25 ms for 4096, 100 ms with logprobs). Below them the thread hop
# would cost more than the stall it saves (a few ms at most).
OFFLOAD_BYTES = 8 * 2**10
OFFLOAD_TOKENS = 512
OFFLOAD_THREADS = min(4, os.cpu_count() or 1)

# Distinct ignored request field names logged (each once); then one line says the rest are
# not: a body of thousands of made-up names wrote a line for each, and kept them all.
MAX_IGNORED_LOGGED = 64

# A request ready for the engine: its body, its prompts' token ids, max_tokens (one, or one
# per prompt) and its stop strings.
Prepared = tuple[Any, list[np.ndarray], "int | list[int]", list[str]]


class Server:
    """State shared by the handlers: the served model, the engine loop, the admission
    count behind the 429s. `engine`: an Engine (driven by an EngineWorker thread started
    with the app) or an already running EngineProcess; both have `config`, `seq_limit` and
    `version`."""

    def __init__(self, served: Served, engine: Any, *, max_queue: int = 256, admin_token: str | None = None,
                 retry_after_s: int = 1, warmup: tuple[int, float] = (0, 0.0)) -> None:
        self.served, self.engine = served, engine
        self.warmup = warmup  # (programs, seconds) the engine's warm-up took before the server listened
        self.tokenizer = served.tokenizer
        self.eos_ids = end_of_turn_ids(served.tokenizer)
        self.capacity = engine.config.max_batch + max_queue  # engine requests admitted at once
        self.admin_token = admin_token
        self.retry_after_s = retry_after_s
        self.outstanding = 0  # engine requests submitted and not yet finished (event loop only)
        self.worker: Any = None  # EngineWorker | EngineProcess
        self.weights_lock = asyncio.Lock()
        self.created = int(time.time())
        self.ignored_seen: set[str] = set()  # request fields already logged as ignored
        self.ignored_muted = False  # MAX_IGNORED_LOGGED names logged: no more
        self._ignored_lock = threading.Lock()  # requests are prepared on several threads
        self.handles: weakref.WeakSet[Handle] = weakref.WeakSet()  # engine requests of the requests in flight
        self.offload_bytes, self.offload_tokens = OFFLOAD_BYTES, OFFLOAD_TOKENS
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        if self.worker is None:
            self.worker = EngineWorker(self.engine, self.served) if isinstance(self.engine, Engine) else self.engine

    def stop(self, timeout: float = 30.0) -> None:
        if self.worker is not None:
            self.worker.stop(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @property
    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that prepare large requests and decode long answers: bounded, so a
        burst of big requests queues here (their tokenizing releases the GIL) rather than
        taking every core, and apart from asyncio's default executor."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(OFFLOAD_THREADS, thread_name_prefix="jrl-serve-prep")
        return self._pool

    async def offload(self, big: bool, fn: Any, *args: Any) -> Any:
        """fn(*args): on the pool if `big`, else here on the event loop (a small piece of work
        costs less than the hop to a thread and back)."""
        if not big:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------ a request's body -> engine prompts
    # Both run off the event loop for a large body; the checks in the order FastAPI and the
    # handlers made them before (parse, validate, then the request's own checks), so a request
    # breaking several rules is refused for the same one whatever its size.
    def _checked_body(self, model: type, raw: bytes, content_type: str | None) -> tuple[Any, list[str]]:
        """The body parsed as `model` and through the checks every endpoint makes: the
        served model, the fields it ignores or refuses; with its stop strings."""
        body = parse_body(model, raw, content_type)
        self.check_model(body)
        self.note_ignored_fields(body)
        body.refuse_unsupported()
        return body, body.stop_strings()

    def prepare_chat(self, raw: bytes, content_type: str | None) -> Prepared:
        body, stop = self._checked_body(ChatCompletionRequest, raw, content_type)
        body.check_messages()
        prompt = self.render_chat(body)
        limit = self.max_new_tokens(len(prompt), body.token_limit(),
                                    "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                                    "messages")
        return body, [prompt], limit, stop

    def prepare_completion(self, raw: bytes, content_type: str | None) -> Prepared:
        body, stop = self._checked_body(CompletionRequest, raw, content_type)
        prompts = self.completion_prompts(body)
        limit = body.max_tokens if body.max_tokens is not None else 16
        limits = [self.max_new_tokens(len(p), limit, "max_tokens", "prompt", "prompt" if len(prompts) == 1 else
                                      f"prompt[{k}]") for k, p in enumerate(prompts)]
        return body, prompts, limits[0] if len(set(limits)) == 1 else limits, stop

    # ------------------------------------------------------------------ requests -> engine requests
    def check_model(self, body: _Common) -> None:
        if body.model != self.served.name:
            raise ServeError(f"model: {body.model!r} is not served here; this server serves {self.served.name!r}",
                             param="model", code="model_not_found")

    def note_ignored_fields(self, body: _Common) -> None:
        """Logs each request field this server does not read, once per name, for the first
        MAX_IGNORED_LOGGED names."""
        for name in body.ignored_fields():
            with self._ignored_lock:
                if self.ignored_muted or name in self.ignored_seen:
                    continue
                if len(self.ignored_seen) >= MAX_IGNORED_LOGGED:
                    self.ignored_muted = True
                    log.warning("request fields this server does not read: %d names logged; further ones are "
                                "ignored without a log line", MAX_IGNORED_LOGGED)
                    continue
                self.ignored_seen.add(name)
                log.warning("request field %r is not one this server reads; ignored (a misspelt sampling "
                            "parameter takes its default)", name)

    def sampling(self, body: _Common, choice: int) -> SamplingParams:
        seed = None if body.seed is None else body.seed + choice
        if seed is not None and not 0 <= body.seed < 2**32:
            raise ServeError(f"seed: must be an integer in [0, 2**32), got {body.seed}", param="seed")
        try:
            return SamplingParams(**{f: getattr(body, f) for f in _SAMPLING_FIELDS},
                                  seed=None if seed is None else seed % 2**32)
        except ValueError as e:
            message = str(e)
            field = message.split(":", 1)[0].removeprefix("sampling.")
            raise ServeError(message.removeprefix("sampling."), param=field) from None

    def max_new_tokens(self, prompt_len: int, limit: int | None, field: str, prompt_field: str,
                       which: str = "prompt") -> int:
        """The request's max_new_tokens: `limit`, or what is left of the context. `which`: the
        prompt the errors name, `prompt[k]` of several (one of a hundred was not found)."""
        seq_limit = self.engine.seq_limit
        the = "the prompt" if which == "prompt" else which
        if prompt_len >= seq_limit:
            raise ServeError(f"{prompt_field}: {the} has {prompt_len} tokens, the context is {seq_limit} "
                             f"(max_seq_len): no room for a completion", param=prompt_field)
        config = self.engine.config
        if not config.chunked_prefill and prompt_len > config.max_tokens_per_step:  # the engine would refuse it
            raise ServeError(f"{prompt_field}: {the} has {prompt_len} tokens; without chunked_prefill a prompt "
                             f"is prefilled in one step of at most max_tokens_per_step ({config.max_tokens_per_step}) "
                             f"tokens", param=prompt_field)
        if limit is None:
            limit = seq_limit - prompt_len
        elif prompt_len + limit > seq_limit:
            raise ServeError(f"{field}: {which} ({prompt_len} tokens) + {field} ({limit}) = {prompt_len + limit} "
                             f"exceeds the context of {seq_limit} tokens (max_seq_len)", param=field)
        pages = self.engine.config.pages_for(prompt_len + limit)
        if pages > self.engine.config.n_pages:
            raise ServeError(f"{field}: {which} + {field} = {prompt_len + limit} tokens need {pages} KV pages, the "
                             f"pool has {self.engine.config.n_pages}", param=field)
        return limit

    def end_in_flight(self, message: str) -> int:
        """Fails every engine request still running with a 503 `message` (a plain answer's
        error object, a stream's error event and then [DONE]) and aborts it; the count."""
        ended = 0
        for handle in list(self.handles):
            if not handle.done:
                handle.queue.put_nowait(ErrorEvent(message, status=503))
                self.worker.abort(handle)
                ended += 1
        return ended

    def request_ended(self) -> None:
        self.outstanding -= 1

    def check_running(self) -> None:
        if self.worker is None or not self.worker.alive:
            raise ServeError("the engine is not running", status=503, type="server_error")

    def admit(self, n: int) -> None:
        self.check_running()
        if self.outstanding + n > self.capacity:
            raise ServeError(f"server busy: {self.outstanding} requests in flight, at most {self.capacity} "
                             f"(max_batch + max_queue); retry later", status=429, type="rate_limit_error",
                             code="queue_full", headers={"Retry-After": str(self.retry_after_s)})

    def render_chat(self, body: ChatCompletionRequest) -> np.ndarray:
        messages = []
        for i, m in enumerate(body.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                parts = []
                for j, part in enumerate(m.content):
                    if part.get("type") != "text":
                        raise ServeError(f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                         f"{part.get('type')!r}", param=f"messages[{i}].content")
                    if not isinstance(part.get("text"), str):
                        got = "none" if part.get("text") is None else _short_repr(part["text"])
                        raise ServeError(f"messages[{i}].content[{j}]: a text part needs a string 'text', got {got}",
                                         param=f"messages[{i}].content")
                    parts.append(part["text"])
                msg["content"] = "\n".join(parts)  # as vLLM, SGLang and TensorRT-LLM join them
            elif m.content is None:
                msg["content"] = ""
            if m.role == "assistant" and isinstance(msg.get("tool_calls"), list):
                msg["tool_calls"] = [_arguments_as_object(call) for call in msg["tool_calls"]]
            messages.append(msg)
        for i, msg in enumerate(messages):
            if isinstance(msg.get("content"), str):
                _check_text(msg["content"], f"messages[{i}].content", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServeError("messages: the served tokenizer has no chat template; use /v1/completions",
                             param="messages")
        context = dict(body.chat_template_kwargs or {})
        if body.tools:
            context["tools"] = body.tools
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **context)
        except ChatTemplateError as e:
            raise ServeError(f"messages: the chat template refused them: {e}", param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template error on unusual input is the input's fault
            raise ServeError(f"messages: rendering the chat template failed: {type(e).__name__}: {e}",
                             param="messages") from None
        _check_text(text, "messages", "messages")  # e.g. in a tool's description or a message's name
        return np.asarray(self.tokenizer.encode(text), np.int32)

    def completion_prompts(self, body: CompletionRequest) -> list[np.ndarray]:
        p = body.prompt
        if isinstance(p, str):
            raw: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [p]
        else:
            raw = list(p)
        if not raw:
            raise ServeError("prompt: must not be empty", param="prompt")
        vocab = self.served.model_config.vocab_size
        add_special_tokens = (body.add_special_tokens if body.add_special_tokens is not None
                              else self.served.add_special_tokens)  # the served model's default
        prompts = []
        for k, x in enumerate(raw):
            where = "prompt" if len(raw) == 1 else f"prompt[{k}]"
            if isinstance(x, str):
                _check_text(x, where, "prompt")
                ids = list(self.tokenizer.encode(x, add_special_tokens=add_special_tokens))
            else:
                ids = list(x)
            if not ids:
                raise ServeError(f"{where}: must hold at least one token", param="prompt")
            # checked as Python ints: an id beyond int64 would not even convert
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ServeError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            prompts.append(np.asarray(ids, np.int32))
        return prompts


def _arguments_as_object(call: Any) -> Any:
    """An assistant message's tool call as chat templates take it: OpenAI's `arguments`, a JSON
    string (as this server answers it), as the object it holds (an empty string: no arguments),
    as vLLM passes it. Tool-use templates (Qwen2.5's, Llama 3.1's) write the arguments with
    `tojson`, which wrote the string JSON-encoded (`"arguments": "{\\"a\\": 1}"`), not the call
    the model wrote. Arguments that are not a JSON object's text reach the template as sent."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or JSON Python will not read (nested too deeply)
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


def _check_text(text: str, where: str, param: str) -> None:
    """A 400 for a string that is not Unicode text: JSON lets a body escape half of a
    surrogate pair ("\\ud800"), which Python decodes to a string no tokenizer (or UTF-8
    encoder) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ServeError(f"{where}: not valid Unicode text: a lone surrogate {text[e.start]!r} at character "
                         f"{e.start} (a \\ud800-\\udfff escape in JSON must be half of a pair)", param=param) from None


class _Choice:
    """One choice being generated: its engine request, its text, what it reports."""

    def __init__(self, server: Server, index: int, prompt_index: int, handle: Handle, stop: list[str],
                 eos_ids: list[int]) -> None:
        self.server, self.index, self.prompt_index, self.handle = server, index, prompt_index, handle
        self.text = TextStream(server.tokenizer, stop, skip_ids=eos_ids)
        self.logprobs: list[float] = []
        self.generated = 0
        self.cached = 0
        self.version = server.engine.version
        self.finish_reason: str | None = None
        self._lp_sent = 0

    async def events(self) -> AsyncIterator[None]:
        """Consumes the engine's events; yields after each batch of tokens. Raises ServeError
        if the engine refused or failed the request."""
        async for event in self.handle:
            if isinstance(event, TokenEvent):
                self.generated += len(event.tokens)
                self.logprobs += event.model_logprobs
                self.version, self.cached = event.version, event.cached_tokens
                # a plain answer's tokens come at once: decoding thousands takes tens of ms
                await self.server.offload(len(event.tokens) > self.server.offload_tokens, self.text.add, event.tokens)
                if self.text.cut:  # a stop string: the rest is not wanted
                    self.server.worker.abort(self.handle)
                    self.finish_reason = "stop"
                    self.text.finish()
                    yield
                    return
                yield
            elif isinstance(event, DoneEvent):
                comp = event.completion
                self.cached = comp.cached_tokens
                if len(comp.versions):
                    self.version = int(comp.versions[-1])
                self.text.finish()  # may find a stop string in the last, incomplete character
                self.finish_reason = "stop" if self.text.cut else _FINISH[comp.finish_reason]
                yield
                return
            elif isinstance(event, ErrorEvent):
                raise ServeError(event.message, param=event.param, status=event.status,
                                 type="invalid_request_error" if event.status == 400 else "server_error")

    def new_logprob_entries(self, final: bool) -> list[tuple[int, float, int]]:
        """(token, logprob, text offset) of the tokens whose text was emitted since the last call."""
        ts = self.text
        end = ts.kept_tokens() if final else sum(1 for o in ts.offsets[:ts.kept_tokens()] if o < ts.emitted)
        out = [(ts.ids[i], self.logprobs[i], ts.offsets[i]) for i in range(self._lp_sent, end)]
        self._lp_sent = max(self._lp_sent, end)
        return out

    def jrl(self) -> dict[str, Any]:
        return {"policy_version": self.version}


def chat_logprobs(tokenizer: Any, entries: list[tuple[int, float, int]]) -> dict[str, Any]:
    content = []
    for tok, lp, _ in entries:
        content.append({"token": token_str(tokenizer, tok), "logprob": lp, "bytes": list(token_bytes(tokenizer, tok)),
                        "top_logprobs": []})
    return {"content": content}


def completion_logprobs(tokenizer: Any, entries: list[tuple[int, float, int]]) -> dict[str, Any]:
    return {"tokens": [token_str(tokenizer, t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": None, "text_offset": [o for _, _, o in entries]}


def _usage(prompts: list[np.ndarray], choices: list[_Choice]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    cached = 0
    for k in range(len(prompts)):
        mine = [c.cached for c in choices if c.prompt_index == k]
        cached += min(mine) if mine else 0
    completion = sum(c.generated for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _gone() -> JSONResponse:
    # 499 (nginx's "client closed request"): nobody reads it, the log says why
    return JSONResponse(error_body("client disconnected; request cancelled"), status_code=499)


def _error_response(e: ServeError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


MAX_REQUEST_MB = 8.0  # the default body limit (--max-request-mb)


def create_app(server: Server, *, shutdown_timeout: float = 30.0, max_request_mb: float = MAX_REQUEST_MB) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop, shutdown_timeout)

    app = FastAPI(title="jrl serve", lifespan=lifespan)
    app.add_middleware(_InternalErrors)
    app.add_middleware(_BodyLimit, limit=int(max_request_mb * 2**20))
    app.state.server = server

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, e: ServeError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # what json.loads found wrong, and where (`parse_body`)
            ctx = first.get("ctx", {})
            what = f": {ctx['error']} at {ctx['position']}" if "position" in ctx else f" ({first.get('msg', '')})"
            return _error_response(ServeError(f"the body is not valid JSON{what}"))
        loc = [x for x in first.get("loc", ()) if x != "body"]
        param = ""
        for x in loc:
            param += f"[{x}]" if isinstance(x, int) else (f".{x}" if param else str(x))
        if not param:
            return _error_response(ServeError("the body must be a JSON object (sent with Content-Type: "
                                              f"application/json): {first.get('msg', '')}"))
        msg = f"{param}: {first.get('msg', 'invalid')}"
        # a scalar's value, unless the message says what it got itself (ctx "got")
        if "input" in first and not isinstance(first["input"], (dict, list)) and "got" not in first.get("ctx", {}):
            msg += f", got {first['input']!r}"
        return _error_response(ServeError(msg, param=param.split("[")[0].split(".")[0]))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        cause = e.__cause__
        if isinstance(cause, UnicodeDecodeError):
            # FastAPI's "There was an error parsing the body" for json.loads' decoding error
            bad = cause.object[cause.start:cause.end]
            return _error_response(ServeError(
                f"the body is not valid UTF-8 JSON: byte{'s' if len(bad) > 1 else ''} "
                f"{' '.join(f'0x{b:02x}' for b in bad)} at offset {cause.start} ({cause.reason})"))
        if isinstance(cause, RecursionError):  # json.loads of arrays / objects nested thousands deep
            return _error_response(ServeError(f"the body is nested too deeply to parse ({cause})"))
        return JSONResponse(error_body(str(e.detail), type="invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.get("/health")
    async def health():
        worker = server.worker
        ok = worker is not None and worker.alive
        snap = dict(worker.snapshot) if worker is not None else {}
        body = {"status": "ok" if ok else "unavailable", "model": server.served.name,
                "outstanding_requests": server.outstanding, "capacity": server.capacity, "engine": snap}
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_object() -> dict[str, Any]:
        served = server.served
        return {"id": served.name, "object": "model", "created": server.created, "owned_by": "jrl",
                "max_model_len": server.engine.seq_limit,
                "jrl": {"policy_version": server.engine.version, "source": served.source,
                        "add_special_tokens": served.add_special_tokens}}  # /v1/completions' default

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model:path}")  # :path: a served name may hold a slash ("org/name")
    async def model(model: str):
        """The openai client's `models.retrieve(id)`: the model object of the served name, else
        OpenAI's 404 `model_not_found` error object."""
        if model != server.served.name:
            raise ServeError(f"The model {model!r} does not exist; this server serves {server.served.name!r}",
                             status=404, code="model_not_found")
        return model_object()

    # The bodies are read here and parsed by the handlers (`parse_body`, FastAPI's reading,
    # errors included), not declared as parameters: FastAPI would parse and validate them on
    # the event loop before the handler runs. /openapi.json still documents them
    # (`_openapi_body`, `_with_body_schemas`).
    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await _answer(request, server.prepare_chat, chat=True)

    @app.post("/v1/completions", openapi_extra=_openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await _answer(request, server.prepare_completion, chat=False)

    async def _answer(request: Request, prepare: Any, chat: bool) -> Any:
        prepared = await _prepare(request, prepare)
        if prepared is _GONE:
            return _gone()
        body, prompts, limit, stop = prepared
        return await _generate(request, body, prompts, limit, stop, chat=chat)

    async def _prepare(request: Request, prepare: Any) -> Any:
        """prepare(body bytes, content type): here for a small body, else on the server's
        pool, `_GONE` if the client disconnects meanwhile (nothing reaches the engine then)."""
        try:
            raw = await request.body()
        except Exception as e:  # as FastAPI answers a failed read (a client gone mid-body, a 413 cut)
            raise StarletteHTTPException(status_code=400, detail="There was an error parsing the body") from e
        content_type = request.headers.get("content-type")
        if len(raw) <= server.offload_bytes:
            return prepare(raw, content_type)
        return await _wait_or_disconnect(request, server.offload(True, prepare, raw, content_type))

    async def _generate(request: Request, body, prompts: list[np.ndarray], limit, stop: list[str], *, chat: bool):
        n = body.n
        if n * len(prompts) > server.capacity:
            field = "n" if n > 1 else "prompt"  # one choice each: the prompts are too many
            raise ServeError(f"{field}: {n} choices x {len(prompts)} prompt(s) exceed what the server admits at once "
                             f"({server.capacity} = max_batch + max_queue)", param=field)
        eos_ids = [] if body.ignore_eos else server.eos_ids
        samplings = [server.sampling(body, k) for k in range(n * len(prompts))]  # validated before anything runs
        server.admit(n * len(prompts))
        choices: list[_Choice] = []
        # tokens before the end are wanted by a stream, or to find a stop string and stop there
        stream_tokens = bool(body.stream or stop)
        for p_idx, prompt in enumerate(prompts):
            max_new = limit[p_idx] if isinstance(limit, list) else limit
            for j in range(n):
                k = p_idx * n + j
                handle = server.worker.submit(prompt, samplings[k], max_new, eos_ids, on_end=server.request_ended,
                                              stream_tokens=stream_tokens)
                server.outstanding += 1
                server.handles.add(handle)
                choices.append(_Choice(server, k, p_idx, handle, stop, eos_ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        meta = {"id": rid, "created": int(time.time()), "model": server.served.name}
        want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        tools = body.tools_to_parse() if chat else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _stream(choices, prompts, meta, chat, want_logprobs, include_usage, tools)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            if await _wait_or_disconnect(request, _drain_all(choices)) is _GONE:
                return _gone()
        finally:
            _release(choices)

        def answer() -> list[dict[str, Any]]:
            out = []
            for c in choices:
                text = c.text.emit(final=True)
                entries = c.new_logprob_entries(final=True) if want_logprobs else []
                if chat:
                    message: dict[str, Any] = {"role": "assistant", "content": text}
                    finish = c.finish_reason
                    if tools:
                        content, calls = parse_tool_calls(text, tools)
                        message["content"] = content
                        if calls:
                            message["tool_calls"] = calls
                            finish = "tool_calls"
                    out.append({"index": c.index, "message": message, "finish_reason": finish,
                                "logprobs": chat_logprobs(server.tokenizer, entries) if want_logprobs else None,
                                "jrl": c.jrl()})
                else:
                    out.append({"index": c.index, "text": text, "finish_reason": c.finish_reason,
                                "logprobs": completion_logprobs(server.tokenizer, entries) if want_logprobs else None,
                                "jrl": c.jrl()})
            return out

        out = await server.offload(sum(len(c.text.ids) for c in choices) > server.offload_tokens, answer)
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": _usage(prompts, choices), "system_fingerprint": None}

    async def _drain(c: _Choice) -> None:
        async for _ in c.events():
            pass

    async def _drain_all(choices: list[_Choice]) -> None:
        """Drains every choice; the first error ends the others' readers (before it is
        raised): `_release` then aborts their engine requests, which send no event that
        would end a reader's wait (gather() left them waiting for ever)."""
        tasks = [asyncio.ensure_future(_drain(c)) for c in choices]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            # every task's end awaited and its error retrieved (none is logged as unread)
            ends = await asyncio.gather(*tasks, return_exceptions=True)
        error = next((e for e in ends if isinstance(e, Exception)), None)
        if error is not None:
            raise error

    def _release(choices: list[_Choice]) -> None:
        """Aborts the choices' engine requests that are still running (a no-op for the
        finished ones). A stream whose client left before it started never gets here: its
        requests run to their end, and their handles still leave `outstanding` then."""
        for c in choices:
            server.worker.abort(c.handle)

    async def _stream(choices: list[_Choice], prompts, meta: dict, chat: bool, want_logprobs: bool,
                      include_usage: bool, tools: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {**meta, "object": obj, "system_fingerprint": None}
        if include_usage:
            base["usage"] = None
        out: asyncio.Queue = asyncio.Queue()

        def chunk(c: _Choice, text: str, entries, finish: str | None, first: bool = False,
                  calls: list[dict[str, Any]] | None = None) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
                    {"content": text} if text or not finish else {})
                if calls:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                choice = {"index": c.index, "delta": delta, "finish_reason": finish,
                          "logprobs": chat_logprobs(server.tokenizer, entries) if want_logprobs and entries else None}
            else:
                choice = {"index": c.index, "text": text, "finish_reason": finish,
                          "logprobs": completion_logprobs(server.tokenizer, entries) if want_logprobs and entries
                          else None}
            choice["jrl"] = c.jrl()
            return {**base, "choices": [choice]}

        async def run(c: _Choice) -> None:
            # tool calls are read from the whole answer: the text that may hold them waits
            calls_in = ToolCallStream(tools) if chat and tools else None
            try:
                async for _ in c.events():
                    done = c.finish_reason is not None
                    text = c.text.emit(final=done)
                    if calls_in is not None:
                        text = calls_in.add(text)
                    entries = c.new_logprob_entries(final=done) if want_logprobs else []
                    if text or entries:
                        await out.put(chunk(c, text, entries, None))
                finish, text, calls = c.finish_reason or "stop", "", None
                if calls_in is not None:
                    text, calls = calls_in.finish()
                    finish = "tool_calls" if calls else finish
                await out.put(chunk(c, text, [], finish, calls=calls))
            except ServeError as e:
                await out.put(e)
            except Exception as e:  # noqa: BLE001 - a bug: the stream must still end (it waited for this choice)
                log.exception("internal error in a streamed choice")
                await out.put(ServeError(f"internal server error: {type(e).__name__}: {e}", status=500,
                                         type="server_error"))

        tasks = []
        try:
            if chat:
                for c in choices:
                    yield _sse(chunk(c, "", [], None, first=True))
            tasks = [asyncio.create_task(run(c)) for c in choices]
            remaining = len(tasks)
            while remaining:
                item = await out.get()
                if isinstance(item, ServeError):
                    yield _sse(item.body())
                    remaining -= 1
                    continue
                if item["choices"][0]["finish_reason"] is not None:
                    remaining -= 1
                yield _sse(item)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(prompts, choices)})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            _release(choices)

    # The body is parsed after the token is checked (as a parameter, FastAPI would validate
    # it first, answering a client without the token about its body instead of a 401).
    @app.post("/v1/weights", openapi_extra=_openapi_body(WeightsRequest))
    async def weights(request: Request):
        if server.admin_token is None:
            raise ServeError("not found (admin endpoints are off: start the server with --admin-token)", status=404)
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), server.admin_token.encode()):
            raise ServeError("invalid admin token (Authorization: Bearer <token>)", status=401,
                             type="authentication_error")
        body = parse_body(WeightsRequest, await request.body(), request.headers.get("content-type"))
        server.check_running()
        async with server.weights_lock:
            t0 = time.perf_counter()
            try:
                ack, source = await server.worker.load_weights(body.checkpoint, body.version)
            except WeightsRefused as e:
                raise ServeError(str(e), param=e.param) from None
            server.served.source = source
            return {"object": "weights.update", "policy_version": ack.version, "checkpoint": source,
                    "finished_in_flight": ack.finished_in_flight, "restarted": ack.restarted,
                    "seconds": round(time.perf_counter() - t0, 3)}

    _with_body_schemas(app, _PARSED_BODIES)
    return app


# The request bodies the handlers parse themselves (`parse_body`), not FastAPI: documented
# in /openapi.json by hand, as FastAPI documents a body parameter.
_PARSED_BODIES = (ChatCompletionRequest, CompletionRequest, WeightsRequest)
_SCHEMA_REF = "#/components/schemas/{model}"


def _openapi_body(model: type) -> dict[str, Any]:
    """The route's `requestBody` for `openapi_extra`: a required JSON `model`, by reference to
    its component schema (added by `_with_body_schemas`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _SCHEMA_REF.format(model=model.__name__)}}}}}


def _with_body_schemas(app: FastAPI, models: tuple[type, ...]) -> None:
    """app.openapi() with the JSON schemas of `models` (validation mode, as FastAPI's for a
    body parameter) and the models they nest (ChatMessage, StreamOptions) among the
    document's components, where `_openapi_body`'s references point."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()  # FastAPI's, cached as app.openapi_schema
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_SCHEMA_REF)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
        return app.openapi_schema

    app.openapi = openapi


class _InternalErrors:
    """A bug (an exception no handler answers) as a 500 OpenAI error object naming the
    exception, its traceback in the log. Here rather than as an exception handler, which
    Starlette runs and then re-raises to uvicorn, which drops the connection: a client's
    next request on that kept-alive connection failed with a reset."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if started:  # too late for an error object
                raise
            log.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            body = error_body(f"internal server error: {type(e).__name__}: {e}", type="server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)


class _BodyLimit:
    """A 413 error object for a body over `limit` bytes, before it is parsed: by its
    Content-Length at once, or (chunked) as soon as that many bytes arrived. Parsing and
    tokenizing run on the event loop, so without it one 50 MB prompt held every other
    client for about a minute (and took gigabytes)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(int(length), scope, receive, send)
            return
        seen = 0
        refused = False

        async def counting() -> Any:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # answered here; to the app the client is gone
                    refused = True
                    await self._refuse(None, scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def muted_once_refused(message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counting, muted_once_refused)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, length: int | None, scope, receive, send) -> None:
        size = f"{length} bytes" if length is not None else f"over {self.limit} bytes"
        body = error_body(f"the request body is {size}, more than this server accepts ({self.limit} bytes: "
                          f"--max-request-mb {self.limit / 2**20:g})", code="request_too_large")
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)


_GONE = object()


async def _wait_or_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Awaits `work`; if the client disconnects first, cancels it and returns `_GONE`."""
    work = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        return _GONE
    finally:
        watch.cancel()
        if not work.done():
            # a cancelled gather() ends holding a CancelledError as its exception, which
            # asyncio logs as "never retrieved" unless someone reads it
            work.add_done_callback(_retrieve)
            work.cancel()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
