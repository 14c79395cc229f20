"""val_set_size and shuffle_merged_datasets pick the rows Axolotl picks: datasets' shuffle(seed) permutation, then
train_test_split(test_size, shuffle=False), which takes the last ceil(test_size x n) rows for eval; and `llmtune eval`
measures that split into the run's eval.json (other data, other models, in files of their own), saying what differs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from tiny import make_tiny_model, write_jsonl

from llmtune.recipe.mixing import merged_order
from llmtune.train.data.base import split_eval


@pytest.mark.parametrize(("rows", "size"), [(16, 0.2), (25, 0.1), (16, 0.15), (10, 0.5), (30, 4)])
def test_the_eval_rows_are_the_ones_datasets_train_test_split_takes(rows, size):
    """It took the first round(f x n) rows: 3 of 16 at 0.2 (rows 0-2) where Axolotl evaluates on 4 (rows 12-15)."""
    from datasets import Dataset

    data = Dataset.from_dict({"i": list(range(rows))})
    theirs = data.train_test_split(test_size=size, shuffle=False)
    evaluation, train = split_eval(list(range(rows)), size)
    assert (evaluation, train) == (theirs["test"]["i"], theirs["train"]["i"])


@pytest.mark.parametrize("seed", [42, 0, 7])
def test_the_merged_rows_are_shuffled_as_datasets_shuffles_them(seed):
    from datasets import Dataset

    data = Dataset.from_dict({"i": list(range(50))})
    assert (
        merged_order(
            50,
            SimpleNamespace(seed=seed, shuffle_merged_datasets=True, curriculum_sampling=False, dataset_shard_num=None),
        )
        == data.shuffle(seed=seed)["i"]
    )


def lora_run(tmp_path, **changes):
    """A run folder (a random LoRA adapter on a tiny base, its plan) with an alpaca eval split, and its recipe file."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = make_tiny_model(tmp_path / "base")
    rows = [{"instruction": f"Repeat {w}", "output": w} for w in "red green blue pink gold grey teal navy".split()]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    write_jsonl(tmp_path / "held_out.jsonl", rows[:3])
    model = AutoModelForCausalLM.from_pretrained(base)
    run = tmp_path / "run"
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(run)
    recipe = {"base_model": str(base), "datasets": [{"path": str(data), "type": "alpaca"}], "val_set_size": 0.25,
              "adapter": "lora", "sequence_len": 128, "output_dir": str(run),
              "dataset_prepared_path": str(tmp_path / "prep"), **changes}  # fmt: skip
    (run / "llmtune").mkdir()
    (run / "llmtune" / "plan.json").write_text(json.dumps({"recipe": recipe, "plan": {"precision": "fp32"}}))
    (tmp_path / "other.yaml").write_text(yaml.safe_dump({**recipe, "output_dir": str(tmp_path / "other")}))
    return run


def test_eval_on_other_data_or_of_a_run_as_another_recipes_model_keeps_the_runs_eval_json(tmp_path):
    # `eval RUN --data OTHER` and `eval RECIPE --model RUN` both replaced RUN/eval.json, the run's own split's figure
    from llmtune.post.evaluate import evaluate

    run = lora_run(tmp_path)
    own = evaluate(run, max_new_tokens=2)
    assert own["written_to"] == str(run / "eval.json") and own["examples"] == 2
    kept = (run / "eval.json").read_text()
    other = evaluate(run, tmp_path / "held_out.jsonl", max_new_tokens=2)
    assert other["written_to"] == str(run / "eval-held_out.json") and other["examples"] == 3
    as_model = evaluate(tmp_path / "other.yaml", max_new_tokens=2, model=str(run))
    assert as_model["written_to"] == str(run / "eval-other.json")
    assert (run / "eval.json").read_text() == kept
    assert json.loads((run / "eval-held_out.json").read_text())["examples"] == 3


def test_eval_of_a_qlora_run_says_its_base_was_measured_unquantized(tmp_path):
    # the figure differed from the run's own eval_loss (6.2301 against 6.2234), with no word why
    from llmtune.post.evaluate import evaluate

    run = lora_run(tmp_path, adapter="qlora", load_in_4bit=True)
    note = evaluate(run, max_new_tokens=2)["note"]
    assert "measured unquantized (float32), while training used it in 4 bits" in note
    assert "differs from the run's own eval_loss" in note
    assert json.loads((run / "eval.json").read_text())["note"] == note
    assert "note" not in evaluate(lora_run(tmp_path / "plain"), max_new_tokens=2)


def test_eval_of_a_missing_path_names_it_and_what_eval_takes(run_cli, tmp_path):
    # it said "recipe file not found: out/nonexist" of what may have been meant as a run folder
    result = run_cli("eval", str(tmp_path / "out" / "nonexist"))
    assert result.code == 2
    assert (f"error: {tmp_path / 'out' / 'nonexist'} does not exist (hint: llmtune eval takes a run's output_dir "
            "(or its checkpoint-N, or merged folder) or a recipe file)") in result.err  # fmt: skip
