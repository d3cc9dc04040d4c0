"""`jrl serve`: an OpenAI-compatible HTTP server over the rollout engine (docs/serve.md).

`protocol` (request bodies, error objects), `text` (incremental decoding, stop strings),
`worker` (the engine's thread), `app` (the FastAPI endpoints), `loading` (what is served),
`tools` (the tool-call hook), `cli` (`jrl serve`). Imports jrl.rl (prompt stop tokens,
checkpoint resolution) and jrl.rollout; nothing below imports it.
"""
