"""What none of TRL's trainers (preference training and online RL alike) runs with: the keys that change the supervised
loss or its data, or split what TRL computes per sequence. Each method refuses them in one line, with its own reasons
where it has them."""

from __future__ import annotations

INERT = (None, False, "", [], {})  # a trl: value that asks for nothing


def refuse_clashes(recipe, why: dict[str, str], otherwise: str, extra: dict[str, bool] | None = None) -> None:
    """ValueError naming the first key set that the method `recipe.rl` can't honour, with `why[key]` (else
    `otherwise`) as the reason. `extra`: the method's own keys, checked after the shared ones."""
    clashes = {
        "reward_model": recipe.reward_model, "process_reward_model": recipe.process_reward_model,
        "sample_packing": recipe.sample_packing, "pipeline_parallel_size > 1": recipe.pipeline_parallel_size > 1,
        "tensor_parallel_size > 1": recipe.tensor_parallel_size > 1,
        "context_parallel_size > 1": recipe.context_parallel_size > 1, "use_eaft": recipe.use_eaft,
        "lisa_n_layers": bool(recipe.lisa_n_layers), "relora": bool(recipe.relora), "qat": bool(recipe.qat),
        **(extra or {}),
    }  # fmt: skip
    clash = next((key for key, on in clashes.items() if on), None)
    if clash:
        raise ValueError(f"rl: {recipe.rl} with {clash} is not supported: {why.get(clash, otherwise)}")
