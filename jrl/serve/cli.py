"""`jrl serve`: the OpenAI-compatible server (docs/serve.md).

    jrl serve --model hf:/models/qwen2-0.5b --port 8000
    jrl serve --checkpoint runs/grpo/checkpoints [--config runs/grpo/config.yaml] --admin-token $T

Before it listens, the server compiles every step program its engine can dispatch for
default-sampled requests (`Engine.warmup`; `--no-warmup` skips it and programs compile on
first use, stalling the requests of that step), and sizes the KV pool to the device's free
memory when the default pool would not fit (`fit_pool`).

Exit status: 0 after a clean shutdown (SIGTERM or Ctrl-C: stop accepting, let requests in
flight finish for up to --shutdown-timeout seconds, cancel the rest), 2 for a bad command
line, config, checkpoint or engine setting.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import uvicorn

from jrl.checkpoint import CheckpointCorruptError
from jrl.config import CONFIG_ERRORS, ConfigError, ModelConfig, cli_exit
from jrl.rollout import Engine, EngineConfig, SamplingParams, engine_config_for_workload
from jrl.rollout.cache.kv_storage import kv_bytes_per_token
from jrl.rollout.config import device_free_memory
from jrl.serve.app import Server, create_app
from jrl.serve.loading import Served, load_served
from jrl.serve.worker import SWITCH_INTERVAL_S, gil_handoff

log = logging.getLogger("jrl.serve")

# The share of the device's free memory (after the weights) the KV pool may take when
# --n-pages is not given: the rest holds a step's activations, logits and the programs.
KV_MEMORY_FRACTION = 0.8
# Seconds an idle keep-alive connection stays open. Longer than the 5 s of httpx (the
# openai client's transport): a client must drop an idle connection before the server
# does, or a request it sends on it as the server closes it fails with a reset connection.
KEEP_ALIVE_S = 75.0


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
    net.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                     help=f"seconds an idle keep-alive connection stays open (default {KEEP_ALIVE_S:g}: longer "
                          "than clients' own idle limit, 5 s for httpx / openai)")
    net.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="compile every step program before listening (default; --no-warmup: compile on first "
                          "use, which stalls the requests of that step)")
    net.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-batch", type=int, default=64, help="requests decoding at once (default 64)")
    eng.add_argument("--page-size", type=int, default=None,
                     help="tokens per KV page (default 16; 32 with an fp8 kv_dtype in --engine)")
    eng.add_argument("--max-seq-len", type=int,
                     help="prompt + completion tokens of one request (default: the model's, at most 4096)")
    eng.add_argument("--n-pages", type=int, help="KV pages (default: every running request can reach max-seq-len, "
                     f"at most what {KV_MEMORY_FRACTION:.0%} of the device's free memory holds)")
    eng.add_argument("--max-tokens-per-step", type=int, help="token budget of one forward")
    eng.add_argument("--engine", default="{}", help="any other EngineConfig fields as JSON, e.g. "
                     "'{\"prefix_cache\": false}'")
    eng.add_argument("--seed", type=int, default=0, help="seeds requests sent without a seed")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (with --checkpoint)")
    return p


def engine_config(served: Served, args: argparse.Namespace, free_memory: int | None = None) -> EngineConfig:
    """The engine's settings from the command line (the engine's one sizing rule, then the
    explicit flags), its KV pool fitted to `free_memory` (bytes free on the device; None:
    unknown, as on the CPU) by `fit_pool`."""
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
    if not args.timeout_keep_alive > 0:
        raise ConfigError(f"--timeout-keep-alive: must be > 0 seconds, got {args.timeout_keep_alive}")
    if extra.get("on_weight_update", "finish") != "finish":
        raise ConfigError("--engine: on_weight_update must be 'finish' for serving (tokens already streamed "
                          "are never taken back)")
    overrides: dict[str, Any] = {"max_batch": args.max_batch, "on_weight_update": "finish", **extra}
    if args.n_pages is not None:
        overrides["n_pages"] = args.n_pages
    if args.max_tokens_per_step is not None:
        overrides["max_tokens_per_step"] = args.max_tokens_per_step
    config = engine_config_for_workload(max_seq_len, args.max_batch,
                                        **{"page_size": args.page_size, "seed": args.seed, **overrides})
    return fit_pool(config, served.model_config, free_memory, chosen="n_pages" in overrides)


def fit_pool(config: EngineConfig, model: ModelConfig, free_memory: int | None, *, chosen: bool) -> EngineConfig:
    """`config` with a KV pool that fits KV_MEMORY_FRACTION of `free_memory` (None: as it
    is). A pool the user `chosen` (--n-pages) that does not fit is an error naming
    --n-pages; the default one is shrunk to what fits, with a log line saying so, unless
    not even one request of max_seq_len fits (an error naming --max-seq-len)."""
    if free_memory is None:
        return config
    per_page = kv_bytes_per_token(model, config.kv_dtype) * config.page_size
    budget = int(free_memory * KV_MEMORY_FRACTION)
    if config.n_pages * per_page <= budget:
        return config
    fits = budget // per_page
    gib = 2.0**30
    where = (f"{KV_MEMORY_FRACTION:.0%} of the device's {free_memory / gib:.1f} GiB free hold {fits} pages of "
             f"{per_page / 2**20:.2f} MiB")
    if chosen:
        raise ConfigError(f"--n-pages: {config.n_pages} KV pages take {config.n_pages * per_page / gib:.1f} GiB; "
                          f"{where}: lower --n-pages (or --max-seq-len / --max-batch)")
    one = config.max_pages_per_request(model)
    if fits < one:
        raise ConfigError(f"--max-seq-len: one request of {config.seq_len_limit(model)} tokens needs {one} KV pages; "
                          f"{where}: lower --max-seq-len")
    log.warning("KV pool capped at %d pages (%.1f GiB) instead of %d: %s; %d requests of max_seq_len %d fit at "
                "once (more wait for pages). Set --n-pages or --max-seq-len to choose.", fits, fits * per_page / gib,
                config.n_pages, where, fits // one, config.seq_len_limit(model))
    return dataclasses.replace(config, n_pages=fits)


def build(args: argparse.Namespace):
    """(Server, FastAPI app) for parsed arguments; raises ConfigError & co. for bad ones."""
    served = load_served(args.model, args.checkpoint, args.config, args.tokenizer, args.dtype,
                         args.served_model_name, args.overrides)
    config = engine_config(served, args, device_free_memory())  # measured with the weights in place
    engine = Engine(served.model_config, served.params, config, version=served.version)
    server = Server(served, engine, max_queue=args.max_queue, admin_token=args.admin_token)
    return server, create_app(server, shutdown_timeout=args.shutdown_timeout)


def warmup(engine: Engine) -> int:
    """Compiles the step programs of default-sampled requests (what clients send without
    sampling fields: temperature 1), printing how many and how long; returns the count.
    Other sampling variants (greedy, top-p / top-k, penalties) compile on first use."""
    t0 = time.perf_counter()
    n = engine.warmup(SamplingParams())
    print(f"jrl serve: {n} step programs compiled or read from the compilation cache in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return n


def main(argv: list[str] | None = None, prog: str = "jrl serve") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server, app = build(args)
    except (*CONFIG_ERRORS, CheckpointCorruptError) as e:
        return cli_exit(e)
    if args.warmup:
        warmup(server.engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=args.timeout_keep_alive,
                            lifespan="on")
    uv = uvicorn.Server(config)
    # uvicorn re-raises the signal it stopped on once it has shut down, to the handler that
    # was installed before it: this one, so a SIGTERM'd server exits 0 after a clean stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"jrl serve: {server.served.name} (policy version {server.engine.version}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    with gil_handoff():
        uv.run()
    print("jrl serve: stopped", flush=True)
    return 0


class ServerThread:
    """A server on 127.0.0.1 in a background thread of this process (tests, `jrl bench
    serve`): `with ServerThread(server, app) as s: s.url`."""

    def __init__(self, server, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 10.0,
                 timeout_keep_alive: float = KEEP_ALIVE_S, switch_interval_s: float = SWITCH_INTERVAL_S) -> None:
        self.server = server
        self._handoff = gil_handoff(switch_interval_s)
        self.uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                                timeout_graceful_shutdown=shutdown_timeout,
                                                timeout_keep_alive=timeout_keep_alive))
        self.host = host
        self._thread = threading.Thread(target=self._run, name="jrl-serve-http", daemon=True)

    def _run(self) -> None:
        self.uv.run()  # the event loop and HTTP parser `jrl serve` runs (uvloop, httptools when installed)

    def __enter__(self) -> ServerThread:
        self._handoff.__enter__()
        self._thread.start()
        deadline = time.time() + 120
        while not self.uv.started:
            if not self._thread.is_alive() or time.time() > deadline:
                self._handoff.__exit__(None, None, None)
                raise RuntimeError("jrl serve: the server thread did not start")
            time.sleep(0.02)
        self.port = self.uv.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cpu_s(self) -> float:
        """CPU seconds the HTTP thread (the event loop: parsing, JSON, detokenization) has
        used: near the wall time of a busy period means the event loop was saturated."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self._thread.join(60)
        self._handoff.__exit__(*exc)


if __name__ == "__main__":
    sys.exit(main())
