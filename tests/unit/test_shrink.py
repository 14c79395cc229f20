"""The shrunken model a rehearsal trains keeps what the plan and the code paths depend on (plan/shrink.py), and
the rehearsal's pure helpers say what they did (stand-ins, the checkpoint's layout, the data at full scale)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmtune.errors import UserError
from llmtune.plan.shrink import (
    facts_from_config,
    known_config,
    layers_needed,
    parameter_ratio,
    read_full_config,
    shrink_config,
)

LLAMA_8B = known_config("meta-llama/Llama-3.1-8B-Instruct")


def test_the_table_gives_the_real_architecture_of_known_models():
    assert LLAMA_8B["model_type"] == "llama" and LLAMA_8B["rope_scaling"]["rope_type"] == "llama3"
    assert known_config("mistralai/Mistral-7B-Instruct-v0.3")["model_type"] == "mistral"
    assert known_config("Qwen/Qwen2.5-7B-Instruct")["architectures"] == ["Qwen2ForCausalLM"]
    assert known_config("someone/unknown-model") is None


def test_default_shrink_keeps_head_dimension_gqa_ratio_and_vocabulary():
    shrunk = shrink_config(LLAMA_8B)
    small, full = shrunk.shrunk, shrunk.full
    assert (small.num_layers, small.num_heads, small.num_kv_heads, small.head_dim) == (2, 4, 1, 128)
    assert small.hidden_size == 512 and small.num_heads // small.num_kv_heads == full.num_heads // full.num_kv_heads
    assert small.vocab_size == full.vocab_size == 128256 and small.tie_word_embeddings is False
    assert small.intermediate_size / small.hidden_size == pytest.approx(3.5)
    assert shrunk.config["rope_scaling"] == LLAMA_8B["rope_scaling"]  # everything else is the real config's
    assert "num_hidden_layers 32 -> 2" in shrunk.changes and parameter_ratio(shrunk) > 50


@pytest.mark.parametrize(("split", "heads", "kv_heads"), [(1, 4, 1), (2, 4, 1), (4, 4, 1), (8, 8, 2)])
def test_a_shrink_for_ulysses_keeps_heads_its_ranks_can_share(split, heads, kv_heads):
    """Context parallelism under DeepSpeed gives each of its ranks whole heads (KV heads divided or repeated): the
    rehearsal's model keeps the fewest heads that allow it, as the full model's 32/8 do."""
    small = shrink_config(LLAMA_8B, heads_split=split).shrunk
    assert (small.num_heads, small.num_kv_heads) == (heads, kv_heads)
    assert small.num_heads % split == 0 and (small.num_kv_heads % split == 0 or split % small.num_kv_heads == 0)


def test_the_rehearsal_counts_distinct_batches_per_data_parallel_group():
    from llmtune.rehearse.report import distinct_data

    ranks = {"ranks": [{"first_batch": "a"}, {"first_batch": "a"}, {"first_batch": "b"}, {"first_batch": "b"}]}
    assert distinct_data(ranks, {"context_parallel": 2})["ok"]  # two groups of two ranks, one batch each
    assert not distinct_data(ranks, None)["ok"]  # four data-parallel ranks that saw two batches
    assert distinct_data({"ranks": [{"first_batch": x} for x in "abcd"]}, {"tensor_parallel": 1})["ok"]


def test_a_hidden_size_trades_the_head_dimension_and_says_so():
    shrunk = shrink_config(known_config("meta-llama/Llama-3.1-70B-Instruct"), hidden=64)
    small = shrunk.shrunk
    assert (small.hidden_size, small.num_heads, small.num_kv_heads, small.head_dim) == (64, 8, 1, 8)
    assert shrunk.config["head_dim"] == 8 and "head_dim 128 -> 8" in shrunk.changes
    # 7 query heads per key/value head: the hidden size is rounded to 7 x an even head dimension
    qwen = shrink_config(known_config("Qwen/Qwen2.5-7B-Instruct"), hidden=64).shrunk
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.hidden_size) == (7, 1, 70)


def test_multi_head_attention_keeps_at_least_two_heads():
    small = shrink_config(known_config("HuggingFaceTB/SmolLM2-1.7B"), hidden=64).shrunk
    assert (small.num_heads, small.num_kv_heads, small.head_dim) == (2, 2, 32)


@given(kv=st.integers(1, 16), ratio=st.integers(1, 8), head_dim=st.sampled_from([64, 80, 96, 128, 256]),
       hidden=st.one_of(st.none(), st.integers(8, 512)), multiple=st.sampled_from([1, 64]))  # fmt: skip
def test_every_shrink_keeps_the_divisibility_attention_needs(kv, ratio, head_dim, hidden, multiple):
    heads = kv * ratio
    config = {"model_type": "llama", "hidden_size": heads * head_dim, "num_hidden_layers": 40,
              "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": 4 * heads * head_dim,
              "vocab_size": 1000}  # fmt: skip
    small = shrink_config(config, hidden=hidden, multiple=multiple).shrunk
    assert small.num_heads % small.num_kv_heads == 0 and small.num_heads // small.num_kv_heads == ratio
    assert small.num_heads >= 2 and small.head_dim % 2 == 0
    assert small.hidden_size == small.num_heads * small.head_dim
    assert small.intermediate_size % 8 == 0 and small.vocab_size == 1000
    # every linear layer's widths: q/o (hidden), k/v (kv heads x head dim), the MLP's
    widths = (small.hidden_size, small.num_kv_heads * small.head_dim, small.intermediate_size)
    assert all(width % multiple == 0 for width in widths)


def test_a_kbit_base_keeps_bitsandbytes_cpu_blocks():
    small = shrink_config(known_config("Qwen/Qwen2.5-1.5B-Instruct"), hidden=64, multiple=64).shrunk
    assert (small.num_kv_heads * small.head_dim, small.hidden_size, small.intermediate_size) == (64, 384, 2240)


def test_layers_cover_every_pipeline_stage():
    assert layers_needed() == 2 and layers_needed(4) == 4 and layers_needed(2, 3) == 6
    assert shrink_config(LLAMA_8B, min_layers=layers_needed(4)).shrunk.num_layers == 4
    assert shrink_config(LLAMA_8B, layers=3).shrunk.num_layers == 3
    with pytest.raises(UserError, match="needs 40 layers"):
        shrink_config(LLAMA_8B, min_layers=40)


def test_per_layer_settings_follow_the_layers_and_quantization_is_dropped():
    config = {**LLAMA_8B, "head_dim": 128, "layer_types": ["full_attention"] * 32, "max_window_layers": 28,
              "quantization_config": {"quant_method": "gptq"}}  # fmt: skip
    shrunk = shrink_config(config)
    assert shrunk.config["layer_types"] == ["full_attention"] * 2 and shrunk.config["max_window_layers"] == 2
    assert "quantization_config" not in shrunk.config and shrunk.config["head_dim"] == 128


def test_a_nested_text_config_is_shrunk_in_place():
    config = {"model_type": "wrapper", "tie_word_embeddings": True, "text_config": dict(LLAMA_8B)}
    shrunk = shrink_config(config, hidden=64)
    assert shrunk.config["text_config"]["num_hidden_layers"] == 2 and shrunk.shrunk.tie_word_embeddings


def test_config_sources_local_then_table(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    local = read_full_config(str(tmp_path), fetch=False)
    assert local.source.startswith("local") and local.config["hidden_size"] == 4096
    table = read_full_config("meta-llama/Llama-3.1-8B", fetch=False)
    assert "table" in table.source
    assert read_full_config("nobody/nothing", fetch=False) is None


def test_a_config_that_is_no_language_model_is_one_line():
    with pytest.raises(UserError, match="no 'num_attention_heads'"):
        facts_from_config({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10})


# --- the rehearsal's pure helpers


def test_stand_in_data_names_its_dataset(tmp_path):
    from llmtune.rehearse.data import parse_stand_ins

    file = tmp_path / "rows.jsonl"
    file.write_text("{}\n")
    found = parse_stand_ins([str(file), f"1={file}", f"test_datasets[0]={file}"])
    assert set(found) == {"*", "datasets[1]", "test_datasets[0]"}
    with pytest.raises(UserError, match="is not a file"):
        parse_stand_ins([f"datasets[0]={tmp_path / 'missing.jsonl'}"])


def test_checkpoint_layout_folds_ranks_and_scales_by_what_files_hold(tmp_path):
    from types import SimpleNamespace

    from llmtune.rehearse.report import checkpoint

    folder = tmp_path / "checkpoint-1"
    (folder / "global_step1").mkdir(parents=True)
    for rank in range(4):
        (folder / "global_step1" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x" * 1200)
        (folder / f"rng_state_{rank}.pth").write_bytes(b"x" * 10)
    (folder / "model.safetensors").write_bytes(b"x" * 400)
    recipe = SimpleNamespace(adapter=None, unfrozen_parameters=None, precision="bf16", bf16=True, optimizer="adamw_torch")
    shrunk = shrink_config(LLAMA_8B, hidden=64)
    total = shrunk.shrunk.total_params()
    found = checkpoint(recipe, SimpleNamespace(strategy="zero3"), shrunk, folder, total, total)
    layout = found["layout"]
    assert layout["global_step{N}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]["files"] == 4
    assert layout["rng_state_{r}.pth"] == {"files": 4, "bytes": 40, "kind": "other"}
    ratio = shrunk.full.total_params() / total
    # the 16-bit weights DeepSpeed saves under bf16 are half of the fp32 ones the rehearsal saved
    assert found["full_scale_bytes"] == pytest.approx(4800 * ratio + 400 * ratio / 2 + 40)


def test_a_large_dataset_is_sampled_checked_and_extrapolated(tmp_path):
    from types import SimpleNamespace

    from tiny import load_tokenizer, write_jsonl

    from llmtune.recipe import Recipe
    from llmtune.rehearse.data import check_data, gather_sources
    from llmtune.rehearse.report import full_scale_data

    rows = [{"instruction": f"say {i}", "input": "", "output": f"number {i} " * (1 + i % 4)} for i in range(50)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    recipe = Recipe.model_validate({"base_model": "x/y", "datasets": [{"path": str(data), "type": "alpaca"}],
                                    "sequence_len": 256, "sample_packing": True, "micro_batch_size": 2,
                                    "output_dir": str(tmp_path / "out")})  # fmt: skip
    [source] = gather_sources(recipe, 20, tmp_path / "sample", {})
    with pytest.raises(UserError, match=r"the recipe has no datasets\[3\] \(it has datasets\[0\]\)"):
        gather_sources(recipe, 20, tmp_path / "sample", {"datasets[3]": str(data)})  # a typo is never ignored
    assert (source.rows_sampled, source.rows_total, source.stand_in) == (20, 50, None)
    assert len(open(source.spec["path"]).readlines()) == 20 and source.spec["type"] == "alpaca"
    checked = check_data(recipe, load_tokenizer(), [source], 20, tmp_path / "cache")
    assert checked.sampled and checked.stats["rows"] == checked.stats["train_examples"] == 20
    assert 1 <= checked.stats["train_rows"] < 20  # the sample was packed (sample_packing), as the full run will be
    plan = SimpleNamespace(micro_batch_size=2, data_parallel_size=2, gradient_accumulation_steps=1, global_batch_size=4)
    full = full_scale_data(recipe, plan, checked)
    assert full["train_rows_full"] == round(checked.stats["train_rows"] * 50 / 20)
    assert full["steps_per_epoch"] == -(-full["train_rows_full"] // 4) and full["token_slots_per_step"] == 4 * 256


@pytest.mark.parametrize("config", [
    {"model_type": "opt", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "ffn_dim": 8192,
     "vocab_size": 512, "word_embed_proj_dim": 2048},
    {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 512},
    {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
     "multi_query": True, "vocab_size": 512},
])  # fmt: skip
def test_older_families_shrink_under_their_own_keys_into_a_model_of_the_counted_size(config):
    """GPT-2's n_embd/n_layer/n_head, OPT's ffn_dim, Falcon's multi-query head (its head_dim a read-only property):
    the shrunken config is written in the family's keys, loads, and has the parameters the estimate counts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shrunk = shrink_config(config)
    loaded = AutoConfig.for_model(**shrunk.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(loaded)
    # learned position tables (OPT's, GPT-2's) are left out of the estimate: a few MB at full size, most of a
    # shrunken model
    counted = sum(p.numel() for n, p in model.named_parameters() if "pos" not in n and "wpe" not in n)
    assert shrunk.shrunk.total_params() == pytest.approx(counted, rel=0.05)
    assert shrunk.shrunk.num_layers == 2 and shrunk.shrunk.hidden_size < 256


def test_a_tokenizer_not_available_offline_is_fetched_with_todays_hub_cli():
    """The hint names `hf download` (today's huggingface_hub has no huggingface-cli), each pattern with its own
    --include: a second pattern after one --include is read by `hf download` as a file name."""
    from types import SimpleNamespace

    from llmtune.rehearse.model import choose_tokenizer

    recipe = SimpleNamespace(tokenizer_config=None, base_model="someone/absent-model")
    with pytest.raises(UserError, match="not available offline") as caught:
        choose_tokenizer(recipe, None, None, online=False)
    assert "`hf download someone/absent-model --include 'tokenizer*' --include '*.json'`" in caught.value.hint
