"""The run `python -m jrl.train` performs without a config: supervised fine-tuning of a
tiny byte-level model on the bundled arithmetic data (`23+45=` -> `68`), sized to finish
on a laptop CPU in a couple of minutes. Overrides apply on top of it."""

from __future__ import annotations

from typing import Any


def default_run() -> dict[str, Any]:
    return {
        "name": "default",
        "seed": 0,
        "steps": 300,
        "model": {"vocab_size": 262, "hidden_size": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "head_dim": 16, "intermediate_size": 192, "max_position_embeddings": 128},
        "data": {"source": "bundled:arithmetic:4000", "format": "sections",
                 "sections": [{"field": "prompt"}, {"field": "response", "train": True}],
                 "seq_len": 128, "batch_size": 16, "eval_fraction": 0.05},
        "strategy": {"name": "sft"},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01, "clip_norm": 1.0},
        "schedule": {"kind": "warmup_cosine", "warmup_steps": 20, "min_lr_ratio": 0.1},
        "checkpoint": {"interval": 100, "keep_last": 2},
        "eval": {"every": 50, "batches": 2},
        "logging": {"log_every": 1},
    }
