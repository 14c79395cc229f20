"""LoRA / QLoRA / DoRA adapters with peft."""

from __future__ import annotations

from llmtune.errors import UserError


def lora_config(recipe):
    from peft import LoraConfig

    if recipe.lora_target_linear:
        targets = "all-linear"
    else:
        targets = recipe.lora_target_modules
    return LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=targets,
        modules_to_save=recipe.lora_modules_to_save,
        use_dora=recipe.peft_use_dora,
        use_rslora=recipe.peft_use_rslora,
        fan_in_fan_out=recipe.lora_fan_in_fan_out,
        layers_to_transform=recipe.peft_layers_to_transform,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_adapter(model, recipe):
    """The model with a trainable adapter (or unchanged for a full fine-tune)."""
    if not recipe.adapter:
        return model
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

    if recipe.load_in_4bit or recipe.load_in_8bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing)
    if recipe.lora_model_dir:
        return PeftModel.from_pretrained(model, recipe.lora_model_dir, is_trainable=True)
    try:
        return get_peft_model(model, lora_config(recipe))
    except ValueError as err:
        raise UserError(f"LoRA could not be attached: {str(err).splitlines()[0][:200]}",
                        "set lora_target_modules to module names of this model, or lora_target_linear: true") from None  # fmt: skip


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameters; 4-bit packed weights count as their logical (unpacked) size."""
    import math

    trainable = total = 0
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None and getattr(state, "shape", None):
            count = math.prod(state.shape)
        else:  # a ZeRO-3 partitioned parameter is empty here; ds_numel is its full size
            count = getattr(param, "ds_numel", param.numel())
        total += count
        trainable += count if param.requires_grad else 0
    return trainable, total
