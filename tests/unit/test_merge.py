"""llmtune merge on adapters PEFT writes: every LoRA flavour folds in to the logits base + adapter gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import make_tiny_model

from llmtune.errors import UserError

PROBE = [[1, 17, 42, 99, 5, 23, 64, 8]]


def fake_run(tmp_path: Path, base: Path, **lora) -> tuple[Path, object]:
    """A run folder holding a randomly initialised (non-zero) adapter, as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(init_lora_weights=False, **lora))
    if lora.get("use_dora"):  # a trained magnitude differs from the weight norm it starts at
        import torch

        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    param.mul_(1.5)
    run = tmp_path / "run"
    model.save_pretrained(run)
    (run / "llmtune").mkdir()
    recipe = {"base_model": str(base), "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "adapter": "lora",
              "output_dir": str(run)}  # fmt: skip
    plan = {"precision": "fp32", "title": "single process", "world_size": 1}
    (run / "llmtune" / "plan.json").write_text(json.dumps({"recipe": recipe, "plan": plan}))
    return run, model.eval()


def logits(model):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits


CASES = {
    "plain": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
    "rslora+patterns": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": True,
                        "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"v_proj": 3}},
    "dora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"], "use_dora": True},
    "modules_to_save": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    "embedding": {"r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens", "o_proj"]},
}  # fmt: skip
# LoRA layers per case on the 2-layer tiny model: all-linear is 7 per layer (lm_head is never a target)
FOLDED = {"plain": 14, "rslora+patterns": 6, "dora": 4, "modules_to_save": 2, "embedding": 1 + 2}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_base_plus_adapter(tmp_path, case):
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base")
    run, reference = fake_run(tmp_path, base, **CASES[case])
    result = merge_run(run, tmp_path / "merged")
    assert result.merged_modules == FOLDED[case]  # the LoRA layers it says it folded in: every targeted module
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    want, got = logits(reference), logits(merged)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(base)), want, atol=1e-4)


def test_lora_on_a_tied_output_layer_unties_it(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(base / "model.safetensors"))  # stored once, as the embedding
    run, reference = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"])
    merge_run(run, tmp_path / "merged")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(merged), logits(reference), atol=1e-5)


def test_dtype_and_errors(tmp_path):
    from safetensors.torch import load_file

    from llmtune.plan.memory.table import parse_size_option
    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base")
    run, _ = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules="all-linear")
    result = merge_run(run, tmp_path / "bf16", dtype="bf16")
    assert result.dtype == "bfloat16"
    assert {str(t.dtype) for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values()} == {"torch.bfloat16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    size = lambda text: parse_size_option("--max-shard-size", text)  # noqa: E731 - the flag merge parses with
    assert size("5GB") == 5 * 10**9 and size("2GiB") == 2 * 2**30 and size("100KB") == 100_000
    with pytest.raises(UserError, match="not a size"):
        size("lots")
    with pytest.raises(UserError, match="already exists"):
        merge_run(run, tmp_path / "bf16")
    with pytest.raises(UserError, match="not an llmtune run folder"):
        merge_run(tmp_path / "base", tmp_path / "x")
    with pytest.raises(UserError, match=r"can't write the merged model next to /proc/llmtune-x"):  # not a traceback
        merge_run(run, Path("/proc/llmtune-x"))
    # the adapter belongs to another model: named, nothing written
    other = make_tiny_model(tmp_path / "other", hidden=32, heads=2, kv_heads=1, intermediate=64)
    plan = json.loads((run / "llmtune" / "plan.json").read_text())
    plan["recipe"]["base_model"] = str(other)
    (run / "llmtune" / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(UserError, match="update has shape"):
        merge_run(run, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists() and not list(tmp_path.glob(".wrong.merging-*"))


def test_force_replaces_an_earlier_merge_only_never_the_run_or_what_holds_it(tmp_path):
    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base")
    run, _ = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules="all-linear")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "other_run" / "checkpoint-100").mkdir(parents=True)
    full_checkpoint = make_tiny_model(tmp_path / "full_run" / "checkpoint-4")  # a plain model folder: config.json
    before = sorted(p.name for p in tmp_path.iterdir())
    for output, said in ((run, "holds the run being merged"), (tmp_path, "holds the run being merged"),
                         (tmp_path / "other_run", r"not one \(checkpoint-100\)"), (tmp_path / "notes.txt", "is a file"),
                         (base, "a model llmtune merge didn't write, perhaps a base model"),
                         (full_checkpoint, r"not one \(a checkpoint\)")):  # fmt: skip
        with pytest.raises(UserError, match=said):
            merge_run(run, output, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (run / "adapter_model.safetensors").is_file()
    assert (base / "model.safetensors").is_file() and (full_checkpoint / "model.safetensors").is_file()
    merge_run(run, tmp_path / "merged")
    merge_run(run, tmp_path / "merged", force=True)  # an earlier merge is what --force replaces
    assert (tmp_path / "merged" / "config.json").is_file()


def test_one_chosen_checkpoint_merges_its_own_weights(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.plan.checkpoint_layout import MARKER
    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base")
    run, final = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules="all-linear")
    torch.manual_seed(1)  # the checkpoint's adapter is another one than the final save's
    _, early = fake_run(tmp_path / "early", base, r=4, lora_alpha=8, target_modules="all-linear")
    early.save_pretrained(run / "checkpoint-2")
    (run / "checkpoint-2" / MARKER).write_text(json.dumps({"step": 2, "world_size": 1}))
    result = merge_run(run / "checkpoint-2")
    assert result.output == run / "merged-checkpoint-2" and "checkpoint-2, its adapter (the checkpoint asked for)" in result.source
    merged = AutoModelForCausalLM.from_pretrained(result.output).eval()
    assert torch.allclose(logits(merged), logits(early), atol=1e-5)
    assert not torch.allclose(logits(merged), logits(final), atol=1e-3)
    early.save_pretrained(run / "checkpoint-3")  # its save never finished: no marker
    with pytest.raises(UserError, match="checkpoint-3 is not a complete checkpoint"):
        merge_run(run / "checkpoint-3")
    assert not (run / "merged-checkpoint-3").exists()
    # a merged folder is a model, not a run: merging it again is refused (it wrote merged/merged), nothing written
    before = sorted(p.name for p in result.output.iterdir())
    with pytest.raises(UserError, match="already a merged model"):
        merge_run(result.output)
    assert sorted(p.name for p in result.output.iterdir()) == before


def test_eval_measures_a_checkpoint_or_names_the_merge_or_recipe_it_needs(tmp_path, monkeypatch):
    from llmtune.plan.checkpoint_layout import MARKER
    from llmtune.post.evaluate import resolve_target

    base = make_tiny_model(tmp_path / "base")
    run, model = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules=["q_proj"])
    model.save_pretrained(run / "checkpoint-2")
    (run / "checkpoint-2" / MARKER).write_text(json.dumps({"step": 2, "world_size": 1}))
    target = resolve_target(run / "checkpoint-2")
    assert (target.adapter_dir, target.model_dir) == (str(run / "checkpoint-2"), str(base))
    assert target.result_file == run / "eval-checkpoint-2.json"  # the run's own eval.json is the final save's
    assert resolve_target(run).result_file == run / "eval.json"
    (run / "checkpoint-4" / "global_step4").mkdir(parents=True)  # a ZeRO-3 checkpoint: partitions only
    (run / "checkpoint-4" / MARKER).write_text(json.dumps({"step": 4, "world_size": 2}))
    with pytest.raises(UserError, match="sharded DeepSpeed ZeRO states") as err:
        resolve_target(run / "checkpoint-4")
    assert err.value.hint == f"llmtune merge {run / 'checkpoint-4'}, then llmtune eval {run / 'merged-checkpoint-4'}"
    bare = tmp_path / "bare"
    model.save_pretrained(bare)  # an adapter without an llmtune run: the recipe must come with it
    with pytest.raises(UserError, match="adapter without an llmtune run") as err:
        resolve_target(bare)
    assert err.value.hint == f"pass the recipe and the model: llmtune eval RECIPE.yaml --model {bare}"
    with pytest.raises(UserError, match="--model goes with a recipe"):
        resolve_target(run, str(bare))
    # infer and chat load the same weights: a checkpoint's adapter on the run's base, with the base's tokenizer
    from llmtune.post.generate import load_for_generation

    loaded = load_for_generation(str(run / "checkpoint-2"))
    assert loaded.label == f"{run / 'checkpoint-2'} (adapter on {base})"
    assert logits(loaded.model).equal(logits(model))
    with pytest.raises(UserError, match="sharded DeepSpeed ZeRO states") as err:
        load_for_generation(str(run / "checkpoint-4"), command="chat")
    assert err.value.hint.endswith(f"then llmtune chat {run / 'merged-checkpoint-4'}")
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # a run that never saved its final model
        (run / name).unlink()
    (run / "checkpoint-4" / "global_step4").rmdir()
    (run / "checkpoint-4" / MARKER).unlink()
    target = resolve_target(run)  # its newest complete checkpoint, said so, in a file of its own
    assert (target.adapter_dir, target.result_file) == (str(run / "checkpoint-2"), run / "eval-checkpoint-2.json")
    assert target.label == f"checkpoint-2 of run {run}"
    assert load_for_generation(str(run)).label == f"checkpoint-2 of run {run} (adapter on {base})"
    monkeypatch.chdir(run / "checkpoint-2")  # `llmtune eval .` from inside the checkpoint is that checkpoint
    assert resolve_target(Path(".")).result_file == run / "eval-checkpoint-2.json"
    # another tool's adapter measured with a recipe is a trained model: a preference recipe's reference is its base
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    (tmp_path / "r.yaml").write_text(json.dumps({"base_model": str(base), "output_dir": str(tmp_path / "o"),
                                                 "datasets": [{"path": str(tmp_path / "rows.jsonl"),
                                                               "type": "alpaca"}]}))  # fmt: skip
    assert resolve_target(tmp_path / "r.yaml", str(bare)).is_run and not resolve_target(tmp_path / "r.yaml").is_run


def test_a_run_whose_saved_recipe_this_llmtune_can_t_read_still_loads_its_full_model(tmp_path, monkeypatch):
    """A recipe key of another llmtune version in plan.json: infer/chat of a merged or full run loaded before the
    recipe was read for every run folder, and must still; an adapter, which needs the recipe's base, is one line."""
    from llmtune.post.generate import load_for_generation

    folder = make_tiny_model(tmp_path / "merged")
    (folder / "llmtune").mkdir()
    recipe = {"base_model": "x", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "key_of_a_later_llmtune": 1}
    (folder / "llmtune" / "plan.json").write_text(json.dumps({"recipe": recipe, "plan": {}}))
    assert load_for_generation(str(folder)).model is not None
    monkeypatch.chdir(tmp_path)  # a relative path to a full model is that model, named as given
    assert load_for_generation("merged").label == "merged"
    run, _ = fake_run(tmp_path, make_tiny_model(tmp_path / "base"), r=4, lora_alpha=8, target_modules=["q_proj"])
    (run / "llmtune" / "plan.json").write_text(json.dumps({"recipe": recipe, "plan": {}}))
    with pytest.raises(UserError, match="its recipe can't be read by this llmtune"):
        load_for_generation(str(run))
    from llmtune.post.merge import merge_run  # merge needs the recipe (its base): one line, not a traceback

    with pytest.raises(UserError, match="its recipe can't be read by this llmtune") as err:
        merge_run(run)
    assert err.value.hint == "merge it with the llmtune version that trained it" and not (run / "merged").exists()


def test_a_changed_eos_token_reaches_the_merged_configs(tmp_path):
    """special_tokens: {eos_token: ...} with LoRA: the merged config and generation config stop on the tokenizer's
    eos, as a full fine-tune's do (the Trainer aligns them); the base's eos still stops generation too."""
    from tiny import load_tokenizer
    from transformers import AutoModelForCausalLM

    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base")
    run, _ = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules=["q_proj"])
    tokenizer = load_tokenizer()
    base_eos = tokenizer.eos_token_id
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})  # in the vocabulary: no new embedding row
    tokenizer.save_pretrained(str(run))
    new_eos = tokenizer.eos_token_id
    assert new_eos != base_eos
    merge_run(run, tmp_path / "merged")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    generation = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert config["eos_token_id"] == new_eos
    assert generation["eos_token_id"] == [new_eos, base_eos]
    assert config["pad_token_id"] == generation["pad_token_id"] == tokenizer.pad_token_id
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert new_eos in merged.generation_config.eos_token_id


def test_align_token_ids_keeps_listed_eos_ids():
    from llmtune.post.merge import align_token_ids

    config, generation = {"eos_token_id": [7, 8], "bos_token_id": 1}, {"eos_token_id": 7, "bos_token_id": 1}
    align_token_ids(config, generation, {"eos_token_id": 9, "bos_token_id": 2})
    assert config == {"eos_token_id": [9, 7, 8], "bos_token_id": 2}
    assert generation == {"eos_token_id": [9, 7], "bos_token_id": 2}
    unchanged = {"eos_token_id": [9, 7], "bos_token_id": 2}
    align_token_ids(unchanged, None, {"eos_token_id": 9})
    assert unchanged == {"eos_token_id": [9, 7], "bos_token_id": 2}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lora_on_fused_moe_experts_merges_through_peft(tmp_path, family):
    """peft's all-linear puts LoRA on a MoE model's fused expert tensors (target_parameters), which transformers 5
    keeps fused in memory and writes one per expert: the merge goes through peft and save_pretrained's layout."""
    import torch
    import transformers
    from tiny import load_tokenizer
    from transformers import AutoModelForCausalLM

    from llmtune.post.merge import merge_run

    config_class = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}[family]
    extra = {"qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                           "decoder_sparse_step": 1},
             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}}[family]  # fmt: skip
    tokenizer = load_tokenizer()
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 **extra)  # fmt: skip
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    run, reference = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules="all-linear")
    assert json.loads((run / "adapter_config.json").read_text())["target_parameters"]  # what this path is for
    result = merge_run(run, tmp_path / "merged")
    assert result.merged_modules > 8  # the attention projections and the expert tensors
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    want, got = logits(reference), logits(merged)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(base)), want, atol=1e-4)


def test_a_merge_the_disk_cant_take_is_one_line_and_keeps_nothing(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error (not an OSError): it was a traceback, staging left behind."""
    from safetensors import SafetensorError

    from llmtune.post.merge import merge_run

    run, _ = fake_run(tmp_path, make_tiny_model(tmp_path / "base"), r=4, lora_alpha=8, target_modules=["q_proj"])

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')  # fmt: skip

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(UserError, match=r"writing the merged model to .*merged failed \(Error while serializing") as err:
        merge_run(run)
    assert "nothing was kept" in err.value.one_line() and not [p for p in run.iterdir() if "merg" in p.name]


def test_a_damaged_adapter_or_base_is_one_line_naming_the_file(tmp_path):
    """A truncated safetensors file or an empty adapter_config.json (a copy cut short, a full disk) was a
    traceback from safetensors or json in merge, infer and eval."""
    from llmtune.errors import reading
    from llmtune.post.merge import merge_run

    base = make_tiny_model(tmp_path / "base")
    run, _ = fake_run(tmp_path, base, r=4, lora_alpha=8, target_modules="all-linear")
    weights = run / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:1000])
    with pytest.raises(UserError, match=rf"{weights} can't be read \(.*header.*\): it is damaged or incompletely"):
        merge_run(run, tmp_path / "m1")
    weights.write_bytes(whole)
    (run / "adapter_config.json").write_text("")
    with pytest.raises(UserError, match="adapter_config.json can't be read"):
        merge_run(run, tmp_path / "m2")
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
    with pytest.raises(KeyError), reading(weights):  # other errors pass through as they are
        raise KeyError("x")
