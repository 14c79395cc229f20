"""Online RL keys: `rl: grpo` and `rl: gdpo` (GRPO with each reward normalised per group before they are summed,
TRL's multi_objective_aggregation: normalize_then_sum), with Axolotl's `trl:` section and `vllm:` section.

TRL's GRPOTrainer runs them (llmtune/train/rl/trainers.py). What llmtune checks here, before anything starts, with one line
naming the key: the reward functions and their weights, the generation sizes, where generation runs (in the
training process, vLLM colocated, or a vLLM server), the dataset types (rows with a prompt, or a transform from the
user's file), and the combinations TRL or the strategy can't run. The user's functions themselves are resolved by
the loader (llmtune/recipe/user_code.py), which knows the recipe's folder.
"""

from __future__ import annotations

from llmtune.recipe.trl_trainers import INERT, refuse_clashes
from llmtune.recipe.user_code import looks_like_function

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
VLLM_MODES = ("server", "colocate")
GDPO_AGGREGATION = "normalize_then_sum"


def trl_value(recipe, key: str, default=None):
    return (recipe.trl or {}).get(key, default)


def reward_names(recipe) -> list[str]:
    names = trl_value(recipe, "reward_funcs") or []
    return [names] if isinstance(names, str) else list(names)


def generation_mode(recipe) -> str:
    """'in-process' (transformers' generate in the training process), 'colocate' or 'server' (vLLM)."""
    if not trl_value(recipe, "use_vllm"):
        return "in-process"
    return trl_value(recipe, "vllm_mode") or "server"


def aggregation(recipe) -> str:
    return trl_value(recipe, "multi_objective_aggregation") or (GDPO_AGGREGATION if recipe.rl == "gdpo" else
                                                               "sum_then_normalize")  # fmt: skip


# trl: keys Axolotl reads for GRPO that TRL 1.16's GRPOConfig doesn't have (set to anything but off, they'd be
# refused by the ranks after the data and the model are loaded; here they are refused when the recipe is read)
AXOLOTL_ONLY_GRPO = frozenset("""
    async_prefetch prefetch_depth replay_buffer_size replay_recompute_logps reroll_max_groups reroll_start_fraction
    reward_num_workers skip_zero_advantage_batches streaming_min_groups streaming_partial_batch use_data_producer
    use_liger_loss vllm_guided_decoding_regex vllm_lora_sync vllm_sync_interval
""".split())  # fmt: skip


def check_online(recipe) -> None:
    """ValueError naming the key, for what TRL's GRPO (or the plan) can't honour."""
    rl = recipe.rl
    for key, value in (recipe.trl or {}).items():
        if key in AXOLOTL_ONLY_GRPO and value not in INERT:
            raise ValueError(f"trl.{key} is a setting of Axolotl's own GRPO (asynchronous generation, replay, "
                             "streaming, its Liger loss), not of TRL 1.16's GRPOTrainer, which llmtune runs: remove "
                             "it")  # fmt: skip
    names = reward_names(recipe)
    if not names:
        raise ValueError(f"rl: {rl} needs trl.reward_funcs: the functions (module.function in a .py file beside the "
                         "recipe) or reward models (a path or hub id) that score each completion")  # fmt: skip
    if any(not isinstance(name, str) or not name for name in names):
        raise ValueError("trl.reward_funcs: each entry is a module.function name or a reward model's path or hub id")
    weights = trl_value(recipe, "reward_weights")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(names)):
        raise ValueError(f"trl.reward_weights has {len(weights) if isinstance(weights, list) else 'no list of'} "
                         f"weights for {len(names)} reward function(s); give one per function")  # fmt: skip
    generations = trl_value(recipe, "num_generations", 8)
    if not isinstance(generations, int) or generations < 2:
        raise ValueError(f"trl.num_generations is {generations}: GRPO compares completions of one prompt, so it "
                         "needs at least 2")  # fmt: skip
    chosen = trl_value(recipe, "multi_objective_aggregation")
    if chosen is not None and chosen not in AGGREGATIONS:
        raise ValueError(f"trl.multi_objective_aggregation '{chosen}' is not one of {', '.join(AGGREGATIONS)}")
    if rl == "gdpo" and chosen == "sum_then_normalize":
        raise ValueError("rl: gdpo normalises each reward before summing them (normalize_then_sum); with "
                         "trl.multi_objective_aggregation: sum_then_normalize it is rl: grpo")  # fmt: skip
    mode = trl_value(recipe, "vllm_mode")
    if mode is not None and mode not in VLLM_MODES:
        raise ValueError(f"trl.vllm_mode '{mode}' is not one of {', '.join(VLLM_MODES)}")
    if mode and not trl_value(recipe, "use_vllm"):
        raise ValueError(f"trl.vllm_mode: {mode} without trl.use_vllm: true; set use_vllm, or remove vllm_mode")
    if recipe.vllm and not trl_value(recipe, "use_vllm"):
        raise ValueError("vllm: configures the generation engine of trl.use_vllm: true; set it, or remove vllm:")
    why = {
        "sample_packing": "TRL's GRPO pads each prompt and completion; set sample_packing: false",
        "pipeline_parallel_size > 1": "TRL's trainers run through the HF Trainer, which pipeline stages replace",
        "tensor_parallel_size > 1": "TRL's GRPO doesn't generate or compute its per-token log-probs over a "
        "tensor-parallel mesh",
        "context_parallel_size > 1": "GRPO's per-token log-probs need whole sequences on each rank",
        "max_prompt_len": "TRL's GRPO has no prompt limit; prompts longer than sequence_len minus "
        "trl.max_completion_length are dropped before launch",
    }  # fmt: skip
    refuse_clashes(
        recipe,
        why,
        "it changes the supervised loss or its data, which GRPO's loss replaces",
        {"max_prompt_len": bool(recipe.max_prompt_len)},
    )
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            kind = spec.type
            if kind in (None, "passthrough") or (isinstance(kind, str) and looks_like_function(kind)):
                continue
            raise ValueError(f"{group}[{index}].type for rl: {rl} is a transform from your file (module.function, "
                             "returning each row's prompt) or none (rows that have a prompt field); "
                             f"'{kind if isinstance(kind, str) else 'a format mapping'}' is a supervised format")  # fmt: skip


def user_functions(recipe, folder) -> dict:
    """Every function the recipe names from the user's files, resolved (imported): {key: callable}. Reward models
    (a folder or hub id) are left as they are. UserError naming the key for a name that doesn't resolve."""
    from pathlib import Path

    from llmtune.errors import UserError
    from llmtune.recipe.user_code import resolve

    found = {}
    for index, name in enumerate(reward_names(recipe)):
        local = Path(name).expanduser() if not Path(name).is_absolute() else Path(name)
        if "." not in name and "/" not in name and not local.exists():  # not a function, a hub id (org/name) or a
            # folder: the Hub would be asked for it, and refuse it, on every rank after the model is loaded
            raise UserError(f"trl.reward_funcs[{index}]: '{name}' is neither module.function (a .py beside the "
                            "recipe) nor a reward model folder", f"name a function as module.function (e.g. "
                            f"rewards.{name} for def {name} in rewards.py), a reward model's folder (read from "
                            f"{Path.cwd()}) or its hub id (org/name)")  # fmt: skip
        if looks_like_function(name) and not (folder and (Path(folder) / name).exists()) and not local.exists():
            found[f"trl.reward_funcs[{index}]"] = resolve(name, folder, f"trl.reward_funcs[{index}]")
    rollout = trl_value(recipe, "rollout_func")
    if rollout:
        found["trl.rollout_func"] = resolve(rollout, folder, "trl.rollout_func")
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            if isinstance(spec.type, str) and looks_like_function(spec.type):
                found[f"{group}[{index}].type"] = resolve(spec.type, folder, f"{group}[{index}].type")
    return found
