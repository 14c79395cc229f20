"""Keys Axolotl defines that llmtune's schema doesn't, kept as data in one place.

Taken from Axolotl's own schema (src/axolotl/utils/schemas/ and the integrations' args, July 2026), plus a few
keys of its earlier releases that archived recipes still carry. Every such key is one of:

- no effect (ANY): accepted with any value and reported once, with the reason (performance-only kernels,
  logging, settings llmtune decides itself);
- a capability llmtune doesn't have: accepted when its value is inert (empty, false, or a listed default) and
  reported once; any other value is an error that names the capability and the key.

Keys llmtune honours live in the schema (recipe/*.py); Axolotl's older spellings of them are in RENAMED.
A key neither defines is an error with a did-you-mean (see loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ANY = object()
INERT = (None, False, "", [], {}, "false", "none")


@dataclass(frozen=True)
class AxolotlKey:
    accepted: Any  # ANY, or values (besides the inert ones) that ask for nothing
    reason: str  # ANY: why the key has no effect; otherwise the capability a real value asks for
    hint: str = ""


def _no_effect(reason: str, keys: str) -> dict[str, AxolotlKey]:
    return {key: AxolotlKey(ANY, reason) for key in keys.split()}


def _refused(capability: str, hint: str, keys: str, accepted: tuple = ()) -> dict[str, AxolotlKey]:
    return {key: AxolotlKey(accepted, capability, hint) for key in keys.split()}


PERFORMANCE = "performance/memory only: a GPU kernel or memory saver llmtune doesn't use (same training maths)"
TRACKING = "logging, tracking or evaluation only; it doesn't change training (llmtune eval / llmtune infer run after)"
DECIDED = "llmtune decides this itself"
LOW_PRECISION = (
    "llmtune doesn't apply this lower-precision form: those weights and matmuls stay in the compute dtype, 16 bits, "
    "which takes more GPU memory than the recipe expects; `llmtune estimate` counts them as they load"
)
EXPERTS_16_BIT = (
    "llmtune doesn't quantize a mixture of experts' fused expert tensors (bitsandbytes quantizes linear layers "
    "only): the routed experts, most of the model, stay in the compute dtype, 16 bits, which takes more GPU memory "
    "than the recipe expects; `llmtune estimate` counts them as they load"
)
EXPERT_PARALLEL = (
    "llmtune doesn't split the experts over ranks: each rank holds every expert unless FSDP or ZeRO-3 shards the "
    "model (deepspeed: zero3 or fsdp_version: 2); `llmtune estimate` counts what each GPU holds"
)
AUTH = "credentials come from HF_TOKEN or `hf auth login`, never from the recipe"
PUSH = (
    "nothing is pushed; upload the output folder with `hf upload <hub_model_id> <output_dir>` "
    "(credentials from HF_TOKEN in the environment, never written to disk)"
)
MEMORY_REASONS = (
    EXPERTS_16_BIT,
    LOW_PRECISION,
    EXPERT_PARALLEL,
)  # accepted keys whose absence changes what a GPU holds

# Key lists are whitespace-separated names.
AXOLOTL_ONLY_KEYS: dict[str, AxolotlKey] = {
    **_no_effect("llmtune is always strict", "strict"),
    **_no_effect(
        "not in Axolotl's schema either: Axolotl drops it (two of its own examples carry it), as llmtune does",
        "test_value",
    ),
    **_no_effect("set by the launcher", "local_rank world_size device device_map ddp"),
    **_no_effect(
        "Axolotl's model-family hints; llmtune reads the model's config",
        """
        is_llama_derived_model is_mistral_derived_model is_falcon_derived_model is_qwen_derived_model
        model_config_type
    """,
    ),
    **_no_effect("Axolotl's dump of which tokens train: `llmtune preprocess RECIPE --debug` shows them", "debug"),
    **_no_effect(
        TRACKING,
        """
        comet_experiment_config comet_experiment_key comet_mode comet_online comet_project_name
        comet_workspace use_comet trackio_project_name trackio_run_name trackio_space_id use_trackio
        use_otel_metrics otel_metrics_host otel_metrics_port mlflow_run_name hf_mlflow_log_artifacts
        include_tokens_per_second include_tkps eval_table_size
        eval_max_new_tokens generate_samples num_generation_samples generation_do_sample
        generation_max_new_tokens generation_prompt_ratio generation_temperature generation_top_k
        generation_top_p do_bench_eval bench_dataset bench_split do_causal_lm_eval eval_causal_lm_metrics
        lm_eval_batch_size lm_eval_model lm_eval_post_train lm_eval_tasks gradio_max_new_tokens
        gradio_server_name gradio_server_port gradio_share gradio_temperature gradio_title use_swanlab
        swanlab_api_host swanlab_completion_log_interval swanlab_completion_max_buffer swanlab_description
        swanlab_experiment_name swanlab_lark_webhook_url swanlab_log_completions swanlab_log_model
        swanlab_mode swanlab_project swanlab_web_host swanlab_workspace use_wandb eval_table_max_new_tokens
    """,
    ),
    **_no_effect(
        AUTH,
        """
        comet_api_key hf_use_auth_token swanlab_api_key swanlab_lark_secret
    """,
    ),
    **_no_effect(
        PERFORMANCE,
        """
        lora_mlp_kernel lora_qkv_kernel lora_o_kernel lora_embedding_kernel fused_attn_kernel
        flex_attn_compile_kwargs use_kernels use_scattermoe use_sonicmoe experts_implementation
        expert_backend moe_bnb_fast moe_dequant_chunk_size moe_grouped_backend use_dsv4_kernels
        use_glm_dsa_kernels dsv4_bf16_all dsv4_fp4_grouped_mode dsv4_fp8_lora_kernel dsv4_fp8_nonexpert_mode
        dsv4_shared_mlp_lora_kernel liger_rms_norm_gated tiled_mlp tiled_mlp_num_shards tiled_mlp_use_original_mlp
        chunked_cross_entropy chunked_cross_entropy_num_chunks flash_attn_cross_entropy flash_attn_rms_norm
        flash_attn_fuse_mlp flash_attn_fuse_qkv flash_optimum flash_attn_d512 large_head_attention
        gemma4_hybrid_attn_impl sdpa_varlen layer_offloading selective_checkpointing
        embeddings_skip_upcast lora_on_cpu qlora_sharded_model_loading low_cpu_mem_usage
        experimental_skip_move_to_device gc_steps gc_collect_steps torch_empty_cache_steps gpu_memory_limit
        max_memory deepcompile torch_compile_options fp32_norms
        fp32_norm_classes expert_parallel_backend
        expert_parallel_fallback_on_unsupported expert_parallel_num_nvl_bytes expert_parallel_num_rdma_bytes
        expert_parallel_token_capacity accelerator_config heads_k_stride ring_attn_func
        ddp_broadcast_buffers torchdistx_path
    """,
    ),
    **_no_effect(
        LOW_PRECISION,
        "nonexpert_quantization gemma4_fp8_nonexpert gemma4_nf4_nonexpert dsv4_fp8_nonexpert_mode fp8 "
        "fp8_enable_fsdp_float8_all_gather",
    ),
    **_no_effect(EXPERTS_16_BIT, "quantize_moe_experts"),
    **_no_effect(EXPERT_PARALLEL, "expert_parallel_size"),
    **_no_effect(
        "the weights' dtype follows bf16/fp16 and the adapter (full fine-tunes keep fp32 master weights under mixed precision)",
        "bfloat16 float16 float32 bloat16 torch_dtype",
    ),
    **_no_effect(
        "the model's Hugging Face tokenizer is used as it is", "tokenizer_legacy tokenizer_use_mistral_common"
    ),
    **_no_effect(
        "llmtune loads the text model (AutoModelForCausalLM): no vision/audio modules to freeze", "freeze_mm_modules"
    ),
    **_no_effect(
        DECIDED,
        """
        dataset_keep_in_memory skip_prepare_dataset is_preprocess preprocess_iterable
        num_dataset_shards_to_save push_dataset_to_hub sample_packing_eff_est sample_packing_bin_size
        sample_packing_group_size sample_packing_mp_start_method sample_packing_sequentially
        multipack_real_batches pretrain_multipack_attn pretrain_multipack_buffer_size
        streaming_multipack_buffer_size pretraining_sample_concatenation total_num_tokens
        total_supervised_tokens pad_to_multiple_of remove_unused_columns tokenizer_save_jinja_files
        save_safetensors save_first_step axolotl_config_path fsdp_final_state_dict_type merge_lora
        merge_method quantization dynamic_checkpoint sample_packing_seq_len_multiplier
        base_model_ignore_patterns
    """,
    ),
    **_no_effect(PUSH, "hub_model_id hub_strategy hub_revision push_to_hub_model_id"),
    # TrainingArguments' and peft's spellings public recipes carry beside hub_model_id / save_safetensors
    **_no_effect(PUSH, "push_to_hub hub_private_repo push_adapter_to_hub"),
    **_no_effect("llmtune always saves safetensors", "safe_serialization"),
    **_no_effect("the adapter is saved in output_dir", "lora_out_dir"),
    **_no_effect(PERFORMANCE, "dpo_use_logits_to_keep dpo_use_liger_kernel"),
    **_no_effect(TRACKING, "dpo_generate_during_eval"),
    **_refused(
        "EBFT, NeMo Gym environments and a separate reference adapter",
        "llmtune trains dpo, ipo, orpo, kto, simpo, grpo and gdpo (rl:); their reference is the base model itself",
        """
        ebft rl_adapter_ref_model hatchery nemo_gym_enabled nemo_gym_dir
        nemo_gym_auto_clone nemo_gym_config_paths nemo_gym_head_port nemo_gym_server_timeout
        nemo_gym_verify_timeout nemo_gym_run_timeout nemo_gym_datasets nemo_gym_auto_start
        nemo_gym_model_name nemo_gym_multi_turn nemo_gym_max_turns
    """,
    ),
    **_refused(
        "training vision and audio models",
        "llmtune fine-tunes text-only causal LMs",
        """
        processor_type processor_kwargs image_size image_resize_algorithm role_boundaries
    """,
    ),
    **_refused(
        "NVFP4 merge-aware LoRA (Axolotl's own)",
        "train the LoRA adapter without it, or a full fine-tune with qat: {weight_dtype: nvfp4}",
        "nvfp4_merge_aware nvfp4_merge_aware_start_step",
    ),
    **_no_effect(
        "a GPTQ base's settings come from its own quantization_config (gptq: true loads it as it was quantized)",
        "gptq_disable_exllama gptq_groupsize gptq_model_v1",
    ),
    **_no_effect(
        "llmtune's ReLoRA merges a 16-bit base in place, as Axolotl does for lora, and keeps a 4-bit base's loaded "
        "weights on the CPU for every restart whatever it says",
        "relora_cpu_offload",
    ),
    **_refused("one-cycle schedules (lr_div_factor)", "use lr_scheduler", "lr_div_factor"),
    **_refused(
        "PoSE position skipping",
        "remove it",
        """
        use_pose pose_max_context_len pose_num_chunks pose_split_on_token_ids
    """,
    ),
    **_refused("scaled-softmax attention", "remove it", "scaling_softmax scaling_softmax_factor scaling_softmax_bias"),
    **_refused(
        "knowledge distillation",
        "remove it",
        """
        kd_trainer kd_ce_alpha kd_alpha kd_temperature kd_beta kd_normalize_topk kd_online_server_base_url
        kd_online_topk kd_online_server kd_online_timeout kd_temperature_min kd_top_k_before_softmax
        kd_zscore_base_temp
    """,
    ),
    **_refused("diffusion language-model training", "remove it", "diffusion"),
    **_refused("MoRA adapters", "use adapter: lora", "mora"),
    **_refused(
        "Spectrum parameter selection",
        "list the parameters in unfrozen_parameters",
        "spectrum_top_fraction spectrum_model_name",
    ),
    **_refused("Grokfast gradient filtering", "remove it", "grokfast_alpha grokfast_lamb"),
    **_refused("DenseMixer MoE training", "remove it", "dense_mixer"),
    **_refused("sparse fine-tuning with LLM Compressor", "remove it", "llmcompressor"),
    **_refused("1-bit (BitNet) training", "remove it", "use_onebitllms"),
    **_no_effect(
        "llmtune starts the ranks itself (accelerate/torchrun): give --num-processes, not Ray workers",
        "use_ray ray_num_workers ray_run_name resources_per_worker",
    ),
    **_refused("custom trainer classes", "remove it", "trainer_cls"),
    **_refused(
        "peft's layer replication (replicated layers share base weights that a merge can't fold per replica)",
        "remove it",
        "peft_layer_replication",
    ),
    **_refused(
        "the settings of Axolotl's own optimizers",
        "use one of llmtune's optimizers (optim_args passes arguments to transformers' own)",
        """
        optim_target_modules adam_beta3 adam_epsilon2 dion_lr dion_momentum dion_rank_fraction
        dion_rank_multiple_of qgalore_cos_threshold qgalore_gamma_proj qgalore_proj_bits
        qgalore_proj_group_size qgalore_proj_quant qgalore_proj_type qgalore_queue_size qgalore_rank
        qgalore_scale qgalore_update_proj_gap
    """,
    ),
    **_refused("shrinking the embeddings", "remove it", "shrink_embeddings"),
    **_refused("re-initialising untrained tokens", "remove it", "fix_untrained_tokens"),
    **_refused("overriding the tokenizer's added tokens", "add new ones with tokens:", "added_tokens_overrides"),
    **_refused(
        "extra from_pretrained arguments",
        "set config values in overrides_of_model_config",
        "overrides_of_model_kwargs model_kwargs",
    ),
    **_refused("searching for a batch size", "use llmtune estimate to choose micro_batch_size", "auto_find_batch_size"),
    **_refused(
        "Axolotl's deprecated attention switches",
        "use attn_implementation: sdpa (or xformers/sage, which run as sdpa)",
        "s2_attention sage_attention",
    ),
    **_refused("Liger's token scaling of the loss", "remove it", "liger_use_token_scaling"),
    **_refused(
        "unsloth kernels",
        "use the liger_* keys",
        """
        unsloth_cross_entropy_loss unsloth_lora_mlp unsloth_lora_qkv unsloth_lora_o unsloth_rms_norm unsloth_rope
    """,
    ),
    **_refused("landmark attention", "remove it", "landmark_attention"),
    **_refused("xPos rotary embeddings", "remove it", "xpos_rope"),
    **_refused("the log-sweep learning-rate schedule", "use lr_scheduler", "log_sweep_min_lr log_sweep_max_lr"),
    **_refused("LLaMA-Adapter (adapter: llama-adapter)", "use adapter: lora", "peft_adapter"),
    **_refused(
        "GPTQ 4-bit loading through load_4bit (Axolotl refused it too)",
        "use load_in_4bit with adapter: qlora",
        "load_4bit",
    ),
}

# BitsAndBytesConfig's own defaults: asked for, they ask for nothing (Axolotl v0.4.0 wrote the first itself)
BNB_DEFAULTS = {"llm_int8_has_fp16_weight": False, "llm_int8_threshold": 6.0,
                "llm_int8_enable_fp32_cpu_offload": False}  # fmt: skip
# bnb_config_kwargs entries: llmtune's key for each, or None where llmtune decides (from the precision).
BNB_CONFIG_KWARGS = {
    "bnb_4bit_use_double_quant": "bnb_4bit_use_double_quant",
    "bnb_4bit_quant_type": "bnb_4bit_quant_type",
    "bnb_4bit_compute_dtype": None,
    "bnb_4bit_quant_storage": None,
}

# Axolotl's older or alternative spellings of keys llmtune honours: old name -> llmtune's name.
RENAMED = {
    "sequence_parallel_degree": "context_parallel_size",
    "evaluation_strategy": "eval_strategy",
    "noisy_embedding_alpha": "neftune_noise_alpha",
    "dataset_num_proc": "dataset_processes",
    "model_config": "overrides_of_model_config",
    "model_revision": "revision_of_model",
    "type_of_model": "model_type",
    # ReLoRA's cycle shape before v0.12 (relora_steps itself is a schema key: it also switches ReLoRA on)
    "relora_warmup_steps": "jagged_restart_warmup_steps",
    "relora_anneal_steps": "jagged_restart_anneal_steps",
    "dpo_beta": "rl_beta",
}

# Keys of Axolotl's earlier releases that llmtune rewrites into today's form (axolotl.py does it): key -> how.
TRANSLATED = {
    "max_packed_sequence_len": "sample_packing: true at sequence_len: the smaller of its value and sequence_len",
    "xformers_attention": "true: attn_implementation: sdpa (torch's memory-efficient kernel; the same maths)",
    "rope_scaling": "overrides_of_model_config: {rope_scaling: <its value>} (the model config's own key)",
}

# Today's spelling of keys that Axolotl has since dropped or deprecated, where it has one (llmtune's, where llmtune
# spells it otherwise); messages about an old key name it beside the releases that defined the key.
_GPTQ = "gptq: true (the quantization settings come from the model's own config)"
SUCCESSORS = {
    "push_to_hub_model_id": "hub_model_id",
    "eval_table_max_new_tokens": "eval_max_new_tokens",
    "bloat16": "bfloat16",
    "torch_dtype": "bf16 / fp16",
    "load_4bit": "load_in_4bit with adapter: qlora",
    "gptq_groupsize": _GPTQ,
    "gptq_model_v1": _GPTQ,
    "gptq_disable_exllama": _GPTQ,
    "max_packed_sequence_len": "sequence_len with sample_packing: true",
    "xformers_attention": "attn_implementation: xformers (llmtune runs it as sdpa)",
    "rope_scaling": "overrides_of_model_config: {rope_scaling: ...}",
    "dpo_beta": "rl_beta",
    "evaluation_strategy": "eval_strategy",
    "noisy_embedding_alpha": "neftune_noise_alpha",
    "lora_out_dir": "output_dir",
    "peft_adapter": "adapter: lora",
}

# Keys that neither llmtune nor Axolotl defines but that recipes carry (Axolotl's own examples among them), whose
# intent is plain: Axolotl drops them without a word, llmtune honours them as the key named here and says so.
# eta_min and min_lr are absolute learning-rate floors (torch's and Megatron's names), read as a fraction of the peak.
INTENDED = {
    "eta_min": "cosine_min_lr_ratio",
    "min_lr": "cosine_min_lr_ratio",
    "adam_eps": "adam_epsilon",
    # spellings public recipes carry (the corpus of scripts/axolotl_corpus.tsv) that Axolotl's loader ignored
    "epochs": "num_epochs",
    "wandb_run_name": "wandb_name",
    "tokenizer_path": "tokenizer_config",
    "deepspeed_config": "deepspeed",
}

# Keys of one `datasets[]` / `pretraining_dataset[]` entry.
AXOLOTL_DATASET_KEYS: dict[str, AxolotlKey] = {
    **_no_effect(DECIDED, "preprocess_shards input_format"),
    **_refused("per-row input transforms", "transform the data beforehand", "input_transform"),
    **_refused("knowledge-distillation data", "remove it", "logprobs_field temperature"),
    **_refused(
        "a preference data key beside the dataset's type (Axolotl reads it only inside a type: mapping)",
        "write them in the dataset's type: mapping (user_defined.default), or use field_messages, "
        "field_chosen and field_rejected (chat_template.default)",
        """
        field_prompt field_system_chosen chosen rejected field_label prompt_key chosen_key rejected_key
    """,
    ),
}
# train_on_split: v0.4.0's README documents it as "name of dataset split to load from" (v0.8.0's schema kept it)
RENAMED_DATASET_KEYS = {"text_column": "field", "train_on_split": "split"}

# Keys of `fsdp_config` (with or without the fsdp_ prefix).
AXOLOTL_FSDP_KEYS: dict[str, AxolotlKey] = {
    **_no_effect(PERFORMANCE, "cpu_offload_pin_memory activation_checkpointing_offload"),
    **_no_effect("the final model is always saved as one full state dict", "final_state_dict_type"),
    **_no_effect("mixed precision follows bf16 / fp16", "mixed_precision_policy"),
}

# Axolotl plugins by class name: None when llmtune provides the effect itself (see kernels.py),
# a reason when the plugin only changes speed or logging, a capability (refused) otherwise.
PLUGINS: dict[str, AxolotlKey | None] = {
    "LigerPlugin": None,
    "CutCrossEntropyPlugin": None,
    "KernelsPlugin": AxolotlKey(ANY, "MoE and LoRA kernels: " + PERFORMANCE),
    "ExpertParallelPlugin": AxolotlKey(ANY, "DeepEP expert dispatch: " + PERFORMANCE),
    "SwanLabPlugin": AxolotlKey(ANY, "SwanLab tracking: " + TRACKING),
    "LMEvalPlugin": AxolotlKey(ANY, "lm-eval after training: " + TRACKING),
    "KDPlugin": AxolotlKey((), "knowledge distillation"),
    "DiffusionPlugin": AxolotlKey((), "diffusion language-model training"),
    "LLMCompressorPlugin": AxolotlKey((), "sparse fine-tuning with LLM Compressor"),
    "SpectrumPlugin": AxolotlKey((), "Spectrum parameter selection"),
    "GrokfastPlugin": AxolotlKey((), "Grokfast gradient filtering"),
    "MoraPlugin": AxolotlKey((), "MoRA adapters"),
    "DenseMixerPlugin": AxolotlKey((), "DenseMixer MoE training"),
    "HatcheryPlugin": AxolotlKey((), "remote training through Hatchery"),
    "NemoGymPlugin": AxolotlKey((), "RL environments (NeMo Gym)"),
}

# attn_implementation values Axolotl knows beyond llmtune's: what runs instead (the same maths).
ATTENTION_ALIASES = {
    "xformers": "sdpa",
    "sage": "sdpa",
    "fp8": "sdpa",
    "flash_attention_3": "flash_attention_2",
}

# Axolotl's top-level keys for launching on a cloud (its `axolotl cloud` config), not for training.
CLOUD_KEYS = ("provider", "gpu", "gpu_count", "node_count", "secrets", "volumes", "dockerfile_commands",
              "memory_preprocess", "timeout_preprocess", "project_name", "branch")  # fmt: skip


def is_inert(entry: AxolotlKey, value: Any) -> bool:
    """True when a value asks for nothing llmtune would have to do."""
    if entry.accepted is ANY:
        return True
    if isinstance(value, (list, dict)) and not value:
        return True
    return any(value is v or (type(value) is type(v) and value == v) for v in (*INERT, *entry.accepted))


def attention_alias(value: Any) -> str | None:
    """llmtune's attn_implementation for an Axolotl value it doesn't name itself (hub kernels included)."""
    if not isinstance(value, str):
        return None
    if value in ATTENTION_ALIASES:
        return ATTENTION_ALIASES[value]
    if "/" in value:  # a hub kernel, e.g. kernels-community/flash-attn3
        return "flash_attention_2" if "flash" in value else "sdpa"
    return None


def plugin_entry(name: str) -> AxolotlKey | None | bool:
    """The PLUGINS entry for a plugin path (matched by class name), or False when Axolotl has no such plugin."""
    if not isinstance(name, str) or not name.startswith("axolotl.integrations."):
        return False
    return PLUGINS.get(name.rsplit(".", 1)[-1], False)
