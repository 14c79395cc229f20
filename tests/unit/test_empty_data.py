"""Empty data is named as empty: no '0 longer than sequence_len', no 'training' for eval data."""

from __future__ import annotations

import pytest
import yaml
from tiny import load_tokenizer, make_tiny_model

from llmtune.errors import UserError


def test_an_empty_data_file_is_named_without_a_sequence_len_hint(tmp_path, monkeypatch):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import prepare_data

    path = tmp_path / "empty.jsonl"
    path.write_text("")
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}],
                                  "dataset_prepared_path": ""}, tmp_path / "r.yaml", check_files=False).recipe  # fmt: skip
    tok = load_tokenizer()
    with pytest.raises(UserError, match=f"no usable training examples: 0 rows read from {path}$") as caught:
        prepare_data(recipe, tok)
    assert "sequence_len" not in caught.value.one_line()
    with pytest.raises(UserError, match=f"no usable eval examples: 0 rows read from {path}$"):
        prepare_data(recipe, tok, purpose="eval")
    # preference rows and GRPO prompts alike (they said: raise sequence_len)
    (tmp_path / "rwd.py").write_text("def r(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    monkeypatch.setenv("LLMTUNE_RECIPE_DIR", str(tmp_path))  # where the reward function's file is
    for rl, words in (("dpo", "preference rows"), ("grpo", "prompts")):
        extra = {"trl": {"reward_funcs": ["rwd.r"]}} if rl == "grpo" else {}
        other = recipe_from_mapping({"base_model": "m", "rl": rl, "datasets": [{"path": str(path)}], **extra},
                                    tmp_path / "r.yaml", check_files=False).recipe  # fmt: skip
        with pytest.raises(UserError, match=f"no usable {words}: 0 rows read from {path}$") as caught:
            prepare_data(other, tok)
        assert "sequence_len" not in caught.value.one_line()


def test_preprocess_and_eval_name_the_empty_file(run_cli, tmp_path):
    model = make_tiny_model(tmp_path / "model")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"base_model": str(model), "datasets": [{"path": str(empty), "type": "alpaca"}],
                                      "sequence_len": 64, "output_dir": str(tmp_path / "out"),
                                      "dataset_prepared_path": str(tmp_path / "prepared")}))  # fmt: skip
    result = run_cli("preprocess", recipe)
    assert result.code == 2 and f"error: no usable training examples: 0 rows read from {empty} (hint:" in result.err
    result = run_cli("eval", recipe, "--data", empty)
    assert result.code == 2 and f"error: no usable eval examples: 0 rows read from {empty.resolve()} (hint:" in (
        result.err
    )
    assert "sequence_len" not in result.err


def test_a_row_longer_than_the_tokenizers_maximum_is_counted_not_warned_about(tmp_path, capfd):
    """transformers warns that such a row 'will result in indexing errors'; llmtune drops it (or truncates) before any
    model sees it and says so in its data line: the warning is not passed on."""
    import json

    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import prepare_data

    path = tmp_path / "rows.jsonl"
    rows = [{"instruction": "Repeat", "input": "", "output": "apple " * (600 if i == 0 else 3)} for i in range(4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}],
                                  "dataset_prepared_path": "", "sequence_len": 256}, tmp_path / "r.yaml",
                                 check_files=False).recipe  # fmt: skip
    tok = load_tokenizer()
    tok.model_max_length = 128
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_warning()  # as a run has it: warnings shown
    prepared = prepare_data(recipe, tok)
    assert prepared.stats["dropped_too_long"] == 1, prepared.stats
    assert "Token indices sequence length" not in capfd.readouterr().err
