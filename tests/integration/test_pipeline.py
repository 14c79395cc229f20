"""Pipeline parallelism on CPU: stages on separate processes reproduce a single-process run step by step."""

from __future__ import annotations

import pytest
import yaml
from harness import LORA, llmtune, losses, make_workspace, read_metrics, saved_weights, train_run, write_run_recipe

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_4_layers):
    return make_workspace(tmp_path_factory, "pipe", tiny_model_4_layers)


run = train_run


@pytest.fixture(scope="module")
def reference(workspace):
    return {
        "full": run(workspace, "single-full", 1, gradient_accumulation_steps=2),
        "lora": run(workspace, "single-lora", 1, gradient_accumulation_steps=2, **LORA),
    }


CASES = [
    ("gpipe", 2, {"pipeline_schedule": "gpipe", "pipeline_microbatches": 2}, "full"),
    ("1f1b", 2, {"pipeline_schedule": "1f1b", "pipeline_microbatches": 2}, "full"),
    (
        "interleaved",
        2,
        {"pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2, "pipeline_microbatches": 2},
        "full",
    ),
    ("1f1b-lora", 2, {"pipeline_schedule": "1f1b", "pipeline_microbatches": 2, **LORA}, "lora"),
    ("pp2xdp2", 4, {"pipeline_schedule": "1f1b", "pipeline_microbatches": 2, "micro_batch_size": 2}, "full"),
]


@pytest.mark.parametrize(("name", "processes", "changes", "kind"), CASES, ids=[c[0] for c in CASES])
def test_pipeline_matches_single_process(workspace, reference, name, processes, changes, kind):
    metrics, output_dir = run(workspace, name, processes, pipeline_parallel_size=2, **changes)
    ref_metrics, ref_dir = reference[kind]
    assert metrics["strategy"] == "pipeline" and metrics["world_size"] == processes
    assert metrics["global_batch_size"] == 8 == ref_metrics["global_batch_size"]
    assert losses(metrics) == pytest.approx(losses(ref_metrics), abs=1e-4)
    stages = {(r["replica"], r["stage"]) for r in metrics["ranks"]}
    assert stages == {(replica, stage) for replica in range(processes // 2) for stage in range(2)}
    # each stage holds only its layers: neither holds the whole model, and one replica's stages hold all of it once
    full = ref_metrics["ranks"][0]["local_parameters"]
    assert all(0 < r["local_parameters"] < full for r in metrics["ranks"]), metrics["ranks"]
    layers = metrics["pipeline"]["layer_bounds"][-1]
    for replica in range(processes // 2):
        mine = [r for r in metrics["ranks"] if r["replica"] == replica]
        held = sorted(i for r in mine for i in r["layer_indices"])
        assert held == list(range(layers)), mine  # every layer once (tiny model: untied, nothing shared)
        assert sum(r["local_parameters"] for r in mine) == full
    schedule = {"gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B"}.get(name, "Schedule1F1B")
    assert {r["schedule"] for r in metrics["ranks"]} == {schedule}
    virtual = changes.get("pipeline_virtual_stages", 1)
    assert all(len(r["stage_indices"]) == virtual for r in metrics["ranks"])
    saved, expected = saved_weights(output_dir), saved_weights(ref_dir)
    assert saved.keys() == expected.keys()
    for key, tensor in expected.items():
        assert (saved[key] - tensor).abs().max().item() < 1e-4, key


def test_saved_pipeline_model_loads_in_transformers(workspace, reference):
    import torch
    from transformers import AutoModelForCausalLM

    _, output_dir = run(workspace, "gpipe-load", 2, pipeline_parallel_size=2, pipeline_microbatches=2,
                        pipeline_schedule="gpipe")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(output_dir))
    reference_model = AutoModelForCausalLM.from_pretrained(str(reference["full"][1]))
    ids = torch.tensor([[1, 5, 9, 14, 20, 7]])
    with torch.no_grad():
        assert (model(ids).logits - reference_model(ids).logits).abs().max().item() < 1e-4


def test_more_stages_than_layers_is_a_clear_error(workspace):
    root, data, model = workspace
    path = root / "too-many.yaml"
    path.write_text(yaml.safe_dump({"base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}],
                                    "pipeline_parallel_size": 8, "output_dir": str(root / "too-many")}))  # fmt: skip
    result = llmtune("plan", path, "--num-processes", "8")
    assert result.returncode == 2
    assert "needs at least 8 layers, but the model has 4" in result.stderr


def test_tied_embeddings_stay_in_sync_across_stages(workspace, tmp_path_factory):
    """SmolLM-style tied embeddings: the first and last stage share one weight; both copies must get every update."""
    from tiny import make_tiny_model

    tied = make_tiny_model(tmp_path_factory.mktemp("tied") / "tied4", layers=4, tie_word_embeddings=True)
    root, data, _ = workspace
    tied_space = (root, data, tied)
    ref_metrics, ref_dir = run(tied_space, "tied-single", 1, gradient_accumulation_steps=2)
    metrics, output_dir = run(tied_space, "tied-pipe", 2, pipeline_parallel_size=2, pipeline_microbatches=2)
    assert losses(metrics) == pytest.approx(losses(ref_metrics), abs=1e-4)
    saved, expected = saved_weights(output_dir), saved_weights(ref_dir)
    assert "lm_head.weight" not in saved  # still tied on disk
    for key, tensor in expected.items():
        assert (saved[key] - tensor).abs().max().item() < 1e-4, key


def test_resume_after_a_crash_is_bit_exact(workspace):
    """SIGKILL the last stage inside step 3, after checkpoint 2 (test hook); rerun the same command: it resumes from
    checkpoint 2, runs only steps 3 and 4, and ends bit-identical to an uninterrupted run."""
    import torch

    common = {
        "pipeline_parallel_size": 2,
        "pipeline_microbatches": 2,
        "pipeline_schedule": "1f1b",
        "save_steps": 2,
        "save_strategy": "steps",
    }
    reference, straight = run(workspace, "resume-straight", 2, **common)
    root = workspace[0]
    path = write_run_recipe(workspace, "resume-crash", **common)  # the same recipe, its own output_dir
    crashed = llmtune("train", path, "--num-processes", "2", env={"LLMTUNE_TEST_KILL_MID_STEP": "3"})
    assert crashed.returncode == 1 and "rank 1 (local rank 1 on" in crashed.stderr
    assert "killed by signal 9 (SIGKILL)" in crashed.stderr
    assert (root / "resume-crash" / "checkpoint-2" / "llmtune-complete.json").exists()
    assert not (root / "resume-crash" / "checkpoint-3").exists()
    assert not (root / "resume-crash" / "model.safetensors").exists()
    resumed = llmtune("train", path, "--num-processes", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = read_metrics(path)
    assert metrics["resumed_from"] == str(root / "resume-crash" / "checkpoint-2")
    assert metrics["steps"] == 4 and metrics["steps_run"] == 2 and reference["steps_run"] == 4
    assert metrics["rows_seen_this_run"] == 2 * metrics["global_batch_size"]  # only the rows after the checkpoint
    assert metrics["rows_seen"] == metrics["steps"] * metrics["global_batch_size"]  # the whole run's
    assert losses(metrics)[2:] == losses(reference)[2:]
    a, b = saved_weights(straight), saved_weights(root / "resume-crash")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigusr1_stops_a_pipeline_after_a_checkpoint_and_the_rerun_resumes(workspace):
    """The stop request rides on the pipeline's per-step loss all-reduce: every stage stops after the same step."""
    import re

    import torch
    from harness import train_and_signal

    common = {"pipeline_parallel_size": 2, "pipeline_microbatches": 2, "num_epochs": 2, "logging_steps": 1}
    _, straight = run(workspace, "usr1-straight", 2, **common)
    root = workspace[0]
    path = write_run_recipe(workspace, "usr1-stopped", **common)  # the same recipe, its own output_dir
    code, seen = train_and_signal(path, lambda text: "step 2/8" in text)
    assert code == 0, seen[-3000:]
    stopped = re.search(r"stopped on request after step (\d+)", seen)
    assert stopped, seen[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < 8 and (root / "usr1-stopped" / f"checkpoint-{step}" / "llmtune-complete.json").exists()
    assert not (root / "usr1-stopped" / "model.safetensors").exists()
    resumed = llmtune("train", path, "--num-processes", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stderr
    a, b = saved_weights(straight), saved_weights(root / "usr1-stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
