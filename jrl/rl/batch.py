"""Trainer rows from sampled completions, and the rollout batch that carries them."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jrl.data.packing import plan_rows_first_fit


def build_rows(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
               behaviour_logp: Sequence[np.ndarray], seq_len: int, pad_id: int,
               token_versions: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Trainer rows for prompt + response pairs, in the target convention of the losses:
    position t predicts `targets[t] = tokens[t + 1]`; `loss_mask` is 1 exactly where the
    target is a response token, and `behaviour_logp` holds the engine's log-prob of it.
    With `token_versions` (each response token's policy version, `Completion.versions`),
    also `token_version`: the version that sampled the target, -1 off the response.
    (A one-turn episode: `build_episode_rows` with mask 0 on the prompt, 1 on the response.)"""
    sequences, masks, logps, versions = [], [], [], []
    for k, (p, r, lp) in enumerate(zip(prompts, responses, behaviour_logp)):
        p, r = np.asarray(p, np.int32), np.asarray(r, np.int32)
        if len(p) + len(r) > seq_len:
            raise ValueError(f"data.seq_len: {seq_len} is shorter than prompt ({len(p)}) + response "
                             f"({len(r)}) = {len(p) + len(r)} tokens; raise data.seq_len")
        if len(lp) != len(r):
            raise ValueError(f"behaviour_logp: {len(lp)} log-probs for a response of {len(r)} tokens")
        sequences.append(np.concatenate([p, r]))
        masks.append(np.concatenate([np.zeros(len(p), np.float32), np.ones(len(r), np.float32)]))
        logps.append(np.concatenate([np.zeros(len(p), np.float32), np.asarray(lp, np.float32)]))
        if token_versions is not None:
            v = np.asarray(token_versions[k], np.int64)
            if len(v) != len(r):
                raise ValueError(f"token_versions: {len(v)} versions for a response of {len(r)} tokens")
            versions.append(np.concatenate([np.full(len(p), -1, np.int64), v]))
    return build_episode_rows(sequences, masks, logps, seq_len, pad_id,
                              versions if token_versions is not None else None)


def build_episode_rows(sequences: Sequence[np.ndarray], token_masks: Sequence[np.ndarray],
                       token_logp: Sequence[np.ndarray], seq_len: int, pad_id: int,
                       token_versions: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Trainer rows for whole episodes (`jrl.rl.environments`): each sequence with a
    per-token mask (1: sampled by the model, 0: prompt, environment or tool tokens) and the
    engine's log-prob of every masked token. Same target convention as `build_rows`:
    `loss_mask[t] = token_mask[t + 1]`, so the loss trains exactly the sampled tokens.
    With `token_versions` (per token, any value where the mask is 0), also `token_version`:
    the policy version that sampled `targets[t]`, -1 where the loss mask is 0."""
    n = len(sequences)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    targets = np.full((n, seq_len), pad_id, np.int32)
    positions = np.zeros((n, seq_len), np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    loss_mask = np.zeros((n, seq_len), np.float32)
    blogp = np.zeros((n, seq_len), np.float32)
    tversion = np.full((n, seq_len), -1, np.int32)
    for i, (seq, m, lp) in enumerate(zip(sequences, token_masks, token_logp)):
        seq = np.asarray(seq, np.int32)
        m, lp = np.asarray(m, np.float32), np.asarray(lp, np.float32)
        length = len(seq)
        if length > seq_len:
            raise ValueError(f"data.seq_len: {seq_len} is shorter than an episode of {length} tokens; raise "
                             f"data.seq_len or lower max_total_tokens")
        if not len(m) == len(lp) == length:
            raise ValueError(f"episode {i}: {length} tokens, {len(m)} mask values, {len(lp)} log-probs")
        if length and m[0]:
            raise ValueError(f"episode {i}: its first token is marked sampled (nothing predicts it)")
        tokens[i, :length] = seq
        targets[i, :length - 1] = seq[1:]
        positions[i, :length] = np.arange(length)
        segment_ids[i, :length] = 1
        loss_mask[i, :length - 1] = m[1:]
        blogp[i, :length - 1] = lp[1:] * m[1:]
        if token_versions is not None:
            v = np.asarray(token_versions[i], np.int64)
            if len(v) != length:
                raise ValueError(f"episode {i}: {length} tokens, {len(v)} versions")
            tversion[i, :length - 1] = np.where(m[1:] > 0, v[1:], -1)
    rows = {"tokens": tokens, "targets": targets, "positions": positions, "segment_ids": segment_ids,
            "loss_mask": loss_mask, "behaviour_logp": blogp}
    if token_versions is not None:
        rows["token_version"] = tversion
    return rows


def stale_groups(sample_versions: np.ndarray, group_size: int, trainer_version: int,
                 max_lag: int) -> np.ndarray:
    """[n_groups] bool: groups holding a sample whose version (the RL loop passes each
    sample's newest token version, see `stale_tokens`) is more than `max_lag` versions
    before `trainer_version`. A sample of version -1 (no trained token) is never stale."""
    versions = np.asarray(sample_versions).reshape(-1, group_size)
    return ((trainer_version - versions > max_lag) & (versions >= 0)).any(axis=1)


def stale_tokens(token_version: np.ndarray, loss_mask: np.ndarray, trainer_version: int,
                 max_lag: int) -> np.ndarray:
    """[rows, seq] bool: trained tokens (loss mask > 0) sampled more than `max_lag`
    versions before `trainer_version`. A sample whose tokens span versions (interruptible
    generation) loses only its stale tokens; one left with none is stale as a whole."""
    return (np.asarray(loss_mask) > 0) & (trainer_version - np.asarray(token_version) > max_lag)


def newest_versions(token_version: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """[rows] the newest version among each row's trained tokens (-1 for a row without)."""
    return np.where(np.asarray(loss_mask) > 0, token_version, -1).max(axis=1)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each sample of one-sample-per-row rows lies in packed rows: sample i is
    `length[i]` tokens at `row[i]`, `offset[i]` (length 0: no token, left out)."""

    row: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    rows: int  # packed rows, padding rows included


def plan_packing(segment_ids: np.ndarray, row_multiple: int = 1) -> Packing:
    """Packing (first fit decreasing, `jrl.data.packing.plan_rows_first_fit`: the loss does
    not depend on where a sample lies) of rows that each hold one sample followed by
    padding; the packed row count is rounded up to a multiple
    of `row_multiple` (the trainer's micro-batches times its data-parallel devices), so a
    run compiles at most `rows / row_multiple` shapes."""
    seg = np.asarray(segment_ids)
    seq_len = seg.shape[1]
    lengths = (seg > 0).sum(axis=1)
    plan = plan_rows_first_fit(lengths, seq_len)
    row, offset, length = (np.zeros(len(seg), np.int64) for _ in range(3))
    for r in range(len(plan)):
        at = 0
        for k in range(int(plan.row_ptr[r]), int(plan.row_ptr[r + 1])):
            d = int(plan.doc[k])
            row[d], offset[d], length[d] = r, at, plan.length[k]
            at += int(plan.length[k])
    rows = max(1, -(-len(plan) // row_multiple)) * row_multiple
    return Packing(row, offset, length, rows)


def pack_rows(rows: dict[str, np.ndarray], packing: Packing, pad_id: int) -> dict[str, np.ndarray]:
    """Packed rows of one-sample-per-row `rows`: every `[N, T]` field moved into place,
    `positions` restarting per sample, `segment_ids` 1, 2, ... per sample of a row (so
    attention never crosses samples), and every per-sample field (`[N]`: advantages,
    behaviour_version) repeated at each of its sample's tokens. Padding is `pad_id` in
    `tokens` and `targets`, -1 in `token_version`, 0 elsewhere (as `build_episode_rows`)."""
    seq_len = rows["segment_ids"].shape[1]
    fills = {"tokens": pad_id, "targets": pad_id, "token_version": -1}
    out = {k: np.full((packing.rows, seq_len), fills.get(k, 0), v.dtype) for k, v in rows.items()}
    placed = np.zeros(packing.rows, np.int64)  # samples written into each packed row so far
    for i in np.flatnonzero(packing.length > 0):  # in sample order: a row's segment ids follow it
        r, a, n = int(packing.row[i]), int(packing.offset[i]), int(packing.length[i])
        for k, v in rows.items():
            out[k][r, a:a + n] = v[i, :n] if v.ndim == 2 else v[i]
        placed[r] += 1
        out["segment_ids"][r, a:a + n] = placed[r]
    return out


def unpack_tokens(packed: np.ndarray, packing: Packing, seq_len: int) -> np.ndarray:
    """Per-token values of packed rows back in the one-sample-per-row layout `[N, seq_len]`
    (0 where a sample has no token)."""
    out = np.zeros((len(packing.row), seq_len), np.asarray(packed).dtype)
    for i in range(len(packing.row)):
        a, n = int(packing.offset[i]), int(packing.length[i])
        out[i, :n] = packed[packing.row[i], a:a + n]
    return out


@dataclasses.dataclass
class Rollout:
    """One rollout batch: trainer rows (all `prompts_per_step * group_size` of them, masked
    groups included so shapes never change) and host-side statistics."""

    rows: dict[str, np.ndarray]
    sample_versions: np.ndarray  # [N] oldest token version per sample
    group_kept: np.ndarray  # [n_groups] bool: trained on (signal, not stale)
    metrics: dict[str, float]
