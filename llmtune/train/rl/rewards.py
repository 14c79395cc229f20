"""The recipe's reward functions as TRL's GRPO calls them, with llmtune's checks around each call.

TRL calls `reward(prompts=..., completions=..., completion_ids=..., <the rows' other columns>, trainer_state=...)`
for a batch and expects one number (or None) per completion. A function that raises, or returns the wrong count or
a non-number, stops the run with one line naming the function and the prompt index (found by calling it again row
by row); its traceback goes to <output_dir>/llmtune/logs/reward-error.txt, and to the console with --verbose.
Checkpoints written so far stay as they are.

Samples: every logging step, the first `num_completions_to_print` completions of the batch (prompt, completion and
each function's reward) go to <output_dir>/completions.jsonl, instead of TRL's console table.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from numbers import Number
from pathlib import Path

from llmtune.errors import UserError


class RewardFunctionError(UserError):
    pass


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # chat messages
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in value if isinstance(m, dict))
    return str(value)


class Samples:
    """Shared by the wrappers of one run: each adds its rewards for the batch; the last one writes the samples."""

    def __init__(self, output_dir: Path, names: list[str], every: int, count: int, last: str | None = None) -> None:
        self.path = Path(output_dir) / "completions.jsonl"
        self.names, self.every, self.count = names, max(1, every), count
        self.last = last or names[-1]  # the last function TRL calls that llmtune wraps (not a reward model)
        self.pending: dict[str, list] = {}
        self.trainer = None

    def add(self, name: str, prompts, completions, rewards) -> None:
        self.pending[name] = rewards
        if name != self.last or self.trainer is None or not self.count:
            return
        step = self.trainer.state.global_step + 1
        if (step - 1) % self.every or int(os.environ.get("RANK", 0)):
            self.pending = {}
            return
        with open(self.path, "a", encoding="utf-8") as out:
            for i in range(min(self.count, len(completions))):
                out.write(json.dumps({"step": step, "prompt": _text(prompts[i]), "completion": _text(completions[i]),
                                      "rewards": {n: self.pending.get(n, [None] * (i + 1))[i] for n in self.names}})
                          + "\n")  # fmt: skip
        self.pending = {}


def _bad(value) -> bool:
    return value is not None and (not isinstance(value, Number) or isinstance(value, complex)
                                  or (isinstance(value, float) and math.isinf(value)))  # fmt: skip


def wrap(function, name: str, samples: Samples | None, error_file: Path):
    """`function` as TRL calls it, checked."""

    def reward(prompts, completions, **kwargs):
        try:
            values = function(prompts=prompts, completions=completions, **kwargs)
        except Exception as err:
            index = _first_failing(function, prompts, completions, kwargs)
            _save(error_file, name, index)
            raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {err} (prompt index "
                                      f"{index} of the batch: {_text(prompts[index])[:80]!r})",
                                      f"fix the function; its traceback is in {error_file}") from None  # fmt: skip
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardFunctionError(f"reward function {name} returned {count} for {len(completions)} completions "
                                      f"(prompt index 0: {_text(prompts[0])[:80]!r})",
                                      "return a list with one number (or None) per completion")  # fmt: skip
        wrong = next((i for i, v in enumerate(values) if _bad(v)), None)
        if wrong is not None:
            raise RewardFunctionError(f"reward function {name} returned {values[wrong]!r} for prompt index {wrong} "
                                      f"({_text(prompts[wrong])[:80]!r}): not a number",
                                      "return a float (or None when the function doesn't apply)")  # fmt: skip
        if samples is not None:
            samples.add(name, prompts, completions, list(values))
        return list(values)

    reward.__name__ = getattr(function, "__name__", name)  # TRL names its rewards/<name>/mean metric after it
    return reward


def _first_failing(function, prompts, completions, kwargs) -> int:
    for i in range(len(completions)):
        single = {k: ([v[i]] if isinstance(v, list) and len(v) == len(completions) else v) for k, v in kwargs.items()}
        try:
            function(prompts=[prompts[i]], completions=[completions[i]], **single)
        except Exception:
            return i
    return 0


def _save(path: Path, name: str, index: int) -> None:
    text = f"reward function {name}, prompt index {index}:\n{traceback.format_exc()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        pass
    if os.environ.get("LLMTUNE_VERBOSE") == "1":
        print(text, file=sys.stderr, flush=True)


def reward_functions(recipe, functions: dict, output_dir: Path) -> tuple[list, Samples]:
    """TRL's reward_funcs: the user's functions wrapped, reward models as their path or hub id."""
    from llmtune.recipe.online import reward_names, trl_value

    names = reward_names(recipe)
    count = trl_value(recipe, "num_completions_to_print")
    count = (count if count is not None else 3) if trl_value(recipe, "log_completions", True) else 0
    wrapped = [i for i in range(len(names)) if functions.get(f"trl.reward_funcs[{i}]")]
    # a reward model (a folder or hub id) is TRL's to load, place and call: its metric is rewards/<its name>/mean,
    # and its value in completions.jsonl is null (llmtune sees the functions' values, not the model's)
    short = [n.rsplit(".", 1)[-1] if i in wrapped else Path(n).name for i, n in enumerate(names)]
    samples = Samples(output_dir, short, recipe.logging_steps or 1, int(count) if wrapped else 0,
                      last=short[wrapped[-1]] if wrapped else None)  # fmt: skip
    error_file = Path(output_dir) / "llmtune" / "logs" / "reward-error.txt"
    out = []
    for index, name in enumerate(names):
        function = functions.get(f"trl.reward_funcs[{index}]")
        out.append(wrap(function, short[index], samples, error_file) if function else name)
    return out, samples
