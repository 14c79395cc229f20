"""Tokens a recipe adds (tokens, special_tokens, additional_special_tokens): how they land in the tokenizer, and the
refusal Axolotl also makes when an adapter would leave their new embedding rows frozen at random values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import load_tokenizer as fixture_tokenizer

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The fixture tokenizer (ChatML, eos <|im_end|>) with a Llama config beside it."""
    path = tmp_path_factory.mktemp("tok")
    fixture_tokenizer().save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def recipe(base: Path, **keys):
    raw = {"base_model": str(base), "datasets": [{"path": "x.jsonl", "type": "alpaca"}], **keys}
    return recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe


def tokenizer_for(base: Path, **keys):
    from llmtune.train.model.load import load_tokenizer

    return load_tokenizer(recipe(base, **keys), str(base))


LORA = {"adapter": "lora", "lora_target_linear": True}


@pytest.mark.parametrize("keys, named", [
    ({"tokens": ["<tool>", "<call>"]}, ["tokens", "<tool>, <call>"]),
    ({"special_tokens": {"eos_token": "<eot>"}}, ["special_tokens.eos_token", "<eot>"]),
    ({"special_tokens": {"additional_special_tokens": ["<tool>"]}}, ["additional_special_tokens", "<tool>"]),
    ({"tokens": ["<tool>"], "lora_modules_to_save": ["lm_head"]}, ["tokens"]),
])  # fmt: skip
def test_new_tokens_with_an_adapter_need_the_embeddings_in_modules_to_save(folder, keys, named):
    with pytest.raises(UserError) as caught:
        tokenizer_for(folder, **LORA, **keys)
    assert "\n" not in caught.value.message
    for word in [*named, "lora_modules_to_save", "embed_tokens", "lm_head"]:
        assert word in caught.value.message
    assert caught.value.hint.startswith("set lora_modules_to_save: [embed_tokens, lm_head]")


def test_the_hint_names_the_models_own_embedding_modules(tmp_path):
    fixture_tokenizer().save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(UserError, match="embed_in and embed_out") as caught:
        tokenizer_for(tmp_path, **LORA, tokens=["<tool>"])
    assert "lora_modules_to_save: [embed_in, embed_out]" in caught.value.hint


@pytest.mark.parametrize("keys", [
    {**LORA, "tokens": ["<tool>"], "lora_modules_to_save": ["embed_tokens", "lm_head"]},
    {**LORA, "tokens": ["<|im_end|>"], "special_tokens": {"eos_token": "<|im_end|>"}},  # already in the vocabulary
    {**LORA, "special_tokens": {"pad_token": "<newpad>"}},  # a pad row is never read by the loss
    {"tokens": ["<tool>"], "special_tokens": {"eos_token": "<eot>"}},  # a full fine-tune trains every row
])  # fmt: skip
def test_tokens_that_will_train_are_accepted(folder, keys):
    tokenizer = tokenizer_for(folder, **keys)
    for token in [*(keys.get("tokens") or []), *(keys.get("special_tokens") or {}).values()]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1


def test_additional_special_tokens_are_added_as_special_after_tokens(folder):
    plain = fixture_tokenizer()
    tokenizer = tokenizer_for(folder, tokens=["<tool>"], special_tokens={"additional_special_tokens": ["<tool>",
                                                                                                    "<call>"]})
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool>", "<call>")]
    assert ids == [len(plain), len(plain) + 1]  # <tool> from tokens first, then the new one
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert set(ids) <= special
    assert tokenizer.encode("a<call>b", add_special_tokens=False)[1] == ids[1]


def test_additional_special_tokens_change_the_cache_key(folder):
    from llmtune.train.data.prepare import cache_key

    bare = recipe(folder)
    extra = recipe(folder, special_tokens={"additional_special_tokens": ["<tool>"]})
    assert cache_key(bare, tokenizer_for(folder)) != cache_key(extra, tokenizer_for(
        folder, special_tokens={"additional_special_tokens": ["<tool>"]}))


@pytest.mark.parametrize("value, words", [
    ({"additional_special_tokens": "<tool>"}, ["additional_special_tokens", "list"]),
    ({"eos_token": ["<a>", "<b>"]}, ["eos_token", "one token"]),
])  # fmt: skip
def test_malformed_special_tokens_are_one_line_errors(value, words):
    with pytest.raises(UserError) as caught:
        recipe(Path("m"), special_tokens=value)
    for word in ["special_tokens", *words]:
        assert word in caught.value.message


def test_validate_refuses_new_tokens_from_the_local_tokenizer_json_before_any_model_loads(folder, tmp_path):
    from llmtune.plan import make_cluster, make_plan

    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    try:
        with pytest.raises(UserError, match="embed_in and embed_out") as caught:
            make_plan(recipe(folder, **LORA, special_tokens={"eos_token": "<eot>"}), make_cluster(1, device="cpu"))
        assert "special_tokens.eos_token" in caught.value.message and "<eot>" in caught.value.message
        # known tokens, a new pad token, the embeddings in modules_to_save, a full fine-tune: planned
        for keys in ({**LORA, "tokens": ["<|im_end|>"]}, {**LORA, "special_tokens": {"pad_token": "<p>"}},
                     {**LORA, "tokens": ["<x>"], "lora_modules_to_save": ["embed_in", "embed_out"]},
                     {"tokens": ["<x>"]}):  # fmt: skip
            make_plan(recipe(folder, **keys), make_cluster(1, device="cpu"))
        # no tokenizer.json here (a hub id not downloaded): left to the load-time check
        make_plan(recipe(tmp_path, **LORA, tokens=["<x>"]), make_cluster(1, device="cpu"))
    finally:
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))


def test_an_adapter_loaded_from_lora_model_dir_must_train_the_embeddings_of_new_tokens(folder, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"modules_to_save": None}))
    with pytest.raises(UserError, match="lora_model_dir") as caught:
        tokenizer_for(folder, adapter="lora", lora_model_dir=str(tmp_path), tokens=["<tool>"])
    assert "lora_modules_to_save: [embed_tokens, lm_head]" in caught.value.hint
    (tmp_path / "adapter_config.json").write_text(json.dumps({"modules_to_save": ["embed_tokens", "lm_head"]}))
    assert "<tool>" in tokenizer_for(folder, adapter="lora", lora_model_dir=str(tmp_path), tokens=["<tool>"]).get_vocab()
