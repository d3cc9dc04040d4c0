"""Tools an RL episode's model may call: plain Python functions with JSON-schema signatures.

    tools: [my_pkg.tools:calc, my_pkg.tools:lookup]      # strategy.options.tools

Each entry is imported (`module:function`). Its schema, the OpenAI / Hugging Face
`{"type": "function", "function": {name, description, parameters}}` form that chat
templates render through `tools=`, is derived from the function:

* `name`: the function's name; `description`: the docstring's first paragraph;
* `parameters`: one property per parameter, typed from its annotation (`int` -> integer,
  `float` -> number, `str`, `bool`, `list[X]` -> array, `dict` -> object, `Literal[...]`
  -> enum, `X | None` -> X or null, optional); described by the docstring's `Args:` lines
  (`name: text` or `name (type): text`); required unless it has a default.

`@tool(name=..., description=..., parameters=...)` overrides any of the three (a
`parameters` schema given explicitly is used as is). A `functools.partial` is described by
the function it wraps, a callable object by its class (hints: its `__call__`'s).

`ToolRegistry.execute(calls)` runs calls in its thread pool, each with a timeout, and
turns every failure into a `ToolResult` with `error=True` whose `content` tells the model
what went wrong: an unknown tool, arguments that do not fit the schema (missing,
unexpected, or of the wrong JSON type or enum value, a list's items included), an
exception (its type and message; any `BaseException`, `SystemExit` and
`asyncio.CancelledError` too), a value that cannot be written as text (an int past Python's
4300 digits, an object whose `__str__` raises) or a timeout. Nothing a tool does stops
the run. Calls run on `jrl.rl.daemon_workers` threads: a timed-out call keeps its thread
until it returns, and one that never returns does not keep the process from exiting;
`workers` bounds how many run at once, and a call still waiting for a worker when its
timeout passes is dropped (it never runs) and answered so. Timed-out calls that hold
workers are warned of (naming the tool) when their number first reaches 1, 2, 4, ... and
all of them: once all are held, every call fails at once, and only `tool_error_rate` would
show it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import json
import re
import threading
import time
import types
import typing
import warnings
from typing import Any, Callable, Literal, Sequence

from jrl.config import ConfigError, called_code, resolve_named
from jrl.rl.daemon_workers import DaemonWorkers
from jrl.rl.tool_calls import ToolCall

_TOOL_ATTR = "__jrl_tool__"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", tuple: "array",
               dict: "object"}


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         parameters: dict | None = None):
    """Marks `fn` as a tool, overriding the name, description or parameters schema that
    would be derived from it. Usable as `@tool` or `@tool(name=...)`."""
    def mark(f: Callable) -> Callable:
        setattr(f, _TOOL_ATTR, {"name": name, "description": description, "parameters": parameters})
        return f
    return mark(fn) if fn is not None else mark


def _json_type(annotation: Any) -> tuple[dict, bool]:
    """(schema, optional) of a parameter annotation."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        schema, _ = _json_type(rest[0]) if len(rest) == 1 else ({}, False)
        optional = len(rest) < len(args)
        if optional and "type" in schema:  # `x: float | None` takes null too (the function is given None)
            schema = {**schema, "type": [schema["type"], "null"]}
        if optional and "enum" in schema and None not in schema["enum"]:  # `Literal["a", "b"] | None` too
            schema = {**schema, "enum": [*schema["enum"], None]}
        return schema, optional
    if origin is Literal:
        return {"enum": list(args)}, False
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        schema = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _json_type(args[0])[0]
        return schema, False
    if origin is dict or annotation is dict:
        return {"type": "object"}, False
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}, False
    return {}, False


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """The first paragraph, and the `Args:` section's parameter descriptions."""
    doc = inspect.getdoc(fn) or ""
    first = doc.split("\n\n", 1)[0].strip()
    if first.lower().startswith(("args:", "arguments:", "parameters:")):
        first = ""
    params: dict[str, str] = {}
    m = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if m:
        current = None
        for line in m.group(1).splitlines():
            hit = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if hit:
                current = hit.group(1)
                params[current] = hit.group(2).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return " ".join(first.split()), params


def _origin(fn: Callable) -> tuple[str, Callable, Callable]:
    """(name, documented, annotated) of a tool's callable: a function is all three itself, a
    `functools.partial` its wrapped function's, a callable object its class's (the hints
    being its `__call__`'s)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if hasattr(fn, "__name__"):
        return fn.__name__, fn, fn
    return type(fn).__name__, type(fn), type(fn).__call__


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable and the JSON schema the model sees."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_function(cls, fn: Callable) -> Tool:
        """The tool of `fn`: schema derived from its signature and docstring, overridden by
        `@tool(...)`."""
        given = getattr(fn, _TOOL_ATTR, {})
        name, documented, annotated = _origin(fn)
        description, arg_docs = _docstring(documented)
        if given.get("parameters") is not None:
            parameters = given["parameters"]
        else:
            props: dict[str, dict] = {}
            required: list[str] = []
            hints = typing.get_type_hints(annotated)
            for p in inspect.signature(fn).parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                schema, optional = _json_type(hints.get(p.name, p.annotation))
                if p.name in arg_docs:
                    schema = {**schema, "description": arg_docs[p.name]}
                props[p.name] = schema
                if p.default is p.empty and not optional:
                    required.append(p.name)
            parameters = {"type": "object", "properties": props, "required": required}
        return cls(name=given.get("name") or name, fn=fn,
                   description=given.get("description") or description, parameters=parameters)

    @property
    def schema(self) -> dict[str, Any]:
        """`{"type": "function", "function": {name, description, parameters}}`."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema (missing, unexpected, wrong JSON type or
        enum value, an array's items included), or None."""
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing required argument(s) {missing}"
        extra = sorted(set(arguments) - set(props))
        if extra and self.parameters.get("additionalProperties", False) is False:
            return f"unexpected argument(s) {extra}; {self.name} takes {sorted(props)}"
        for k, v in arguments.items():
            problem = _misfit(v, props.get(k, {}), f"argument {k!r}")
            if problem is not None:
                return problem
        return None


def _misfit(v: Any, schema: dict[str, Any], what: str) -> str | None:
    """Why the value `v` (named `what` in the message) does not fit `schema` (its JSON type,
    its enum, and the items of an array, each against `items`), or None."""
    want = schema.get("type")
    if want and not _is_json_type(v, want):
        return f"{what} must be of type {want}, got {json.dumps(v, default=repr)[:80]}"
    enum = schema.get("enum")
    if enum is not None and v not in enum:
        return f"{what} must be one of {enum}, got {v!r}"
    items = schema.get("items")
    if isinstance(v, list) and isinstance(items, dict):
        for i, item in enumerate(v):
            problem = _misfit(item, items, f"{what} item {i}")
            if problem is not None:
                return problem
    return None


def _is_json_type(v: Any, want: str | list[str]) -> bool:
    """Whether `v` is of the JSON-schema type `want`: a name, or a list of names (any of them,
    e.g. `["string", "null"]` for an optional argument)."""
    if isinstance(want, list):
        return any(_is_json_type(v, w) for w in want)
    if want == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if want == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}.get(
        want, object).__instancecheck__(v)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a call produced, as the content of the `tool` message that answers it."""

    call_id: str
    name: str
    content: str
    error: bool = False
    seconds: float = 0.0

    def message(self) -> dict[str, Any]:
        """The `tool` chat message answering the call. Characters UTF-8 cannot encode (lone
        surrogates: `os.listdir` of undecodable names, JSON's "\\ud800") become U+FFFD, since no
        tokenizer could encode the message and the run would stop."""
        content = re.sub("[\ud800-\udfff]", "\ufffd", self.content)
        return {"role": "tool", "name": self.name, "tool_call_id": self.call_id, "content": content}


def resolve_tool(name: str, field: str = "tools") -> Tool:
    """The tool of `module:function` (ConfigError naming `field` when it cannot be found)."""
    fn = resolve_named(name, field)
    for kind, test, returned in (("an async", inspect.iscoroutinefunction, "a coroutine"),
                                 ("an async generator", inspect.isasyncgenfunction, "an async generator"),
                                 ("a generator", inspect.isgeneratorfunction, "a generator")):
        if test(called_code(fn)):  # its answer would be that object's repr, read by the model as the result
            raise ConfigError(f"{field}: {name!r} is {kind} function, whose calls return {returned}, not the "
                              f"tool's answer; a tool must be a plain function returning it")
    try:
        return Tool.from_function(fn)
    except (TypeError, ValueError, NameError) as e:
        raise ConfigError(f"{field}: cannot derive the schema of {name!r} ({e}); give it with @tool(parameters=...)")


def _render(value: Any) -> str:
    """A tool's value as the text the model reads: a string as is, bytes (a command's output)
    as UTF-8 text (bytes it cannot decode as U+FFFD), anything else its JSON (arrays and
    scalars of numpy, JAX, torch, anything with `tolist()`, as the lists and numbers it gives),
    else its str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        return json.dumps(value, ensure_ascii=False, default=_plain)
    except (TypeError, ValueError):
        return str(value)


def _plain(value: Any) -> Any:
    """json.dumps' `default`: an array or array scalar as the lists and numbers of its `tolist()`."""
    tolist = getattr(value, "tolist", None)
    if not callable(tolist):
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return tolist()


class ToolRegistry:
    """Tools by name, executed in a thread pool with a per-call timeout (seconds)."""

    def __init__(self, tools: Sequence[Tool | Callable], *, timeout_s: float = 10.0, workers: int = 8) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            t = t if isinstance(t, Tool) else Tool.from_function(t)
            if t.name in self.tools:
                raise ConfigError(f"tools: two tools are named {t.name!r}")
            self.tools[t.name] = t
        if not timeout_s > 0:
            raise ConfigError(f"tool_timeout_s: must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._workers = DaemonWorkers(workers, "jrl-tool")
        self._held: dict[concurrent.futures.Future, str] = {}  # timed-out calls still running: their tools
        self._held_lock = threading.Lock()
        self._held_warned = 0  # the number of held workers last warned of

    @classmethod
    def from_names(cls, names: Sequence[str], field: str = "tools", **kwargs: Any) -> ToolRegistry:
        return cls([resolve_tool(n, f"{field}[{i}]") for i, n in enumerate(names)], **kwargs)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's `tools=`."""
        return [t.schema for t in self.tools.values()]

    def execute(self, calls: Sequence[ToolCall], timeout_s: float | None = None) -> list[ToolResult]:
        """Runs `calls` concurrently; one result per call, in order. Never raises for what
        a tool or its caller did wrong."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started: list[tuple[ToolCall, Any]] = []
        t0 = time.perf_counter()
        for call in calls:
            t = self.tools.get(call.name)
            if t is None:
                started.append((call, f"error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}"))
                continue
            problem = t.check_arguments(call.arguments)
            if problem is not None:
                started.append((call, f"error: bad arguments for {call.name}: {problem}"))
                continue
            started.append((call, self._workers.submit(t.fn, **call.arguments)))
        results = []
        deadline = time.perf_counter() + timeout  # calls run concurrently: one shared window
        for call, fut in started:
            if isinstance(fut, str):
                results.append(ToolResult(call.id, call.name, fut, error=True))
                continue
            concurrent.futures.wait([fut], timeout=max(0.0, deadline - time.perf_counter()))
            if not fut.done():
                # a call still queued behind busy workers is dropped: it must not run after this answer
                message = (f"did not start within {timeout:g} s (every tool worker was busy)" if fut.cancel()
                           else f"timed out after {timeout:g} s")
                results.append(ToolResult(call.id, call.name, f"error: {call.name} {message}", error=True,
                                          seconds=timeout))
                if not fut.cancelled():
                    self._hold(fut, call.name, timeout)
            # the tool raised: the model is told, the run goes on, whatever it raised (sys.exit in an
            # argparse or click CLI wrapped as a tool, asyncio.CancelledError out of asyncio.run: any
            # BaseException). Read off the future: a Ctrl-C on this thread is never taken for the tool's
            elif (e := fut.exception()) is not None:
                results.append(ToolResult(call.id, call.name, f"error: {call.name} raised {type(e).__name__}: {e}",
                                          error=True, seconds=time.perf_counter() - t0))
            else:
                results.append(self._answer(call, fut.result(), time.perf_counter() - t0))
        return results

    @staticmethod
    def _answer(call: ToolCall, value: Any, seconds: float) -> ToolResult:
        """The result of a call that returned `value`: its text, or an error result when it has
        none (str() of an int past Python's 4300 digits raises, and so may a __str__)."""
        try:
            return ToolResult(call.id, call.name, _render(value), seconds=seconds)
        except Exception as e:  # noqa: BLE001 - whatever rendering it raised is the tool's
            return ToolResult(call.id, call.name, f"error: {call.name} returned a value that cannot be written as "
                                                  f"text: {type(value).__name__} ({type(e).__name__}: {e})",
                              error=True, seconds=seconds)

    def _hold(self, fut: concurrent.futures.Future, name: str, timeout: float) -> None:
        """Counts a timed-out call's worker as held until the call returns, and warns when the
        number held reaches 1, 2, 4, ... or all: hung calls filling the pool make every later
        call fail, which the run would otherwise show only in `tool_error_rate`."""
        with self._held_lock:
            if fut.done():  # returned since
                return
            self._held[fut] = name
            held, workers = len(self._held), self._workers.workers
            warn = held >= min(2 * self._held_warned, workers) and held > self._held_warned
            if warn:
                self._held_warned = held
                tools = list(self._held.values())
        fut.add_done_callback(self._release)
        if warn:
            by_tool = ", ".join(f"{t}: {tools.count(t)}" for t in dict.fromkeys(tools))
            warnings.warn(f"tool {name!r} timed out after {timeout:g} s and runs on until it returns (Python cannot "
                          f"stop a thread), holding its tool worker: {held} of {workers} tool workers are held by "
                          f"timed-out calls ({by_tool}); with all of them held every tool call fails at once ('did "
                          f"not start ... every tool worker was busy'). Give {name} a timeout of its own shorter "
                          f"than strategy.options.tool_timeout_s ({self.timeout_s:g} s), e.g. on its network calls, "
                          f"or raise strategy.options.env_workers (the run has env_workers x max_tool_calls tool "
                          f"workers)", stacklevel=3)

    def _release(self, fut: concurrent.futures.Future) -> None:
        """A held call returned: its worker is free again."""
        with self._held_lock:
            self._held.pop(fut, None)

    def close(self) -> None:
        """Calls not started yet never start (those running finish on their own)."""
        self._workers.close()