"""One model definition shared by the trainer and the rollout engine."""

from jrl.models.attention import DenseAttention, dense_attention
from jrl.models.transformer import (
    ModelOutput,
    Transformer,
    apply,
    count_params,
    forward,
    init_params,
    lm_logits,
    param_logical_axes,
)

__all__ = [
    "DenseAttention", "ModelOutput", "Transformer", "apply", "count_params", "dense_attention",
    "forward", "init_params", "lm_logits", "param_logical_axes",
]
