"""Optimizers llmtune builds instead of the Trainer's: Muon (llmtune's own, objectives/muon.py), LoRA+ (peft's
create_loraplus_optimizer) and learning rates by parameter group (embedding_lr, embedding_lr_scale, lr_groups),
the last two with the Trainer's optimizer class and arguments. The Trainer builds every other."""

from __future__ import annotations

from collections import defaultdict

from llmtune.errors import UserError

# Segments that wrappers put into parameter names (FSDP1, activation checkpointing, DDP, torch.compile): a recipe's
# lr_groups modules name the model's own parameters
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def own_optimizer(trainer, model):
    """The recipe's own optimizer for `model`, or None where the Trainer's create_optimizer builds it."""
    recipe = trainer.recipe
    if recipe.optimizer == "muon":
        from llmtune.train.objectives.muon import make_muon

        return make_muon(model, trainer.args, set(trainer.get_decay_parameter_names(model)))
    if recipe.loraplus_lr_ratio:
        from peft.optimizers import create_loraplus_optimizer

        optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
        # peft's groups: A matrices at learning_rate, B at ratio x learning_rate, LoRA on embeddings at their own
        # rate; weight_decay as the recipe says (Axolotl left peft's default, 0)
        return create_loraplus_optimizer(
            model, optimizer_cls, loraplus_lr_ratio=recipe.loraplus_lr_ratio,
            loraplus_lr_embedding=recipe.loraplus_lr_embedding or 1e-6,
            loraplus_weight_decay=trainer.args.weight_decay, **kwargs,
        )  # fmt: skip
    if recipe.grouped_rates:
        return grouped_optimizer(trainer, model)
    return None


def clean_name(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def embedding_paths(model) -> tuple[str, ...]:
    """The module paths (wrapper segments removed) of the model's input and output embeddings."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    wanted = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(base, getter)()
        except (AttributeError, NotImplementedError):
            module = None
        if module is not None:
            wanted.append(module)
    return tuple(clean_name(name) for name, module in model.named_modules() if any(module is w for w in wanted))


def rate_groups(model, recipe, decay_names: set[str], weight_decay: float) -> tuple[list[dict], list[str]]:
    """(the optimizer's parameter groups, one line per rate for the log). Embeddings first (embedding_lr or
    learning_rate x embedding_lr_scale, no weight decay, as Axolotl groups them), then each lr_groups entry (the
    first listed whose module a name contains), then the rest at learning_rate; weight decay as the Trainer
    decides it (not on biases and norms)."""
    base_lr = recipe.learning_rate
    embedding_lr = recipe.embedding_lr or (base_lr * recipe.embedding_lr_scale if recipe.embedding_lr_scale else None)
    embeddings = embedding_paths(model) if embedding_lr is not None else ()
    lr_groups = recipe.lr_groups or []
    chosen: dict[tuple[str, bool], list] = defaultdict(list)  # (group, decays) -> parameters
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    rates = {"embeddings": embedding_lr, **{group.name: group.lr for group in lr_groups}, "the rest": base_lr}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        plain = clean_name(name)
        if any(f".{path}." in f".{plain}" for path in embeddings):
            group, decays = "embeddings", False
        else:
            group = next((g.name for g in lr_groups if any(module in plain for module in g.modules)), "the rest")
            decays = name in decay_names
        chosen[(group, decays)].append(parameter)
        sizes[group][0] += 1
        sizes[group][1] += getattr(parameter, "ds_numel", parameter.numel())  # ZeRO-3 partitions hold a part
    if embedding_lr is not None and not sizes["embeddings"][0]:
        key = "embedding_lr" if recipe.embedding_lr else "embedding_lr_scale"
        frozen = ", ".join(_shown(path) for path in embeddings) or "none found"
        leaves = ", ".join(dict.fromkeys(path.rsplit(".", 1)[-1] for path in embeddings)) or "embed_tokens, lm_head"
        raise UserError(f"{key}: the model's embeddings ({frozen}) don't train in this run, so the key would have no "
                        "effect", f"train them (with an adapter: lora_modules_to_save: [{leaves}]), or remove the "
                        "key")  # fmt: skip
    for index, group in enumerate(lr_groups):
        if not sizes[group.name][0]:
            trainable = [clean_name(n) for n, p in model.named_parameters() if p.requires_grad]
            raise UserError(f"lr_groups[{index}] ({group.name}): no trainable parameter's name contains "
                            f"{' or '.join(map(repr, group.modules))} (or an earlier group took them)",
                            f"name part of a trainable parameter, e.g. {_example(group.modules, trainable)!r}")  # fmt: skip
    groups = []
    for (group, decays), parameters in chosen.items():
        for on_mesh in _by_mesh(parameters):
            groups.append({"params": on_mesh, "lr": rates[group], "weight_decay": weight_decay if decays else 0.0})
    lines = [f"{group} at {rates[group]:g} ({count} tensors, {values:,} values)"
             for group, (count, values) in sizes.items() if count]  # fmt: skip
    return groups, lines


def _shown(name: str) -> str:
    """A parameter or module name without peft's wrapper prefix."""
    return name.removeprefix("base_model.model.")


def _example(modules: list[str], trainable: list[str]) -> str:
    """A trainable parameter's name near what the group wrote: the longest leading part of one of its modules that
    some trainable name contains (self_attn.o_proj.weight -> ...self_attn.o_proj.lora_A.default.weight)."""
    for module in modules:
        parts = module.split(".")
        for end in range(len(parts), 0, -1):
            found = next((name for name in trainable if ".".join(parts[:end]) in name), None)
            if found:
                return _shown(found)
    return _shown(trainable[0]) if trainable else ""


def _by_mesh(parameters: list) -> list[list]:
    """Parameters split by DTensor device mesh: one fused/foreach optimizer kernel call can't span meshes."""
    from torch.distributed.tensor import DTensor

    meshes: dict = defaultdict(list)
    for parameter in parameters:
        meshes[parameter.device_mesh if isinstance(parameter, DTensor) else None].append(parameter)
    return list(meshes.values())


def grouped_optimizer(trainer, model):
    """The Trainer's optimizer class and arguments over the recipe's rate groups; bitsandbytes' 8-bit optimizers keep
    embeddings in 32-bit state, as the Trainer's own create_optimizer registers them."""
    import torch.nn as nn

    from llmtune.train.runtime.progress import log

    optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    groups, lines = rate_groups(model, trainer.recipe, set(trainer.get_decay_parameter_names(model)),
                                trainer.args.weight_decay)  # fmt: skip
    log("learning rates by group: " + "; ".join(lines))
    optimizer = optimizer_cls(groups, **kwargs)
    if "bitsandbytes" in str(optimizer_cls) and kwargs.get("optim_bits") == 8:
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer
