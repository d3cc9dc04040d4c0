"""The load generator of `jrl bench serve`, run in processes of its own.

    with LoadClient(processes=8) as client:
        wall_s, latencies, output_tokens = client.round(url, model, prompts, concurrency, new)

Each round keeps `concurrency` /v1/completions requests in flight (async httpx clients, one
connection per request in flight, reused) until every prompt is answered. The requests in
flight are spread over `processes` client processes (each keeps its share in flight over
its share of the prompts): one Python process with a few hundred connections is itself the
bottleneck (on the H200 host one httpx process held 256 requests in flight at a sixth of
the engine's pace), as a single real client would be. Separate processes, as real clients
are: in the server's own process the generator's Python work (JSON, HTTP parsing) would
take the GIL from the server's event loop and measure a contention no deployment has.
The processes are spawned, not forked (the benchmark's process holds threads), and this
module imports neither jax nor jrl's engine, so the clients never
touch the accelerator.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import httpx


def split_load(prompts: list, concurrency: int, processes: int) -> list[tuple[list[tuple[int, list[int]]], int]]:
    """(indexed prompts, requests in flight) per client process: the prompts dealt round
    robin, the concurrency split as evenly as it goes; processes that would keep nothing in
    flight get no share."""
    n = max(1, min(processes, concurrency, len(prompts)))
    shares = []
    for p in range(n):
        in_flight = concurrency // n + (1 if p < concurrency % n else 0)
        shares.append(([(k, prompts[k]) for k in range(p, len(prompts), n)], in_flight))
    return shares


class LoadClient:
    def __init__(self, processes: int = 1) -> None:
        self.processes = processes

    def __enter__(self) -> LoadClient:
        self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown()

    def round(self, url: str, model: str, prompts: list[list[int]], concurrency: int,
              new: int) -> tuple[float, list[float], int]:
        """(wall seconds, per-request latencies, output tokens) of one round over the client
        processes; raises RuntimeError naming the request for a failed one."""
        t0 = time.perf_counter()
        futures = [self._pool.submit(run_round, url, model, share, in_flight, new)
                   for share, in_flight in split_load(prompts, concurrency, self.processes)]
        latencies: list[float] = []
        tokens = 0
        for future in futures:
            lat, tok = future.result()
            latencies += lat
            tokens += tok
        return time.perf_counter() - t0, latencies, tokens


def run_round(url: str, model: str, prompts: list[tuple[int, list[int]]], concurrency: int,
              new: int) -> tuple[list[float], int]:
    return asyncio.run(_load(url, model, prompts, concurrency, new))


async def _load(url: str, model: str, prompts: list[tuple[int, list[int]]], concurrency: int,
                new: int) -> tuple[list[float], int]:
    queue = list(prompts)
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

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, tokens
