"""`llmtune eval`: eval loss, perplexity and exact-match accuracy of a run (or of the recipe's base model).

Prompt/answer pairs come from the tokenized eval examples themselves: the prompt is everything
before the first trained token, the answer is the trained text. So exact match works for every
dataset type that masks a prompt (alpaca, chat_template, input_output, custom formats).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError
from llmtune.train.data.formats import IGNORE


@dataclass
class Target:
    recipe: object
    model_dir: str  # what to load: the run folder, or the base model
    adapter_dir: str | None
    result_file: Path
    label: str
    is_run: bool = False  # a trained run's folder (not the recipe's base model)


def resolve_target(target: Path) -> Target:
    from llmtune.recipe import Recipe, load_recipe
    from llmtune.train.model.load import model_source

    if target.is_dir():
        from llmtune.post.generate import refuse_reward_model

        refuse_reward_model(target, "eval")
        plan_file = target / "llmtune" / "plan.json"
        if not plan_file.exists():
            raise UserError(f"{target} is not an llmtune run folder (no llmtune/plan.json)", "pass a run's output_dir")
        recipe = Recipe.model_validate(json.loads(plan_file.read_text())["recipe"])
        adapter = str(target) if (target / "adapter_config.json").exists() else None
        base = model_source(recipe)[0] if adapter else str(target)
        return Target(recipe, base, adapter, target / "eval.json", f"run {target}", is_run=True)
    recipe = load_recipe(target).recipe
    if recipe.num_labels:
        raise UserError(f"{target} trains a reward model: `llmtune eval` measures a causal LM's answers",
                        "the run's own eval (val_set_size) reports eval_accuracy")  # fmt: skip
    return Target(recipe, model_source(recipe)[0], None, Path(recipe.output_dir) / "eval_base.json",
                  f"base model {recipe.base_model}")  # fmt: skip


def eval_examples(recipe, tokenizer, data: Path | None) -> list[dict]:
    from llmtune.train.data.prepare import prepare_data

    if data is not None:
        spec = recipe.datasets[0].model_copy(update={"path": str(data.resolve())})
        recipe = recipe.model_copy(update={"datasets": [spec], "test_datasets": None, "val_set_size": 0.0,
                                           "dataset_prepared_path": None, "sample_packing": False})  # fmt: skip
        return prepare_data(recipe, tokenizer).train
    prepared = prepare_data(recipe.model_copy(update={"sample_packing": False}), tokenizer)
    if not prepared.eval:
        raise UserError("the recipe has no eval data (val_set_size or test_datasets)", "pass --data FILE")
    return prepared.eval


def split_prompt(example: dict, eos_id: int | None) -> tuple[list[int], list[int]] | None:
    labels = example["labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE), None)
    if not first:
        return None  # nothing masked: no prompt to answer
    answer = [t for t in labels[first:] if t != IGNORE and t != eos_id]
    return example["input_ids"][:first], answer


def evaluate(target: Path, data: Path | None = None, batch_size: int = 8, max_new_tokens: int | None = None,
             limit: int | None = None, show: int = 0) -> dict:  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.data.collate import REAL_TOKENS, Collator
    from llmtune.train.model.load import load_tokenizer
    from llmtune.train.runtime.progress import track

    info = resolve_target(target)
    recipe = info.recipe
    tokenizer = load_tokenizer(recipe, info.adapter_dir or info.model_dir)
    from llmtune.post.generate import inference_device

    device, dtype = inference_device()
    from llmtune.train.model import linearize

    model = linearize.from_pretrained(AutoModelForCausalLM, info.model_dir, recipe if info.adapter_dir else None,
                                      dtype=dtype)  # fmt: skip
    if info.adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, info.adapter_dir)
    model.to(device).eval()
    examples = eval_examples(recipe, tokenizer, data)[:limit]
    if recipe.rl:  # preference rows: rewards, margins and accuracy over the pairs
        from llmtune.post.evaluate_preference import preference_eval

        results = preference_eval(info, model, tokenizer, list(examples), batch_size)
        return _write(info, results)
    collate = Collator(tokenizer.pad_token_id)
    total_loss = total_tokens = 0.0
    with torch.no_grad():
        for start in track(range(0, len(examples), batch_size), "eval loss"):
            batch = collate(examples[start : start + batch_size])
            batch.pop(REAL_TOKENS)
            tokens = int((batch["labels"][:, 1:] != IGNORE).sum())
            total_loss += model(**{k: v.to(device) for k, v in batch.items()}).loss.item() * tokens
            total_tokens += tokens
    loss = total_loss / max(total_tokens, 1)
    results = {
        "target": info.label,
        "examples": len(examples),
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50)),
    }
    pairs = [p for p in (split_prompt(e, tokenizer.eos_token_id) for e in examples) if p]
    if pairs:
        results.update(exact_match(model, tokenizer, pairs, batch_size, max_new_tokens, show))
    return _write(info, results)


def _write(info: Target, results: dict) -> dict:
    info.result_file.parent.mkdir(parents=True, exist_ok=True)
    info.result_file.write_text(json.dumps(results, indent=2) + "\n")
    results["written_to"] = str(info.result_file)
    return results


def exact_match(model, tokenizer, pairs, batch_size: int, max_new_tokens: int | None, show: int) -> dict:
    import torch

    from llmtune.train.runtime.progress import log, track

    hits, samples = 0, []
    budget = max_new_tokens or max(len(a) for _, a in pairs) + 8
    pad = tokenizer.pad_token_id
    for start in track(range(0, len(pairs), batch_size), "generating"):
        chunk = pairs[start : start + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])  # left padding for generation
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=budget, do_sample=False,
                                 pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        for (prompt, answer), generated in zip(chunk, out[:, width:].cpu(), strict=True):
            got = tokenizer.decode(generated, skip_special_tokens=True).strip()
            want = tokenizer.decode(answer, skip_special_tokens=True).strip()
            hits += got == want
            if len(samples) < show:
                samples.append(
                    {"prompt": tokenizer.decode(prompt, skip_special_tokens=True)[-80:], "want": want, "got": got}
                )
    for sample in samples:
        log(f"want {sample['want']!r} got {sample['got']!r}")
    return {"exact_match": hits / len(pairs), "exact_match_examples": len(pairs), "samples": samples}
