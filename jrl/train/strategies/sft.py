"""`sft`: supervised fine-tuning. The loss is the `seq` cross-entropy, but the data must
come from declarative sections or chat messages, so only tokens of `train: true` sections
(e.g. the response, not the prompt) or of trained roles are targets; packed documents never attend to each other
because attention is masked by segment id."""

from __future__ import annotations

from jrl.train.strategies import register_strategy
from jrl.train.strategies.base import Strategy
from jrl.train.strategies.seq import TOKEN_FIELDS, TokenLossOptions, token_cross_entropy

register_strategy(Strategy(
    name="sft", loss_fn=token_cross_entropy, batch_fields=TOKEN_FIELDS,
    options_cls=TokenLossOptions, data_formats=("sections", "chat"),
))
