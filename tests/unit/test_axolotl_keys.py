"""Axolotl's keys as llmtune reads them: never unknown; honoured, renamed, no effect (said once), or refused by the
capability they ask for, in one line that names it."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_loading import BASE, load, refusal

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.accelerate_config import fsdp_section
from llmtune.recipe import Recipe
from llmtune.recipe.axolotl import action
from llmtune.recipe.axolotl_keys import ANY, AXOLOTL_DATASET_KEYS, AXOLOTL_ONLY_KEYS
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.runtime.distributed import trainer_fsdp_config

# Every top-level key of Axolotl's schema (src/axolotl/utils/schemas/ and the integrations' args, July 2026).
AXOLOTL_SCHEMA_KEYS = """
accelerator_config activation_offloading adam_beta1 adam_beta2 adam_beta3 adam_epsilon adam_epsilon2 adapter
added_tokens_overrides attn_implementation auto_find_batch_size auto_resume_from_checkpoints axolotl_config_path
base_model base_model_config batch_flattening batch_size bench_dataset bench_split bf16 bfloat16 bnb_config_kwargs
center_rewards_coefficient chat_template chat_template_jinja chat_template_kwargs chunked_cross_entropy
chunked_cross_entropy_num_chunks cls_model_config comet_api_key comet_experiment_config comet_experiment_key
comet_mode comet_online comet_project_name comet_workspace context_parallel_size cosine_constant_lr_ratio
cosine_min_lr_ratio cpo_alpha curriculum_sampling cut_cross_entropy dataloader_drop_last dataloader_num_workers
dataloader_pin_memory dataloader_prefetch_factor dataset_exact_deduplication dataset_keep_in_memory dataset_num_proc
dataset_prepared_path dataset_processes dataset_shard_idx dataset_shard_num datasets ddp ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_timeout deepcompile deepspeed default_system_message dense_mixer
device device_map diffusion dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of do_bench_eval
do_causal_lm_eval dp_replicate_size dp_shard_size dpo_beta dpo_generate_during_eval dpo_label_smoothing
dpo_loss_type dpo_loss_weights dpo_norm_loss dpo_padding_free dpo_use_liger_kernel dpo_use_logits_to_keep
dpo_use_weighting dsv4_bf16_all dsv4_fp4_grouped_mode dsv4_fp8_lora_kernel dsv4_fp8_nonexpert_mode
dsv4_shared_mlp_lora_kernel dynamic_checkpoint eaft_alpha eaft_k eager_attention early_stopping_patience ebft
embedding_lr embedding_lr_scale embeddings_skip_upcast eot_tokens eval_batch_size eval_causal_lm_metrics
eval_max_new_tokens eval_sample_packing eval_sequence_len eval_steps eval_strategy eval_table_size evals_per_epoch
evaluation_strategy excess_length_strategy experimental_skip_move_to_device expert_backend expert_parallel_backend
expert_parallel_fallback_on_unsupported expert_parallel_num_nvl_bytes expert_parallel_num_rdma_bytes
expert_parallel_size expert_parallel_token_capacity experts_implementation fix_untrained_tokens flash_attention
flash_attn_cross_entropy flash_attn_d512 flash_attn_fuse_mlp flash_attn_rms_norm flash_optimum flex_attention
flex_attn_compile_kwargs float16 float32 fp16 fp32_norm_classes fp32_norms fp8 fp8_enable_fsdp_float8_all_gather
freeze_mm_modules fsdp fsdp_config fsdp_final_state_dict_type fsdp_version fused_attn_kernel gc_collect_steps
gc_steps gemma4_fp8_nonexpert gemma4_hybrid_attn_impl gemma4_nf4_nonexpert generate_samples generation_do_sample
generation_max_new_tokens generation_prompt_ratio generation_temperature generation_top_k generation_top_p gptq
gpu_memory_limit gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs
gradio_max_new_tokens gradio_server_name gradio_server_port gradio_share gradio_temperature gradio_title
greater_is_better grokfast_alpha grokfast_lamb group_by_length hatchery heads_k_stride hf_mlflow_log_artifacts
hf_use_auth_token hub_model_id hub_revision hub_strategy image_resize_algorithm image_size include_tkps
include_tokens_per_second is_falcon_derived_model is_llama_derived_model is_mistral_derived_model is_preprocess
is_qwen_derived_model jagged_restart_anneal_steps jagged_restart_steps jagged_restart_warmup_steps kd_alpha kd_beta
kd_ce_alpha kd_normalize_topk kd_online_server kd_online_server_base_url kd_online_timeout kd_online_topk
kd_temperature kd_temperature_min kd_trainer kto_desirable_weight kto_undesirable_weight large_head_attention
layer_offloading learning_rate liger_cross_entropy liger_fused_linear_cross_entropy liger_glu_activation
liger_layer_norm liger_rms_norm liger_rms_norm_gated liger_rope liger_swiglu liger_use_token_scaling
lisa_layers_attribute lisa_n_layers lisa_step_interval llama4_linearized_experts llmcompressor lm_eval_batch_size
lm_eval_model lm_eval_post_train lm_eval_tasks load_best_model_at_end load_in_4bit load_in_8bit local_rank
logging_steps lora_alpha lora_alpha_pattern lora_dropout lora_embedding_kernel lora_fan_in_fan_out lora_mlp_kernel
lora_model_dir lora_modules_to_save lora_o_kernel lora_on_cpu lora_qkv_kernel lora_r lora_rank_pattern
lora_target_linear lora_target_modules lora_target_parameters loraplus_lr_embedding loraplus_lr_ratio
loss_watchdog_patience loss_watchdog_threshold low_cpu_mem_usage lr_div_factor lr_groups lr_quadratic_warmup
lr_scheduler lr_scheduler_kwargs max_grad_norm max_memory max_packed_sequence_len max_prompt_len max_steps
mean_resizing_embeddings merge_lora merge_method metric_for_best_model micro_batch_size min_sample_len
mlflow_experiment_name mlflow_run_name mlflow_tracking_uri model_config model_kwargs model_quantization_config
model_quantization_config_kwargs model_revision moe_bnb_fast moe_dequant_chunk_size moe_grouped_backend mora
multipack_real_batches neftune_noise_alpha nemo_gym_auto_clone nemo_gym_auto_start nemo_gym_config_paths
nemo_gym_datasets nemo_gym_dir nemo_gym_enabled nemo_gym_head_port nemo_gym_max_turns nemo_gym_model_name
nemo_gym_multi_turn nemo_gym_run_timeout nemo_gym_server_timeout nemo_gym_verify_timeout noisy_embedding_alpha
nonexpert_quantization num_dataset_shards_to_save num_epochs num_generation_samples num_labels nvfp4_merge_aware
nvfp4_merge_aware_start_step optim_args optim_target_modules optimizer orpo_alpha otel_metrics_host
otel_metrics_port output_dir overrides_of_model_config overrides_of_model_kwargs pad_to_multiple_of
pad_to_sequence_len peft peft_autocast_adapter_dtype peft_ensure_weight_tying peft_init_lora_weights
peft_layer_replication peft_layers_pattern peft_layers_to_transform peft_trainable_token_indices peft_use_dora
peft_use_rslora plugins pose_max_context_len pose_num_chunks pose_split_on_token_ids precompute_ref_log_probs
preprocess_iterable pretrain_multipack_attn pretrain_multipack_buffer_size pretraining_dataset
pretraining_sample_concatenation process_reward_model processor_kwargs processor_type profiler_steps
profiler_steps_start push_dataset_to_hub qat qgalore_cos_threshold qgalore_gamma_proj qgalore_proj_bits
qgalore_proj_group_size qgalore_proj_quant qgalore_proj_type qgalore_queue_size qgalore_rank qgalore_scale
qgalore_update_proj_gap qlora_sharded_model_loading quantization quantize_moe_experts ray_num_workers ray_run_name
reinit_weights relora relora_cpu_offload relora_prune_method relora_prune_ratio remove_unused_columns
resize_token_embeddings_to_32x resources_per_worker resume_from_checkpoint revision_of_model reward_model
ring_attn_func rl rl_beta role_boundaries rope_scaling rpo_alpha s2_attention sage_attention sample_packing
sample_packing_bin_size sample_packing_eff_est sample_packing_group_size sample_packing_mp_start_method
sample_packing_sequentially save_first_step save_only_model save_safetensors save_steps save_strategy
save_total_limit saves_per_epoch scaling_softmax scaling_softmax_bias scaling_softmax_factor sdp_attention
sdpa_varlen seed selective_checkpointing sequence_len sequence_parallel_degree shrink_embeddings
shuffle_before_merging_datasets shuffle_merged_datasets simpo_gamma skip_prepare_dataset special_tokens
spectrum_model_name spectrum_top_fraction streaming streaming_multipack_buffer_size strict swanlab_api_host
swanlab_api_key swanlab_completion_log_interval swanlab_completion_max_buffer swanlab_description
swanlab_experiment_name swanlab_lark_secret swanlab_lark_webhook_url swanlab_log_completions swanlab_log_model
swanlab_mode swanlab_project swanlab_web_host swanlab_workspace tensor_parallel_size test_datasets tf32 tiled_mlp
tiled_mlp_num_shards tiled_mlp_use_original_mlp tokenizer_config tokenizer_legacy tokenizer_save_jinja_files
tokenizer_type tokenizer_use_fast tokenizer_use_mistral_common tokens torch_compile torch_compile_backend
torch_compile_mode torch_compile_options torch_empty_cache_steps torchdistx_path total_num_tokens
total_supervised_tokens trackio_project_name trackio_run_name trackio_space_id train_on_inputs trainer_cls trl
trust_remote_code type_of_model unfrozen_parameters use_comet use_dsv4_kernels use_eaft use_glm_dsa_kernels
use_kernels use_mlflow use_onebitllms use_otel_metrics use_pose use_ray use_scattermoe use_sonicmoe use_swanlab
use_tensorboard use_trackio use_wandb val_set_size vllm wandb_entity wandb_log_model wandb_mode wandb_name
wandb_project wandb_run_id wandb_watch warmup_ratio warmup_steps weight_decay world_size xformers_attention
""".split()


def test_every_axolotl_key_is_known():
    assert not [key for key in AXOLOTL_SCHEMA_KEYS if action(key) == "unknown"]


@pytest.mark.parametrize("key", sorted(set(AXOLOTL_SCHEMA_KEYS) - {"base_model", "datasets"}))
def test_an_empty_axolotl_key_reads_as_if_absent(key):
    """Axolotl's own recipes write keys with no value: the recipe is the one without the key, and a key llmtune has
    no use for is said once to have no effect."""
    absent = recipe_from_mapping({k: v for k, v in BASE.items() if k != key}, Path("r.yaml"), check_files=False)
    loaded = load(**{key: None})
    assert loaded.recipe == absent.recipe
    if key in AXOLOTL_ONLY_KEYS:
        assert sum(key in note and "no effect" in note for note in loaded.notes) == 1, loaded.notes


@pytest.mark.parametrize("key", ["base_model", "datasets"])
def test_an_empty_required_key_is_refused_naming_it(key):
    assert f"{key}: " in refusal(**{key: None})


@pytest.mark.parametrize("key", sorted(k for k, e in AXOLOTL_ONLY_KEYS.items() if e.accepted is not ANY))
def test_a_real_value_is_refused_by_capability(key):
    entry = AXOLOTL_ONLY_KEYS[key]
    line = refusal(**{key: "asked-for"})
    assert f"{entry.reason} is not supported ({key}: 'asked-for')" in line
    assert "unknown key" not in line and "\n" not in line


@pytest.mark.parametrize("key", sorted(k for k, e in AXOLOTL_ONLY_KEYS.items() if e.accepted is ANY))
def test_a_key_without_effect_is_accepted_and_said_once(key):
    notes = load(**{key: "on"}).notes
    assert sum(key in note and "no effect" in note for note in notes) == 1


def test_capability_refusals_read_as_the_issue_asks():
    assert "rl: ebft (EBFT) is not supported yet: llmtune trains dpo, ipo, orpo, kto, simpo, grpo, gdpo" in refusal(rl="ebft")
    assert "vllm belongs to preference training or online RL; set rl:" in refusal(vllm={"gpu_memory_utilization": 0.5})
    assert "training vision and audio models is not supported (processor_type" in refusal(
        processor_type="AutoProcessor"
    )
    assert "one-cycle schedules (lr_div_factor) is not supported (lr_div_factor: 25)" in refusal(lr_div_factor=25)
    assert load(context_parallel_size=1, tensor_parallel_size=1).recipe
    # context parallelism runs (with FSDP2); Axolotl's older name is read as it
    assert "context parallelism needs a sharding engine" in refusal(context_parallel_size=2)
    assert load(sequence_parallel_degree=2, fsdp_version=2).recipe.context_parallel_size == 2


def test_unknown_keys_keep_a_did_you_mean_over_both_vocabularies():
    assert "did you mean 'context_parallel_size'" in refusal(context_parapllel_size=2)
    assert "did you mean 'lora_r'" in refusal(lora_rr=8)
    assert "did you mean 'adam_epsilon'" in refusal(adam_epsilom=1e-9)


def test_older_names_are_read_as_the_new_ones():
    loaded = load(evaluation_strategy="no", model_config={"output_router_logits": True}, model_revision="abc")
    r = loaded.recipe
    assert r.eval_strategy == "no" and r.overrides_of_model_config == {"output_router_logits": True}
    assert r.revision_of_model == "abc"
    assert any("evaluation_strategy: read as eval_strategy" in n for n in loaded.notes)
    assert "disagree" in refusal(evaluation_strategy="no", eval_strategy="steps")


def test_batch_size_gives_gradient_accumulation_as_axolotl_derives_it():
    assert load(batch_size=8, micro_batch_size=2).recipe.gradient_accumulation_steps == 4
    # both: Axolotl refuses the pair (check_gas_bsz), and so does llmtune, in one line naming both
    assert "batch_size (8) and gradient_accumulation_steps (1) are both set" in refusal(
        batch_size=8, micro_batch_size=2, gradient_accumulation_steps=1)
    assert "below micro_batch_size" in refusal(batch_size=1, micro_batch_size=2)
    agreeing = refusal(batch_size=4, micro_batch_size=2, gradient_accumulation_steps=2)
    assert "they agree" in agreeing and "disagree" not in agreeing


def test_value_spellings():
    r = load(evals_per_epoch=0, val_set_size=0.1).recipe
    assert r.eval_strategy == "no" and r.evals_per_epoch is None
    loaded = load(warmup_steps=0.1, attn_implementation="xformers", gradient_checkpointing="offload")
    r = loaded.recipe
    assert (r.warmup_ratio, r.warmup_steps, r.attn_implementation, r.gradient_checkpointing) == (
        0.1,
        None,
        "sdpa",
        True,
    )
    assert len([n for n in loaded.notes if "xformers runs as sdpa" in n or "warmup_ratio" in n or "offload" in n]) == 3
    assert load(attn_implementation="kernels-community/vllm-flash-attn3").recipe.attn_implementation == (
        "flash_attention_2"
    )
    tokens = load(tokens={"pad_token": "<pad>", "bos_token": "<s>"}).recipe
    assert tokens.special_tokens == {"pad_token": "<pad>", "bos_token": "<s>"} and tokens.tokens is None


def test_bnb_config_kwargs_are_read_as_llmtunes_keys():
    loaded = load(adapter="qlora", load_in_4bit=True,
                  bnb_config_kwargs={"bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "bfloat16"})  # fmt: skip
    assert loaded.recipe.bnb_4bit_use_double_quant is False
    assert "the bitsandbytes option llm_int8_threshold is not supported" in refusal(
        bnb_config_kwargs={"llm_int8_threshold": 4.0}
    )  # (at BitsAndBytesConfig's default, 6.0, it asks for nothing)


def test_plugins_speed_and_logging_only_accepted_others_refused_by_capability():
    loaded = load(plugins=["axolotl.integrations.kernels.KernelsPlugin", "axolotl.integrations.liger.LigerPlugin"])
    assert loaded.recipe.plugins == ["axolotl.integrations.liger.LigerPlugin"]
    assert any("plugins: KernelsPlugin: accepted, has no effect" in n for n in loaded.notes)
    line = refusal(plugins=["axolotl.integrations.kd.KDPlugin"])
    assert "llmtune has no plugin system (knowledge distillation is not supported)" in line
    assert "unknown" not in refusal(plugins=["axolotl.integrations.diffusion.DiffusionPlugin"])


def test_optimizers():
    assert load(optimizer="adamw_torch_4bit").recipe.optimizer == "adamw_torch_4bit"
    assert load(optimizer="muon").recipe.optimizer == "muon"
    assert "'dion' (an optimizer Axolotl implements itself) is not supported" in refusal(optimizer="dion")


def test_chat_templates_by_axolotls_names():
    for name in ("falcon_h1", "cohere", "qwen3", "gemma3", "tokenizer_default_fallback_chatml"):
        assert load(chat_template=name).recipe.chat_template == name
    assert "not a known template" in refusal(chat_template="falcon_h2")


def test_pretraining_dataset_is_packed_completion_data(tmp_path):
    text = tmp_path / "corpus.jsonl"
    text.write_text('{"content": "a b c"}\n')
    r = load(
        datasets=None, pretraining_dataset=[{"path": str(text), "type": "pretrain", "text_column": "content"}]
    ).recipe
    assert [(s.type, s.field) for s in r.datasets] == [("completion", "content")] and r.sample_packing
    assert r.pretraining_dataset is None and not r.streaming
    assert Recipe.model_validate(r.model_dump(mode="json")) == r  # the worker reads the plan's copy back
    hub = {"path": "allenai/c4", "name": "en", "type": "pretrain"}
    assert "set max_steps" in refusal(datasets=None, pretraining_dataset=hub)
    assert load(datasets=None, pretraining_dataset=hub, max_steps=10).recipe.streaming
    assert "use one" in refusal(pretraining_dataset=[hub], max_steps=10)
    assert "required key is missing" in refusal(datasets=None)


def test_streaming_needs_max_steps_and_excludes_deduplication():
    assert "set max_steps" in refusal(streaming=True)
    assert "can't run on streamed data" in refusal(streaming=True, max_steps=5, dataset_exact_deduplication=True)


def test_dataset_entry_keys():
    spec = {"path": "org/data", "type": "chat_template", "shards_idx": 0, "train_on_eot": "last", "skip": 3}
    r = load(datasets=[spec]).recipe
    assert (r.datasets[0].train_on_eot, r.datasets[0].skip) == ("last", 3)
    line = refusal(datasets=[{"path": "org/data", "type": "chat_template", "field_chosen": "chosen"}])
    assert "datasets[0].field_chosen belongs to preference data; set rl: dpo" in line
    line = refusal(rl="dpo", datasets=[{"path": "org/data", "type": "chatml.intel", "chosen_key": "chosen"}])
    assert "a preference data key beside the dataset's type (Axolotl reads it only inside a type: mapping) is not " \
           "supported (datasets[0].chosen_key" in line  # fmt: skip
    assert load(datasets=[{"path": "x", "type": "chat_template.default"}]).recipe.datasets[0].type == "chat_template"


def test_cloud_configs_are_not_recipes():
    with pytest.raises(UserError, match="cloud launch config .* launching on Modal or Baseten is not supported"):
        recipe_from_mapping({"provider": "baseten", "gpu": "h100"}, Path("cloud.yaml"), check_files=False)


def test_fsdp1_limit_all_gathers_reaches_accelerate_and_the_trainer():
    loaded = load(fsdp=["full_shard", "auto_wrap"], fsdp_config={"fsdp_limit_all_gathers": False,
                                                                  "fsdp_cpu_offload_pin_memory": True})  # fmt: skip
    assert any("fsdp_config.fsdp_cpu_offload_pin_memory" in n for n in loaded.notes)
    version, settings = loaded.recipe.resolved_fsdp()
    section = fsdp_section(version, settings)
    assert section["fsdp_limit_all_gathers"] is False
    assert trainer_fsdp_config(section)["limit_all_gathers"] is False
    plan = make_plan(loaded.recipe, make_cluster(2, device="cuda"))
    assert plan.accelerate_config["fsdp_config"]["fsdp_limit_all_gathers"] is False
    assert "fsdp_limit_all_gathers" not in fsdp_section(*load(fsdp=["full_shard"]).recipe.resolved_fsdp())


def test_model_loading_keys():
    r = load(model_quantization_config="Mxfp4Config", model_quantization_config_kwargs={"dequantize": True}).recipe
    assert r.model_quantization_config == "Mxfp4Config"
    assert "dequantize" in refusal(model_quantization_config="Mxfp4Config")
    assert "is not a regular expression" in refusal(unfrozen_parameters=["model.(layers"])
    assert load(cls_model_config="Gemma3TextConfig").recipe.cls_model_config == "Gemma3TextConfig"
    assert "not a transformers config class" in refusal(cls_model_config="gemma 3")
    assert "needs adapter: lora" in refusal(peft={"loftq_config": {"loftq_bits": 4}})


def test_dataset_only_keys_are_all_data():
    assert all(isinstance(entry.reason, str) and entry.reason for entry in AXOLOTL_DATASET_KEYS.values())


def test_what_public_recipes_carry_that_axolotl_ignored_is_a_note_or_one_line_saying_where_it_goes():
    """From scripts/axolotl_corpus.tsv's review: keys Axolotl ignored (or set itself) that llmtune refused."""
    notes = lambda **raw: " | ".join(load(**raw).notes)  # noqa: E731
    # a W&B model-upload value that isn't one: transformers turned uploading off under Axolotl
    assert load(wandb_log_model="axolotl-qlora-run").recipe.wandb_log_model == "false"
    assert "wandb_log_model: 'x-run' is none of false, checkpoint, end" in notes(wandb_log_model="x-run")
    assert load(wandb_log_model="checkpoint").recipe.wandb_log_model == "checkpoint"
    # LoRA+'s embedding rate alone (Axolotl's schema default): read, and used only beside loraplus_lr_ratio
    assert load(loraplus_lr_embedding=1e-6).recipe.loraplus_lr_embedding == 1e-6
    # the best-model keys (Axolotl sets them beside early_stopping_patience; a recipe may set them alone): the
    # Trainer keeps the best checkpoint by that metric (tests/unit/test_objectives.py checks its arguments)
    best = {"load_best_model_at_end": True, "metric_for_best_model": "eval_accuracy", "greater_is_better": True}
    assert load(**best, val_set_size=0.1, reward_model=True, datasets=[{"path": "o/d", "type":
                "bradley_terry.chat_template"}]).recipe.metric_for_best_model == "eval_accuracy"  # fmt: skip
    # hub and serialization spellings beside hub_model_id
    said = notes(hub_model_id="me/model", push_to_hub=True, hub_private_repo=True, safe_serialization=True)
    assert "push_to_hub" in said and "hub_private_repo" in said and "safe_serialization" in said
    # the upload and login commands are today's huggingface_hub CLI (`hf`; it has no huggingface-cli)
    assert "upload the output folder with `hf upload <hub_model_id> <output_dir>`" in said
    assert "credentials come from HF_TOKEN or `hf auth login`" in notes(hf_use_auth_token=True)
    # a custom format's keys beside a named type: the default is a note, another value says where it goes
    spec = {"path": "org/data", "type": "alpaca", "field_instruction": "instruction", "field_output": "output"}
    assert "datasets[0].field_instruction" in notes(datasets=[spec])
    line = refusal(datasets=[{**spec, "field_instruction": "question"}])
    assert "datasets[0].field_instruction: 'question' beside type: alpaca has no effect" in line
    assert "type: {field_instruction: 'question', ...}" in line
    # a preference key beside an SFT dataset: ignored there by Axolotl too
    sft = {"path": "org/data", "type": "completion", "field_prompt": "prompt", "field_completion": "completion"}
    assert "datasets[0].field_prompt" in notes(datasets=[sft])
    # a recipe key repeated in a dataset entry: the same value is a note, another is refused
    assert "datasets[0].train_on_inputs" in notes(train_on_inputs=False, datasets=[{**spec, "train_on_inputs": False}])
    line = refusal(train_on_inputs=False, datasets=[{"path": "org/data", "type": "alpaca", "train_on_inputs": True}])
    assert "datasets[0].train_on_inputs: True: train_on_inputs is a recipe key, read for the whole recipe" in line
    # v0.4.0's documented rl: data entry: data_files and ds_type, no path
    loaded = load(rl="dpo", datasets=[{"ds_type": "json", "data_files": ["pairs.jsonl"], "type": "chatml.intel"}])
    assert loaded.recipe.datasets[0].path == "json" and "no path, read as path: json" in " | ".join(loaded.notes)
    # Axolotl's hand-written ChatML / Llama-3 preference types: said to follow the model's template here
    said = " | ".join(loaded.notes)
    assert "datasets[0].type: chatml.intel: rendered with the model's chat template" in said and "ChatML by hand" in said
    said = notes(rl="kto", datasets=[{"path": "org/data", "type": "llama3.ultra"}])
    assert "datasets[0].type: llama3.ultra" in said and "Llama-3 by hand" in said
    assert "by hand" not in notes(rl="dpo", datasets=[{"path": "org/data", "type": "chat_template.default"}])
    assert load(datasets=[{"data_files": "rows.parquet", "type": "alpaca"}]).recipe.datasets[0].path == "parquet"
    # BitsAndBytesConfig's own default, written out (Axolotl v0.4.0 wrote it itself): nothing asked for
    assert "bnb_config_kwargs.llm_int8_has_fp16_weight" in notes(bnb_config_kwargs={"llm_int8_has_fp16_weight": False})
    assert "llm_int8_has_fp16_weight is not supported" in refusal(bnb_config_kwargs={"llm_int8_has_fp16_weight": True})


def test_a_chat_template_key_beside_another_type_is_said_to_have_no_effect():
    """roles_to_train on a sharegpt entry, train_on_eos on an alpaca one: Axolotl's formats ignored them and so does
    llmtune, but says so once instead of silently; at their defaults nothing is said."""
    entry = {"path": "x", "type": "alpaca", "train_on_eos": "none", "roles_to_train": ["human", "gpt"]}
    notes = load(datasets=[entry]).notes
    [note] = [n for n in notes if "chat_template reads it" in n]
    assert "datasets[0].roles_to_train" in note and "datasets[0].train_on_eos" in note and "type: alpaca" in note
    quiet = load(datasets=[{"path": "x", "type": "alpaca", "train_on_eos": "turn"}]).notes
    assert not any("chat_template reads it" in n for n in quiet)
    chat = load(datasets=[{"path": "x", "type": "chat_template", "train_on_eos": "none"}]).notes
    assert not any("chat_template reads it" in n for n in chat)


def test_tokenizer_type_is_said_to_have_no_effect_and_the_keys_that_do_are_not():
    loaded = load(tokenizer_type="LlamaTokenizer")
    assert loaded.recipe.tokenizer_type == "LlamaTokenizer"
    [line] = [note for note in loaded.notes if note.startswith("tokenizer_type")]
    assert "accepted, has no effect in llmtune" in line and "AutoTokenizer" in line
    # tokenizer_use_fast reaches AutoTokenizer, and model_type is checked against the loaded model: no such note
    quiet = load(tokenizer_use_fast=False, model_type="LlamaForCausalLM").notes
    assert not [note for note in quiet if "no effect" in note]
    assert not [note for note in load(tokenizer_type=None).notes if "tokenizer_type" in note]


def test_lora_shape_keys_beside_lora_model_dir_are_said_to_have_no_effect():
    """PEFT loads the adapter as saved: lora_r and its kind were ignored without a word (Axolotl does the same)."""
    notes = load(adapter="lora", lora_model_dir="/runs/sft", lora_r=32, lora_alpha=64).notes
    assert ("lora_model_dir: the adapter trains on as it was saved (its adapter_config.json: rank, alpha, dropout, "
            "target modules); lora_r, lora_alpha in the recipe have no effect") in notes  # fmt: skip
    assert not any("lora_model_dir" in n for n in load(adapter="lora", lora_model_dir="/runs/sft").notes)
