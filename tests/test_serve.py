"""`jrl serve`: a live server on 127.0.0.1 (a random free port) over a tiny random qwen2
model saved as a Hugging Face directory with a ChatML tokenizer, driven with the official
`openai` client (and httpx for raw bodies): chat, completions, streaming, n > 1, logprobs,
stop strings, seeds, 64 concurrent requests, cancellation returning pages, a random mix of
requests and cancellations, every bad input's 400 / 429 (for a large body, prepared off the
event loop, too), other clients answered while a large prompt is tokenized, the admin weights
endpoint, the OpenAPI document, SIGTERM shutdown (a subprocess), `jrl bench serve --tiny`.
Nothing asserts on wall-clock time."""

import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, normalizers
from tokenizers import models as tok_models

from chat_fixtures import CHATML, write_chat_tokenizer
from jrl import checkpoint
from jrl.bench.cli import main as bench
from jrl.bench.serve_client import split_load
from jrl.config import ConfigError, ModelConfig, from_dict, to_dict
from jrl.hf import params_equal, save_pretrained
from jrl.models import init_params
from jrl.serve.tools import parse_tool_calls
from jrl.rollout import Engine, SamplingParams, TuningOverrides
from jrl.rollout.cache.kv_storage import kv_bytes_per_token
from jrl.rollout.tuning import resolve_tuning
from jrl.serve import cli
from jrl.serve.cli import ServerThread, build, build_parser, main
from jrl.serve.loading import KV_MEMORY_FRACTION, engine_config, load_served
from jrl.serve.app import chat_logprobs, completion_logprobs
from jrl.serve.text import TextStream, decode
from jrl.serve.worker import DoneEvent, TokenEvent
from jrl.tokenizer import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"vocab_size": 320, "hidden_size": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
         "intermediate_size": 64, "max_position_embeddings": 128, "qkv_bias": True}
# One engine geometry for every server here (the step programs compile once per process).
# Every step padded to 16 rows and 16 or 128 tokens: a handful of programs to compile.
ENGINE_FLAGS = ["--max-batch", "16", "--page-size", "16", "--max-seq-len", "128", "--max-queue", "48",
                "--max-tokens-per-step", "128", "--engine", json.dumps({"batch_buckets": [16],
                                                                        "token_buckets": [16, 128]})]
TOKEN = "s3cret"
NAME = "tiny-qwen"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    config = from_dict(ModelConfig, MODEL)
    dirs = []
    for seed in (0, 1):  # the served weights, and another version for /v1/weights
        d = root / f"tiny-{seed}"
        write_chat_tokenizer(d)
        save_pretrained(config, jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed)), str(d),
                        model_type="qwen2")
        dirs.append(d)
    return dirs


def serve(argv: list[str]):
    """A live server (ServerThread) with an openai client and an httpx client."""
    server, app = build(build_parser().parse_args(argv))
    with ServerThread(server, app) as thread:
        thread.client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0)
        thread.http = httpx.Client(base_url=thread.url, timeout=120)
        yield thread
        thread.http.close()


@pytest.fixture(scope="module")
def live(hf_dirs):
    """The server as `jrl serve` runs it: the engine in a process of its own."""
    yield from serve(["--model", f"hf:{hf_dirs[0]}", "--served-model-name", NAME, "--admin-token", TOKEN,
                      *ENGINE_FLAGS])


@pytest.fixture(scope="module")
def live_in_thread(hf_dirs):
    """The engine on a thread of this process (tests that reach into it); capacity 16 + 240."""
    yield from serve(["--model", f"hf:{hf_dirs[0]}", "--served-model-name", NAME, "--engine-in-process",
                      *ENGINE_FLAGS, "--max-queue", "240"])


def health(live) -> dict:
    r = live.http.get("/health")
    assert r.status_code == 200
    return r.json()


def settle(live, timeout: float = 60.0) -> dict:
    """/health once no request is active any more."""
    deadline = time.time() + timeout
    while True:
        h = health(live)
        if h["outstanding_requests"] == 0 and h["engine"]["active_requests"] == 0 and h["engine"]["running"] == 0:
            return h
        assert time.time() < deadline, h
        time.sleep(0.05)


def test_models_and_health(live):
    (m,) = live.client.models.list().data
    assert m.id == NAME and m.model_extra["max_model_len"] == 128
    tok = live.server.tokenizer  # stops at EOS and at the ChatML end of turn
    assert live.server.eos_ids == [tok.encode("<|endoftext|>")[0], tok.encode("<|im_end|>")[0]]
    h = health(live)
    assert h["status"] == "ok" and h["capacity"] == 16 + 48
    assert h["engine"]["total_pages"] == h["engine"]["available_pages"] > 0


def test_chat_completion_renders_the_template_and_counts_cached_tokens(live, hf_dirs):
    tok = load_tokenizer(str(hf_dirs[0]))
    messages = [{"role": "system", "content": "be brief: the user asks about the cat on the mat"},
                {"role": "user", "content": "what is 2 plus 3?"}]
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    first = live.client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    again = live.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=8,
                                                temperature=0)
    for r in (first, again):
        (c,) = r.choices
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length") and c.model_extra["jrl"] == {"policy_version": 0}
        assert r.usage.prompt_tokens == len(prompt) and 1 <= r.usage.completion_tokens <= 8
        assert r.object == "chat.completion" and r.model == NAME
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = live.client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, tools=tools)
    assert with_tools.choices[0].message.tool_calls is None  # parsed once the shared parser lands
    # the second request reads the first one's full prompt pages from the prefix cache
    assert len(prompt) > 16
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * ((len(prompt) - 1) // 16)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_n_seed_logprobs(live):
    kw = dict(model=NAME, prompt="the cat sat", max_tokens=6, n=3, seed=7, temperature=1.0, logprobs=0,
              extra_body={"ignore_eos": True})
    a, b = live.client.completions.create(**kw), live.client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({tuple(c.logprobs.tokens) for c in a.choices}) == 3  # one seed per choice
    assert a.usage.completion_tokens == 18
    for c in a.choices:
        assert c.finish_reason == "length" and len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == 6
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs) and c.logprobs.text_offset[0] == 0
    # token-id prompts, several at once: n choices per prompt, indexed prompt-major
    ids = live.client.completions.create(model=NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, seed=1,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in ids.choices] == [0, 1, 2, 3] and ids.usage.prompt_tokens == 5
    chat = live.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, logprobs=True, top_logprobs=0, seed=3)
    content = chat.choices[0].logprobs.content
    assert 1 <= len(content) <= 4 and all(e.logprob <= 0 and e.top_logprobs == [] for e in content)


def test_stop_strings_cut_the_text(live):
    kw = dict(model=NAME, prompt="what is", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = live.client.completions.create(**kw).choices[0].text
    assert len(full) >= 6, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = live.client.completions.create(**kw, stop=[stop, "never appears \x01"]).choices[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in live.client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == cut.text


def test_streaming_chat_matches_the_plain_answer(live):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "the cat"}], max_tokens=10, n=2, seed=11)
    plain = live.client.chat.completions.create(**kw)
    texts, finish, usage, roles = {0: "", 1: ""}, {}, None, set()
    for chunk in live.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        roles.add(c.delta.role)
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert "assistant" in roles and set(finish) == {0, 1}
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in plain.choices]
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    # logprobs stream with the text they belong to: one entry per kept token
    entries = []
    for chunk in live.client.chat.completions.create(**{**kw, "n": 1}, stream=True, logprobs=True,
                                                     extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            entries += chunk.choices[0].logprobs.content
    assert len(entries) == 10 and all(e.logprob <= 0 for e in entries)
    # the raw stream ends with [DONE]
    with live.http.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2,
                                                             "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_64_concurrent_requests_all_complete(live):
    async def go():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(client.completions.create(
                model=NAME, prompt=f"{k} plus {k % 7}", max_tokens=1 + k % 12, seed=k,
                extra_body={"ignore_eos": True}) for k in range(64)))
        finally:
            await client.close()

    before = health(live)["engine"]["generated_tokens"]
    results = asyncio.run(go())
    assert [r.usage.completion_tokens for r in results] == [1 + k % 12 for k in range(64)]
    assert all(r.choices[0].finish_reason == "length" for r in results)
    h = settle(live)
    assert h["engine"]["generated_tokens"] - before >= sum(1 + k % 12 for k in range(64))
    assert h["engine"]["available_pages"] == h["engine"]["total_pages"]


def test_256_concurrent_requests_all_complete_over_reused_connections(live_in_thread):
    # capacity 16 + 240 = 256: every request is admitted; the second wave reuses the first's
    # connections (which must still be open when the client sends on them)
    async def go(url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            waves = []
            for wave in range(2):
                waves.append(await asyncio.gather(*(client.completions.create(
                    model=NAME, prompt=[k % 300, 7], max_tokens=1 + k % 4, seed=k,
                    extra_body={"ignore_eos": True}) for k in range(256))))
            return waves
        finally:
            await client.close()

    for results in asyncio.run(go(live_in_thread.url)):
        assert [r.usage.completion_tokens for r in results] == [1 + k % 4 for k in range(256)]
        assert all(r.choices[0].finish_reason == "length" for r in results)


def test_help_lists_the_flags():
    """`jrl serve --help` prints every flag (a bare % in a help string once crashed it)."""
    text = " ".join(build_parser().format_help().split())
    assert f"at most what {KV_MEMORY_FRACTION:.0%} of the device's free memory" in text
    assert "--admin-token" in text and "--max-seq-len" in text


def test_idle_connections_outlive_the_clients_keep_alive(hf_dirs):
    # httpx (the openai client's transport) drops a connection idle for 5 s; a server that
    # closed it first would reset a request sent on it (httpx.ReadError under load)
    client_expiry = httpx.Limits().keepalive_expiry
    assert build_parser().parse_args([]).timeout_keep_alive > client_expiry
    assert ServerThread(None, None).uv.config.timeout_keep_alive > client_expiry
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    with pytest.raises(ConfigError, match=r"^--timeout-keep-alive: must be > 0 seconds, got 0.0"):
        engine_config(served, build_parser().parse_args(["--timeout-keep-alive", "0"]))


def test_a_plain_answer_gets_its_tokens_once_with_its_completion(live):
    async def events(stream_tokens):
        handle = live.server.worker.submit(np.array([5, 6, 7], np.int32), SamplingParams(seed=1), 12, [],
                                           stream_tokens=stream_tokens)
        return [e async for e in handle]

    plain = asyncio.run(events(False))
    assert [type(e) for e in plain] == [TokenEvent, DoneEvent]
    assert plain[0].tokens == plain[1].completion.tokens.tolist() and len(plain[0].tokens) == 12
    streamed = asyncio.run(events(True))  # the same seed: the same tokens, step by step
    pieces = [e.tokens for e in streamed if isinstance(e, TokenEvent)]
    assert len(pieces) > 1 and sum(pieces, []) == plain[0].tokens


def _stop_at_first_tokens(engine) -> None:
    """Run in the engine process (`worker.call`): the process stops itself (SIGSTOP) at the
    start of the first step after one that read tokens back. That step's loop turn has sent
    them to the server, and no request has advanced since: none can have finished."""
    start, step = engine.stats.generated_tokens, engine.step

    def stopping_step():
        if engine.stats.generated_tokens > start:
            del engine.step  # the class's own step from now on
            os.kill(os.getpid(), signal.SIGSTOP)
        return step()

    engine.step = stopping_step


def _unhook_step(engine) -> None:
    engine.__dict__.pop("step", None)


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.01)


def wait_stopped(pid: int) -> None:
    """Returns once the child process `pid` is stopped (SIGSTOP reaches it asynchronously)."""
    deadline = time.time() + 60
    while os.waitpid(pid, os.WNOHANG | os.WUNTRACED) == (0, 0):
        assert time.time() < deadline, "the engine process did not stop"
        time.sleep(0.01)


def test_cancelled_requests_give_their_pages_back(live):
    # The engine is paused (SIGSTOP) at points where no choice can have finished: a fast
    # engine ran all 64 x 100 tokens in 0.3 s, and a pause sent from here once came after a
    # choice had finished, so the probe below was admitted and waited on the paused engine.
    total = settle(live)["engine"]["total_pages"]
    before = health(live)["engine"]["generated_tokens"]
    worker = live.server.worker
    engine_pid = worker.pid
    # a stream of 64 choices fills the server (capacity 64): more gets 429, closing it cancels all 64
    body = {"model": NAME, "prompt": "the mat", "max_tokens": 100, "n": 64, "stream": True, "ignore_eos": True}
    worker.call(_stop_at_first_tokens)
    try:
        with live.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            wait_stopped(engine_pid)  # the engine stopped itself right after its first tokens
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            h = health(live)
            busy = live.http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1})
            assert h["outstanding_requests"] == 64 and h["engine"]["available_pages"] < total
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_error"
        # the server saw the client leave and aborted the 64 before the engine could finish them
        wait_until(lambda: live.server.outstanding == 0, "the stream's requests were not aborted")
    finally:
        os.kill(engine_pid, signal.SIGCONT)
        worker.call(_unhook_step)  # (already gone once the engine stopped)
    # the official client reads that 429 as a RateLimitError (replayed byte for byte)
    replay = httpx.MockTransport(lambda request: httpx.Response(busy.status_code, headers=busy.headers,
                                                                content=busy.content))
    with httpx.Client(transport=replay) as http:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, http_client=http)
        with pytest.raises(openai.RateLimitError, match="server busy"):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
    h = settle(live)
    assert h["engine"]["available_pages"] == total  # aborted requests' pages are back (or cached)
    assert h["engine"]["generated_tokens"] - before < 64 * 100  # they did not run to the end
    # a non-streaming client that gives up is cancelled too: sent to the paused engine, admitted,
    # then the connection closes (the engine could finish the 6,400 tokens before the server saw it)
    before = health(live)["engine"]["generated_tokens"]
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        wait_stopped(engine_pid)
        payload = json.dumps({**body, "stream": False}).encode()
        url = httpx.URL(live.url)
        with socket.create_connection((url.host, url.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (url.host.encode(), len(payload), payload))
            wait_until(lambda: live.server.outstanding == 64, "the plain request was not admitted")
        wait_until(lambda: live.server.outstanding == 0, "the plain request was not aborted")
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    h = settle(live)
    assert h["engine"]["available_pages"] == total
    assert h["engine"]["generated_tokens"] - before < 64 * 100
    ok = live.client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": NAME, "prompt": "hi"}
BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": ', None),
    ("not an object", "/v1/completions", b"[1, 2]", None),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, "model"),
    ("model null", "/v1/completions", {**COMP, "model": None}, "model"),
    ("prompt null", "/v1/completions", {**COMP, "prompt": None}, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": NAME}, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("max_tokens past the context", "/v1/chat/completions", {**CHAT, "max_tokens": 500}, "max_tokens"),
    ("max_completion_tokens past the context", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 500},
     "max_completion_tokens"),
    ("max_tokens 0", "/v1/completions", {**COMP, "max_tokens": 0}, "max_tokens"),
    ("negative temperature", "/v1/completions", {**COMP, "temperature": -0.5}, "temperature"),
    ("temperature not a number", "/v1/completions", {**COMP, "temperature": "hot"}, "temperature"),
    ("top_p 0", "/v1/completions", {**COMP, "top_p": 0}, "top_p"),
    ("top_k negative", "/v1/completions", {**COMP, "top_k": -1}, "top_k"),
    ("min_p above 1", "/v1/completions", {**COMP, "min_p": 2}, "min_p"),
    ("repetition_penalty 0", "/v1/completions", {**COMP, "repetition_penalty": 0}, "repetition_penalty"),
    ("penalty infinite", "/v1/completions", {**COMP, "presence_penalty": 1e39}, "presence_penalty"),
    ("seed negative", "/v1/completions", {**COMP, "seed": -1}, "seed"),
    ("n 0", "/v1/completions", {**COMP, "n": 0}, "n"),
    ("n beyond the capacity", "/v1/completions", {**COMP, "n": 65}, "n"),
    ("prompts beyond the capacity", "/v1/completions", {**COMP, "prompt": ["hi"] * 65}, "prompt"),
    ("out-of-vocabulary ids", "/v1/completions", {**COMP, "prompt": [1, 2, 320]}, "prompt"),
    ("negative ids", "/v1/completions", {**COMP, "prompt": [[3], [-1]]}, "prompt"),
    ("ids beyond int64", "/v1/completions", {**COMP, "prompt": [3, 2**70]}, "prompt"),
    ("empty prompt", "/v1/completions", {**COMP, "prompt": ""}, "prompt"),
    ("prompt fills the context", "/v1/completions", {**COMP, "prompt": [3] * 128}, "prompt"),
    ("a lone surrogate in the prompt", "/v1/completions", b'{"model": "%s", "prompt": ["ok", "a\\ud800b"]}' % NAME.encode(),
     "prompt"),
    ("a lone surrogate in a message", "/v1/chat/completions",
     b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % NAME.encode(), "messages"),
    ("top_logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ("completion logprobs > 0", "/v1/completions", {**COMP, "logprobs": 2}, "logprobs"),
    ("empty stop string", "/v1/completions", {**COMP, "stop": ["", "x"]}, "stop"),
    ("max_tokens a string", "/v1/completions", {**COMP, "max_tokens": "5"}, "max_tokens"),
    ("max_tokens a float", "/v1/completions", {**COMP, "max_tokens": 5.0}, "max_tokens"),
    ("n a string", "/v1/completions", {**COMP, "n": "2"}, "n"),
    ("seed a string", "/v1/completions", {**COMP, "seed": "7"}, "seed"),
    ("temperature a numeric string", "/v1/completions", {**COMP, "temperature": "0.5"}, "temperature"),
    ("top_p a boolean", "/v1/completions", {**COMP, "top_p": True}, "top_p"),
    ("max_completion_tokens a string", "/v1/chat/completions", {**CHAT, "max_completion_tokens": "5"},
     "max_completion_tokens"),
    ("stop not strings", "/v1/completions", {**COMP, "stop": [1]}, "stop"),
    ("stream a string", "/v1/completions", {**COMP, "stream": "true"}, "stream"),
    ("add_special_tokens a string", "/v1/completions", {**COMP, "add_special_tokens": "false"},
     "add_special_tokens"),
    ("logprobs a number", "/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("logit_bias", "/v1/completions", {**COMP, "logit_bias": {"5": 10}}, "logit_bias"),
    ("image content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ("message without a role", "/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]},
     "messages[0].role"),
    ("unknown role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}, "messages[1].role"),
    ("message without content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]},
     "messages[0].content"),
    ("content not text", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("empty content list", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": []}]},
     "messages[0].content"),
    ("name not a string", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "name": 5}]},
     "messages[1].name"),
    ("tool message without tool_call_id", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
                           {"role": "tool", "content": "5"}]}, "messages[2].tool_call_id"),
    ("tool message answering no call", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "5"}]},
     "messages[1].tool_call_id"),
    ("stream_options without stream", "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("stream_options with stream false", "/v1/completions",
     {**COMP, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 0}, "top_logprobs"),
]


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(live, name, path, body, param):
    if isinstance(body, bytes):
        r = live.http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = live.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


@pytest.mark.parametrize("name,path,body,param", [b for b in BAD if isinstance(b[2], dict)],
                         ids=[b[0] for b in BAD if isinstance(b[2], dict)])
def test_a_large_body_prepared_off_the_event_loop_gets_the_same_400(live, name, path, body, param):
    # a body past offload_bytes is parsed, checked and tokenized on the server's thread pool
    small = live.http.post(path, json=body)
    padded = {**body, "user": "u" * live.server.offload_bytes}  # a field the server ignores
    large = live.http.post(path, json=padded)
    assert len(json.dumps(padded)) > live.server.offload_bytes
    assert small.status_code == large.status_code == 400, large.text
    assert large.json() == small.json() and large.json()["error"]["param"] == param


NULLABLE = ("n", "max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "stop",
            "stream", "stream_options", "logprobs", "logit_bias", "user")


@pytest.mark.parametrize("path,body,extra", [
    ("/v1/chat/completions", CHAT, ("top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                                    "response_format", "chat_template_kwargs")),
    ("/v1/completions", COMP, ("echo", "best_of", "suffix", "add_special_tokens"))], ids=["chat", "completions"])
def test_optional_fields_sent_as_null_take_their_defaults(live, path, body, extra):
    # OpenAI's optional parameters are nullable: clients that build the body from a struct send null for unset
    nulls = {k: None for k in (*NULLABLE, *extra)}
    fixed = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = live.http.post(path, json={**body, **nulls, **fixed})
    assert r.status_code == 200, r.text
    plain = live.http.post(path, json={**body, **fixed}).json()
    got = r.json()
    assert got["choices"][0]["logprobs"] is None and len(got["choices"]) == 1
    assert got["usage"] == plain["usage"] and got["usage"]["completion_tokens"] == 3
    key = "message" if "messages" in body else "text"
    assert got["choices"][0][key] == plain["choices"][0][key]


def test_a_prompt_of_several_that_fills_the_context_is_named_by_its_index(live):
    # the message said "the prompt has 128 tokens" for one of a list (which one?)
    r = live.http.post("/v1/completions", json={**COMP, "prompt": [[3] * 4, [3] * 128, [3] * 2]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "prompt: prompt[1] has 128 tokens, the context is 128 (max_seq_len): no "
                                            "room for a completion", "type": "invalid_request_error", "param": "prompt",
                                 "code": None}


def test_max_tokens_past_the_context_of_one_prompt_of_several_names_that_prompt(live):
    r = live.http.post("/v1/completions", json={**COMP, "prompt": [[3] * 2, [3] * 120], "max_tokens": 10})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "max_tokens: prompt[1] (120 tokens) + max_tokens (10) = 130 exceeds the "
                                            "context of 128 tokens (max_seq_len)", "type": "invalid_request_error",
                                 "param": "max_tokens", "code": None}


def test_a_lone_surrogate_is_named_with_its_place(live):
    r = live.http.post("/v1/completions", content=b'{"model": "%s", "prompt": ["ok", "a\\ud800b"]}' % NAME.encode(),
                       headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("prompt[1]: not valid Unicode text: a lone surrogate '\\ud800' at "
                                            "character 1 (a \\ud800-\\udfff escape in JSON must be half of a pair)")


ROLES = "'system', 'developer', 'user', 'assistant', 'tool', 'function'"


def test_a_message_with_an_unknown_role_is_a_400_naming_its_role(live):
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": f"messages[1].role: 'wizard' is not a role; expected one of {ROLES}",
                                  "type": "invalid_request_error", "param": "messages[1].role", "code": None}}


CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
ASKED = [{"role": "user", "content": "what is 2 plus 3?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool", "assistant"])
@pytest.mark.parametrize("content", ["missing", None])
def test_a_message_without_content_is_a_400_naming_it(live, role, content):
    message = {"role": role} if content == "missing" else {"role": role, "content": None}
    # a tool message otherwise valid: it answers the tool call before it
    before, message = (ASKED, {**message, "tool_call_id": "call_0"}) if role == "tool" else (CHAT["messages"], message)
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": [*before, message]})
    assert r.status_code == 400, r.text
    unless = " unless it has tool_calls" if role == "assistant" else ""
    i = len(before)
    assert r.json()["error"] == {
        "message": f"messages[{i}].content: missing; a '{role}' message needs content (a string or a list of "
                   f"text parts){unless}", "type": "invalid_request_error", "param": f"messages[{i}].content",
        "code": None}


def test_a_message_name_is_a_string_or_null(live):
    for name in ("alice", None):
        messages = [{"role": "user", "content": "hi", "name": name}]
        r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi",
                                                                           "name": ["alice"]}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "messages[0].name: must be a string, got ['alice']"


def test_an_assistant_message_with_tool_calls_and_null_content_is_accepted(live):
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [{"role": "user", "content": "what is 2 plus 3?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    r = live.client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, tools=tools,
                                            extra_body={"ignore_eos": True})
    tok = live.server.tokenizer  # the null content reaches the template as ""
    rendered = tok.apply_chat_template([messages[0], {**messages[1], "content": ""}, messages[2]],
                                       add_generation_prompt=True, tools=tools)
    assert r.usage.prompt_tokens == len(tok.encode(rendered)) and r.usage.completion_tokens == 2


# How Qwen2.5's and Llama 3.1's chat templates write an assistant message's tool calls: the
# arguments through `tojson`, as transformers' tool-use templates expect them, a dict.
TOOL_CALL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + (m.content or '') }}"
    "{% for c in m.tool_calls or [] %}{% set c = c.function %}"
    "{{ '<tool_call>{\"name\": \"' + c.name + '\", \"arguments\": ' }}{{ c.arguments | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}{{ '<|im_start|>assistant\n' }}")


def rendered_chat(live, monkeypatch, messages: list[dict]) -> str:
    """The prompt `messages` are rendered to (with TOOL_CALL_TEMPLATE), as the engine gets it."""
    monkeypatch.setattr(live.server.tokenizer, "chat_template", TOOL_CALL_TEMPLATE)
    _, prompts, _, _ = live.server.prepare_chat(json.dumps({**CHAT, "messages": messages}).encode(),
                                                "application/json")
    return live.server.tokenizer.decode(prompts[0].tolist())


def test_a_tool_calls_arguments_sent_back_as_a_json_string_reach_the_template_as_an_object(live, monkeypatch):
    # OpenAI's `arguments` is a JSON string (as the server answers it); templates write them with
    # `tojson`, which made the model read '"arguments": "{\"a\": 2, \"b\": 3}"', not the call it wrote
    text = rendered_chat(live, monkeypatch, [*ASKED, {"role": "tool", "tool_call_id": "call_0", "content": "5"}])
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text


def test_a_messages_text_parts_reach_the_template_joined_by_newlines(live, monkeypatch):
    # joined with nothing between them, "Summarize:" and "the cat sat" reached the model as
    # "Summarize:the cat sat" (vLLM, SGLang and TensorRT-LLM join them with a newline)
    parts = [{"type": "text", "text": "Summarize:"}, {"type": "text", "text": "the cat sat"}]
    text = rendered_chat(live, monkeypatch, [{"role": "user", "content": parts}])
    assert text == "<|im_start|>user\nSummarize:\nthe cat sat<|im_end|>\n<|im_start|>assistant\n"


def test_tool_call_arguments_that_are_no_json_object_reach_the_template_as_sent(live, monkeypatch):
    call = {**CALL, "function": {"name": "add", "arguments": "a=2, b=3"}}
    text = rendered_chat(live, monkeypatch, [ASKED[0], {**ASKED[1], "tool_calls": [call]},
                                             {"role": "tool", "tool_call_id": "call_0", "content": "5"}])
    assert '<tool_call>{"name": "add", "arguments": "a=2, b=3"}</tool_call>' in text


@pytest.mark.parametrize("calls,where,got", [("call_0", "tool_calls", "'call_0'"),
                                              ({"id": "call_0"}, "tool_calls", "{'id': 'call_0'}"),
                                              ([CALL, "call_1"], "tool_calls[1]", "'call_1'")],
                         ids=["a string", "an object", "an entry not an object"])
def test_tool_calls_that_are_not_a_list_of_objects_are_a_400_naming_them(live, calls, where, got):
    # they were taken as calls: their message's missing content let through, the template given a string
    messages = [ASKED[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    what = "a tool call object" if "[" in where else "a list of tool call objects"
    assert r.json()["error"] == {"message": f"messages[1].{where}: must be {what}, got {got}",
                                 "type": "invalid_request_error", "param": "messages[1].tool_calls", "code": None}


def tool_call_id_error(live, messages: list[dict], message: str) -> None:
    """The 400 of the last message's `tool_call_id`, its message `message`."""
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    where = f"messages[{len(messages) - 1}].tool_call_id"
    assert r.json()["error"] == {"message": f"{where}: {message}", "type": "invalid_request_error", "param": where,
                                 "code": None}


@pytest.mark.parametrize("answer", [{"content": "5"}, {"content": "5", "tool_call_id": None}], ids=["missing", "null"])
def test_a_tool_message_without_tool_call_id_is_a_400_naming_it(live, answer):
    # as OpenAI's API: a tool message says which call it answers
    tool_call_id_error(live, [*ASKED, {"role": "tool", **answer}],
                       "missing; a 'tool' message needs the id of the tool call it answers (one of the tool_calls of "
                       "the assistant message before it)")


def test_a_tool_call_id_that_is_not_a_string_is_a_400_naming_it(live):
    tool_call_id_error(live, [*ASKED, {"role": "tool", "tool_call_id": 0, "content": "5"}], "must be a string, got 0")


@pytest.mark.parametrize("before", [
    ASKED[:1],
    [ASKED[0], {"role": "assistant", "content": "Let me add."}],
    [*ASKED, {"role": "tool", "tool_call_id": "call_0", "content": "5"}, {"role": "user", "content": "and 4 + 4?"}],
], ids=["after a user message", "after an assistant message without tool_calls", "after a later user message"])
def test_a_tool_message_after_no_tool_call_is_a_400_naming_its_tool_call_id(live, before):
    # as OpenAI's API: a tool message answers a call of the assistant message right before it
    tool_call_id_error(live, [*before, {"role": "tool", "tool_call_id": "call_0", "content": "5"}],
                       "'call_0' answers no tool call: a 'tool' message must follow an assistant message with "
                       "tool_calls (or the other tool messages answering it)")


def test_a_tool_message_answering_an_id_of_no_call_is_a_400_naming_its_tool_call_id(live):
    tool_call_id_error(live, [*ASKED, {"role": "tool", "tool_call_id": "call_7", "content": "5"}],
                       "'call_7' answers no tool call of messages[1] (its tool_calls' ids: 'call_0')")


def test_tool_messages_answering_each_call_of_the_assistant_message_before_them_are_accepted(live):
    second = {**CALL, "id": "call_1", "function": {"name": "add", "arguments": '{"a": 4, "b": 4}'}}
    messages = [ASKED[0], {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
                {"role": "tool", "tool_call_id": "call_1", "content": "8"},
                {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_more_than_four_stop_strings_is_a_400_naming_stop(live):
    r = live.http.post("/v1/completions", json={**COMP, "stop": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "stop: at most 4 stop strings, got 5", "type": "invalid_request_error",
                                 "param": "stop", "code": None}
    ok = live.http.post("/v1/completions", json={**COMP, "stop": ["a", "b", "c", "d"], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


BOS = "<s>"


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory):
    """A server (the engine on a thread, Starlette's test client) over a model whose tokenizer
    prepends BOS when asked for its special tokens (Llama's post-processor) and whose chat
    template writes `bos_token` itself (Llama's, Mistral's)."""
    d = write_chat_tokenizer(tmp_path_factory.mktemp("bos") / "tiny", template="{{ bos_token }}" + CHATML, bos=BOS)
    config = from_dict(ModelConfig, MODEL)
    save_pretrained(config, jax.jit(init_params, static_argnums=0)(config, jax.random.key(0)), str(d),
                    model_type="qwen2")
    yield from threaded_server(["--model", f"hf:{d}"])


def threaded_server(source: list[str]):
    """(server, Starlette test client) over `source` (its --model / --checkpoint flags), the
    engine on a thread; a fixture yields from it."""
    server, app = build(build_parser().parse_args([*source, "--served-model-name", NAME, "--engine-in-process",
                                                   "--no-warmup", *ENGINE_FLAGS]))
    with TestClient(app) as client:
        yield server, client


def recorded_prompts(server, monkeypatch) -> list[list[int]]:
    """The prompt ids each engine request of `server` is given from now on, in order."""
    worker, prompts = server.worker, []
    real_submit = worker.submit

    def submit(prompt, *args, **kwargs):
        prompts.append([int(t) for t in prompt])
        return real_submit(prompt, *args, **kwargs)

    monkeypatch.setattr(worker, "submit", submit)
    return prompts


@pytest.fixture
def engine_prompts(bos_server, monkeypatch) -> list[list[int]]:
    """The prompt ids each engine request of the bos_server is given, in order."""
    return recorded_prompts(bos_server[0], monkeypatch)


def complete(bos_server, **fields) -> httpx.Response:
    return bos_server[1].post("/v1/completions", json={**COMP, "max_tokens": 1, **fields})


def test_a_text_prompt_gets_the_tokenizers_bos(bos_server, engine_prompts):
    # as vLLM (and transformers) encode a completions prompt: with the tokenizer's special tokens
    tok = bos_server[0].tokenizer
    r = complete(bos_server, prompt="the cat")
    assert r.status_code == 200, r.text
    assert engine_prompts == [[tok.bos_id, *tok.encode("the cat")]]
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("the cat")) + 1


def test_each_text_prompt_of_a_list_gets_the_bos(bos_server, engine_prompts):
    tok = bos_server[0].tokenizer
    r = complete(bos_server, prompt=["the cat", "the mat"])
    assert r.status_code == 200, r.text
    assert engine_prompts == [[tok.bos_id, *tok.encode("the cat")], [tok.bos_id, *tok.encode("the mat")]]


def test_add_special_tokens_false_leaves_the_text_prompt_as_the_tokenizer_encodes_it(bos_server, engine_prompts):
    tok = bos_server[0].tokenizer
    r = complete(bos_server, prompt="the cat", add_special_tokens=False)
    assert r.status_code == 200, r.text
    assert engine_prompts == [tok.encode("the cat")]
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("the cat"))


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_token_id_prompts_reach_the_engine_as_given(bos_server, engine_prompts, add_special_tokens):
    extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    r = complete(bos_server, prompt=[[5, 6, 7], [8]], **extra)
    assert r.status_code == 200, r.text
    assert engine_prompts == [[5, 6, 7], [8]] and r.json()["usage"]["prompt_tokens"] == 4


def test_the_bos_counts_in_the_prompt_length_that_max_tokens_must_fit_beside(bos_server):
    tok = bos_server[0].tokenizer
    text = "the cat sat on the mat " * 17  # about 120 tokens: a few left for max_tokens
    n = len(tok.encode(text))
    r = complete(bos_server, prompt=text, max_tokens=128 - n)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"max_tokens: prompt ({n + 1} tokens) + max_tokens ({128 - n}) = 129 "
                                            f"exceeds the context of 128 tokens (max_seq_len)",
                                 "type": "invalid_request_error", "param": "max_tokens", "code": None}
    without = complete(bos_server, prompt=text, max_tokens=128 - n, add_special_tokens=False, ignore_eos=True)
    assert without.status_code == 200, without.text


def test_an_empty_text_prompt_is_the_bos_alone(bos_server, engine_prompts):
    # what vLLM samples from too: the start of a text
    r = complete(bos_server, prompt="")
    assert r.status_code == 200, r.text
    assert engine_prompts == [[bos_server[0].tokenizer.bos_id]] and r.json()["usage"]["prompt_tokens"] == 1


def test_a_chat_prompt_has_the_templates_bos_once(bos_server, engine_prompts):
    # the template writes BOS; the rendered text is encoded without adding another
    server, client = bos_server
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    tok = server.tokenizer
    (prompt,) = engine_prompts
    assert prompt == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert prompt[0] == tok.bos_id and prompt.count(tok.bos_id) == 1
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


# ------------------------------------------------------------------ the default of add_special_tokens
# A jrl checkpoint is prompted as its run encoded plain text (data.add_bos, a grpo run's
# strategy.options.task.add_bos); a Hugging Face model as vLLM prompts it (with the BOS).
BYTES_MODEL = {**MODEL, "vocab_size": 262}  # the byte tokenizer's vocabulary


def write_run(root: Path, config: dict) -> Path:
    """A run directory (config.yaml over the byte tokenizer, one checkpoint) whose config
    is `config` over the model and tokenizer; returns its checkpoints/ directory."""
    (root / "checkpoints").mkdir(parents=True)
    data = {"tokenizer": "bytes", "seq_len": 64, **config.get("data", {})}
    (root / "config.yaml").write_text(json.dumps({"name": root.name, "model": BYTES_MODEL, **config, "data": data}))
    model = from_dict(ModelConfig, BYTES_MODEL)
    checkpoint.save(root / "checkpoints", 1, {"params": jax.jit(init_params, static_argnums=0)(model, jax.random.key(0))},
                    meta={"policy_version": 1})
    return root / "checkpoints"


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """A text run trained with jrl's default data.add_bos (false)."""
    return write_run(tmp_path_factory.mktemp("textrun") / "textrun", {"data": {"format": "text"}})


@pytest.fixture(scope="module")
def ckpt_server(text_run):
    """A server (the engine on a thread, Starlette's test client) over `text_run`."""
    yield from threaded_server(["--checkpoint", str(text_run)])


@pytest.fixture
def ckpt_prompts(ckpt_server, monkeypatch) -> list[list[int]]:
    """The prompt ids each engine request of the ckpt_server is given, in order."""
    return recorded_prompts(ckpt_server[0], monkeypatch)


def test_a_text_prompt_to_a_run_trained_without_bos_gets_none(ckpt_server, ckpt_prompts):
    tok = ckpt_server[0].tokenizer
    r = complete(ckpt_server, prompt="the cat")
    assert r.status_code == 200, r.text
    assert ckpt_prompts == [tok.encode("the cat")]
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("the cat"))


def test_a_request_sending_add_special_tokens_true_gets_the_bos_from_such_a_run(ckpt_server, ckpt_prompts):
    tok = ckpt_server[0].tokenizer
    r = complete(ckpt_server, prompt="the cat", add_special_tokens=True)
    assert r.status_code == 200, r.text
    assert ckpt_prompts == [[tok.bos_id, *tok.encode("the cat")]]


def test_add_special_tokens_sent_as_null_takes_the_servers_default(ckpt_server, ckpt_prompts):
    r = complete(ckpt_server, prompt="the cat", add_special_tokens=None)
    assert r.status_code == 200, r.text
    assert ckpt_prompts == [ckpt_server[0].tokenizer.encode("the cat")]


def test_models_shows_the_default_of_add_special_tokens_for_a_run(ckpt_server):
    (m,) = ckpt_server[1].get("/v1/models").json()["data"]
    assert m["jrl"]["add_special_tokens"] is False


def test_models_shows_the_default_of_add_special_tokens_for_a_hf_model(bos_server):
    (m,) = bos_server[1].get("/v1/models").json()["data"]
    assert m["jrl"]["add_special_tokens"] is True


@pytest.mark.parametrize("config,default,why", [
    ({"data": {"format": "text"}}, False, "the run's data.add_bos"),
    ({"data": {"format": "text", "add_bos": True}}, True, "the run's data.add_bos"),
    ({"data": {"format": "sections", "add_bos": True}}, True, "the run's data.add_bos"),
    ({"data": {"format": "preference", "sections": [{"field": "prompt"}]}}, False, "the run's data.add_bos"),
    ({"strategy": {"name": "grpo", "options": {"task": {"name": "addition"}}}}, False,
     "the run's strategy.options.task.add_bos"),
    ({"strategy": {"name": "grpo", "options": {"task": {"add_bos": True}}}}, True,
     "the run's strategy.options.task.add_bos"),
    ({"strategy": {"name": "grpo", "options": {}}}, False, "the run's strategy.options.task.add_bos"),
    ({"data": {"format": "chat"}}, True, "vLLM's, for a chat run (its template places the BOS)"),
    ({"data": {"format": "chat", "add_bos": False}}, True, "vLLM's, for a chat run (its template places the BOS)"),
], ids=["text", "text-add_bos", "sections-add_bos", "preference", "grpo", "grpo-add_bos", "grpo-no-task", "chat",
        "chat-add_bos-false"])
def test_a_checkpoints_default_of_add_special_tokens_follows_its_run(tmp_path, config, default, why):
    served = load_served(checkpoint=str(write_run(tmp_path / "run", config)))
    assert (served.add_special_tokens, served.add_special_tokens_from) == (default, why)


def test_a_hf_models_default_of_add_special_tokens_is_vllms(hf_dirs):
    served = load_served(model=f"hf:{hf_dirs[0]}")
    assert (served.add_special_tokens, served.add_special_tokens_from) == (True, "vLLM's, for a Hugging Face model")


def test_a_grpo_task_add_bos_that_is_not_a_boolean_is_a_config_error_naming_it(tmp_path):
    run = write_run(tmp_path / "run", {"strategy": {"name": "grpo", "options": {"task": {"add_bos": "yes"}}}})
    with pytest.raises(ConfigError) as e:
        load_served(checkpoint=str(run))
    assert str(e.value) == "strategy.options.task.add_bos: must be true or false, got 'yes'"


@pytest.mark.parametrize("flag,default", [("--add-special-tokens", True), ("--no-add-special-tokens", False)])
def test_the_flag_sets_the_servers_default_of_add_special_tokens(text_run, flag, default):
    server, _ = build(build_parser().parse_args(["--checkpoint", str(text_run), flag, "--engine-in-process",
                                                 "--no-warmup", *ENGINE_FLAGS]))
    assert (server.served.add_special_tokens, server.served.add_special_tokens_from) == (default, flag)


def test_start_up_prints_the_default_of_add_special_tokens_and_where_it_came_from(text_run, monkeypatch, capsys):
    monkeypatch.setattr(cli._Uvicorn, "run", lambda self, sockets=None: None)  # start up, then stop at once
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # leave pytest's handlers in place
    # and its logging: uvicorn's dictConfig closes every handler there is, pytest's capture ones too
    monkeypatch.setattr(cli.uvicorn.Config, "configure_logging", lambda self: None)
    assert main(["--checkpoint", str(text_run), "--port", "0", "--engine-in-process", "--no-warmup",
                 *ENGINE_FLAGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("jrl serve: /v1/completions encodes a text prompt without the tokenizer's special tokens (its BOS) "
            "unless a request sends add_special_tokens: true (default false: the run's data.add_bos)") in lines


def test_models_retrieve_gives_the_served_model(live):
    m = live.client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model" and m.owned_by == "jrl"
    assert m.model_extra["max_model_len"] == 128
    assert m.model_dump() == live.client.models.list().data[0].model_dump()


@pytest.mark.parametrize("name", ["gpt-4", "org/tiny-qwen"])
def test_models_retrieve_of_another_model_is_a_404_model_not_found(live, name):
    r = live.http.get(f"/v1/models/{name}")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"The model '{name}' does not exist; this server serves '{NAME}'",
                                  "type": "invalid_request_error", "param": None, "code": "model_not_found"}}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.client.models.retrieve(name)


def test_openapi_documents_the_bodies_the_handlers_parse_themselves(live):
    """The generation endpoints read their bodies raw (parsed off the event loop), yet
    /openapi.json (and /docs) still show their request schemas, every $ref resolving."""
    r = live.http.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    schemas = doc["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        prefix = "#/components/schemas/"
        assert schema["$ref"].startswith(prefix), schema
        return schemas[schema["$ref"][len(prefix):]]

    for path, fields in [("/v1/chat/completions", ("model", "messages", "max_tokens", "max_completion_tokens",
                                                   "stream", "stop", "tools")),
                         ("/v1/completions", ("model", "prompt", "max_tokens", "logprobs", "stream", "stop"))]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        schema = resolve(body["content"]["application/json"]["schema"])
        assert set(fields) <= set(schema["properties"]), (path, sorted(schema["properties"]))
        assert "model" in schema["required"]
    assert set(resolve({"$ref": "#/components/schemas/ChatCompletionRequest"})["required"]) >= {"messages"}
    assert set(resolve({"$ref": "#/components/schemas/CompletionRequest"})["required"]) >= {"prompt"}
    assert "role" in schemas["ChatMessage"]["properties"]
    assert "checkpoint" in resolve(doc["paths"]["/v1/weights"]["post"]["requestBody"]["content"]
                                   ["application/json"]["schema"])["properties"]

    def refs(x):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from [v] if k == "$ref" else refs(v)
        elif isinstance(x, list):
            for v in x:
                yield from refs(v)
    for ref in set(refs(doc)):
        resolve({"$ref": ref})
    assert live.http.get("/docs").status_code == 200


@pytest.mark.parametrize("prompt,got", [(5, "5"), (1.5, "1.5"), (True, "True"), ({"text": "hi"}, "an object"),
                                        (["hi", 3], "3 at prompt[1]"), ([[1, 2], [3, "x"]], "'x' at prompt[1][1]"),
                                        ([1, 2.0], "2.0 at prompt[1]"), ([[1], 2], "2 at prompt[1]"),
                                        ([None], "None at prompt[0]")])
def test_a_prompt_of_another_type_is_a_400_naming_prompt_and_the_accepted_types(live, prompt, got):
    r = live.http.post("/v1/completions", json={**COMP, "prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "prompt: must be a string, a list of strings, a list of token ids (integers) or a list of "
                   f"lists of token ids, got {got}", "type": "invalid_request_error", "param": "prompt", "code": None}


def test_a_body_that_is_not_utf8_is_a_400_saying_so(live):
    body = b'{"model": "%s", "prompt": "caf\xe9"}' % NAME.encode()  # Latin-1, not UTF-8
    r = live.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": "the body is not valid UTF-8 JSON: byte 0xe9 at offset 37 (invalid "
                                             "continuation byte)", "type": "invalid_request_error", "param": None,
                                  "code": None}}
    assert body.index(b"\xe9") == 37


def test_malformed_json_is_a_400_saying_what_is_wrong_and_where(live):
    # the message was "the body is not valid JSON (JSON decode error)": nothing on what or where
    body = b'{"model": "%s", "prompt": "hi",}' % NAME.encode()  # a trailing comma
    r = live.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": "the body is not valid JSON: Expecting property name enclosed in double "
                                             "quotes at line 1 column 39 (char 38)", "type": "invalid_request_error",
                                  "param": None, "code": None}}
    assert body.index(b"}") == 38


@pytest.mark.parametrize("depth", [3_000, 100_000], ids=["small body", "large body, on the pool"])
def test_a_body_nested_too_deeply_is_a_400_saying_so(live, depth):
    # json.loads' RecursionError was answered "There was an error parsing the body"
    body = b'{"model": "%s", "prompt": "hi", "user": %s%s}' % (NAME.encode(), b"[" * depth, b"]" * depth)
    assert (len(body) > live.server.offload_bytes) == (depth > 3_000)
    r = live.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("the body is nested too deeply to parse (maximum recursion depth exceeded")
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, None)


@pytest.mark.parametrize("large", [False, True], ids=["small body", "large body, on the pool"])
def test_a_server_bug_is_a_500_error_object_and_the_server_goes_on(live_in_thread, monkeypatch, large):
    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(live_in_thread.server.tokenizer, "encode", broken)
    pad = {"user": "u" * live_in_thread.server.offload_bytes} if large else {}
    r = live_in_thread.http.post("/v1/completions", json={**COMP, "max_tokens": 1, **pad})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error: RuntimeError: tokenizer exploded",
                                  "type": "server_error", "param": None, "code": None}}
    monkeypatch.undo()
    assert live_in_thread.http.post("/v1/completions", json={**COMP, "max_tokens": 1}).status_code == 200


def test_a_server_bug_in_a_stream_is_an_error_event_and_the_stream_ends(live_in_thread, monkeypatch):
    # the choice's task died with the exception and the stream waited for it forever (the
    # client until its timeout: the openai client's is 10 minutes)
    def broken(*args, **kwargs):
        raise RuntimeError("decode exploded")

    monkeypatch.setattr(live_in_thread.server.tokenizer, "decode", broken)
    with live_in_thread.http.stream("POST", "/v1/completions", json={**COMP, "max_tokens": 3, "stream": True},
                                    timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200
    assert [json.loads(line.removeprefix("data: ")) for line in lines[:-1]] == [
        {"error": {"message": "internal server error: RuntimeError: decode exploded", "type": "server_error",
                   "param": None, "code": None}}]
    assert lines[-1] == "data: [DONE]"
    monkeypatch.undo()
    assert live_in_thread.http.post("/v1/completions", json={**COMP, "max_tokens": 1}).status_code == 200
    settle(live_in_thread)


class BlockingEncode:
    """The server's tokenizer's `encode`, held at a text holding "BLOCK" until `release`
    is set (`entered` says it got there): a large prompt being tokenized, for as long as a
    test needs."""

    def __init__(self, server, monkeypatch) -> None:
        self.encode = server.tokenizer.encode
        self.entered, self.release = threading.Event(), threading.Event()
        monkeypatch.setattr(server.tokenizer, "encode", self)

    def __call__(self, text, **kwargs):
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(120)
        return self.encode(text, **kwargs)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_other_clients_are_answered_while_a_large_prompt_is_tokenized(live, monkeypatch, chat):
    # a request whose body is past offload_bytes is parsed and tokenized on a thread: the
    # event loop goes on serving everyone else meanwhile (it held them all before)
    blocking = BlockingEncode(live.server, monkeypatch)
    fixed = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    path, prompt = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "BLOCK the cat"}]}) if chat
                    else ("/v1/completions", {"prompt": "BLOCK the cat"}))
    body = {"model": NAME, **prompt, **fixed, "user": "u" * live.server.offload_bytes}
    assert len(json.dumps(body)) > live.server.offload_bytes
    with httpx.Client(base_url=live.url, timeout=120) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(http.post, path, json=body)
        assert blocking.entered.wait(120)  # the server is tokenizing it now, and stays there
        assert live.http.get("/v1/models").json()["data"][0]["id"] == NAME
        small = live.client.completions.create(model=NAME, prompt="the mat", max_tokens=3,
                                               extra_body={"ignore_eos": True})
        assert small.usage.completion_tokens == 3
        chunks = [c.choices[0].text for c in live.client.completions.create(
            model=NAME, prompt="the mat", max_tokens=3, stream=True, extra_body={"ignore_eos": True}) if c.choices]
        assert len(chunks) >= 1
        assert not big.done()
        blocking.release.set()
        r = big.result(120)
    assert r.status_code == 200, r.text
    plain = live.http.post(path, json={"model": NAME, **prompt, **fixed})  # the same request, small
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (plain.json()["usage"]["prompt_tokens"], 4)
    key = "message" if chat else "text"
    assert r.json()["choices"][0][key] == plain.json()["choices"][0][key]


def test_a_client_leaving_while_its_large_prompt_is_tokenized_sends_nothing_to_the_engine(live, monkeypatch):
    blocking = BlockingEncode(live.server, monkeypatch)
    before = settle(live)["engine"]["generated_tokens"]
    connections = live.uv.server_state.connections
    others = set(connections)
    body = json.dumps({**COMP, "prompt": "BLOCK", "max_tokens": 4, "ignore_eos": True,
                       "user": "u" * live.server.offload_bytes}).encode()
    with socket.create_connection((live.host, live.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert blocking.entered.wait(120)
        mine = set(connections) - others
        assert mine
    while mine & set(connections):  # the server has seen the client go (uvicorn's connection_lost)
        time.sleep(0.01)
    health(live)  # and the event loop has run on since
    blocking.release.set()
    h = settle(live)
    assert h["engine"]["generated_tokens"] == before and h["outstanding_requests"] == 0


LIMIT = 8 * 2**20  # --max-request-mb 8, the default


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(live):
    big = json.dumps({**COMP, "prompt": "a" * LIMIT}).encode()
    r = live.http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json() == {"error": {"message": f"the request body is {len(big)} bytes, more than this server accepts "
                                             f"({LIMIT} bytes: --max-request-mb 8)", "type": "invalid_request_error",
                                  "param": None, "code": "request_too_large"}}
    assert health(live)["outstanding_requests"] == 0


def test_a_chunked_body_over_the_limit_is_a_413(live):
    def chunks():
        yield b'{"model": "%s", "prompt": "' % NAME.encode()
        for _ in range(9):
            yield b"a" * 2**20
        yield b'"}'

    r = live.http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == (f"the request body is over {LIMIT} bytes, more than this server "
                                            "accepts (8388608 bytes: --max-request-mb 8)")
    ok = json.dumps({**COMP, "max_tokens": 1, "user": "u" * (LIMIT - 1000)}).encode()  # under it: served
    assert live.http.post("/v1/completions", content=ok, headers={"Content-Type": "application/json"}).status_code == 200


def test_a_stop_that_is_not_strings_is_named_as_stop(live):
    r = live.http.post("/v1/completions", json={**COMP, "stop": [1]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "stop: must be a string or a list of strings"



@pytest.mark.parametrize("key", ["template", "add_generation_prompt", "eos_token"])
def test_template_kwargs_cannot_replace_the_servers_own_template_arguments(live, key):
    r = live.http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {key: "{{ 'x' }}"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert r.json()["error"]["message"] == (
        f"chat_template_kwargs: {key} cannot be set here (the server sets add_generation_prompt, bos_token, "
        "eos_token, messages, template, tools itself; tools go in `tools`)")

def test_bad_input_through_the_client_and_the_server_lives_on(live):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        live.client.completions.create(model=NAME, prompt="x", temperature=-1)
    r = live.http.post("/v1/nothing", json={})
    assert r.status_code == 404 and "error" in r.json()
    assert settle(live)["status"] == "ok"


def test_a_client_leaving_a_plain_answer_leaves_no_unretrieved_error_in_the_log():
    from jrl.serve.app import _GONE, _wait_or_disconnect

    class Gone:  # the client has hung up
        async def receive(self):
            return {"type": "http.disconnect"}

    async def forever():
        await asyncio.Event().wait()

    logged = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: logged.append(context["message"]))
        out = await _wait_or_disconnect(Gone(), asyncio.gather(forever(), forever()))
        for _ in range(3):  # the cancelled coroutines end, then the gather
            await asyncio.sleep(0)
        gc.collect()  # an exception nobody read is logged when its future is collected
        return out

    assert asyncio.run(main()) is _GONE
    assert logged == []


def test_engine_abort_frees_pages_and_keeps_the_others(live_in_thread):
    served = live_in_thread.server.served
    engine = Engine(served.model_config, served.params, live_in_thread.server.engine.config)  # same programs: compiled
    total = engine.pool.allocator.n_available
    keep = engine.add_request([1, 2, 3], SamplingParams(seed=1), max_new_tokens=12)
    gone = engine.add_request(list(range(4, 30)), SamplingParams(seed=2), max_new_tokens=40)
    queued = engine.add_request([9, 9], SamplingParams(seed=3), max_new_tokens=4)
    for _ in range(3):
        engine.step()
    assert engine.abort(gone) and engine.abort(queued)
    assert not engine.abort(gone) and not engine.abort(12345)
    done = engine.run()
    assert [c.request_id for c in done] == [keep] and len(done[0].tokens) == 12
    assert engine.pool.allocator.n_available == total


def test_weights_admin_updates_the_served_version(live, hf_dirs):
    url = "/v1/weights"
    body = {"checkpoint": f"hf:{hf_dirs[1]}", "version": 3}
    assert live.http.post(url, json=body).status_code == 401
    assert live.http.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = live.http.post(url, json={"checkpoint": "/no/such/dir"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "checkpoint"
    assert bad.json()["error"]["message"].startswith("checkpoint: /no/such/dir does not exist")
    kw = dict(model=NAME, prompt="the cat", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    old = live.client.completions.create(**kw)
    r = live.http.post(url, json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["policy_version"] == 3 and r.json()["object"] == "weights.update"
    new = live.client.completions.create(**kw)
    assert new.choices[0].model_extra["jrl"] == {"policy_version": 3}
    assert old.choices[0].model_extra["jrl"] == {"policy_version": 0}
    assert new.choices[0].text != old.choices[0].text  # other weights
    assert live.client.models.list().data[0].model_extra["jrl"]["policy_version"] == 3
    again = live.http.post(url, json=body, headers=auth)  # loaded anew: other weights for version 3
    assert again.status_code == 400 and again.json()["error"]["param"] == "version"
    back = live.http.post(url, json={"checkpoint": f"hf:{hf_dirs[0]}", "version": 2}, headers=auth)
    assert back.status_code == 400 and back.json()["error"]["param"] == "version"  # versions never go back


def test_a_weights_version_beyond_int64_is_a_400_naming_version_and_the_server_goes_on(live, hf_dirs):
    # it was accepted, and every request after it failed in the engine step (its completion
    # records versions as int64: OverflowError), until the engine loop gave up
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = live.http.post("/v1/weights", json={"checkpoint": f"hf:{hf_dirs[1]}", "version": 2**63}, headers=auth)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "version: must be below 2**63 (completions record versions as int64), "
                                            "got 9223372036854775808", "type": "invalid_request_error",
                                 "param": "version", "code": None}
    ok = live.http.post("/v1/completions", json={**COMP, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["jrl"]["policy_version"] == live.server.engine.version < 2**63


def test_weights_endpoint_is_off_without_a_token(hf_dirs):
    _, app = build(build_parser().parse_args(["--model", f"hf:{hf_dirs[0]}", "--engine-in-process", "--no-warmup",
                                              *ENGINE_FLAGS]))

    with TestClient(app) as client:
        r = client.post("/v1/weights", json={"checkpoint": f"hf:{hf_dirs[1]}"})
        assert r.status_code == 404


@pytest.mark.parametrize("kind", ["jrl", "hf"])
def test_weights_of_another_architecture_are_refused_naming_what_differs(hf_dirs, tmp_path, kind):
    # a jrl checkpoint was refused with the trainer's advice ("init_from: ... set these
    # under model:"), which a server cannot follow
    other = from_dict(ModelConfig, {**MODEL, "n_layers": 1, "rope_theta": 500000.0})
    params = jax.jit(init_params, static_argnums=0)(other, jax.random.key(0))
    if kind == "jrl":
        spec = str(tmp_path / "run" / "checkpoints")
        checkpoint.save(spec, 1, {"params": params, "policy_version": 1}, meta={"config": {"model": to_dict(other)}})
    else:
        save_pretrained(other, params, str(tmp_path / "hf"), model_type="qwen2")
        spec = f"hf:{tmp_path / 'hf'}"
    _, app = build(build_parser().parse_args(["--model", f"hf:{hf_dirs[0]}", "--engine-in-process", "--no-warmup",
                                              "--admin-token", TOKEN, *ENGINE_FLAGS]))
    with TestClient(app) as client:
        r = client.post("/v1/weights", json={"checkpoint": spec}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "checkpoint"
    assert r.json()["error"]["message"] == (
        f"checkpoint: {spec} is another architecture than the served model: n_layers (served 2, checkpoint 1); "
        f"rope_theta (served 10000.0, checkpoint 500000.0); the server serves the architecture it was started "
        f"with (start another server to serve this one)")


def test_weights_from_a_corrupt_checkpoint_are_refused_naming_the_field_that_gave_them(hf_dirs, tmp_path):
    # before: "checkpoint: init_from: ...", a config key the request never set
    step_dir = a_corrupt_checkpoint(tmp_path / "run")
    _, app = build(build_parser().parse_args(["--model", f"hf:{hf_dirs[0]}", "--engine-in-process", "--no-warmup",
                                              "--admin-token", TOKEN, *ENGINE_FLAGS]))
    with TestClient(app) as client:
        r = client.post("/v1/weights", json={"checkpoint": str(step_dir)}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "checkpoint")
    assert r.json()["error"]["message"] == corrupt_error("checkpoint", step_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests_and_exits_0(hf_dirs):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "jrl.serve", "--model", f"hf:{hf_dirs[0]}", "--port", str(port),
                             "--served-model-name", NAME, "--shutdown-timeout", "60", *ENGINE_FLAGS],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        body = {"model": NAME, "prompt": "the", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the request in flight finished
        chunks = [json.loads(x[6:]) for x in [first, *rest[:-1]]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_requests_still_running_at_the_shutdown_timeout_end_with_a_503_error(hf_dirs):
    server, app = build(build_parser().parse_args(["--model", f"hf:{hf_dirs[0]}", "--served-model-name", NAME,
                                                   *ENGINE_FLAGS]))
    thread = ServerThread(server, app, shutdown_timeout=0.5).__enter__()
    engine_pid = server.worker.pid
    os.kill(engine_pid, signal.SIGSTOP)  # nothing finishes before the shutdown timeout
    body = {"model": NAME, "prompt": "the", "max_tokens": 40, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # two clients and the shutdown
        try:
            plain = pool.submit(httpx.post, thread.url + "/v1/completions", json=body, timeout=60)

            def stream() -> list[str]:
                with httpx.stream("POST", thread.url + "/v1/completions", json={**body, "stream": True},
                                  timeout=60) as r:
                    return [line for line in r.iter_lines() if line]

            streamed = pool.submit(stream)
            while server.outstanding < 2:  # both submitted to the engine
                time.sleep(0.01)
            stopping = pool.submit(thread.__exit__, None, None, None)
            message = "the server is shutting down: the request did not finish within --shutdown-timeout (0.5 s)"
            r = plain.result()
            assert r.status_code == 503
            assert r.json() == {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
            assert streamed.result() == [f"data: {json.dumps({'error': r.json()['error']})}", "data: [DONE]"]
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        stopping.result()
    assert not server.worker.alive


def test_a_start_up_error_in_the_engine_process_exits_2_naming_the_flag(hf_dirs, capsys):
    # the engine process loads and sizes the engine; its error is the server's, before it listens
    assert main(["--model", f"hf:{hf_dirs[0]}", "--max-seq-len", "4096", "--no-warmup"]) == 2
    assert capsys.readouterr().err == ("config error: --max-seq-len: must be <= the model's "
                                       "max_position_embeddings (128), got 4096\n")


def a_corrupt_checkpoint(root: Path) -> Path:
    """The step directory of a run (`write_run`) in `root`, its manifest.json gone (an
    interrupted copy)."""
    step_dir = write_run(root, {}) / "step_1"
    (step_dir / "manifest.json").unlink()
    return step_dir


def corrupt_error(named_by: str, step_dir: Path) -> str:
    """The error of loading `a_corrupt_checkpoint` given by `named_by`."""
    return (f"{named_by}: {str(step_dir)!r}: checkpoint {step_dir} is corrupt: manifest.json: missing (jrl writes it "
            f"last; an interrupted copy?)")


def test_a_corrupt_checkpoint_exits_2_naming_the_flag_that_gave_it(tmp_path, capsys):
    # before: "config error: init_from: ...", a config key jrl serve has not
    step_dir = a_corrupt_checkpoint(tmp_path / "run")
    assert main(["--checkpoint", str(step_dir), "--port", "0", "--engine-in-process", "--no-warmup",
                 *ENGINE_FLAGS]) == 2
    assert capsys.readouterr().err == f"config error: {corrupt_error('--checkpoint', step_dir)}\n"


def test_a_port_in_use_exits_2_naming_the_flag_before_the_model_loads(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model directory does not exist: the port is checked first, before anything loads
        assert main(["--model", f"hf:{tmp_path / 'missing'}", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (f"config error: --host / --port: cannot listen on 127.0.0.1:{port} (Address "
                                       f"already in use); another server there? pick another --port\n")


def test_a_port_out_of_range_exits_2_naming_the_flag(tmp_path, capsys):
    # bind() raises OverflowError, not OSError: it was a traceback and exit status 1
    assert main(["--model", f"hf:{tmp_path / 'missing'}", "--port", "70000"]) == 2
    assert capsys.readouterr().err == ("config error: --host / --port: cannot listen on 127.0.0.1:70000 (bind(): port "
                                       "must be 0-65535.); pick a port in 0-65535\n")


def test_a_killed_engine_process_fails_its_requests_with_503_and_health_says_so(hf_dirs):
    for live in serve(["--model", f"hf:{hf_dirs[0]}", "--served-model-name", NAME, "--no-warmup", *ENGINE_FLAGS]):
        pid = live.server.engine.pid
        os.kill(pid, signal.SIGSTOP)  # the request below stays in flight until the engine dies
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(live.http.post, "/v1/completions", json={"model": NAME, "prompt": "the",
                                                                           "max_tokens": 20})
            while health(live)["outstanding_requests"] == 0:
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            r = pending.result(timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["message"] == ("the engine process exited (exit code -9); this server cannot "
                                                "generate any more: restart it")
        h = live.http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "unavailable"
        r = live.http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is not running"


def test_the_server_process_never_initialises_a_jax_backend(hf_dirs):
    # the engine process owns the accelerator; the HTTP process only tokenizes and serves
    code = f"""
import httpx, jax._src.xla_bridge as xla_bridge
from jrl.serve.cli import ServerThread, build, build_parser
server, app = build(build_parser().parse_args({["--model", f"hf:{hf_dirs[0]}", "--no-warmup", *ENGINE_FLAGS]!r}))
with ServerThread(server, app) as thread:
    r = httpx.post(thread.url + "/v1/completions", timeout=120,
                   json={{"model": server.served.name, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}})
    print(r.json()["usage"]["completion_tokens"], server.served.params, sorted(xla_bridge._backends))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "3 None []"


@pytest.mark.parametrize("argv,message", [
    # 0 (or less) started a server that answered every request with a 413
    (["--max-request-mb", "0"], r"--max-request-mb: must be a finite number > 0 MiB, got 0.0"),
    # -1 started a server whose shutdown killed the engine process at once ("did not stop within -1 s")
    (["--shutdown-timeout", "-1"], r"--shutdown-timeout: must be a finite number >= 0 seconds, got -1.0"),
    # `--max-seq-len 0` was read as "not given": the server quietly served the model's 128
    (["--max-seq-len", "0"], r"--max-seq-len: must be >= 1, got 0"),
    # inf passed the check, then the app's body limit failed to build: an OverflowError traceback, exit 1
    (["--max-request-mb", "inf"], r"--max-request-mb: must be a finite number > 0 MiB, got inf"),
    # inf started a server whose shutdown failed with an OverflowError ("timestamp out of range")
    (["--shutdown-timeout", "inf"], r"--shutdown-timeout: must be a finite number >= 0 seconds, got inf"),
], ids=["max-request-mb", "shutdown-timeout", "max-seq-len", "max-request-mb-inf", "shutdown-timeout-inf"])
def test_a_flag_value_the_server_cannot_run_with_is_a_startup_error_naming_the_flag(hf_dirs, argv, message):
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    with pytest.raises(ConfigError, match=f"^{message}$"):
        engine_config(served, build_parser().parse_args(argv))


def test_bench_serve_tiny(tmp_path, hf_dirs):
    path = tmp_path / "rows.jsonl"
    assert bench(["serve", "--tiny", "--json", str(path), "--model", f"hf:{hf_dirs[0]}", "--concurrency", "1,4",
                  "--requests", "8", "--prompt", "8", "--new", "4", "--clients", "2",
                  "--switch-interval-ms", "5,0.2", *ENGINE_FLAGS]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    (warm,) = [r for r in rows if r["section"] == "warmup"]
    assert warm["programs"] > 0 and warm["max_seq_len"] == 128
    for section in ("http", "engine"):
        mine = [r for r in rows if r["section"] == section]
        assert [r["concurrency"] for r in mine] == ([1, 1, 4, 4] if section == "http" else [1, 4])
        for r in mine:
            assert r["requests"] == 8 and r["output_tokens"] == 32
            assert r["compiled_while_timed"] == 0  # the warm-up compiled every program the rounds use
            assert all(np.isfinite(r[k]) and r[k] > 0 for k in ("requests_per_s", "output_tokens_per_s"))
    assert all(r["worker_step_s"] > 0 and r["worker_host_s"] > 0 and r["http_cpu_s"] > 0
               for r in rows if r["section"] == "http")
    assert [(r["clients"], r["switch_interval_ms"]) for r in rows if r["section"] == "http"] == [
        (1, 5.0), (1, 0.2), (2, 5.0), (2, 0.2)]
    assert all(r["engine_process"] for r in rows)  # as `jrl serve` runs it


def test_bench_serve_leaves_the_accelerator_to_the_engine_process(tmp_path, hf_dirs):
    # a backend in the bench's own process would be a second device context beside the engine's
    path = tmp_path / "rows.jsonl"
    argv = ["serve", "--tiny", "--json", str(path), "--model", f"hf:{hf_dirs[0]}", "--concurrency", "2",
            "--requests", "4", "--prompt", "8", "--new", "4", "--clients", "1", *ENGINE_FLAGS]
    code = f"""
import jax._src.xla_bridge as xla_bridge
from jrl.bench.cli import main
print(main({argv!r}), sorted(xla_bridge._backends))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "0 []"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["device"] for r in rows} == {f"cpu ({jax.devices()[0].device_kind})"}  # named by the engine's process


def test_bench_serve_tiny_with_the_engine_on_a_thread(tmp_path, hf_dirs):
    path = tmp_path / "rows.jsonl"
    assert bench(["serve", "--tiny", "--json", str(path), "--model", f"hf:{hf_dirs[0]}", "--concurrency", "2",
                  "--requests", "4", "--prompt", "8", "--new", "4", "--clients", "1", "--engine-in-process",
                  *ENGINE_FLAGS]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["section"] for r in rows] == ["warmup", "http", "engine"]
    assert all(r["engine_process"] is False for r in rows)
    assert rows[0]["programs"] > 0 and [r["output_tokens"] for r in rows[1:]] == [16, 16]
    assert rows[1]["worker_step_s"] > 0 and rows[2]["steps"] > 0


def test_the_load_is_dealt_over_client_processes_without_loss():
    prompts = [[k] for k in range(10)]
    shares = split_load(prompts, concurrency=7, processes=3)
    assert [in_flight for _, in_flight in shares] == [3, 2, 2]
    assert sorted(k for share, _ in shares for k, _ in share) == list(range(10))
    assert [p for share, _ in shares for k, p in share if k == 4] == [[4]]
    assert [in_flight for _, in_flight in split_load(prompts, concurrency=1, processes=3)] == [1]


def test_the_default_kv_pool_shrinks_to_the_free_device_memory(hf_dirs, caplog):
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    per_page = 16 * kv_bytes_per_token(served.model_config)
    assert per_page == 2 * 2 * 16 * 1 * 16 * 4  # keys and values x 2 layers x 16 tokens x 1 head x 16 dims, f32
    args = build_parser().parse_args(["--max-batch", "16", "--max-seq-len", "128"])
    assert engine_config(served, args).n_pages == 256  # no memory figure (the CPU): 16 x 8 pages + 8, pow2
    free = int(100 * per_page / KV_MEMORY_FRACTION) + 1  # room for 100 pages
    with caplog.at_level("WARNING", logger="jrl.serve"):
        assert engine_config(served, args, free).n_pages == 100
    assert "KV pool capped at 100 pages" in caplog.text and "--n-pages or --max-seq-len" in caplog.text
    assert engine_config(served, args, 10 * free).n_pages == 256  # fits: as sized


@pytest.mark.parametrize("field,flag", [("max_seq_len", "--max-seq-len"), ("max_batch", "--max-batch"),
                                        ("page_size", "--page-size"),
                                        ("n_pages", "--n-pages"), ("max_tokens_per_step", "--max-tokens-per-step"),
                                        ("seed", "--seed")])
def test_a_field_with_a_flag_of_its_own_in_the_engine_json_is_a_config_error_naming_its_flag(hf_dirs, field, flag):
    # {"max_batch": 64} with --max-batch 4 ran 64 rows over a KV pool (and token budget) sized
    # for 4; --n-pages and --max-tokens-per-step quietly beat the JSON, which beat the others;
    # max_seq_len reached engine_config_for_workload twice (a TypeError traceback, exit status 1)
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    with pytest.raises(ConfigError, match=rf"^--engine: {field} is set with {flag} \({flag} 64\)$"):
        engine_config(served, build_parser().parse_args(["--max-batch", "4", "--max-seq-len", "128",
                                                         "--engine", json.dumps({field: 64})]))


@pytest.mark.parametrize("flags,message", [
    (["--engine", '{"kv_dtyp": "float8_e4m3fn"}'], "unknown key(s) --engine kv_dtyp; allowed: "),
    (["--engine", '{"kv_dtype": "int3"}'], "--engine kv_dtype: must be null"),
    (["--page-size", "0"], "--page-size: must be a positive integer, got 0"),
])
def test_an_engine_setting_error_names_the_flag_or_the_engine_json_field_it_came_from(hf_dirs, flags, message):
    # they named engine.<field>, a key the server's command line has nowhere
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    with pytest.raises(ConfigError) as caught:
        engine_config(served, build_parser().parse_args(["--max-batch", "4", "--max-seq-len", "128", *flags]))
    assert str(caught.value).startswith(message) and "engine." not in str(caught.value)


def test_an_fp8_kv_cache_gets_32_token_pages_unless_the_page_size_is_given(hf_dirs):
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    fp8 = ["--max-batch", "4", "--max-seq-len", "128", "--engine", '{"kv_dtype": "float8_e4m3fn"}']
    assert engine_config(served, build_parser().parse_args(fp8)).page_size == 32
    assert engine_config(served, build_parser().parse_args([*fp8, "--page-size", "64"])).page_size == 64
    assert engine_config(served, build_parser().parse_args(fp8[:4])).page_size == 16


def test_a_kv_pool_that_cannot_fit_is_a_startup_error_naming_the_flag(hf_dirs):
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    free = int(100 * 16 * kv_bytes_per_token(served.model_config) / KV_MEMORY_FRACTION) + 1
    chosen = build_parser().parse_args(["--max-batch", "16", "--max-seq-len", "128", "--n-pages", "256"])
    with pytest.raises(ConfigError, match=r"^--n-pages: 256 KV pages .* hold 100 pages"):
        engine_config(served, chosen, free)
    default = build_parser().parse_args(["--max-batch", "16", "--max-seq-len", "128"])
    with pytest.raises(ConfigError, match=r"^--max-seq-len: one request of 128 tokens needs 8 KV pages"):
        engine_config(served, default, free // 20)  # 5 pages


def test_an_n_pages_below_one_request_of_max_seq_len_is_a_startup_error_naming_the_flag(hf_dirs):
    # 4 pages of 16 hold 64 tokens: a chat request without max_tokens (the rest of the 128-token
    # context) would be refused for a max_tokens the client never sent, and max_model_len would lie
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    small = build_parser().parse_args(["--max-batch", "4", "--max-seq-len", "128", "--n-pages", "4"])
    with pytest.raises(ConfigError, match=r"^--n-pages: 4 KV pages of 16 tokens hold 64 tokens; one request of "
                                          r"--max-seq-len 128 needs 8 pages: raise --n-pages or lower --max-seq-len$"):
        engine_config(served, small)
    enough = build_parser().parse_args(["--max-batch", "4", "--max-seq-len", "128", "--n-pages", "8"])
    assert engine_config(served, enough).n_pages == 8


def test_a_jrl_checkpoint_serves_with_its_run_config_tokenizer_and_version(tmp_path):
    run = tmp_path / "myrun"
    model = {**MODEL, "vocab_size": 262}  # the byte tokenizer's vocabulary
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(json.dumps({"name": "myrun", "model": model,
                                                 "data": {"tokenizer": "bytes", "seq_len": 64}}))
    config = from_dict(ModelConfig, model)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(4))
    checkpoint.save(run / "checkpoints", 5, {"params": params}, meta={"policy_version": 7})
    served = load_served(checkpoint=str(run / "checkpoints"))
    assert (served.name, served.version, served.tokenizer.vocab_size) == ("myrun", 7, 262)
    assert served.model_config.vocab_size == 262
    assert params_equal(jax.device_get(served.params), jax.device_get(params))
    step = load_served(checkpoint=str(run / "checkpoints" / "step_5"), name="other")
    assert (step.name, step.version) == ("other", 7)
    with pytest.raises(ConfigError, match="--model"):
        load_served(model=str(run))
    with pytest.raises(ConfigError, match=r"^--model: \S+nothing does not exist \(hf:<dir> names"):
        load_served(model=f"hf:{tmp_path / 'nothing'}")
    with pytest.raises(ConfigError, match=r"^--checkpoint: \S+nothing does not exist \(give a run directory"):
        load_served(checkpoint=str(tmp_path / "nothing"))


def test_a_hf_directory_without_a_tokenizer_asks_for_one(tmp_path):
    # what jrl.hf.save_pretrained exports: weights and config.json, no tokenizer
    config = from_dict(ModelConfig, {**MODEL, "vocab_size": 262})
    save_pretrained(config, jax.device_get(init_params(config, jax.random.key(0))), tmp_path / "export")
    with pytest.raises(ConfigError) as e:
        load_served(model=f"hf:{tmp_path / 'export'}")
    assert str(e.value) == (f"--model: {tmp_path / 'export'} has no tokenizer.json; pass --tokenizer (bytes, a "
                            "tokenizer.json or a directory) or copy the model's tokenizer files there")
    served = load_served(model=f"hf:{tmp_path / 'export'}", tokenizer="bytes")
    assert served.tokenizer.vocab_size == 262


def test_overrides_without_a_run_config_to_override_are_a_config_error(hf_dirs):
    # `jrl serve --model hf:<dir> data.tokenizer=...` started a server that had dropped them
    with pytest.raises(ConfigError) as e:
        load_served(model=f"hf:{hf_dirs[0]}", overrides=["data.tokenizer=bytes", "model.dtype=bfloat16"])
    assert str(e.value) == ("key=value overrides: data.tokenizer=bytes, model.dtype=bfloat16 override a run config "
                            "(--checkpoint, or --config with --model), and --model without --config reads none; "
                            "give --config, or the flags --tokenizer / --dtype")


def test_model_naming_config_json_asks_for_its_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_served(model=f"hf:{tmp_path / 'config.json'}")
    assert str(e.value) == (f"--model: {tmp_path / 'config.json'} is a file; "
                            "hf:<dir> names the directory that holds config.json")


def test_text_stream_holds_back_possible_stop_strings_and_whole_characters():
    tok = ByteTokenizer()
    ids = tok.encode("héllo <<END>> world")
    s = TextStream(tok, stop=["<<END>>"], skip_ids=[tok.eos_id])
    shown = []
    for i in ids:
        s.add([i])
        shown.append(s.emit())
    assert "".join(shown) + s.emit(final=True) == "héllo "
    assert s.cut and "\ufffd" not in "".join(shown)
    assert s.kept_tokens() == len(tok.encode("héllo "))
    # the end-of-turn id ends the text; nothing after it is shown
    s = TextStream(tok, skip_ids=[tok.eos_id])
    s.add(tok.encode("ab") + [tok.eos_id] + tok.encode("cd"))
    assert s.emit(final=True) == "ab" and s.stopped and not s.cut


def test_a_stop_string_completed_by_the_flush_at_an_end_of_turn_token_cuts_the_text():
    # an end-of-turn token after an incomplete character flushes it (as U+FFFD); the stop
    # strings were not looked for in that flush, as they are in the one at max_tokens (finish)
    tok = ByteTokenizer()
    s = TextStream(tok, stop=["\ufffd"], skip_ids=[tok.eos_id])
    s.add(tok.encode("ok") + tok.encode("é")[:1] + [tok.eos_id])
    assert (s.emit(final=True), s.cut, s.stopped) == ("ok", True, True)


def write_byte_fallback_tokenizer(path: Path) -> Path:
    """A SentencePiece-style (Llama 2) tokenizer: `▁` pieces, byte pieces `<0xNN>` for what
    the vocabulary lacks, and Llama's decoder, which decodes a run of byte pieces together
    (each byte of an invalid run becomes U+FFFD)."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", "a", "▁a", "▁the", "cat"]:
        vocab[piece] = len(vocab)
    raw = RawTokenizer(tok_models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.add_special_tokens(["</s>"])
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def test_a_token_that_changes_the_decode_of_the_tokens_before_it_is_not_sent_twice(tmp_path):
    """A byte piece after "é"'s two makes the decoder turn the whole run of bytes into
    U+FFFDs: decode(window + new) no longer starts with decode(window), and the stream
    appended all of it, sending the window's text again ("the cat écat ..."). Only what
    follows the text the two decodes share is added."""
    tok = load_tokenizer(str(write_byte_fallback_tokenizer(tmp_path / "tok")))
    ids = tok.encode("the cat é") + [2 + 0xA9] + tok.encode("a")  # a stray continuation byte, then " a"
    s = TextStream(tok)
    shown = []
    for i in ids:
        s.add([i])
        shown.append(s.emit())
    shown.append(s.emit(final=True))
    assert "".join(shown) == s.text == "the cat é\ufffd\ufffd\ufffd a"
    assert decode(tok, ids) == "the cat \ufffd\ufffd\ufffd a"  # the decoder's own text of all the tokens


@pytest.mark.parametrize("kind", ["bytes", "byte-level BPE"])
def test_chat_logprob_bytes_of_tokens_splitting_a_character_join_to_it(kind, tmp_path):
    """`bytes` was the UTF-8 of each token decoded alone: U+FFFD's three bytes for every
    token holding part of a multi-byte character, so a client could not rebuild "é" from
    its tokens. As in OpenAI's API they are the token's own bytes."""
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok")))
    text = "é€ cat 😀"
    ids = tok.encode(text)
    content = chat_logprobs(tok, [(i, -1.0, 0) for i in ids])["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode("utf-8")
    assert content[0]["bytes"] == [0xC3]  # the first byte of "é" alone


@pytest.mark.parametrize("kind", ["bytes", "byte-level BPE"])
def test_a_token_holding_part_of_a_character_is_written_by_its_bytes_as_openai_does(kind, tmp_path):
    """Such a token's string was U+FFFD, the same for every piece of every character. OpenAI
    writes it as `bytes:` and its bytes escaped (`bytes:\\xc3`), in both endpoints."""
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok")))
    ids = tok.encode("é a")
    entries = [(i, -1.0, 0) for i in ids]
    want = ["bytes:\\xc3", "bytes:\\xa9"] + [tok.decode([i]) for i in ids[2:]]
    assert [e["token"] for e in chat_logprobs(tok, entries)["content"]] == want
    assert completion_logprobs(tok, entries)["tokens"] == want


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(live_in_thread, monkeypatch):
    live = live_in_thread
    engine = live.server.engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    r = live.http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    ok = live.client.completions.create(model=NAME, prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
    h = settle(live)
    assert h["engine"]["engine_errors"] == 1 and h["engine"]["available_pages"] == h["engine"]["total_pages"]


def test_a_prompt_over_the_step_budget_without_chunked_prefill_is_a_400_naming_prompt(hf_dirs):
    # the HTTP side let it through: the engine refused it (param null) while the request's
    # other prompt ran on, its reader left waiting for ever
    engine = json.dumps({"batch_buckets": [16], "token_buckets": [16, 32], "chunked_prefill": False})
    for live in serve(["--model", f"hf:{hf_dirs[0]}", "--served-model-name", NAME, "--engine-in-process",
                       "--no-warmup", "--max-batch", "16", "--page-size", "16", "--max-seq-len", "128",
                       "--max-tokens-per-step", "32", "--engine", engine]):
        r = live.http.post("/v1/completions", json={"model": NAME, "prompt": [[1, 2, 3], list(range(1, 41))],
                                                    "max_tokens": 8})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "prompt: prompt[1] has 40 tokens; without chunked_prefill a prompt "
                                                "is prefilled in one step of at most max_tokens_per_step (32) tokens",
                                     "type": "invalid_request_error", "param": "prompt", "code": None}
        h = settle(live)
        assert h["engine"]["steps"] == 0 and h["engine"]["available_pages"] == h["engine"]["total_pages"]


def _pending_drains(loop: asyncio.AbstractEventLoop) -> list[str]:
    """The choice readers (`_drain` tasks) not yet done on the server's event loop."""
    async def pending():
        return [repr(t) for t in asyncio.all_tasks() if t.get_coro().__name__ == "_drain" and not t.done()]
    return asyncio.run_coroutine_threadsafe(pending(), loop).result(10)


def test_a_choice_the_engine_refuses_ends_the_plain_answer_and_the_other_choices(live_in_thread, monkeypatch):
    # the other choice's reader waited for ever on a request the answer's end had aborted
    live = live_in_thread
    engine = live.server.engine
    real_add = engine.add_request

    def refusing_add(prompt, *args, **kwargs):
        if list(prompt) == [7, 7, 7]:
            raise ValueError("prompt: refused by the test")
        return real_add(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", refusing_add)
    worker, handles = live.server.worker, []
    real_submit = worker.submit

    def submit(*args, **kwargs):
        handles.append(real_submit(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(worker, "submit", submit)
    r = live.http.post("/v1/completions", json={"model": NAME, "prompt": [[1, 2, 3], [7, 7, 7]], "max_tokens": 64,
                                                "ignore_eos": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "prompt: refused by the test"
    assert len(handles) == 2 and _pending_drains(handles[0].loop) == []
    h = settle(live)
    assert h["engine"]["available_pages"] == h["engine"]["total_pages"]


def test_tool_calls_in_an_answer_come_back_as_openai_tool_calls():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    content, calls = parse_tool_calls(text, [{"type": "function", "function": {"name": "add"}}])
    assert content == "Let me add."
    assert calls == [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]


def test_an_answer_with_a_malformed_tool_call_comes_back_as_written():
    text = '<tool_call>{"name": "add", "arguments": </tool_call>'
    assert parse_tool_calls(text, [{"type": "function", "function": {"name": "add"}}]) == (text, None)
    assert parse_tool_calls("just prose", []) == ("just prose", None)


# Step programs a `jrl serve --max-batch 256` warmup compiles with the GPU tuning
# (docs/serve.md): decode 8 row buckets (2..256) x widths, the same again for 4-step
# decode, and one prefill program per token bucket (64..1024), all sampled.
SERVE_PROGRAMS = {256: 16 + 16 + 5, 512: 24 + 24 + 5}  # widths 8/16, then 8/16/32


@pytest.mark.parametrize("seq_len", sorted(SERVE_PROGRAMS))
def test_warmup_program_count_of_a_256_request_server(hf_dirs, seq_len):
    served = load_served(f"hf:{hf_dirs[0]}", None, None, dtype="float32")
    served = dataclasses.replace(served, model_config=dataclasses.replace(served.model_config,
                                                                          max_position_embeddings=seq_len))
    config = engine_config(served, build_parser().parse_args(["--max-batch", "256", "--max-seq-len", str(seq_len)]))
    gpu = TuningOverrides(**dataclasses.asdict(resolve_tuning("gpu", served.model_config, config)))
    engine = Engine(served.model_config, served.params, config, tuning=gpu)
    layouts = engine.step_layouts(SamplingParams())
    assert len(layouts) == len(set(layouts)) == SERVE_PROGRAMS[seq_len]
    prefill = [(x.n_tokens, x.n_rows) for x in layouts if not x.decode]
    assert prefill == [(64, 64), (128, 128), (256, 256), (512, 256), (1024, 256)]


def test_a_random_mix_of_requests_and_cancellations_leaves_the_server_clean(live):
    """32 concurrent clients at once, each a random request: chat or completion, streamed or
    not, n of 1 or 2 (64 choices at most: the server's capacity), stop strings, logprobs,
    greedy or sampled; a third of the streams are closed after their
    first chunk. Every finished answer is well-formed and repeats its seed's answer from a
    quiet server; afterwards nothing is outstanding and every page is back."""
    rng = np.random.default_rng(5)

    def body(k):
        chat = bool(rng.integers(2))
        b = {"model": NAME, "max_tokens": int(rng.integers(1, 20)), "n": int(rng.integers(1, 3)),
             "seed": k, "temperature": float(rng.choice([0.0, 0.8])), "stream": bool(rng.integers(2)),
             "stop": [" the"] if rng.random() < 0.3 else None}
        if chat:
            b["messages"] = [{"role": "user", "content": f"tell {k}"}]
            b["logprobs"] = bool(rng.integers(2))
        else:
            b["prompt"] = f"count {k} and"
        return ("/v1/chat/completions" if chat else "/v1/completions"), b, bool(b["stream"] and rng.random() < 0.33)

    requests = [body(k) for k in range(32)]

    def text_of(choice):
        return choice["message"]["content"] if "message" in choice else choice["text"]

    async def one(client, path, b, cancel):
        if not b["stream"]:
            r = await client.post(path, json=b)
            assert r.status_code == 200, r.text
            return {c["index"]: (text_of(c), c["finish_reason"]) for c in r.json()["choices"]}
        texts, reasons = {}, {}
        async with client.stream("POST", path, json=b) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if cancel:
                    return None  # leaving the block closes the connection mid-stream
                for c in json.loads(line[6:])["choices"]:
                    delta = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
                    texts[c["index"]] = texts.get(c["index"], "") + (delta or "")
                    if c.get("finish_reason"):
                        reasons[c["index"]] = c["finish_reason"]
        return {i: (texts.get(i, ""), reasons.get(i)) for i in range(b["n"])}

    async def go(pairs):
        async with httpx.AsyncClient(base_url=live.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, p, b, cancel) for p, b, cancel in pairs))

    total = settle(live)["engine"]["total_pages"]
    together = asyncio.run(go(requests))
    h = settle(live)
    assert h["outstanding_requests"] == 0 and h["engine"]["available_pages"] == total
    alone = asyncio.run(go([(p, {**b, "stream": False}, False) for p, b, _ in requests]))
    for (path, b, cancel), got, quiet in zip(requests, together, alone):
        if cancel:
            assert got is None
            continue
        assert sorted(got) == list(range(b["n"])) and all(r in ("stop", "length") for _, r in got.values())
        assert got == quiet, (path, b)  # a seed's answer does not depend on what else runs


class ChildSeenAlive:
    """A child multiprocessing still calls alive (its wait finds no child: something else
    reaped it); `exited` says whether its sentinel pipe closed."""

    def __init__(self, exited: bool):
        self.killed = False
        read, self._write = os.pipe()
        self.sentinel = read
        if exited:
            os.close(self._write)

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return True

    def kill(self):
        self.killed = True


def stopped(child, caplog):
    from jrl.serve.engine_process import EngineProcess
    proc = object.__new__(EngineProcess)  # only what stop() touches
    proc._gone, proc._process, proc._reader = True, child, ChildSeenAlive(exited=True)
    with caplog.at_level("ERROR"):
        proc.stop(timeout=0.1)
    return child


def test_stopping_an_engine_process_that_something_else_reaped_does_not_kill_it(caplog):
    child = stopped(ChildSeenAlive(exited=True), caplog)
    assert not child.killed and "did not stop" not in caplog.text


def test_stopping_an_engine_process_that_hangs_kills_it(caplog):
    child = stopped(ChildSeenAlive(exited=False), caplog)
    assert child.killed and "the engine process did not stop within 0 s; killing it" in caplog.text


def test_a_request_field_the_server_does_not_read_is_logged_once_by_name(live_in_thread, caplog):
    # a misspelt sampling parameter is ignored as OpenAI's unknown fields are, but not silently
    with caplog.at_level("WARNING", logger="jrl.serve"):
        for _ in range(2):
            r = live_in_thread.http.post("/v1/completions", json={**COMP, "max_tokens": 2, "temprature": 0})
            assert r.status_code == 200, r.text
    assert [m for m in caplog.messages if "temprature" in m] == [
        "request field 'temprature' is not one this server reads; ignored (a misspelt sampling parameter takes "
        "its default)"]


def test_ignored_request_fields_are_logged_for_the_first_64_names_only(live_in_thread, monkeypatch, caplog):
    # one 8 MB body of distinct unknown field names wrote a log line for each (20,000 lines
    # for a 300 KB request), and the set of names seen grew with every such request
    server = live_in_thread.server
    monkeypatch.setattr(server, "ignored_seen", set())
    monkeypatch.setattr(server, "ignored_muted", False)
    fields = {f"x{i:03d}": 1 for i in range(100)}
    with caplog.at_level("WARNING", logger="jrl.serve"):
        for _ in range(2):
            r = live_in_thread.http.post("/v1/completions", json={**COMP, "max_tokens": 1, **fields})
            assert r.status_code == 200, r.text
    assert [m for m in caplog.messages if "is not one this server reads" in m] == [
        f"request field 'x{i:03d}' is not one this server reads; ignored (a misspelt sampling parameter takes its "
        "default)" for i in range(64)]
    assert [m for m in caplog.messages if "64" in m] == [
        "request fields this server does not read: 64 names logged; further ones are ignored without a log line"]
    assert len(server.ignored_seen) == 64


def test_help_names_the_address_the_server_listens_on():
    # the README's base_url (http://127.0.0.1:8000/v1) relies on these defaults, which --help did not show
    text = " ".join(build_parser().format_help().split())
    assert "--host HOST interface to listen on (default 127.0.0.1" in text
    assert "--port PORT (default 8000)" in text


TOOL_ANSWER = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ADD_TOOL = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def script_answers(monkeypatch, tokenizer, text: str | list[int]) -> int:
    """Every choice's text is `text` (a string, or token ids), whatever the model samples
    (each sampled token is swapped for the next of `text`'s tokens): request max_tokens (the
    returned count) with ignore_eos. Returns how many tokens `text` takes."""
    import jrl.serve.app as app_module
    script = tokenizer.encode(text) if isinstance(text, str) else list(text)

    class Scripted(TextStream):
        def add(self, ids):
            start = len(self.ids)
            super().add(script[start:start + len(ids)])

    monkeypatch.setattr(app_module, "TextStream", Scripted)
    return len(script)


def test_a_streamed_answer_with_tool_calls_streams_them_as_tool_calls(live, monkeypatch):
    n_tokens = script_answers(monkeypatch, live.server.tokenizer, TOOL_ANSWER)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "2 plus 3?"}], tools=ADD_TOOL, max_tokens=n_tokens,
              extra_body={"ignore_eos": True})
    plain = live.client.chat.completions.create(**kw).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content == "Let me add."
    content, calls, finish = "", [], None
    for chunk in live.client.chat.completions.create(**kw, stream=True):
        (c,) = chunk.choices
        content += c.delta.content or ""
        calls += c.delta.tool_calls or []
        finish = c.finish_reason or finish
    assert content == "Let me add." and finish == "tool_calls"
    assert [call.model_dump() for call in calls] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]


def test_an_answers_tool_calls_sent_back_with_their_answers_continue_the_conversation(live, monkeypatch):
    # as docs/serve.md shows: the assistant message with its tool_calls as they came, a tool message per call
    n_tokens = script_answers(monkeypatch, live.server.tokenizer, TOOL_ANSWER)
    messages = [{"role": "user", "content": "2 plus 3?"}]
    kw = dict(model=NAME, tools=ADD_TOOL, max_tokens=n_tokens, extra_body={"ignore_eos": True})
    calls = live.client.chat.completions.create(messages=messages, **kw).choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                 *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in calls)]
    again = live.client.chat.completions.create(messages=messages, **kw)
    assert again.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_choice_none_leaves_a_tool_call_in_the_content(live, monkeypatch, stream):
    n_tokens = script_answers(monkeypatch, live.server.tokenizer, TOOL_ANSWER)
    body = {"model": NAME, "messages": [{"role": "user", "content": "2 plus 3?"}], "tools": ADD_TOOL,
            "tool_choice": "none", "max_tokens": n_tokens, "ignore_eos": True, "stream": stream}
    if stream:
        with live.http.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == TOOL_ANSWER
        assert not any("tool_calls" in d for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        (c,) = live.http.post("/v1/chat/completions", json=body).json()["choices"]
        assert c["message"] == {"role": "assistant", "content": TOOL_ANSWER} and c["finish_reason"] == "length"


def test_a_tool_choice_that_is_no_choice_is_a_400_naming_it(live):
    r = live.http.post("/v1/chat/completions", json={**CHAT, "tools": ADD_TOOL, "tool_choice": "any"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "tool_choice: 'any' is not a tool choice; this server takes 'auto' and "
                                            "'none' (no forced tool calls)", "type": "invalid_request_error",
                                 "param": "tool_choice", "code": None}


def test_a_tool_choice_neither_a_string_nor_an_object_is_named_as_tool_choice(live):
    # the union's own error named its first member: "tool_choice.str: Input should be a valid string"
    r = live.http.post("/v1/chat/completions", json={**CHAT, "tool_choice": 5})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "tool_choice: must be 'auto', 'none' or a tool choice object, got 5",
                                 "type": "invalid_request_error", "param": "tool_choice", "code": None}


@pytest.mark.parametrize("part,got", [({"type": "text"}, "none"), ({"type": "text", "text": 5}, "5")],
                         ids=["missing", "a number"])
def test_a_text_part_without_a_string_text_is_a_400_saying_so(live, part, got):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    r = live.http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"messages[0].content[1]: a text part needs a string 'text', got {got}",
                                 "type": "invalid_request_error", "param": "messages[0].content", "code": None}


@pytest.mark.parametrize("body", [b'{"checkpoint": ', b'{"nope": 1}'], ids=["malformed", "no checkpoint"])
def test_weights_checks_the_admin_token_before_the_body(live, body):
    r = live.http.post("/v1/weights", content=body, headers={"Authorization": "Bearer wrong",
                                                             "Content-Type": "application/json"})
    assert r.status_code == 401, r.text
    assert r.json()["error"] == {"message": "invalid admin token (Authorization: Bearer <token>)",
                                 "type": "authentication_error", "param": None, "code": None}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_stop_string_in_the_final_flush_of_an_incomplete_character_finishes_with_stop(live, monkeypatch, stream):
    """The answer ends at max_tokens inside a character ("ok" and the first byte of "é"): only
    the final flush writes its U+FFFD, where the stop string is found. The text was cut
    there but finish_reason stayed "length"."""
    tok = live.server.tokenizer
    n_tokens = script_answers(monkeypatch, tok, tok.encode("ok") + tok.encode("é")[:1])
    body = {"model": NAME, "prompt": "hi", "max_tokens": n_tokens, "ignore_eos": True, "stop": ["\ufffd"],
            "stream": stream}
    if stream:
        with live.http.stream("POST", "/v1/completions", json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert (text, finish) == ("ok", ["stop"])
    else:
        (c,) = live.http.post("/v1/completions", json=body).json()["choices"]
        assert (c["text"], c["finish_reason"]) == ("ok", "stop")
