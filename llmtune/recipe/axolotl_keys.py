"""Keys Axolotl defines that llmtune has no use for, kept as data in one place.

Such a key is accepted when its value is inert (empty, false, or the listed default) and
reported once as having no effect; a value that asks for something llmtune can't honour is
an error that names the key. ANY marks keys whose value never changes what llmtune does.
"""

from __future__ import annotations

from typing import Any

ANY = object()
INERT = (None, False, "", [], {}, "false", "none")

# key: (values accepted besides the inert ones, hint shown when the value can't be honoured)
AXOLOTL_ONLY_KEYS: dict[str, tuple[Any, str]] = {
    "strict": (ANY, ""),  # llmtune is always strict
    "local_rank": (ANY, ""),
    "debug": (ANY, ""),
    "is_llama_derived_model": (ANY, ""),
    "is_mistral_derived_model": (ANY, ""),
    "is_falcon_derived_model": (ANY, ""),
    "is_qwen_derived_model": (ANY, ""),
    "model_config_type": (ANY, ""),
    "save_safetensors": ((True,), "llmtune always saves safetensors"),
    "bnb_config_kwargs": ((), "use bnb_4bit_quant_type / bnb_4bit_use_double_quant"),
    "xformers_attention": ((), "use attn_implementation: sdpa"),
    "s2_attention": ((), "use attn_implementation: sdpa"),
    "flash_attn_cross_entropy": ((), "remove it"),
    "flash_attn_rms_norm": ((), "remove it"),
    "flash_attn_fuse_qkv": ((), "remove it"),
    "flash_attn_fuse_mlp": ((), "remove it"),
    "flash_optimum": ((), "remove it"),
    "torch_compile": ((), "remove it; llmtune does not compile the model yet"),
    "torch_compile_backend": ((), "remove it"),
    "tensor_parallel_size": ((1,), "use deepspeed zero3 or fsdp to shard a model that doesn't fit one GPU"),
    "context_parallel_size": ((1,), "remove it; context parallelism is not supported"),
    "sequence_parallel_degree": ((1,), "remove it; sequence parallelism is not supported"),
    "dp_shard_size": ((), "use fsdp_config or deepspeed for sharding"),
    "dp_replicate_size": ((), "use fsdp_config or deepspeed for sharding"),
    "hub_model_id": ((), "push the output folder with huggingface-cli upload"),
    "hub_strategy": ((), "remove it"),
    "push_dataset_to_hub": ((), "remove it"),
    "hf_use_auth_token": (ANY, ""),  # the token comes from HF_TOKEN / the hub login
    "gptq": ((), "GPTQ bases are not supported; use adapter: qlora"),
    "gptq_disable_exllama": ((), "remove it"),
    "unfrozen_parameters": ((), "use lora_modules_to_save, or a full fine-tune"),
    "resize_token_embeddings_to_32x": ((), "remove it"),
    "shrink_embeddings": ((), "remove it"),
    "embeddings_skip_upcast": ((), "remove it"),
    "neftune_noise_alpha": ((), "remove it"),
    "noisy_embedding_alpha": ((), "remove it"),
    "relora_steps": ((), "ReLoRA is not supported"),
    "relora_warmup_steps": ((), "ReLoRA is not supported"),
    "relora_anneal_steps": ((), "ReLoRA is not supported"),
    "relora_prune_ratio": ((), "ReLoRA is not supported"),
    "relora_cpu_offload": ((), "ReLoRA is not supported"),
    "lora_on_cpu": ((), "remove it"),
    "loraplus_lr_ratio": ((), "LoRA+ is not supported"),
    "loraplus_lr_embedding": ((), "LoRA+ is not supported"),
    "default_system_message": ((), "put the system message in the data"),
    "eval_table_size": ((0,), "use llmtune infer after training"),
    "eval_max_new_tokens": (ANY, ""),
    "do_causal_lm_eval": ((), "use llmtune eval after training"),
    "eval_causal_lm_metrics": ((), "use llmtune eval after training"),
    "profiler_steps": ((), "remove it"),
    "loss_watchdog_threshold": ((), "remove it; llmtune stops on NaN/inf loss by itself"),
    "loss_watchdog_patience": ((), "remove it"),
    "plugins": ((), "Axolotl plugins don't run under llmtune; remove them"),
    "liger_rope": ((), "Liger kernels are not supported"),
    "liger_rms_norm": ((), "Liger kernels are not supported"),
    "liger_glu_activation": ((), "Liger kernels are not supported"),
    "liger_layer_norm": ((), "Liger kernels are not supported"),
    "liger_fused_linear_cross_entropy": ((), "Liger kernels are not supported"),
    "cut_cross_entropy": ((), "remove it"),
    "unsloth_cross_entropy_loss": ((), "unsloth kernels are not supported"),
    "unsloth_lora_mlp": ((), "unsloth kernels are not supported"),
    "unsloth_lora_qkv": ((), "unsloth kernels are not supported"),
    "unsloth_lora_o": ((), "unsloth kernels are not supported"),
    "sample_packing_eff_est": (ANY, ""),
    "total_num_tokens": (ANY, ""),
    "pretrain_multipack_attn": (ANY, ""),
    "multipack_real_batches": (ANY, ""),
    "sample_packing_group_size": (ANY, ""),
    "sample_packing_bin_size": (ANY, ""),
    "max_packed_sequence_len": ((), "use sequence_len with sample_packing: true"),
    "curriculum_sampling": ((), "remove it"),
    "pretraining_dataset": ((), "streamed pretraining is not supported; use datasets with type: completion"),
    "dataset_exact_deduplication": ((), "deduplicate the data beforehand"),
    "dataset_keep_in_memory": (ANY, ""),
    "batch_flattening": ((), "use sample_packing: true"),
    "include_tokens_per_second": (ANY, ""),  # always reported in metrics.json
    "use_ray": ((), "Ray is not supported; use llmtune's own launchers"),
    "low_cpu_mem_usage": (ANY, ""),
    "fix_untrained_tokens": ((), "remove it"),
    "save_first_step": ((), "remove it"),
    "lr_quadratic_warmup": ((), "remove it"),
    "lr_div_factor": ((), "remove it"),
    "optim_args": ((), "remove it"),
    "optim_target_modules": ((), "remove it"),
    "embedding_lr": ((), "remove it"),
    "embedding_lr_scale": ((), "remove it"),
    "evaluation_strategy": ((), "use eval_strategy"),
    "rl": ((), "preference training (DPO/ORPO/KTO/GRPO) is not supported; llmtune does supervised fine-tuning"),
    "reward_model": ((), "reward models are not supported"),
    "auto_find_batch_size": ((), "use llmtune estimate to choose micro_batch_size"),
    "batch_size": ((), "set micro_batch_size and gradient_accumulation_steps instead"),
    "dataloader_prefetch_factor": (ANY, ""),
    "dataloader_drop_last": ((), "remove it"),
    "mlflow_run_name": (ANY, ""),
    "hf_mlflow_log_artifacts": ((), "remove it"),
    "chat_template_kwargs": ((), "remove it"),
    "overrides_of_model_config": ((), "edit the model's config.json instead"),
    "overrides_of_model_kwargs": ((), "remove it"),
    "deepcompile": ((), "remove it"),
    "gc_steps": (ANY, ""),
}


def is_inert(key: str, value: Any) -> bool:
    """True when an Axolotl-only key's value asks for nothing llmtune would have to do."""
    accepted, _ = AXOLOTL_ONLY_KEYS[key]
    if accepted is ANY:
        return True
    if isinstance(value, (list, dict)) and not value:
        return True
    return any(value is v or (type(value) is type(v) and value == v) for v in (*INERT, *accepted))
