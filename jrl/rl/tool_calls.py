"""Tool calls in model output: a small, pluggable parser API.

A parser turns the text of one assistant turn into the prose around the calls, the calls,
and the calls it could not read:

    parser = get_parser("hermes")                       # or "my_pkg.parsers:MyParser"
    parsed = parser.parse('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    parsed.content        # 'Let me add.'
    parsed.calls          # [ToolCall(name='add', arguments={'a': 1}, id='call_0')]
    parsed.errors         # [] (malformed calls land here, never raise)
    content, calls = parsed.content, parsed.calls

`parse` never raises on model output: malformed JSON, a call without a string `name`, or
`arguments` that are not an object become `ToolCallError`s, which a tool environment
answers with an error message to the model. Call ids (`call_<k>`, in order of appearance,
errors included) let the answering `tool` messages name the call they answer.

Built-in formats (`PARSERS`): `hermes`, the Hermes / Qwen 2.5+ format
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one JSON object per block, any
number of blocks); `pythonic`, the Llama 3.2 / 4 format, where the whole turn is a Python
list of calls with keyword arguments, `[lookup(key="qzk"), add(a=1, b=2)]` (short: what a
byte-level model writes fastest). Any class with the `ToolCallParser` methods can be named
`module:Class` instead (constructed without arguments); `parse_turn` holds it to the contract,
a `ToolParserError` naming it when it raises or returns anything but a `ParsedMessage`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from typing import Any, Protocol, runtime_checkable

from jrl.config import ConfigError, resolve_named
from jrl.data.wording import short_repr


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]
    id: str = "call_0"

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI chat `tool_calls` entry (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the parser found but could not read: its raw text and why."""

    text: str
    message: str
    id: str = "call_0"


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    """An assistant turn split into its prose (`content`, calls removed, stripped), its
    calls and its malformed calls, both in order of appearance."""

    content: str
    calls: list[ToolCall]
    errors: list[ToolCallError]

    @property
    def has_calls(self) -> bool:
        """Whether the turn asked for any tool (well-formed or not)."""
        return bool(self.calls or self.errors)


@runtime_checkable
class ToolCallParser(Protocol):
    """Finds tool calls in an assistant turn's text. Must not raise on any input."""

    def parse(self, text: str) -> ParsedMessage: ...


def _reason(e: BaseException) -> str:
    """The first sentence of why Python could not read a call, for the model to see."""
    return str(e).split(";")[0].split(":")[0].strip() or type(e).__name__


def read_call(body: str, call_id: str) -> ToolCall | ToolCallError:
    """A call from its JSON text `{"name": str, "arguments": {...}}` (`arguments` may
    also be a JSON string holding an object; where it is null or absent, `parameters`,
    which some models write instead, is read the same way; neither: no arguments)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(body, f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})", call_id)
    except (ValueError, RecursionError) as e:  # valid JSON Python will not read: a huge integer, deep nesting
        return ToolCallError(body, f"malformed tool call: unreadable JSON ({_reason(e)})", call_id)
    if not isinstance(obj, dict):
        return ToolCallError(body, f"malformed tool call: expected a JSON object, got {type(obj).__name__}", call_id)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(body, "malformed tool call: needs a string 'name'", call_id)
    args = obj.get("arguments")
    if args is None:  # null as absent: a model that writes `parameters` may still emit `"arguments": null`
        args = obj.get("parameters")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(body, f"malformed tool call {name!r}: 'arguments' is a string that is not JSON "
                                       f"({e.msg})", call_id)
        except (ValueError, RecursionError) as e:
            return ToolCallError(body, f"malformed tool call {name!r}: 'arguments' is a string of unreadable JSON "
                                       f"({_reason(e)})", call_id)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(body, f"malformed tool call {name!r}: 'arguments' must be an object, got "
                                   f"{type(args).__name__}", call_id)
    return ToolCall(name, args, call_id)


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen 2.5 / 3). A block left open at
    the end of the text (the turn was cut off) is a malformed call."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.S)

    def parse(self, text: str) -> ParsedMessage:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        prose: list[str] = []
        pos = 0
        for k, m in enumerate(self._block.finditer(text)):
            prose.append(text[pos:m.start()])
            pos = m.end()
            call_id = f"call_{k}"
            if not m.group(2):
                errors.append(ToolCallError(m.group(0), f"malformed tool call: {self.open_tag} without "
                                                        f"{self.close_tag}", call_id))
                continue
            parsed = read_call(m.group(1).strip(), call_id)
            (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        prose.append(text[pos:])
        return ParsedMessage("".join(prose).strip(), calls, errors)


class PythonicParser:
    """A turn that is a Python list of calls, `[name(key=value, ...), ...]` (Llama 3.2 / 4),
    values being Python literals. A turn that is not bracketed (`[...]` after stripping) is
    prose; a bracketed one that is not such a list is one malformed call (so a final
    answer must not be a bracketed list)."""

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ParsedMessage(body, [], [])
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as e:
            return ParsedMessage("", [], [ToolCallError(body, f"malformed tool call: not Python ({e.msg})")])
        except (ValueError, MemoryError, RecursionError) as e:  # nesting the parser's stack cannot hold
            return ParsedMessage("", [], [ToolCallError(body, f"malformed tool call: not Python ({_reason(e)})")])
        if not (isinstance(tree, ast.List) and tree.elts and all(isinstance(c, ast.Call) for c in tree.elts)):
            return ParsedMessage("", [], [ToolCallError(body, "malformed tool call: expected a list of calls "
                                                              "[name(key=value, ...)]")])
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for k, node in enumerate(tree.elts):
            call_id, source = f"call_{k}", ast.get_source_segment(body, node) or body
            if not isinstance(node.func, ast.Name) or node.args or any(kw.arg is None for kw in node.keywords):
                errors.append(ToolCallError(source, "malformed tool call: expected name(key=value, ...) with "
                                                    "keyword arguments only", call_id))
                continue
            names = [kw.arg for kw in node.keywords]
            if len(set(names)) < len(names):  # Python's parser lets `f(a=1, a=2)` through (its compiler refuses it)
                errors.append(ToolCallError(source, f"malformed tool call {node.func.id!r}: an argument is given "
                                                    f"twice", call_id))
                continue
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # TypeError: {[1]: 2}
                errors.append(ToolCallError(source, f"malformed tool call {node.func.id!r}: argument values must "
                                                    f"be Python literals", call_id))
                continue
            calls.append(ToolCall(node.func.id, arguments, call_id))
        return ParsedMessage("", calls, errors)


class ToolParserError(RuntimeError):
    """A tool-call parser broke its contract on a turn: it raised, or returned something other
    than a ParsedMessage of ToolCalls and ToolCallErrors. Names the parser and its option."""


def parse_turn(parser: ToolCallParser, text: str, field: str = "strategy.options.tool_parser") -> ParsedMessage:
    """`parser.parse(text)`, checked: a ToolParserError naming the parser (`module:Class`, as a
    config names it) and `field` when it raises or returns anything but a ParsedMessage whose
    calls are ToolCalls and errors ToolCallErrors (a user's parser; the built-ins never do),
    instead of an AttributeError deep in the tool environment that names neither."""
    name = f"{type(parser).__module__}:{type(parser).__qualname__}"
    try:
        parsed = parser.parse(text)
    except Exception as e:
        raise ToolParserError(f"{field}: {name}.parse raised {type(e).__name__}: {e} (a parser must not raise on "
                              f"model output: a call it cannot read is one of its ParsedMessage's errors)") from e
    if not (isinstance(parsed, ParsedMessage) and isinstance(parsed.content, str)
            and all(isinstance(c, ToolCall) for c in parsed.calls)
            and all(isinstance(e, ToolCallError) for e in parsed.errors)):
        raise ToolParserError(f"{field}: {name}.parse must return a jrl.rl.tool_calls.ParsedMessage (its calls "
                              f"ToolCalls, its errors ToolCallErrors), got {short_repr(parsed)}")
    return parsed


PARSERS: dict[str, type] = {"hermes": HermesParser, "pythonic": PythonicParser}


def get_parser(name: str | ToolCallParser, field: str = "tool_parser") -> ToolCallParser:
    """A parser by built-in name (`PARSERS`) or `module:Class`; a parser instance is
    returned as is. Errors (ConfigError) name `field`."""
    if not isinstance(name, str):
        if isinstance(name, ToolCallParser):
            return name
        raise ConfigError(f"{field}: must be a parser name {sorted(PARSERS)} or 'module:Class', got {name!r}")
    if ":" not in name:
        if name not in PARSERS:
            raise ConfigError(f"{field}: unknown tool-call parser {name!r}; built-ins are {sorted(PARSERS)}, "
                              f"or give 'module:Class'")
        return PARSERS[name]()
    parser = resolve_named(name, field, "class")()
    if not isinstance(parser, ToolCallParser):
        raise ConfigError(f"{field}: {name!r} has no parse(text) method")
    return parser
