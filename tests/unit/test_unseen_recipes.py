"""What a review with recipes, data and commands written the way Axolotl users write them found, each fixed and
checked here. Local data read as Axolotl (through `datasets`) reads it: a folder whose file names say their split, a
split's slice, compressed or extension-less JSON lines, a byte-order mark, globs in data_files; the recipe forms of
older releases (pretraining_dataset as a name, chat_template_jinja as a path); and one-line answers, when the recipe
is read, for an output_dir that is a file, a checkpoint of the other kind, Axolotl-only GRPO settings, common names
of keys, a preference type llmtune lacks, and estimate flags that are not there."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.recipe.data import DatasetSpec
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.data.sources import read_rows


def _rows(prefix: str, count: int) -> str:
    return "".join(json.dumps({"instruction": f"{prefix}{i}", "input": "", "output": "o"}) + "\n" for i in range(count))


def read(path: Path, **spec) -> list[str]:
    return [row["instruction"] for row, _ in read_rows(DatasetSpec(path=str(path), type="alpaca", **spec), "datasets[0]")]


def test_a_folder_whose_file_names_say_the_split_gives_each_split_its_own_files(tmp_path):
    # train.jsonl beside test.jsonl: the held-out row must not reach training (it did: every file was read)
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.jsonl").write_text(_rows("train", 3))
    (folder / "test.jsonl").write_text(_rows("test", 1))
    assert read(folder) == ["train0", "train1", "train2"]
    assert read(folder, split="test") == ["test0"]
    with pytest.raises(UserError, match=r"split 'validation' is not among the files of .* \(their names say test, train\)"):
        read(folder, split="validation")
    # a hub snapshot's layout (data/train-00000-of-00001.parquet)
    import pandas as pd

    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    for split, count in (("train", 15), ("test", 5)):
        rows = [{"instruction": f"{split}{i}", "input": "", "output": "o"} for i in range(count)]
        pd.DataFrame(rows).to_parquet(snapshot / f"{split}-00000-of-00001.parquet")
    assert len(read(snapshot.parent)) == 15 and len(read(snapshot.parent, split="test")) == 5
    # names that say no split: every file, in name order
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "part1.jsonl").write_text(_rows("a", 2))
    (plain / "part2.jsonl").write_text(_rows("b", 2))
    assert read(plain) == ["a0", "a1", "b0", "b1"]
    assert read(plain, data_files="part2*.jsonl") == ["b0", "b1"]  # a glob, as `datasets` expands it
    # a split's slice on local data, as load_dataset reads it (it was ignored: every row trained)
    assert read(plain, split="train[:3]") == ["a0", "a1", "b0"]
    assert read(plain, split="train[50%:]") == ["b0", "b1"]
    assert read(folder, split="test[:5]") == ["test0"]
    with pytest.raises(UserError, match=r"datasets\[0\].split: 'train\[:2\]\+train\[3:\]' is not a slice"):
        read(plain, split="train[:2]+train[3:]")


def test_compressed_extension_less_and_bom_files_read_and_other_bytes_are_one_line(tmp_path):
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(_rows("g", 3).encode()))
    assert read(tmp_path / "rows.jsonl.gz") == ["g0", "g1", "g2"]
    assert read(tmp_path / "rows.jsonl.gz", ds_type="json") == ["g0", "g1", "g2"]
    (tmp_path / "rows").write_text(_rows("n", 2))  # no extension: JSON, as Axolotl's get_dataset_type says
    assert read(tmp_path / "rows") == ["n0", "n1"]
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + _rows("b", 2).encode())
    assert read(tmp_path / "bom.jsonl") == ["b0", "b1"]
    (tmp_path / "latin.jsonl").write_bytes(_rows("ok", 1).encode() + b'{"instruction": "caf\xe9", "output": "o"}\n')
    with pytest.raises(UserError) as err:  # a traceback before
        read(tmp_path / "latin.jsonl")
    assert "latin.jsonl line 2: not UTF-8 text (byte 0xe9)" in err.value.one_line()
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(_rows("c", 50).encode())[:40])
    with pytest.raises(UserError, match="cut.jsonl.gz"):
        read(tmp_path / "cut.jsonl.gz")


def recipe(tmp_path: Path, **changes):
    data = tmp_path / "rows.jsonl"
    data.write_text(_rows("r", 2))
    mapping = {"base_model": "org/model", "datasets": [{"path": str(data), "type": "alpaca"}],
               "output_dir": str(tmp_path / "out"), **changes}  # fmt: skip
    return recipe_from_mapping(mapping, Path("r.yaml"), check_files=False)


def test_older_recipe_forms_of_data_keys(tmp_path):
    # pretraining_dataset: one name (v0.3.0-v0.4.0)
    loaded = recipe(tmp_path, datasets=None, pretraining_dataset=str(tmp_path / "rows.jsonl"))
    assert [spec.path for spec in loaded.recipe.datasets] == [str(tmp_path / "rows.jsonl")]
    assert loaded.recipe.datasets[0].type == "completion" and loaded.recipe.sample_packing
    assert any("pretraining_dataset: a name" in note for note in loaded.notes)
    # chat_template_jinja: a path to a .jinja file (v0.11.0 on), at the top and in a dataset entry
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    loaded = recipe(tmp_path, chat_template="jinja", chat_template_jinja=str(tmp_path / "t.jinja"))
    assert loaded.recipe.chat_template_jinja == template
    entry = {"path": str(tmp_path / "rows.jsonl"), "type": "chat_template", "chat_template": "jinja",
             "chat_template_jinja": str(tmp_path / "t.jinja")}  # fmt: skip
    assert recipe(tmp_path, datasets=[entry]).recipe.datasets[0].chat_template_jinja == template
    # the text alone, without chat_template: that text is the template (Axolotl sets chat_template: jinja too)
    alone = recipe(tmp_path, chat_template_jinja=str(tmp_path / "t.jinja")).recipe
    assert (alone.chat_template, alone.chat_template_jinja) == ("jinja", template)
    spec = recipe(tmp_path, datasets=[{**entry, "chat_template": None}]).recipe.datasets[0]
    assert (spec.chat_template, spec.chat_template_jinja) == ("jinja", template)
    with pytest.raises(UserError, match="chat_template_jinja: .*missing.jinja is not a file"):
        recipe(tmp_path, chat_template="jinja", chat_template_jinja=str(tmp_path / "missing.jinja"))
    # a dataset entry's chat_template is checked when the recipe is read, naming the entry
    with pytest.raises(UserError, match=r"datasets\[0\].*'notatemplate' is not a known template"):
        recipe(tmp_path, datasets=[{**entry, "chat_template": "notatemplate"}])


def test_a_null_field_is_called_null(tmp_path):
    from llmtune.train.data.base import RowError, _field

    with pytest.raises(RowError, match="field 'output' is null"):
        _field({"instruction": "g", "output": None}, "output")
    with pytest.raises(RowError, match=r"missing field 'output' \(row has: instruction\)"):
        _field({"instruction": "g"}, "output")


def test_output_dir_and_resume_point_mistakes_are_one_line_when_the_recipe_is_read(tmp_path):
    from llmtune.recipe import load_recipe

    (tmp_path / "afile").write_text("x")
    (tmp_path / "rows.jsonl").write_text(_rows("r", 2))

    def load(**changes):
        import yaml

        mapping = {"base_model": "org/model", "datasets": [{"path": str(tmp_path / "rows.jsonl"), "type": "alpaca"}],
                   "output_dir": str(tmp_path / "out"), **changes}  # fmt: skip
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(mapping))
        return load_recipe(tmp_path / "r.yaml")

    for output in ("afile", "afile/sub"):  # a traceback at launch before
        with pytest.raises(UserError, match=r"output_dir: .*afile is a file, not a folder"):
            load(output_dir=str(tmp_path / output))
    lora = tmp_path / "lora" / "checkpoint-3"
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match="was saved by a LoRA run, and this recipe trains the whole model"):
        load(resume_from_checkpoint=str(lora))
    full = tmp_path / "full" / "checkpoint-3"
    full.mkdir(parents=True)
    (full / "config.json").write_text("{}")
    (full / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="was saved by a full fine-tune, and this recipe trains a lora adapter"):
        load(resume_from_checkpoint=str(full), adapter="lora")
    assert load(resume_from_checkpoint=str(lora), adapter="lora").recipe.adapter == "lora"


def test_a_key_users_write_for_another_is_pointed_at_it(tmp_path):
    with pytest.raises(UserError, match="unknown key 'lora_rank'; did you mean 'lora_r'"):
        recipe(tmp_path, lora_rank=16)


def test_axolotl_only_grpo_settings_are_refused_when_the_recipe_is_read(tmp_path):
    import dataclasses

    from trl import GRPOConfig

    from llmtune.recipe.online import AXOLOTL_ONLY_GRPO

    assert not AXOLOTL_ONLY_GRPO & {field.name for field in dataclasses.fields(GRPOConfig)}  # none is TRL's
    (tmp_path / "rwd.py").write_text("def fn(completions, **kw):\n    return [0.0 for _ in completions]\n")
    trl = {"num_generations": 2, "reward_funcs": ["rwd.fn"], "async_prefetch": True}
    with pytest.raises(UserError, match="trl.async_prefetch is a setting of Axolotl's own GRPO"):
        recipe(tmp_path, rl="grpo", trl=trl, datasets=[{"path": str(tmp_path / "rows.jsonl")}])


def test_an_axolotl_preference_type_llmtune_lacks_is_answered_with_the_preference_types():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="'zephyr.nectar' is not one of the preference types .* chatml.intel"):
        DatasetSpec(path="x", type="zephyr.nectar")


def test_estimate_refuses_sizes_and_counts_that_are_not_there(tmp_path, run_cli):
    loaded = recipe(tmp_path)
    path = tmp_path / "r.yaml"
    import yaml

    path.write_text(yaml.safe_dump(loaded.recipe.model_dump(mode="json", exclude_unset=True)))
    for flags, said in ((["--num-machines", "-1"], "--num-machines -1 is not a machine count"),
                        (["--gpu-memory", "0GB"], "--gpu-memory '0GB' is not above zero")):  # fmt: skip
        result = run_cli("estimate", str(path), *flags)
        assert result.code == 2 and said in result.err and "Traceback" not in result.err, result.err


def test_an_alpaca_run_is_prompted_with_the_tokens_it_was_trained_on(tmp_path):
    # infer/chat on an alpaca run used the chat template: answers disagreed with `llmtune eval`'s (training format)
    from tiny import load_tokenizer

    from llmtune.post.generate import Loaded, prompt_text, trained_prompt_format
    from llmtune.train.data.formats import IGNORE, FormatContext, format_for

    run = tmp_path / "run"
    (run / "llmtune").mkdir(parents=True)
    plan = {"recipe": {"datasets": [{"path": "x.jsonl", "type": "alpaca"}]}, "plan": {}}
    (run / "llmtune" / "plan.json").write_text(json.dumps(plan))
    assert trained_prompt_format(run) == "alpaca"
    plan["recipe"]["datasets"].append({"path": "y.jsonl", "type": "chat_template"})
    (run / "llmtune" / "plan.json").write_text(json.dumps(plan))
    assert trained_prompt_format(run) is None  # mixed formats: the chat template, as before
    tok = load_tokenizer()
    loaded = Loaded(None, tok, "run", "alpaca")
    spec = DatasetSpec(path="x", type="alpaca")
    for row in ({"instruction": "Repeat stone", "input": "twice"}, {"instruction": "Repeat stone", "input": ""}):
        [(ids, labels)] = format_for(spec)({**row, "output": "stone"}, FormatContext(tok, spec, False, 256, None))
        trained_prompt = ids[: labels.index(next(label for label in labels if label != IGNORE))]
        text = prompt_text(loaded, row, row["instruction"], raw=False)
        assert tok(text, add_special_tokens=False)["input_ids"] == trained_prompt
    assert "### Instruction:\nRepeat apple" in prompt_text(loaded, {"prompt": "Repeat apple"}, "Repeat apple", False)
    assert prompt_text(loaded, {"prompt": "hi"}, "hi", raw=True) == "hi"


def test_every_unknown_key_is_named_in_the_one_line(tmp_path):
    with pytest.raises(UserError) as err:
        recipe(tmp_path, lora_rank=16, learnig_rate=1e-4, foo_bar_baz=1)
    line = err.value.one_line()
    assert "3 unknown keys: 'lora_rank' (did you mean 'lora_r'?), 'learnig_rate' (did you mean 'learning_rate'?)" in line
    assert "'foo_bar_baz'" in line


def test_bf16_asked_for_on_a_gpu_without_it_is_one_line_before_the_first_step(monkeypatch):
    import torch

    from llmtune.train.engine.arguments import _check_bf16_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-32GB")
    with pytest.raises(UserError) as err:
        _check_bf16_device("bf16", rehearsal=False)
    assert "bf16 needs an Ampere or newer GPU; this one is a Tesla V100-SXM2-32GB" in err.value.one_line()
    _check_bf16_device("fp16", rehearsal=False)  # what bf16: auto plans on that GPU goes through
    _check_bf16_device("bf16", rehearsal=True)  # the rehearsal computes in fp32


def test_every_wrong_value_is_named_in_the_one_line_in_the_recipe_s_order(tmp_path):
    raw = {"base_model": "org/m", "num_epochs": 0, "datasets": [{"path": "org/d", "type": "alpaca", "split": 3}],
           "learning_rate": "abc", "micro_batch_size": -1, "bf16": "maybe"}  # fmt: skip
    with pytest.raises(UserError) as err:
        recipe_from_mapping(raw, tmp_path / "r.yaml", check_files=False)
    line = err.value.one_line()
    keys = ["num_epochs: Input should be greater than 0 (got 0)", "datasets[0].split:", "learning_rate:",
            "micro_batch_size: Input should be greater than 0 (got -1)", "bf16:"]  # fmt: skip
    assert all(key in line for key in keys), line
    assert [line.index(key) for key in keys] == sorted(line.index(key) for key in keys)  # as the recipe has them
    assert line.count("bf16") == 1  # bool | 'auto': one problem, not one per union member
    many = {**raw, **{k: -1 for k in ("lora_r", "lora_alpha", "warmup_steps", "save_total_limit")}, "adapter": "lora"}
    with pytest.raises(UserError) as err:
        recipe_from_mapping(many, tmp_path / "r.yaml", check_files=False)
    assert err.value.one_line().count(": Input should") == 5 and "(and " in err.value.one_line()
    # a typo in a type: mapping is answered by the format the mapping's other keys belong to
    for fields, meant in (({"field_promt": "q", "field_chosen": "c", "field_rejected": "r"}, "field_prompt"),
                          ({"field_instrution": "q", "field_output": "o"}, "field_instruction")):  # fmt: skip
        wrong = {"base_model": "org/m", "datasets": [{"path": "org/d", "type": fields}]}
        with pytest.raises(UserError) as err:
            recipe_from_mapping(wrong, tmp_path / "r.yaml", check_files=False)
        assert f"datasets[0].type: unknown key '{next(iter(fields))}'; did you mean '{meant}'?" in err.value.one_line()


def test_a_resume_path_that_is_not_there_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "checkpoint-4").mkdir(parents=True)
    base = {"base_model": "org/m", "datasets": [{"path": "org/d", "type": "alpaca"}], "output_dir": "out"}
    for value, said in (("checkpoint-4", f"does not exist in {tmp_path} (hint: did you mean out/checkpoint-4?"),
                        ("/nowhere/checkpoint-4", "/nowhere/checkpoint-4 does not exist (hint: check the path)")):
        with pytest.raises(UserError) as err:
            recipe_from_mapping({**base, "resume_from_checkpoint": value}, tmp_path / "r.yaml")
        assert said in err.value.one_line()


def test_a_chat_dataset_on_a_tokenizer_without_a_chat_template_is_one_line_when_validated(tmp_path, run_cli):
    """type: chat_template with no chat_template key renders with the tokenizer's own template; a base model's
    tokenizer (here a local folder, as a download is) has none, which the run found only after loading the model."""
    import shutil

    import yaml

    model = tmp_path / "base-model"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")

    def validate(**changes):
        raw = {"base_model": str(model), "output_dir": str(tmp_path / "out"),
               "datasets": [{"path": str(tmp_path / "chats.jsonl"), "type": "chat_template"}], **changes}  # fmt: skip
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
        return run_cli("validate", str(tmp_path / "r.yaml"), "--device", "cpu", "--num-processes", "1")

    refused = validate()
    assert refused.code == 2 and "Traceback" not in refused.err, refused.err
    assert "datasets[0] (type: chat_template) renders with the tokenizer's own chat template, and the tokenizer of " \
           f"{model} has none" in refused.err and "set chat_template: chatml" in refused.err  # fmt: skip
    assert validate(chat_template="chatml").code == 0
    assert validate(datasets=[{"path": str(tmp_path / "chats.jsonl"), "type": "chat_template",
                               "chat_template": "llama3"}]).code == 0  # fmt: skip
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert validate().code == 0  # transformers' newer layout keeps the template beside the config
