"""jrl.serve.tools.ToolCallStream: what a streamed answer that offered tools sends, for any
split of the answer into pieces."""

import random

import pytest

from jrl.serve.tools import ToolCallStream, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def whole(text: str) -> tuple[str, list | None]:
    """What the streamed pieces add up to: the non-streamed answer's content and calls."""
    content, calls = parse_tool_calls(text, TOOLS)
    return (content or "", calls) if calls else (text, None)


@pytest.mark.parametrize("answer", [
    "Just prose, no call.  \n",
    "  Leading space, then a call:\n" + CALL,
    "Before <tool the call " + CALL + "\nafter it",
    CALL + "\n" + CALL,
    "  " + CALL + "  tail ",
    "Text with < and <tool_ but no call <",
    "Broken: <tool_call>{not json</tool_call> stays",
    "Cut off <tool_call>{\"name\": \"add\"",
])
def test_any_split_of_the_answer_streams_the_whole_answer(answer):
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(answer)), k=rng.randint(0, min(8, len(answer) - 1))))
        pieces = [answer[i:j] for i, j in zip([0, *cuts], [*cuts, len(answer)])]
        stream = ToolCallStream(TOOLS)
        sent = "".join(stream.add(p) for p in pieces)
        rest, calls = stream.finish()
        content, want_calls = whole(answer)
        assert calls == want_calls
        if calls:  # the streamed prose is the stripped one, less nothing but leading whitespace
            assert (sent + rest).lstrip() == content
        else:
            assert sent + rest == answer

