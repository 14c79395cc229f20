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
from harness import STEP_LINE, llmtune, losses, make_workspace, train_run, write_run_recipe
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


def test_requeue_near_the_time_limit_checkpoints_first_and_loses_no_step(cluster, workspace):
    """USR1 (what --signal sends before the limit): the ranks save a checkpoint after their current step and stop,
    the script requeues, and the rerun resumes from exactly that step. The recipe saves no checkpoint of its own."""
    import re
    import time

    reference, _ = train_run(
        workspace, "requeue-reference", 1, gradient_accumulation_steps=2, num_epochs=3, logging_steps=1
    )
    recipe = write_run_recipe(workspace, "requeued", num_epochs=3, logging_steps=1)
    made = llmtune("slurm", recipe, "--nodes", 2, "--gpus-per-node", 1, "--device", "cpu", "--job-name", "requeue-test",
                   env=cluster.env, cwd=workspace[0])  # fmt: skip
    assert made.returncode == 0, made.stderr
    run_dir = workspace[0] / "requeued"
    # steps slowed to 1 s each (a test hook), so the signal lands mid-run
    submitted = cluster.run("sbatch", "--parsable", "--export=ALL,LLMTUNE_TEST_STEP_SLEEP=1",
                            str(run_dir / "slurm" / "job.sbatch"))  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = run_dir / "slurm" / f"requeue-test-{job_id}.out"
    deadline = time.monotonic() + 600
    while not log.exists() or len(STEP_LINE.findall(log.read_text(errors="replace"))) < 3:
        assert time.monotonic() < deadline, cluster.logs()[-3000:]
        time.sleep(0.5)
    assert cluster.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    # Slurm holds a requeued job (BeginTime) until the old credential has expired; releasing it early raced that
    # ("Job credential revoked"), so the test waits the hold out, short with the test cluster's cred_expire=15
    state = cluster.wait_job(job_id, timeout=900)
    output = log.read_text(errors="replace")
    assert state == "COMPLETED", f"{state}\n{output[-4000:]}"
    assert "USR1 received: checkpoint after this step, stop, and requeue" in output
    stopped = re.search(r"stopped on request after step (\d+); checkpoint-\d+ is saved", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 3 <= step < 12
    assert "(restart 1)" in output  # the requeued run of the same job id
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(run_dir / f"checkpoint-{step}")  # nothing lost: it resumed at the stop
    assert metrics["steps"] == 12  # 3 epochs x 32 rows / global batch 8: the whole run, across the requeue
    assert losses(metrics) == pytest.approx(losses(reference), abs=2e-5)
