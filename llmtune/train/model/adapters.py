"""LoRA / QLoRA / DoRA adapters with peft."""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.recipe.adapter import names_module
from llmtune.train.model.targets import (
    REGEX_CHARS,
    all_linear_exclusions,
    by_layer,
    layer_of,
    listed_targets,
    lora_targets,
)


def lora_config(recipe, model=None):
    """The recipe's LoraConfig; `model`, the base before peft wraps it, where lora_target_linear has modules listed
    beside it, or layers picked by index (targets.lora_targets)."""
    from peft import LoraConfig

    from llmtune.train.model.load import head_of

    task = head_of(recipe)[1]
    targets = lora_targets(recipe, model, task)
    if isinstance(targets, str) and by_layer(recipe):  # peft raises a ValueError of its own
        raise UserError("peft_layers_to_transform and peft_layers_pattern apply to a list of module names, and "
                        "lora_target_modules is a regular expression here (one string, or a list with regex entries)",
                        "list the modules by plain names, e.g. lora_target_modules: [q_proj, v_proj]")  # fmt: skip
    extra = {}
    if recipe.lora_target_parameters:
        extra["target_parameters"] = recipe.lora_target_parameters
        targets = targets or []  # parameters alone: no module targets
    if task != "CAUSAL_LM" and recipe.lora_target_linear:
        extra["exclude_modules"] = ["score", "classifier"]  # the new head trains whole (peft's modules_to_save)
    for key, name in (("lora_rank_pattern", "rank_pattern"), ("lora_alpha_pattern", "alpha_pattern"),
                      ("peft_layers_pattern", "layers_pattern"), ("peft_init_lora_weights", "init_lora_weights"),
                      ("peft_ensure_weight_tying", "ensure_weight_tying"),
                      ("peft_trainable_token_indices", "trainable_token_indices")):  # fmt: skip
        if getattr(recipe, key) is not None:
            extra[name] = getattr(recipe, key)
    loftq = recipe.peft.loftq_config if recipe.peft else None
    if loftq:
        from peft import LoftQConfig

        extra.update(init_lora_weights="loftq", loftq_config=LoftQConfig(loftq_bits=loftq.loftq_bits))
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
        task_type=task,  # a reward model's head is new: peft trains and saves it whole
        **extra,
    )


def attach_adapter(model, recipe):
    """The model with a trainable adapter (or unchanged for a full fine-tune); unfrozen_parameters applied."""
    model = _with_adapter(model, recipe)
    if recipe.unfrozen_parameters:
        freeze_except(model, recipe.unfrozen_parameters, bool(recipe.adapter), recipe.gradient_checkpointing)
    return model


def _with_adapter(model, recipe):
    if not recipe.adapter:
        return model
    import torch
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

    if recipe.load_in_4bit or recipe.load_in_8bit or recipe.gptq:  # peft's preparation knows GPTQ bases too
        # it makes every 16-bit parameter fp32, for the norms and embeddings; a mixture of experts' fused expert
        # tensors (3D: bitsandbytes quantizes linear layers only) are most of the model, frozen: they keep their
        # 16 bits, as under plain LoRA (fp32 would double the base it was meant to shrink)
        fused = {name: param.dtype for name, param in model.named_parameters()
                 if param.ndim >= 3 and param.dtype in (torch.bfloat16, torch.float16)}  # fmt: skip
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing)
        for name, param in model.named_parameters():
            if name in fused:
                param.data = param.data.to(fused[name])
    if recipe.lora_model_dir:
        from llmtune.plan.vocabulary import check_adapter_rows, embedding_modules_of

        weight = model.get_input_embeddings().weight
        rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 partitioned: the full shape is ds_shape
        check_adapter_rows(recipe, rows, embedding_modules_of(getattr(model.config, "model_type", None))[0])
        return PeftModel.from_pretrained(model, recipe.lora_model_dir, is_trainable=True)
    layout = ModuleLayout.of(model)  # before peft wraps it
    check_module_names(recipe, layout, key="lora_modules_to_save")
    if recipe.peft_trainable_token_indices is not None:
        check_token_rows(model, recipe.peft_trainable_token_indices)
    config = lora_config(recipe, model)
    if recipe.lora_target_linear:  # all-linear, or its layers by name with the listed ones (Axolotl's union)
        left_out = all_linear_exclusions(model)
        if left_out:
            config.exclude_modules = sorted({*(config.exclude_modules or ()), *left_out})
    try:
        adapted = get_peft_model(model, config, autocast_adapter_dtype=recipe.peft_autocast_adapter_dtype)
    except ValueError as err:
        if "not found in the base model" in str(err):  # nothing matched: name the entry that matches no module
            check_module_names(recipe, layout, key="lora_target_modules")
        hint = ("set lora_target_modules to the module names to adapt (lora_target_linear: true is what failed)"
                if recipe.lora_target_linear else
                "add the missing name: transformers 5 holds both in one fused experts tensor, which LoRA adapts "
                "whole" if "without also targeting" in str(err) else
                "set lora_target_modules to module names of this model, or lora_target_linear: true")  # fmt: skip
        if isinstance(recipe.lora_target_modules, str):  # peft reads one string as a regex the whole name matches
            hint = (f"lora_target_modules is one string, which peft matches against each module's whole name as a "
                    f"regular expression: write a list, lora_target_modules: [{recipe.lora_target_modules}]")  # fmt: skip
        raise UserError(f"LoRA could not be attached: {str(err).splitlines()[0][:200]}", hint) from None
    # peft maps the per-expert names of transformers 4 (gate_proj, up_proj, down_proj; Mixtral's w1, w3, w2) onto
    # transformers 5's fused expert tensors where it knows the family: what it converted is no unmatched name
    kept = next(iter(adapted.peft_config.values())).target_modules
    converted = set() if isinstance(kept, str) or kept is None else set(listed_targets(recipe)) - set(kept)
    check_module_names(recipe, layout, key="lora_target_modules", converted=converted)
    return adapted


def check_token_rows(model, rows) -> None:
    """peft_trainable_token_indices against the model: each module it names is an embedding or a linear head of the
    model, and each id one of its rows (peft would stop on an IndexError, or blame lora_target_modules)."""
    import torch

    wanted = rows.items() if isinstance(rows, dict) else [(None, rows)]
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Embedding, torch.nn.Linear))}  # fmt: skip
    for key, ids in wanted:
        if key is None:
            found, module = "the input embedding", model.get_input_embeddings()
        else:
            found = next((name for name in layers if names_module(name, key)), None)
            module = layers.get(found)
        if module is None:
            embeddings = [name.rsplit(".", 1)[-1] for name, layer in layers.items()
                          if isinstance(layer, torch.nn.Embedding) or layer is model.get_output_embeddings()]  # fmt: skip
            raise UserError(f"peft_trainable_token_indices: {key} names no embedding or output layer of the model",
                            f"use its names: {', '.join(dict.fromkeys(embeddings))}")  # fmt: skip
        size = module.weight.shape[0]
        if max(ids) >= size:
            raise UserError(f"peft_trainable_token_indices: id {max(ids)} is past {found}'s {size} rows (ids 0 to "
                            f"{size - 1})", "list token ids of the run's tokenizer (tokens it adds come after "
                            "its vocabulary)")  # fmt: skip


class ModuleLayout:
    """What the name checks need of a model, taken before peft wraps it: its module names, its linear layers' short
    names, its fused experts' lora_target_parameters entries, its parameter names and family."""

    def __init__(self, names, linear, experts, parameters, kind, embeddings=()):
        self.names, self.linear, self.experts, self.parameters, self.kind = names, linear, experts, parameters, kind
        self.embeddings = embeddings  # the last name of each embedding module (wte, embed_tokens, ...)

    @classmethod
    def of(cls, model) -> ModuleLayout:
        import torch

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})  # fmt: skip
        kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        embeddings = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
        )
        return cls([n for n, _ in model.named_modules()], linear, fused_expert_tensors(model),
                   [n for n, _ in model.named_parameters()], kind, embeddings)  # fmt: skip


def check_module_names(recipe, layout: ModuleLayout, key: str, converted: set[str] = frozenset()) -> None:
    """Every plain name in `key` (lora_target_modules, lora_modules_to_save) must name a module of the model, or be
    one peft `converted` onto fused expert tensors: peft adapts what matches and says nothing of an entry that
    matches nothing (a typo, or another family's name, would train without that layer). Beside lora_target_linear
    such a name is said, not refused: Axolotl's own recipes list the names of other families there."""
    entries = getattr(recipe, key) or []
    if key == "lora_target_modules":
        if not recipe.lora_target_linear and not isinstance(entries, list):
            return  # one regex string: peft says when it matches nothing
        entries = listed_targets(recipe)
    unmatched = []
    for entry in entries:
        if (entry in converted or REGEX_CHARS & set(entry)
                or any(n == entry or n.endswith(f".{entry}") for n in layout.names)):  # fmt: skip
            continue
        if key == "lora_target_modules" and recipe.lora_target_linear:
            unmatched.append(entry)
            continue
        if key == "lora_target_modules" and any(n.endswith(f".{entry}") for n in layout.parameters):
            raise UserError(f"{key}: '{entry}' is a parameter of this model (fused experts' weights), not a "
                            "module: peft can't wrap it as a layer and would leave it out silently",
                            "list it under lora_target_parameters instead")  # fmt: skip
        experts = layout.experts if key == "lora_target_modules" else []
        embeddings = layout.embeddings
        raise UserError(f"{key}: '{entry}' names no module of this model ({layout.kind}); peft would leave it out "
                        "silently and train without it",
                        (f"its embedding layers are named {', '.join(embeddings)}; " if embeddings and
                         key == "lora_modules_to_save" else "")
                        + f"its linear layers are named {', '.join(layout.linear[:12]) or 'differently'}"
                        + ("" if key == "lora_modules_to_save" else "; or set lora_target_linear: true")
                        + (f"; its experts' weights are parameters: lora_target_parameters: [{', '.join(experts)}]"
                           if experts else ""))  # fmt: skip
    if unmatched:
        from llmtune.train.runtime.progress import log

        log(f"note: lora_target_modules: {', '.join(unmatched)} name{'s' if len(unmatched) == 1 else ''} no module "
            f"of this model ({layout.kind}), whose linear layers are named {', '.join(layout.linear[:12])}: "
            f"lora_target_linear adapts those, and nothing by {'that name' if len(unmatched) == 1 else 'those names'}")  # fmt: skip


def _base_name(name: str) -> str:
    """The base model's name of a parameter or module, peft's wrapping removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def _in_layer(name: str) -> str:
    """A name as lora_target_parameters writes it, within its layer: model.layers.0.mlp.experts -> mlp.experts."""
    import re

    return re.sub(r"^.*?\.\d+\.", "", _base_name(name))


def fused_expert_tensors(model) -> list[str]:
    """The lora_target_parameters entries of a mixture of experts' fused expert tensors (3D, one slice per
    expert), e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]; [] for a dense model."""
    return list(dict.fromkeys(_in_layer(name) for name, param in model.named_parameters() if param.ndim == 3))


def frozen_experts(model) -> str | None:
    """What an adapter leaves frozen of a mixture of experts' fused expert weights (3D tensors, one slice per expert:
    no nn.Linear for all-linear or a module name to reach; peft wraps them for some families and not others), said
    with the recipe key that trains them; None where every expert tensor is adapted or there are none."""
    import re

    owners: dict[str, list[str]] = {}
    adapted: set[str] = set()
    for name, param in model.named_parameters():
        if "lora_" in name:
            adapted.add(_base_name(re.sub(r"\.lora_.*$", "", name)))
        elif param.ndim == 3 and not param.requires_grad:
            owner, _, leaf = _base_name(name).rpartition(".")
            owners.setdefault(owner, []).append(leaf)
    frozen = {owner: leaves for owner, leaves in owners.items() if owner not in adapted}
    if not frozen:
        return None
    first = next(iter(frozen))
    module = model.get_submodule(first if not hasattr(model, "get_base_model") else PEFT_PREFIX + first)
    kind = type(getattr(module, "base_layer", module)).__name__
    targets = ", ".join(_in_layer(f"{first}.{leaf}") for leaf in frozen[first])
    return (
        f"the routed experts stay frozen: {len(frozen)} fused expert modules ({kind}, e.g. {first}) hold their "
        "weights as 3D tensors, which this adapter's target modules don't reach; to train them add "
        f"lora_target_parameters: [{targets}]"
    )


def frozen_linears(model, recipe) -> str | None:
    """Linear layers the recipe's LoRA targets name (all-linear, or a list of names) that peft left without LoRA,
    said instead of silently. peft 0.21 moves every target named gate_proj, up_proj or down_proj of a family whose
    experts transformers 5 fuses (DeepSeek-V3, GLM-4 MoE, ...) onto the fused experts, which takes LoRA off the dense
    layers' MLPs and the shared experts of those names; nothing in a recipe can put it back today."""
    import torch

    if recipe.lora_model_dir:
        return None
    targets = lora_targets(recipe)  # as the recipe asked, before peft's conversion ("all-linear" with any listed)
    layers = recipe.peft_layers_to_transform
    if not targets or (isinstance(targets, str) and targets != "all-linear"):
        return None  # a regex: peft's own matching, which says when it matches nothing
    output = getattr(getattr(model, "get_output_embeddings", lambda: None)(), "weight", None)
    left_out = set(all_linear_exclusions(model)) | {
        "lm_head",
        "score",
        "classifier",
        *(recipe.lora_modules_to_save or []),
    }
    frozen = []
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        if name.endswith(".base_layer") or ".lora_" in name or "modules_to_save" in name or "original_module" in name:
            continue  # wrapped by peft, or peft's own
        base = _base_name(name)
        leaf = base.rsplit(".", 1)[-1]
        wanted = targets == "all-linear" or any(base == t or base.endswith(f".{t}") for t in targets)
        if layers and layer_of(base, recipe.peft_layers_pattern) not in layers:
            continue  # a layer peft_layers_to_transform leaves out
        if wanted and leaf not in left_out and base not in left_out and module.weight is not output:
            frozen.append(base)
    if not frozen:
        return None
    names = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in frozen}))
    return (f"{len(frozen)} linear layers the LoRA targets name stay frozen ({names}; e.g. {frozen[0]}): peft left "
            "them without LoRA (peft 0.21 maps these names onto this family's fused experts and takes them off the "
            "dense layers that share them)")  # fmt: skip


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


PEFT_PREFIX = "base_model.model."


def freeze_except(model, patterns: list[str], adapter: bool, checkpointing: bool) -> None:
    """unfrozen_parameters, as Axolotl reads them: a parameter trains only if a pattern matches its name from the
    start; a [start:end] range trains only those rows (the others' gradients are zeroed). With an adapter the
    names are the base model's (peft's prefix removed) and only the adapter's own parameters can train: base
    weights trained outside lora_modules_to_save would not be saved with it."""
    from llmtune.recipe.adapter import unfrozen_pattern

    compiled = [unfrozen_pattern(p) for p in patterns]
    trainable, used = 0, set()
    for name, param in model.named_parameters():
        shown = name.removeprefix(PEFT_PREFIX) if adapter else name
        matches = [rows for regex, rows in compiled if regex.match(shown)]
        used.update(i for i, (regex, _) in enumerate(compiled) if regex.match(shown))
        if adapter and not param.requires_grad:
            continue  # the frozen base stays frozen
        param.requires_grad = bool(matches)
        if not matches:
            continue
        trainable += 1
        ranges = [rows for rows in matches if rows is not None]
        if ranges and len(ranges) == len(matches):
            param.register_hook(_rows_only(ranges, param.shape[0]))
    if not trainable:
        names = [n.removeprefix(PEFT_PREFIX) if adapter else n for n, _ in list(model.named_parameters())[:3]]
        raise UserError(f"unfrozen_parameters matches no {'adapter ' if adapter else ''}parameter, so nothing would "
                        f"train (names look like: {', '.join(names)})",
                        "patterns match from the start of the name ('.' is a literal dot); check them against "
                        "the model's parameter names")  # fmt: skip
    unused = [patterns[i] for i in range(len(patterns)) if i not in used]
    if unused and not adapter:  # (an adapter's entries may name base weights, left frozen, as Axolotl's do)
        raise UserError(f"unfrozen_parameters: {', '.join(repr(p) for p in unused)} match no parameter of the model, "
                        f"so they train nothing (names look like: {next(iter(dict(model.named_parameters())))})",
                        "patterns match from the start of the name ('.' is a literal dot); check them against "
                        "the model's parameter names")  # fmt: skip
    embeddings = model.get_input_embeddings()
    if checkpointing and embeddings is not None and not embeddings.weight.requires_grad:
        model.enable_input_require_grads()  # checkpointed layers need an input that requires grad


def _rows_only(ranges: list[tuple[int | None, int | None]], rows: int):
    """A gradient hook that keeps only the given row ranges of a parameter's gradient."""
    import torch

    keep = torch.zeros(rows, dtype=torch.bool)
    for start, end in ranges:
        keep[slice(start, end)] = True

    def hook(grad):
        mask = keep.to(grad.device).view(-1, *([1] * (grad.dim() - 1)))
        return grad * mask

    return hook
