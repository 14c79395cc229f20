"""`llmtune config` after SFT: preference training on an llmtune run's result (an adapter or a full model).

The SFT results are fakes made in tmp_path: llmtune/plan.json with the run's recipe, and adapter_config.json or
config.json beside it; nothing trains. Every written recipe is loaded by llmtune's own loader, files checked.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from llmtune.recipe import load_recipe

SMALL_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
               "num_hidden_layers": 4, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
               "vocab_size": 49152}  # fmt: skip
PAIR_ROW = {"system": "Be brief.", "question": "Reverse: a b", "chosen": "b a", "rejected": "a b"}
KTO_ROW = {"prompt": "Reverse: a b", "completion": "b a", "label": True}


def _jsonl(path: Path, row: dict) -> Path:
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.fixture
def base(tmp_path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return folder


def sft_result(tmp_path: Path, base: Path, kind: str) -> Path:
    """A finished SFT run's output folder: lora, qlora (a LoRA on a 4-bit base) or full."""
    folder = tmp_path / f"sft-{kind}"
    (folder / "llmtune").mkdir(parents=True)
    recipe = {"base_model": str(base), "chat_template": "chatml", "sequence_len": 512, "bf16": True, "fp16": False,
              "tokenizer_use_fast": True, "trust_remote_code": False, "special_tokens": {"pad_token": "<pad>",
              "eos_token": None}, "adapter": None if kind == "full" else kind, "load_in_4bit": kind == "qlora",
              "resize_token_embeddings_to_32x": True}  # fmt: skip
    (folder / "llmtune" / "plan.json").write_text(json.dumps({"plan": {}, "recipe": recipe}))
    (folder / "tokenizer_config.json").write_text("{}")
    if kind == "full":
        (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
        (folder / "model.safetensors").write_bytes(b"")
    else:
        adapter = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                   "target_modules": ["v_proj", "q_proj"], "base_model_name_or_path": str(base)}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(adapter))
    return folder


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_an_adapter_result_is_continued_on_its_base(run_cli, tmp_path, base, kind):
    sft = sft_result(tmp_path, base, kind)
    pairs = _jsonl(tmp_path / "pairs.jsonl", PAIR_ROW)
    output = tmp_path / "dpo.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", sft, "--rl", "dpo", "--preference-data", pairs,
                     "--preference-type", "chatml.intel")  # fmt: skip
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert raw["base_model"] == str(base) and raw["lora_model_dir"] == str(sft)  # the adapter's base; the adapter
    assert raw["adapter"] == kind and raw.get("load_in_4bit", False) == (kind == "qlora")
    assert (raw["lora_r"], raw["lora_alpha"], raw["lora_target_modules"]) == (8, 16, ["q_proj", "v_proj"])
    assert raw["rl"] == "dpo" and raw["rl_beta"] == 0.1
    assert raw["datasets"] == [{"path": str(pairs), "type": "chatml.intel"}]
    # carried from the SFT run: its template, tokenizer (saved in the run folder), length and precision
    assert raw["chat_template"] == "chatml" and raw["tokenizer_config"] == str(sft) and raw["bf16"] is True
    assert raw["sequence_len"] == 512 and raw["special_tokens"] == {"pad_token": "<pad>"}
    assert raw["resize_token_embeddings_to_32x"] is True  # the adapter's embedding rows have that shape
    assert raw["sample_packing"] is False and raw["learning_rate"] == 1e-5  # SFT's LoRA default is 2e-4
    assert raw["output_dir"] == "./outputs/sft-" + kind + "-dpo"
    recipe = load_recipe(output).recipe  # files checked: base, adapter, tokenizer and data exist
    assert recipe.rl == "dpo" and recipe.lora_model_dir == str(sft.resolve())
    assert run_cli("validate", output).code == 0


def test_a_full_model_result_is_the_new_base(run_cli, tmp_path, base):
    sft = sft_result(tmp_path, base, "full")
    data = _jsonl(tmp_path / "kto.jsonl", KTO_ROW)
    output = tmp_path / "kto.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", sft, "--method", "full", "--rl", "kto",
                     "--preference-data", data)  # fmt: skip
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert raw["base_model"] == str(sft) and "adapter" not in raw and "lora_model_dir" not in raw
    assert raw["rl"] == "kto" and raw["datasets"][0]["type"] == "chatml.ultra"
    assert raw["learning_rate"] == 1e-6 and raw["sequence_len"] == 512  # SFT's full default is 2e-5
    assert "tokenizer_config" not in raw  # the folder is the model: its tokenizer comes with it
    assert load_recipe(output).recipe.rl == "kto"


def test_yes_alone_takes_preference_training_as_the_next_step(run_cli, tmp_path, base):
    """No flag but the folder: the step offered after SFT is the default, with its default data (a hub id)."""
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", sft_result(tmp_path, base, "lora"))
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert raw["rl"] == "dpo" and raw["datasets"] == [{"path": "Intel/orca_dpo_pairs", "type": "chatml.intel"}]
    assert load_recipe(output).recipe.rl == "dpo"


def test_sft_data_flags_on_a_full_result_still_write_sft(run_cli, tmp_path, base):
    sft = sft_result(tmp_path, base, "full")
    data = _jsonl(tmp_path / "alpaca.jsonl", {"instruction": "hi", "input": "", "output": "hello"})
    output = tmp_path / "r.yaml"
    assert run_cli("config", "--yes", "-o", output, "--base-model", sft, "--dataset", data).code == 0
    raw = yaml.safe_load(output.read_text())
    assert "rl" not in raw and raw["base_model"] == str(sft) and raw["datasets"][0]["type"] == "alpaca"


@pytest.mark.parametrize(
    ("rl", "row", "kind", "extra"),
    [
        ("dpo", PAIR_ROW, "chatml.intel", {}),
        ("kto", KTO_ROW, "chatml.ultra", {}),
        ("orpo", {"messages": [{"role": "user", "content": "hi"}], "chosen": "hello", "rejected": "go"},
         "chat_template.default", {}),
        ("dpo", {"conversations": [{"from": "human", "value": "hi"}], "chosen": "hello", "rejected": "go"},
         "chat_template.default", {"field_messages": "conversations"}),
        ("simpo", {"prompt": "hi", "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
                   "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]},
         "chatml.ultra", {}),
        ("ipo", {"prompt": "<|im_start|>user\nhi<|im_end|>\n", "chosen": "a", "rejected": "b"}, "passthrough", {}),
        ("dpo", {"input": "hi", "chosen": "a", "rejected": "b"}, "chatml.icr", {}),
        ("kto", {"question": "hi", "completion": "a", "label": False}, "chatml.intel", {}),
    ],
)  # fmt: skip
def test_the_type_is_read_from_the_first_row(run_cli, tmp_path, base, rl, row, kind, extra):
    data = _jsonl(tmp_path / "data.jsonl", row)
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", sft_result(tmp_path, base, "lora"),
                     "--rl", rl, "--preference-data", data)  # fmt: skip
    assert result.code == 0, result.err
    assert f"{data}: the first row has {', '.join(row)}: type {kind}" in result.err  # said, not silently chosen
    dataset = yaml.safe_load(output.read_text())["datasets"][0]
    assert (
        dataset["type"] == kind
        and {k: v for k, v in dataset.items() if k not in ("path", "type")}.items() >= extra.items()
    )
    load_recipe(output)


@pytest.mark.parametrize(
    ("rl", "keys", "absent"),
    [
        ("orpo", {"orpo_alpha": 0.1}, ["rl_beta", "simpo_gamma"]),  # one of ORPO's two names for its weight
        ("simpo", {"rl_beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}, ["orpo_alpha"]),
        ("ipo", {"rl_beta": 0.1}, ["orpo_alpha", "simpo_gamma", "cpo_alpha"]),
    ],
)
def test_each_method_gets_only_its_own_keys(run_cli, tmp_path, base, rl, keys, absent):
    """On a model that is no SFT result: --rl asks for preference training on any base, with a new adapter."""
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", base, "--rl", rl,
                     "--preference-data", _jsonl(tmp_path / "p.jsonl", PAIR_ROW))  # fmt: skip
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert {k: raw.get(k) for k in keys} == keys and not [k for k in absent if k in raw]
    assert raw["adapter"] == "lora" and raw["lora_target_linear"] is True and "lora_model_dir" not in raw
    assert load_recipe(output).recipe.rl == rl


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--rl", "kto", "--preference-type", "chat_template.default"], "--preference-type chat_template.default"),
        (["--rl", "kto", "--preference-type", "chatml.intel", "--preference-data", "PAIRS"], "--preference-data"),
        (["--rl", "dpo", "--preference-type", "chatml.intel", "--preference-data", "KTO"], "--preference-data"),
        (["--rl", "dpo", "--preference-type", "chatml.icr", "--preference-data", "PAIRS"], "--preference-type chatml.icr"),
        (["--rl", "grpo"], "--rl 'grpo'"),
        (["--rl", "dpo", "--orpo-alpha", "0.2"], "--orpo-alpha"),
        (["--rl", "orpo", "--rl-beta", "0.2", "--orpo-alpha", "0.1"], "--rl-beta and --orpo-alpha"),
        (["--rl", "dpo", "--rl-beta", "-1"], "--rl-beta -1.0"),
        (["--method", "full"], "--method full"),
        (["--strategy", "pipeline"], "--strategy pipeline"),
        (["--rl", "dpo", "--dataset", "PAIRS"], "--dataset"),
        (["--preference-data", "ODD"], "--preference-type (default chatml.intel)"),  # no type reads its rows
    ],
)  # fmt: skip
def test_wrong_combinations_are_one_line_naming_the_flag(run_cli, tmp_path, base, flags, key):
    files = {
        "PAIRS": str(_jsonl(tmp_path / "pairs.jsonl", PAIR_ROW)),
        "KTO": str(_jsonl(tmp_path / "k.jsonl", KTO_ROW)),
        "ODD": str(_jsonl(tmp_path / "odd.jsonl", {"query": "hi", "good": "a", "bad": "b"})),
    }
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", sft_result(tmp_path, base, "lora"),
                     *[files.get(flag, flag) for flag in flags])  # fmt: skip
    error = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert result.code == 2 and len(error) == 1 and key in error[0], result.err
    assert "Traceback" not in result.err and not output.exists()


def test_a_run_folder_without_a_saved_model_is_refused(run_cli, tmp_path, base):
    sft = sft_result(tmp_path, base, "lora")
    (sft / "adapter_config.json").unlink()  # still training, or stopped before saving
    result = run_cli("config", "--yes", "-o", tmp_path / "r.yaml", "--base-model", sft)
    assert result.code == 2 and "no saved model yet" in result.err and f"--base-model {sft}" in result.err


def test_interactive_preference_session(tmp_path, base, monkeypatch):
    """In a real terminal: the next step is offered, data of the wrong kind is refused in place, and the type the
    first row matches is preselected."""
    import pexpect

    sft = sft_result(tmp_path, base, "full")
    _jsonl(tmp_path / "pairs.jsonl", PAIR_ROW)
    _jsonl(tmp_path / "kto.jsonl", KTO_ROW)
    output = tmp_path / "r.yaml"
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "160", "LINES": "60", "CUDA_VISIBLE_DEVICES": ""}
    child = pexpect.spawn(sys.executable, ["-m", "llmtune", "config", "-o", str(output)], cwd=str(tmp_path), env=env,
                          encoding="utf-8", timeout=30, dimensions=(60, 160))  # fmt: skip
    down, enter, backspace = "\x1b[B", "\r", "\x7f"
    try:
        child.expect(re.escape("Model (hub id or local folder)"))
        child.send(sft.name + enter)
        child.expect(re.escape(f"{sft.name} is an llmtune SFT result (a full model). Next step:"))
        child.expect(re.escape("preference training (DPO, IPO, ORPO, KTO, SimPO) on this SFT result"))
        child.send(enter)
        child.expect("Preference method")
        child.expect(re.escape("SimPO: pairs, no reference model"))
        child.send(down * 4 + enter)  # dpo -> ipo -> orpo -> simpo -> kto
        child.expect("Fine-tuning method")
        child.send(enter)  # LoRA
        child.expect(re.escape("Preference data (prompt, completion, label;"))
        child.send("pairs.jsonl" + enter)
        child.expect(re.escape("is pairs (chosen and rejected), which rl: kto can't read"))
        child.send(backspace * len("pairs.jsonl") + "kto.jsonl" + enter)
        child.expect(re.escape("chatml.ultra (prompt, completion, label)  [matches the first row]"))
        child.send(enter)
        child.expect(re.escape("Beta (smaller: the policy may move further from the reference) [0.1]:"))
        child.send("0.2" + enter)
        for question in ("How many machines?", "How many GPUs per machine?", "Which GPU ids", "Memory of one GPU"):
            child.expect(re.escape(question))
            child.send(enter)
        child.expect("Mixed precision")
        child.send(enter)  # bf16, as the SFT run had
        child.expect(re.escape("torch.compile"))
        child.send(enter)  # no
        child.expect(re.escape("Sequence length (tokens) [512]:"))  # the SFT run's
        child.send(enter)
        child.expect(re.escape("Micro-batch size per GPU [2]:"))
        child.send(enter)
        child.expect("Distributed strategy")
        child.send(enter)
        child.expect(re.escape("Output folder [./outputs/sft-full-kto]:"))
        child.send(enter)
        child.expect("wrote")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    raw = yaml.safe_load(output.read_text())
    assert (raw["rl"], raw["rl_beta"], raw["adapter"], raw["bf16"]) == ("kto", 0.2, "lora", True)
    assert raw["datasets"] == [{"path": "kto.jsonl", "type": "chatml.ultra"}]
    monkeypatch.chdir(tmp_path)  # the recipe names its files as typed, relative to where it was written
    assert load_recipe(output).recipe.rl == "kto"


def test_user_defined_names_the_fields_the_first_row_has(run_cli, tmp_path, base):
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", sft_result(tmp_path, base, "lora"),
                     "--preference-data", _jsonl(tmp_path / "p.jsonl", PAIR_ROW),
                     "--preference-type", "user_defined.default")  # fmt: skip
    assert result.code == 0, result.err
    kind = yaml.safe_load(output.read_text())["datasets"][0]["type"]
    assert kind == {"field_prompt": "question", "field_chosen": "chosen", "field_rejected": "rejected",
                    "field_system": "system"}  # fmt: skip
    assert load_recipe(output).recipe.datasets[0].type.field_prompt == "question"
