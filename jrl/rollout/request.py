"""A generation request's host-side state, and the completion handed back to callers."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from jrl.rollout.cache.task_cache import TaskCache
from jrl.rollout.sampling import SamplingParams

# "error": the request's logits (or log-probabilities) turned non-finite; the token drawn
# from them is dropped and the request ends there.
FinishReason = Literal["eos", "stop", "length", "error"]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One finished request. `tokens[i]` was produced by weights of version `versions[i]`;
    `logprobs[i]` is its log-probability under the distribution it was drawn from,
    `model_logprobs[i]` under the untruncated temperature-1 model distribution.
    `finish_reason` "error": the logits turned non-finite; `tokens` are those before."""

    request_id: int
    prompt: np.ndarray
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    model_logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int64 [n]
    finish_reason: FinishReason
    cached_tokens: int  # prompt tokens served from the prefix cache, computed at no admission
    n_preemptions: int


@dataclasses.dataclass(eq=False, slots=True)  # slots: faster attribute reads in the per-step loops
class Request:
    rid: int
    prompt: np.ndarray
    sampling: SamplingParams  # the engine passes them without their seed (which is `seed`)
    max_new_tokens: int
    eos_ids: frozenset[int]
    stop_sequences: tuple[tuple[int, ...], ...]
    seed: int
    outputs: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model_logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    task: TaskCache | None = None
    prefill_target: int = 0  # positions to prefill at this admission (prompt + known outputs)
    epoch: int = 0  # bumped on preempt/abort/finish: results of older steps are ignored
    n_inflight: int = 0  # samples dispatched but not yet read back (2 while step n-1 is unread)
    device_row: int = -1  # row of the last dispatched step whose sample is the next input
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # set at the first admission (epoch 0), the fewest of each later one
    n_preemptions: int = 0
    # (epoch, pages) of the task it last released while samples of it were still unread:
    # should one of those samples turn out non-finite, those pages' KV may be too
    # (`Engine._record` drops them from the prefix cache)
    released: tuple[int, list[int]] | None = None
    _tokens: np.ndarray = dataclasses.field(init=False, repr=False)  # prompt + outputs, preallocated
    _n_synced: int = dataclasses.field(default=0, init=False, repr=False)  # outputs copied into _tokens

    def __post_init__(self) -> None:
        self._tokens = np.zeros(len(self.prompt) + self.max_new_tokens, np.int32)
        self._tokens[:len(self.prompt)] = self.prompt

    @property
    def n_scheduled_samples(self) -> int:
        return len(self.outputs) + self.n_inflight

    @property
    def in_prefill(self) -> bool:
        return self.task is not None and self.task.kv_len < self.prefill_target

    def known_tokens(self) -> np.ndarray:
        """Prompt + tokens read back so far (a view; no copy). Outputs are copied into the
        preallocated array here, when asked for, rather than per recorded token, so reading
        a decode step back touches no numpy per request."""
        n_out = len(self.outputs)
        if self._n_synced < n_out:
            start = len(self.prompt)
            self._tokens[start + self._n_synced:start + n_out] = self.outputs[self._n_synced:]
            self._n_synced = n_out
        return self._tokens[:len(self.prompt) + n_out]

    def reset_outputs(self) -> None:
        self.outputs, self.logprobs, self.model_logprobs, self.versions = [], [], [], []
        self._n_synced = 0

    def record(self, token: int, logprob: float, model_logprob: float, version: int) -> None:
        """Appends a sampled token and sets `finish_reason` when a stop condition holds."""
        outputs = self.outputs
        outputs.append(token)
        self.logprobs.append(logprob)
        self.model_logprobs.append(model_logprob)
        self.versions.append(version)
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif self.stop_sequences and any(len(outputs) >= len(s) and tuple(outputs[-len(s):]) == s
                                         for s in self.stop_sequences):
            self.finish_reason = "stop"
        elif len(outputs) >= self.max_new_tokens:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            request_id=self.rid, prompt=self.prompt, tokens=np.asarray(self.outputs, np.int32),
            logprobs=np.asarray(self.logprobs, np.float32),
            model_logprobs=np.asarray(self.model_logprobs, np.float32),
            versions=np.asarray(self.versions, np.int64), finish_reason=self.finish_reason,
            cached_tokens=self.cached_tokens, n_preemptions=self.n_preemptions)
