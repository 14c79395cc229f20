"""async_checkpoint: true at 2 ranks over gloo (issue 37).

- A rank killed with SIGKILL in the middle of a background write (its data files written, DCP's metadata and the
  marker not): nothing of that checkpoint is published, the previous one stays whole, and the same command resumes
  from it. The resumed steps are bit-identical to an uninterrupted run that checkpointed synchronously.
- On a slow disk (each write held 4 s by a test hook), training goes on while a checkpoint is written: a save's stall
  is a fraction of its write, the next save waits for the previous write and says so, and the end of training waits
  for the last write before the run publishes it.
- FSDP2: each rank writes its own shard (two shard files), and the run's losses are the synchronous run's.
"""

from __future__ import annotations

import json

import pytest
from harness import llmtune, losses, make_workspace, read_metrics, write_run_recipe

pytestmark = pytest.mark.integration

RUN = {"max_steps": 8, "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "lr_scheduler": "constant", "micro_batch_size": 2,
       "gradient_accumulation_steps": 2}  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "async-checkpoint", tiny_model)


def train(path, env=None, timeout=600):
    return llmtune("train", path, "--num-processes", "2", env=env, timeout=timeout)


def test_a_kill_mid_write_loses_nothing_and_the_resume_is_bit_exact(workspace):
    root = workspace[0]
    sync_path = write_run_recipe(workspace, "sync", **RUN)
    done = train(sync_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sync = read_metrics(sync_path)
    assert [c["async"] for c in sync["checkpoints"]] == [False] * 4

    path = write_run_recipe(workspace, "async", async_checkpoint=True, **RUN)
    killed = train(path, env={"LLMTUNE_TEST_KILL_IN_ASYNC_WRITE": "6"})
    assert killed.returncode != 0 and "kills itself in the middle of writing" in killed.stdout + killed.stderr
    out = root / "async"
    assert (out / "checkpoint-4" / "llmtune-complete.json").is_file()
    marker = json.loads((out / "checkpoint-4" / "llmtune-complete.json").read_text())
    assert marker["format"] == "dcp-async" and marker["rows_seen"] == 4 * 8
    assert not (out / "checkpoint-6").exists()  # never published: the write did not finish on every rank
    staged = out / ".checkpoint-staging" / "checkpoint-6" / "dcp_state"
    assert list(staged.glob("*.distcp")) and not (staged / ".metadata").exists()  # cut mid-write, as intended

    resumed = train(path, env={"LLMTUNE_TEST_ASYNC_WRITE_SECONDS": "4"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-4'}" in resumed.stdout + resumed.stderr
    metrics = read_metrics(path)
    assert metrics["resumed_from"].endswith("checkpoint-4") and metrics["rows_seen"] == 64
    mine = {e["step"]: e["loss"] for e in metrics["log_history"] if "loss" in e}
    theirs = {e["step"]: e["loss"] for e in sync["log_history"] if "loss" in e}
    assert [mine[s] for s in range(5, 9)] == [theirs[s] for s in range(5, 9)]  # bit-exact, not approximately
    # the slow disk: the write of checkpoint-6 outlasted the steps after it (training went on), checkpoint-8's save
    # waited for it, and the end of training waited for checkpoint-8's write before publishing it
    six, eight = metrics["checkpoints"]
    assert six["step"] == 6 and six["async"] and six["write_seconds"] >= 4 and six["stall_seconds"] < six["write_seconds"] / 2
    assert eight["waited_seconds"] > 0 and "waited" in resumed.stdout + resumed.stderr
    assert "the last checkpoint's write finished" in resumed.stdout + resumed.stderr
    assert (out / "checkpoint-8" / "llmtune-complete.json").is_file()
    assert not (out / ".checkpoint-staging").exists()


def test_fsdp2_writes_each_ranks_shard_and_trains_as_the_synchronous_run(workspace):
    root = workspace[0]
    runs = {}
    for name, changes in (("fsdp2-sync", {}), ("fsdp2-async", {"async_checkpoint": True})):
        path = write_run_recipe(workspace, name, fsdp_version=2, fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"},
                                **RUN, **changes)  # fmt: skip
        result = train(path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = read_metrics(path)
    assert losses(runs["fsdp2-async"]) == losses(runs["fsdp2-sync"])
    shards = sorted(p.name for p in (root / "fsdp2-async" / "checkpoint-8" / "dcp_state").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert all(c["async"] and c["write_seconds"] > 0 for c in runs["fsdp2-async"]["checkpoints"])
