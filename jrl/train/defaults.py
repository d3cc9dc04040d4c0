"""The run `python -m jrl.train` performs without a config: GRPO on the bundled addition
task (`37+48=` -> `58`, the sum's digits least-significant first; `jrl.data.tasks`) for a
tiny byte-level model, after a short SFT warm start (`strategy.options.warm_start`: on
`bundled:addition` demonstrations until 40% of the validation problems are solved, run into
`<run_dir>/warm_start/` by `jrl.rl.warm_start`). Sized to finish on a 2-core CPU in a few
minutes; overrides apply to the GRPO stage (and `model.*` / `seed` to both)."""

from __future__ import annotations

from typing import Any

MODEL = {"vocab_size": 262, "hidden_size": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "head_dim": 16, "intermediate_size": 256, "max_position_embeddings": 64}


def default_run() -> dict[str, Any]:
    """The GRPO stage: 32 prompts x 8 samples per rollout, one update per rollout."""
    return {
        "name": "default",
        "seed": 0,
        "steps": 300,
        "model": dict(MODEL),
        "data": {"seq_len": 16, "batch_size": 256},
        "strategy": {"name": "grpo", "options": {
            "prompts_per_step": 32, "group_size": 8, "max_new_tokens": 5, "temperature": 1.0,
            "epochs": 1, "engine": {"page_size": 4},
            # SFT on demonstrations of training problems (never a held-out or validation
            # one) until the model solves 40% of the validation problems, so RL has signal
            # and room to improve
            "warm_start": {"source": "bundled:addition:100000", "target_accuracy": 0.4, "max_steps": 1500,
                           "check_every": 25, "lr": 5e-3, "clip_norm": 0.0, "batch_size": 16, "seq_len": 64,
                           "warmup_steps": 20}}},
        "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.0, "clip_norm": 1.0},
        "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 100, "keep_last": 2},
        "eval": {"every": 50},
        "logging": {"log_every": 1},
    }
