"""`jrl serve` under load: requests/s and output tokens/s over HTTP, beside the same
workload driven through the Engine directly.

    jrl bench serve [--concurrency 1,16,64,256] [--requests N] [--prompt 128] [--new 128]
                    [--model hf:<dir> | --checkpoint <dir>] [--max-batch 64 ...]

The server runs as `jrl serve` does (`jrl.serve.cli.build`): its engine loaded, sized and
warmed up in a process of its own (`EngineProcess`), the HTTP side (FastAPI on uvicorn) in
a thread of this process on 127.0.0.1; the load generator (`serve_client`) is async httpx clients in
`--clients` processes of their own (default one per 32 requests in flight, at most 8)
keeping `concurrency` requests in flight until `--requests` (default max(2 x concurrency,
32)) have completed. Each request is a /v1/completions call with a
random token-id prompt of `--prompt` tokens, `--new` new tokens (`ignore_eos`, so every
request generates exactly that many), temperature 1 and its own seed. Without a model,
random weights of the 0.82B rollout shape (`shapes.ROLLOUT_082B`; `--tiny`: `shapes.TINY`)
with the byte tokenizer.

Then, the HTTP side idle, the engine process runs the same prompts on its engine directly
(`engine_round` through `EngineProcess.call`: `add_request` / `step`, again `concurrency`
in flight): the difference is the cost of HTTP, JSON, detokenization and the hand-off
between the processes. `--engine-in-process` measures the engine on a thread of the
server's process instead (`jrl serve --engine-in-process`; rows' `engine_process` false).

Before anything is timed the engine compiles every step program of these requests
(`Engine.warmup`, as `jrl serve` does before it listens; row `warmup`: programs, seconds),
and before each timed round an untimed one (`concurrency` requests) warms the rest
(connections, host caches). Rows: section `http` / `engine`, with concurrency, requests,
output_tokens, wall_s, requests_per_s, output_tokens_per_s, compiled_while_timed (step
programs compiled inside the timed round: > 0 means the round paid for a compilation),
steps (engine steps in the round) and step_s / worker_step_s (seconds in `engine.step`);
(http) latency_p50_s / latency_p99_s, worker_host_s (the engine loop's time in the
server's own work around the steps: commands, token hand-off; from the engine process's
/health snapshot) and http_cpu_s (CPU seconds of the event loop's thread: HTTP, JSON,
detokenization; close to wall_s means the event loop, not the engine, set the pace).
`--switch-interval-ms` sets the GIL switch interval of the HTTP process (the event loop and
the thread reading the engine's messages; the engine process keeps Python's default). `--max-seq-len` defaults to prompt + new rounded up
to a page, so the default KV pool holds every running request and nothing more. `--tiny`
pads every step to `--max-batch` rows and 16 or max(128, max-batch) tokens unless
`--engine` says otherwise. The load generator shares the machine with the server: on a
small CPU box it takes a share of the cores the server would otherwise get.
"""

from __future__ import annotations

import functools
import json
import time

import numpy as np

from jrl.bench.results import device_name
from jrl.bench.serve_client import LoadClient
from jrl.bench.shapes import ROLLOUT_082B, TINY, csv_ints, init
from jrl.rollout import SamplingParams
from jrl.serve.cli import ServerThread, build, build_parser
from jrl.serve.loading import Served
from jrl.serve.worker import SWITCH_INTERVAL_S, gil_handoff
from jrl.tokenizer import ByteTokenizer


def add_arguments(p) -> None:
    p.add_argument("--concurrency", default=None, help="requests in flight, comma-separated (default "
                   "1,16,64,256; --tiny: 1,4)")
    p.add_argument("--requests", type=int, default=None, help="requests per concurrency level "
                   "(default max(2 x concurrency, 32); --tiny: 8)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; --tiny 16)")
    p.add_argument("--new", type=int, default=None, help="new tokens per request (default 128; --tiny 8)")
    p.add_argument("--model", help="hf:<dir> to serve (default: random weights)")
    p.add_argument("--checkpoint", help="a jrl checkpoint to serve (with its run's config)")
    p.add_argument("--config", help="the checkpoint's run config")
    p.add_argument("--max-batch", type=int, default=None, help="engine rows (default 64; --tiny 16)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None, help="engine max_seq_len (default: prompt + new "
                   "rounded up to a page)")
    p.add_argument("--n-pages", type=int, default=None)
    p.add_argument("--max-tokens-per-step", type=int, default=None)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--clients", type=int, default=None, help="load-generator processes (default: one per 32 "
                   "requests in flight at the highest concurrency, at most 8)")
    p.add_argument("--switch-interval-ms", default=None, help="the HTTP process's GIL switch interval(s) "
                   f"in ms, comma-separated: each HTTP round runs under each (default {SWITCH_INTERVAL_S * 1e3:g}, "
                   "the server's; Python's own is 5)")
    p.add_argument("--engine", default="{}", help="other EngineConfig fields as JSON")
    p.add_argument("--engine-in-process", action="store_true", help="the engine on a thread of the server's "
                   "process, as `jrl serve --engine-in-process` (default: a process of its own, as `jrl serve`)")


def record_name(args) -> str:
    return "serve"


def random_served(tiny: bool) -> Served:
    """Random weights of the benchmark's shape with the byte tokenizer (built in the engine
    process: picklable as `functools.partial(random_served, tiny)`)."""
    cfg = TINY if tiny else ROLLOUT_082B
    return Served("bench", cfg, init(cfg), ByteTokenizer(), 0, "random weights")


def run(args, results) -> int:
    tiny = args.tiny
    levels = csv_ints(args.concurrency or ("1,4" if tiny else "1,16,64,256"))
    prompt_len = args.prompt or (16 if tiny else 128)
    new = args.new or (8 if tiny else 128)
    max_batch = args.max_batch or (16 if tiny else 64)
    engine_json, max_tokens_per_step = args.engine, args.max_tokens_per_step
    if tiny and engine_json == "{}":  # few step shapes: quick to compile on a CPU
        budget = max(128, max_batch)
        engine_json = json.dumps({"batch_buckets": [max_batch], "token_buckets": [16, budget]})
        max_tokens_per_step = budget if max_tokens_per_step is None else max_tokens_per_step
    max_seq_len = args.max_seq_len or -(-(prompt_len + new) // args.page_size) * args.page_size
    serve_argv = ["--max-batch", str(max_batch), "--page-size", str(args.page_size), "--max-queue",
                  str(args.max_queue), "--engine", engine_json, "--max-seq-len", str(max_seq_len)]
    for flag, value in (("--n-pages", args.n_pages), ("--max-tokens-per-step", max_tokens_per_step),
                        ("--model", args.model), ("--checkpoint", args.checkpoint), ("--config", args.config)):
        if value is not None:
            serve_argv += [flag, str(value)]
    if args.engine_in_process:
        serve_argv.append("--engine-in-process")
    serve_args = build_parser().parse_args(serve_argv)
    # as `jrl serve` runs: the engine (loaded, sized, warmed up) in a process of its own, unless
    # --engine-in-process
    server, app = build(serve_args, None if args.model or args.checkpoint else functools.partial(random_served, tiny))
    programs, seconds = server.warmup
    process = not args.engine_in_process
    # the rows name the engine's device, asked of the engine's process: this one never starts
    # an accelerator backend (a second CUDA context here would take device memory and time)
    results.name_device(server.engine.call(engine_device) if process else engine_device(server.engine))
    results.row("warmup", programs=programs, seconds=seconds, max_batch=max_batch, max_seq_len=max_seq_len,
                n_pages=server.engine.config.n_pages, engine_process=process)
    served = server.served
    vocab = min(served.model_config.vocab_size, served.tokenizer.vocab_size)
    rng = np.random.default_rng(0)

    def workload(c: int) -> list[list[int]]:
        n = args.requests or (max(8, c) if tiny else max(2 * c, 32))
        return rng.integers(0, vocab, (n, prompt_len)).tolist()

    plans = {c: workload(c) for c in levels}
    clients = args.clients or min(8, -(-max(levels) // 32))
    intervals = [float(x) for x in (args.switch_interval_ms or f"{SWITCH_INTERVAL_S * 1e3:g}").split(",")]
    with ServerThread(server, app) as thread, LoadClient(clients) as client:
        worker = server.worker  # the EngineProcess, or the EngineWorker thread the app started
        for c, interval in ((c, i) for c in levels for i in intervals):
            client.round(thread.url, served.name, plans[c][:c], c, new)  # untimed
            before, cpu = _settled(worker), thread.cpu_s()
            with gil_handoff(interval / 1e3):
                wall, lat, tokens = client.round(thread.url, served.name, plans[c], c, new)
                after = _settled(worker)
            cpu = thread.cpu_s() - cpu
            n = len(plans[c])
            results.row("http", concurrency=c, requests=n, output_tokens=tokens, wall_s=wall,
                        compiled_while_timed=after["compiled_programs"] - before["compiled_programs"],
                        requests_per_s=n / wall, output_tokens_per_s=tokens / wall,
                        latency_p50_s=float(np.percentile(lat, 50)), latency_p99_s=float(np.percentile(lat, 99)),
                        worker_step_s=after["step_s"] - before["step_s"],
                        worker_host_s=after["host_s"] - before["host_s"], steps=after["steps"] - before["steps"],
                        http_cpu_s=cpu, clients=min(clients, c), switch_interval_ms=interval,
                        prompt=prompt_len, new=new, max_batch=max_batch, engine_process=process)
        for c in levels:  # the HTTP side idle: the engine loop runs the rounds itself
            worker.call(engine_round, plans[c][:c], c, new)  # untimed, as above
            r = worker.call(engine_round, plans[c], c, new)
            n = len(plans[c])
            results.row("engine", concurrency=c, requests=n, output_tokens=r["tokens"], wall_s=r["wall_s"],
                        step_s=r["step_s"], steps=r["steps"], compiled_while_timed=r["compiled"],
                        requests_per_s=n / r["wall_s"], output_tokens_per_s=r["tokens"] / r["wall_s"],
                        prompt=prompt_len, new=new, max_batch=max_batch, engine_process=process)
    columns = [("concurrency", "concurrency"), ("requests", "requests"), ("requests_per_s", "req/s"),
               ("output_tokens_per_s", "out tok/s"), ("compiled_while_timed", "compiled"),
               ("latency_p50_s", "p50 s"), ("latency_p99_s", "p99 s")]
    results.table(columns + [("switch_interval_ms", "switch ms"), ("steps", "steps"), ("worker_step_s", "step s"), ("worker_host_s", "host s"),
                             ("http_cpu_s", "http cpu s")], "http",
                  title=f"over HTTP ({served.name}, prompt {prompt_len}, {new} new tokens)")
    results.table(columns[:5] + [("steps", "steps"), ("step_s", "step s")], "engine",
                  title="the same requests through the Engine directly, without HTTP")
    return 0


def engine_device(engine) -> str:
    """The device name rows carry, where the engine runs."""
    return device_name()


def engine_round(engine, prompts: list[list[int]], concurrency: int, new: int) -> dict:
    """The prompts run on `engine` directly, where it runs (`EngineProcess.call`,
    `EngineWorker.call`):
    wall_s, tokens (output), step_s (in engine.step), steps, compiled (programs)."""
    traces, steps = engine.step_function.traces, engine.stats.steps
    pending = list(enumerate(prompts))
    in_flight = tokens = 0
    step_s = 0.0
    t0 = time.perf_counter()
    while pending or engine.has_work:
        while pending and in_flight < concurrency:
            k, prompt = pending.pop()
            engine.add_request(prompt, SamplingParams(temperature=1.0, seed=k), max_new_tokens=new)
            in_flight += 1
        t1 = time.perf_counter()
        finished = engine.step()
        step_s += time.perf_counter() - t1
        for c in finished:
            in_flight -= 1
            tokens += len(c.tokens)
    for c in engine.flush():
        tokens += len(c.tokens)
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "step_s": step_s,
            "steps": engine.stats.steps - steps, "compiled": engine.step_function.traces - traces}


def _settled(worker, timeout: float = 30.0) -> dict:
    """The engine's snapshot once its last step's deliveries are published (the round's
    responses can arrive before the step's bookkeeping ends)."""
    deadline = time.time() + timeout
    while worker.snapshot["active_requests"] and time.time() < deadline:
        time.sleep(0.01)
    return dict(worker.snapshot)
