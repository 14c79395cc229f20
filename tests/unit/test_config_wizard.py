"""`llmtune config`: driven in a real pseudo-terminal with arrow keys, and non-interactively with flags."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from llmtune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}  # fmt: skip


@pytest.fixture
def chat_file(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "llama8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return folder


def test_interactive_session_in_a_terminal(tmp_path, chat_file, model_dir):
    """Typed the way a person types: a value then Enter, or Enter alone for the default shown in brackets."""
    import pexpect  # a dev dependency: without it this must fail, not skip (a skip would pass CI unproven)

    output = tmp_path / "my.yaml"
    missing = "./data/missing.jsonl"
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "160", "LINES": "60", "CUDA_VISIBLE_DEVICES": ""}
    child = pexpect.spawn(sys.executable, ["-m", "llmtune", "config", "-o", str(output)], cwd=str(tmp_path),
                          env=env, encoding="utf-8", timeout=30, dimensions=(60, 160))  # fmt: skip
    down, enter, backspace = "\x1b[B", "\r", "\x7f"
    try:
        child.expect(re.escape("Model (hub id or local folder) [HuggingFaceTB/SmolLM2-135M-Instruct]:"))
        child.send(str(model_dir) + enter)  # typing replaces the default (it is shown, not pre-filled)
        child.expect("Fine-tuning method")
        child.send(down + down + enter)  # LoRA -> QLoRA -> Full fine-tune
        child.expect(re.escape("Dataset (local .jsonl/.json/.parquet file or hub id) [tatsu-lab/alpaca]:"))
        child.send(missing + enter)  # a local path that doesn't exist is refused, and the question stays
        child.expect(re.escape(f"{missing} does not exist here"))
        child.send(backspace * len(missing) + str(chat_file) + enter)
        child.expect("Dataset format")
        child.send(enter)  # chat_template, guessed from the file, is preselected
        child.expect(re.escape("How many machines? [1]"))
        child.send(enter)
        child.expect(re.escape("How many GPUs per machine? [1]"))
        child.send("8" + enter)  # 8, not 18
        child.expect(re.escape("Which GPU ids on each machine (comma separated, or all)? [all]"))
        child.send(enter)
        child.expect(re.escape("Memory of one GPU [80GB]:"))
        child.send("80GB" + enter)
        child.expect("Mixed precision")
        child.send(enter)
        child.expect(re.escape("torch.compile"))
        child.send(enter)  # no
        child.expect(re.escape("Sequence length (tokens) [2048]:"))
        child.send(enter)
        child.expect(re.escape("Micro-batch size per GPU [2]:"))
        child.send("1" + enter)  # 1, not 21
        child.expect("Distributed strategy")
        child.expect(r"ZeRO-1 \(optimizer states sharded\)  \[recommended\]")  # preselected in the menu
        child.send(enter)  # take the preselected recommendation
        child.expect(re.escape("Output folder [./outputs/llama8b-full]:"))
        child.send(enter)
        child.expect("wrote")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    text = output.read_text()
    assert "recommended because" in text and f"llmtune train {output} --num-processes 8" in text
    raw = yaml.safe_load(text)
    assert raw["base_model"] == str(model_dir) and raw["datasets"][0]["path"] == str(chat_file)  # exactly as typed
    assert raw["micro_batch_size"] == 1 and raw["sequence_len"] == 2048  # typed; Enter alone
    assert raw["output_dir"] == "./outputs/llama8b-full"  # Enter alone: the default shown
    assert "torch_compile" not in raw  # Enter alone: no, as accelerate config's dynamo question
    recipe = load_recipe(output).recipe
    assert recipe.deepspeed == "zero1" and recipe.adapter is None and recipe.bf16 is True
    assert recipe.datasets[0].type == "chat_template" and recipe.datasets[0].field_messages == "conversations"


def test_text_answers_enter_takes_the_default_typing_replaces_it(monkeypatch, tmp_path):
    """The Asker's rules without a terminal: questionary gets no pre-filled default, and the answer is what was typed."""
    import questionary

    from llmtune.wizard import Asker, _existing_if_local

    asked: list[tuple[str, dict]] = []

    def answering(typed: str) -> None:
        class Question:
            def ask(self):
                return typed

        def text(message, **options):
            asked.append((message, options))
            return Question()

        monkeypatch.setattr(questionary, "text", text)

    ask = Asker(interactive=True)
    answering("")
    assert ask.text("Output folder:", "./outputs/run") == "./outputs/run"
    assert asked[-1][0] == "Output folder [./outputs/run]:" and "default" not in asked[-1][1]
    answering("  my/data ")
    assert ask.text("Dataset:", "tatsu-lab/alpaca") == "my/data"
    assert ask.text("IP address:", "") == "my/data" and asked[-1][0] == "IP address:"
    assert ask.text("How many?", "1", lambda v: None if v.isdigit() else "a number") == "my/data"
    validate = asked[-1][1]["validate"]
    assert validate("") is True and validate("x") == "a number"  # Enter alone is checked as the default
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.jsonl").write_text("{}\n")
    for local in ("./nope.jsonl", "nope.parquet", "/no/such/folder", "~/no/such/file.json", "../x/y"):
        assert "does not exist here" in _existing_if_local(local), local
    for fine in ("here.jsonl", "./here.jsonl", str(tmp_path), "tatsu-lab/alpaca", "org/repo/model.Q4.gguf"):
        assert _existing_if_local(fine) is None, fine


def test_yes_takes_defaults_and_flags_answer_questions(run_cli, tmp_path, chat_file, model_dir):
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", model_dir, "--dataset", chat_file,
                     "--gpus-per-machine", "4", "--num-machines", "2", "--main-process-ip", "10.0.0.1",
                     "--strategy", "fsdp", "--fsdp-state-dict-type", "SHARDED_STATE_DICT")  # fmt: skip
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert raw["fsdp_version"] == 2 and raw["fsdp_config"]["state_dict_type"] == "SHARDED_STATE_DICT"
    assert raw["adapter"] == "lora"  # the default method
    for rank in (0, 1):  # one command per machine, printed and in the recipe's header
        line = f"--num-processes 8 --num-machines 2 --machine-rank {rank} --main-process-ip 10.0.0.1"
        assert line in result.out and line in output.read_text()
    assert load_recipe(output).recipe.fsdp_enabled
    assert raw["bf16"] is True  # the default answer
    # fp32 asked for is written out: a recipe without bf16 would be Axolotl's bf16: auto
    fp32 = tmp_path / "fp32.yaml"
    assert run_cli("config", "--yes", "-o", fp32, "--base-model", model_dir, "--dataset", chat_file,
                   "--mixed-precision", "no").code == 0  # fmt: skip
    assert yaml.safe_load(fp32.read_text())["bf16"] is False and load_recipe(fp32).recipe.precision == "no"



def test_a_strategy_chosen_over_the_recommended_one_gets_its_own_estimate(run_cli, tmp_path, chat_file):
    """It printed the recommended strategy's figure: a 70B full fine-tune under DDP read "Estimated 19.9 GB"."""
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-70B", "--method", "full",
                     "--dataset", chat_file, "--gpus-per-machine", "8", "--gpu-memory", "80GB",
                     "--strategy", "ddp")  # fmt: skip
    assert result.code == 0, result.err
    header = output.read_text()
    assert "Chosen instead of the recommended" in header and "does NOT fit" in header
    # what `llmtune train` does with it: its memory check refuses it before launch (no out-of-memory error to expect)
    assert "`llmtune train` refuses to launch it (its memory check) unless given --no-memory-check" in header
    assert "19.9 GB" not in header and "expect an out-of-memory error" not in header


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "zero4"], "--strategy 'zero4' is not one of"),
        (["--method", "dora"], "--method 'dora' is not one of"),
        (["--gpu-memory", "lots"], "--gpu-memory 'lots' is not a size"),
        (["--num-machines", "2"], "--main-process-ip is required"),
        (["--strategy", "pipeline", "--pipeline-stages", "3", "--gpus-per-machine", "2"], "pipeline"),
        (["--dataset", "missing.jsonl"], "missing.jsonl"),
    ],
)
def test_bad_answers_are_one_line_and_write_nothing(run_cli, tmp_path, model_dir, flags, message):
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", model_dir, *flags)
    assert result.code == 2 and message in result.err and "Traceback" not in result.err
    assert not output.exists()


def test_existing_file_needs_force(run_cli, tmp_path, model_dir):
    output = tmp_path / "r.yaml"
    output.write_text("keep me\n")
    result = run_cli("config", "--yes", "-o", output, "--base-model", model_dir)
    assert result.code == 2 and "--force" in result.err and output.read_text() == "keep me\n"
    assert run_cli("config", "--yes", "--force", "-o", output, "--base-model", model_dir).code == 0


def test_not_a_terminal_without_yes_is_a_clear_error(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "llmtune", "config", "-o", str(tmp_path / "r.yaml")],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "--yes" in result.stderr



@pytest.mark.parametrize(
    ("strategy", "flag", "keys", "mesh"),
    [
        ("tensor_parallel", "--tensor-parallel-size", {"tensor_parallel_size": 4, "fsdp_version": 2},
         {"tensor_parallel": 4, "dp_shard": 2, "dp_replicate": 1}),
        ("context_parallel", "--context-parallel-size", {"context_parallel_size": 4, "fsdp_version": 2,
                                                         "sample_packing": False},
         {"tensor_parallel": 1, "context_parallel": 4, "dp_shard": 2, "dp_replicate": 1}),
    ],
)  # fmt: skip
def test_model_splitting_strategies_write_a_mesh_that_plans(run_cli, tmp_path, chat_file, model_dir, strategy, flag,
                                                           keys, mesh):  # fmt: skip
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", model_dir, "--dataset", chat_file,
                     "--gpus-per-machine", "8", "--method", "full", "--sequence-len", "65536",
                     "--strategy", strategy, flag, "4")  # fmt: skip
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert {key: raw[key] for key in keys} == keys
    plan = run_cli("plan", output, "--num-processes", "8", "--json")
    assert plan.code == 0, plan.err
    planned = json.loads(plan.out)
    assert planned["mesh"] == mesh and planned["data_parallel_size"] == 2  # not the world size


def test_large_full_fine_tunes_are_offered_background_checkpoints_where_the_strategy_allows(run_cli, tmp_path, chat_file,
                                                                                           model_dir):  # fmt: skip
    def written(*flags) -> dict:
        output = tmp_path / f"r{len(list(tmp_path.glob('r*.yaml')))}.yaml"
        result = run_cli("config", "--yes", "-o", output, "--base-model", model_dir, "--dataset", chat_file,
                         "--method", "full", "--gpus-per-machine", "8", *flags)  # fmt: skip
        assert result.code == 0, result.err
        return yaml.safe_load(output.read_text())

    assert written("--strategy", "fsdp")["async_checkpoint"] is True  # 8B: yes by default, and it plans
    assert "async_checkpoint" not in written("--strategy", "fsdp", "--no-async-checkpoint")
    assert "async_checkpoint" not in written("--strategy", "zero3")  # DeepSpeed writes its own checkpoints


def test_a_file_the_chosen_format_cant_read_is_refused_and_nothing_is_written(run_cli, tmp_path, model_dir, chat_file):
    rows = tmp_path / "own.jsonl"
    rows.write_text(json.dumps({"conversation": [{"speaker": "person", "text": "hi"}], "system": "x"}) + "\n")
    output = tmp_path / "r.yaml"
    for flags, wanted in ((["--dataset", rows], "type alpaca reads 'instruction' and 'output'"),  # not guessed
                          (["--dataset", chat_file, "--dataset-type", "completion"], "type completion reads 'text'")):
        result = run_cli("config", "--yes", "-o", output, "--base-model", model_dir, *flags)
        assert result.code == 2 and wanted in result.err and "Traceback" not in result.err, result.err
        assert result.err.count("error:") == 1 and "--dataset-type" in result.err and not output.exists()


def test_the_default_sequence_len_stays_within_the_models_positions(run_cli, tmp_path, model_dir, chat_file):
    (model_dir / "config.json").write_text(json.dumps({**LLAMA_8B, "max_position_embeddings": 1024}))
    output = tmp_path / "r.yaml"
    assert run_cli("config", "--yes", "-o", output, "--base-model", model_dir, "--dataset", chat_file).code == 0
    assert yaml.safe_load(output.read_text())["sequence_len"] == 1024
    longer = run_cli("config", "--yes", "-o", tmp_path / "l.yaml", "--base-model", model_dir, "--dataset", chat_file,
                     "--sequence-len", "4096")  # fmt: skip
    assert longer.code == 0 and "sequence_len 4096 is beyond the 1024 positions" in longer.err


def test_machines_not_on_one_network_meet_by_the_rendezvous_asked_and_compile_is_asked(run_cli, tmp_path):
    """What `accelerate config` asks beside the machines: the same local network (no: the rendezvous backend, and
    how it meets) and torch dynamo, as the recipe's keys; each with a flag."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "hi", "input": "", "output": "hello"}) + "\n")
    base = ["config", "--yes", "--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--dataset", str(data),
            "--num-machines", "2", "--main-process-ip", "10.0.0.1", "--gpus-per-machine", "2"]  # fmt: skip

    def written(*flags) -> dict:
        output = tmp_path / "r.yaml"
        result = run_cli(*base, "-o", output, "--force", *flags)
        assert result.code == 0, result.err
        return yaml.safe_load(output.read_text())

    same = written()
    assert "rdzv_backend" not in same and "torch_compile" not in same  # static, as accelerate's defaults
    elastic = written("--no-same-network", "--min-machines", "1", "--torch-compile")
    assert (elastic["rdzv_backend"], elastic["min_machines"], elastic["torch_compile"]) == ("c10d", 1, True)
    etcd = written("--rdzv-backend", "etcd", "--rdzv-endpoint", "10.0.0.9:2379")
    assert (etcd["rdzv_backend"], etcd["rdzv_endpoint"]) == ("etcd", "10.0.0.9:2379")
    refused = run_cli(*base, "-o", tmp_path / "x.yaml", "--rdzv-backend", "etcd")
    assert refused.code == 2 and "--rdzv-backend etcd needs --rdzv-endpoint" in refused.err
    assert not (tmp_path / "x.yaml").exists()
    wrong = run_cli(*base, "-o", tmp_path / "x.yaml", "--rdzv-backend", "tcp")
    assert wrong.code == 2 and "--rdzv-backend 'tcp' is not one of static, c10d, etcd" in wrong.err
