"""`llmtune slurm`: the sbatch script (golden file, bash -n) and its refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.launch.slurm import SlurmJob, sbatch_script

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "slurm"
ARGS = (Path("/shared/recipes/llama 8b.yaml"), Path("/shared/runs/llama8b"))
LLMTUNE = ["/opt/venv/bin/python", "-m", "llmtune"]


def script(job: SlurmJob) -> str:
    return sbatch_script(*ARGS, job, Path("/shared/work"), LLMTUNE, Path("/shared/runs/llama8b/slurm/job.sbatch"))


CASES = {
    "gpu-2x8": SlurmJob(2, 8, partition="gpu", time="4:00:00", account="ml", cpus_per_task=32),
    "cpu-rehearsal-2x1": SlurmJob(2, 1, job_name="rehearse", device="cpu", signal_seconds=60),
}


@pytest.mark.parametrize("name", list(CASES))
def test_script_matches_golden_and_parses(name, tmp_path):
    text = script(CASES[name])
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("LLMTUNE_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    # what every node runs: its machine rank from Slurm, the head's address and port from the script
    assert "bash -c 'exec \"$@\" --machine-rank \"$SLURM_NODEID\"'" in text
    assert '--main-process-ip "$HEAD_ADDR" --main-process-port "$PORT" &' in text
    assert "'/shared/recipes/llama 8b.yaml'" in text  # quoted for the shell


def test_each_nodes_command_gets_the_recipe_path_as_one_word_whatever_it_holds(tmp_path):
    """The srun line ran `bash -c "exec ... 'path'"`: a path with an apostrophe left a quote open, and one with $HOME
    was expanded by the script's shell. Each node's words are now arguments of bash -c, quoted once: run as a node
    would (srun left out, exec printing its words), the recipe is one word, as written."""
    recipe = Path("/shared/it's $HOME/r 8b.yaml")
    text = sbatch_script(recipe, Path("/shared/runs/x y"), SlurmJob(2, 4), Path("/shared/work"), LLMTUNE,
                         Path("/shared/runs/x y/slurm/job.sbatch"))  # fmt: skip
    assert '#SBATCH --output="/shared/runs/x y/slurm/%x-%j.out"' in text and "#SBATCH --job-name=llmtune-r_8b" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    command = "\n".join(lines[start : start + 2]).replace('exec "$@"', 'printf "%s\\n" "$@"').rstrip(" &")
    command = command[command.index("bash -c") :]  # what srun starts on each node
    shown = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True,
                           env={"PATH": os.environ["PATH"], "HEAD_ADDR": "10.0.0.1", "PORT": "29500",
                                "SLURM_NODEID": "1", "HOME": "/root"}).stdout.splitlines()  # fmt: skip
    assert shown == [*LLMTUNE, "train", str(recipe), "--num-processes", "8", "--num-machines", "2",
                     "--main-process-ip", "10.0.0.1", "--main-process-port", "29500", "--machine-rank", "1"]


def test_gpu_and_cpu_directives():
    gpu, cpu = script(CASES["gpu-2x8"]), script(CASES["cpu-rehearsal-2x1"])
    assert "#SBATCH --gpus-per-node=8" in gpu and "--num-processes 16 --num-machines 2" in gpu
    assert "--gpus-per-node" not in cpu and "--device cpu" in cpu and "#SBATCH --signal=B:USR1@60" in cpu
    # the launchers' srun asks for the CPUs itself: Slurm 22.05 to 23.02 give each task one CPU otherwise
    assert "#SBATCH --cpus-per-task=32" in gpu and "srun --cpus-per-task=32 --ntasks-per-node=1" in gpu
    assert "--cpus-per-task" not in cpu
    for text in (gpu, cpu):
        assert "#SBATCH --requeue" in text and "scontrol requeue" in text and "NodeAddr" in text


@pytest.mark.parametrize(("job", "message"), [
    (SlurmJob(2, 8, time="four hours"), "not a Slurm time"),
    (SlurmJob(2, 8, job_name="bad name"), "can't hold"),
    (SlurmJob(0, 8), "--nodes 0"),
    (SlurmJob(2, 8, device="gpu"), "--device must be cuda or cpu, not 'gpu'"),  # found on the nodes, after the queue
])  # fmt: skip
def test_bad_job_settings(job, message):
    with pytest.raises(UserError, match=message):
        script(job)


def test_cli_writes_the_script_or_refuses_an_impossible_plan(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: m\ndatasets: [{{path: d.jsonl, type: alpaca}}]\noutput_dir: {tmp_path / 'out'}\n"
                      "pipeline_parallel_size: 3\n")  # fmt: skip
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    def run(*a):
        return subprocess.run([sys.executable, "-m", "llmtune", "slurm", str(recipe), *a], capture_output=True,
                                        text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    refused = run("--nodes", "2", "--gpus-per-node", "1")  # 2 processes can't hold 3 pipeline stages
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
    recipe.write_text(recipe.read_text().replace("pipeline_parallel_size: 3\n", ""))
    done = run("--nodes", "2", "--gpus-per-node", "1", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    written = tmp_path / "out" / "slurm" / "job.sbatch"
    assert written.exists() and os.access(written, os.X_OK) and "sbatch" in done.stdout
    assert "--cpus-per-task" not in done.stderr  # CPU processes: nothing to warn of
    gpus = run("--nodes", "2", "--gpus-per-node", "8", "-o", str(tmp_path / "gpu.sbatch"))
    assert gpus.returncode == 0 and "note: no --cpus-per-task" in gpus.stderr and "8 ranks" in gpus.stderr
    if shutil.which("sbatch") is None:
        no_slurm = run("--nodes", "1", "--submit", "--device", "cpu")
        assert no_slurm.returncode == 2 and "sbatch is not on PATH" in no_slurm.stderr


def test_grpo_with_a_vllm_server_places_the_server_and_the_trainers(tmp_path):
    """One node: the server on its first GPUs, the trainers on the rest. Several: the server on the last node, alone,
    the trainers on the others, told its address. The server stops with the job; a job too small is refused."""
    one = script(SlurmJob(1, 8, vllm_gpus=2))
    assert "CUDA_VISIBLE_DEVICES=0,1 /opt/venv/bin/python -m llmtune vllm-serve" in one
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 exec" in one and "--num-processes 6 --num-machines 1" in one
    assert one.index("vllm-serve") < one.index("srun") and "trap 'kill $VLLM_PID 2>/dev/null' EXIT" in one
    many = script(SlurmJob(3, 8, vllm_gpus=4))
    assert "--num-processes 16 --num-machines 2" in many and '--nodes=2 --exclude="$SERVER_NODE"' in many
    assert 'srun --nodes=1 --ntasks=1 --nodelist="$SERVER_NODE"' in many and "CUDA_VISIBLE_DEVICES=0,1,2,3" in many
    assert "export LLMTUNE_VLLM_SERVER_HOST=" in many
    for text in (one, many):
        path = tmp_path / "job.sbatch"
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    with pytest.raises(UserError, match="leaves no GPU for training"):
        script(SlurmJob(1, 2, vllm_gpus=2))
    with pytest.raises(UserError, match="more than --gpus-per-node 4"):
        script(SlurmJob(2, 4, vllm_gpus=8))


def test_the_trainers_connect_where_the_script_put_the_server(monkeypatch):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.rl.trainers import config_arguments

    raw = {"base_model": "m", "rl": "grpo", "output_dir": "/o", "datasets": [{"path": "d.jsonl", "type": "rwd.t"}],
           "trl": {"reward_funcs": ["rwd.r"], "use_vllm": True, "vllm_mode": "server"}, "vllm": {"port": 8011}}
    recipe = recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe
    assert config_arguments(recipe, "cuda")["vllm_server_host"] == "127.0.0.1"
    monkeypatch.setenv("LLMTUNE_VLLM_SERVER_HOST", "10.0.0.7")
    arguments = config_arguments(recipe, "cuda")
    assert arguments["vllm_server_host"] == "10.0.0.7" and arguments["vllm_server_port"] == 8011


def test_a_size_that_doesnt_divide_the_job_is_hinted_in_nodes_and_gpus_per_node(run_cli, write_recipe):
    """The plan's hint named train's --num-processes, which llmtune slurm doesn't take."""
    recipe = write_recipe({"fsdp_version": 2, "tensor_parallel_size": 3, "bf16": True})
    done = run_cli("slurm", recipe, "--nodes", "2", "--gpus-per-node", "4")
    assert done.code == 2, done.err
    line = done.err.strip().splitlines()[-1]
    assert "tensor_parallel_size 3" in line and "--nodes 2 --gpus-per-node 3" in line and "--num-processes" not in line
