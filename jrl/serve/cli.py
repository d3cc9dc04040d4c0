"""`jrl serve`: the OpenAI-compatible server (docs/serve.md).

    jrl serve --model hf:/models/qwen2-0.5b --port 8000
    jrl serve --checkpoint runs/grpo/checkpoints [--config runs/grpo/config.yaml] --admin-token $T

The engine runs in a process of its own (`engine_process`; `--engine-in-process`: on a
thread of the server's). Before the server listens, the engine compiles every step program
it can dispatch for default-sampled requests (`Engine.warmup`; `--no-warmup` skips it and
programs compile on first use, stalling the requests of that step), and sizes the KV pool
to the device's free memory when the default pool would not fit (`fit_pool`).

Exit status: 0 after a clean shutdown (SIGTERM or Ctrl-C: stop accepting, let requests in
flight finish for up to --shutdown-timeout seconds, cancel the rest), 2 for a bad command
line, config, checkpoint or engine setting.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn

from jrl.checkpoint import CheckpointCorruptError
from jrl.config import CONFIG_ERRORS, ConfigError, cli_exit, cli_warnings
from jrl.serve.app import MAX_REQUEST_MB, Server, create_app
from jrl.serve.engine_process import EngineProcess
from jrl.serve.loading import (KV_MEMORY_FRACTION, Served, add_special_tokens_line, load_engine,
                               with_add_special_tokens)
from jrl.serve.worker import SWITCH_INTERVAL_S, gil_handoff

log = logging.getLogger("jrl.serve")

# Seconds an idle keep-alive connection stays open. Longer than the 5 s of httpx (the
# openai client's transport): a client must drop an idle connection before the server
# does, or a request it sends on it as the server closes it fails with a reset connection.
KEEP_ALIVE_S = 75.0


# Seconds after --shutdown-timeout for the requests failed then to write their error before
# uvicorn cancels what is left (a response cut off without an error, a plain answer's 500).
SHUTDOWN_GRACE_S = 5.0


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown ends the requests still in flight at
    `shutdown_timeout` with a 503 error object (a stream: an error event, then [DONE])
    instead of letting uvicorn cancel them, which cut streams off mid-event and answered
    plain requests with a bare 'Internal Server Error'."""

    def __init__(self, config: uvicorn.Config, server: Server, shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout + SHUTDOWN_GRACE_S
        super().__init__(config)
        self.jrl_server, self.shutdown_timeout = server, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        def end() -> None:
            n = self.jrl_server.end_in_flight(
                f"the server is shutting down: the request did not finish within --shutdown-timeout "
                f"({self.shutdown_timeout:g} s)")
            if n:
                log.warning("shutting down: ended %d engine request(s) still running after %g s", n,
                            self.shutdown_timeout)

        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, end)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


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
    src.add_argument("--add-special-tokens", action=argparse.BooleanOptionalAction, default=None,
                     help="the default of /v1/completions' add_special_tokens: whether a text prompt opens with the "
                          "tokenizer's BOS unless a request says (default: as a jrl checkpoint's run encoded plain "
                          "text, its data.add_bos or a grpo run's strategy.options.task.add_bos; else true, as vLLM)")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1",
                     help="interface to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every one)")
    net.add_argument("--port", type=int, default=8000, help="(default 8000)")
    net.add_argument("--max-queue", type=int, default=256,
                     help="requests (choices) waiting beyond the --max-batch running; more get 429 (default 256)")
    net.add_argument("--admin-token", help="enables POST /v1/weights for clients sending Authorization: Bearer <it>")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds requests in flight may run after SIGTERM before they are cancelled")
    net.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB,
                     help=f"largest request body in MiB; larger ones get 413 before they are parsed (default "
                          f"{MAX_REQUEST_MB:g})")
    net.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                     help=f"seconds an idle keep-alive connection stays open (default {KEEP_ALIVE_S:g}: longer "
                          "than clients' own idle limit, 5 s for httpx / openai)")
    net.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="compile every step program before listening (default; --no-warmup: compile on first "
                          "use, which stalls the requests of that step)")
    net.add_argument("--engine-in-process", action="store_true",
                     help="run the engine on a thread of the server's process instead of a process of its own "
                          "(tests that reach into the engine; the engine then shares the GIL with the HTTP side)")
    net.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-batch", type=int, default=64, help="requests decoding at once (default 64)")
    eng.add_argument("--page-size", type=int, default=None,
                     help="tokens per KV page (default 16; 32 with an fp8 kv_dtype in --engine)")
    eng.add_argument("--max-seq-len", type=int,
                     help="prompt + completion tokens of one request (default: the model's, at most 4096)")
    # "%%": argparse %-formats help texts
    eng.add_argument("--n-pages", type=int, help="KV pages (default: every running request can reach max-seq-len, "
                     f"at most what {KV_MEMORY_FRACTION:.0%}% of the device's free memory holds)")
    eng.add_argument("--max-tokens-per-step", type=int, help="token budget of one forward")
    eng.add_argument("--engine", default="{}", help="any other EngineConfig fields as JSON, e.g. "
                     "'{\"prefix_cache\": false}'")
    eng.add_argument("--seed", type=int, default=0, help="seeds requests sent without a seed")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (with --checkpoint)")
    return p


def build(args: argparse.Namespace, load: Callable[[], Served] | None = None):
    """(Server, FastAPI app) for parsed arguments, the engine loaded, sized and warmed up
    (unless --no-warmup) in a process of its own (or here, with --engine-in-process);
    raises ConfigError & co. for bad ones. `load`: see `loading.load_engine`."""
    if args.engine_in_process:
        served, engine, warm = load_engine(args, load)
    else:
        engine = EngineProcess(args, load)
        served, warm = engine.served, engine.warmup
    served = with_add_special_tokens(served, args.add_special_tokens)
    server = Server(served, engine, max_queue=args.max_queue, admin_token=args.admin_token, warmup=warm)
    return server, create_app(server, shutdown_timeout=args.shutdown_timeout, max_request_mb=args.max_request_mb)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), taken before the model loads and compiles, so that
    a port in use is a start-up error at once rather than after the warm-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--host / --port: cannot listen on {host}:{port} ({e.strerror or e}); another server "
                          f"there? pick another --port") from None
    except OverflowError as e:  # a port outside 0-65535
        sock.close()
        raise ConfigError(f"--host / --port: cannot listen on {host}:{port} ({e}); pick a port in 0-65535") from None
    return sock


@cli_warnings()
def main(argv: list[str] | None = None, prog: str = "jrl serve") -> int:
    args = build_parser(prog).parse_intermixed_args(argv)  # overrides on both sides of a flag
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sock = listen_socket(args.host, args.port)
    except ConfigError as e:
        return cli_exit(e)
    try:
        server, app = build(args)
    except (*CONFIG_ERRORS, CheckpointCorruptError) as e:
        sock.close()
        return cli_exit(e)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=args.timeout_keep_alive, lifespan="on")
    uv = _Uvicorn(config, server, args.shutdown_timeout)
    # uvicorn re-raises the signal it stopped on once it has shut down, to the handler that
    # was installed before it: this one, so a SIGTERM'd server exits 0 after a clean stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"jrl serve: {server.served.name} (policy version {server.engine.version}) on "
          f"http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)  # --port 0: the port picked
    print(add_special_tokens_line(server.served), flush=True)
    with gil_handoff():
        uv.run(sockets=[sock])
    print("jrl serve: stopped", flush=True)
    return 0


class ServerThread:
    """A server on 127.0.0.1 in a background thread of this process (tests, `jrl bench
    serve`): `with ServerThread(server, app) as s: s.url`."""

    def __init__(self, server, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 10.0,
                 timeout_keep_alive: float = KEEP_ALIVE_S, switch_interval_s: float = SWITCH_INTERVAL_S) -> None:
        self.server = server
        self._handoff = gil_handoff(switch_interval_s)
        self.uv = _Uvicorn(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                          timeout_keep_alive=timeout_keep_alive), server, shutdown_timeout)
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
