"""`jrl serve`: an OpenAI-compatible HTTP server over the rollout engine (docs/serve.md).

`protocol` (request bodies, error objects), `text` (incremental decoding, stop strings),
`worker` (the engine loop, and the thread running it with --engine-in-process),
`engine_process` (the engine loop in a process of its own: `jrl serve`'s default), `app`
(the FastAPI endpoints), `loading` (what is served, on which engine), `tools` (the
tool-call hook), `cli` (`jrl serve`). Imports jrl.rl (prompt stop tokens,
checkpoint resolution) and jrl.rollout; nothing below imports it.
"""
