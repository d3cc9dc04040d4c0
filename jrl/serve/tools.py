"""Tool calls in chat completions.

Requests' `tools` are passed to the chat template (`tools=[...]`), so the model sees them
as its template presents them. Turning the model's answer back into OpenAI `tool_calls`
needs the shared tool-call parser (`<tool_call>{json}</tool_call>`, Hermes / Qwen style)
being written in jrl.rl; until it lands, `parse_tool_calls` is the one hook that will call
it, and answers carry the model's text unparsed in `content` (`tool_calls` absent,
`finish_reason` never "tool_calls").
"""

from __future__ import annotations

from typing import Any


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of an assistant answer for a request that offered `tools`.

    TODO(tool-call parser): parsed once the shared parser lands in jrl.rl; call it here and
    return the OpenAI `tool_calls` list (`{"id", "type": "function", "function": {"name",
    "arguments"}}`) with the text outside the calls as `content`. Until then the text is
    returned unparsed and no tool calls."""
    return text, None
