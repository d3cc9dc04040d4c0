"""Tool calls in chat completions.

Requests' `tools` are passed to the chat template (`tools=[...]`), so the model sees them
as its template presents them, and the answer is read back with the same parser the
multi-turn rollouts use (`jrl.rl.tool_calls`, Hermes / Qwen `<tool_call>{json}</tool_call>`
blocks). An answer whose calls all parse comes back as OpenAI `tool_calls` (finish reason
"tool_calls") with the prose around them as `content`; one with a malformed call comes
back as the model wrote it, in `content`, so the client sees exactly what went wrong.
"""

from __future__ import annotations

from typing import Any

from jrl.rl.tool_calls import HermesParser

_PARSER = HermesParser()


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of an assistant answer for a request that offered `tools`."""
    parsed = _PARSER.parse(text)
    if not parsed.calls or parsed.errors:
        return text, None
    return parsed.content or None, [call.to_openai() for call in parsed.calls]


class ToolCallStream:
    """A streamed answer to a request that offered `tools`, as content deltas and, at the
    end, its calls: the text before the first `<tool_call>` goes out as it comes (less
    trailing whitespace and a possible start of the tag, held back until the next text
    settles them); from the tag on, nothing until the answer is complete, which is then
    read as `parse_tool_calls` reads a plain answer. Calls that parse: the rest of the
    prose and the calls; otherwise the rest of the text as written."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tools
        self._parts: list[str] = []  # the answer so far, joined once it is complete
        # the text after what went out while no tag has begun: held whitespace and a possible
        # start of the tag (each piece is looked at once, not the whole answer at every token)
        self._unsent = ""
        self._sent = 0  # characters handed out: a prefix of the answer, ending in non-whitespace
        self._lead = 0  # the whitespace that prefix begins with
        self._holding = False  # a tag has begun: the rest waits for the end

    def add(self, text: str) -> str:
        """The content that can go out now, given the answer's next piece of `text`."""
        self._parts.append(text)
        if self._holding:
            return ""
        self._unsent += text
        tag = self._unsent.find(_PARSER.open_tag)
        if tag >= 0:
            self._holding = True
            safe = self._unsent[:tag]
        else:
            safe = self._unsent[:len(self._unsent) - _tag_start(self._unsent, _PARSER.open_tag)]
        out = safe.rstrip()  # whitespace before a call is not content
        if out:
            if not self._sent:
                self._lead = len(out) - len(out.lstrip())
            self._sent += len(out)
            self._unsent = self._unsent[len(out):]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        """(the content not handed out yet, the calls or None) once the answer is complete."""
        text = "".join(self._parts)
        content, calls = parse_tool_calls(text, self.tools)
        if calls is None:
            return text[self._sent:], None
        # the prose, stripped, begins with what went out (less its leading whitespace)
        return (content or "")[self._sent - self._lead:], calls


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
