"""A tiny Hugging Face-style chat tokenizer directory, built in-test (no download): a
byte-level BPE with ChatML special tokens, EOS `<|endoftext|>` and turns closed by
`<|im_end|>` (as Qwen's base models are)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that also renders `tools=` (a system turn listing their JSON schemas) and
# `<tool_call>` instructions, Qwen-style; `tool` messages are ChatML turns like any other.
CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ 'Call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' }}"
    "{% endif %}" + CHATML
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the cat sat on the mat", "what is 2 plus 3? 5", "user assistant system", "0123456789 +-=?"] * 20


def write_chat_tokenizer(path: Path, vocab_size: int = 300, template: str = CHATML, bos: str | None = None) -> Path:
    """Writes tokenizer.json + tokenizer_config.json (with the ChatML template, or
    `template`) into `path`. `bos`: a BOS token the tokenizer prepends when asked for its
    special tokens (its post-processor, as Llama's)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + ([bos] if bos else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": template}
    if bos:
        raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, raw.token_to_id(bos))])
        config["bos_token"] = bos
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
