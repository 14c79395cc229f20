"""Every kind of user mistake: one line naming the key, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import json

import pytest
from recipe_edits import DROP

BAD_RECIPES = [
    # (id, changes or raw text, words the one-line message must contain, extra CLI args)
    ("typo", {"lora_rr": 8}, ["lora_rr", "lora_r"], []),
    ("empty-file", "", ["empty"], []),
    ("top-level-list", "- base_model: x\n", ["mapping", "list"], []),
    ("yaml-syntax", "base_model: x\ndatasets: [\n  {path: a\nlr: 1\n", ["line"], []),
    ("python-tag", "base_model: !!python/object/apply:os.system ['echo pwned']\n", ["line 1", "tag"], []),
    ("missing-base-model", {"base_model": DROP}, ["base_model", "missing"], []),
    ("missing-datasets", {"datasets": DROP}, ["datasets", "missing"], []),
    ("unknown-dataset-type", {"datasets": [{"path": "org/ds", "type": "alpacca"}]}, ["datasets[0].type", "alpaca"], []),
    ("second-dataset-type", {"datasets": [{"path": "org/a", "type": "alpaca"}, {"path": "org/b", "type": 3}]},
     ["datasets[1].type"], []),
    ("dataset-key-typo", {"datasets": [{"path": "org/ds", "type": "chat_template", "feild_messages": "m"}]},
     ["datasets[0]", "feild_messages", "field_messages"], []),
    ("zero-micro-batch", {"micro_batch_size": 0}, ["micro_batch_size", "greater than 0"], []),
    ("negative-lr", {"learning_rate": -1e-4}, ["learning_rate"], []),
    ("wrong-type", {"sequence_len": "long"}, ["sequence_len", "integer"], []),
    ("deepspeed-and-fsdp", {"deepspeed": "zero2", "fsdp_version": 2}, ["deepspeed", "fsdp"], []),
    ("warmup-both", {"warmup_steps": 10, "warmup_ratio": 0.1}, ["warmup_steps", "warmup_ratio"], []),
    ("wsd-no-decay", {"lr_scheduler": "warmup_stable_decay"}, ["warmup_stable_decay", "num_decay_steps"], []),
    ("4bit-and-8bit", {"adapter": "lora", "load_in_4bit": True, "load_in_8bit": True}, ["load_in_4bit", "load_in_8bit"], []),
    ("qlora-without-4bit", {"adapter": "qlora"}, ["qlora", "load_in_4bit"], []),
    ("bad-adapter", {"adapter": "dora"}, ["adapter", "lora"], []),
    ("bad-optimizer", {"optimizer": "adamw_foo"}, ["optimizer", "adamw_torch"], []),
    ("unknown-preset", {"deepspeed": "zero4"}, ["deepspeed", "zero4", "preset"], []),
    ("missing-model-dir", {"base_model": "./models/nope"}, ["base_model", "does not exist"], []),
    ("missing-data-file", {"datasets": [{"path": "./data/missing.jsonl", "type": "alpaca"}]},
     ["datasets[0].path", "does not exist"], []),
    ("pipeline-sizes", {"pipeline_parallel_size": 3}, ["world size 4", "pipeline_parallel_size 3"], ["--num-processes", "4"]),
    ("pipeline-microbatches", {"pipeline_parallel_size": 2, "pipeline_microbatches": 1}, ["pipeline_microbatches"], []),
    ("xformers-beside-flash", {"xformers_attention": True, "flash_attention": True},
     ["xformers_attention", "flash_attention"], []),
    ("fsdp-word", {"fsdp": ["full_shard", "bogus"]}, ["fsdp", "bogus"], []),
    ("bf16-and-fp16", {"bf16": True, "fp16": True}, ["bf16", "fp16"], []),
    ("special-token-name", {"special_tokens": {"pad": "<pad>"}}, ["special_tokens", "pad_token"], []),
    ("sharegpt-conversation", {"datasets": [{"path": "org/ds", "type": "sharegpt", "conversation": "vicuna_v9"}]},
     ["datasets[0].conversation", "vicuna_v9"], []),
    ("non-string-key", "1: x\nbase_model: m\n", ["key 1"], []),
    ("nvme-without-path", {"deepspeed": "zero3_nvme"}, ["offload_nvme_path"], []),
    ("bad-cluster-split", {}, ["--num-processes 3", "--num-machines 2"],
     ["--num-processes", "3", "--num-machines", "2", "--main-process-ip", "10.0.0.1"]),
    ("bad-machine-rank", {}, ["--machine-rank 2"],
     ["--num-processes", "2", "--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "10.0.0.1"]),
    ("multinode-without-ip", {}, ["--main-process-ip"], ["--num-processes", "2", "--num-machines", "2"]),
    ("qat-scheme", {"qat": {"activation_dtype": "int8", "weight_dtype": "int8"}}, ["qat", "int8", "int8/int4"], []),
    ("qat-nvfp4-group", {"qat": {"weight_dtype": "nvfp4", "group_size": 32}}, ["qat", "nvfp4", "group_size: 16"], []),
    ("qat-dtype", {"qat": {"weight_dtype": "int3"}}, ["qat.weight_dtype", "int4"], []),
    ("qat-key", {"qat": {"weight_dtype": "int4", "groupsize": 32}}, ["qat", "groupsize", "group_size"], []),
    ("qat-with-lora", {"adapter": "lora", "qat": {"weight_dtype": "int4"}}, ["qat", "adapter"], []),
    ("qat-pipeline", {"pipeline_parallel_size": 2, "qat": {"weight_dtype": "int4"}}, ["qat", "pipeline_parallel_size"],
     ["--num-processes", "2"]),
    ("lisa-with-lora", {"adapter": "lora", "lisa_n_layers": 2}, ["lisa_n_layers", "adapter"], []),
    ("lisa-two-ranks", {"lisa_n_layers": 2}, ["lisa_n_layers", "one process"], ["--num-processes", "2"]),
    ("eaft-with-fused-loss", {"use_eaft": True, "liger_fused_linear_cross_entropy": True},
     ["use_eaft", "liger_fused_linear_cross_entropy"], []),
    ("val-and-test-sets", {"val_set_size": 0.1, "test_datasets": [{"path": "org/t", "type": "alpaca"}]},
     ["test_datasets", "val_set_size"], []),
    ("save-strategy-and-steps", {"save_strategy": "epoch", "save_steps": 2},
     ["save_strategy: epoch and save_steps: 2 disagree", "set save_strategy: steps"], []),
    ("eval-strategy-no-and-per-epoch", {"val_set_size": 0.1, "eval_strategy": "no", "evals_per_epoch": 2},
     ["eval_strategy: no and evals_per_epoch: 2 disagree", "remove evals_per_epoch"], []),
    # Axolotl's FSDP word list against itself and fsdp_config: the first word or fsdp_config won silently
    ("fsdp-two-strategies", {"fsdp": ["full_shard", "shard_grad_op"], "fsdp_version": 2},
     ["full_shard and shard_grad_op are two sharding strategies"], []),
    ("fsdp-word-vs-config", {"fsdp": ["full_shard", "offload", "auto_wrap"],
                             "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": False}},
     ["fsdp: offload and fsdp_config.offload_params: False disagree"], []),
    ("fsdp-strategy-vs-reshard", {"fsdp": ["shard_grad_op", "auto_wrap"], "fsdp_version": 2,
                                  "fsdp_config": {"reshard_after_forward": True}},
     ["sharding_strategy SHARD_GRAD_OP and fsdp_config.reshard_after_forward: True disagree"], []),
    ("val-set-whole", {"val_set_size": 1.0}, ["val_set_size: 1", "nothing to train", "count of 2"], []),
    # mappings handed on as keyword arguments: a TypeError at step 1 before
    ("scheduler-kwarg", {"lr_scheduler": "cosine", "lr_scheduler_kwargs": {"num_cylces": 2}},
     ["lr_scheduler_kwargs.num_cylces", "num_cycles"], []),
    ("jinja-syntax", {"chat_template": "jinja", "chat_template_jinja": "{% for m in messages %}{{ m['content'] }"},
     ["chat_template_jinja", "doesn't parse"], []),
    ("dataset-jinja-syntax", {"datasets": [{"path": "org/ds", "type": "chat_template", "chat_template": "jinja",
                                            "chat_template_jinja": "{% if x %}open"}]},
     ["datasets[0]", "chat_template_jinja", "doesn't parse"], []),
    ("checkpointing-kwarg", {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_rentrant": False}},
     ["gradient_checkpointing_kwargs.use_rentrant", "use_reentrant"], []),
]


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize(("changes", "words", "args"), [c[1:] for c in BAD_RECIPES], ids=[c[0] for c in BAD_RECIPES])
def test_bad_recipe_is_one_line_exit_2(run_cli, write_recipe, tmp_path, command, changes, words, args):
    path = write_recipe(text=changes) if isinstance(changes, str) else write_recipe(changes)
    result = run_cli(command, path, *args, "--write", tmp_path / "written") if command == "plan" else run_cli(
        command, path, *args
    )
    assert result.code == 2, result.err + result.out
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("error: ")
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert "Traceback" not in result.err + result.out
    assert not (tmp_path / "written").exists()
    assert not (tmp_path / "out").exists()


def test_python_tag_is_never_executed(run_cli, write_recipe, tmp_path):
    marker = tmp_path / "pwned"
    path = write_recipe(text=f"base_model: !!python/object/apply:os.system ['touch {marker}']\n")
    assert run_cli("validate", path).code == 2
    assert not marker.exists()


def test_missing_recipe_file(run_cli, tmp_path):
    result = run_cli("validate", tmp_path / "nope.yaml")
    assert result.code == 2 and "not found" in result.err and "nope.yaml" in result.err


def test_deepspeed_json_conflicting_with_recipe(run_cli, write_recipe, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    result = run_cli("plan", write_recipe({"deepspeed": str(ds), "micro_batch_size": 2}))
    assert result.code == 2
    assert "train_micro_batch_size_per_gpu" in result.err and "4" in result.err and "2" in result.err


def test_deepspeed_json_syntax_error_names_line(run_cli, write_recipe, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{\n  "zero_optimization": {"stage": 2},\n  oops\n}\n')
    result = run_cli("plan", write_recipe({"deepspeed": str(ds)}))
    assert result.code == 2 and "line 3" in result.err


def test_unknown_cli_flag_is_exit_2(run_cli, write_recipe):
    result = run_cli("validate", write_recipe(), "--num-proceses", "2")
    assert result.code == 2


def test_qlora_with_zero3_plans(run_cli, write_recipe, tmp_path):
    """QLoRA under ZeRO-3 is a plan, not a mistake: the 4-bit weights, stored in the compute dtype, are partitioned
    like any parameter (tests/integration/test_qlora_sharded.py trains it at 2 ranks)."""
    path = write_recipe({"adapter": "qlora", "load_in_4bit": True, "deepspeed": "zero3", "bf16": True})
    result = run_cli("plan", path, "--num-processes", "2", "--write", tmp_path / "written")
    assert result.code == 0, result.err
    config = json.loads((tmp_path / "written" / "deepspeed.json").read_text())
    assert config["zero_optimization"]["stage"] == 3
    assert "QLoRA under ZeRO-3: each rank loads the 4-bit model whole" in result.out


def test_base_model_naming_a_lora_adapter_folder_is_refused_with_the_two_ways_on(tmp_path):
    """An SFT run's LoRA output as the next recipe's base_model: a new adapter trained from the raw base (the SFT
    weights dropped, silently), or a full fine-tune crashed with nothing to train. One line now, with both fixes."""
    from llmtune.errors import UserError
    from llmtune.recipe.loader import recipe_from_mapping

    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 8}))
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    mapping = {"base_model": str(adapter), "adapter": "lora", "datasets": [{"path": str(data), "type": "alpaca"}]}
    with pytest.raises(UserError, match=r"base_model: .*sft is a LoRA adapter \(adapter_config.json, trained on "
                                        r"org/base\), not a model") as err:  # fmt: skip
        recipe_from_mapping(mapping, tmp_path / "r.yaml")
    assert f"lora_model_dir: {adapter}" in err.value.hint and f"llmtune merge {adapter}" in err.value.hint


def test_what_a_run_would_write_over_or_find_too_late_is_one_line_before_anything_starts(run_cli, write_recipe,
                                                                                     tmp_path, data_file):  # fmt: skip
    """From a probe of unseen recipes, each passed validate: output_dir naming the local base model (its weights
    were overwritten) or a dataset folder (the saved model's files then read as data); dataset_prepared_path naming a
    file (a FileExistsError traceback in preprocess and train); a folder's split its file names don't hold (a
    traceback from every rank of train)."""
    import shutil

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    folder = tmp_path / "splits"
    folder.mkdir()
    for split in ("train", "test"):
        shutil.copy(data_file, folder / f"{split}.jsonl")
    for changes, words in (
        ({"base_model": str(model), "output_dir": str(model)}, ["output_dir is base_model", "overwrite"]),
        ({"datasets": [{"path": str(folder), "type": "alpaca"}], "output_dir": str(folder / "run")},
         ["output_dir", "datasets[0].path", "read as data"]),
        ({"dataset_prepared_path": str(data_file)}, ["dataset_prepared_path", "is a file"]),
        ({"datasets": [{"path": str(folder), "type": "alpaca", "split": "validation"}]},
         ["datasets[0].split", "'validation'", "test, train"]),
    ):  # fmt: skip
        for command in ("validate", "train"):
            result = run_cli(command, write_recipe(changes), "--num-processes", "1")
            assert result.code == 2, result.err + result.out
            lines = result.err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.out, result.err
            assert all(word in lines[0] for word in words), (words, lines[0])
            assert not (tmp_path / "out").exists() and not (folder / "run").exists()
    assert (model / "config.json").read_text() == "{}"
    ok = run_cli("validate", write_recipe({"datasets": [{"path": str(folder), "type": "alpaca", "split": "test"}]}))
    assert ok.code == 0, ok.err
