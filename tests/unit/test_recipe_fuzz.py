"""The recipe loader never shows a traceback: any YAML at all ends in a recipe or one UserError line."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe import Recipe, load_recipe

KEYS = sorted(Recipe.model_fields) + ["datasets", "fsdp_config", "deepspeed", "unknown_key", "lora_target_modules"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["auto", "zero3", "alpaca", "chat_template", "lora", "qlora", "bf16", "cuda", "", "0", "1e-4"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=12)), inner, max_size=4),
    ),
    max_leaves=20,
)
mappings = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=20)), values, max_size=12)


def check(text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            loaded = load_recipe(path)
            make_plan(loaded.recipe, make_cluster(num_processes=2, device="cpu"), config_dir=folder)
        except UserError as err:
            line = err.one_line()
            assert line and "\n" not in line and "Traceback" not in line


def base() -> dict:
    return {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mappings)
def test_random_mappings(mapping):
    check(yaml.safe_dump(mapping, allow_unicode=True))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=6))
def test_valid_base_with_random_values(changes):
    check(yaml.safe_dump({**base(), **changes}, allow_unicode=True))


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    check(text)


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=1, max_value=60))
def test_deep_nesting(depth):
    nested: object = "x"
    for _ in range(depth):
        nested = {"k": [nested]}
    check(yaml.safe_dump({**base(), "fsdp_config": nested}))
    check("a: " + "[" * depth * 20 + "]" * depth * 20)


def test_trust_remote_code_is_off_by_default_and_loud_when_on(run_cli, write_recipe):
    quiet = run_cli("validate", write_recipe())
    assert quiet.code == 0 and "WARNING" not in quiet.out + quiet.err
    loud = run_cli("validate", write_recipe({"trust_remote_code": True}))
    assert loud.code == 0 and "WARNING trust_remote_code: true" in loud.out


# Every key whose value names a file, folder or hub id, at the depth it lives (datasets' keys inside one dataset).
PATH_KEYS = ["base_model", "base_model_config", "tokenizer_config", "lora_model_dir", "resume_from_checkpoint",
             "deepspeed", "output_dir", "dataset_prepared_path", "chat_template_jinja", "mlflow_tracking_uri"]  # fmt: skip
DATASET_PATH_KEYS = ["path", "data_files", "name", "split"]
odd_strings = st.one_of(
    st.integers(min_value=0, max_value=6000).map(lambda n: "a" * n),
    st.integers(min_value=1, max_value=300).map(lambda n: "/".join(["d" * 200] * n)),
    st.sampled_from(["\x00", "a\x00b.jsonl", "./x\x00.json", "~" * 300, "./" + "é" * 3000, "../" * 2000, " ", "."]),
    st.text(min_size=0, max_size=5000),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATH_KEYS), odd_strings, st.sampled_from(["", ".json", ".jsonl", ".gguf", "/"]))
def test_any_string_in_a_path_key_is_one_line(key, text, suffix):
    check(yaml.safe_dump({**base(), key: text + suffix}, allow_unicode=True))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(DATASET_PATH_KEYS), odd_strings, st.sampled_from(["", ".json", ".jsonl", "/"]))
def test_any_string_in_a_dataset_path_is_one_line(key, text, suffix):
    dataset = {"path": "org/data", "type": "alpaca", key: text + suffix}
    check(yaml.safe_dump({**base(), "datasets": [dataset]}, allow_unicode=True))


def test_a_5000_character_path_names_its_key():
    for key in ("deepspeed", "base_model"):
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "recipe.yaml"
            path.write_text(yaml.safe_dump({**base(), key: "./" + "x" * 5000 + ".json"}))
            try:
                load_recipe(path)
            except UserError as err:
                assert err.one_line().startswith(f"{path}: {key}:"), err.one_line()[:200]
            else:
                raise AssertionError(f"{key}: a 5000-character path was accepted")


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "INFINITY"])
def test_infinite_and_nan_numbers_are_one_line(tmp_path, value):
    """YAML's .inf and .nan are numbers to yaml.safe_load: no recipe setting means them (logging_steps: .inf crashed
    in int(), found by the fuzz test above)."""
    for key in ("logging_steps", "learning_rate", "val_set_size", "num_epochs"):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({"base_model": "m", "datasets": [{"path": "x", "type": "alpaca"}]})
                        + f"{key}: {value}\n")  # fmt: skip
        with pytest.raises(UserError, match=f"{key}: Input should be a finite number"):
            load_recipe(path, check_files=False)
