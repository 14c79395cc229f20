"""`llmtune preprocess --debug`: the first examples as spans of trained (+) and masked (-) tokens, read from the same
tokenization a run trains on."""

from __future__ import annotations

import json

from recipe_edits import DROP
from tiny import TOKENIZER_DIR, write_jsonl

from llmtune.train.data.formats import IGNORE
from llmtune.train.data.show import spans


def test_spans_are_runs_of_trained_or_masked_tokens():
    assert spans([5, 6, 7, 8, 9], [IGNORE, IGNORE, 7, 8, IGNORE]) == [(False, [5, 6]), (True, [7, 8]), (False, [9])]
    assert spans([], []) == []


def test_preprocess_debug_shows_what_each_format_trains(run_cli, write_recipe, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "Four."}, {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "Six."}]}])  # fmt: skip
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Name a colour", "input": "", "output": "Red"}])
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "datasets": [{"path": str(chat), "type": "chat_template"}],
                           "test_datasets": [{"path": str(alpaca), "type": "alpaca"}],
                           "dataset_prepared_path": str(tmp_path / "prep")})  # fmt: skip
    done = run_cli("preprocess", recipe, "--debug")
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("train example 1 of 1:")))
    shown = [(line.split()[0], int(line.split()[1]), json.loads(line.split(maxsplit=2)[2]))
             for line in lines[start + 1 : start + 6]]  # fmt: skip
    # assistant turns (and their turn end) train; system, user and the template's scaffolding don't
    assert [(sign, text) for sign, _, text in shown] == [
        ("-", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        ("+", "Four.<|im_end|>"), ("-", "\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"),
        ("+", "Six.<|im_end|>"), ("-", "\n")]  # fmt: skip
    header = lines[start].split(": ")[1]
    assert header == f"{sum(n for _, n, _ in shown)} tokens, {sum(n for s, n, _ in shown if s == '+')} trained"
    eval_lines = lines[lines.index(next(line for line in lines if line.startswith("eval example 1 of 1:"))) + 1 :]
    assert eval_lines[0].startswith("  - ") and eval_lines[0].endswith('### Response:\\n"')  # alpaca: the answer
    assert eval_lines[1] == '  +    3 "Red<|im_end|>"' and not eval_lines[2].startswith("  ")  # and eos, only
    text_only = run_cli("preprocess", recipe, "--debug", "--debug-text-only").out  # a cache hit: the same spans
    assert '  + "Four.<|im_end|>"' in text_only and "cache hit" in text_only


def test_preprocess_counts_each_dataset_and_warns_of_an_empty_one(run_cli, write_recipe, tmp_path):
    rows = write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"say {i}", "input": "", "output": "ok"} for i in range(3)])
    (tmp_path / "empty.jsonl").write_text("")
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "dataset_prepared_path": "",
                           "datasets": [{"path": str(rows), "type": "alpaca"},
                                        {"path": str(tmp_path / "empty.jsonl"), "type": "alpaca"}]})  # fmt: skip
    done = run_cli("preprocess", recipe)
    assert done.code == 0, done.err
    assert "  datasets[0]: 3 rows, 3 examples" in done.out and "  datasets[1]: 0 rows, 0 examples" in done.out
    assert f"warning: datasets[1] ({tmp_path / 'empty.jsonl'}) has no rows" in done.err
    # rows, but no example trains a token (roles_to_train naming a role no row has): said too (it was silent)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "yo"}]}] * 2)  # fmt: skip
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "dataset_prepared_path": "", "chat_template": "chatml",
                           "datasets": [{"path": str(rows), "type": "alpaca"}, {"path": str(chat), "type":
                                        "chat_template", "roles_to_train": ["asistant"]}]})  # fmt: skip
    done = run_cli("preprocess", recipe)
    assert done.code == 0, done.err
    assert (f"warning: datasets[1] ({chat}): none of its 2 rows gave an example (2 without trained tokens; "
            "roles_to_train: ['asistant']): the run trains on the other datasets only") in done.err, done.err  # fmt: skip


def test_preprocess_names_what_each_dataset_lost_and_a_custom_answer_field_no_row_has(run_cli, write_recipe, tmp_path):
    """Deduplication and min_sample_len drops are counted in all and against the dataset each dropped example came
    from (preprocess listed neither); a custom format whose field_output no row holds is refused (each example
    would train nothing: Axolotl trains nothing for an empty answer)."""
    same = {"text": "one two three four five"}
    first = write_jsonl(tmp_path / "a.jsonl", [same, same, {"text": "hi"}, {"text": "six seven eight nine ten"}])
    second = write_jsonl(tmp_path / "b.jsonl", [same, {"text": "eleven twelve thirteen fourteen"}])
    short = write_jsonl(tmp_path / "c.jsonl", [{"text": "yo"}])
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "dataset_prepared_path": "", "min_sample_len": 4,
                           "dataset_exact_deduplication": True, "datasets": [
                               {"path": str(path), "type": "completion"} for path in (first, second, short)]})  # fmt: skip
    done = run_cli("preprocess", recipe)
    assert done.code == 0, done.err
    # a dataset that gives nothing is said with what dropped its rows (it said "no trained tokens" for any cause)
    assert (f"warning: datasets[2] ({short}): none of its 1 rows gave an example (1 shorter than min_sample_len 4 "
            "dropped): the run trains on the other datasets only") in done.err, done.err  # fmt: skip
    assert "  dropped_too_short: 2" in done.out and "  dropped_duplicates: 2" in done.out, done.out
    assert ("  datasets[0]: 4 rows, 2 examples (1 shorter than min_sample_len 4 dropped, 1 exact duplicates dropped"
            ")") in done.out, done.out
    assert "  datasets[1]: 2 rows, 1 examples (1 exact duplicates dropped)" in done.out
    rows = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "answer": "4"}] * 2)
    form = {"field_instruction": "question", "field_output": "response", "format": "Q: {instruction} A:"}
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "dataset_prepared_path": "",
                           "datasets": [{"path": str(rows), "type": form}]})  # fmt: skip
    done = run_cli("preprocess", recipe)
    assert done.code == 2 and len(done.err.strip().splitlines()) == 1, done.err
    assert ("datasets[0]" in done.err and "field_output 'response' is in none of its 2 rows" in done.err
            and "its rows have: question, answer" in done.err), done.err  # fmt: skip
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "dataset_prepared_path": "", "train_on_inputs": True,
                           "datasets": [{"path": str(rows), "type": form}]})  # fmt: skip
    assert run_cli("preprocess", recipe).code == 0  # the prompt trains: a completion-style format, answer or not


def test_a_pretraining_dataset_row_error_names_that_key_and_the_text_field_to_set(run_cli, write_recipe, tmp_path):
    """pretraining_dataset entries train as completion datasets: a row's error named datasets[0], which the recipe
    doesn't have, and hinted at 'type/fields'."""
    rows = write_jsonl(tmp_path / "c.jsonl", [{"content": "hello world"}])
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "datasets": DROP, "pretraining_dataset": str(rows),
                           "max_steps": 2, "dataset_prepared_path": ""})  # fmt: skip
    done = run_cli("preprocess", recipe)
    assert done.code == 2, done.err
    assert done.err.strip().splitlines()[-1] == (
        f"error: {rows} line 1: missing field 'text' (row has: content) (pretraining_dataset[0].type is completion) "
        "(hint: set pretraining_dataset[0].field (Axolotl's text_column) to the field that holds the text)")


def test_a_reward_model_s_scored_positions_say_their_class(run_cli, write_recipe, tmp_path):
    """A process reward model's labels are classes read at each step's end, not tokens to predict: --debug says
    which label each scored position carries (it showed `+ 1 "\\n"`, as if the newline were trained)."""
    rows = write_jsonl(tmp_path / "prm.jsonl", [{"prompt": "What is 2+3*4?", "completions": ["3*4=12", "2+12=15"],
                                                 "labels": [True, False]}])  # fmt: skip
    recipe = write_recipe({"base_model": str(TOKENIZER_DIR), "process_reward_model": True,
                           "datasets": [{"path": str(rows), "type": "stepwise_supervised"}],
                           "dataset_prepared_path": str(tmp_path / "prep")})  # fmt: skip
    done = run_cli("preprocess", recipe, "--debug")
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("train example 1 of 1:")))
    assert lines[start].endswith(", 2 scored positions"), lines[start]
    scored = [line.split("<- ", 1)[1] for line in lines[start + 1 : start + 5] if line.lstrip().startswith("+")]
    assert scored == ["step label 1", "step label 0"], lines[start : start + 5]


def test_the_data_line_says_when_the_rows_cant_fill_one_global_batch_on_several_ranks():
    """1 row, 2 ranks, global batch 4: accelerate filled each rank's batch with copies of it, without a word."""
    from pathlib import Path

    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.counts import data_line

    recipe = recipe_from_mapping({"base_model": "org/m", "datasets": [{"path": "org/d", "type": "alpaca"}]},
                                 Path("r.yaml"), check_files=False).recipe  # fmt: skip
    stats = {"train_examples": 1, "eval_examples": 0, "cache_hit": False, "train_rows": 1, "dropped_too_long": 0,
             "dropped_no_labels": 0}  # fmt: skip
    ddp = {"global_batch_size": 4, "data_parallel_size": 2, "strategy": "ddp"}
    line = data_line(recipe, stats, ddp)
    assert line.startswith("data: 1 train / 0 eval examples (tokenized; 0 longer than sequence_len dropped, 0 without")
    assert "note: 1 training row(s) don't fill one global batch of 4: each rank's batch is filled by repeating" in line
    assert "note" not in data_line(recipe, {**stats, "train_rows": 4}, ddp)
    assert "note" not in data_line(recipe, stats, {**ddp, "data_parallel_size": 1})  # one process: a smaller batch
