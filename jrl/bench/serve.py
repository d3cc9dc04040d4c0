"""`jrl serve` under load: requests/s and output tokens/s over HTTP, beside the same
workload driven through the in-process Engine.

    jrl bench serve [--concurrency 1,16,64,256] [--requests N] [--prompt 128] [--new 128]
                    [--model hf:<dir> | --checkpoint <dir>] [--max-batch 64 ...]

The server (`jrl.serve`, the same app and engine thread as `jrl serve`) runs in a thread of
this process on 127.0.0.1; the load generator is an async httpx client in the main thread
keeping `concurrency` requests in flight until `--requests` (default max(2 x concurrency,
32)) have completed. Each request is a /v1/completions call with a random token-id prompt
of `--prompt` tokens, `--new` new tokens (`ignore_eos`, so every request generates exactly
that many), temperature 1 and its own seed. Without a model, random weights of the 0.82B
rollout shape (`shapes.ROLLOUT_082B`; `--tiny`: `shapes.TINY`) with the byte tokenizer.

Then the server is stopped and its engine runs the same prompts directly (`add_request` /
`step`, again `concurrency` in flight): the difference is the cost of HTTP, JSON,
detokenization and the thread hand-off. Before each timed round an untimed one (2 x
concurrency requests) compiles the step programs its batch sizes need. Rows: section `http` / `engine`, with
concurrency, requests, output_tokens, wall_s, requests_per_s, output_tokens_per_s,
compiled_while_timed (step programs still compiled inside the timed round: > 0 means the
round paid for a compilation) and (http) latency_p50_s / latency_p99_s. `--tiny` pads
every step to `--max-batch` rows and 16 or 128 tokens unless `--engine` says otherwise. The load generator shares the process (and the GIL) with the
server: on a small CPU box it takes a share of the host time the engine would otherwise get.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np

from jrl.bench.shapes import ROLLOUT_082B, TINY, csv_ints, init
from jrl.rollout import Engine, SamplingParams
from jrl.serve.app import Server, create_app
from jrl.serve.cli import ServerThread, build_parser, engine_config
from jrl.serve.loading import Served, load_served
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
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--n-pages", type=int, default=None)
    p.add_argument("--max-tokens-per-step", type=int, default=None)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--engine", default="{}", help="other EngineConfig fields as JSON")


def record_name(args) -> str:
    return "serve"


def _served(args, serve_args):
    if args.model or args.checkpoint:
        return load_served(args.model, args.checkpoint, args.config)
    cfg = TINY if args.tiny else ROLLOUT_082B
    return Served("bench", cfg, init(cfg), ByteTokenizer(), 0, "random weights")


def run(args, results) -> int:
    tiny = args.tiny
    levels = csv_ints(args.concurrency or ("1,4" if tiny else "1,16,64,256"))
    prompt_len = args.prompt or (16 if tiny else 128)
    new = args.new or (8 if tiny else 128)
    max_batch = args.max_batch or (16 if tiny else 64)
    engine_json = args.engine
    if tiny and engine_json == "{}":  # few step shapes: the untimed rounds compile them all on a CPU
        engine_json = json.dumps({"batch_buckets": [max_batch], "token_buckets": [16, 128], "max_tokens_per_step": 128})
    serve_argv = ["--max-batch", str(max_batch), "--page-size", str(args.page_size), "--max-queue",
                  str(args.max_queue), "--engine", engine_json]
    for flag, value in (("--max-seq-len", args.max_seq_len), ("--n-pages", args.n_pages),
                        ("--max-tokens-per-step", args.max_tokens_per_step)):
        if value is not None:
            serve_argv += [flag, str(value)]
    serve_args = build_parser().parse_args(serve_argv)
    served = _served(args, serve_args)
    engine = Engine(served.model_config, served.params, engine_config(served, serve_args), version=served.version)
    server = Server(served, engine, max_queue=args.max_queue)
    vocab = min(served.model_config.vocab_size, served.tokenizer.vocab_size)
    rng = np.random.default_rng(0)

    def workload(c: int) -> list[list[int]]:
        n = args.requests or (8 if tiny else max(2 * c, 32))
        return rng.integers(0, vocab, (n, prompt_len)).tolist()

    plans = {c: workload(c) for c in levels}
    with ServerThread(server, create_app(server)) as thread:
        for c in levels:
            # untimed: compiles the step programs this concurrency's batch sizes need
            asyncio.run(_http_load(thread.url, served.name, plans[c][:2 * c], c, new))
            traces = engine.step_function.traces
            wall, lat, tokens = asyncio.run(_http_load(thread.url, served.name, plans[c], c, new))
            n = len(plans[c])
            results.row("http", concurrency=c, requests=n, output_tokens=tokens, wall_s=wall,
                        compiled_while_timed=engine.step_function.traces - traces,
                        requests_per_s=n / wall, output_tokens_per_s=tokens / wall,
                        latency_p50_s=float(np.percentile(lat, 50)), latency_p99_s=float(np.percentile(lat, 99)),
                        prompt=prompt_len, new=new, max_batch=max_batch)
    for c in levels:
        _engine_load(engine, plans[c][:2 * c], c, new)  # untimed, as above
        traces = engine.step_function.traces
        wall, tokens = _engine_load(engine, plans[c], c, new)
        n = len(plans[c])
        results.row("engine", concurrency=c, requests=n, output_tokens=tokens, wall_s=wall,
                    compiled_while_timed=engine.step_function.traces - traces, requests_per_s=n / wall,
                    output_tokens_per_s=tokens / wall, prompt=prompt_len, new=new, max_batch=max_batch)
    columns = [("concurrency", "concurrency"), ("requests", "requests"), ("requests_per_s", "req/s"),
               ("output_tokens_per_s", "out tok/s"), ("compiled_while_timed", "compiled"),
               ("latency_p50_s", "p50 s"), ("latency_p99_s", "p99 s")]
    results.table(columns, "http", title=f"over HTTP ({served.name}, prompt {prompt_len}, {new} new tokens)")
    results.table(columns[:5], "engine", title="the same requests through the in-process Engine")
    return 0


async def _http_load(url: str, model: str, prompts: list[list[int]], concurrency: int,
                     new: int) -> tuple[float, list[float], int]:
    queue = list(enumerate(prompts))
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def worker() -> None:
            nonlocal tokens
            while queue:
                k, prompt = queue.pop()
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": new, "temperature": 1.0, "seed": k,
                    "ignore_eos": True})
                if r.status_code != 200:
                    raise RuntimeError(f"bench serve: HTTP {r.status_code}: {r.text[:500]}")
                latencies.append(time.perf_counter() - t0)
                tokens += json.loads(r.content)["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies, tokens


def _engine_load(engine, prompts: list[list[int]], concurrency: int, new: int) -> tuple[float, int]:
    pending = list(enumerate(prompts))
    in_flight = tokens = 0
    t0 = time.perf_counter()
    while pending or engine.has_work:
        while pending and in_flight < concurrency:
            k, prompt = pending.pop()
            engine.add_request(prompt, SamplingParams(temperature=1.0, seed=k), max_new_tokens=new)
            in_flight += 1
        for c in engine.step():
            in_flight -= 1
            tokens += len(c.tokens)
    for c in engine.flush():
        tokens += len(c.tokens)
    return time.perf_counter() - t0, tokens
