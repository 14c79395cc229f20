"""peft_trainable_token_indices: only the named embedding rows train beside LoRA (peft's trainable tokens), tokens a
recipe adds are accepted when their rows are among them (and refused, naming the rows to list, when not), and
llmtune merge writes the trained rows into the embedding exactly as peft's own merge does, tied or untied, with
the vocabulary grown or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import load_tokenizer, make_tiny_model

from llmtune.errors import UserError
from llmtune.plan.vocabulary import check_modules_to_save
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.model.adapters import lora_config

MODULES = ("embed_tokens", "lm_head")


def recipe(**changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x",
            "adapter": "lora", "lora_target_modules": ["q_proj", "v_proj"]}  # fmt: skip
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def test_the_rows_reach_peft_and_impossible_settings_are_refused():
    assert lora_config(recipe(peft_trainable_token_indices=[5, 9])).trainable_token_indices == [5, 9]
    assert recipe(peft_trainable_token_indices=7).peft_trainable_token_indices == [7]  # one id, as Axolotl reads it
    both = {"embed_tokens": [5], "lm_head": [5]}
    assert lora_config(recipe(peft_trainable_token_indices=both)).trainable_token_indices == both
    assert lora_config(recipe()).trainable_token_indices is None
    for changes, message in [
        ({"adapter": None}, "trains embedding rows beside a LoRA adapter"),
        ({"lora_model_dir": "/runs/sft"}, "the loaded adapter trains the token rows it was saved with"),
        ({"relora": True, "jagged_restart_steps": 10}, "relora with peft_trainable_token_indices"),
        ({"pipeline_parallel_size": 2}, "the pipeline's stages are cut from the plain model"),
    ]:
        with pytest.raises(UserError, match=message):
            recipe(peft_trainable_token_indices=[5], **changes)
    with pytest.raises(UserError, match=r"distinct ids, 0 or more \(got \[3, 3\]\)"):
        recipe(peft_trainable_token_indices=[3, 3])
    from llmtune.plan import make_cluster
    from llmtune.plan import make_plan as plan_alone

    for zero3 in ("zero3", "deepspeed_configs/zero3_bf16.json", {"zero_optimization": {"stage": 3}}):
        with pytest.raises(UserError, match="peft_trainable_token_indices with ZeRO-3"):  # (peft hard-codes CUDA)
            plan_alone(recipe(deepspeed=zero3, peft_trainable_token_indices=[5]), make_cluster(2, device="cpu"))
    plan_alone(recipe(deepspeed="zero2", peft_trainable_token_indices=[5]), make_cluster(2, device="cpu"))


NEW = [("tokens", "<think>"), ("tokens", "</think>")]


def test_added_tokens_train_when_their_rows_are_listed_for_every_untied_embedding():
    check = check_modules_to_save
    # a list is the input embedding's rows: a tied head follows them, an untied one would keep its new rows random
    check(recipe(peft_trainable_token_indices=[512, 513]), NEW, "m", MODULES, [512, 513], tied=True)
    with pytest.raises(UserError, match=r"ids \[512, 513\]\) have rows in lm_head that peft_trainable_token_indices "
                                        "doesn't train") as refused:  # fmt: skip
        check(recipe(peft_trainable_token_indices=[512, 513]), NEW, "m", MODULES, [512, 513], tied=False)
    assert refused.value.hint == ("set peft_trainable_token_indices: {embed_tokens: [512, 513], lm_head: "
                                  "[512, 513]}")  # fmt: skip
    check(recipe(peft_trainable_token_indices={"embed_tokens": [512, 513, 7], "lm_head": [512, 513]}), NEW, "m",
          MODULES, [512, 513], tied=False)  # fmt: skip
    check(recipe(peft_trainable_token_indices=[512, 513], lora_modules_to_save=["lm_head"]), NEW, "m", MODULES,
          [512, 513], tied=False)  # fmt: skip (the head trains whole)
    with pytest.raises(UserError, match="embed_tokens and lm_head") as refused:  # one id of two missing
        check(recipe(peft_trainable_token_indices=[512, 7]), NEW, "m", MODULES, [512, 513], tied=False)
    assert "embed_tokens: [7, 512, 513]" in refused.value.hint
    check(recipe(peft_trainable_token_indices=[9]), NEW, "m", MODULES)  # plan time: the ids come with the tokenizer
    with pytest.raises(UserError, match="lora_modules_to_save doesn't hold embed_tokens and lm_head") as refused:
        check(recipe(), NEW, "m", MODULES, [512, 513], tied=True)
    assert "or peft_trainable_token_indices for their rows alone" in refused.value.hint


@pytest.mark.parametrize(("tied", "grown", "rows"), [
    (False, True, {"embed_tokens": [512, 5], "lm_head": [512]}),
    (True, True, [512, 5]),
    (False, False, [5, 9]),
    (True, False, {"embed_tokens": [9]}),
    (True, True, {"embed_tokens": [512, 513]}),  # peft saves the tied head's copy, which the mapping doesn't name
])  # fmt: skip
def test_merge_writes_the_trained_rows_as_peft_merges_them(tmp_path, tied, grown, rows):
    import torch
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtune.post.fold import fold_adapter
    from llmtune.train.model.shards import ShardWriter

    base = make_tiny_model(tmp_path / "base", tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(base)
    if grown:  # tokens the recipe added: the embedding grew before peft wrapped it
        tokenizer = load_tokenizer()
        tokenizer.add_tokens(["<think>", "</think>"])
        model.resize_token_embeddings(len(tokenizer))
    adapted = get_peft_model(model, lora_config(recipe(peft_trainable_token_indices=rows)))
    trained = [name for name, p in adapted.named_parameters() if p.requires_grad and "token_adapter" in name]
    assert trained and all(name.endswith("trainable_tokens_delta.default") for name in trained)
    torch.manual_seed(1)
    with torch.no_grad():  # as training would move them: the rows and LoRA's B away from their start
        for parameter in adapted.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    adapted.save_pretrained(tmp_path / "run")
    expected = {k: v.clone() for k, v in adapted.merge_and_unload().state_dict().items()}
    (tmp_path / "merged").mkdir()
    writer = ShardWriter(tmp_path / "merged", 10**9)
    fold_adapter(tmp_path / "run", base, writer, torch.float32, lambda items, *_a, **_k: items)
    writer.finish()
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    embedding = merged["model.embed_tokens.weight"]
    assert embedding.shape[0] == (514 if grown else 512)
    assert torch.equal(embedding, expected["model.embed_tokens.weight"])
    head = "lm_head.weight"
    assert (head in merged) is not tied  # a tied head stays the embedding, one tensor
    if not tied:
        assert torch.equal(merged[head], expected[head])
    untouched = load_file(str(base / "model.safetensors"))["model.embed_tokens.weight"]
    listed = rows if isinstance(rows, list) else rows["embed_tokens"]
    kept = [i for i in range(untouched.shape[0]) if i not in listed]
    old_rows = [i for i in listed if i < 512]
    assert torch.equal(embedding[kept], untouched[kept])  # every other row as the base has it
    if old_rows:  # the listed rows took their trained values
        assert not torch.allclose(embedding[old_rows], untouched[old_rows])


@pytest.mark.parametrize("tied", [True, False])
def test_the_tokenizer_names_the_new_ids_and_the_model_says_whether_its_head_is_tied(tmp_path, tied):
    """add_recipe_tokens checks after adding: the ids are the tokenizer's (512, 513 after its 512), tied from the
    model's config."""
    from llmtune.train.model.load import add_recipe_tokens

    source = make_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    listed = recipe(tokens=["<think>", "</think>"], peft_trainable_token_indices=[512, 513])
    tokenizer = load_tokenizer()
    if tied:
        add_recipe_tokens(listed, tokenizer, "m", str(source))
        assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [512, 513]
    else:
        with pytest.raises(UserError, match="have rows in lm_head"):
            add_recipe_tokens(listed, tokenizer, "m", str(source))
        both = recipe(tokens=["<think>", "</think>"], peft_trainable_token_indices={"embed_tokens": [512, 513],
                                                                                    "lm_head": [512, 513]})  # fmt: skip
        add_recipe_tokens(both, load_tokenizer(), "m", str(source))


def test_ids_and_modules_the_model_lacks_are_one_line(tmp_path):
    """peft stopped on an IndexError (an id past the vocabulary), or blamed lora_target_linear (a module name the
    model lacks)."""
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.adapters import check_token_rows

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"))
    check_token_rows(model, [0, 511])
    check_token_rows(model, {"embed_tokens": [3], "lm_head": [3]})
    with pytest.raises(UserError, match=r"id 600 is past the input embedding's 512 rows \(ids 0 to 511\)"):
        check_token_rows(model, [5, 600])
    with pytest.raises(UserError, match="id 512 is past model.embed_tokens's 512 rows"):
        check_token_rows(model, {"embed_tokens": [512]})
    with pytest.raises(UserError, match="wte names no embedding or output layer of the model") as caught:
        check_token_rows(model, {"wte": [5]})
    assert caught.value.hint == "use its names: embed_tokens, lm_head"


def test_an_adapter_saved_with_another_embedding_size_is_refused_before_peft_loads_it(run_cli, write_recipe, tmp_path):
    """lora_model_dir's adapter grew the embedding to 544 rows (a token added, resize_token_embeddings_to_32x); a run
    whose model has 513 (the same token, without the rounding) was a state-dict size mismatch traceback from peft
    after the model loaded. It is one line at validate, read from the files, and again before peft loads it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = make_tiny_model(tmp_path / "base")
    adapter = tmp_path / "adapter"
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(544)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=list(MODULES))).save_pretrained(adapter)
    changes = {"base_model": str(base), "adapter": "lora", "lora_model_dir": str(adapter), "tokens": ["<x1>"],
               "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "alpaca"}]}  # fmt: skip
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    done = run_cli("validate", write_recipe(changes))
    line = done.err.strip().splitlines()[-1]  # (the lines before: this test's own model building)
    assert done.code == 2 and line.startswith("error: ") and "Traceback" not in done.err, done.err
    assert ("adapter holds 544 embedding rows (embed_tokens) but this run's model has 513" in line
            and "set resize_token_embeddings_to_32x: true" in line), done.err  # fmt: skip
    assert run_cli("validate", write_recipe({**changes, "resize_token_embeddings_to_32x": True})).code == 0
    # before peft loads it (the tokenizer may not have been on this machine at validate): the model's own rows
    from llmtune.train.model.adapters import attach_adapter

    loaded = AutoModelForCausalLM.from_pretrained(base)
    loaded.resize_token_embeddings(513)
    with pytest.raises(UserError, match="holds 544 embedding rows .* has 513.*") as refused:
        attach_adapter(loaded, recipe(base_model=str(base), lora_model_dir=str(adapter)))
    assert "resize_token_embeddings_to_32x: true" in refused.value.hint
    loaded.resize_token_embeddings(576)  # the rounding set where the adapter's run had none
    with pytest.raises(UserError, match="has 576 .*rounded up to 32"):
        attach_adapter(loaded, recipe(lora_model_dir=str(adapter), resize_token_embeddings_to_32x=True))
    loaded.resize_token_embeddings(544)
    assert attach_adapter(loaded, recipe(lora_model_dir=str(adapter))).peft_config["default"].r == 2
