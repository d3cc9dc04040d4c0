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
        self.text = ""  # the answer so far
        self.sent = ""  # the content handed out: a prefix of `text`
        self._holding = False  # a tag has begun: the rest waits for the end

    def add(self, text: str) -> str:
        """The content that can go out now, given the answer's next piece of `text`."""
        self.text += text
        if self._holding:
            return ""
        tag = self.text.find(_PARSER.open_tag)
        if tag >= 0:
            self._holding = True
            safe = self.text[:tag]
        else:
            safe = self.text[:len(self.text) - _tag_start(self.text, _PARSER.open_tag)]
        safe = safe.rstrip()  # whitespace before a call is not content
        out = safe[len(self.sent):]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        """(the content not handed out yet, the calls or None) once the answer is complete."""
        content, calls = parse_tool_calls(self.text, self.tools)
        if calls is None:
            return self.text[len(self.sent):], None
        # the prose, stripped, begins with what went out (less its leading whitespace)
        return (content or "")[len(self.sent.lstrip()):], calls


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
