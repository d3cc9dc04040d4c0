"""Data pipeline: sections -> masks, packing layout, overflow, stores, splits, errors."""

import collections
import dataclasses
import functools
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from jrl.config import ConfigError, DataConfig, ModelConfig, Section
from jrl.data import (
    DataSource, assemble_rows, build_dataset, build_store, doc_pieces, encode_record, load_documents,
    load_tokenizer, open_store, plan_rows, write_store,
)
from jrl.data import bundled
from jrl.data.bundled import DEFAULT_SIZES, load_bundled
from jrl.data.records import is_heldout, iter_located_records
from jrl.data.packing import assemble_pairs, plan_pairs
from jrl.data import pipeline
from jrl.data.pipeline import cache_key
from jrl.data.store import CorruptStoreError, StoreWriteError
from jrl.models import apply, init_params
from unprivileged import unprivileged_prefix

TOK = load_tokenizer("bytes")
SECTIONS = (Section(text="Q:"), Section(field="prompt"), Section(text="A:"), Section(field="response", train=True))


def doc(ids, train=None):
    ids = np.asarray(ids, np.int32)
    return ids, np.ones(len(ids), bool) if train is None else np.asarray(train, bool)


def test_sections_mark_only_trained_pieces_and_eos():
    cfg = DataConfig(sections=SECTIONS)
    [(ids, train)] = encode_record({"prompt": "1+1", "response": 2}, cfg, TOK)
    assert TOK.decode(ids[:-1]) == "Q:1+1A:2"
    assert ids[-1] == TOK.eos_id
    assert train.tolist() == [False] * 7 + [True, True]  # "2" and EOS are trained


def test_text_format_trains_every_token():
    cfg = DataConfig(format="text", add_eos=False)
    [(ids, train)] = encode_record({"text": "abc"}, cfg, TOK)
    assert ids.tolist() == list(b"abc") and train.all()


def test_preference_gives_chosen_then_rejected_with_untrained_prompt():
    cfg = DataConfig(format="preference", sections=(Section(field="prompt"),), add_eos=False)
    (c, ct), (r, rt) = encode_record({"prompt": "p=", "chosen": "1", "rejected": "22"}, cfg, TOK)
    assert TOK.decode(c) == "p=1" and TOK.decode(r) == "p=22"
    assert ct.tolist() == [False, False, True] and rt.tolist() == [False, False, True, True]


def test_preference_pair_with_the_same_response_twice_is_named_by_its_file_line(tmp_path):
    src = tmp_path / "pairs.jsonl"  # DPO would count the pair in its average, with nothing to learn
    src.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
                   '{"prompt": "2+2=", "chosen": "4", "rejected": "4"}\n')
    cfg = DataConfig(source=str(src), format="preference", sections=(Section(field="prompt"),), eval_fraction=0.0)
    with pytest.raises(ConfigError, match=rf"^{src}:2: fields 'chosen' and 'rejected' \(data.chosen_field / "
                                          r"data.rejected_field\) hold the same response '4'; a preference pair "
                                          r"needs two different ones$"):
        load_documents(cfg, TOK, "train")


def test_preference_pair_whose_responses_tokenize_the_same_is_refused_naming_its_file_line(tmp_path):
    # "Yes" and "yes" differ as text, but a lowercasing tokenizer gives both the same ids: two equal rows,
    # counted in DPO's average (and as a wrong preference in reward_accuracy) with nothing to learn
    from tokenizers import Tokenizer as RawTokenizer, models, normalizers
    vocab = {"<unk>": 0, "</s>": 1, **{c: 2 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789+=?")}}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.normalizer = normalizers.Lowercase()
    raw.add_special_tokens(["</s>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path))
    src = tmp_path / "pairs.jsonl"
    src.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
                   '{"prompt": "ok?", "chosen": "Yes", "rejected": "yes"}\n')
    cfg = DataConfig(source=str(src), format="preference", sections=(Section(field="prompt"),), eval_fraction=0.0)
    with pytest.raises(ConfigError) as e:
        load_documents(cfg, tok, "train")
    assert str(e.value) == (f"{src}:2: fields 'chosen' and 'rejected' (data.chosen_field / data.rejected_field) hold "
                            f"'Yes' and 'yes', which the tokenizer encodes to the same tokens; a preference pair "
                            f"needs two different responses")


def test_preference_response_given_as_chat_messages_is_refused_naming_file_line_and_config_key(tmp_path):
    # a file mixing text responses with chat-style ones (as in conversational preference datasets)
    src = tmp_path / "pairs.jsonl"
    src.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
                   '{"prompt": "2+2=", "chosen": "4", "rejected": [{"role": "assistant", "content": "5"}]}\n')
    cfg = DataConfig(source=str(src), format="preference", sections=(Section(field="prompt"),), eval_fraction=0.0)
    with pytest.raises(ConfigError) as e:
        load_documents(cfg, TOK, "train")
    assert str(e.value) == (f"{src}:2: field 'rejected' (data.rejected_field) is a list; data.format 'preference' takes "
                            f"each response as one text (a string or number), not chat messages")


def test_preference_empty_response_without_eos_is_refused_naming_the_field():
    cfg = DataConfig(format="preference", sections=(Section(field="prompt"),), add_eos=False)
    with pytest.raises(ConfigError, match=r"^rec 5: field 'rejected' \(data.rejected_field\) is empty, so there is "
                                          r"nothing to score \(data.add_eos is false\)$"):
        encode_record({"prompt": "p=", "chosen": "1", "rejected": ""}, cfg, TOK, where="rec 5")


def test_preference_empty_response_with_eos_scores_the_eos():
    cfg = DataConfig(format="preference", sections=(Section(field="prompt"),))
    (_, ct), (r, rt) = encode_record({"prompt": "p=", "chosen": "1", "rejected": ""}, cfg, TOK)
    assert r[rt].tolist() == [TOK.eos_id] and ct.sum() == 2


def test_chat_trains_assistant_content_and_closing_eos_only():
    cfg = DataConfig(format="chat")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6"}]
    [(ids, train)] = encode_record({"messages": messages}, cfg, TOK)
    assert TOK.decode(ids) == TOK.apply_chat_template(messages)
    assert TOK.decode(ids[train]) == "4<eos>6<eos>"


def test_chat_trains_the_content_of_a_trained_role_other_than_assistant():
    cfg = DataConfig(format="chat", train_roles=("assistant", "tool"))
    messages = [{"role": "user", "content": "look up abc"}, {"role": "assistant", "content": "call"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "it is 42"}]
    [(ids, train)] = encode_record({"messages": messages}, cfg, TOK)
    assert TOK.decode(ids) == TOK.apply_chat_template(messages)
    assert TOK.decode(ids[train]) == "call<eos>42<eos>it is 42<eos>"


# ----------------------------------------------------------------------------- data.add_bos
# ids of the byte tokenizer: <pad> 256, <bos> 257, <eos> 258; 'a' 97, 'b' 98, 'c' 99


def test_add_bos_opens_a_text_document_with_the_bos_untrained():
    # Hugging Face base models were pretrained with BOS at every document's start; the BOS
    # is context (never a target), the first text token is now predicted from it
    cfg = DataConfig(format="text", add_bos=True)
    [(ids, train)] = encode_record({"text": "ab"}, cfg, TOK)
    assert ids.tolist() == [257, 97, 98, 258]
    assert train.tolist() == [False, True, True, True]


def test_add_bos_is_off_by_default():
    [(ids, _)] = encode_record({"text": "ab"}, DataConfig(format="text"), TOK)
    assert ids.tolist() == [97, 98, 258]


def test_add_bos_opens_a_sections_document_before_its_first_piece():
    cfg = DataConfig(sections=SECTIONS, add_bos=True)
    [(ids, train)] = encode_record({"prompt": "1", "response": "2"}, cfg, TOK)
    assert ids.tolist() == [257, 81, 58, 49, 65, 58, 50, 258]  # <bos> Q : 1 A : 2 <eos>
    assert train.tolist() == [False] * 6 + [True, True]


def test_add_bos_opens_both_documents_of_a_preference_pair_once():
    cfg = DataConfig(format="preference", sections=(Section(field="prompt"),), add_bos=True, add_eos=False)
    (c, ct), (r, rt) = encode_record({"prompt": "p", "chosen": "1", "rejected": "22"}, cfg, TOK)
    assert c.tolist() == [257, 112, 49] and r.tolist() == [257, 112, 50, 50]
    assert ct.tolist() == [False, False, True] and rt.tolist() == [False, False, True, True]


def test_add_bos_leaves_a_chat_document_with_the_templates_single_bos():
    # the chat template writes the BOS itself (as add_eos, add_bos does not apply to chat)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    [(ids, _)] = encode_record({"messages": messages}, DataConfig(format="chat", add_bos=True), TOK)
    [(plain, _)] = encode_record({"messages": messages}, DataConfig(format="chat"), TOK)
    assert ids.tolist() == plain.tolist() == [257, 260, 10, 97, 258, 261, 10, 98, 258]


def test_add_bos_comes_before_the_start_of_text_mark_of_a_sentencepiece_tokenizer():
    # Llama-2's tokenizer(text) gives <s> then the text as a text of its own ('▁' before it),
    # not as a continuation: what the server's default encoding of a text prompt gives
    from tokenizers import Tokenizer as RawTokenizer, models, normalizers
    from jrl.tokenizer import HFTokenizer
    pieces = ["<unk>", "<s>", "</s>", "<0x0A>", "▁", "2", "+", "=", "4", "▁4", "▁2"]
    raw = RawTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [("▁", "4"), ("▁", "2")],
                                  unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok = HFTokenizer(raw, eos_token="</s>", bos_token="<s>")
    cfg = DataConfig(sections=(Section(field="prompt"), Section(field="response", train=True)), add_bos=True)
    [(ids, train)] = encode_record({"prompt": "2+2=", "response": " 4"}, cfg, tok)
    assert ids.tolist() == [1, 10, 6, 5, 7, 9, 2]  # <s> ▁2 + 2 = ▁4 </s>
    assert train.tolist() == [False] * 5 + [True, True]


def test_add_bos_is_what_a_hugging_face_tokenizer_prepends_with_its_special_tokens(tmp_path):
    from chat_fixtures import write_chat_tokenizer
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok", bos="<s>")))
    cfg = DataConfig(format="text", add_bos=True, add_eos=False)
    [(ids, _)] = encode_record({"text": "the cat sat"}, cfg, tok)
    assert ids[0] == tok.bos_id == 3 and ids.tolist() == tok.encode("the cat sat", add_special_tokens=True)


def test_add_bos_with_a_tokenizer_without_bos_is_a_config_error(tmp_path):
    from chat_fixtures import write_chat_tokenizer
    tok_dir = write_chat_tokenizer(tmp_path / "tok")  # Qwen-like: no bos_token
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "the cat"}\n')
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, add_bos=True, tokenizer=str(tok_dir))
    with pytest.raises(ConfigError) as e:
        load_documents(cfg, load_tokenizer(str(tok_dir)), "train")
    assert str(e.value) == (f"data.add_bos: the tokenizer {str(tok_dir)!r} (data.tokenizer) has no BOS token "
                            f"(no bos_token in its tokenizer_config.json); set data.add_bos: false")


def test_add_bos_with_a_chat_format_needs_no_bos_token(tmp_path):
    # chat ignores add_bos: a tokenizer without BOS (ChatML's) is not refused for it
    from chat_fixtures import write_chat_tokenizer
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok")))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "5"}]
    [(ids, _)] = encode_record({"messages": messages}, DataConfig(format="chat", add_bos=True), tok)
    assert tok.decode(ids) == tok.apply_chat_template(messages)


def test_packed_rows_keep_each_documents_bos_and_eos_in_its_own_segment(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "ab"}\n{"text": "c"}\n')
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, add_bos=True, seq_len=10, shuffle=False)
    dataset = build_dataset(cfg, TOK, "train")
    assert len(dataset) == 1
    row = {k: v[0].tolist() for k, v in dataset.rows(np.array([0])).items()}
    assert row["tokens"] == [257, 97, 98, 258, 257, 99, 258, 256, 256, 256]
    assert row["segment_ids"] == [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]
    assert row["positions"] == [0, 1, 2, 3, 0, 1, 2, 0, 0, 0]
    # each document's text is predicted from its own BOS; no EOS predicts the next BOS
    assert row["targets"] == [97, 98, 258, 256, 99, 258, 256, 256, 256, 256]
    assert row["loss_mask"] == [1, 1, 1, 0, 1, 1, 0, 0, 0, 0]


def test_add_bos_is_in_the_cache_key():
    cfg = DataConfig(source="bundled:tinytext:20", format="text")
    assert cache_key(dataclasses.replace(cfg, add_bos=True), TOK, "train") != cache_key(cfg, TOK, "train")


def test_a_cache_written_before_add_bos_existed_is_still_read():
    # the default (false) leaves the key as it was, so existing token stores are reused
    for format, train, held_out in [("text", "f2e68f399ea11ecdf6ae", "fb9bb155a8cbecdcd69e"),
                                    ("sections", "37c3d8185a855486c2de", "8b291a8bc3b2915e6ca6")]:
        cfg = DataConfig(source="bundled:tinytext:20", format=format)
        assert (cache_key(cfg, TOK, "train"), cache_key(cfg, TOK, "eval")) == (train, held_out)


def test_a_bundled_generators_version_is_in_the_cache_key(monkeypatch):
    # a store cached from a generator's earlier records must not be served once it draws
    # other ones (arithmetic's records changed when it stopped repeating them)
    cfg = DataConfig(source="bundled:arithmetic:50", sections=SECTIONS)
    before = cache_key(cfg, TOK, "train")
    monkeypatch.setitem(bundled.GENERATOR_VERSIONS, "arithmetic", bundled.GENERATOR_VERSIONS["arithmetic"] + 1)
    assert cache_key(cfg, TOK, "train") != before
    other = DataConfig(source="bundled:tinytext:20", format="text")  # its generator unchanged
    assert cache_key(other, TOK, "train") == "f2e68f399ea11ecdf6ae"


def test_add_bos_does_not_change_a_chat_cache_key():
    # chat documents are the same with it (the template places the BOS): their store is reused
    cfg = DataConfig(source="bundled:tinytext:20", format="chat")
    assert cache_key(dataclasses.replace(cfg, add_bos=True), TOK, "train") == cache_key(cfg, TOK, "train")


def test_chat_rejects_malformed_messages():
    with pytest.raises(ValueError, match=r"field 'messages' \(data.messages_field\) must be a non-empty list"):
        encode_record({"messages": []}, DataConfig(format="chat"), TOK)


def test_chat_message_without_string_content_is_named_by_its_index():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    with pytest.raises(ConfigError, match=r"^rec 2: field 'messages' \(data.messages_field\): message 1: 'content' "
                                          r"must be a string, got null$"):
        encode_record({"messages": messages}, DataConfig(format="chat"), TOK, where="rec 2")


def test_chat_role_the_template_rejects_is_named_by_its_file_line(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
                   '{"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(ConfigError, match=rf"^{src}:2: field 'messages' \(data.messages_field\): default chat "
                                          r"template: unknown role robot; allowed: system, user, assistant, tool$"):
        load_documents(DataConfig(source=str(src), format="chat", eval_fraction=0.0), TOK, "train")


def test_chat_data_a_chat_template_fails_on_is_named_by_its_file_line(tmp_path):
    # before: jinja's UndefinedError (a message field the template reads that the records lack)
    # escaped as a traceback naming neither the record nor the field
    from chat_fixtures import write_chat_tokenizer
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['name'] + '\\n' + m['content'] }}"
                "{% endfor %}")
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok", template=template)))
    src = tmp_path / "chat.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(src), format="chat", eval_fraction=0.0), tok, "train")
    assert str(e.value) == (f"{src}:1: field 'messages' (data.messages_field): UndefinedError: 'dict object' has "
                            f"no attribute 'name'")


def test_missing_field_error_names_field_and_config_key():
    with pytest.raises(ValueError, match=r"missing field 'response' \(data.sections\[1\].field\)"):
        encode_record({"prompt": "x"}, DataConfig(), TOK, where="rec 3")


def test_a_nan_field_is_refused_not_trained_as_text(tmp_path):
    src = tmp_path / "sft.jsonl"
    src.write_text('{"prompt": "1/0=", "response": NaN}\n')
    with pytest.raises(ConfigError, match=rf"^{src}:1: field 'response' must be a string or finite number, got nan$"):
        load_documents(DataConfig(source=str(src), eval_fraction=0.0), TOK, "train")


def test_a_numeric_field_is_trained_as_the_file_writes_it(tmp_path):
    # before: Python's str of the parsed number ('1e-07', '0.5', '0', '100.0'), text the file never had
    src = tmp_path / "sft.jsonl"
    src.write_text('{"prompt": "a=", "response": 1e-7}\n{"prompt": "b=", "response": 0.50}\n'
                   '{"prompt": "c=", "response": -0}\n{"prompt": "d=", "response": 12}\n'
                   '{"prompt": "e=", "response": 1E+2}\n')
    store = load_documents(DataConfig(source=str(src), eval_fraction=0.0, add_eos=False), TOK, "train")
    texts = [TOK.decode(store.doc(i)[0]) for i in range(len(store))]
    assert texts == ["a=1e-7", "b=0.50", "c=-0", "d=12", "e=1E+2"]


def test_row_layout_segments_positions_targets_and_mask():
    store = build_store([doc([10, 11, 12], [0, 1, 1]), doc([20, 21], [0, 1])])
    plan = plan_rows(store.lengths, 8, pack=True, overflow="truncate_right")
    assert len(plan) == 1
    row = {k: v[0].tolist() for k, v in assemble_rows(store, plan, np.array([0]), 8, pad_id=0).items()}
    assert row["tokens"] == [10, 11, 12, 20, 21, 0, 0, 0]
    assert row["segment_ids"] == [1, 1, 1, 2, 2, 0, 0, 0]
    assert row["positions"] == [0, 1, 2, 0, 1, 0, 0, 0]
    # a document's last token has no target: nothing is predicted across the boundary
    assert row["targets"] == [11, 12, 0, 21, 0, 0, 0, 0]
    assert row["loss_mask"] == [1, 1, 0, 1, 0, 0, 0, 0]


def test_without_packing_each_document_gets_its_own_row():
    store = build_store([doc([1, 2]), doc([3, 4])])
    assert len(plan_rows(store.lengths, 8, pack=False, overflow="truncate_right")) == 2
    assert len(plan_rows(store.lengths, 8, pack=True, overflow="truncate_right")) == 1


def test_overflow_policies():
    assert doc_pieces(10, 4, "truncate_right") == [(0, 4)]
    assert doc_pieces(10, 4, "truncate_left") == [(6, 4)]
    assert doc_pieces(10, 4, "drop") == []
    assert doc_pieces(10, 4, "split") == [(0, 4), (3, 4), (6, 4)]


def test_split_packing_trains_every_target_exactly_once():
    lengths = [13, 3, 7, 1, 5]
    store = build_store([doc(np.arange(n) + 100 * (d + 1)) for d, n in enumerate(lengths)])
    plan = plan_rows(store.lengths, 6, pack=True, overflow="split")
    rows = assemble_rows(store, plan, np.arange(len(plan)), 6, pad_id=0)
    trained = sorted(rows["targets"][rows["loss_mask"] > 0].tolist())
    expected = sorted(int(t) for d, n in enumerate(lengths) for t in np.arange(1, n) + 100 * (d + 1))
    assert trained == expected


def test_packed_documents_do_not_attend_to_each_other():
    cfg = ModelConfig(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, intermediate_size=64)
    params = jax.jit(functools.partial(init_params, cfg))(jax.random.key(0))
    forward = jax.jit(functools.partial(apply, cfg))
    a, b1, b2 = doc([5, 6, 7, 8]), doc([40, 41, 42]), doc([90, 91, 92, 93])
    outs = []
    for other in (b1, b2):
        store = build_store([other, a])  # `a` packed after a different neighbour
        plan = plan_rows(store.lengths, 12, pack=True, overflow="truncate_right")
        row = assemble_rows(store, plan, np.array([0]), 12, pad_id=0)
        logits = forward(params, row["tokens"], row["positions"], row["segment_ids"])
        outs.append(np.asarray(logits[0, row["segment_ids"][0] == 2]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_pairs_layout():
    store = build_store([doc([1, 2, 3], [0, 1, 1]), doc([1, 4], [0, 1])])
    plan = plan_pairs(store.lengths, 4, overflow="truncate_left")
    out = assemble_pairs(store, plan, np.array([0]), 4, pad_id=0)
    assert out["tokens"].shape == (1, 2, 4)
    assert out["tokens"][0].tolist() == [[1, 2, 3, 0], [1, 4, 0, 0]]
    assert out["loss_mask"][0].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_memmap_store_round_trip(tmp_path):
    docs = [doc([1, 2, 3], [0, 1, 1]), doc([7]), doc([8, 9])]
    write_store(tmp_path / "s", iter(docs), {"note": "test"})
    store = open_store(tmp_path / "s")
    assert isinstance(store.tokens, np.memmap)
    assert store.lengths.tolist() == [3, 1, 2]
    for i, (ids, train) in enumerate(docs):
        got_ids, got_train = store.doc(i)
        assert got_ids.tolist() == ids.tolist() and got_train.astype(bool).tolist() == train.tolist()
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["n_tokens"] == 6


def test_cache_dir_reuses_the_tokenised_store(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{i}+", "response": str(i)}) + "\n" for i in range(20)))
    cfg = DataConfig(source=str(src), cache_dir=str(tmp_path / "cache"), eval_fraction=0.0)
    first = load_documents(cfg, TOK, "train")
    assert isinstance(first.tokens, np.memmap)
    [cached] = list((tmp_path / "cache").iterdir())
    stamp = (cached / "tokens.bin").stat().st_mtime_ns
    second = load_documents(cfg, TOK, "train")
    assert (cached / "tokens.bin").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(first.tokens, second.tokens)


def test_heldout_split_is_disjoint_and_covers_all_records():
    cfg = DataConfig(source="bundled:arithmetic:400", eval_fraction=0.25, add_eos=False)
    train = load_documents(cfg, TOK, "train")
    held = load_documents(cfg, TOK, "eval")
    assert 60 <= len(held) <= 140
    text = lambda store: {TOK.decode(store.doc(i)[0]) for i in range(len(store))}
    records = {r["prompt"] + r["response"] for r in load_bundled(cfg.source)}
    assert text(train) | text(held) == records and not text(train) & text(held)


def test_a_held_out_record_identical_to_a_training_one_is_left_out_of_the_eval_split(tmp_path):
    # the split was by record index alone: a record repeated in the file was evaluated on
    # the copies held out while the model trained on the others
    records = [{"prompt": f"{i % 10}+1=", "response": str(i % 10 + 1)} for i in range(60)]  # each 6 times
    records += [{"prompt": f"{i}+2=", "response": str(i + 2)} for i in range(10, 70)]  # each once
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source=str(src), eval_fraction=0.3, add_eos=False)
    by_index = [is_heldout(i, cfg.seed, 0.3) for i in range(len(records))]  # the rule, by record index
    trained = [r for r, out in zip(records, by_index) if not out]
    want = [r["prompt"] + r["response"] for r, out in zip(records, by_index) if out and r not in trained]
    assert sum(by_index) > len(want) > 10  # some held-out records have a training copy, others none
    held = load_documents(cfg, TOK, "eval")
    assert [TOK.decode(held.doc(i)[0]) for i in range(len(held))] == want


def test_jsonl_errors_name_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_documents(DataConfig(source=str(src), eval_fraction=0.0), TOK, "train")


def test_a_utf8_byte_order_mark_opening_the_file_is_skipped(tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"text": "ab"}\r\n{"text": "cd"}\r\n')
    store = load_documents(DataConfig(source=str(src), format="text", eval_fraction=0.0), TOK, "train")
    assert [TOK.decode(store.doc(i)[0]) for i in range(len(store))] == ["ab<eos>", "cd<eos>"]


def test_a_line_that_is_not_utf8_is_named_by_its_file_line(tmp_path):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(ConfigError, match=rf"^{src}:2: not valid UTF-8 \(invalid continuation byte at byte 15\)$"):
        load_documents(DataConfig(source=str(src), sections=SECTIONS, eval_fraction=0.0), TOK, "train")


@pytest.mark.parametrize("suffix, kind", [(".gz", "a gzip"), (".bz2", "a bzip2"), (".xz", "an xz")])
def test_a_compressed_data_file_is_named_as_compressed(tmp_path, suffix, kind):
    # before: 'not valid UTF-8 (invalid start byte at byte 1)' or 'not valid JSON' at line 1
    import bz2, gzip, lzma
    src = tmp_path / f"train.jsonl{suffix}"
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix]
    with opener(src, "wt") as f:
        f.write('{"prompt": "a", "response": "b"}\n' * 20)
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(src), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == f"{src}: {kind}-compressed file; data files are read uncompressed: decompress it first"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be"])
def test_a_utf16_data_file_is_named_as_utf16(tmp_path, encoding):
    # before: 'not valid UTF-8 (invalid start byte at byte 0)' (Windows editors save UTF-16)
    src = tmp_path / "train.jsonl"
    src.write_bytes(("\ufeff" if encoding == "utf-16-be" else "").encode(encoding)
                    + '{"prompt": "a", "response": "b"}\n'.encode(encoding))
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(src), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == f"{src}: UTF-16 text (it opens with UTF-16's byte order mark); data files are UTF-8: save it as UTF-8"


def test_a_data_file_whose_lines_end_in_cr_only_is_named_as_such(tmp_path):
    # before: 'line 1: not valid JSON (Extra data)' for a file of good records (classic Mac line ends)
    src = tmp_path / "train.jsonl"
    src.write_bytes(b'{"prompt": "a", "response": "b"}\r{"prompt": "c", "response": "d"}\r')
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(src), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == (f"{src}:1: not valid JSON (Extra data); its lines end in a carriage return alone (CR): "
                            "JSONL lines end in LF or CRLF")


def test_a_string_with_half_a_surrogate_pair_is_named_by_its_file_line(tmp_path):
    src = tmp_path / "cut.jsonl"
    src.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "cut \\ud83d"}\n')
    with pytest.raises(ConfigError, match=rf"^{src}:2: not valid Unicode text: \\ud83d is half of a UTF-16 "
                                          r"surrogate pair without its other half$"):
        load_documents(DataConfig(source=str(src), format="text", eval_fraction=0.0), TOK, "train")


def test_a_record_missing_a_field_is_named_by_its_file_line(tmp_path):
    src = tmp_path / "sft.jsonl"  # the blank line counts: the error is where an editor shows it
    src.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c"}\n')
    with pytest.raises(ConfigError, match=rf"{src}:3: missing field 'response' \(data.sections\[3\].field\)"):
        load_documents(DataConfig(source=str(src), sections=SECTIONS, eval_fraction=0.0), TOK, "train")


@pytest.mark.parametrize("split,key", [("train", "data.source"), ("eval", "data.eval_source")])
def test_a_missing_data_file_is_named_by_its_config_field(tmp_path, split, key):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "response": "b"}\n')
    missing = str(tmp_path / "nope.jsonl")
    paths = {"source": missing, "eval_source": str(good)} if split == "train" else {"source": str(good),
                                                                                     "eval_source": missing}
    with pytest.raises(ConfigError, match=rf"^{key}: no such file '{missing}'$"):
        load_documents(DataConfig(**paths), TOK, split)


def test_a_directory_given_as_data_file_is_named_as_a_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(tmp_path), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == (f"data.source: '{tmp_path}' is a directory; give a file, a list of files or a glob "
                            f"pattern such as '{tmp_path}/*.jsonl'")


def test_a_pipe_given_as_data_file_is_named_as_not_a_regular_file(tmp_path):
    # before: 'no such file' for a path that exists (a named pipe, or <(zcat x.jsonl.gz)), which a run reads more than once
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(fifo), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == (f"data.source: '{fifo}' is not a regular file (a pipe or a device, which a run cannot "
                            f"read more than once); give a file")


def test_a_link_to_a_missing_file_is_named_as_such(tmp_path):
    link = tmp_path / "train.jsonl"
    link.symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(link), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == f"data.source: '{link}' is a link to {str(tmp_path / 'gone.jsonl')!r}, which does not exist"


@pytest.mark.parametrize("text,overflow,why", [
    ("\n", "truncate_right", "it has no records"),
    ('{"prompt": "a long prompt", "response": "b"}\n', "drop", "its document is longer than data.seq_len=8"),
])
def test_training_data_without_rows_is_named(tmp_path, text, overflow, why):
    src = tmp_path / "train.jsonl"
    src.write_text(text)
    cfg = DataConfig(source=str(src), sections=SECTIONS, eval_fraction=0.0, seq_len=8, overflow=overflow)
    with pytest.raises(ConfigError, match=rf"^data.source: '{src}' gives no training rows: {why}"):
        build_dataset(cfg, TOK, "train")


def test_training_data_all_held_out_by_eval_fraction_is_named_as_such(tmp_path):
    # it said "it has no records" about a file that has them
    src = tmp_path / "train.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n' * 2)
    cfg = DataConfig(source=str(src), sections=SECTIONS, eval_fraction=0.99, seq_len=8)
    with pytest.raises(ConfigError) as e:
        build_dataset(cfg, TOK, "train")
    assert str(e.value) == (f"data.source: '{src}' gives no training rows: data.eval_fraction=0.99 holds out every "
                            f"one of its records; lower it or give the held-out records as data.eval_source")


def test_an_eval_source_without_rows_is_named(tmp_path):
    # it used to give no held-out batches silently: no eval rows, early stopping never firing
    src, held = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n')
    held.write_text("")
    cfg = DataConfig(source=str(src), eval_source=str(held), sections=SECTIONS)
    with pytest.raises(ConfigError, match=rf"^data.eval_source: '{held}' gives no held-out rows: it has no records$"):
        build_dataset(cfg, TOK, "eval")


def test_chat_data_without_a_trained_role_is_named(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    cfg = DataConfig(source=str(src), format="chat", train_roles=("assistent",), eval_fraction=0.0)
    with pytest.raises(ConfigError, match=rf"^data.source: '{src}' has nothing to train on: none of its records "
                                          rf"trains a token, the first at {src}:1: none of its messages has a role in "
                                          r"data.train_roles=\['assistent'\]$"):
        build_dataset(cfg, TOK, "train")


@pytest.mark.parametrize("data_format", ["sections", "chat"])
def test_training_data_whose_every_trained_token_truncation_cuts_away_is_refused(tmp_path, data_format):
    # before: the run trained on rows whose loss mask is all zero (a chat dry run blamed train_roles)
    src = tmp_path / "train.jsonl"
    record = ({"prompt": "x" * 40, "response": "b"} if data_format == "sections" else
              {"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "b"}]})
    src.write_text(json.dumps(record) + "\n")
    cfg = DataConfig(source=str(src), format=data_format, seq_len=16, eval_fraction=0.0)
    from jrl.data.pipeline import check_records
    for fn in (build_dataset, check_records):  # the run, and the dry run's check
        with pytest.raises(ConfigError) as e:
            fn(cfg, TOK, "train")
        assert str(e.value).startswith(f"data.source: '{src}' has nothing to train on: none of its records trains a "
                                       f"token, the first at {src}:1: its ")
        assert str(e.value).endswith("tokens are more than data.seq_len=16 and data.overflow='truncate_right' keeps "
                                     "none of its trained ones")


def write_chat_with_untrained_records(src):
    """Line 1 trains the assistant's answer; lines 3 and 4 (after a blank line) have no assistant turn."""
    user = {"role": "user", "content": "a"}
    src.write_text(json.dumps({"messages": [user, {"role": "assistant", "content": "b"}]}) + "\n\n"
                   + (json.dumps({"messages": [user]}) + "\n") * 2)


def one_warning(fn, *args):
    """(fn(*args), the message of the one warning it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    assert len(caught) == 1, [str(w.message) for w in caught]
    return out, str(caught[0].message)


def test_chat_records_that_train_nothing_get_one_warning_naming_the_first(tmp_path):
    # a record without an assistant turn added no trained token, and nothing said so
    src = tmp_path / "chat.jsonl"
    write_chat_with_untrained_records(src)
    cfg = DataConfig(source=str(src), format="chat", eval_fraction=0.0)
    dataset, message = one_warning(build_dataset, cfg, TOK, "train")
    assert message == (f"data.source: 2 of the 3 training records of '{src}' train nothing, the "
                       f"first at {src}:3: none of its messages has a role in "
                       f"data.train_roles=['assistant']")
    assert len(dataset.store) == 3


def test_a_reused_cache_repeats_the_warning_about_records_that_train_nothing(tmp_path):
    src = tmp_path / "chat.jsonl"
    write_chat_with_untrained_records(src)
    cfg = DataConfig(source=str(src), format="chat", eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    messages = []
    for _ in range(2):  # writes the store, then reads it back
        messages.append(one_warning(build_dataset, cfg, TOK, "train")[1])
    assert messages[0] == messages[1] and f"the first at {src}:3:" in messages[0]


def test_a_dry_run_check_warns_about_records_that_train_nothing(tmp_path):
    from jrl.data.pipeline import check_records

    src = tmp_path / "chat.jsonl"
    write_chat_with_untrained_records(src)
    cfg = DataConfig(source=str(src), format="chat", eval_fraction=0.0)
    checked, message = one_warning(check_records, cfg, TOK, "train")
    assert (checked.source, checked.records) == (str(src), 3)
    assert message.startswith("data.source: 2 of the 3 training records")


def test_sections_records_with_an_empty_trained_field_get_the_warning(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": ""}\n')
    cfg = DataConfig(source=str(src), sections=SECTIONS, add_eos=False, eval_fraction=0.0)
    _, message = one_warning(build_dataset, cfg, TOK, "train")
    assert message == (f"data.source: 1 of the 2 training records of '{src}' trains nothing, the "
                       f"first at {src}:2: its trained sections (data.sections) are empty "
                       f"and data.add_eos is false")


def test_a_prompt_that_truncation_keeps_in_place_of_the_response_gets_the_warning(tmp_path):
    # truncate_right kept the first seq_len tokens, all prompt: the record trained nothing, silently
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"prompt": "x" * 40, "response": "b"}) + "\n" + '{"prompt": "a", "response": "b"}\n')
    cfg = DataConfig(source=str(src), sections=SECTIONS, seq_len=16, eval_fraction=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_dataset(cfg, TOK, "train")
    untrained, truncated = [str(w.message) for w in caught]  # the second: what truncation drops
    assert untrained == (f"data.source: 1 of the 2 training records of '{src}' trains nothing, the first "
                         f"at {src}:1: its 46 tokens are more than data.seq_len=16 and "
                         f"data.overflow='truncate_right' keeps none of its trained ones")
    assert truncated.startswith(f"data.source: 1 of the 2 training documents of '{src}' is longer than")


def long_prompt_records(tmp_path):
    """Line 1: a 40-byte prompt and a 1-byte response (46 tokens with the sections and EOS); line 2: a short record."""
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"prompt": "x" * 40, "response": "b"}) + "\n" + '{"prompt": "a", "response": "b"}\n')
    return src


def warning_messages(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [str(w.message) for w in caught]


def test_a_reused_cache_counts_the_records_that_train_nothing_again_for_a_new_seq_len(tmp_path):
    # the store (whose key has no seq_len) kept the count of the run that wrote it: none
    src = long_prompt_records(tmp_path)
    cfg = DataConfig(source=str(src), sections=SECTIONS, seq_len=64, eval_fraction=0.0,
                     cache_dir=str(tmp_path / "cache"))
    assert warning_messages(build_dataset, cfg, TOK, "train") == []
    short = dataclasses.replace(cfg, seq_len=16)
    reused = warning_messages(build_dataset, short, TOK, "train")
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the same store
    assert reused == warning_messages(build_dataset, dataclasses.replace(short, cache_dir=None), TOK, "train")
    assert reused[0] == (f"data.source: 1 of the 2 training records of '{src}' trains nothing, the first "
                         f"at {src}:1: its 46 tokens are more than data.seq_len=16 and "
                         f"data.overflow='truncate_right' keeps none of its trained ones")


def test_a_reused_cache_drops_the_warning_where_a_new_overflow_keeps_the_trained_tokens(tmp_path):
    src = long_prompt_records(tmp_path)
    cfg = DataConfig(source=str(src), sections=SECTIONS, seq_len=16, eval_fraction=0.0,
                     cache_dir=str(tmp_path / "cache"))
    assert "trains nothing" in warning_messages(build_dataset, cfg, TOK, "train")[0]
    # truncate_left keeps the response: the only warning left is the truncation's
    [message] = warning_messages(build_dataset, dataclasses.replace(cfg, overflow="truncate_left"), TOK, "train")
    assert message.startswith(f"data.source: 1 of the 2 training documents of '{src}' is longer than data.seq_len=16 "
                              f"and data.overflow='truncate_left' drops 30 of the 53 tokens")


@pytest.mark.parametrize("overflow", ["truncate_right", "truncate_left", "drop", "split"])
@pytest.mark.parametrize("pack", [False, True])
def test_trained_targets_kept_agrees_with_keeps_a_trained_target_for_every_document(overflow, pack):
    from jrl.data.packing import keeps_a_trained_target, trained_targets_kept

    rng = np.random.default_rng(0)
    docs = [doc(rng.integers(0, 9, n), rng.random(n) < p) for n in [0, 1, 2, 3, 5, 8, 9, 13, 30] * 6
            for p in (0.0, 0.1, 0.5)]
    store = build_store(docs)
    expected = [keeps_a_trained_target(train, 8, overflow, pack=pack) for _, train in docs]
    assert trained_targets_kept(store, 8, overflow, pack=pack, chunk_tokens=7).tolist() == expected


def long_prompt_pairs(tmp_path, overflow):
    src = tmp_path / "pairs.jsonl"
    src.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
                   + json.dumps({"prompt": "x" * 40, "chosen": "2", "rejected": "3"}) + "\n")
    return src, DataConfig(source=str(src), format="preference", sections=(Section(field="prompt"),), seq_len=16,
                           overflow=overflow, eval_fraction=0.0)


def test_a_pair_whose_response_truncation_cuts_away_is_refused_naming_file_line_and_field(tmp_path):
    # both responses were cut off: a pair of two equal rows, counted in DPO's average as a wrong preference
    src, cfg = long_prompt_pairs(tmp_path, "truncate_right")
    with pytest.raises(ConfigError) as e:
        build_dataset(cfg, TOK, "train")
    assert str(e.value) == (f"{src}:2: field 'chosen' (data.chosen_field): the prompt and response are 42 tokens and "
                            f"data.overflow='truncate_right' at data.seq_len=16 keeps none of the response, so the pair "
                            f"carries no preference; raise data.seq_len, or set data.overflow to 'truncate_left' "
                            f"(keeps the end) or 'drop'")


def test_a_pair_whose_responses_differ_only_past_seq_len_is_refused_naming_file_line(tmp_path):
    # truncation kept the same 16 tokens of both: two equal rows, counted in DPO's average
    src = tmp_path / "pairs.jsonl"
    src.write_text(json.dumps({"prompt": "1+1=", "chosen": "y" * 20 + "a", "rejected": "y" * 20 + "bc"}) + "\n")
    cfg = DataConfig(source=str(src), format="preference", sections=(Section(field="prompt"),), seq_len=16,
                     eval_fraction=0.0)
    with pytest.raises(ConfigError) as e:
        build_dataset(cfg, TOK, "train")
    assert str(e.value) == (f"{src}:1: fields 'chosen' and 'rejected' (data.chosen_field / data.rejected_field) differ "
                            f"only in tokens that data.overflow='truncate_right' at data.seq_len=16 cuts away, so the "
                            f"pair carries no preference; raise data.seq_len, or set data.overflow to 'drop'")


def refusal_with_and_without_the_cache(cached):
    """The ConfigError message of `cached` (a config whose cache_dir holds one store, built
    under other settings), after checking that an uncached build refuses the same way and
    that the store was reused, not rebuilt."""
    with pytest.raises(ConfigError) as uncached:
        build_dataset(dataclasses.replace(cached, cache_dir=None), TOK, "train")
    with pytest.raises(ConfigError) as e:
        build_dataset(cached, TOK, "train")
    assert len(list(Path(cached.cache_dir).iterdir())) == 1  # the same store
    assert str(e.value) == str(uncached.value)
    return str(e.value)


def test_a_reused_cache_refuses_a_pair_whose_response_a_new_seq_len_cuts_away_as_an_uncached_run_does(tmp_path):
    # the store was written (and its pairs checked) at seq_len 64: reused at 16 it was trained on silently
    src, cfg = long_prompt_pairs(tmp_path, "truncate_right")
    cached = dataclasses.replace(cfg, seq_len=64, cache_dir=str(tmp_path / "cache"))
    assert len(build_dataset(cached, TOK, "train")) == 2
    assert refusal_with_and_without_the_cache(dataclasses.replace(cached, seq_len=16)) == (
        f"{src}:2: field 'chosen' (data.chosen_field): the prompt and response are 42 tokens and "
        f"data.overflow='truncate_right' at data.seq_len=16 keeps none of the response, so the pair carries no "
        f"preference; raise data.seq_len, or set data.overflow to 'truncate_left' (keeps the end) or 'drop'")


def test_a_reused_cache_refuses_a_pair_whose_responses_a_new_overflow_keeps_equal_as_an_uncached_run_does(tmp_path):
    # written under drop (which leaves the long pair out): truncate_right keeps the same 16 tokens of both
    src = tmp_path / "pairs.jsonl"
    src.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
                   + json.dumps({"prompt": "1+1=", "chosen": "y" * 20 + "a", "rejected": "y" * 20 + "bc"}) + "\n")
    cfg = DataConfig(source=str(src), format="preference", sections=(Section(field="prompt"),), seq_len=16,
                     overflow="drop", eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="data.overflow='drop' leaves it out"):
        assert len(build_dataset(cfg, TOK, "train")) == 1
    assert refusal_with_and_without_the_cache(dataclasses.replace(cfg, overflow="truncate_right")) == (
        f"{src}:2: fields 'chosen' and 'rejected' (data.chosen_field / data.rejected_field) differ only in tokens "
        f"that data.overflow='truncate_right' at data.seq_len=16 cuts away, so the pair carries no preference; "
        f"raise data.seq_len, or set data.overflow to 'drop'")


def test_a_reused_cache_keeps_pairs_that_truncate_left_keeps_apart(tmp_path):
    # the check of a reused store refuses no more than an uncached run: truncate_left keeps both responses
    _, cfg = long_prompt_pairs(tmp_path, "truncate_right")
    cached = dataclasses.replace(cfg, seq_len=64, cache_dir=str(tmp_path / "cache"))
    assert len(build_dataset(cached, TOK, "train")) == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "data.source: .* longer than data.seq_len")
        assert len(build_dataset(dataclasses.replace(cached, seq_len=16, overflow="truncate_left"), TOK, "train")) == 2


@pytest.mark.parametrize("overflow", ["truncate_right", "truncate_left", "drop"])
def test_trained_targets_kept_of_first_pieces_agrees_with_keeps_a_trained_target(overflow):
    from jrl.data.packing import keeps_a_trained_target, trained_targets_kept

    rng = np.random.default_rng(1)
    docs = [doc(rng.integers(0, 9, n), rng.random(n) < p) for n in [0, 1, 2, 3, 5, 8, 9, 13, 30] * 6
            for p in (0.0, 0.1, 0.5)]
    expected = [keeps_a_trained_target(train, 8, overflow, first_piece=True) for _, train in docs]
    assert trained_targets_kept(build_store(docs), 8, overflow, first_piece=True, chunk_tokens=7).tolist() == expected


def test_preference_fields_that_are_the_same_field_are_refused_by_the_config():
    # every record was then refused as a pair of equal responses, naming 'chosen' twice
    with pytest.raises(ConfigError, match=r"^data.rejected_field: must differ from data.chosen_field "
                                          r"\(both 'chosen'\)$"):
        DataConfig(format="preference", sections=(Section(field="prompt"),), rejected_field="chosen")


@pytest.mark.parametrize("overflow, pairs", [("truncate_left", 2), ("drop", 1)])
def test_a_long_prompt_pair_is_kept_by_truncate_left_and_left_out_by_drop(tmp_path, overflow, pairs):
    _, cfg = long_prompt_pairs(tmp_path, overflow)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "data.source: .* longer than data.seq_len")  # truncate_left says so
        warnings.filterwarnings("ignore", "data.source: .* leaves it out")  # drop says so
        assert len(build_dataset(cfg, TOK, "train")) == pairs


def test_a_pair_that_drop_leaves_out_gets_the_warning_about_records_that_train_nothing(tmp_path):
    # before: the pair was left out of the rows silently, where a sections record so dropped is warned about
    src, cfg = long_prompt_pairs(tmp_path, "drop")
    assert warning_messages(build_dataset, cfg, TOK, "train") == [
        f"data.source: 1 of the 2 training records of '{src}' trains nothing, the first at {src}:2: its 42 tokens "
        f"are more than data.seq_len=16 and data.overflow='drop' leaves it out"]


def test_a_reused_cache_warns_of_the_pairs_a_new_seq_len_drops_as_an_uncached_run_does(tmp_path):
    src, cfg = long_prompt_pairs(tmp_path, "drop")
    cached = dataclasses.replace(cfg, seq_len=64, cache_dir=str(tmp_path / "cache"))
    assert warning_messages(build_dataset, cached, TOK, "train") == []
    reused = warning_messages(build_dataset, dataclasses.replace(cached, seq_len=16), TOK, "train")
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the same store
    assert reused == warning_messages(build_dataset, cfg, TOK, "train") and len(reused) == 1


REPEATED = {  # records 3 and 5 repeat record 1; record 2 shares its prompt, not its response; record 4 is another
    "preference": [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in
                   [("1+1=", "2", "3"), ("1+1=", "2", "4"), ("1+1=", "2", "3"), ("2+2=", "4", "5"), ("1+1=", "2", "3")]],
    "sections": [{"prompt": p, "response": r} for p, r in
                 [("1+1", "2"), ("1+1", "3"), ("1+1", "2"), ("2+2", "4"), ("1+1", "2")]],
    "chat": [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]} for p, r in
             [("1+1", "2"), ("1+1", "3"), ("1+1", "2"), ("2+2", "4"), ("1+1", "2")]],
}
REPEATED_WHAT = {
    "preference": ("an earlier record's preference pair (the same prompt, chosen and rejected response, as tokens)",
                   "each repeat counts its pair once more in DPO's loss; remove the repeats unless the pair is meant "
                   "to weigh more"),
    "sections": ("an earlier record (the same fields of data.sections, as tokens)",
                 "each repeat counts once more in the loss; remove the repeats unless the record is meant to weigh "
                 "more"),
    "chat": ("an earlier record (the same chat messages, as tokens)",
             "each repeat counts once more in the loss; remove the repeats unless the record is meant to weigh more"),
}


def repeated_records(tmp_path, data_format="preference", cache_dir=None, records=None):
    """A file of `data_format` whose records are `records` (else `REPEATED`'s, whose
    records 3 and 5 repeat record 1) and the warning about the `REPEATED` ones."""
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps(record) + "\n" for record in records or REPEATED[data_format]))
    sections = {"preference": (Section(field="prompt"),), "sections": SECTIONS, "chat": ()}[data_format]
    cfg = DataConfig(source=str(src), format=data_format, sections=sections, seq_len=16, eval_fraction=0.0,
                     cache_dir=cache_dir)
    what, advice = REPEATED_WHAT[data_format]
    return cfg, (f"data.source: 2 of the 5 training records of '{src}' repeat {what}, the first at {src}:3, a repeat "
                 f"of {src}:1: {advice}")


REPEATING_FORMATS = pytest.mark.parametrize("data_format", ["preference", "sections", "chat"])


@REPEATING_FORMATS
def test_records_repeating_an_earlier_one_are_warned_of_naming_both_file_lines(tmp_path, data_format):
    # before: silent, each repeat weighing its record once more (SFT records were not counted at all)
    cfg, message = repeated_records(tmp_path, data_format)
    assert warning_messages(build_dataset, cfg, TOK, "train") == [message]


@REPEATING_FORMATS
def test_records_without_a_repeat_are_not_warned_of(tmp_path, data_format):
    records = REPEATED[data_format][:2] + REPEATED[data_format][3:4]  # the same prompt, another response
    cfg, _ = repeated_records(tmp_path, data_format, records=records)
    assert warning_messages(build_dataset, cfg, TOK, "train") == []


def test_repeats_of_a_record_that_trains_nothing_are_warned_of_only_as_training_nothing(tmp_path):
    # it weighs nothing in the loss, however often it is repeated
    src = tmp_path / "chat.jsonl"
    write_chat_with_untrained_records(src)  # lines 3 and 4 are the same record, without an assistant turn
    cfg = DataConfig(source=str(src), format="chat", eval_fraction=0.0)
    assert warning_messages(build_dataset, cfg, TOK, "train") == [
        f"data.source: 2 of the 3 training records of '{src}' train nothing, the first at {src}:3: none of its "
        f"messages has a role in data.train_roles=['assistant']"]


@REPEATING_FORMATS
def test_a_reused_cache_warns_of_repeated_records_as_an_uncached_run_does(tmp_path, data_format):
    cfg, message = repeated_records(tmp_path, data_format, cache_dir=str(tmp_path / "cache"))
    assert warning_messages(build_dataset, cfg, TOK, "train") == [message]
    assert warning_messages(build_dataset, cfg, TOK, "train") == [message]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the same store


@pytest.mark.parametrize("data_format, kept", [
    ("preference", None),  # written before repeats were counted
    ("sections", None),
    ("sections", {"pairs": False, "records": 0, "count": 0, "first": -1, "earlier": -1}),  # preference pairs only
    ("chat", {"pairs": False, "records": 0, "count": 0, "first": -1, "earlier": -1}),
])
def test_a_cached_store_written_before_repeats_were_counted_warns_of_them(tmp_path, data_format, kept):
    cfg, message = repeated_records(tmp_path, data_format, cache_dir=str(tmp_path / "cache"))
    warning_messages(build_dataset, cfg, TOK, "train")
    (store,) = (tmp_path / "cache").iterdir()
    meta = json.loads((store / "meta.json").read_text())
    del meta["repeated"]  # as an earlier jrl wrote it
    if kept is not None:
        meta["repeated"] = kept
    (store / "meta.json").write_text(json.dumps(meta))
    assert warning_messages(build_dataset, cfg, TOK, "train") == [message]


def test_a_cached_store_keeps_the_repeated_pairs_an_earlier_jrl_counted(tmp_path):
    cfg, message = repeated_records(tmp_path, "preference", cache_dir=str(tmp_path / "cache"))
    warning_messages(build_dataset, cfg, TOK, "train")
    (store,) = (tmp_path / "cache").iterdir()
    meta = json.loads((store / "meta.json").read_text())
    meta["repeated"] = {"pairs": True, "records": 5, "count": 2, "first": 2, "earlier": 0}  # as it wrote them
    (store / "meta.json").write_text(json.dumps(meta))
    assert warning_messages(build_dataset, cfg, TOK, "train") == [message]


@REPEATING_FORMATS
def test_a_dry_run_check_warns_of_repeated_records(tmp_path, data_format):
    cfg, message = repeated_records(tmp_path, data_format)
    assert warning_messages(pipeline.check_records, cfg, TOK, "train") == [message]


def test_repeats_a_bundled_dataset_draws_are_not_warned_of():
    # more records than its 15,050 problems: 50 come twice, as asked for (jrl's generator, no file to fix)
    cfg = DataConfig(source="bundled:arithmetic:15100", sections=SECTIONS, seq_len=16, eval_fraction=0.0)
    assert warning_messages(build_dataset, cfg, TOK, "train") == []
    counts = collections.Counter(r["prompt"] for r in load_bundled("bundled:arithmetic:15100"))
    assert sorted(collections.Counter(counts.values()).items()) == [(1, 15_000), (2, 50)]


def test_unknown_bundled_dataset_is_named():
    with pytest.raises(ValueError, match="unknown bundled dataset 'bundled:nope'"):
        load_bundled("bundled:nope")


@pytest.mark.parametrize("name", sorted(set(DEFAULT_SIZES) - {"addition"}))
@pytest.mark.parametrize("seed", [0, 1])
def test_no_bundled_dataset_repeats_a_record_at_its_default_size(name, seed):
    # before: bundled:arithmetic_pairs repeated 6 of its 1,000 pairs and arithmetic 148 of
    # its 2,000 records (seed 0), each repeat weighing once more
    records = [json.dumps(r, sort_keys=True) for r in load_bundled(f"bundled:{name}", seed)]
    assert len(records) == DEFAULT_SIZES[name]
    assert len(set(records)) == len(records)


def test_a_bundled_dataset_larger_than_its_problems_repeats_each_as_few_times_as_it_can():
    # before: some drawn many times, others never (bundled:arithmetic:30100 drew 12,580 of its 15,050 problems)
    prompts = collections.Counter(r["prompt"] for r in load_bundled("bundled:arithmetic:30100"))
    assert len(prompts) == 15_050 and set(prompts.values()) == {2}


def test_a_smaller_bundled_dataset_is_the_first_records_of_a_larger_one():
    # an eval_source drawn from the source's bundled set holds its first (training) records
    for name, few, many in [("arithmetic", 100, 20_000), ("arithmetic_pairs", 50, 5_000)]:
        assert load_bundled(f"bundled:{name}:{few}", 3) == load_bundled(f"bundled:{name}:{many}", 3)[:few]


def test_bundled_arithmetic_pairs_choose_the_right_answer_over_a_near_wrong_one():
    records = load_bundled("bundled:arithmetic_pairs")
    assert records == load_bundled("bundled:arithmetic_pairs")
    for r in records:
        right, wrong = int(r["chosen"]), int(r["rejected"])
        assert eval(r["prompt"][:-1]) == right and wrong >= 0 and abs(wrong - right) in (1, 2, 10)


def test_bundled_arithmetic_is_correct_and_deterministic():
    records = load_bundled("bundled:arithmetic:50")
    assert records == load_bundled("bundled:arithmetic:50")
    for r in records:
        assert eval(r["prompt"][:-1]) == r["answer"] == int(r["response"])


def test_data_source_batches_have_row_fields():
    cfg = DataConfig(source="bundled:arithmetic:200", seq_len=32)
    source = DataSource(build_dataset(cfg, TOK, "train"), 4, seed=0)
    batch = source.next_batch()
    assert {k: v.shape for k, v in batch.items()} == {k: (4, 32) for k in
                                                    ("tokens", "targets", "loss_mask", "positions", "segment_ids")}


def test_preprocess_command_writes_the_stores_a_run_reuses(tmp_path, capsys):
    from jrl.data.__main__ import main

    cache = tmp_path / "cache"
    overrides = [f"data.cache_dir={cache}", "data.source=bundled:arithmetic:100"]
    assert main(overrides) == 0
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["eval", "train"]
    cfg = DataConfig(source="bundled:arithmetic:100", cache_dir=str(cache))
    store = load_documents(cfg, TOK, "train")
    assert isinstance(store.tokens, np.memmap)
    assert f"train: {len(store)} documents" in capsys.readouterr().out


def test_preprocess_command_names_a_bad_record_on_one_line(tmp_path, capsys):
    from jrl.data.__main__ import main

    src = tmp_path / "train.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    assert main([f"data.cache_dir={tmp_path / 'cache'}", f"data.source={src}"]) == 2
    assert capsys.readouterr().err == f"error: {src}:2: not valid JSON (Expecting property name enclosed in double quotes)\n"


def test_preprocess_command_refuses_an_empty_config_path(tmp_path, capsys):
    from jrl.data.__main__ import main

    # read as no --config, it tokenised the embedded default's data instead of the run's
    assert main(["--config", "", f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    assert capsys.readouterr().err.startswith("config error: --config: the path is empty; name a YAML config file")
    assert not (tmp_path / "cache").exists()


def test_cache_dir_rebuilds_when_the_chat_messages_field_changes(tmp_path):
    chat = lambda answer: [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": chat("hello"), "other": chat("bye")}) + "\n")
    config = functools.partial(DataConfig, source=str(src), format="chat", eval_fraction=0.0,
                               cache_dir=str(tmp_path / "cache"))
    load_documents(config(), TOK, "train")
    other = load_documents(config(messages_field="other"), TOK, "train")
    assert TOK.decode(other.doc(0)[0]).endswith("bye<eos>")


def test_open_store_refuses_a_truncated_file_naming_it(tmp_path):
    write_store(tmp_path / "s", iter([doc([1, 2, 3]), doc([4, 5])]), {})
    with open(tmp_path / "s" / "tokens.bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(CorruptStoreError, match=r"tokens\.bin: 8 bytes, expected 20 \(meta.json: 2 documents, 5 tokens\)"):
        open_store(tmp_path / "s")


def test_a_store_tokenised_by_an_older_reading_of_records_is_not_reused(tmp_path, monkeypatch):
    # how records become documents changes between versions (numbers as the file writes
    # them, templates' tools): a store from before must be built again, not read back
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "x 0.50"}) + "\n")
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    key = cache_key(cfg, TOK, "train")
    monkeypatch.setattr(pipeline, "RECORD_ENCODING_VERSION", pipeline.RECORD_ENCODING_VERSION - 1)
    assert cache_key(cfg, TOK, "train") != key


def test_cache_dir_rebuilds_a_truncated_store(tmp_path):
    cfg = DataConfig(source="bundled:arithmetic:20", eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    first = np.array(load_documents(cfg, TOK, "train").tokens)
    [cached] = list((tmp_path / "cache").iterdir())
    with open(cached / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.warns(UserWarning, match="damaged token store, rebuilding it"):
        again = load_documents(cfg, TOK, "train")
    np.testing.assert_array_equal(again.tokens, first)


def test_cache_dir_rebuilds_when_the_tokenizer_files_change_in_place(tmp_path):
    from chat_fixtures import CHATML, write_chat_tokenizer

    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "5"}]}) + "\n")
    tok_dir = write_chat_tokenizer(tmp_path / "tok")
    cfg = DataConfig(source=str(src), format="chat", eval_fraction=0.0, tokenizer=str(tok_dir),
                     cache_dir=str(tmp_path / "cache"))
    load_documents(cfg, load_tokenizer(str(tok_dir)), "train")
    write_chat_tokenizer(tok_dir, template="SYSTEM\n" + CHATML)  # same path, same vocab size
    tok = load_tokenizer(str(tok_dir))
    assert tok.decode(load_documents(cfg, tok, "train").doc(0)[0]).startswith("SYSTEM\n")


def test_cache_dir_rebuilds_when_the_bos_token_a_chat_template_renders_changes(tmp_path):
    from chat_fixtures import CHATML, write_chat_tokenizer

    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "5"}]}) + "\n")
    tok_dir = write_chat_tokenizer(tmp_path / "tok", template="{{ bos_token }}" + CHATML)
    cfg = DataConfig(source=str(src), format="chat", eval_fraction=0.0, tokenizer=str(tok_dir),
                     cache_dir=str(tmp_path / "cache"))
    load_documents(cfg, load_tokenizer(str(tok_dir)), "train")
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**tok_config, "bos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(tok_dir))
    assert tok.decode(load_documents(cfg, tok, "train").doc(0)[0]).startswith("<|endoftext|><|im_start|>user")


def test_cache_dir_rebuilds_a_source_rewritten_in_place_with_its_size_and_mtime_kept(tmp_path):
    src = tmp_path / "d.jsonl"  # cp -p, rsync -t, tar and touch -r put an older mtime back
    src.write_text('{"text": "aaaa"}\n')
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, add_eos=False,
                     cache_dir=str(tmp_path / "cache"))
    load_documents(cfg, TOK, "train")
    before = src.stat()
    time.sleep(0.05)  # past a tick of the kernel's file clock, so the rewrite's ctime differs
    with open(src, "r+b") as f:  # in place: the same inode
        f.write(b'{"text": "bbbb"}\n')
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert src.stat().st_size == before.st_size and src.stat().st_mtime_ns == before.st_mtime_ns
    assert TOK.decode(load_documents(cfg, TOK, "train").doc(0)[0]) == "bbbb"


def test_write_store_keeps_a_complete_store_another_process_published_meanwhile(tmp_path):
    # two runs building the same cache: the one that finishes second must not delete the
    # store the first one published (and may be reading) to put its own copy there
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    first = open_store(tmp_path / "s")
    inode = (tmp_path / "s" / "tokens.bin").stat().st_ino
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    assert (tmp_path / "s" / "tokens.bin").stat().st_ino == inode
    assert open_store(tmp_path / "s").tokens.tolist() == first.tokens.tolist() == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # its own copy is gone


def test_a_cached_store_has_the_content_digest_of_the_same_documents_in_memory(tmp_path):
    # a run that resumes with data.cache_dir set or unset trains on the same documents: same digest
    from jrl.data.store import content_digest

    docs = [doc([1, 2, 3], [0, 1, 1]), doc([], []), doc([7], [1])]
    write_store(tmp_path / "s", iter(docs), {})
    cached, in_memory = open_store(tmp_path / "s"), build_store(docs)
    assert cached.digest == in_memory.digest == content_digest(dataclasses.replace(cached, digest=None))
    assert content_digest(build_store(docs[:1] + [doc([], []), doc([8], [1])])) != cached.digest


def test_write_store_replaces_a_damaged_store(tmp_path):
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    (tmp_path / "s" / "tokens.bin").write_bytes(b"")
    write_store(tmp_path / "s", iter([doc([4, 5])]), {})
    assert open_store(tmp_path / "s").tokens.tolist() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_a_cache_write_that_fills_the_disk_names_the_store_and_keeps_nothing(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "x" * 50_000}) + "\n")  # 200 kB of int32 tokens
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    key = cache_key(cfg, TOK, "train")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # a write past 64 kB fails as a full disk does
    try:
        with pytest.raises(StoreWriteError) as e:
            load_documents(cfg, TOK, "train")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == (f"data.cache_dir: cannot write the token store {tmp_path}/cache/train-{key}: "
                            f"File too large; nothing of it was kept")
    assert list((tmp_path / "cache").iterdir()) == []
    assert load_documents(cfg, TOK, "train").lengths.tolist() == [50_001]  # room again: built whole


def test_a_cache_dir_that_is_a_file_is_named_as_a_file(tmp_path):
    # it said "cannot write the token store notes.txt/train-<key>: File exists (notes.txt)"
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "notes.txt").write_text("mine")
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, cache_dir=str(tmp_path / "notes.txt"))
    key = cache_key(cfg, TOK, "train")
    with pytest.raises(StoreWriteError) as e:
        load_documents(cfg, TOK, "train")
    assert str(e.value) == (f"data.cache_dir: cannot write the token store {tmp_path}/notes.txt/train-{key}: "
                            f"{tmp_path}/notes.txt is a file, not a directory")
    assert (tmp_path / "notes.txt").read_text() == "mine"


WRITER = """
import sys, time
import numpy as np
from jrl.data.store import write_store
def docs():
    yield np.arange(5, dtype=np.int32), np.ones(5, bool)
    open(sys.argv[2], "w").close()  # the staging directory holds a document: killed mid-write from here on
    time.sleep(600)
    yield np.arange(3, dtype=np.int32), np.ones(3, bool)
write_store(sys.argv[1], docs(), {})
"""


def start_writer(store, marker):
    """A process writing the store `store` that stops mid-write (after `marker` appears)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(marker)],
                            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def staging_dirs(cache):
    return sorted(p.name for p in cache.iterdir() if ".staging-" in p.name)


def test_the_next_build_removes_the_staging_directory_of_a_killed_build(tmp_path):
    # a build killed mid-write left a hidden .train-<key>.staging-<id> directory that nothing removed
    cache = tmp_path / "cache"
    proc = start_writer(cache / "train-old", tmp_path / "marker")
    [left] = staging_dirs(cache)
    assert left.startswith(f".train-old.staging-{socket.gethostname()}-{proc.pid}-")
    proc.kill()
    proc.wait()
    assert staging_dirs(cache) == [left]
    write_store(cache / "train-new", iter([doc([1, 2, 3])]), {})
    assert sorted(p.name for p in cache.iterdir()) == ["train-new"]


def test_a_build_keeps_the_staging_directory_a_live_process_is_writing(tmp_path):
    cache = tmp_path / "cache"
    proc = start_writer(cache / "train-a", tmp_path / "marker")
    try:
        [live] = staging_dirs(cache)
        write_store(cache / "train-b", iter([doc([1, 2, 3])]), {})
        assert staging_dirs(cache) == [live]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("idle_hours, kept", [(25, False), (1, True)])
def test_another_hosts_staging_directory_is_removed_only_once_idle_for_a_day(tmp_path, idle_hours, kept):
    # its pid cannot be checked from here: one whose files changed lately may be a live writer
    name = f".train-x.staging-other-host-{os.getpid()}-{'0' * 32}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "tokens.bin").write_bytes(b"1234")
    then = time.time() - idle_hours * 3600
    for path in (tmp_path / name / "tokens.bin", tmp_path / name):
        os.utime(path, (then, then))
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    assert staging_dirs(tmp_path) == ([name] if kept else [])


def gone_pid():
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def damaged_store(parent, name):
    """A damaged store moved aside as `parent/name` (its files as a build left them)."""
    (parent / name).mkdir(parents=True)
    (parent / name / "tokens.bin").write_bytes(b"1234")
    return parent / name


def test_the_next_build_removes_a_damaged_store_that_a_gone_process_moved_aside(tmp_path):
    # a build killed between moving the damaged store aside and removing it left it for good
    name = f".train-x.damaged-{socket.gethostname()}-{gone_pid()}-{'0' * 32}"
    damaged_store(tmp_path, name)
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_a_build_keeps_a_damaged_store_a_live_process_moved_aside(tmp_path):
    # the process that moved it aside (this one, alive) removes it itself
    name = f".train-x.damaged-{socket.gethostname()}-{os.getpid()}-{'0' * 32}"
    damaged_store(tmp_path, name)
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, "s"]


@pytest.mark.parametrize("name", [f".train-x.damaged-other-host-4242-{'0' * 32}",
                                  f".train-x.damaged-{'0' * 32}"])  # another host's; an older jrl's (no pid)
@pytest.mark.parametrize("idle_hours, kept", [(25, False), (1, True)])
def test_a_damaged_store_whose_process_cannot_be_checked_is_removed_only_once_idle_for_a_day(
        tmp_path, name, idle_hours, kept):
    aside = damaged_store(tmp_path, name)
    then = time.time() - idle_hours * 3600
    for path in (aside / "tokens.bin", aside):
        os.utime(path, (then, then))
    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if kept else []) + ["s"]


def test_a_damaged_store_left_moved_aside_is_named_by_its_host_and_pid_and_marked_moved_now(tmp_path, monkeypatch):
    # its removal failed (e.g. files another process held): the next build must know whose it was and since when
    import jrl.data.store as store_module

    write_store(tmp_path / "s", iter([doc([1, 2, 3])]), {})
    (tmp_path / "s" / "tokens.bin").write_bytes(b"")
    old = time.time() - 48 * 3600
    os.utime(tmp_path / "s", (old, old))
    rmtree = shutil.rmtree
    monkeypatch.setattr(store_module.shutil, "rmtree",
                        lambda path, *a, **k: None if ".damaged-" in str(path) else rmtree(path, *a, **k))
    write_store(tmp_path / "s", iter([doc([4, 5])]), {})
    monkeypatch.undo()
    [aside] = [p for p in tmp_path.iterdir() if p.name != "s"]
    assert aside.name.startswith(f".s.damaged-{socket.gethostname()}-{os.getpid()}-")
    assert time.time() - aside.stat().st_mtime < 3600
    assert [p.name for p in store_module.remove_stale_leftovers(tmp_path)] == []  # this process is alive


def test_a_data_file_without_read_permission_is_named_by_its_config_field(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text('{"text": "hello"}\n')
    src.chmod(0)
    prefix = unprivileged_prefix("reads a mode-000 file")
    (tmp_path / "c.yaml").write_text(f"data: {{source: {src}, format: text, eval_fraction: 0}}\nstrategy: {{name: seq}}\n")
    done = subprocess.run([*prefix, sys.executable, "-m", "jrl.train", "--config", str(tmp_path / "c.yaml"), "--dry-run"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert done.returncode == 2
    assert done.stderr == f"config error: data.source: cannot read '{src}': Permission denied\n"


def test_a_data_file_that_grows_while_it_is_read_is_refused_naming_it(tmp_path):
    src = tmp_path / "train.jsonl"  # a writer still appending: the records read are neither file
    src.write_text('{"text": "a"}\n{"text": "b"}\n')
    records = iter_located_records(str(src), 0, "data.source")
    assert next(records) == (f"{src}:1", {"text": "a"})
    with open(src, "a") as f:
        f.write('{"text": "c"}\n')
    with pytest.raises(ConfigError, match=rf"^data.source: '{src}' changed while it was being read \(28 bytes, then 42\); "
                                          r"start the run once whatever writes it has finished$"):
        list(records)


@pytest.mark.parametrize("text, add_eos", [("", True), ("a", False)])
def test_a_single_token_text_document_is_warned_about_as_such(tmp_path, text, add_eos):
    src = tmp_path / "train.jsonl"  # one token: no earlier token to predict it from
    src.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "hello"}) + "\n")
    cfg = DataConfig(source=str(src), format="text", eval_fraction=0.0, add_eos=add_eos)
    _, message = one_warning(build_dataset, cfg, TOK, "train")
    assert message == (f"data.source: 1 of the 2 training records of '{src}' trains nothing, the first at {src}:1: "
                       f"its document is a single token, and a document's first token is never a target")


def texts(store):
    return [TOK.decode(store.doc(i)[0]) for i in range(len(store))]


def write_lines(path, *texts_):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts_))
    return str(path)


def test_a_list_of_two_jsonl_files_reads_as_their_concatenation(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", *(f"a{i}" for i in range(30)))
    b = write_lines(tmp_path / "b.jsonl", *(f"b{i}" for i in range(30)))
    both = tmp_path / "both.jsonl"
    both.write_text((tmp_path / "a.jsonl").read_text() + (tmp_path / "b.jsonl").read_text())
    listed = DataConfig(source=(a, b), format="text", eval_fraction=0.2)
    joined = DataConfig(source=str(both), format="text", eval_fraction=0.2)
    for split in ("train", "eval"):  # the same records held out: the rule counts across files
        assert texts(load_documents(listed, TOK, split)) == texts(load_documents(joined, TOK, split))
    assert len(load_documents(listed, TOK, "eval")) > 0


def test_a_glob_pattern_reads_its_files_in_sorted_order(tmp_path):
    (tmp_path / "shards").mkdir()
    for name in ("02", "10", "01"):
        write_lines(tmp_path / "shards" / f"{name}.jsonl", f"doc {name}")
    write_lines(tmp_path / "shards" / "notes.json", "not matched")
    cfg = DataConfig(source=str(tmp_path / "shards" / "*.jsonl"), format="text", eval_fraction=0.0)
    assert texts(load_documents(cfg, TOK, "train")) == ["doc 01<eos>", "doc 02<eos>", "doc 10<eos>"]


def test_txt_files_are_one_raw_text_document_each_named_by_the_file(tmp_path):
    (tmp_path / "a.txt").write_text('first line\n{"not": "json"}\n')
    (tmp_path / "b.txt").write_text("")
    jsonl = write_lines(tmp_path / "c.jsonl", "a record")
    cfg = DataConfig(source=(str(tmp_path / "*.txt"), jsonl), format="text", eval_fraction=0.0)
    dataset, message = one_warning(build_dataset, cfg, TOK, "train")
    assert texts(dataset.store) == ['first line\n{"not": "json"}\n<eos>', "<eos>", "a record<eos>"]
    assert f"the first at {tmp_path / 'b.txt'}: its document is a single token" in message


def test_a_txt_file_is_refused_for_a_format_other_than_text(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(tmp_path / "a.txt"), eval_fraction=0.0), TOK, "train")
    assert str(e.value) == (f"data.source: '{tmp_path / 'a.txt'}' is a raw text file (.txt: one document per "
                            f"file), read only with data.format: text, not 'sections'; give sections records as JSONL")


def test_a_pattern_that_matches_no_file_is_named(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", "x")
    pattern = str(tmp_path / "shard-*.jsonl")
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=(a, pattern), format="text", eval_fraction=0.0), TOK, "train")
    assert str(e.value) == f"data.source: the pattern '{pattern}' matches no file"


def test_a_file_given_twice_is_refused(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", "x")
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=(str(tmp_path / "*.jsonl"), a), format="text", eval_fraction=0.0),
                       TOK, "train")
    assert str(e.value) == f"data.source: '{a}' is given twice (by '{tmp_path}/*.jsonl' and '{a}'); list each file once"


def test_a_pattern_that_matches_a_directory_is_refused_naming_it(tmp_path):
    write_lines(tmp_path / "a.jsonl", "x")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=rf"^data.source: the pattern '{tmp_path}/\*' matches the directory "
                                          rf"'{tmp_path}/sub'; give a pattern that matches files only"):
        load_documents(DataConfig(source=str(tmp_path / "*"), format="text", eval_fraction=0.0), TOK, "train")


def test_cache_dir_rebuilds_when_the_second_file_of_a_list_changes(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", "aaaa")
    b = write_lines(tmp_path / "b.jsonl", "bbbb")
    cfg = DataConfig(source=(a, b), format="text", eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    assert texts(load_documents(cfg, TOK, "train")) == ["aaaa<eos>", "bbbb<eos>"]
    time.sleep(0.05)  # past a tick of the kernel's file clock, so the rewrite's mtime differs
    write_lines(tmp_path / "b.jsonl", "cccc")  # the same size
    assert texts(load_documents(cfg, TOK, "train")) == ["aaaa<eos>", "cccc<eos>"]
    assert len(list((tmp_path / "cache").iterdir())) == 2


def long_text_documents(tmp_path):
    """a.jsonl: a 5-token document (4 bytes and EOS) on line 1, a 25-token one on line 2; b.txt: 41 tokens."""
    a = write_lines(tmp_path / "a.jsonl", "abcd", "x" * 24)
    (tmp_path / "b.txt").write_text("y" * 40)
    return [a, str(tmp_path / "b.txt")]


def test_truncation_that_drops_tokens_warns_once_with_the_counts_and_the_first_document(tmp_path):
    source = long_text_documents(tmp_path)
    cfg = DataConfig(source=tuple(source), format="text", seq_len=16, eval_fraction=0.0)
    dataset, message = one_warning(build_dataset, cfg, TOK, "train")
    assert message == (f"data.source: 2 of the 3 training documents of [{source[0]}, {source[1]}] are longer than "
                       f"data.seq_len=16 and data.overflow='truncate_right' drops 34 of the 71 tokens (47.9%), "
                       f"the first at {source[0]}:2 (25 tokens); set data.overflow: split to train on all of "
                       f"their tokens (windows of data.seq_len), or raise data.seq_len")
    assert len(dataset) == 3


def test_a_count_of_one_is_singular_in_the_truncation_warning(tmp_path):
    # it said "1 of the 1 training documents ... are longer ... (17 tokens)"
    src = write_lines(tmp_path / "a.jsonl", "x" * 16)
    cfg = DataConfig(source=src, format="text", seq_len=16, eval_fraction=0.0)
    _, message = one_warning(build_dataset, cfg, TOK, "train")
    assert message == (f"data.source: 1 of the 1 training document of '{src}' is longer than data.seq_len=16 and "
                       f"data.overflow='truncate_right' drops 1 of the 17 tokens (5.9%), the first at {src}:1 "
                       f"(17 tokens); set data.overflow: split to train on all of their tokens (windows of "
                       f"data.seq_len), or raise data.seq_len")


def test_counted_says_one_row_and_two_rows():
    from jrl.data.wording import counted

    assert [counted(n, "row") for n in (0, 1, 2, 1234)] == ["0 rows", "1 row", "2 rows", "1,234 rows"]


def test_overflow_split_drops_nothing_and_does_not_warn(tmp_path):
    cfg = DataConfig(source=tuple(long_text_documents(tmp_path)), format="text", seq_len=16, eval_fraction=0.0,
                     overflow="split")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_dataset(cfg, TOK, "train")


def test_a_reused_cache_repeats_the_truncation_warning_and_counts_it_for_a_new_seq_len(tmp_path):
    source = long_text_documents(tmp_path)
    cfg = DataConfig(source=tuple(source), format="text", seq_len=16, eval_fraction=0.0,
                     cache_dir=str(tmp_path / "cache"))
    written, reused = (one_warning(build_dataset, cfg, TOK, "train")[1] for _ in range(2))
    assert written == reused and "drops 34 of the 71 tokens" in reused
    # seq_len is not in the store's key: the same store, counted again
    _, longer = one_warning(build_dataset, dataclasses.replace(cfg, seq_len=32), TOK, "train")
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert ("1 of the 3 training documents of" in longer and "is longer than" in longer and "drops 9 of the 71 tokens (12.7%), "
            f"the first at {source[1]} (41 tokens)" in longer)


def test_a_dry_run_check_warns_about_truncation(tmp_path):
    from jrl.data.pipeline import check_records

    cfg = DataConfig(source=tuple(long_text_documents(tmp_path)), format="text", seq_len=16, eval_fraction=0.0)
    checked, message = one_warning(check_records, cfg, TOK, "train")
    assert (checked.records, checked.files, checked.tokens) == (3, 2, 71)
    assert "drops 34 of the 71 tokens (47.9%)" in message
