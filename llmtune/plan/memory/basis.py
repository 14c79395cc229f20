"""Which rows of `llmtune estimate` rest on a GPU measurement, and which are modelled only.

A row is "measured on H100" when a recorded GPU run (tests/fixtures/h100_memory.json, benchmarks/gpu_memory.py)
had its strategy, its method and the conditions every recorded run shared; anything else is "modelled", with the
first reason it is. Every recorded run used one GPU, so any row at world size > 1 is modelled: its /N sharding
terms, communication buckets and gathers never ran on a GPU. tests/unit/test_estimate.py checks this table against
the fixture, so a new measurement has to be added to both.
"""

from __future__ import annotations

import os

from llmtune.plan.memory.buffers import expandable_segments

MEASURED_ON = "H100"  # NVIDIA H100 80GB HBM3, torch 2.11+cu130, transformers 5.17, DeepSpeed 0.19.8
MODELLED = "modelled"
# (allocator, the estimate's row, method) of every recorded run. The allocator: "expandable" (llmtune's default)
# or "default" (a PYTORCH_CUDA_ALLOC_CONF of the user's own, without expandable segments).
MEASURED = frozenset(
    [("expandable", row, "full") for row in ("single / DDP", "ZeRO-2", "ZeRO-3", "ZeRO-3 + CPU offload",
                                              "FSDP full shard")]
    + [("expandable", "single / DDP", method) for method in ("lora", "qlora")]
    + [("default", row, "full") for row in ("single / DDP", "ZeRO-2", "ZeRO-3", "FSDP full shard")]
    + [("default", "single / DDP", method) for method in ("lora", "qlora")]
)  # fmt: skip
# What every recorded run shared. The model's size, sequence length, micro-batch, LoRA rank, checkpointing and
# packing varied or enter the counted terms per token and per parameter; these change which terms exist.
MEASURED_MODEL_TYPES = ("llama",)
MEASURED_OPTIMIZERS = ("adamw_torch",)
MEASURED_ATTENTION = (None, "sdpa")
# recipe keys that change what a GPU holds, left at their defaults in every recorded run: key -> what it is
UNMEASURED_KEYS = {
    "gradient_accumulation_steps": "gradients held across micro-batches",
    "lora_dropout": "LoRA dropout's masks",
    "peft_use_dora": "DoRA",
    "load_in_8bit": "an 8-bit base",
    "qat": "quantization-aware training",
    "reward_model": "a reward model's head",
    "process_reward_model": "a process reward model's head",
    "num_labels": "a classification head",
    "lisa_n_layers": "LISA",
    "unfrozen_parameters": "unfrozen_parameters",
    "lora_modules_to_save": "lora_modules_to_save",
    "torch_compile": "torch.compile",
    "flash_attention": "flash attention",
    "neftune_noise_alpha": "NEFTune",
    "lora_target_parameters": "LoRA on parameters (MoE experts)",
    "activation_offloading": "activations offloaded to CPU",
    "gptq": "a GPTQ base",
    "rl": "preference training: its reference model and chosen + rejected batches",
}


def method(recipe) -> str:
    if not recipe.adapter:
        return "full"
    return "qlora" if recipe.load_in_4bit else "lora"


def unmeasured_condition(recipe, model_type: str) -> str | None:
    """Why no recorded run covers this recipe, whatever the strategy; None when one could."""
    from llmtune.recipe.kernels import liger_requested

    if model_type not in MEASURED_MODEL_TYPES:
        return f"model_type {model_type}: only Llama shapes were measured"
    if recipe.precision != "bf16":
        return f"precision {recipe.precision}: only bf16 was measured"
    if recipe.optimizer not in MEASURED_OPTIMIZERS:
        return f"optimizer {recipe.optimizer}: only {', '.join(MEASURED_OPTIMIZERS)} was measured"
    if recipe.attn_implementation not in MEASURED_ATTENTION:
        return f"attn_implementation {recipe.attn_implementation}: only sdpa was measured"
    if any(liger_requested(recipe).values()):
        return "Liger kernels: never measured for memory"
    fields = type(recipe).model_fields
    for key, what in UNMEASURED_KEYS.items():
        if key in fields and getattr(recipe, key) != fields[key].default:
            return f"{key} ({what}): never measured"
    return None


def basis(recipe, row_name: str, world_size: int, model_type: str, env=None) -> tuple[str, str]:
    """(label, why): "measured on H100" or "modelled", and the reason a row is modelled ("" when measured)."""
    expandable = expandable_segments(os.environ if env is None else env)
    if world_size > 1:
        return MODELLED, (f"world size {world_size}: every recorded GPU run used 1 GPU, so the /N sharding and "
                          "communication terms never ran on one")  # fmt: skip
    why = unmeasured_condition(recipe, model_type)
    if why:
        return MODELLED, why
    allocator = "expandable" if expandable else "default"
    if (allocator, row_name, method(recipe)) not in MEASURED:
        mode = "" if expandable else ", without expandable segments"
        return MODELLED, f"{method(recipe)} under {row_name}{mode}: never measured on a GPU"
    return f"measured on {MEASURED_ON}", ""
