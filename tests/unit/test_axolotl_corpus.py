"""Axolotl recipes as written: every recipe of the corpus validates and plans, or is refused by a capability.

The corpus (tests/fixtures/axolotl_recipes/) is written in the style of Axolotl's examples and covers every key
those examples use; each recipe says what `llmtune validate` must answer. The public recipes' manifest
(scripts/axolotl_corpus.tsv, counted by scripts/axolotl_corpus.py) is well-formed, the counting script tells
refusals from crashes, and docs/axolotl.md holds what scripts/axolotl_tables.py generates.
"""

from __future__ import annotations

import re
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe import load_recipe
from llmtune.recipe.axolotl_history import KEYS, RELEASES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import axolotl_corpus  # noqa: E402
import axolotl_tables  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "axolotl_recipes"
RECIPES = sorted(CORPUS.glob("*.yml"))

# Every key Axolotl's own examples use (examples/ of axolotl-ai-cloud/axolotl, July 2026), save the few that
# Axolotl itself ignores (test_value, torch_dtype, full_finetune, context_parapllel_size; adam_eps and eta_min,
# which llmtune honours, are in test_keys_axolotl_drops_silently_but_whose_intent_is_plain_are_honoured_and_said).
EXAMPLE_KEYS = """
accelerator_config activation_offloading adam_beta1 adam_beta2 adam_epsilon adapter attn_implementation
auto_resume_from_checkpoints base_model base_model_ignore_patterns batch_size bf16 bfloat16 bnb_config_kwargs branch
center_rewards_coefficient chat_template cls_model_config context_parallel_size cosine_constant_lr_ratio
cosine_min_lr_ratio curriculum_sampling cut_cross_entropy dataset_exact_deduplication dataset_prepared_path datasets
ddp ddp_find_unused_parameters debug deepspeed device_map diffusion do_causal_lm_eval dockerfile_commands
dp_replicate_size dp_shard_size dsv4_fp4_grouped_mode eaft_alpha eaft_k early_stopping_patience ebft eot_tokens
eval_batch_size eval_causal_lm_metrics eval_max_new_tokens eval_sample_packing eval_steps eval_strategy
eval_table_size evals_per_epoch evaluation_strategy experimental_skip_move_to_device expert_parallel_num_nvl_bytes
expert_parallel_size expert_parallel_token_capacity experts_implementation flash_attention flash_attn_cross_entropy
flash_attn_fuse_mlp flash_attn_rms_norm flash_optimum flex_attn_compile_kwargs float16 fp16 fp8
fp8_enable_fsdp_float8_all_gather fsdp fsdp_config fsdp_version fused_attn_kernel gemma4_hybrid_attn_impl gpu
gpu_count gptq gptq_disable_exllama gptq_groupsize gptq_model_v1 gradient_accumulation_steps gradient_checkpointing
gradient_checkpointing_kwargs group_by_length hf_use_auth_token hub_model_id jagged_restart_anneal_steps
jagged_restart_steps jagged_restart_warmup_steps kto_desirable_weight learning_rate liger_fused_linear_cross_entropy
liger_glu_activation liger_layer_norm liger_rms_norm liger_rms_norm_gated liger_rope lisa_layers_attribute
lisa_n_layers lisa_step_interval llama4_linearized_experts llmcompressor load_in_4bit load_in_8bit local_rank
logging_steps lora_alpha lora_dropout lora_fan_in_fan_out lora_mlp_kernel lora_model_dir lora_modules_to_save
lora_o_kernel lora_qkv_kernel lora_r lora_target_linear lora_target_modules lora_target_parameters
loss_watchdog_patience loss_watchdog_threshold low_cpu_mem_usage lr_quadratic_warmup lr_scheduler max_grad_norm
max_packed_sequence_len max_steps memory memory_preprocess micro_batch_size min_sample_len model_config
model_quantization_config model_quantization_config_kwargs model_type node_count num_epochs num_labels
nvfp4_merge_aware optimizer orpo_alpha otel_metrics_host otel_metrics_port output_dir pad_to_sequence_len peft
peft_use_rslora plugins pretrain_multipack_attn pretraining_dataset process_reward_model processor_type project_name
provider push_dataset_to_hub qat quantize_moe_experts ray_num_workers reinit_weights relora relora_cpu_offload
relora_prune_ratio remove_unused_columns resize_token_embeddings_to_32x resume_from_checkpoint revision_of_model
reward_model rl rl_beta sample_packing sample_packing_eff_est sample_packing_seq_len_multiplier
sample_packing_sequentially save_only_model save_safetensors save_steps save_strategy save_total_limit
saves_per_epoch secrets seed sequence_len shuffle_merged_datasets skip_prepare_dataset special_tokens streaming
streaming_multipack_buffer_size strict swanlab_completion_log_interval swanlab_completion_max_buffer
swanlab_description swanlab_experiment_name swanlab_log_completions swanlab_log_model swanlab_mode swanlab_project
swanlab_workspace tensor_parallel_size tf32 tiled_mlp timeout timeout_preprocess tokenizer_config tokenizer_legacy
tokenizer_type tokenizer_use_fast tokenizer_use_mistral_common tokens torch_compile torch_compile_mode
torchdistx_path total_num_tokens trackio_project_name trackio_run_name trackio_space_id train_on_inputs trl
trust_remote_code unfrozen_parameters use_dsv4_kernels use_eaft use_glm_dsa_kernels use_kernels use_onebitllms
use_otel_metrics use_ray use_scattermoe use_sonicmoe use_swanlab use_tensorboard use_wandb val_set_size vllm volumes
wandb_entity wandb_log_model wandb_name wandb_project wandb_run_id wandb_watch warmup_ratio warmup_steps weight_decay
""".split()
EXAMPLE_DATASET_KEYS = """
data_files drop_system_message field field_chosen field_messages field_rejected field_thinking max_completion_length
message_field_content message_field_role message_property_mappings name path roles split step_separator
template_thinking_key text_column train_on_last_step_only type
""".split()
EXAMPLE_FSDP_KEYS = """
activation_checkpointing auto_wrap_policy cpu_ram_efficient_loading fsdp_activation_checkpointing
fsdp_auto_wrap_policy fsdp_backward_prefetch fsdp_cpu_ram_efficient_loading fsdp_forward_prefetch
fsdp_limit_all_gathers fsdp_offload_params fsdp_reshard_after_forward fsdp_sharding_strategy fsdp_state_dict_type
fsdp_sync_module_states fsdp_transformer_layer_cls_to_wrap fsdp_use_orig_params fsdp_version offload_params
reshard_after_forward sharding_strategy state_dict_type transformer_layer_cls_to_wrap
""".split()


def expectation(path: Path) -> str:
    """'accepted', or the capability a refusal must name (from the recipe's `# expect:` line)."""
    for line in path.read_text().splitlines():
        if line.startswith("# expect: "):
            return line.removeprefix("# expect: ").removeprefix("refused: ").strip()
    raise AssertionError(f"{path.name} has no '# expect:' line")


def corpus_keys() -> tuple[set, set, set]:
    top, datasets, fsdp = set(), set(), set()
    for path in RECIPES:
        raw = yaml.safe_load(path.read_text())
        top |= set(raw)
        for group in ("datasets", "test_datasets", "pretraining_dataset"):
            for entry in raw.get(group) or []:
                datasets |= set(entry)
        fsdp |= set(raw.get("fsdp_config") or {})
    return top, datasets, fsdp


def test_the_corpus_covers_every_key_axolotls_examples_use():
    top, datasets, fsdp = corpus_keys()
    assert not sorted(set(EXAMPLE_KEYS) - top)
    assert not sorted(set(EXAMPLE_DATASET_KEYS) - datasets)
    assert not sorted(set(EXAMPLE_FSDP_KEYS) - fsdp)


def test_the_corpus_has_both_outcomes():
    outcomes = [expectation(p) for p in RECIPES]
    assert outcomes.count("accepted") >= 20 and len(outcomes) - outcomes.count("accepted") >= 15


def planned_processes(recipe) -> int:
    """2 processes, or what the recipe's own keys ask for: LISA runs in one (and says so at 2); a tensor-parallel
    mesh needs its sizes' product."""
    if recipe.lisa_n_layers:
        return 1
    return max(2, recipe.least_mesh_ranks)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_is_accepted_or_refused_by_capability(path, monkeypatch):
    monkeypatch.chdir(CORPUS)  # relative paths are read from the current directory, as Axolotl does
    expected = expectation(path)
    try:
        loaded = load_recipe(path)
        processes = planned_processes(loaded.recipe)
        plan = make_plan(loaded.recipe, make_cluster(processes, device="cuda"), config_dir=str(CORPUS / ".plan"))
    except UserError as err:
        line = err.one_line()
        assert expected != "accepted", line
        assert expected in line and "not supported" in line, line
        assert "unknown key" not in line and "\n" not in line
        return
    assert expected == "accepted", f"{path.name} was accepted; expected a refusal naming {expected}"
    assert plan.world_size == processes
    assert not [n for n in loaded.notes if "unknown" in n]


def test_a_key_neither_defines_stays_unknown_with_a_did_you_mean(tmp_path):
    path = tmp_path / "typo.yml"
    text = (CORPUS / "llama3-lora-8bit.yml").read_text() + "context_parapllel_size: 2\n"
    path.write_text(text)
    with pytest.raises(UserError, match="unknown key 'context_parapllel_size'; did you mean 'context_parallel_size'"):
        load_recipe(path)


def test_keys_axolotl_drops_silently_but_whose_intent_is_plain_are_honoured_and_said(tmp_path):
    path = tmp_path / "floor.yml"
    base = (CORPUS / "llama3-lora-8bit.yml").read_text()  # cosine, learning_rate 0.0002
    path.write_text(base + "eta_min: 2.0e-5\nadam_eps: 1.0e-9\n")
    loaded = load_recipe(path)
    assert loaded.recipe.cosine_min_lr_ratio == pytest.approx(0.1)
    assert loaded.recipe.adam_epsilon == 1e-9
    assert any(n.startswith("eta_min: read as cosine_min_lr_ratio: 0.1 (Axolotl drops") for n in loaded.notes)
    assert any(n.startswith("adam_eps: read as adam_epsilon") for n in loaded.notes)
    path.write_text(base.replace("lr_scheduler: cosine", "lr_scheduler: linear") + "min_lr: 1.0e-6\n")
    with pytest.raises(UserError, match="min_lr floors a cosine schedule, and lr_scheduler is linear"):
        load_recipe(path)
    path.write_text(base + "eta_min: 2.0e-5\ncosine_min_lr_ratio: 0.5\n")
    with pytest.raises(
        UserError, match="eta_min .read as cosine_min_lr_ratio: 0.1. and cosine_min_lr_ratio: 0.5 disagree"
    ):
        load_recipe(path)
    path.write_text(base + "eta_min: 0.001\n")
    with pytest.raises(UserError, match="eta_min: 0.001 must lie between 0 and learning_rate 0.0002"):
        load_recipe(path)


# The public corpus: a manifest of other projects' recipes (never copies of them), and the script that counts them.
AXOLOTL_ITSELF = {"axolotl-ai-cloud/axolotl", "openaccess-ai-collective/axolotl"}


def test_the_public_corpus_manifest_is_well_formed():
    rows = axolotl_corpus.read_manifest()
    assert len(rows) >= 60
    assert len({r.repo for r in rows}) >= 30
    assert not [r for r in rows if r.repo.lower() in AXOLOTL_ITSELF]
    assert len({(r.repo, r.path) for r in rows}) == len(rows)  # one version of each file: it has one local path
    for row in rows:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", row.repo), row
        assert re.fullmatch(r"[0-9a-f]{40}", row.commit), row
        assert row.path.endswith((".yml", ".yaml")) and not row.path.startswith("/") and ".." not in row.path, row
        assert re.fullmatch(r"20(2[3-6])-(0[1-9]|1[0-2])", row.date), row
        assert re.fullmatch(r"v0\.\d+\.\d+", row.release), row
    assert {r.era.split()[0] for r in rows} == {"2023", "2024", "2025", "2026"}
    # the release is the latest one tagged by the commit's date, so it never goes back as the date goes on
    order = sorted((r.date, ("v0.1.0", "v0.2.0", "v0.2.1", *RELEASES).index(r.release)) for r in rows)
    assert all(a[1] <= b[1] for a, b in pairwise(order))


def test_a_manifest_with_other_columns_is_refused(tmp_path):
    bad = tmp_path / "m.tsv"
    bad.write_text("repo\tcommit\tpath\n")
    with pytest.raises(ValueError, match="header"):
        axolotl_corpus.read_manifest(bad)


def test_refusals_are_classed_by_what_they_ask_for():
    cls = axolotl_corpus.refusal_class
    assert cls("ReLoRA is not supported (relora: True) (hint: train one LoRA adapter)") == "ReLoRA"
    assert (
        cls("unknown key 'data_seed'; did you mean 'datasets'?") == "unknown key data_seed (no Axolotl release has it)"
    )
    assert cls("datasets[0]: unknown key 'overlap_len'") == "unknown key overlap_len (no Axolotl release has it)"
    assert cls("2 unknown keys: 'lr' (did you mean 'learning_rate'?), 'train_batch_size'") == (
        "unknown key lr (no Axolotl release has it)"
    )
    assert cls("datasets[0].type: Axolotl's dataset type 'alpaca_chat.load_chatml' is not supported; use one of x") == (
        "dataset type alpaca_chat.load_chatml"
    )
    assert (
        cls("wandb_log_model: Input should be 'false', 'checkpoint' or 'end' (got 'x')") == "a value of wandb_log_model"
    )


def corpus_run(tmp_path, capsys, recipes: dict[str, str]) -> tuple[int, str]:
    """Run the counting script over recipes written into a corpus folder of its layout."""
    manifest = tmp_path / "corpus.tsv"
    lines = ["# a comment", "\t".join(axolotl_corpus.COLUMNS)]
    for i, (name, text) in enumerate(recipes.items()):
        (tmp_path / "dir" / "someone+recipes").mkdir(parents=True, exist_ok=True)
        (tmp_path / "dir" / "someone+recipes" / name).write_text(text)
        lines.append(f"someone/recipes\t{i:040x}\t{name}\t2024-0{i + 1}\tv0.4.0")
    manifest.write_text("\n".join(lines) + "\n")
    code = axolotl_corpus.main(["--dir", str(tmp_path / "dir"), "--manifest", str(manifest)])
    return code, capsys.readouterr().out


def test_the_counting_script_counts_accepted_refused_and_absent_files(tmp_path, capsys):
    good = (CORPUS / "llama3-lora-8bit.yml").read_text()
    local = good.replace("path: teknium/GPT4-LLM-Cleaned", "path: ./mine.jsonl")  # its author's own file
    assert local != good
    code, out = corpus_run(tmp_path, capsys, {
        "good.yml": good,
        "grok.yml": good + "grokfast_alpha: 2.0\n",
        "local.yml": local,
    })  # fmt: skip
    assert code == 0
    assert "| 2024 H1 | 3 | 1 (33%) | 1/3 | 0/0 | 0/0 | 1 | 1 |" in out
    assert (
        "1  Grokfast gradient filtering  e.g. Grokfast gradient filtering is not supported (grokfast_alpha: 2.0)" in out
    )
    assert "mine.jsonl does not exist" in out and "-- and nothing else" in out
    assert "3 recipes from 1 repositories; 0 raised something other than UserError" in out


def test_anything_but_a_user_error_is_a_failure_with_its_traceback(tmp_path, capsys, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyError("a bug in llmtune")

    monkeypatch.setattr(axolotl_corpus.examples, "check", crash)
    code, out = corpus_run(tmp_path, capsys, {"any.yml": (CORPUS / "llama3-lora-8bit.yml").read_text()})
    assert code == 1
    assert "1 raised something other than UserError" in out
    assert "FAILED someone/recipes/any.yml" in out and "KeyError: 'a bug in llmtune'" in out


def test_the_doc_tables_are_what_the_generator_writes():
    assert axolotl_tables.in_doc() == axolotl_tables.tables(), "run: python scripts/axolotl_tables.py --write"
    # the counts above them too (keys per release and per action: they were written by hand and went stale)
    summary = axolotl_tables.in_doc(markers=axolotl_tables.SUMMARY)
    assert summary == axolotl_tables.summary(), "run: python scripts/axolotl_tables.py --write"


def test_the_generated_tables_name_every_alias_translation_and_refused_capability():
    text = axolotl_tables.tables()
    for key, entry in ((k, e) for k, e in KEYS.items() if e[2] != "llmtune"):  # shown one by one or as word_*
        assert f"`{key}`" in text or f"`{key.split('_')[0]}_*`" in text, key
        if entry[2].startswith("refused: "):
            assert f"| {entry[2].removeprefix('refused: ')} |" in text


def test_download_fetches_a_missing_recipe_at_its_commit(tmp_path, capsys, monkeypatch):
    source = tmp_path / "github" / "someone" / "recipes" / ("ab" * 20)
    source.mkdir(parents=True)
    (source / "r.yml").write_text((CORPUS / "llama3-lora-8bit.yml").read_text())
    monkeypatch.setattr(axolotl_corpus, "RAW", f"file://{tmp_path}/github/{{repo}}/{{commit}}/{{path}}")
    manifest = tmp_path / "corpus.tsv"
    manifest.write_text(
        "\t".join(axolotl_corpus.COLUMNS) + f"\nsomeone/recipes\t{'ab' * 20}\tr.yml\t2025-07\tv0.11.0\n"
    )
    args = ["--dir", str(tmp_path / "dir"), "--manifest", str(manifest)]
    assert axolotl_corpus.main(args) == 0
    assert "1 recipes not under" in capsys.readouterr().out  # without --download, a missing recipe is only counted
    assert axolotl_corpus.main([*args, "--download"]) == 0
    assert "| 2025 H2 | 1 | 1 (100%) |" in capsys.readouterr().out
    assert (tmp_path / "dir" / "someone+recipes" / "r.yml").read_text() == (source / "r.yml").read_text()
