"""A real two-node Slurm cluster on this host runs the script `llmtune slurm` writes.

munged, slurmctld and two slurmd (n1, n2 on 127.0.0.1, own ports) are started in a temporary folder;
the job's srun tasks see SLURM_NODEID 0 and 1 and each starts one llmtune launcher. The result must be
one job of world size 2 whose losses equal a single-process run with the same global batch.
`.ci/run` installs Debian's slurm-wlm and munge; without them this module is skipped and says why.
"""

from __future__ import annotations

import json
import os

import pytest
from harness import llmtune, losses, make_workspace, train_run, write_run_recipe
from slurm_cluster import SlurmCluster, available

pytestmark = [pytest.mark.integration, pytest.mark.skipif(available() is not None, reason=str(available()))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root")
    running = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "slurm-runs", tiny_model)


def test_generated_sbatch_script_trains_on_two_slurm_nodes(cluster, workspace):
    reference, _ = train_run(workspace, "reference", 1, gradient_accumulation_steps=2)
    recipe = write_run_recipe(workspace, "on-slurm")
    made = llmtune("slurm", recipe, "--nodes", 2, "--gpus-per-node", 1, "--device", "cpu", "--job-name", "llmtune-test",
                   "--time", "15:00", env=cluster.env, cwd=workspace[0])  # fmt: skip
    assert made.returncode == 0, made.stderr
    script = workspace[0] / "on-slurm" / "slurm" / "job.sbatch"
    submitted = cluster.run("sbatch", "--parsable", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    state = cluster.wait_job(job_id, timeout=900)
    log = workspace[0] / "on-slurm" / "slurm" / f"llmtune-test-{job_id}.out"
    output = log.read_text(errors="replace") if log.exists() else "(no job log)"
    assert state == "COMPLETED", f"{state}\n{output[-4000:]}\n{cluster.logs()[-3000:]}"
    metrics = json.loads((workspace[0] / "on-slurm" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 8
    assert sorted(r["rank"] for r in metrics["ranks"]) == [0, 1]
    assert len({r["first_batch"] for r in metrics["ranks"]}) == 2  # distinct data shards
    assert losses(metrics) == pytest.approx(losses(reference), abs=2e-5)
    # the head's address came from Slurm (NodeAddr), and each node ran its own launcher (machine rank 0 and 1)
    assert "head n1 = 127.0.0.1:" in output
    plan = json.loads((workspace[0] / "on-slurm" / "llmtune" / "plan.json").read_text())["plan"]
    assert plan["cluster"]["num_machines"] == 2


def test_requeue_near_the_time_limit_resumes_from_the_last_checkpoint(cluster, workspace):
    """USR1 (what --signal sends before the limit) makes the script stop and requeue; the rerun resumes."""
    recipe = write_run_recipe(workspace, "requeued", num_epochs=3, save_strategy="steps", save_steps=2)
    made = llmtune("slurm", recipe, "--nodes", 2, "--gpus-per-node", 1, "--device", "cpu", "--job-name", "requeue-test",
                   env=cluster.env, cwd=workspace[0])  # fmt: skip
    assert made.returncode == 0, made.stderr
    run_dir = workspace[0] / "requeued"
    submitted = cluster.run("sbatch", "--parsable", str(run_dir / "slurm" / "job.sbatch"))
    job_id = submitted.stdout.strip().split(";")[0]
    import time

    deadline = time.monotonic() + 600
    while not any((p / "llmtune-complete.json").exists() for p in run_dir.glob("checkpoint-*")):
        assert time.monotonic() < deadline, cluster.logs()[-3000:]
        time.sleep(1)
    assert cluster.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    state = cluster.wait_job(job_id, timeout=900)
    output = (run_dir / "slurm" / f"requeue-test-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", f"{state}\n{output[-4000:]}"
    assert "USR1 received, stopping and requeueing" in output
    assert "(restart 1)" in output  # the requeued run of the same job id
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["resumed_from"] and "checkpoint-" in metrics["resumed_from"]
    assert metrics["steps"] == 12  # 3 epochs x 32 rows / global batch 8: the whole run, across the requeue
