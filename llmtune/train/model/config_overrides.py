"""overrides_of_model_config applied to a loaded model config.

transformers 5 keeps a rotary model's RoPE settings in one mapping, `config.rope_parameters` (rope_type,
rope_theta, factor, ...), built from `rope_scaling` and `rope_theta` when a config is constructed. Setting either
old name on a loaded config afterwards is not read again: `rope_theta` was ignored (the model trained at its own
theta, and its saved config.json held both values), and `rope_scaling` replaced the mapping without its theta (a
TypeError in the rotary embedding at the first forward). The overrides that Axolotl recipes write, and that
llmtune's reading of the old top-level `rope_scaling` key produces, are folded into `rope_parameters` here, the
way the config's constructor folds them, and checked with the config's own validation.
"""

from __future__ import annotations

import copy

from llmtune.errors import UserError

OLD_ROPE_KEYS = ("rope_scaling", "rope_theta")


def apply_overrides(config, overrides: dict, log) -> None:
    overrides = dict(overrides or {})
    rope = {key: overrides.pop(key) for key in OLD_ROPE_KEYS if key in overrides}
    if rope and "rope_parameters" not in overrides and isinstance(getattr(config, "rope_parameters", None), dict):
        _fold_rope(config, rope, log)
    else:  # a config of the older layout (or rope_parameters given too): set as written
        overrides.update(rope)
    for key, value in overrides.items():
        if not hasattr(config, key):
            log(f"overrides_of_model_config.{key}: {type(config).__name__} has no such setting; set anyway")
        setattr(config, key, value)


def _fold_rope(config, rope: dict, log) -> None:
    current = copy.deepcopy(config.rope_parameters)
    keys = ", ".join(f"{key}: {value}" for key, value in rope.items())
    if any(isinstance(value, dict) for value in current.values()):  # one mapping per attention type (Gemma 3)
        raise UserError(f"overrides_of_model_config: {keys}: {type(config).__name__} keeps its RoPE settings per "
                        f"attention type ({', '.join(k for k, v in current.items() if isinstance(v, dict))}), so "
                        "which one it means is ambiguous", "set overrides_of_model_config.rope_parameters to the "
                        "whole mapping, each attention type's settings under its name")  # fmt: skip
    scaling = rope.get("rope_scaling", {})
    if scaling is None:  # null: no scaling, the model's own theta
        folded = {"rope_type": "default", "rope_theta": current.get("rope_theta")}
    elif not isinstance(scaling, dict):
        raise UserError(f"overrides_of_model_config.rope_scaling: {scaling!r} must be a mapping",
                        "e.g. {rope_type: linear, factor: 2.0}")  # fmt: skip
    else:
        scaling = dict(scaling)
        if "type" in scaling:  # the name before transformers 4.45
            scaling.setdefault("rope_type", scaling.pop("type"))
        folded = (
            {**current, **scaling}
            if scaling.get("rope_type", current.get("rope_type")) == current.get("rope_type")
            else {"rope_theta": current.get("rope_theta"), **scaling}
        )  # another type: its own keys
    if "rope_theta" in rope:
        folded["rope_theta"] = rope["rope_theta"]
    config.rope_parameters = folded
    try:
        config.standardize_rope_params()
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"overrides_of_model_config: {keys}: transformers refuses the RoPE settings it gives "
                        f"({config.rope_parameters}): {str(err).strip(chr(34)).splitlines()[0][:200] if str(err) else type(err).__name__}",
                        "see transformers' rope_parameters for the keys each rope_type needs") from None  # fmt: skip
    log(f"overrides_of_model_config: {keys}: the model's rope_parameters are {config.rope_parameters}")
