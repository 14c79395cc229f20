"""The planner: strategies, batch arithmetic, resolved DeepSpeed values, commands per machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.pipeline import bubble_fraction, split_layers
from llmtune.recipe.loader import recipe_from_mapping


def recipe(**changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def test_zero3_offload_on_8_processes(run_cli, write_recipe):
    path = write_recipe({"deepspeed": "zero3_offload", "micro_batch_size": 2, "gradient_accumulation_steps": 4})
    result = run_cli("plan", path, "--num-processes", "8", "--json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    ds = plan["deepspeed_config"]
    assert plan["strategy"] == "zero3" and plan["offload"] == "cpu"
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_batch_size"] == 2 * 4 * 8 == plan["global_batch_size"]
    assert '"auto"' not in result.out


def test_human_summary_shows_the_arithmetic(run_cli, write_recipe):
    path = write_recipe({"deepspeed": "zero3_offload", "micro_batch_size": 2, "gradient_accumulation_steps": 4})
    result = run_cli("plan", path, "--num-processes", "8")
    assert result.code == 0
    assert "ZeRO-3 + CPU offload" in result.out
    assert "64 = micro 2 x accumulation 4 x data-parallel 8" in result.out
    assert '"train_batch_size": 64' in result.out


def test_plan_write_gives_files_plain_accelerate_can_use(run_cli, write_recipe, tmp_path):
    out = tmp_path / "cfg"
    result = run_cli("plan", write_recipe({"deepspeed": "zero2"}), "--num-processes", "2", "--write", out)
    assert result.code == 0, result.err
    assert {p.name for p in out.iterdir()} == {
        "plan.json",
        "recipe.resolved.yaml",
        "accelerate_config.yaml",
        "deepspeed.json",
    }
    import yaml

    accel = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert accel["deepspeed_config"]["deepspeed_config_file"] == str((out / "deepspeed.json").resolve())


@pytest.mark.parametrize(
    ("changes", "world", "strategy"),
    [
        ({}, 1, "single"),
        ({}, 4, "ddp"),
        ({"deepspeed": "zero1"}, 2, "zero1"),
        ({"deepspeed": "deepspeed_configs/zero3_bf16.json"}, 2, "zero3"),  # Axolotl's shipped file name
        ({"fsdp_config": {"fsdp_offload_params": False}}, 2, "fsdp2"),
        ({"fsdp": "full_shard auto_wrap"}, 2, "fsdp1"),
        ({"pipeline_parallel_size": 2}, 4, "pipeline"),
    ],
)
def test_strategy_choice(changes, world, strategy):
    plan = make_plan(recipe(**changes), make_cluster(world, device="cuda"))
    assert plan.strategy == strategy
    assert plan.world_size == world


def test_axolotl_shipped_deepspeed_files_stand_for_presets_and_the_plan_says_so(tmp_path, monkeypatch):
    plan = make_plan(
        recipe(deepspeed="deepspeed_configs/zero3_bf16_cpuoffload_all.json"), make_cluster(2, device="cuda")
    )
    assert plan.strategy == "zero3" and plan.deepspeed_config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert any("deepspeed_configs/zero3_bf16_cpuoffload_all.json is Axolotl's own file, not on disk here: llmtune's "
               "zero3_offload preset stands for it" in note for note in plan.notes)  # fmt: skip
    # each of Axolotl's files (v0.18.0, as in every release since v0.4.0): the stage and offloads it holds
    shipped = {"zero1": (1, None, None), "zero1_torch_compile": (1, None, None), "zero2": (2, "cpu", None),
               "zero2_torch_compile": (2, "cpu", None), "zero3": (3, None, None), "zero3_bf16": (3, None, None),
               "zero3_bf16_cpuoffload_all": (3, "cpu", "cpu"), "zero3_bf16_cpuoffload_params": (3, None, "cpu")}  # fmt: skip
    for name, (stage, optimizer, parameters) in shipped.items():
        zero = make_plan(recipe(deepspeed=f"deepspeed_configs/{name}.json"), make_cluster(8, device="cuda"))
        zero = zero.deepspeed_config["zero_optimization"]
        found = [(zero.get(key) or {}).get("device") for key in ("offload_optimizer", "offload_param")]
        assert (zero["stage"], *found) == (stage, optimizer, parameters), name
        if stage == 3:  # the file's own values where it has them (DeepSpeed's defaults for these are 1e9)
            assert (zero["stage3_max_live_parameters"], zero["stage3_max_reuse_distance"], zero["sub_group_size"]) == (
                0, 0, 0), name  # fmt: skip
    # the offload files let torch's optimizer step (zero_force_ds_cpu_optimizer: false), as the file on disk does
    offload = make_plan(recipe(deepspeed="deepspeed_configs/zero3_bf16_cpuoffload_params.json"), make_cluster(2, device="cuda"))
    assert offload.deepspeed_config["zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in make_plan(recipe(deepspeed="deepspeed_configs/zero3_bf16.json"),
                                                          make_cluster(2, device="cuda")).deepspeed_config  # fmt: skip
    # zero2.json offloads the optimizer, so another optimizer than DeepSpeed's CPU Adam is refused, naming the file
    with pytest.raises(UserError) as err:
        make_plan(recipe(deepspeed="deepspeed_configs/zero2.json", optimizer="paged_adamw_8bit"),
                  make_cluster(8, device="cuda"))  # fmt: skip
    assert "optimizer offload of deepspeed: deepspeed_configs/zero2.json" in err.value.one_line()
    assert "deepspeed: zero2 (no offload)" in err.value.one_line()
    # a file of the user's own at that path is read as it is (here: ZeRO-2), and no note claims otherwise
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deepspeed_configs").mkdir()
    (tmp_path / "deepspeed_configs" / "zero3_bf16.json").write_text('{"zero_optimization": {"stage": 2}}')
    own = make_plan(recipe(deepspeed="deepspeed_configs/zero3_bf16.json"), make_cluster(2, device="cuda"))
    assert own.strategy == "zero2" and not any("Axolotl's own file" in note for note in own.notes)


def test_inline_deepspeed_auto_values_are_filled():
    ds = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "scheduler": {"type": "WarmupLR"},
    }
    plan = make_plan(recipe(deepspeed=ds, micro_batch_size=3, gradient_accumulation_steps=2, bf16=True),
                     make_cluster(4, device="cuda"))  # fmt: skip
    config = plan.deepspeed_config
    assert config["train_batch_size"] == 24 and config["gradient_accumulation_steps"] == 2
    assert config["bf16"]["enabled"] is True
    assert isinstance(config["zero_optimization"]["reduce_bucket_size"], int)
    assert "scheduler" not in config and any("scheduler" in n for n in plan.notes)


def test_multi_node_commands_differ_only_in_machine_rank():
    cluster = make_cluster(
        4, num_machines=2, machine_rank=1, main_process_ip="10.1.2.3", main_process_port=29555, device="cuda"
    )
    plan = make_plan(recipe(adapter="lora"), cluster)
    assert len(plan.commands) == 2
    assert plan.commands[0][plan.commands[0].index("--machine_rank") + 1] == "0"
    assert plan.commands[1][plan.commands[1].index("--machine_rank") + 1] == "1"
    assert plan.accelerate_config["main_process_ip"] == "10.1.2.3"
    assert plan.accelerate_config["num_machines"] == 2 and plan.accelerate_config["num_processes"] == 4


def test_cpu_rehearsal_environment(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    plan = make_plan(recipe(deepspeed="zero2", bf16=True), make_cluster(2, device="cpu"))
    assert plan.env["DS_ACCELERATOR"] == "cpu"
    assert plan.precision == "no" and any("rehearsal" in n for n in plan.notes)
    # OpenMP's threads sleep rather than spin between regions (benchmarks/rehearsal_threads.py: spinning cost 5x the
    # CPU of two runs sharing two cores); a user's own setting stays, and a GPU run's environment has none
    assert plan.env["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert "OMP_WAIT_POLICY" not in make_plan(recipe(), make_cluster(2, device="cpu")).env
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert "OMP_WAIT_POLICY" not in make_plan(recipe(), make_cluster(2, device="cuda")).env


def test_pipeline_split_and_bubble(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = make_plan(recipe(base_model=str(tmp_path), pipeline_parallel_size=2, pipeline_microbatches=4),
                     make_cluster(4, device="cuda"))  # fmt: skip
    assert plan.data_parallel_size == 2
    assert plan.pipeline.bubble == pytest.approx(1 / 5)
    layers = plan.pipeline.layers_per_stage
    assert layers[0][0] == 0 and layers[-1][1] == 6 and layers[0][1] == layers[1][0]
    with pytest.raises(UserError, match="needs at least 8 layers"):
        make_plan(recipe(base_model=str(tmp_path), pipeline_parallel_size=8, pipeline_microbatches=8),
                  make_cluster(8, device="cuda"))  # fmt: skip
    # the recipe's accumulation, raised to the stage count, changes the global batch: said, not silent
    raised = make_plan(recipe(base_model=str(tmp_path), pipeline_parallel_size=4, gradient_accumulation_steps=2),
                       make_cluster(4, device="cuda"))  # fmt: skip
    assert raised.pipeline.microbatches == 4 and raised.global_batch_size == 4 * raised.micro_batch_size
    assert any("4 micro-batches per step, not gradient_accumulation_steps 2" in note for note in raised.notes)
    assert not any("micro-batches per step" in note for note in plan.notes)  # pipeline_microbatches says it


def test_split_layers_balances_parameters():
    ranges = split_layers([10] * 8, first_extra=30, last_extra=0, stages=2)
    loads = [sum(10 for _ in r) + (30 if i == 0 else 0) for i, r in enumerate(ranges)]
    assert [len(r) for r in ranges] == [3, 5] or max(loads) <= 60
    assert max(loads) == 60
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


def test_axolotl_only_keys_are_reported_once(run_cli, write_recipe):
    result = run_cli("validate", write_recipe({"strict": False, "wandb_watch": None, "xformers_attention": None}))
    assert result.code == 0
    assert result.out.count("strict: accepted, has no effect") == 1
    assert "xformers_attention: accepted" in result.out


def test_optimizer_names_exist_in_transformers():
    from transformers.training_args import OptimizerNames

    from llmtune.recipe.training import OPTIMIZERS

    assert set(OPTIMIZERS) <= {o.value for o in OptimizerNames}


def test_gloo_on_a_gpu_lets_ranks_share_it_and_refuses_a_pipeline(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU
    with pytest.raises(UserError, match="2 processes per machine but this machine has 1 GPU"):
        make_cluster(2, device="cuda")
    shared = make_cluster(2, device="cuda:gloo")
    assert (shared.device, shared.backend, shared.num_processes) == ("cuda", "gloo", 2)
    assert make_cluster(1, device="cuda").backend == "nccl" and make_cluster(1, device="cpu").backend == "gloo"
    with pytest.raises(UserError, match="--device must be cuda or cpu, not 'cpu:gloo'"):
        make_cluster(1, device="cpu:gloo")
    # torch's device names: the hint says how a run picks its GPUs (it offered cuda:gloo)
    with pytest.raises(UserError, match="not 'cuda:1'") as refused:
        make_cluster(1, device="cuda:1")
    assert "CUDA_VISIBLE_DEVICES=1 llmtune train" in refused.value.hint
    with pytest.raises(UserError, match="not 'gpu'") as refused:
        make_cluster(1, device="gpu")
    assert refused.value.hint == "use --device cuda"
    assert make_plan(recipe(deepspeed="zero3"), shared).strategy == "zero3"
    with pytest.raises(UserError, match="send/recv, which gloo cannot do on CUDA tensors"):
        make_plan(recipe(pipeline_parallel_size=2), shared)


def test_nvme_offload_on_gpus_is_refused_where_async_io_cannot_build():
    """Measured on an H100 image without libaio: every rank died after loading the model. Now: one line, first."""
    from llmtune.launch.preflight import check_nvme_offload

    nvme = recipe(deepspeed="zero3_nvme", offload_nvme_path="/local/nvme")
    on_gpus = make_plan(nvme, make_cluster(num_processes=2, device="cuda"))
    assert on_gpus.offload == "nvme"
    with pytest.raises(UserError) as refused:
        check_nvme_offload(on_gpus, compatible=lambda: False)
    assert "async_io" in str(refused.value) and "libaio-dev" in refused.value.hint
    check_nvme_offload(on_gpus, compatible=lambda: True)  # libaio present: no objection
    rehearsal = make_plan(nvme, make_cluster(num_processes=2, device="cpu"))
    check_nvme_offload(rehearsal, compatible=lambda: False)  # CPU rehearsal: not this check's business
    cpu_offload = make_plan(recipe(deepspeed="zero3_offload"), make_cluster(num_processes=2, device="cuda"))
    check_nvme_offload(cpu_offload, compatible=lambda: False)


@pytest.mark.parametrize(("value", "fixed"), [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("9.0 10.0f", "9.0;10.0"),
                                              ("8.0;9.0", None), ("", None), (None, None), ("9.0+PTX", None)])  # fmt: skip
def test_arch_list_for_deepspeed_drops_arch_suffixes(value, fixed):
    from llmtune.train.runtime.distributed import arch_list_for_deepspeed

    assert arch_list_for_deepspeed(value) == fixed


def test_errors_raised_inside_deepspeed_are_not_blamed_on_the_model_source():
    from llmtune.train.model.load import raised_inside

    namespace: dict = {}
    exec(
        compile("def fail():\n    int('0a')\n", "/site-packages/deepspeed/ops/op_builder/builder.py", "exec"), namespace
    )
    try:
        namespace["fail"]()
    except ValueError as err:
        assert raised_inside(err, "deepspeed") and not raised_inside(err, "transformers")
    try:
        int("0a")
    except ValueError as err:
        assert not raised_inside(err, "deepspeed")


def _llama_config(tmp_path, heads: int = 4, kv_heads: int = 2):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": 128,
              "vocab_size": 512}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("changes", "world", "mesh", "data_parallel"),
    [
        ({"tensor_parallel_size": 2}, 2, (2, 1, 1), 1),
        ({"tensor_parallel_size": 2}, 8, (2, 1, 4), 4),  # no fsdp: the rest are replicas
        ({"tensor_parallel_size": 2, "fsdp_version": 2}, 8, (2, 4, 1), 4),  # with fsdp: the rest shard
        ({"tensor_parallel_size": 2, "fsdp_version": 2, "dp_shard_size": 4, "dp_replicate_size": 2}, 16, (2, 4, 2), 8),
        ({"tensor_parallel_size": 2, "dp_shard_size": 2}, 4, (2, 2, 1), 2),  # dp_shard alone implies FSDP2
    ],
)
def test_tensor_parallel_mesh_and_batch_follow_the_data_parallel_degree(tmp_path, changes, world, mesh, data_parallel):
    plan = make_plan(recipe(base_model=_llama_config(tmp_path), micro_batch_size=2, gradient_accumulation_steps=3,
                            save_only_model=True, **changes), make_cluster(world, device="cuda"))  # fmt: skip
    assert plan.strategy == "tp" and plan.accelerate_config["distributed_type"] == "MULTI_GPU"
    assert (plan.mesh["tensor_parallel"], plan.mesh["dp_shard"], plan.mesh["dp_replicate"]) == mesh
    assert plan.data_parallel_size == data_parallel
    assert plan.global_batch_size == 2 * 3 * data_parallel  # not x world size


@pytest.mark.parametrize(
    ("changes", "world", "words"),
    [
        ({"tensor_parallel_size": 3}, 4, ["tensor_parallel_size 3", "4 attention heads"]),  # the model before the world
        ({"tensor_parallel_size": 4}, 4, ["tensor_parallel_size 4", "2 KV heads"]),
        ({"tensor_parallel_size": 2, "dp_shard_size": 3}, 4, ["world size 4", "not divisible by dp_shard_size 3", "--num-processes 6"]),
        ({"fsdp_version": 2, "dp_replicate_size": 3}, 4, ["world size 4", "dp_replicate_size 3"]),
        ({"dp_shard_size": 2}, 2, ["dp_shard_size", "fsdp_version: 2"]),
    ],
)
def test_impossible_parallel_sizes_name_the_arithmetic(tmp_path, changes, world, words):
    with pytest.raises(UserError) as err:
        make_plan(recipe(base_model=_llama_config(tmp_path), **{"save_only_model": True, **changes}),
                  make_cluster(world, device="cuda"))  # fmt: skip
    assert all(word in err.value.one_line() for word in words), err.value.one_line()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"deepspeed": "zero3"}, ["tensor_parallel_size", "DeepSpeed"]),
        ({"fsdp": ["full_shard"]}, ["FSDP2"]),
        ({"adapter": "lora"}, ["tensor_parallel_size", "adapter"]),
        ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size"]),
    ],
)
def test_tensor_parallel_refuses_what_it_cannot_combine_with(changes, words):
    with pytest.raises(UserError) as err:
        recipe(tensor_parallel_size=2, **changes)
    assert all(word in err.value.one_line() for word in words), err.value.one_line()


def test_hsdp_plans_a_replicated_fsdp2_mesh(tmp_path):
    plan = make_plan(recipe(fsdp_version=2, dp_replicate_size=2), make_cluster(8, device="cuda"))
    assert plan.strategy == "fsdp2" and plan.mesh == {
        "tensor_parallel": 1,
        "context_parallel": 1,
        "dp_shard": 4,
        "dp_replicate": 2,
    }
    assert plan.data_parallel_size == 8 and any("HSDP" in n for n in plan.notes)
    assert make_plan(recipe(fsdp_version=2, dp_shard_size=8), make_cluster(8, device="cuda")).mesh is None
    # NO_SHARD has no FSDP2 form: it planned a full shard without a word
    with pytest.raises(UserError, match="sharding_strategy NO_SHARD has no FSDP2 form"):
        recipe(fsdp_version=2, fsdp_config={"sharding_strategy": "NO_SHARD"})
    assert recipe(fsdp=["no_shard"]).resolved_fsdp()[0] == 1  # Axolotl's word list is FSDP1, which has it


@pytest.mark.parametrize(
    ("changes", "world", "mesh", "data_parallel"),
    [
        ({}, 2, (2, 1, 1), 1),
        ({}, 8, (2, 4, 1), 4),  # the rest shard
        ({"dp_replicate_size": 2}, 8, (2, 2, 2), 4),
    ],
)
def test_context_parallel_mesh_and_batch(changes, world, mesh, data_parallel):
    plan = make_plan(recipe(fsdp_version=2, context_parallel_size=2, micro_batch_size=2, **changes),
                     make_cluster(world, device="cuda"))  # fmt: skip
    assert plan.strategy == "fsdp2"
    assert (plan.mesh["context_parallel"], plan.mesh["dp_shard"], plan.mesh["dp_replicate"]) == mesh
    assert plan.data_parallel_size == data_parallel and plan.global_batch_size == 2 * data_parallel
    assert any("context parallel" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({}, ["context parallelism needs a sharding engine", "fsdp_version: 2", "deepspeed"]),
        ({"fsdp_version": 2, "sample_packing": True}, ["sample_packing and FSDP2", "sample_packing: false",
                                                       "deepspeed"]),
        ({"fsdp_version": 2, "attn_implementation": "flash_attention_2"}, ["sdpa"]),
        ({"fsdp_version": 2, "tensor_parallel_size": 2}, ["alone", "tensor_parallel_size", "not supported"]),
        ({"deepspeed": "zero3", "tensor_parallel_size": 2}, ["tensor_parallel_size"]),
        ({"deepspeed": "zero2", "attn_implementation": "eager"}, ["eager", "under DeepSpeed", "Ulysses"]),
        ({"deepspeed": "zero2", "use_eaft": True}, ["use_eaft", "Ulysses"]),
    ],
)  # fmt: skip
def test_context_parallel_refusals_say_why(changes, words):
    with pytest.raises(UserError) as err:
        recipe(context_parallel_size=2, **changes)
    assert all(word in err.value.one_line() for word in words), err.value.one_line()


@pytest.mark.parametrize(("world", "data_parallel"), [(2, 1), (4, 2)])
def test_context_parallel_under_deepspeed_runs_ulysses(tmp_path, world, data_parallel):
    """context_parallel_size beside deepspeed: DeepSpeed's Ulysses (packed rows too), ZeRO over every rank, the global
    batch by the data-parallel groups; the JSON's train_batch_size is left to accelerate, which sets it for them."""
    plan = make_plan(recipe(base_model=_llama_config(tmp_path), deepspeed="zero2", context_parallel_size=2,
                            sample_packing=True, micro_batch_size=2), make_cluster(world, device="cuda"))  # fmt: skip
    assert plan.strategy == "zero2" and plan.mesh == {"tensor_parallel": 1, "context_parallel": 2,
                                                      "dp_shard": data_parallel, "dp_replicate": 1,
                                                      "sequence_parallel": "ulysses"}  # fmt: skip
    assert plan.data_parallel_size == data_parallel and plan.global_batch_size == 2 * data_parallel
    assert plan.deepspeed_config["train_batch_size"] == "auto"
    assert plan.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
    assert any("DeepSpeed Ulysses" in note for note in plan.notes)
    batches = plan.kernels["batches"]
    assert batches["layout"] == "sequence-split" and batches["attention"] == "llmtune_varlen"
    assert batches["kernel"] == "torch_varlen"  # the GPU run's (bf16 on CUDA)


def test_context_parallel_under_zero3_keeps_deepspeed_s_reduce_scatter():
    """llmtune scales the Ulysses loss to ZeRO-3's reduce-scatter averaging; without it DeepSpeed averages buckets
    over different rank counts, so the recipe is refused in one line."""
    config = {"zero_optimization": {"stage": 3, "reduce_scatter": False}}
    with pytest.raises(UserError, match="reduce_scatter: false with ZeRO-3 and context parallelism"):
        make_plan(recipe(deepspeed=config, context_parallel_size=2), make_cluster(2, device="cuda"))
    assert make_plan(recipe(deepspeed="zero3", context_parallel_size=2), make_cluster(2, device="cuda")).mesh


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "match"),
    [(4, 2, 3, "does not divide the model's 4 attention heads"), (12, 3, 2, "don't divide one another")],
)
def test_context_parallel_under_deepspeed_needs_heads_that_split(tmp_path, heads, kv_heads, size, match):
    config = json.loads(Path(_llama_config(tmp_path), "config.json").read_text())
    config.update(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * 16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=match):
        make_plan(recipe(base_model=str(tmp_path), deepspeed="zero2", context_parallel_size=size),
                  make_cluster(size * 2, device="cuda"))  # fmt: skip


def test_context_parallel_world_must_divide():
    with pytest.raises(UserError, match="world size 3 is not divisible by context_parallel_size 2"):
        make_plan(recipe(fsdp_version=2, context_parallel_size=2), make_cluster(3, device="cuda"))


def test_context_parallel_refuses_models_with_state_space_layers(tmp_path):
    config = json.loads(Path(_llama_config(tmp_path), "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "nemotron_h"}))
    with pytest.raises(UserError, match="context parallelism for nemotron_h models is not supported"):
        make_plan(recipe(base_model=str(tmp_path), fsdp_version=2, context_parallel_size=2),
                  make_cluster(2, device="cuda"))  # fmt: skip


def test_context_parallel_refuses_loaded_models_with_other_sequence_mixers():
    from torch import nn

    from llmtune.train.runtime.ranks import check_attention_only

    class MambaMixer(nn.Module):
        pass

    model = nn.Sequential(nn.Linear(2, 2))
    check_attention_only(model)  # attention-only (here: no mixer at all) passes
    model.append(MambaMixer())
    with pytest.raises(UserError, match=r"1 \(MambaMixer\) mixes tokens outside attention"):
        check_attention_only(model)


def test_steps_per_epoch_follow_the_data_parallel_degree_under_tensor_and_context_parallel(tmp_path):
    from llmtune.train.engine.arguments import steps_per_epoch

    base = _llama_config(tmp_path)
    tp = make_plan(recipe(base_model=base, tensor_parallel_size=2, micro_batch_size=4, save_strategy="no"),
                   make_cluster(4, device="cuda"))  # fmt: skip
    cp = make_plan(recipe(base_model=base, fsdp_version=2, context_parallel_size=2, micro_batch_size=4),
                   make_cluster(4, device="cuda"))  # fmt: skip
    for plan in (tp, cp):  # 64 rows, 4 per rank, 2 data-parallel groups (not 4 ranks): 8 steps, not 4
        assert plan.data_parallel_size == 2 and steps_per_epoch(64, plan.to_dict()) == 8


# Combinations that pass a CPU rehearsal and fail (or compute something else) over NCCL: refused at plan time, on
# every device, in one line naming the keys; the neighbouring valid combination still plans.
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"


@pytest.mark.parametrize(
    ("fused", "key"),
    [
        ({"liger_fused_linear_cross_entropy": True}, "liger_fused_linear_cross_entropy"),
        ({"cut_cross_entropy": True}, "cut_cross_entropy"),  # runs as Liger's fused linear cross-entropy
        ({"plugins": [CCE]}, f"plugins: {CCE}"),  # Axolotl's way to turn it on
    ],
)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_tensor_parallel_refuses_the_fused_linear_cross_entropy(fused, key, device):
    with pytest.raises(UserError) as err:
        make_plan(recipe(tensor_parallel_size=2, **fused), make_cluster(2, device=device))
    line = err.value.one_line()
    assert line.startswith(f"{key} with tensor_parallel_size 2 is not supported"), line
    assert "whole lm_head weight" in line and "DTensor shard" in line and "liger_cross_entropy: true" in err.value.hint
    # the neighbours plan: tensor parallel with Liger's plain cross-entropy, and the fused kernel without TP
    assert (
        make_plan(recipe(tensor_parallel_size=2, liger_cross_entropy=True), make_cluster(2, device=device)).strategy
        == "tp"
    )
    assert make_plan(recipe(fsdp_version=2, **fused), make_cluster(2, device=device)).strategy == "fsdp2"


@pytest.mark.parametrize(
    ("fsdp", "key"),
    [
        ({"fsdp_config": {"offload_params": True}}, "fsdp_config.offload_params"),
        ({"fsdp_config": {"fsdp_offload_params": True}}, "fsdp_config.offload_params"),  # Axolotl's spelling
        ({"fsdp": ["full_shard", "auto_wrap", "offload"]}, "fsdp: offload"),
    ],
)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_muon_refuses_fsdp2_parameter_offload(fsdp, key, device):
    with pytest.raises(UserError) as err:
        make_plan(recipe(optimizer="muon", fsdp_version=2, **fsdp), make_cluster(2, device=device))
    line = err.value.one_line()
    assert line.startswith(f"optimizer: muon with {key} is not supported"), line
    assert "Newton-Schulz" in line and "whole weight matrix" in line and "CPU" in line
    # the neighbours plan: muon under FSDP2 without offload, and AdamW with the offload
    assert make_plan(recipe(optimizer="muon", fsdp_version=2), make_cluster(2, device=device)).strategy == "fsdp2"
    assert make_plan(recipe(fsdp_version=2, **fsdp), make_cluster(2, device=device)).offload == "cpu"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tensor_parallel_size": 2, "liger_fused_linear_cross_entropy": True},
         ["liger_fused_linear_cross_entropy with tensor_parallel_size 2", "DTensor shard"]),
        ({"optimizer": "muon", "fsdp_version": 2, "fsdp_config": {"offload_params": True}},
         ["optimizer: muon with fsdp_config.offload_params", "Newton-Schulz"]),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_refused_combinations_end_the_cli_in_one_line(run_cli, write_recipe, changes, words, command):
    flags = ["--num-processes", "2", "--device", "cpu"] if command == "plan" else []
    result = run_cli(command, write_recipe(changes), *flags)
    assert result.code == 2, (result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.err, result.err
    assert all(word in lines[0] for word in words), lines[0]


def _machines(count: int, **flags):
    return make_cluster(2 * count, num_machines=count, main_process_ip="10.0.0.1", device="cuda", **flags)


def test_tensor_parallel_checkpoints_across_machines_need_a_shared_output_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    plan = make_plan(recipe(tensor_parallel_size=2), _machines(2))
    assert plan.shared_output_dir and "tp_state" in plan.shared_output_dir  # the machines' check-in tests it
    assert any("output_dir must be on storage every machine shares" in note for note in plan.notes)
    assert make_plan(recipe(tensor_parallel_size=2, save_only_model=True), _machines(2)).shared_output_dir is None
    assert make_plan(recipe(tensor_parallel_size=2), _machines(1)).shared_output_dir is None
    # launches that skip the check-in can't learn it before training: refused, naming what skips it
    with pytest.raises(UserError) as err:
        make_plan(recipe(tensor_parallel_size=2, rdzv_backend="c10d"), _machines(2))
    assert "rdzv_backend: c10d starts them without that check" in err.value.one_line()
    assert "remove rdzv_backend: c10d" in err.value.hint and "save_only_model: true" in err.value.hint
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("10.0.0.1 slots=2\n10.0.0.2 slots=2\n")
    with pytest.raises(UserError, match="DeepSpeed's launcher over ssh starts them without that check"):
        make_plan(
            recipe(tensor_parallel_size=2), make_cluster(launcher="deepspeed", hostfile=str(hostfile), device="cuda")
        )
    no_ssh = make_cluster(launcher="deepspeed", hostfile=str(hostfile), device="cuda", no_ssh=True)
    assert make_plan(recipe(tensor_parallel_size=2), no_ssh).shared_output_dir  # each machine checks in


def test_a_deepspeed_file_that_forces_bf16_rehearses_in_fp32_and_says_so(tmp_path):
    # Axolotl's zero3_bf16*.json hold "bf16": {"enabled": true}; CPU processes run fp32, as they do the recipe's bf16
    path = tmp_path / "zero3_bf16.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    cpu = make_plan(recipe(deepspeed=str(path), bf16=True), make_cluster(2, device="cpu"))
    assert cpu.deepspeed_config["bf16"]["enabled"] is False and cpu.precision == "no"
    assert any("deepspeed config's bf16.enabled becomes fp32" in note for note in cpu.notes)
    gpu = make_plan(recipe(deepspeed=str(path), bf16=True), make_cluster(2, device="cuda"))
    assert gpu.deepspeed_config["bf16"]["enabled"] is True
    with pytest.raises(UserError, match=r"sets bf16.enabled = True but the recipe implies False \(from the recipe's "
                                        r"precision\)"):  # fmt: skip
        make_plan(recipe(deepspeed=str(path), bf16=False), make_cluster(2, device="cuda"))  # the recipe must agree
    clipped = tmp_path / "clip.json"
    clipped.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}))
    with pytest.raises(UserError) as err:  # the recipe key that disagrees, named (the recipe had left it out)
        make_plan(recipe(deepspeed=str(clipped)), make_cluster(2, device="cuda"))
    assert err.value.message.endswith("sets gradient_clipping = 0.3 but the recipe implies 1.0 (from max_grad_norm "
                                      "(default 1.0))") and err.value.hint.endswith("or change max_grad_norm")  # fmt: skip
    # bf16 left out is Axolotl's bf16: auto, which agrees with the file on a GPU
    assert make_plan(recipe(deepspeed=str(path)), make_cluster(2, device="cuda")).precision == "bf16"


def test_deepspeed_json_values_are_read_as_deepspeed_reads_them():
    # "stage": "3" is ZeRO-3 to DeepSpeed, but transformers' is_zero3() compares it with the number: written as 3
    plan = make_plan(recipe(deepspeed={"zero_optimization": {"stage": "3"}}), make_cluster(2, device="cuda"))
    assert plan.strategy == "zero3" and plan.deepspeed_config["zero_optimization"]["stage"] == 3
    # offload_param at stage 2 does nothing in DeepSpeed: neither the JSON nor the plan claims it
    stage2 = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    plan = make_plan(recipe(deepspeed=stage2), make_cluster(2, device="cuda"))
    assert "offload_param" not in plan.deepspeed_config["zero_optimization"] and plan.offload == "none"
    assert any("offload_param works at ZeRO stage 3 only" in note for note in plan.notes)


def test_a_data_parallel_size_that_does_not_divide_the_world_is_named_alone():
    with pytest.raises(UserError) as err:
        make_plan(recipe(fsdp_version=2, dp_shard_size=3), make_cluster(8, device="cuda"))
    assert err.value.one_line().startswith("world size 8 is not divisible by dp_shard_size 3 (hint: use --num-processes 6")


def test_fsdp_plans_say_what_axolotl_would_have_run_and_refuse_another_models_layer_class(tmp_path):
    plan = make_plan(recipe(fsdp_config={"fsdp_use_orig_params": False, "fsdp_offload_params": True}),
                     make_cluster(8, device="cuda"))  # fmt: skip
    assert plan.strategy == "fsdp2"
    assert any("without fsdp_version runs FSDP2 (Axolotl would run FSDP1" in note for note in plan.notes)
    assert any("use_orig_params is an FSDP1 key with no FSDP2 counterpart" in note for note in plan.notes)
    asked = make_plan(recipe(fsdp_version=2, fsdp_config={"offload_params": True}), make_cluster(8, device="cuda"))
    assert not any("FSDP1" in note for note in asked.notes)
    # a wrap class copied from another model's recipe: one line naming the model's own, before any rank starts
    llama = _llama_config(tmp_path)
    with pytest.raises(UserError) as err:
        make_plan(recipe(base_model=llama, fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrap":
                                                                         "MistralDecoderLayer"}),
                  make_cluster(8, device="cuda"))  # fmt: skip
    assert "MistralDecoderLayer is not a class of llama models" in err.value.one_line()
    assert "use LlamaDecoderLayer" in err.value.one_line()
    own = make_plan(recipe(base_model=llama, fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrap":
                                                                          "LlamaDecoderLayer"}),
                    make_cluster(8, device="cuda"))  # fmt: skip
    assert own.accelerate_config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    # accelerate splits on "," and looks for " LlamaRMSNorm" (with its space): written as accelerate reads it
    for written in ("LlamaDecoderLayer, LlamaRMSNorm", ["LlamaDecoderLayer", " LlamaRMSNorm"]):
        two = make_plan(recipe(base_model=llama, fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrap": written}),
                        make_cluster(8, device="cuda"))  # fmt: skip
        assert two.accelerate_config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == \
            "LlamaDecoderLayer,LlamaRMSNorm"  # fmt: skip
    # a class of the modelling file that is a whole model, never a module inside the loaded one
    for whole in ("LlamaForSequenceClassification", "LlamaPreTrainedModel"):
        with pytest.raises(UserError) as err:
            make_plan(recipe(base_model=llama, fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrap": whole}),
                      make_cluster(8, device="cuda"))  # fmt: skip
        assert f"{whole} is a whole-model class, not a layer inside the model" in err.value.one_line()
    # FSDP2's size-based wrap would hand fully_shard the ModuleList of layers: refused, with what works
    with pytest.raises(UserError) as err:
        make_plan(recipe(base_model=llama, fsdp_version=2, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP",
                                                                         "min_num_params": 100_000_000}),
                  make_cluster(8, device="cuda"))  # fmt: skip
    assert "SIZE_BASED_WRAP under FSDP2" in err.value.message and "TRANSFORMER_BASED_WRAP" in err.value.hint
    assert make_plan(recipe(base_model=llama, fsdp_version=1, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP"}),
                     make_cluster(8, device="cuda")).strategy == "fsdp1"  # fmt: skip


def test_precision_defaults_to_bf16_auto_as_axolotl_and_falls_back_to_fp16_before_ampere(monkeypatch):
    from llmtune.plan.memory import fit

    # no bf16 in the recipe is Axolotl's default since v0.5.0, bf16: auto; the plan says so
    plain = make_plan(recipe(), make_cluster(8, device="cuda"))
    assert plain.precision == "bf16" and plain.deepspeed_config is None
    assert any("bf16: auto (the default, as in Axolotl)" in n for n in plain.notes)
    said = make_plan(recipe(bf16=False), make_cluster(8, device="cuda"))
    assert said.precision == "no" and not any("bf16: auto" in n for n in said.notes)
    # fp16 asked for wins over bf16: auto (Axolotl turns auto off beside fp16)
    assert make_plan(recipe(bf16="auto", fp16=True), make_cluster(8, device="cuda")).precision == "fp16"
    assert make_plan(recipe(bf16="auto"), make_cluster(8, device="cuda")).precision == "bf16"
    assert make_plan(recipe(), make_cluster(2, device="cpu")).precision == "no"  # the rehearsal computes in fp32
    # on GPUs before Ampere (nvidia-smi's compute_cap below 8.0), auto is fp16, as Axolotl resolves it
    monkeypatch.setattr(fit, "gpu_compute_capability_of_this_machine", lambda: 7.0)
    volta = make_plan(recipe(deepspeed={"zero_optimization": {"stage": 2}}), make_cluster(8, device="cuda"))
    assert volta.precision == "fp16" and volta.deepspeed_config["fp16"]["enabled"] is True
    assert any("compute capability 7, which have no bf16" in n for n in volta.notes)
    assert make_plan(recipe(bf16=True), make_cluster(8, device="cuda")).precision == "bf16"  # asked for: kept


def test_gpu_queries_read_only_the_gpus_cuda_visible_devices_names_and_old_drivers_by_name(monkeypatch):
    """The precision and the memory check read nvidia-smi; a job given some GPUs of a mixed machine (by index or
    UUID) is planned for those, and a driver whose nvidia-smi has no compute_cap field is read by the GPU's name."""
    import shutil
    import subprocess

    from llmtune.plan.memory import fit

    table = {"0": ("GPU-aaaa1111", "7.5", "15360", "Tesla T4"), "1": ("GPU-bbbb2222", "9.0", "81559", "NVIDIA H100")}
    old_driver = {"yes": False}

    def smi(cmd, **_):
        fields = cmd[1].removeprefix("--query-gpu=").split(",")
        if old_driver["yes"] and "compute_cap" in fields:
            raise subprocess.CalledProcessError(2, cmd, "Field \"compute_cap\" is not a valid field to query.")
        column = {"compute_cap": 1, "memory.total": 2, "name": 3}
        lines = [", ".join([i, row[0], *(row[column[f]] for f in fields[2:])]) for i, row in table.items()]
        return subprocess.CompletedProcess(cmd, 0, stdout="\n".join(lines) + "\n")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", smi)

    def read(visible):
        fit.gpu_compute_capability_of_this_machine.cache_clear()
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        memory = fit.gpu_memory_of_this_machine()
        return fit.gpu_compute_capability_of_this_machine(), memory and round(memory / 2**20)

    assert read(None) == (7.5, 15360)  # every GPU: the weakest decides
    assert read("1") == (9.0, 81559)  # only the H100: bf16, and its memory
    assert read("GPU-bbbb") == (9.0, 81559)  # a UUID prefix, as CUDA takes it
    assert read("1,7,0") == (9.0, 81559)  # CUDA stops at the first entry that names no GPU
    assert read("MIG-1234") == (7.5, 15360)  # a MIG instance isn't mapped here: every GPU counts
    old_driver["yes"] = True
    assert read("0") == (7.5, 15360) and read("1") == (9.0, 81559)  # from the name
    assert fit.capability_from_name("NVIDIA A100-SXM4-80GB") == 8.0 and fit.capability_from_name("NVIDIA A10G") == 8.6
    assert fit.capability_from_name("Tesla V100-SXM2-16GB") == 7.0 and fit.capability_from_name("Radeon") is None
    fit.gpu_compute_capability_of_this_machine.cache_clear()


def test_kto_with_one_row_per_micro_batch_is_refused_before_launch():
    """TRL's KTO refuses micro-batches of one (its KL term comes from the others), but only after the model is
    loaded; the plan says it first, naming the key."""
    kto = {"rl": "kto", "datasets": [{"path": "x", "type": "chatml.argilla"}]}
    with pytest.raises(UserError, match="rl: kto needs micro_batch_size 2 or more"):
        make_plan(recipe(**kto), make_cluster(1, device="cuda"))
    assert make_plan(recipe(micro_batch_size=2, **kto), make_cluster(1, device="cuda")).global_batch_size == 2


def test_plan_write_on_a_machine_without_gpus_says_the_files_are_the_rehearsals(run_cli, write_recipe, tmp_path):
    """Without --device, a machine with no GPU plans the CPU rehearsal (gloo, fp32): --write's files say so, with the
    flag that writes the GPU machines' files (a login node or a laptop gave fp32 configs without a word)."""
    from llmtune.plan.memory.fit import gpu_memory_of_this_machine

    if gpu_memory_of_this_machine() is not None:
        pytest.skip("this machine has a GPU: plan's default device is cuda here")
    path = write_recipe({})
    rehearsal = run_cli("plan", path, "--num-processes", "2", "--write", str(tmp_path / "cpu"))
    assert rehearsal.code == 0 and "for the GPU machines' files add --device cuda" in rehearsal.err
    gpu = run_cli("plan", path, "--num-processes", "2", "--write", str(tmp_path / "gpu"), "--device", "cuda")
    assert gpu.code == 0 and "add --device cuda" not in gpu.err


@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": "3"}, 'zero_optimization is "3", and DeepSpeed reads it as a JSON object'),
    ({"zero_optimization": {"stage": "three"}}, 'zero_optimization.stage is "three" (hint: use 0, 1, 2 or 3)'),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}}, 'zero_optimization.offload_optimizer is "cpu"'),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "offload_param is {\"device\": \"gpu\"}"),
    ({"zero_optimization": {"stage": 2}, "optimizer": "AdamW"}, 'optimizer is "AdamW", and DeepSpeed reads it as'),
    ({"zero_optimization": {"stage": 2}, "bf16": True}, "bf16 is true, and DeepSpeed reads it as a JSON object "
                                                        "(hint: write it as {enabled: true})"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "offload_param offloads to NVMe without an nvme_path (hint: set offload_nvme_path in the recipe"),
])  # fmt: skip
def test_a_deepspeed_json_of_the_wrong_shape_is_one_line_naming_the_key(config, message):
    """Each was a traceback (ValueError, AttributeError), or DeepSpeed's error on every rank at start-up."""
    with pytest.raises(UserError) as err:
        make_plan(recipe(deepspeed=config), make_cluster(8, device="cuda"))
    assert message in err.value.one_line() and "inline deepspeed mapping" in err.value.one_line()


@pytest.mark.parametrize("config", [
    {"zero_optimization": {"stage": 2}, "bf16": "auto"},  # filled from the recipe
    {"zero_optimization": {"stage": 2}, "bf16": None, "fp16": None, "optimizer": None},  # null: left out
    {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}},  # DeepSpeed ignores it below ZeRO-3
])  # fmt: skip
def test_deepspeed_json_sections_that_were_taken_before_still_are(config):
    plan = make_plan(recipe(deepspeed=config, bf16=True), make_cluster(8, device="cuda"))
    assert plan.strategy == "zero2" and plan.deepspeed_config["bf16"] == {"enabled": True}
    assert "offload_param" not in plan.deepspeed_config["zero_optimization"]


def test_nvme_offload_takes_the_recipe_s_path_and_buffers_that_hold_the_largest_partition():
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    plan = make_plan(recipe(deepspeed=nvme, offload_nvme_path="/local_nvme"), make_cluster(8, device="cuda"))
    assert plan.deepspeed_config["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme"
    # Llama-3.1-70B on 8 GPUs: a rank's share of the embedding is 1.3e8 elements, over DeepSpeed's 1e8 buffer
    preset = make_plan(recipe(base_model="meta-llama/Llama-3.1-70B", deepspeed="zero3_nvme", offload_nvme_path="/nv"),
                       make_cluster(8, device="cuda")).deepspeed_config["zero_optimization"]["offload_param"]  # fmt: skip
    assert preset["buffer_size"] == -(-128256 * 8192 // 8) > 100_000_000


def test_a_deepspeed_json_key_deepspeed_doesn_t_know_is_refused_before_launch(tmp_path):
    from llmtune.launch.preflight import check_deepspeed_schema

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sizes": 5e8}}))
    typo = recipe(deepspeed=str(path))
    with pytest.raises(UserError) as err:
        check_deepspeed_schema(typo, make_plan(typo, make_cluster(8, device="cuda")))
    line = err.value.one_line()
    assert f"deepspeed file {path}: zero_optimization.stage3_prefetch_bucket_sizes: Extra inputs" in line
    assert "did you mean stage3_prefetch_bucket_size?" in line
    good = recipe(deepspeed={"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e8}})
    check_deepspeed_schema(good, make_plan(good, make_cluster(8, device="cuda")))  # DeepSpeed's model takes it
    preset = recipe(deepspeed="zero3_offload")
    check_deepspeed_schema(preset, make_plan(preset, make_cluster(8, device="cuda")))


def test_early_stopping_without_eval_data_is_noted_as_having_no_effect():
    said = make_plan(recipe(early_stopping_patience=2), make_cluster(1, device="cpu")).notes
    assert any(note.startswith("early_stopping_patience: no effect") for note in said), said
    said = make_plan(recipe(early_stopping_patience=2, val_set_size=0.1), make_cluster(1, device="cpu")).notes
    assert not any("early_stopping_patience" in note for note in said), said
    # evaluation keys alone: no evaluation ran, and nothing said so
    said = make_plan(recipe(eval_strategy="steps", eval_steps=2), make_cluster(1, device="cpu")).notes
    assert [n.split(":")[0] for n in said if ": no effect: the recipe has no eval data" in n] == ["eval_steps",
                                                                                                 "eval_strategy"]


def test_default_system_message_where_no_dataset_reads_it_is_noted_as_having_no_effect():
    """Axolotl gave it to sharegpt conversations in chatml/llama3 under the same chat_template; a chat_template
    dataset never saw it, and nothing said so."""
    cpu = make_cluster(1, device="cpu")
    chat = [{"path": "org/d", "type": "chat_template"}]
    said = make_plan(recipe(datasets=chat, chat_template="chatml", default_system_message="Be kind."), cpu).notes
    assert any(note.startswith("default_system_message: no effect here") for note in said), said
    sharegpt = [{"path": "org/d", "type": "sharegpt", "conversation": "chatml"}]
    said = make_plan(recipe(datasets=sharegpt, chat_template="chatml", default_system_message="Be kind."), cpu).notes
    assert not any("default_system_message" in note for note in said), said


def test_a_zero3_file_without_the_gather_key_saves_a_model_file_and_the_size_wrap_is_shown(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    plan = make_plan(recipe(deepspeed=str(config)), make_cluster(2, device="cuda"))
    assert plan.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert any("stage3_gather_16bit_weights_on_model_save set true" in note for note in plan.notes)
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}))
    plan = make_plan(recipe(deepspeed=str(config)), make_cluster(2, device="cuda"))
    assert any("is false: the final model is saved as ZeRO-3 shards" in note for note in plan.notes)
    from llmtune.plan.render import summary_lines

    keys = recipe(fsdp=["full_shard", "auto_wrap"], fsdp_config={"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                  "fsdp_min_num_params": 1000, "fsdp_backward_prefetch_policy": "BACKWARD_POST"})  # fmt: skip
    sized = make_plan(keys, make_cluster(2, device="cuda"))
    assert "wrap every module of 1,000+ parameters (size-based)" in dict(summary_lines(sized, keys))["fsdp"]
    assert sized.accelerate_config["fsdp_config"]["fsdp_backward_prefetch"] == "BACKWARD_POST"  # the older name


def test_zero3_keys_by_deepspeeds_field_names_are_kept_as_written(tmp_path):
    """Axolotl's zero3_bf16.json writes gather_16bit_weights_on_model_save and max_live_parameters, DeepSpeed's
    field names for the stage3_ aliases: the file's setting stands (no alias added beside it, which DeepSpeed
    refuses), and "auto" resolves under either spelling."""
    from llmtune.launch.preflight import check_deepspeed_schema

    config = tmp_path / "zero3_bf16.json"
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "max_live_parameters": 0, "max_reuse_distance": 0,
            "gather_16bit_weights_on_model_save": True}  # fmt: skip
    del zero["prefetch_bucket_size"]
    config.write_text(json.dumps({"zero_optimization": zero, "bf16": {"enabled": "auto"}}))
    keys = recipe(deepspeed=str(config), bf16=True)
    plan = make_plan(keys, make_cluster(8, device="cuda"))
    written = plan.deepspeed_config["zero_optimization"]
    assert written["gather_16bit_weights_on_model_save"] is True and "stage3_gather_16bit_weights_on_model_save" not in written
    assert not any("set true (not in the file" in note for note in plan.notes), plan.notes
    check_deepspeed_schema(keys, plan)  # DeepSpeed's own model takes the written section
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto",
                                                        "gather_16bit_weights_on_model_save": False}}))  # fmt: skip
    keys = recipe(deepspeed=str(config))
    plan = make_plan(keys, make_cluster(8, device="cuda"))
    assert isinstance(plan.deepspeed_config["zero_optimization"]["prefetch_bucket_size"], int)
    assert any("gather_16bit_weights_on_model_save is false" in note for note in plan.notes), plan.notes
    check_deepspeed_schema(keys, plan)

def test_a_text_model_types_wrap_class_is_checked_in_its_familys_modelling_files():
    from llmtune.plan.checks import check_wrap_class
    from llmtune.plan.memory.facts import facts_from_config

    facts = facts_from_config({"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "vocab_size": 100})  # fmt: skip
    with pytest.raises(UserError, match="LlamaDecoderLayer is not a class of gemma3_text") as caught:
        check_wrap_class("LlamaDecoderLayer", facts)
    assert "Gemma3DecoderLayer" in caught.value.hint
    check_wrap_class("Gemma3DecoderLayer", facts)


def test_cuda_without_a_process_count_on_a_machine_without_gpus_says_so(monkeypatch):
    """`llmtune plan recipe --device cuda` here said `--num-processes must be at least 1 (got 0)`, a flag not given."""
    import llmtune.plan.cluster as cluster

    monkeypatch.setattr(cluster, "count_local_gpus", lambda: 0)
    with pytest.raises(UserError) as caught:
        cluster.make_cluster(None, device="cuda")
    assert caught.value.message == "--device cuda, and this machine has no GPU to count the processes from"
    assert caught.value.hint.startswith("pass --num-processes N")
    assert cluster.make_cluster(2, device="cuda").num_processes == 2  # a plan for GPUs elsewhere, sized by the flag


@pytest.mark.parametrize(("changes", "said"), [
    ({"fsdp_version": 2, "tensor_parallel_size": 3}, "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size 3 x 1 virtual stages needs at least 3 layers, but the model has 2"),
])  # fmt: skip
def test_a_size_the_model_cant_take_is_said_before_the_world_size_hint_that_would_lead_to_it(tmp_path, changes, said):
    """On 2 processes the world-size refusal came first, its hint 'use --num-processes 3'; following it met this."""
    from tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model")  # 4 attention heads, 2 layers
    with pytest.raises(UserError, match=re.escape(said)):
        make_plan(recipe(base_model=str(model), **changes), make_cluster(2, device="cpu"))


def test_the_ranks_get_the_plans_precision_whatever_the_shell_exported(monkeypatch):
    """transformers reads ACCELERATE_MIXED_PRECISION where bf16/fp16 are off: an exported bf16 trained a one-process
    run in bf16 under a plan saying fp32. The plan's environment, which the launcher lays over the shell's, sets it."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    rehearsal = make_plan(recipe(bf16=True), make_cluster(1, device="cpu"))
    assert rehearsal.precision == "no" and rehearsal.env["ACCELERATE_MIXED_PRECISION"] == "no"
    gpu = make_plan(recipe(bf16=True), make_cluster(2, device="cuda"))
    assert gpu.env["ACCELERATE_MIXED_PRECISION"] == gpu.precision == "bf16"
