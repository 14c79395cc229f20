"""What a LoRA adapter targets: the recipe's lora_target_modules and lora_target_linear as peft's target_modules,
and the linear layers peft's "all-linear" selects and can't adapt."""

from __future__ import annotations

REGEX_CHARS = set("[]()*+?^$|\\")

# the heads peft's all-linear leaves out of a classifier that has no output embedding (peft's SEQ_CLS_HEAD_NAMES)
CLASSIFIER_HEADS = ("score", "classifier")

# peft refuses LoRA on these modules of state-space models (its own all-linear selects out_proj there)
MAMBA_MODULES = {"falcon_h1": ("out_proj", "conv1d"), "mamba": ("out_proj", "conv1d"),
                 "mamba2": ("out_proj", "conv1d"), "falcon_mamba": ("out_proj", "conv1d"),
                 "nemotron_h": ("out_proj", "conv1d")}  # fmt: skip


def target_pattern(modules):
    """peft matches a list of target names by suffix (".q_proj"), and only a single string as a regex. A list with
    regex entries, as recipes write them (experts.gate_projs.[0-9]+$), becomes one regex that keeps the plain
    entries' suffix meaning."""
    if not isinstance(modules, list) or not any(REGEX_CHARS & set(m) for m in modules):
        return modules
    import re

    parts = [m.strip("^$") if REGEX_CHARS & set(m) else re.escape(m) for m in modules]
    return rf"(?:.*\.)?(?:{'|'.join(parts)})"


def listed_targets(recipe) -> list[str]:
    """lora_target_modules as a list (one string is one name beside lora_target_linear, as Axolotl reads it)."""
    listed = recipe.lora_target_modules
    return [listed] if isinstance(listed, str) else list(listed or [])


def lora_targets(recipe, model=None, task: str = "CAUSAL_LM"):
    """peft's target_modules for the recipe. lora_target_linear alone is peft's "all-linear". With modules listed
    beside it, or peft_layers_to_transform / peft_layers_pattern (peft takes them with a list of names only), it is
    Axolotl's
    union: the names of the linear layers all-linear selects in `model` (the base, before peft wraps it) and the listed
    ones, e.g. lm_head and embed_tokens, which all-linear leaves out. Without a model: "all-linear"."""
    if not recipe.lora_target_linear:
        return target_pattern(recipe.lora_target_modules)
    listed = listed_targets(recipe)
    if model is None or not (listed or by_layer(recipe)):
        return "all-linear"
    return target_pattern(sorted({*linear_layer_names(model, task), *listed}))


def by_layer(recipe) -> bool:
    """Whether the recipe picks layers by index (peft refuses both keys with target_modules as one string)."""
    return recipe.peft_layers_to_transform is not None or recipe.peft_layers_pattern is not None


def linear_layer_names(model, task: str = "CAUSAL_LM") -> list[str]:
    """The last names of the layers peft's all-linear selects (nn.Linear and Conv1D, bitsandbytes' k-bit linears
    among them) less the output head's (a classifier's head where there is no output embedding), as Axolotl's
    find_all_linear_names writes them: peft matches a name by suffix, and applies peft_layers_to_transform only to
    a suffix match (a module's full name is adapted whatever its layer)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    output = getattr(model, "get_output_embeddings", lambda: None)()
    heads = [output] if output is not None else []
    if output is None and task == "SEQ_CLS":
        heads = [getattr(model, name) for name in CLASSIFIER_HEADS if getattr(model, name, None) is not None][:1]
    found, left_out = set(), set()
    for name, module in model.named_modules():
        if not name or not isinstance(module, (torch.nn.Linear, Conv1D)):
            continue
        (left_out if any(module is head for head in heads) else found).add(name.rsplit(".", 1)[-1])
    return sorted(found - left_out)


def all_linear_exclusions(model) -> list[str]:
    """What peft's all-linear would select and can't adapt: a state-space model's out_proj/conv1d (peft refuses
    them), and a MoE router that subclasses nn.Linear but returns a tuple (transformers' PhimoeTopKRouter: the LoRA
    forward fails on it)."""
    import torch

    names = list(MAMBA_MODULES.get(getattr(getattr(model, "config", None), "model_type", ""), ()))
    for name, module in model.named_modules():
        kind = type(module)
        if (isinstance(module, torch.nn.Linear) and kind is not torch.nn.Linear and "Router" in kind.__name__
                and kind.__module__.startswith("transformers.models.")):  # fmt: skip
            names.append(name)
    return names


def layer_of(name: str, patterns) -> int | None:
    """The layer index peft reads from a module's name for peft_layers_to_transform (the first number after
    `patterns`, peft_layers_pattern; without them, the first numbered segment)."""
    import re

    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        patterns = [patterns] if isinstance(patterns, str) else patterns
        match = next(filter(None, (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name) for p in patterns)), None)
    return int(match.group("idx")) if match else None
