"""The training report's preference part (`rl:` runs): TRL's reward margin and accuracy per step, drawn as a panel
under the loss, and a summary section with the method, beta, the reference and the first and last logged values.

TRL logs them in log_history as `rewards/margins` and `rewards/accuracies` (eval entries with an `eval_` prefix);
KTO logs no accuracy, and skips the margin in a logging window that held only desirable (or undesirable) rows.
"""

from __future__ import annotations

METHODS = {"dpo": "DPO", "ipo": "IPO", "orpo": "ORPO", "kto": "KTO", "simpo": "SimPO", "grpo": "GRPO", "gdpo": "GDPO"}
ONLINE = ("grpo", "gdpo")  # GRPO logs its reward (mean over the generations) where DPO logs a margin
REFERENCE_FREE = ("orpo", "simpo")
SERIES = {"margin": "rewards/margins", "accuracy": "rewards/accuracies"}
REFERENCES = {  # what llmtune.train.rl.trainers.reference_report recorded, in words
    "adapter_disabled": "the base model with the adapter switched off (no second copy)",
    "adapter_copy": "the starting adapter (lora_model_dir), copied and frozen",
    "precomputed": "its log-probs, computed once before training (no model kept)",
    "none": "none (a reference-free method)",
}


def _series(history: list[dict], key: str) -> dict:
    points = [e for e in history if "step" in e and isinstance(e.get(key), int | float)]
    return {"step": [e["step"] for e in points], "value": [float(e[key]) for e in points]}


def preference_curves(history: list[dict]) -> dict | None:
    """Margin and accuracy, train and eval, each with its own steps; None when TRL logged no margin (an SFT run,
    whose curves.json then stays as it was)."""
    data = {name: {"train": _series(history, key), "eval": _series(history, "eval_" + key)}
            for name, key in SERIES.items()}  # fmt: skip
    margin = data["margin"]
    if margin["train"]["step"] or margin["eval"]["step"]:
        return data
    reward = {"train": _series(history, "reward"), "eval": _series(history, "eval_reward")}
    if reward["train"]["step"]:  # GRPO: its mean reward, in the same panel
        empty = {"step": [], "value": []}
        return {"margin": reward, "accuracy": {"train": empty, "eval": empty}, "kind": "reward"}
    return None


def plot_preference(axis, data: dict) -> None:
    """The margin on `axis`, the accuracy (0 to 1) on a twin axis when the method logs one."""
    margin, accuracy = data["margin"], data["accuracy"]
    what = "reward" if data.get("kind") == "reward" else "reward margin"  # GRPO's mean reward, or DPO's margin
    axis.plot(margin["train"]["step"], margin["train"]["value"], label=f"train {what}", color="tab:purple")
    if margin["eval"]["step"]:
        axis.plot(margin["eval"]["step"], margin["eval"]["value"], "o-", label=f"eval {what}", color="tab:red")
    if what == "reward margin":
        axis.axhline(0.0, color="black", linewidth=0.8, alpha=0.5)  # above it, the chosen reply scores higher
    axis.set_xlabel("step")
    axis.set_ylabel(what)
    axis.grid(alpha=0.3)
    lines, labels = axis.get_legend_handles_labels()
    if accuracy["train"]["step"] or accuracy["eval"]["step"]:
        second = axis.twinx()
        second.plot(accuracy["train"]["step"], accuracy["train"]["value"], "--", color="tab:gray",
                    label="train reward accuracy")  # fmt: skip
        if accuracy["eval"]["step"]:
            second.plot(accuracy["eval"]["step"], accuracy["eval"]["value"], "s--", color="tab:brown",
                        label="eval reward accuracy")  # fmt: skip
        second.set_ylim(-0.05, 1.05)
        second.set_ylabel("reward accuracy")
        more_lines, more_labels = second.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    axis.legend(lines, labels, loc="best")


def recipe_beta(recipe: dict) -> tuple[float | None, str | None]:
    """TRL's beta from the recipe copy and the key it came from, in the order llmtune.recipe.preference.beta reads
    them (trl.beta, then ORPO's orpo_alpha, then rl_beta)."""
    candidates = [("trl.beta", (recipe.get("trl") or {}).get("beta"))]
    if recipe.get("rl") == "orpo":
        candidates.append(("orpo_alpha", recipe.get("orpo_alpha")))
    candidates.append(("rl_beta", recipe.get("rl_beta")))
    return next(((value, key) for key, value in candidates if value is not None), (None, None))


def _beta(recipe: dict, block: dict) -> str:
    value, key = recipe_beta(recipe)
    if value is not None:
        return f"{value} ({key})"
    if block.get("beta") is not None:  # no recipe copy: the worker's record
        return f"{block['beta']}"
    return "not set (TRL's default)"


def _reference(method: str, metrics: dict, block: dict) -> str:
    kind = block.get("reference")
    if kind is None:
        return REFERENCES["none"] if method in REFERENCE_FREE else "not recorded (metrics.json has no preference block)"
    if kind in REFERENCES:
        return REFERENCES[kind]
    stage = next((r.get("reference_zero_stage") for r in metrics.get("ranks") or [] if "reference" in r), None)
    return f"a frozen copy of the model ({kind}" + (f", ZeRO stage {stage})" if stage is not None else ")")


def _ends(series: dict, fallback: tuple[float | None, float | None] = (None, None)) -> tuple[str, str]:
    """The first and the last logged value, with its step; the preference block's numbers when history has none."""
    if series["step"]:
        return tuple(f"{series['value'][i]:.4f} (step {series['step'][i]})" for i in (0, -1))
    return tuple("not logged" if v is None else f"{v:.4f}" for v in fallback)


def preference_section(metrics: dict, recipe: dict, data: dict | None) -> str:
    """The summary's `## Preference` section; empty for a run that is not a preference run."""
    block = metrics.get("preference") or {}
    method = recipe.get("rl") or block.get("method")
    if not method:
        return ""
    if method in ONLINE:
        return _online_section(method, recipe, block)
    empty = {"step": [], "value": []}  # a preference run with no logged margin still says what it was
    data = data or {name: {"train": empty, "eval": empty} for name in SERIES}
    rows = [("method", METHODS.get(method, method)), ("beta", _beta(recipe, block)),
            ("reference", _reference(method, metrics, block))]  # fmt: skip
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    first, last = block.get("first") or {}, block.get("last") or {}
    values = []
    for name, key in SERIES.items():
        values.append((f"reward {name} (train)", _ends(data[name]["train"], (first.get(key), last.get(key)))))
        if data[name]["eval"]["step"]:
            values.append((f"reward {name} (eval)", _ends(data[name]["eval"])))
    logged = "\n".join(f"| {k} | {a} | {b} |" for k, (a, b) in values)
    note = "The margin is the chosen replies' mean reward minus the rejected ones' (`rewards/margins`)" + (
        "; KTO's rows are not pairs, so it logs no accuracy" if method == "kto"
        else ", the accuracy the share of pairs whose chosen reply scores higher (`rewards/accuracies`)")  # fmt: skip
    return (
        f"## Preference\n\n| | |\n| --- | --- |\n{table}\n\n"
        f"| TRL metric | first logged | last logged |\n| --- | --- | --- |\n{logged}\n\n"
        f"{note}. The loss plot shows them per step in a panel below the loss.\n\n"
    )


def _online_section(method: str, recipe: dict, block: dict) -> str:
    """GRPO's summary: the method, its rewards and their aggregation, and TRL's numbers at the first and last step."""
    trl = recipe.get("trl") or {}
    aggregation = trl.get("multi_objective_aggregation") or ("normalize_then_sum" if method == "gdpo" else
                                                             "sum_then_normalize")  # fmt: skip
    rows = [("method", METHODS[method]), ("beta (KL weight)", _beta(recipe, block)),
            ("reward functions", ", ".join(trl.get("reward_funcs") or []) or "not recorded"),
            ("aggregation", aggregation), ("completions per prompt", trl.get("num_generations", 8))]  # fmt: skip
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    first, last = block.get("first") or {}, block.get("last") or {}
    keys = [k for k in last if k == "reward" or k.startswith(("rewards/", "completions/mean_length",
                                                              "completions/clipped_ratio", "kl"))]  # fmt: skip
    logged = "\n".join(f"| {k} | {first.get(k, float('nan')):.4f} | {last[k]:.4f} |" for k in keys)
    return (
        f"## Online RL\n\n| | |\n| --- | --- |\n{table}\n\n"
        f"| TRL metric | first logged | last logged |\n| --- | --- | --- |\n{logged}\n\n"
        "The loss plot shows the mean reward per step in a panel below the loss; sample completions with each "
        "function's reward are in completions.jsonl.\n\n"
    )
