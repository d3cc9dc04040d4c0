"""Tokenizers: byte round trips, a tiny BPE trained in-test through HFTokenizer, chat templates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from chat_fixtures import CHATML, SPECIALS
from jrl.tokenizer import (
    _GIL_FREE_CHARS,
    DEFAULT_CHAT_TEMPLATE,
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    Tokenizer,
    apply_chat_template,
    encode_continuation,
    load_tokenizer,
)
from jrl.config import DataConfig, Section
from jrl.data.encode import encode_record

CORPUS = ["the cat sat on the mat", "the dog sat on the log", "héllo wörld, the cat says hi"] * 20
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE trained on a toy corpus, saved like a Hugging Face model directory."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("bpe")
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>",
        "chat_template": CHATML}))
    return path


# ----------------------------------------------------------------------------- bytes


def test_byte_tokenizer_round_trips_unicode_text():
    tok = ByteTokenizer()
    text = "héllo wörld — 你好 🙂\n\ttab"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_ids_of_special_tokens():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 262)
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_encodes_special_strings_as_single_ids_and_decodes_them_back():
    tok = ByteTokenizer()
    ids = tok.encode("<|user|>\nhi<eos>")
    assert ids == [260, 10, 104, 105, 258]
    assert tok.decode(ids) == "<|user|>\nhi<eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "\nhi"


def test_byte_tokenizer_adds_bos_only_when_asked():
    tok = ByteTokenizer()
    assert tok.encode("a", add_special_tokens=True) == [257, 97]
    assert tok.encode("a") == [97]


def test_byte_tokenizer_decodes_a_cut_multibyte_character_as_replacement():
    tok = ByteTokenizer()
    assert tok.decode(list("é".encode("utf-8"))[:1] + [97]) == "\ufffda"


def test_byte_tokenizer_rejects_ids_outside_its_vocab():
    with pytest.raises(ValueError, match=r"token id 262 is outside the byte tokenizer's vocab \[0, 262\)"):
        ByteTokenizer().decode([97, 262])


# ----------------------------------------------------------------------------- Hugging Face


def test_hf_tokenizer_round_trips_text(bpe_dir):
    tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json", bpe_dir / "tokenizer_config.json")
    text = "the cat sat on the log, héllo"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == text


def test_hf_tokenizer_reads_special_tokens_from_tokenizer_config(bpe_dir):
    tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json", bpe_dir / "tokenizer_config.json")
    raw = RawTokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    assert tok.eos_id == raw.token_to_id("<|im_end|>")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert (tok.bos_id, tok.vocab_size) == (None, raw.get_vocab_size(with_added_tokens=True))
    assert isinstance(tok, Tokenizer)


def test_hf_tokenizer_without_config_needs_an_explicit_eos(bpe_dir):
    with pytest.raises(ValueError, match="eos_token: .* has no eos_token"):
        HFTokenizer.from_file(bpe_dir / "tokenizer.json")
    tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json", eos_token="<|endoftext|>")
    assert tok.pad_id == tok.eos_id  # no pad token: falls back to EOS


def test_hf_tokenizer_rejects_an_eos_token_missing_from_the_vocab(bpe_dir):
    with pytest.raises(ValueError, match="eos_token: token '</s>' is not in the tokenizer's vocabulary"):
        HFTokenizer.from_file(bpe_dir / "tokenizer.json", eos_token="</s>")


def test_hf_chat_template_renders_and_special_tokens_encode_as_single_ids(bpe_dir):
    tok = load_tokenizer(str(bpe_dir))
    text = tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.encode("<|im_start|>")[0] and ids.count(tok.eos_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\nassistant\n"


def test_a_long_text_encodes_to_the_same_ids_with_the_gil_released(bpe_dir):
    # past _GIL_FREE_CHARS HFTokenizer.encode goes through encode_batch_fast (the GIL let go)
    tok = load_tokenizer(str(bpe_dir))
    text = "<|im_start|>user\n" + " ".join(CORPUS) * 20 + " 你好 🙂<|im_end|>\n"
    assert len(text) >= _GIL_FREE_CHARS
    for special in (False, True):
        assert tok.encode(text, add_special_tokens=special) == tok._tok.encode(text, add_special_tokens=special).ids
    assert tok.encode(text).count(tok.eos_id) == 1


def test_a_special_token_the_tokenizer_json_does_not_list_as_added_encodes_as_its_single_id(tmp_path):
    # transformers registers the special tokens tokenizer_config.json names; read here
    # without that, "there</s>" (as a chat template renders a turn's end) was one unknown
    # token and the EOS never reached the training data
    raw = RawTokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2, "there": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hi there</s>") == [2, 3, 1]
    assert tok.decode([2, 3, 1], skip_special_tokens=True) == "hi there"
    assert tok.vocab_size == 4


def test_truncation_and_padding_saved_in_tokenizer_json_do_not_cut_or_pad_what_is_encoded(tmp_path):
    # a tokenizer saved after a call with truncation=True keeps it in tokenizer.json; the
    # tokenizers library then cut every text to max_length (and padded it), which transformers
    # switches off for a call that asks for neither
    raw = RawTokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2, "there": 3, "<pad>": 4}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.enable_truncation(max_length=3)
    raw.enable_padding(length=6, pad_id=4, pad_token="<pad>")
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hi there hi there") == [2, 3, 2, 3]
    assert tok.encode("hi") == [2]
    long = "hi there " * _GIL_FREE_CHARS  # the GIL-free path too
    assert tok.encode(long) == [2, 3] * _GIL_FREE_CHARS


def test_from_dir_prefers_chat_template_jinja(bpe_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert HFTokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES[:2]) == "[Be brief.][Hi]"


def test_a_tokenizer_json_path_reads_the_chat_template_jinja_beside_it(bpe_dir, tmp_path):
    # newer transformers save the template only there: the path of the file must not fall
    # back to the default template while the directory it sits in renders the model's own
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    for spec in (tmp_path, tmp_path / "tokenizer.json"):
        tok = load_tokenizer(str(spec))
        assert tok.chat_template == CHATML
        assert tok.apply_chat_template(MESSAGES[1:2]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_special_tokens_only_in_special_tokens_map_json_are_read(bpe_dir, tmp_path):
    # older model directories name their special tokens only there: the eos was "missing"
    # and the template's {{ bos_token }} rendered empty
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False) == "<|im_start|>Hi<|im_end|>"


def test_tokenizer_config_json_names_special_tokens_before_special_tokens_map_json(bpe_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):  # eos <|im_end|>, pad <|endoftext|>
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                   "bos_token": "<|im_start|>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def test_chat_template_jinja_is_read_as_utf8_whatever_the_locale(bpe_dir, tmp_path):
    # the file is UTF-8 as transformers writes it; a process under an ASCII locale (a
    # minimal container, cron) read it in the locale's encoding and failed to decode it
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_bytes("{% for m in messages %}→{{ m['content'] }}{% endfor %}".encode())
    code = ("import sys; from jrl.tokenizer import HFTokenizer; "
            "t = HFTokenizer.from_dir(sys.argv[1]).chat_template; print(t.encode('unicode_escape').decode())")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{% for m in messages %}\\u2192{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("name,text,problem", [
    ("tokenizer.json", "{", "not a readable tokenizer.json"),
    ("tokenizer_config.json", "{", "not a readable JSON file"),
    ("tokenizer_config.json", '["<|im_end|>"]', "must hold a JSON object, got list"),
])
def test_an_unreadable_tokenizer_file_is_named(bpe_dir, tmp_path, name, text, problem):
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((bpe_dir / file).read_bytes())
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / name))}: {re.escape(problem)}"):
        load_tokenizer(str(tmp_path))


def test_named_template_list_uses_the_default_entry(bpe_dir, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}))
    tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json", tmp_path / "tokenizer_config.json")
    assert tok.chat_template == "plain"


def test_named_template_list_renders_its_tool_use_entry_when_tools_are_given(bpe_dir, tmp_path):
    # transformers picks "tool_use" for a call with tools (Hermes, Command-R): rendering the
    # default one instead left the tool schemas out of the prompt without a word
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "plain:{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "{{ tools | length }} tool(s):{{ messages[0]['content'] }}"}]}))
    tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json", tmp_path / "tokenizer_config.json")
    tools = [{"type": "function", "function": {"name": "add"}}]
    assert tok.apply_chat_template(MESSAGES[1:2], tools=tools) == "1 tool(s):Hi"
    assert tok.apply_chat_template(MESSAGES[1:2]) == "plain:Hi"
    assert tok.apply_chat_template(MESSAGES[1:2], tools=None) == "plain:Hi"
    assert tok.apply_chat_template(MESSAGES[1:2], tools=tools, template="own") == "own"


def test_a_directory_renders_additional_chat_templates_tool_use_jinja_when_tools_are_given(bpe_dir, tmp_path):
    # where newer transformers save a named list: default in chat_template.jinja, the others beside it
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("plain:{{ messages[0]['content'] }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{{ tools | length }} tool(s):{{ messages[0]['content'] }}")
    for spec in (tmp_path, tmp_path / "tokenizer.json"):
        tok = load_tokenizer(str(spec))
        assert tok.apply_chat_template(MESSAGES[1:2], tools=[{"type": "function"}]) == "1 tool(s):Hi"
        assert tok.apply_chat_template(MESSAGES[1:2]) == "plain:Hi"


def test_a_tool_use_template_is_in_the_data_cache_key(bpe_dir):
    # chat records with tools render it: a token store cached under the default template
    # (or another tool_use one) must not be served for it
    from jrl.data.pipeline import cache_key
    cfg = DataConfig(source="bundled:tinytext:20", format="chat")
    keys = [cache_key(cfg, HFTokenizer.from_file(bpe_dir / "tokenizer.json", eos_token="<|im_end|>",
                                                 chat_template="plain", tool_use_template=tool_use), "train")
            for tool_use in (None, "tools:a", "tools:b")]
    assert len(set(keys)) == 3


def test_hf_tokenizer_without_template_uses_the_default(bpe_dir):
    tok = HFTokenizer.from_file(bpe_dir / "tokenizer.json", eos_token="<|im_end|>")
    assert tok.apply_chat_template(MESSAGES[1:2]) == "<|user|>\nHi<|im_end|>"


# ----------------------------------------------------------------------------- chat templates


def test_default_chat_template_renders_exact_string():
    assert apply_chat_template(MESSAGES, eos_token="<eos>") == (
        "<|system|>\nBe brief.<eos><|user|>\nHi<eos><|assistant|>\nHello<eos>")


def test_default_chat_template_generation_prompt_with_byte_tokenizer():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=True)
    assert text == "<bos><|user|>\nHi<eos><|assistant|>\n"
    assert tok.encode(text)[:2] == [257, 260] and tok.encode(text)[-2:] == [261, 10]


def test_default_chat_template_rejects_unknown_role():
    with pytest.raises(ChatTemplateError, match="unknown role ipython; allowed: system, user, assistant, tool"):
        apply_chat_template([{"role": "ipython", "content": "42"}])


def test_default_chat_template_renders_tool_answers_with_a_byte_marker():
    tok = ByteTokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"},
                                    {"role": "tool", "content": "42"}], add_generation_prompt=True)
    assert text == "<bos><|user|>\nHi<eos><|assistant|>\nx<eos><|tool|>\n42<eos><|assistant|>\n"
    ids = tok.encode("<|tool|>\n42<eos>")
    assert ids == list(b"<|tool|>\n42") + [tok.eos_id] and tok.vocab_size == 262  # no new special token


def test_messages_must_have_roles():
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]: needs a string 'role'"):
        apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ChatTemplateError, match="messages: must be a list"):
        apply_chat_template("hello")


def test_tojson_takes_its_positional_arguments_in_transformers_order():
    # transformers' filter is tojson(x, ensure_ascii, indent, separators, sort_keys): a
    # template's tojson(true) escapes non-ASCII there, and indented by 1 here
    template = "{{ messages[0] | tojson(true) }}|{{ messages[0] | tojson(false, 1) }}"
    assert apply_chat_template([{"role": "user", "content": "é"}], template) == \
        '{"role": "user", "content": "\\u00e9"}|{\n "role": "user",\n "content": "é"\n}'


def test_template_context_tojson_keeps_unicode_and_extra_variables():
    template = "{{ messages | tojson }}|{{ enable_thinking }}"
    out = apply_chat_template([{"role": "user", "content": "héllo <b>"}], template, enable_thinking=False)
    assert out == '[{"role": "user", "content": "héllo <b>"}]|False'


def test_tools_and_documents_are_none_when_not_given_as_in_transformers():
    # Mistral-7B-Instruct-v0.3's template tests `tools is not none` without `is defined`:
    # undefined, it wrote an empty [AVAILABLE_TOOLS] block into every prompt
    template = ("{% for m in messages %}{% if tools is not none %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
                "[/AVAILABLE_TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
                "[INST] {{ m['content'] }}[/INST]{% endfor %}")
    assert apply_chat_template(MESSAGES[1:2], template) == "[INST] Hi[/INST]"
    assert apply_chat_template(MESSAGES[1:2], template, tools=[{"name": "f"}]) == (
        '[AVAILABLE_TOOLS][{"name": "f"}][/AVAILABLE_TOOLS][INST] Hi[/INST]')


def test_generation_blocks_render_their_content_as_in_transformers():
    # transformers' {% generation %} marks the assistant's tokens (TRL's assistant_only_loss
    # templates carry it); rendering, it is its body
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<eos>{% endgeneration %}"
                "{% else %}{{ m['content'] }}<eos>{% endif %}{% endfor %}")
    assert apply_chat_template(MESSAGES[1:], template) == "<|user|>\nHi<eos><|assistant|>\nHello<eos>"


def test_jinja_block_whitespace_follows_transformers_conventions():
    template = "{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    assert apply_chat_template(MESSAGES[:2], template) == "  Be brief.\n  Hi\n"


def test_default_template_constant_is_what_byte_tokenizer_uses():
    assert ByteTokenizer().chat_template == DEFAULT_CHAT_TEMPLATE


def test_load_tokenizer_rejects_unknown_spec():
    with pytest.raises(ValueError, match="tokenizer: 'nope.json' is neither 'bytes' nor an existing"):
        load_tokenizer("nope.json")


def dummy_prefix_tokenizer() -> HFTokenizer:
    """A SentencePiece-style BPE that puts '▁' (a space) before every text it encodes, as
    Llama-2's and Mistral v0.1's tokenizers do; '▁4' and '▁2' are merged words."""
    pieces = ["<unk>", "<s>", "</s>", "<0x0A>", "▁", "2", "+", "=", "4", "▁4", "▁2"]
    raw = RawTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [("▁", "4"), ("▁", "2")],
                                  unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return HFTokenizer(raw, eos_token="</s>", bos_token="<s>")


def pieces_of(tok: HFTokenizer, ids) -> list[str]:
    return [tok._tok.id_to_token(i) for i in ids]


def test_a_continuation_gets_no_start_of_text_mark():
    tok = dummy_prefix_tokenizer()
    assert tok.marks_text_start and not ByteTokenizer().marks_text_start
    assert pieces_of(tok, tok.encode(" 4")) == ["▁", "▁4"]  # a text of its own: the mark, then the word
    assert pieces_of(tok, encode_continuation(tok, " 4")) == ["▁4"]  # inside a sequence: the word alone
    assert pieces_of(tok, encode_continuation(tok, "4")) == ["4"]
    assert encode_continuation(ByteTokenizer(), " 4") == [32, 52]


def test_a_response_is_encoded_as_it_is_inside_prompt_and_response_together():
    # encoded apart from its prompt, the response " 4" gained a trained '▁' (a second space)
    tok = dummy_prefix_tokenizer()
    config = DataConfig(sections=(Section(field="prompt"), Section(field="response", train=True)))
    (ids, train), = encode_record({"prompt": "2+2=", "response": " 4"}, config, tok, where="x:1")
    assert pieces_of(tok, ids) == ["▁2", "+", "2", "=", "▁4", "</s>"]
    assert list(ids[:-1]) == tok.encode("2+2= 4")
    assert train.tolist() == [False, False, False, False, True, True]
