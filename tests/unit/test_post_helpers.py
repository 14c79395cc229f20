"""Pure helpers behind infer and the report: prompt files and the plotted curves."""

from __future__ import annotations

import json

import pytest

from llmtune.errors import UserError
from llmtune.post.generate import Sampling, read_prompts
from llmtune.post.report import curves


def test_prompt_files_in_every_accepted_shape(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a"}, "b", {"instruction": "c", "input": "d"},
            {"messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "reference"}]}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    prompts = [p for _, p in read_prompts(path)]
    assert prompts == ["a", "b", "c\n\nd", [{"role": "user", "content": "e"}]]
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo\n")
    assert [p for _, p in read_prompts(text)] == ["one", "two"]
    array = tmp_path / "p.json"  # a JSON array of the same rows (it was read line by line, as text prompts)
    array.write_text(json.dumps(rows, indent=2))
    assert [p for _, p in read_prompts(array)] == prompts
    upper = tmp_path / "P.JSONL"
    upper.write_text(path.read_text())
    assert [p for _, p in read_prompts(upper)] == prompts


@pytest.mark.parametrize(("body", "message"), [
    ('{"prompt": "ok"}\n{"oops": 1}\n', "p.jsonl line 2: no 'prompt'"),
    ('{"prompt": "ok"}\nnot json\n', "p.jsonl line 2: not valid JSON"),
    ("\n\n", "has no prompts"),
    ("[1, 2]\n", "p.jsonl line 1: expected an object"),
    ('{"messages": ["hi"]}\n', r"p.jsonl line 1: messages\[0\] should be an object with a 'role' and a text"),
    ('{"messages": [{"role": "user"}]}\n', r"line 1: messages\[0\] should be an object"),
    ('{"messages": []}\n', "line 1: messages holds no turn before the answer"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}\n', "line 1: messages holds no turn before the answer"),
])  # fmt: skip
def test_bad_prompt_files_name_the_line(tmp_path, body, message):
    path = tmp_path / "p.jsonl"
    path.write_text(body)
    with pytest.raises(UserError, match=message):
        read_prompts(path)
    with pytest.raises(UserError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_sampling_is_greedy_unless_a_temperature_is_given():
    class Tok:
        pad_token_id, eos_token_id = 0, 1

    assert Sampling().kwargs(Tok())["do_sample"] is False
    sampled = Sampling(temperature=0.7, top_p=0.9).kwargs(Tok())
    assert sampled["do_sample"] is True and sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9


def test_generation_stops_at_the_models_eos_ids_and_the_tokenizers():
    """An instruct model's generation config lists its turn end beside the end of text; a recipe's eos_token may
    be neither. Generation stops at all of them (passing the tokenizer's alone dropped the config's)."""
    from types import SimpleNamespace

    class Tok:
        pad_token_id, eos_token_id = 0, 7

    for config_ids, stops in (([5, 6], [5, 6, 7]), (7, [7]), (None, [7]), ([7, 5], [7, 5])):
        model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=config_ids))
        assert Sampling().kwargs(Tok(), model)["eos_token_id"] == stops
    assert Sampling().kwargs(Tok())["eos_token_id"] == [7]  # no model: the tokenizer's


def test_curves_pick_train_and_eval_points_by_step():
    metrics = {
        "log_history": [{"loss": 2.0, "learning_rate": 1e-3, "step": 1}, {"eval_loss": 1.9, "step": 1},
                        {"loss": 1.5, "learning_rate": 5e-4, "step": 2}, {"train_runtime": 3.0, "step": 2}],
        "step_seconds": [0.5, 0.25], "step_real_tokens": [100, 100],
    }  # fmt: skip
    data = curves(metrics)
    assert data["train"] == {"step": [1, 2], "loss": [2.0, 1.5], "learning_rate": [1e-3, 5e-4]}
    assert data["eval"] == {"step": [1], "loss": [1.9]}
    assert data["throughput"] == {"step": [1, 2], "tokens_per_second": [200.0, 400.0]}


def test_summary_names_both_throughputs_and_the_gpu_peaks_beside_the_estimate():
    from llmtune.post.report import _gpu_memory, _throughput

    metrics = {"tokens_per_second_whole_run": 900.0, "tokens_per_second_steady": 1200.0,
               "estimate_total_bytes": 40e9,
               "ranks": [{"cuda_max_allocated_bytes": 38.1e9, "cuda_max_reserved_bytes": 39.0e9},
                         {"cuda_max_allocated_bytes": 37.0e9, "cuda_max_reserved_bytes": 39.5e9}]}  # fmt: skip
    assert _throughput(metrics) == "900.0 tokens/s over the whole run, 1200.0 after the warm-up steps"
    assert _gpu_memory(metrics) == "38.1 GB allocated, 39.5 GB reserved (largest rank); estimate 40.0 GB"
    assert _gpu_memory({"ranks": [{"peak_rss_bytes": 1}]}) is None  # CPU runs have no CUDA peaks


def test_report_on_a_missing_folder_says_it_does_not_exist(tmp_path):
    """`llmtune report` on a mistyped path named a metrics.json it couldn't find; it says the folder isn't there."""
    from llmtune.post.report import write_report

    with pytest.raises(UserError, match=r"nope does not exist"):
        write_report(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"file is not a folder"):
        write_report(tmp_path / "file")
    with pytest.raises(UserError, match=r"has no metrics.json and no complete checkpoint"):
        write_report(tmp_path)


def test_a_run_that_stopped_before_its_final_save_is_reported_from_its_newest_checkpoint(tmp_path):
    """An interrupted run, the one that most needs its loss curve, had no report (no metrics.json)."""
    from llmtune.plan.checkpoint_layout import MARKER
    from llmtune.post.report import write_report

    for step, losses in ((2, [3.0, 2.5]), (4, [3.0, 2.5, 2.2, 2.0])):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        history = [{"step": i + 1, "loss": loss, "learning_rate": 1e-4} for i, loss in enumerate(losses)]
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
        (folder / MARKER).parent.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).write_text("{}")
    (tmp_path / "checkpoint-6").mkdir()  # incomplete: never read
    report = write_report(tmp_path)
    assert json.loads((report / "curves.json").read_text())["train"]["loss"] == [3.0, 2.5, 2.2, 2.0]
    summary = (report / "summary.md").read_text()
    assert "| steps | 4 |" in summary and "no final save: the run stopped; curves up to" in summary
    assert "checkpoint-4" in summary


def test_a_missing_model_path_is_named_before_the_hub_is_asked(run_cli, write_recipe, tmp_path):
    """A path that can't be a hub id said "Repo id must be in the form ..." with a network hint; it is named."""
    from llmtune.post.generate import check_model_name

    missing = tmp_path / "nomodel"
    for args, line in [
        (("infer", missing, "-p", "hi"), f"error: {missing} does not exist (hint: MODEL takes"),
        (("chat", "./nomodel"), "error: ./nomodel does not exist (hint: MODEL takes"),
        (("infer", "a/b/c", "-p", "hi"), "error: a/b/c does not exist"),
        (("eval", write_recipe(), "--model", missing), f"error: --model {missing} does not exist (hint: --model takes"),
    ]:
        result = run_cli(*args)
        assert result.code == 2 and line in result.err, (args, result.err)
        assert "Repo id" not in result.err and "HF_TOKEN" not in result.err and "base_model" not in result.err
    with pytest.raises(UserError, match="can't be a hub id"):
        check_model_name("my..model", "MODEL")
    check_model_name("HuggingFaceTB/SmolLM2-135M-Instruct", "MODEL")  # may be on the hub: left to the hub
    check_model_name(str(tmp_path), "MODEL")  # exists


def test_exact_match_scores_the_last_turn_given_everything_before_it(tmp_path):
    """Multi-turn rows: the prompt stopped before the first answer but the expected text was every answer joined."""
    from tiny import load_tokenizer, write_jsonl

    from llmtune.post.evaluate import split_prompt
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.formats import IGNORE
    from llmtune.train.data.prepare import prepare_data

    tok = load_tokenizer()
    turns = [("user", "one two"), ("assistant", "first answer"), ("user", "three four"), ("assistant", "second answer")]
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns]}, {"messages": [{"role": r, "content": c}
            for r, c in turns[2:]]}]  # fmt: skip
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    for train_on_eos in ("turn", "all"):  # "all" also trains the user turn's end: no answer on its own
        recipe = recipe_from_mapping({"base_model": "m", "chat_template": "tokenizer_default", "dataset_prepared_path":
                                      "", "datasets": [{"path": str(path), "type": "chat_template",
                                                          "train_on_eos": train_on_eos}]},
                                     tmp_path / "r.yaml", check_files=False).recipe  # fmt: skip
        one_turn, two_turns = sorted(prepare_data(recipe, tok).train, key=lambda e: len(e["input_ids"]))
        prompt, answer = split_prompt(two_turns, tok.eos_token_id)
        assert tok.decode(answer) == "second answer"
        text = tok.decode(prompt)
        assert text.endswith("three four<|im_end|>\n<|im_start|>assistant\n") and "first answer<|im_end|>" in text
        prompt, answer = split_prompt(one_turn, tok.eos_token_id)
        assert tok.decode(answer) == "second answer" and tok.decode(prompt).endswith("<|im_start|>assistant\n")
    # by hand: an answer followed by an end-of-sequence span alone keeps its prompt; nothing masked: no pair
    example = {"input_ids": [5, 6, 7, 8, 0, 9, 0], "labels": [IGNORE, 6, IGNORE, 8, 0, IGNORE, 0]}
    assert split_prompt(example, 0) == ([5, 6, 7], [8])
    assert split_prompt({"input_ids": [5, 6], "labels": [5, 6]}, 0) is None
    assert split_prompt({"input_ids": [5, 6], "labels": [IGNORE, IGNORE]}, 0) is None


def test_generation_stays_within_a_learned_position_table():
    """GPT-2 and OPT look positions up in a table: past its end generation fails with an IndexError. Rotary models
    have no such limit."""
    from types import SimpleNamespace

    import pytest

    from llmtune.errors import UserError
    from llmtune.post.generate import within_positions

    learned = SimpleNamespace(config=SimpleNamespace(n_positions=256))
    assert within_positions(learned, 100, {"max_new_tokens": 300})["max_new_tokens"] == 156
    assert within_positions(learned, 100, {"max_new_tokens": 20})["max_new_tokens"] == 20
    rotary = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256, rope_theta=10000.0))
    assert within_positions(rotary, 100, {"max_new_tokens": 300})["max_new_tokens"] == 300
    with pytest.raises(UserError, match="the prompt is 256 tokens, and the model has 256 positions"):
        within_positions(learned, 256, {"max_new_tokens": 1})


def test_eval_without_eval_data_is_refused_before_the_model_loads(run_cli, write_recipe, tmp_path):
    """A recipe without val_set_size or test_datasets, and no --data: one line, before the tokenizer and the model
    load (a base model that isn't here would otherwise fail first, on its download)."""
    recipe = write_recipe({"base_model": "some-org/not-here"})
    done = run_cli("eval", recipe)
    assert done.code == 2 and "the recipe has no eval data (val_set_size or test_datasets)" in done.err, done.err
    assert "pass --data FILE" in done.err and "not-here" not in done.err


def test_raw_with_messages_rows_is_refused_before_any_model_loads(tmp_path):
    from llmtune.post.generate import infer

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="--raw sends prompts without the chat template"):
        infer(str(tmp_path / "no-such-model"), [], path, None, Sampling(), raw=True)
