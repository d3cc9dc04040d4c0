"""The load generator of `jrl bench serve`, run in a process of its own.

    with LoadClient() as client:
        wall_s, latencies, output_tokens = client.round(url, model, prompts, concurrency, new)

Each round keeps `concurrency` /v1/completions requests in flight (an async httpx client,
one connection per request in flight, reused) until every prompt is answered. A separate
process, as real clients are: in the server's own process the generator's Python work
(JSON, HTTP parsing) would take the GIL from the server's event loop and engine thread
and measure a contention no deployment has. The process is spawned, not forked (the
server process holds a device and threads), and this module imports neither jax nor jrl's
engine, so the client never touches the accelerator.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import httpx


class LoadClient:
    def __enter__(self) -> LoadClient:
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown()

    def round(self, url: str, model: str, prompts: list[list[int]], concurrency: int,
              new: int) -> tuple[float, list[float], int]:
        """(wall seconds, per-request latencies, output tokens) of one round (in the client
        process); raises RuntimeError naming the request for a failed one."""
        return self._pool.submit(run_round, url, model, prompts, concurrency, new).result()


def run_round(url: str, model: str, prompts: list[list[int]], concurrency: int,
              new: int) -> tuple[float, list[float], int]:
    return asyncio.run(_load(url, model, prompts, concurrency, new))


async def _load(url: str, model: str, prompts: list[list[int]], concurrency: int,
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
                try:
                    r = await client.post("/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": new, "temperature": 1.0, "seed": k,
                        "ignore_eos": True})
                except httpx.TransportError as e:
                    raise RuntimeError(f"bench serve: request {k} at concurrency {concurrency} failed: "
                                       f"{type(e).__name__}: {e!r}") from None
                if r.status_code != 200:
                    raise RuntimeError(f"bench serve: HTTP {r.status_code}: {r.text[:500]}")
                latencies.append(time.perf_counter() - t0)
                tokens += json.loads(r.content)["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies, tokens
