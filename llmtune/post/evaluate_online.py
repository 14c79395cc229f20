"""`llmtune eval` of an online-RL run (rl: grpo | gdpo): its measure is the reward, not a loss.

Each eval prompt gets one greedy completion (up to trl.max_completion_length tokens, or --max-new-tokens), which
the recipe's reward functions score as TRL's GRPO calls them: the prompt and completion (chat messages for a
conversational prompt), the row's other columns, one value or None per completion. The result is each function's
mean over the completions it scored, and their weighted sum (trl.reward_weights) as `reward`, TRL's own metric
names. Reward models (a folder or hub id in trl.reward_funcs) score in training only; eval names them as left out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmtune.errors import UserError


def recipe_folder(info, target: Path) -> Path | None:
    """Where the recipe's own Python files are: beside the recipe a run was trained from (its plan says which), or
    beside the recipe given to eval."""
    plan = info.result_file.parent / "llmtune" / "plan.json"
    if info.is_run and plan.is_file():
        try:
            path = json.loads(plan.read_text()).get("recipe_path")
        except (OSError, ValueError):
            path = None
        if path and Path(path).is_file():
            return Path(path).resolve().parent
    return target.resolve().parent if target.is_file() else None


def _completions(model, tokenizer, prompts: list, batch_size: int, max_new_tokens: int) -> list[str]:
    from llmtune.post.generate import Sampling, generate_texts
    from llmtune.train.data.templates import template_kwargs

    texts = [p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True,
                                                                        **template_kwargs(tokenizer))
             for p in prompts]  # fmt: skip
    options = Sampling(max_new_tokens).kwargs(tokenizer, model)  # greedy
    out = []
    for start in range(0, len(texts), batch_size):
        out += generate_texts(model, tokenizer, texts[start : start + batch_size], options)
    return out


def online_eval(info, model, tokenizer, rows: list[dict], batch_size: int, max_new_tokens: int | None,
                functions: dict) -> dict:  # fmt: skip
    """The mean reward of each function over one greedy completion per eval prompt, and their weighted sum."""
    from llmtune.recipe.online import reward_names, trl_value
    from llmtune.train.rl.rewards import reward_functions

    recipe = info.recipe
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokens = max_new_tokens or int(trl_value(recipe, "max_completion_length", 512))
    prompts = [row["prompt"] for row in rows]
    texts = _completions(model, tokenizer, prompts, batch_size, tokens)
    completions = [
        t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(prompts, texts, strict=True)
    ]
    columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"} if rows else {}
    wrapped, _ = reward_functions(recipe, functions, info.result_file.parent)
    names, weights = reward_names(recipe), trl_value(recipe, "reward_weights") or [1.0] * len(reward_names(recipe))
    results: dict = {"target": info.label, "method": recipe.rl, "examples": len(rows), "max_new_tokens": tokens}
    total = [0.0] * len(rows)
    scored = [False] * len(rows)
    left_out = []
    for name, function, weight in zip(names, wrapped, weights, strict=True):
        if isinstance(function, str):  # a reward model: TRL's to load and call in training
            left_out.append(name)
            continue
        values = function(prompts=prompts, completions=completions, completion_ids=None, trainer_state=None,
                          **columns)  # fmt: skip
        kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        results[f"rewards/{function.__name__}/mean"] = sum(kept) / len(kept) if kept else None
        for i, value in enumerate(values):
            if value is not None and not math.isnan(float(value)):
                total[i] += weight * float(value)
                scored[i] = True
    if left_out and len(left_out) == len(names):
        raise UserError(f"every reward in trl.reward_funcs is a reward model ({', '.join(left_out)}), which llmtune "
                        "eval doesn't load", "read the eval reward that training logged (metrics.json, eval_reward)")  # fmt: skip
    counted = [t for t, s in zip(total, scored, strict=True) if s]
    results["reward"] = sum(counted) / len(counted) if counted else None
    if left_out:
        results["note"] = f"reward models left out of eval (scored in training only): {', '.join(left_out)}"
    results["samples"] = [{"prompt": p if isinstance(p, str) else p[-1].get("content"), "completion": t}
                          for p, t in zip(prompts[:3], texts[:3], strict=True)]  # fmt: skip
    return results
