"""`llmtune config` and the memory estimate: the table it shows and the strategy it recommends are of the recipe it
writes, and the recipe it writes plans, on the cluster it was written for (in-process, no training)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

LLAMA_405B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
              "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
              "intermediate_size": 53248, "vocab_size": 128256, "max_position_embeddings": 131072}  # fmt: skip
TABLE = "strategy (GB per GPU)"  # the estimate table's first column


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"instruction": "hi", "input": "", "output": "hello"}) + "\n")
    return path


def cluster_flags(gpus: int, memory: str, machines: int = 1, interconnect: str = "fast") -> list[str]:
    flags = ["--gpus-per-machine", str(gpus), "--gpu-memory", memory]
    if machines > 1:
        flags += ["--num-machines", str(machines), "--main-process-ip", "10.0.0.1", "--interconnect", interconnect]
    return flags


def header_strategy(text: str) -> str:
    """The written strategy's estimate row, from the header's `Strategy:` label."""
    from llmtune.recipe.writer import STRATEGIES

    label = re.search(r"^# Strategy: (.*), on \d+ machine", text, re.M).group(1)
    return next(row for title, row in STRATEGIES.values() if title == label)


def planned_figure(output: Path, gpus: int, machines: int, memory: str, interconnect: str = "fast") -> str:
    """What `llmtune train`'s memory check reads for the written recipe: planned_row of its plan."""
    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.memory.buffers import GB
    from llmtune.plan.memory.fit import estimate_recipe, planned_row
    from llmtune.plan.memory.table import parse_size
    from llmtune.recipe import load_recipe

    recipe = load_recipe(output).recipe
    plan = make_plan(recipe, make_cluster(gpus * machines, machines, 0, "10.0.0.1" if machines > 1 else None,
                                          29500, "cuda"))  # fmt: skip
    report = estimate_recipe(recipe, gpus, machines, parse_size(memory), None, interconnect)
    return f"{planned_row(report, plan).total / GB:.1f} GB per GPU"


SETUPS = {  # (base model, method, GPUs per machine, GPU memory, machines, interconnect, more flags)
    "8B full, 8 x 80 GB, 8k rows": ("meta-llama/Llama-3.1-8B", "full", 8, "80GB", 1, "fast", ["--sequence-len", "8192"]),
    "8B full, 2 x 8 x 40 GB, slow": ("meta-llama/Llama-3.1-8B", "full", 8, "40GB", 2, "slow",
                                     ["--sequence-len", "4096"]),
    "8B full, 2 x 8 x 48 GB, slow": ("meta-llama/Llama-3.1-8B", "full", 8, "48GB", 2, "slow",
                                     ["--sequence-len", "4096"]),
    "8B full, 8 x 40 GB, micro 1": ("meta-llama/Llama-3.1-8B", "full", 8, "40GB", 1, "fast",
                                    ["--micro-batch-size", "1"]),
    "70B full, 8 x 80 GB": ("meta-llama/Llama-3.1-70B", "full", 8, "80GB", 1, "fast", ["--sequence-len", "4096"]),
    "8B LoRA, 2 x 8 x 80 GB": ("meta-llama/Llama-3.1-8B", "lora", 8, "80GB", 2, "fast", []),
    "8B QLoRA, 1 x 24 GB": ("meta-llama/Llama-3.1-8B", "qlora", 1, "24GB", 1, "fast", []),
}  # fmt: skip


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_recommendation_is_the_estimate_of_the_recipe_written_and_it_plans(run_cli, tmp_path, data, setup):
    """It estimated a draft without gradient_accumulation_steps and packing: ZeRO-1 at 63.1 GB "fits" on 8 x 80 GB,
    while `llmtune estimate` of the written recipe said 79.2 GB, no fit, ZeRO-2. And it wrote FSDP1 hybrid shard
    with async_checkpoint on, which the plan refused."""
    model, method, gpus, memory, machines, interconnect, more = SETUPS[setup]
    output = tmp_path / "r.yaml"
    flags = cluster_flags(gpus, memory, machines, interconnect)
    result = run_cli("config", "--yes", "-o", output, "--base-model", model, "--method", method, "--dataset", data,
                     "--dataset-type", "alpaca", *flags, *more)  # fmt: skip
    assert result.code == 0, result.err
    text = output.read_text()
    assert "recommended because" in text
    written = header_strategy(text)
    cluster = ["--num-processes", str(gpus * machines)]
    if machines > 1:
        cluster += ["--num-machines", str(machines), "--main-process-ip", "10.0.0.1"]
    plan = run_cli("plan", output, *cluster, "--device", "cuda", "--json")
    assert plan.code == 0, plan.err
    estimate = run_cli("estimate", output, *[f for f in flags if f not in ("--main-process-ip", "10.0.0.1")], "--json")
    assert estimate.code == 0, estimate.err
    assert json.loads(estimate.out)["recommended"]["strategy"].split(" (")[0] == written
    assert f"Estimated {planned_figure(output, gpus, machines, memory, interconnect)} of {memory[:-2]} GB" in text


def test_rows_too_long_for_packing_are_recommended_context_parallelism(run_cli, tmp_path, data):
    """Context parallelism runs unpacked rows, so the packed recipe's estimate has no row for it: the recipe as
    written for it (sample_packing: false) is estimated too, and recommended where its estimate recommends it."""
    output = tmp_path / "r.yaml"
    flags = cluster_flags(8, "80GB")
    result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-8B", "--method", "full",
                     "--dataset", data, *flags, "--sequence-len", "65536")  # fmt: skip
    assert result.code == 0, result.err
    raw = yaml.safe_load(output.read_text())
    assert raw["context_parallel_size"] == 8 and raw["sample_packing"] is False and raw["fsdp_version"] == 2
    estimate = run_cli("estimate", output, *flags, "--json")
    assert json.loads(estimate.out)["recommended"]["strategy"] == "context parallel (8-way)"
    assert run_cli("plan", output, "--num-processes", "8", "--device", "cuda").code == 0


def test_the_context_parallel_recipe_passes_the_memory_check_it_was_recommended_by(run_cli, tmp_path, data,
                                                                                      monkeypatch):
    """row_for_plan mapped an FSDP2 plan with context_parallel > 1 to 'FSDP full shard': `llmtune train` refused the
    context-parallel recipe its estimate recommended (309 GB for 8B at 64k on 8 x 80 GB)."""
    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.memory import fit
    from llmtune.plan.memory.buffers import GB
    from llmtune.plan.memory.fit import fits_line, model_facts_for
    from llmtune.recipe import load_recipe

    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-8B", "--method", "full",
                     "--dataset", data, *cluster_flags(8, "80GB"), "--sequence-len", "65536")  # fmt: skip
    assert result.code == 0, result.err
    assert f"Estimated {planned_figure(output, 8, 1, '80GB')} of 80 GB; recommended because" in output.read_text()
    recipe = load_recipe(output).recipe
    plan = make_plan(recipe, make_cluster(8, 1, 0, None, 29500, "cuda"))
    monkeypatch.setattr(fit, "cpu_memory_of_this_machine", lambda: 2048 * GB)  # a GPU machine's (async copies)
    said = fits_line(recipe, plan, 80 * GB, model_facts_for(recipe))  # train's check: raises where it refuses
    assert "under context parallel (8-way)" in said


def test_background_checkpoints_only_where_the_written_plan_takes_them(run_cli, tmp_path, data):
    """FSDP hybrid shard was written as FSDP1 with async_checkpoint on by default: the plan refused the wizard's own
    recipe. Hybrid sharding is FSDP2's HSDP now (dp_shard_size: the GPUs of a machine); FSDP1's, asked for, gets no
    background checkpoints; DeepSpeed and pipelines none either."""

    def written(*flags: str) -> dict:
        output = tmp_path / f"r{len(list(tmp_path.glob('r*.yaml')))}.yaml"
        result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-8B", "--method",
                         "full", "--dataset", data, *cluster_flags(8, "80GB", 2, "slow"), *flags)  # fmt: skip
        assert result.code == 0, result.err
        return yaml.safe_load(output.read_text())

    hsdp = written("--strategy", "fsdp_hybrid")
    assert hsdp["fsdp_version"] == 2 and hsdp["dp_shard_size"] == 8 and hsdp["async_checkpoint"] is True
    assert "sharding_strategy" not in hsdp["fsdp_config"]
    fsdp1 = written("--strategy", "fsdp_hybrid", "--fsdp-version", "1")
    assert fsdp1["fsdp_config"]["sharding_strategy"] == "HYBRID_SHARD" and "async_checkpoint" not in fsdp1
    for strategy in ("zero2", "pipeline"):
        assert "async_checkpoint" not in written("--strategy", strategy)


def test_the_hsdp_recipe_shards_within_each_machine(run_cli, tmp_path, data):
    output = tmp_path / "r.yaml"
    assert run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-8B", "--method", "full",
                   "--dataset", data, *cluster_flags(8, "80GB", 2), "--strategy", "fsdp_hybrid").code == 0  # fmt: skip
    plan = run_cli("plan", output, "--num-processes", "16", "--num-machines", "2", "--main-process-ip", "10.0.0.1",
                   "--device", "cuda", "--json")  # fmt: skip
    assert plan.code == 0, plan.err
    assert json.loads(plan.out)["mesh"] == {"tensor_parallel": 1, "context_parallel": 1, "dp_shard": 8,
                                            "dp_replicate": 2}  # fmt: skip


def test_the_cpu_memory_decides_between_cpu_and_nvme_offload(tmp_path, data, monkeypatch, capsys, run_cli):
    """It never asked: 70B full on 8 x 80 GB recommended ZeRO-3 + CPU offload, 1411 GB of host memory per machine.
    The CPU memory (asked where the recommendation offloads; by default this machine's where it has GPUs) goes into
    the estimate."""
    import llmtune.plan.memory.fit as fit
    import llmtune.wizard as wizard
    from llmtune.errors import UserError

    given = {"base_model": "meta-llama/Llama-3.1-70B", "method": "full", "dataset": str(data), "gpus_per_machine": 8,
             "gpu_memory": "80GB", "sequence_len": 4096}  # fmt: skip

    def header(**more) -> str:
        output = tmp_path / "r.yaml"
        wizard.run_config({**given, **more}, output, True, True)
        return output.read_text()

    assert "ZeRO-3 + parameter and optimizer offload to CPU" in header()  # not checked, and the header says so
    assert "CPU memory (not checked: no CPU memory given)" in header()
    assert "offload to NVMe" in header(cpu_memory="1000GB")
    with pytest.raises(UserError, match="offload more than the 100 GB of CPU memory"):
        header(cpu_memory="100GB")
    flags = ["--base-model", "meta-llama/Llama-3.1-70B", "--method", "full", "--dataset", data, "--gpus-per-machine",
             "8", "--gpu-memory", "80GB", "--sequence-len", "4096"]  # fmt: skip
    result = run_cli("config", "--yes", "--force", "-o", tmp_path / "r.yaml", *flags, "--cpu-memory", "1000GB")
    assert result.code == 0 and "offload to NVMe" in (tmp_path / "r.yaml").read_text()  # the flag, as a user gives it
    monkeypatch.setattr(wizard, "_detected_gpus", lambda: (8, "80GB"))  # the job runs here: this machine's memory
    monkeypatch.setattr(fit, "cpu_memory_of_this_machine", lambda: 1000e9)
    assert "offload to NVMe" in header()


def test_an_unknown_model_is_written_with_its_header_saying_there_was_no_estimate(run_cli, tmp_path, data,
                                                                                  monkeypatch):  # fmt: skip
    import llmtune.plan.memory.facts as facts

    monkeypatch.setattr(facts, "fetch_hub_config", lambda name: None)  # offline
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", "some-org/Unknown-72B", "--method", "full",
                     "--dataset", data, "--gpus-per-machine", "8")  # fmt: skip
    assert result.code == 0, result.err  # not an error: the recipe is fine, only its memory is unknown
    assert "no estimate" in result.err
    assert "# No memory estimate: the config of some-org/Unknown-72B can't be read here" in output.read_text()
    assert f"llmtune estimate {output} --gpus-per-machine 8" in output.read_text()


def test_nothing_fits_is_refused_unless_a_strategy_is_given(run_cli, tmp_path, data):
    """405B full on one 24 GB GPU said "nothing fits" on stderr and wrote a plain DDP recipe, exit 0."""
    model = tmp_path / "llama405b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_405B))
    output = tmp_path / "r.yaml"
    flags = ["config", "--yes", "-o", output, "--base-model", model, "--method", "full", "--dataset", data,
             *cluster_flags(1, "24GB")]  # fmt: skip
    result = run_cli(*flags)
    assert result.code == 2 and result.err.count("error:") == 1 and "Traceback" not in result.err
    assert "error: nothing fits" in result.err and "use LoRA" in result.err and "--strategy" in result.err
    assert not output.exists()
    chosen = run_cli(*flags, "--strategy", "zero3_offload")  # asked for: written, and said not to fit
    assert chosen.code == 0, chosen.err
    header = output.read_text()
    assert "does NOT fit" in header and "`llmtune train` refuses to launch it" in header
    assert "does NOT fit" in chosen.err  # and the console says it


def test_fsdp_parameter_offload_is_estimated_as_the_plan_runs_it(run_cli, tmp_path, data):
    """--fsdp-offload-params read "192.4 GB ... does NOT fit: expect an out-of-memory error", the row without offload;
    `llmtune train`'s check reads planned_row, which moves the states to the CPU."""
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-70B", "--method", "full",
                     "--dataset", data, *cluster_flags(8, "80GB"), "--strategy", "fsdp", "--fsdp-offload-params",
                     "--no-async-checkpoint")  # fmt: skip
    assert result.code == 0, result.err
    header = output.read_text()
    assert f"estimated {planned_figure(output, 8, 1, '80GB')} of 80 GB, which fits" in header
    assert "GB in each machine's CPU memory (not checked" in header and "out-of-memory" not in header


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus-per-machine", "-1"], "--gpus-per-machine -1 is below 1"),
        (["--num-machines", "0"], "--num-machines 0 is below 1"),
        (["--sequence-len", "0"], "--sequence-len 0 is below 1"),
        (["--micro-batch-size", "0"], "--micro-batch-size 0 is below 1"),
        (["--main-process-port", "70000"], "--main-process-port 70000 is not a TCP port"),
        (["--pipeline-stages", "1"], "--pipeline-stages 1 is below 2"),
        (["--gpu-memory", "1e11"], "--gpu-memory '1e11' is 1e+11 GB, not the memory of one GPU (a bare number is GB)"),
        (["--gpu-memory", "80MB"], "not the memory of one GPU"),
        (["--gpus-per-machine", "8", "--gpu-ids", "0,1"], "--gpu-ids '0,1' names 2 GPU(s), and each machine trains on 8"),
        (["--gpu-ids", "a,b"], "--gpu-ids 'a,b' is not a comma-separated list of GPU indices"),
        (["--gpu-ids", "0,0"], "--gpu-ids '0,0' names a GPU twice"),
        (["--gpu-ids", "-1"], "--gpu-ids '-1' is not a comma-separated list"),
    ],
)  # fmt: skip
def test_the_wizards_own_flags_are_checked_first_and_named(run_cli, tmp_path, data, flags, message):
    """--gpus-per-machine -1 printed a table for "1 x -1 GPUs", then named --num-processes; --sequence-len 0 named
    llmtune-config.yaml; --gpu-memory 1e11 was taken as 1e11 GB."""
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-8B", "--dataset", data,
                     *flags)  # fmt: skip
    assert result.code == 2 and message in result.err, result.err
    assert result.err.count("error:") == 1 and "(hint: " in result.err and "Traceback" not in result.err
    assert TABLE not in result.out + result.err and "llmtune-config.yaml" not in result.err
    assert not output.exists()


def test_gpu_ids_alone_give_the_gpus_per_machine(run_cli, tmp_path, data):
    output = tmp_path / "r.yaml"
    result = run_cli("config", "--yes", "-o", output, "--base-model", "meta-llama/Llama-3.1-8B", "--dataset", data,
                     "--gpu-ids", "0, 1", "--num-machines", "2", "--main-process-ip", "10.0.0.1")  # fmt: skip
    assert result.code == 0, result.err
    assert "CUDA_VISIBLE_DEVICES=0,1 llmtune train" in result.out and "--num-processes 4 " in result.out


def test_the_gpu_ids_question_refuses_what_the_flag_refuses():
    from llmtune.wizard_sft import gpu_ids_problem

    assert gpu_ids_problem("all", 8) is None and gpu_ids_problem("0,1", 2) is None and gpu_ids_problem("3", 1) is None
    for bad, count in (("0,1", 8), ("a", 1), ("0,0", 2), ("-1", 1), ("0;1", 2), ("1.5", 1)):
        assert gpu_ids_problem(bad, count), bad


class Scripted:
    """An interactive Asker whose answers are scripted by the question's opening words (else the default)."""

    interactive = True

    def __init__(self, answers: dict[str, str]):
        self.answers, self.asked, self.shown = answers, [], []

    def _answer(self, message: str, default):
        self.asked.append((message, default))
        return next((a for start, a in self.answers.items() if message.startswith(start)), default)

    def text(self, message, default, check=None):
        answer = self._answer(message, default)
        assert check is None or check(answer) is None, (message, answer, check(answer))
        return answer

    def select(self, message, choices, default):
        return self._answer(message, default)

    def confirm(self, message, default):
        return self._answer(message, default)

    def show(self, text):
        self.shown.append(text)


def test_the_cpu_memory_is_asked_where_the_recommendation_offloads_to_it(tmp_path, data, capsys):
    from llmtune.wizard import ask_all

    flags = {"base_model": "meta-llama/Llama-3.1-70B", "method": "full", "dataset": str(data), "num_machines": 1,
             "gpus_per_machine": 8, "gpu_ids": "all", "gpu_memory": "80GB", "mixed_precision": "bf16",
             "sequence_len": 4096, "micro_batch_size": 2, "output_dir": str(tmp_path / "out")}  # fmt: skip
    ask = Scripted({"CPU memory of one machine": "1000GB"})
    answers, fit, _ = ask_all(flags, ask)
    assert [m for m, _ in ask.asked if m.startswith("CPU memory")] and answers.cpu_memory == "1000GB"
    assert fit.recommended == "zero3_nvme" == answers.strategy  # the CPU row (1411 GB) no longer fits
    lora = Scripted({})
    ask_all({**flags, "method": "lora"}, lora)  # nothing offloaded: not asked
    assert not [m for m, _ in lora.asked if m.startswith("CPU memory")]


def test_nothing_fits_in_a_terminal_preselects_the_smallest_and_says_so(tmp_path, data):
    from llmtune.wizard import ask_all

    model = tmp_path / "llama405b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_405B))
    flags = {"base_model": str(model), "method": "full", "dataset": str(data), "num_machines": 1,
             "gpus_per_machine": 1, "gpu_ids": "all", "gpu_memory": "24GB", "mixed_precision": "bf16",
             "sequence_len": 2048, "micro_batch_size": 1, "output_dir": str(tmp_path / "out")}  # fmt: skip
    ask = Scripted({})
    answers, fit, _ = ask_all(flags, ask)
    assert fit.recommended is None and any(s.startswith("note: nothing fits") for s in ask.shown)
    strategy = next(default for message, default in ask.asked if message.startswith("Distributed strategy"))
    assert strategy == answers.strategy and strategy.startswith("zero3_")  # the least memory per GPU, not DDP
