"""`jrl serve`: the OpenAI-compatible server (docs/serve.md).

    jrl serve --model hf:/models/qwen2-0.5b --port 8000
    jrl serve --checkpoint runs/grpo/checkpoints [--config runs/grpo/config.yaml] --admin-token $T

Exit status: 0 after a clean shutdown (SIGTERM or Ctrl-C: stop accepting, let requests in
flight finish for up to --shutdown-timeout seconds, cancel the rest), 2 for a bad command
line, config, checkpoint or engine setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import uvicorn
import yaml

from jrl.checkpoint import CheckpointCorruptError
from jrl.config import ConfigError
from jrl.rollout import Engine, EngineConfig, engine_config_for_workload
from jrl.serve.app import Server, create_app
from jrl.serve.loading import Served, load_served

log = logging.getLogger("jrl.serve")


def build_parser(prog: str = "jrl serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP with the OpenAI API "
                                "(/v1/chat/completions, /v1/completions, /v1/models, /health) on jrl's engine.")
    src = p.add_argument_group("model")
    src.add_argument("--model", help="hf:<dir>: a Hugging Face directory (weights, config.json, tokenizer)")
    src.add_argument("--checkpoint", help="a jrl run dir, its checkpoints/ dir (latest step), a step_<N> dir "
                     "or hf:<dir> read with the run's config")
    src.add_argument("--config", help="the run's YAML config (default: config.yaml of the checkpoint's run)")
    src.add_argument("--tokenizer", help="tokenizer override: 'bytes', a tokenizer.json or a directory")
    src.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="weights and compute dtype (default: float32 on CPU, bfloat16 on GPU; a run config's "
                          "own dtype with --checkpoint)")
    src.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--max-queue", type=int, default=256,
                     help="requests (choices) waiting beyond the --max-batch running; more get 429 (default 256)")
    net.add_argument("--admin-token", help="enables POST /v1/weights for clients sending Authorization: Bearer <it>")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds requests in flight may run after SIGTERM before they are cancelled")
    net.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-batch", type=int, default=64, help="requests decoding at once (default 64)")
    eng.add_argument("--page-size", type=int, default=16)
    eng.add_argument("--max-seq-len", type=int,
                     help="prompt + completion tokens of one request (default: the model's, at most 4096)")
    eng.add_argument("--n-pages", type=int, help="KV pages (default: every running request can reach max-seq-len)")
    eng.add_argument("--max-tokens-per-step", type=int, help="token budget of one forward")
    eng.add_argument("--engine", default="{}", help="any other EngineConfig fields as JSON, e.g. "
                     "'{\"prefix_cache\": false}'")
    eng.add_argument("--seed", type=int, default=0, help="seeds requests sent without a seed")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (with --checkpoint)")
    return p


def engine_config(served: Served, args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the command line (the engine's one sizing rule, then the
    explicit flags)."""
    try:
        extra = json.loads(args.engine)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--engine: not valid JSON ({e})") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"--engine: must be a JSON object of EngineConfig fields, got {args.engine!r}")
    max_pos = served.model_config.max_position_embeddings
    max_seq_len = args.max_seq_len or min(max_pos, 4096)
    if max_seq_len > max_pos:
        raise ConfigError(f"--max-seq-len: must be <= the model's max_position_embeddings ({max_pos}), "
                          f"got {max_seq_len}")
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch: must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if extra.get("on_weight_update", "finish") != "finish":
        raise ConfigError("--engine: on_weight_update must be 'finish' for serving (tokens already streamed "
                          "are never taken back)")
    overrides: dict[str, Any] = {"max_batch": args.max_batch, "on_weight_update": "finish", **extra}
    if args.n_pages is not None:
        overrides["n_pages"] = args.n_pages
    if args.max_tokens_per_step is not None:
        overrides["max_tokens_per_step"] = args.max_tokens_per_step
    return engine_config_for_workload(max_seq_len, args.max_batch, page_size=args.page_size, seed=args.seed,
                                      **overrides)


def build(args: argparse.Namespace):
    """(Server, FastAPI app) for parsed arguments; raises ConfigError & co. for bad ones."""
    served = load_served(args.model, args.checkpoint, args.config, args.tokenizer, args.dtype,
                         args.served_model_name, args.overrides)
    engine = Engine(served.model_config, served.params, engine_config(served, args), version=served.version)
    server = Server(served, engine, max_queue=args.max_queue, admin_token=args.admin_token)
    return server, create_app(server, shutdown_timeout=args.shutdown_timeout)


def main(argv: list[str] | None = None, prog: str = "jrl serve") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server, app = build(args)
    except CheckpointCorruptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, FileNotFoundError, ValueError, yaml.YAMLError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    uv = uvicorn.Server(config)
    # uvicorn re-raises the signal it stopped on once it has shut down, to the handler that
    # was installed before it: this one, so a SIGTERM'd server exits 0 after a clean stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"jrl serve: {server.served.name} (policy version {server.engine.version}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uv.run()
    print("jrl serve: stopped", flush=True)
    return 0


class ServerThread:
    """A server on 127.0.0.1 in a background thread of this process (tests, `jrl bench
    serve`): `with ServerThread(server, app) as s: s.url`."""

    def __init__(self, server, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 10.0) -> None:
        self.server = server
        self.uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                                timeout_graceful_shutdown=shutdown_timeout))
        self.host = host
        self._thread = threading.Thread(target=self._run, name="jrl-serve-http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.uv.serve())

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.time() + 120
        while not self.uv.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("jrl serve: the server thread did not start")
            time.sleep(0.02)
        self.port = self.uv.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self._thread.join(60)


if __name__ == "__main__":
    sys.exit(main())
