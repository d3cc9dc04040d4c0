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
