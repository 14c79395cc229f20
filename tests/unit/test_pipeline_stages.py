"""A pipeline's stages handing over to each other: an adapter trained with added tokens loads for infer and eval; a
preference run that trained on from lora_model_dir is measured against that frozen adapter, from its run folder and
from its merged folder alike; a lora_model_dir that is no adapter is one line at validation."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny import load_tokenizer, make_tiny_model

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping


def test_an_adapter_that_added_tokens_answers_in_infer(tmp_path, run_cli):
    """The run's tokenizer holds tokens the base doesn't; peft saved the grown embedding and head, which load only
    onto a base grown to the same size (infer, chat and eval failed with a size mismatch)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtune.post.generate import fit_embeddings

    base = make_tiny_model(tmp_path / "base")
    tokenizer = load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|a|>", "<|b|>"]})
    tokenizer.add_tokens(["<think>"])
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tokenizer))
    torch.manual_seed(0)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                                               modules_to_save=["embed_tokens", "lm_head"]))  # fmt: skip
    run = tmp_path / "run"
    adapted.save_pretrained(run)
    tokenizer.save_pretrained(run)
    probe = torch.tensor([[1, 5, len(tokenizer) - 1]])  # the last added token
    with torch.no_grad():
        expected = adapted(input_ids=probe).logits
    fresh = AutoModelForCausalLM.from_pretrained(base)
    fit_embeddings(fresh, tokenizer, SimpleNamespace(resize_token_embeddings_to_32x=False))
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(fresh, run)(input_ids=probe).logits
    assert torch.allclose(loaded, expected, atol=1e-6)
    grown = AutoModelForCausalLM.from_pretrained(base)
    fit_embeddings(grown, tokenizer, SimpleNamespace(resize_token_embeddings_to_32x=True))
    assert grown.get_input_embeddings().weight.shape[0] == -(-len(tokenizer) // 32) * 32
    result = run_cli("infer", run, "-p", "hello", "--max-new-tokens", "2")  # the command that failed
    assert result.code == 0, result.err[-2000:]
    assert json.loads(result.out.strip().splitlines()[-1])["prompt"] == "hello"


def test_the_reference_of_a_run_from_lora_model_dir_is_the_adapter_it_froze(tmp_path):
    from llmtune.post.evaluate_preference import saved_reference

    run = tmp_path / "dpo"
    (run / "ref").mkdir(parents=True)
    (run / "ref" / "adapter_config.json").write_text("{}")
    recipe = SimpleNamespace(lora_model_dir=str(tmp_path / "sft"))
    for target in (SimpleNamespace(recipe=recipe, adapter_dir=str(run), result_file=run / "eval.json"),
                   SimpleNamespace(recipe=recipe, adapter_dir=None, result_file=run / "merged" / "eval.json")):  # fmt: skip
        assert saved_reference(target) == str(run / "ref")  # (the merged folder measured against the raw base)
    moved = SimpleNamespace(recipe=recipe, adapter_dir=None, result_file=tmp_path / "elsewhere" / "eval.json")
    assert saved_reference(moved) == str(tmp_path / "sft")


def test_a_lora_model_dir_that_is_no_adapter_is_one_line(tmp_path):
    merged = make_tiny_model(tmp_path / "merged")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    base = {"base_model": str(merged), "datasets": [{"path": str(data), "type": "alpaca"}], "adapter": "lora",
            "output_dir": str(tmp_path / "out")}  # fmt: skip
    with pytest.raises(UserError) as caught:
        recipe_from_mapping({**base, "lora_model_dir": str(merged)}, Path("r.yml"))
    assert "holds no adapter (adapter_config.json): it is a whole model" in caught.value.message
    assert caught.value.hint == f"train on from it as base_model: {merged} (without lora_model_dir)"
    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    recipe_from_mapping({**base, "lora_model_dir": str(adapter), "output_dir": str(adapter)}, Path("r.yml"))  # SFT
    with pytest.raises(UserError, match="rl: dpo would overwrite the adapter it starts from, which is also its "
                                        "reference"):  # fmt: skip
        recipe_from_mapping({**base, "lora_model_dir": str(adapter), "output_dir": str(adapter), "rl": "dpo",
                             "datasets": [{"path": str(data), "type": "chatml.intel"}]}, Path("r.yml"))  # fmt: skip


def test_training_on_from_lora_model_dir_keeps_its_tokenizer_s_ids_and_template(tmp_path):
    """The next stage's recipe need not repeat the tokens the adapter's run added (its model would not load), and
    listing them in another order must not give them other ids (the adapter's trained rows would serve others)."""
    from llmtune.train.model.load import load_tokenizer as stage_tokenizer

    base = make_tiny_model(tmp_path / "base")
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "adapter_config.json").write_text("{}")
    saved = load_tokenizer()
    saved.add_special_tokens({"additional_special_tokens": ["<|a|>", "<|b|>", "<|c|>"]})
    saved.chat_template = "{{ 'SFT TEMPLATE' }}"
    saved.save_pretrained(sft)
    keys = {"base_model": str(base), "datasets": [{"path": "o/d", "type": "chatml.intel"}], "rl": "dpo",
            "adapter": "lora", "lora_model_dir": str(sft), "output_dir": str(tmp_path / "dpo"),
            "lora_modules_to_save": ["embed_tokens", "lm_head"]}  # fmt: skip
    for extra in ({}, {"special_tokens": {"additional_special_tokens": ["<|c|>", "<|b|>", "<|a|>"]}}):
        recipe = recipe_from_mapping({**keys, **extra}, Path("r.yml"), check_files=False).recipe
        tokenizer = stage_tokenizer(recipe, str(base))
        assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|a|>", "<|b|>", "<|c|>")] == \
            [saved.convert_tokens_to_ids(t) for t in ("<|a|>", "<|b|>", "<|c|>")]  # fmt: skip
        assert len(tokenizer) == len(saved) and tokenizer.chat_template == "{{ 'SFT TEMPLATE' }}"


def test_an_adapter_trained_on_another_base_is_said(tmp_path):
    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base-a"}))
    keys = {"datasets": [{"path": "o/d", "type": "alpaca"}], "adapter": "lora", "lora_model_dir": str(adapter)}
    other = recipe_from_mapping({**keys, "base_model": "/runs/sft-full"}, Path("r.yml"), check_files=False)
    assert any(note.startswith("lora_model_dir: the adapter was trained on /models/base-a, and base_model is "
                               "/runs/sft-full") for note in other.notes), other.notes  # fmt: skip
    same = recipe_from_mapping({**keys, "base_model": "org/base-a"}, Path("r.yml"), check_files=False)
    assert not any("was trained on" in note for note in same.notes)  # the same model, downloaded elsewhere


def test_a_wrap_class_accelerate_can_t_find_ends_the_rank_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """A model with remote code: the plan can't read its classes, and accelerate refuses the class after loading.
    That is the recipe's value, not a crash (it was every rank's traceback and exit 1)."""
    import llmtune.train.worker as worker
    from llmtune.errors import EXIT_USER_ERROR

    def refuse(*_):
        raise ValueError("Could not find the transformer layer class MyLayer in the model.")

    recipe = recipe_from_mapping({"base_model": "org/m", "datasets": [{"path": "o/d", "type": "alpaca"}]},
                                 Path("r.yml"), check_files=False).recipe  # fmt: skip
    payload = tmp_path / "plan.json"
    payload.write_text(json.dumps({"recipe": recipe.model_dump(mode="json"), "plan": {"strategy": "fsdp2"}}))
    monkeypatch.setattr(worker.libraries, "hide_unused", lambda *_: None)
    monkeypatch.setattr(worker.distributed, "setup", refuse)
    assert worker.main([str(payload)]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == (
        "error: fsdp_config.transformer_layer_cls_to_wrap: the loaded model has no MyLayer module (accelerate wraps "
        "only classes of modules inside it) (hint: name the class of the model's decoder layers (its "
        "_no_split_modules), or remove the key)")  # fmt: skip
    monkeypatch.setattr(worker.distributed, "setup", lambda *_: (_ for _ in ()).throw(ValueError("other")))
    with pytest.raises(ValueError, match="other"):  # any other error stays a crash, with its traceback
        worker.main([str(payload)])
