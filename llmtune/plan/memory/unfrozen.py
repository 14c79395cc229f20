"""How many parameters a full fine-tune's unfrozen_parameters leaves trainable: the patterns matched, as the rank
matches them (llmtune/train/model/adapters.py: freeze_except), against the model's own parameter names, read from
the model built on the meta device (shapes only: no weights, no memory, a second or two for an 8B config).

Only gradients and optimizer states shrink with it: every weight is still held. Patterns are regexes, so no
arithmetic on the config can answer them; where the config isn't on this machine, or transformers can't build the
architecture without running the model's own code, the estimate counts every parameter as trainable and says so.
"""

from __future__ import annotations

from functools import cache

# recipe key -> the auto class the rank builds (train/model/load.py: HEADS holds the same choice)
HEAD_CLASSES = {"reward_model": "AutoModelForSequenceClassification",
                "process_reward_model": "AutoModelForTokenClassification"}  # fmt: skip


def parameter_names(recipe) -> tuple[tuple[str, int], ...] | None:
    """(name, element count) of each parameter of the recipe's model, as the rank names them; None where the
    config can't be read here (not local, not cached, Hub unreachable), transformers can't build the architecture,
    or the rank renames parameters after loading (llama4_linearized_experts)."""
    from pathlib import Path

    from llmtune.plan.memory.facts import fetch_hub_config, find_config_json

    if getattr(recipe, "llama4_linearized_experts", False):
        return None
    name = recipe.base_model_config or recipe.base_model
    found = find_config_json(name)
    if found is None and not Path(name).expanduser().exists():
        found = fetch_hub_config(name)  # where the estimate reads it from too
    if found is None:
        return None
    auto = next((name for key, name in HEAD_CLASSES.items() if getattr(recipe, key, False)), "AutoModelForCausalLM")
    overrides = tuple(sorted((recipe.overrides_of_model_config or {}).items(), key=lambda item: item[0]))
    return _parameters(str(found), found.stat().st_mtime_ns, auto, bool(recipe.trust_remote_code),
                       getattr(recipe, "num_labels", None), recipe.cls_model_config, repr(overrides))  # fmt: skip


def _compiled(recipe) -> list:
    from llmtune.recipe.adapter import unfrozen_pattern

    return [unfrozen_pattern(p)[0] for p in recipe.unfrozen_parameters]


def _matched(recipe) -> list[tuple[str, int, bool]] | None:
    """(name, element count, whether an entry matches it) for each parameter of a full fine-tune's model under
    unfrozen_parameters; None where that doesn't apply or the names can't be read here."""
    named = parameter_names(recipe) if recipe.unfrozen_parameters and not recipe.adapter else None
    if not named:
        return None
    compiled = _compiled(recipe)
    return [(name, count, any(regex.match(name) for regex in compiled)) for name, count in named]


def unmatched_patterns(recipe) -> tuple[list[str], list[str]]:
    """(the unfrozen_parameters entries that match no parameter name, the first names) where the names can be
    read here; ([], []) otherwise."""
    matched = _matched(recipe)
    if not matched:
        return [], []
    names = [name for name, _, _ in matched]
    unmatched = [p for p, regex in zip(recipe.unfrozen_parameters, _compiled(recipe), strict=True)
                 if not any(regex.match(n) for n in names)]  # fmt: skip
    return unmatched, names


def trains_module(recipe, module: str) -> bool:
    """Whether unfrozen_parameters leaves a weight of this module name (embed_tokens) trainable; True where the
    names can't be read here (every parameter counts as trained then)."""
    matched = _matched(recipe)
    return matched is None or any(hit and f".{module}." in f".{name}" for name, _, hit in matched)


def unfrozen_share(recipe) -> float | None:
    """The share of the model's parameters that unfrozen_parameters leaves trainable in a full fine-tune; None
    where it doesn't apply (an adapter, no patterns) or the names can't be read here."""
    matched = _matched(recipe)
    if not matched:
        return None
    return sum(count for _, count, hit in matched if hit) / sum(count for _, count, _ in matched)


@cache
def _parameters(config_path: str, _mtime: int, auto: str, remote_code: bool, num_labels: int | None,
                config_class: str | None, overrides: str) -> tuple[tuple[str, int], ...] | None:  # fmt: skip
    """The names, from the config as the rank reads it (cls_model_config, overrides_of_model_config)."""
    import ast
    import logging

    import torch
    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # in a ZeRO-3 rank, from_config would build it for real, partitioned
        return None
    quiet = logging.getLogger("transformers").level
    transformers.logging.set_verbosity_error()
    try:
        kwargs = {"num_labels": num_labels} if num_labels else {}
        reader = getattr(transformers, config_class) if config_class else transformers.AutoConfig
        config = reader.from_pretrained(config_path, trust_remote_code=remote_code, **kwargs)
        for key, value in ast.literal_eval(overrides):
            setattr(config, key, value)  # as the rank applies them (names don't depend on its rope folding)
        with torch.device("meta"):
            model = getattr(transformers, auto).from_config(config, trust_remote_code=remote_code)
    except Exception:  # an architecture this transformers can't build: the estimate counts every parameter
        return None
    finally:
        logging.getLogger("transformers").setLevel(quiet)
    return tuple((name, param.numel()) for name, param in model.named_parameters())
