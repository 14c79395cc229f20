"""`llmtune eval`: eval loss, perplexity and exact-match accuracy of a run (or of the recipe's base model).

Prompt/answer pairs come from the tokenized eval examples themselves: the answer is the last trained
span (a conversation's last assistant turn), the prompt everything before it. So exact match works for
every dataset type that masks a prompt (alpaca, chat_template, input_output, custom formats).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError, reading
from llmtune.train.data.formats import IGNORE


@dataclass
class Target:
    recipe: object
    model_dir: str  # what to load: the run folder, or the base model
    adapter_dir: str | None
    result_file: Path
    label: str
    is_run: bool = False  # a trained model (a run, a checkpoint, --model), not the recipe's base model itself
    note: str | None = None  # something the user should know about what was measured


def resolve_target(target: Path, model: str | None = None) -> Target:
    """What `llmtune eval` measures: a run (its final save, else its newest complete checkpoint), one checkpoint-N of
    a run, a merged folder, the recipe's base model, or (with a recipe) any model folder, adapter or hub id."""
    from llmtune.recipe import load_recipe
    from llmtune.train.model.load import model_source

    if not target.exists():  # said before load_recipe calls it a missing recipe: it may have been a run folder
        raise UserError(f"{target} does not exist",
                        "llmtune eval takes a run's output_dir (or its checkpoint-N, or merged folder) or a recipe file")  # fmt: skip
    if target.is_dir():
        if model is not None:
            raise UserError(f"--model goes with a recipe, and {target} is a folder",
                            f"llmtune eval RECIPE.yaml --model {model}")  # fmt: skip
        return _run_target(target)
    recipe = load_recipe(target).recipe
    if recipe.num_labels:
        raise UserError(f"{target} trains a reward model: `llmtune eval` measures a causal LM's answers",
                        "the run's own eval (val_set_size) reports eval_accuracy")  # fmt: skip
    if model is not None:
        return _model_target(recipe, model, target)
    return Target(recipe, model_source(recipe)[0], None, Path(recipe.output_dir) / "eval_base.json",
                  f"base model {recipe.base_model}")  # fmt: skip


def _run_target(folder: Path) -> Target:
    from llmtune.post.consolidate import PLAN, loadable_weights, run_recipe
    from llmtune.post.generate import refuse_reward_model
    from llmtune.train.model.load import model_source

    weights, run = loadable_weights(folder, "eval")
    refuse_reward_model(run, "eval")
    if weights is None:
        if (folder / "adapter_config.json").exists() or (folder / "config.json").exists():
            what = "an adapter" if (folder / "adapter_config.json").exists() else "a model"
            raise UserError(f"{folder} is {what} without an llmtune run (no {PLAN}): there is no recipe to take "
                            "the eval data and the prompt format from",
                            f"pass the recipe and the model: llmtune eval RECIPE.yaml --model {folder}")  # fmt: skip
        raise UserError(f"{folder} is not an llmtune run folder (no {PLAN})",
                        "pass a run's output_dir, one of its checkpoint-N folders, or a recipe")  # fmt: skip
    recipe = run_recipe(run)
    adapter = str(weights.folder) if weights.kind == "adapter" else None
    base = model_source(recipe)[0] if adapter else str(weights.folder)
    if weights.folder == run:
        return Target(recipe, base, adapter, run / "eval.json", f"run {run}", is_run=True)
    # a checkpoint (asked for, or the newest of a run that never saved its final model): its own result file
    return Target(recipe, base, adapter, run / f"eval-{weights.folder.name}.json", f"{weights.folder.name} of run {run}",
                  is_run=True)  # fmt: skip


def _model_target(recipe, model: str, recipe_file: Path) -> Target:
    """Any model measured on the recipe's eval data: an adapter folder (on the recipe's base model), a model folder,
    or a hub id. A run's folder keeps its eval.json for its own eval split: this one is eval-<recipe>.json."""
    from llmtune.post.generate import check_model_name
    from llmtune.recipe.paths import adapter_trained_on
    from llmtune.train.model.load import model_source

    check_model_name(model, "--model")
    folder = Path(model)
    if folder.is_dir():
        from llmtune.post.consolidate import PLAN

        mine = folder / ("eval.json" if not (folder / PLAN).exists() else f"eval-{recipe_file.stem}.json")
        if (folder / "adapter_config.json").exists():
            base = model_source(recipe)[0]
            named = adapter_trained_on(folder, recipe.base_model)  # another base (by name)
            note = None
            if named:
                note = (f"the adapter says it was trained on {named}; it is measured on the recipe's base_model "
                        f"{recipe.base_model}")  # fmt: skip
            return Target(recipe, base, str(folder), mine, f"adapter {model} on {recipe.base_model}",
                          is_run=True, note=note)  # fmt: skip
        if not (folder / "config.json").exists():
            raise UserError(f"--model {model} has no model (config.json) or adapter (adapter_config.json)",
                            "pass a model folder, an adapter folder or a hub id")  # fmt: skip
        return Target(recipe, str(folder), None, mine, f"model {model}", is_run=True)
    if folder.exists() or folder.suffix in (".yaml", ".yml", ".json"):
        raise UserError(f"--model {model} is not a model folder", "pass a model folder, an adapter folder or a hub id")
    name = model.replace("/", "--")
    return Target(recipe, model, None, Path(recipe.output_dir) / f"eval_{name}.json", f"model {model}", is_run=True)


def eval_examples(recipe, tokenizer, data: Path | None) -> list[dict]:
    from llmtune.train.data.prepare import prepare_data

    if data is not None:
        spec = recipe.datasets[0].model_copy(update={"path": str(data.resolve())})
        recipe = recipe.model_copy(update={"datasets": [spec], "test_datasets": None, "val_set_size": 0.0,
                                           "dataset_prepared_path": None, "sample_packing": False})  # fmt: skip
        return prepare_data(recipe, tokenizer, purpose="eval").train
    prepared = prepare_data(recipe.model_copy(update={"sample_packing": False}), tokenizer)
    if not prepared.eval:
        raise UserError("the recipe has no eval data (val_set_size or test_datasets)", "pass --data FILE")
    return prepared.eval


def split_prompt(example: dict, eos_id: int | None) -> tuple[list[int], list[int]] | None:
    """(prompt, answer) for exact match: the last trained span (a conversation's last answer) given everything before
    it. A span of end-of-sequence tokens alone is no answer: it stays with the answer before it."""
    labels = example["labels"]
    starts = [i for i, label in enumerate(labels) if label != IGNORE and (i == 0 or labels[i - 1] == IGNORE)]
    answers = [i for i in starts if any(t != eos_id for t in labels[i : _span_end(labels, i)])]
    if not answers or answers[-1] == 0:
        return None  # nothing trained, or nothing masked before it: no prompt to answer
    start = answers[-1]
    return example["input_ids"][:start], [t for t in labels[start:] if t != IGNORE and t != eos_id]


def _span_end(labels: list[int], start: int) -> int:
    end = start
    while end < len(labels) and labels[end] != IGNORE:
        end += 1
    return end


def evaluate(target: Path, data: Path | None = None, batch_size: int = 8, max_new_tokens: int | None = None,
             limit: int | None = None, show: int = 0, model: str | None = None) -> dict:  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.data.collate import REAL_TOKENS, Collator
    from llmtune.train.model.load import load_tokenizer
    from llmtune.train.runtime.progress import track

    info = resolve_target(target, model)
    recipe = info.recipe
    if data is not None:  # the result file named for its own split stays that split's: this one names the data
        info.result_file = info.result_file.with_name(f"{info.result_file.stem}-{data.stem}.json")
    if data is None and not recipe.val_set_size and not recipe.test_datasets:  # before the model loads
        raise UserError("the recipe has no eval data (val_set_size or test_datasets)", "pass --data FILE")
    try:
        tokenizer = load_tokenizer(recipe, _tokenizer_source(info))
    except UserError as err:
        if model is None or recipe.tokenizer_config or not err.message.startswith("could not load"):
            raise
        raise UserError(err.message, "check --model, your network or HF_TOKEN; a local folder also works") from None
    from llmtune.post.generate import inference_device

    device, dtype = inference_device()
    from llmtune.train.model import linearize

    try:
        with reading(info.model_dir):
            model = linearize.from_pretrained(AutoModelForCausalLM, info.model_dir, recipe if info.adapter_dir
                                              else None, dtype=dtype, trust_remote_code=recipe.trust_remote_code)  # fmt: skip
    except (OSError, ValueError) as err:
        raise UserError(f"could not load the model '{info.model_dir}' ({str(err).splitlines()[0][:160]})",
                        "check the path or hub id, your network or HF_TOKEN") from None  # fmt: skip
    if info.adapter_dir and (recipe.load_in_4bit or recipe.load_in_8bit):
        info.note = "; ".join(filter(None, [info.note, unquantized_note(recipe, dtype)]))
    if info.adapter_dir:
        from peft import PeftModel

        from llmtune.post.generate import fit_embeddings

        fit_embeddings(model, tokenizer, recipe)
        with reading(info.adapter_dir):
            model = PeftModel.from_pretrained(model, info.adapter_dir)
    model.to(device).eval()
    from llmtune.recipe.preference import ONLINE_METHODS

    if recipe.rl in ONLINE_METHODS:  # its measure is the reward of what it generates (post/evaluate_online.py)
        from llmtune.post.evaluate_online import online_eval, recipe_folder
        from llmtune.recipe.online import user_functions

        folder = recipe_folder(info, target)
        os.environ.setdefault("LLMTUNE_RECIPE_DIR", str(folder or Path.cwd()))
        rows = list(eval_examples(recipe, tokenizer, data)[:limit])
        return _write(info, online_eval(info, model, tokenizer, rows, batch_size, max_new_tokens,
                                        user_functions(recipe, folder)))  # fmt: skip
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
        "eval_loss": loss,  # the mean over every label token (the Trainer's eval_loss is a mean of batch means)
        "eval_tokens": int(total_tokens),
        "perplexity": math.exp(min(loss, 50)),
    }
    pairs = [p for p in (split_prompt(e, tokenizer.eos_token_id) for e in examples) if p]
    if pairs:
        results.update(exact_match(model, tokenizer, pairs, batch_size, max_new_tokens, show))
    return _write(info, results)


def unquantized_note(recipe, dtype) -> str:
    """Eval loads the base of a QLoRA (or 8-bit) run unquantized: the figure is that model's, not the one trained."""
    bits = 4 if recipe.load_in_4bit else 8
    return (f"the base model was measured unquantized ({str(dtype).removeprefix('torch.')}), while training used it "
            f"in {bits} bits: the eval loss differs from the run's own eval_loss by the quantization error")  # fmt: skip


def _tokenizer_source(info: Target) -> str:
    """The tokenizer saved beside the weights (an adapter's or a checkpoint's), else the base model's."""
    from llmtune.post.consolidate import has_tokenizer
    from llmtune.train.model.load import model_source

    for folder in (info.adapter_dir, info.model_dir):
        if has_tokenizer(folder):
            return folder
    return info.model_dir if not Path(info.model_dir).is_dir() else model_source(info.recipe)[0]


def _write(info: Target, results: dict) -> dict:
    if info.note:
        results["note"] = info.note
    from llmtune.plan.files import atomic_write

    atomic_write(info.result_file, json.dumps(results, indent=2) + "\n")
    results["written_to"] = str(info.result_file)
    return results


def exact_match(model, tokenizer, pairs, batch_size: int, max_new_tokens: int | None, show: int) -> dict:
    from llmtune.post.generate import Sampling, generate_ids
    from llmtune.train.runtime.progress import log, track

    hits, samples = 0, []
    budget = max_new_tokens or max(len(a) for _, a in pairs) + 8
    options = Sampling(budget).kwargs(tokenizer, model)  # greedy
    for start in track(range(0, len(pairs), batch_size), "generating"):
        chunk = pairs[start : start + batch_size]
        made = generate_ids(model, tokenizer, [prompt for prompt, _ in chunk], options)
        for (prompt, answer), generated in zip(chunk, made, strict=True):
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
