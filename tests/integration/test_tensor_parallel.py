"""Tensor parallelism (transformers' tp_plan), TP x FSDP2, TP x replicas and HSDP in the CPU rehearsal.

Each run is compared with one process training on the same global batch: the per-step losses match, each rank
reports its mesh coordinates and the shapes it holds, ranks of one tensor-parallel group see the same rows while
data-parallel groups see their own, and the saved model is whole and reloads to the run's own logits."""

from __future__ import annotations

import json

import pytest
from harness import llmtune, losses, read_metrics
from tiny import write_jsonl

pytestmark = pytest.mark.integration

WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]
STEPS = 4
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("tensor-parallel")
    rows = [{"instruction": f"Repeat {w} number {i}", "output": f"{w} {i}"} for i, w in enumerate(WORDS * 4)]
    return root, write_jsonl(root / "data.jsonl", rows), tiny_model  # distinct rows: first batches tell ranks apart


def run(workspace, name: str, processes: int, micro: int, probe=None, env=None, **changes) -> tuple[dict, object]:
    import yaml

    root, data, model = workspace
    recipe = {"base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 128,
              "micro_batch_size": micro, "max_steps": STEPS, "learning_rate": 1e-3, "lr_scheduler": "linear",
              "save_strategy": "no", "dataset_prepared_path": str(root / "prepared"), "output_dir": str(root / name),
              **changes}  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**(env or {}), **({"LLMTUNE_PROBE_FILE": str(probe)} if probe else {})}
    result = llmtune("train", path, "--rehearse", "--num-processes", processes, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(path), root / name


@pytest.fixture(scope="module")
def reference(workspace):
    metrics, _ = run(workspace, "single", 1, GLOBAL_BATCH)
    assert metrics["global_batch_size"] == GLOBAL_BATCH
    return losses(metrics), metrics["ranks"][0]["local_parameters"]


def test_tensor_parallel_two_ranks(workspace, reference, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    probe = tmp_path / "probe.safetensors"
    metrics, output_dir = run(workspace, "tp2", 2, GLOBAL_BATCH, probe=probe, tensor_parallel_size=2,
                              save_strategy="steps", save_steps=2, save_only_model=True)  # fmt: skip
    plan = json.loads((output_dir / "llmtune" / "plan.json").read_text())["plan"]
    # the data-parallel degree is 1: same global batch and steps as one process, not twice them
    assert plan["strategy"] == "tp" and plan["data_parallel_size"] == 1 and plan["global_batch_size"] == GLOBAL_BATCH
    assert plan["mesh"] == {"tensor_parallel": 2, "dp_shard": 1, "dp_replicate": 1}
    assert metrics["steps"] == STEPS and losses(metrics) == pytest.approx(reference[0], abs=1e-5)
    assert metrics["rows_seen"] == STEPS * GLOBAL_BATCH  # both ranks train on each row: counted once
    ranks = metrics["ranks"]
    assert [r["coordinates"] for r in ranks] == [{"tp": 0}, {"tp": 1}]
    assert all(r["engine"] == "tensor_parallel" and r["mesh"] == {"tp": 2} for r in ranks)
    # each rank holds half of every split projection: q/k/v/gate/up by rows, o/down by columns
    for r in ranks:
        shapes = r["local_shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == [32, 64]
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == [16, 64]
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == [64, 32]
        assert shapes["model.layers.0.mlp.down_proj.weight"] == [64, 64]  # intermediate 128 split by columns
    assert ranks[0]["first_batch"] == ranks[1]["first_batch"]  # one forward pass, split: the same rows
    # saved whole, and it reloads to the logits the run ended with
    saved = load_file(str(output_dir / "model.safetensors"))
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    # weight snapshots (TP can't checkpoint its optimizer): gathered whole too, and marked complete
    snapshot = output_dir / "checkpoint-2"
    assert (snapshot / "llmtune-complete.json").exists() and not (snapshot / "optimizer.pt").exists()
    assert load_file(str(snapshot / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    model = AutoModelForCausalLM.from_pretrained(str(output_dir), dtype=torch.float32).eval()
    expected = load_file(str(probe))
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    assert (logits - expected["logits"]).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("name", "micro", "changes", "mesh", "q_rows"),
    [
        ("tp2-fsdp2", 2, {"tensor_parallel_size": 2, "fsdp_version": 2}, {"fsdp": 2, "tp": 2}, 16),
        ("tp2-replicas", 2, {"tensor_parallel_size": 2, "dp_replicate_size": 2},
         {"dp_replicate": 2, "fsdp": 1, "tp": 2}, 32),
    ],
)  # fmt: skip
def test_tensor_parallel_with_data_parallel_groups_four_ranks(workspace, reference, name, micro, changes, mesh, q_rows):
    metrics, _ = run(workspace, name, 4, micro, **changes)
    assert metrics["world_size"] == 4 and metrics["global_batch_size"] == GLOBAL_BATCH
    assert losses(metrics) == pytest.approx(reference[0], abs=1e-5) and metrics["rows_seen"] == STEPS * GLOBAL_BATCH
    ranks = metrics["ranks"]
    assert all(r["mesh"] == mesh and r["engine"] == "tensor_parallel+fsdp2" for r in ranks)
    assert all(r["local_shapes"]["model.layers.0.self_attn.q_proj.weight"] == [q_rows, 64] for r in ranks)
    assert [r["coordinates"]["tp"] for r in ranks] == [0, 1, 0, 1]
    batches = [r["first_batch"] for r in ranks]
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]


def test_hsdp_four_ranks(workspace, reference):
    metrics, _ = run(workspace, "hsdp", 4, 1, fsdp_version=2, dp_replicate_size=2)
    assert losses(metrics) == pytest.approx(reference[0], abs=1e-5)
    ranks = metrics["ranks"]
    assert all(r["engine"] == "fsdp2" and r["mesh"] == {"dp_replicate": 2, "dp_shard_cp": 2} for r in ranks)
    assert len({r["first_batch"] for r in ranks}) == 4  # four data-parallel ranks, four different rows
    total = reference[1]  # the whole model, as one process holds it: each rank keeps half (2 shards, 2 replicas)
    assert all(abs(r["local_parameters"] - total / 2) < total * 0.01 for r in ranks)


@pytest.mark.parametrize(("processes", "micro", "changes"), [(2, GLOBAL_BATCH, {}), (4, 2, {"dp_shard_size": 2})],
                         ids=["cp2", "cp2-fsdp2"])  # fmt: skip
def test_context_parallel(workspace, reference, processes, micro, changes):
    metrics, output_dir = run(workspace, f"cp-{processes}", processes, micro, fsdp_version=2, context_parallel_size=2,
                              **changes)  # fmt: skip
    plan = json.loads((output_dir / "llmtune" / "plan.json").read_text())["plan"]
    assert plan["mesh"]["context_parallel"] == 2 and plan["data_parallel_size"] == processes // 2
    assert metrics["global_batch_size"] == GLOBAL_BATCH and losses(metrics) == pytest.approx(reference[0], abs=1e-5)
    assert metrics["rows_seen"] == STEPS * GLOBAL_BATCH
    ranks = metrics["ranks"]
    for r in ranks:  # each rank's model sees half of every row (rows padded to a multiple of 2 x 2 chunks)
        assert r["first_batch_width"] % 4 == 0 and r["sequence_seen"][0] * 2 == r["first_batch_width"]
    batches = [r["first_batch"] for r in ranks]  # the two ranks of a context-parallel group read the same rows
    assert all(batches[i] == batches[i + 1] for i in range(0, processes, 2))
    assert len(set(batches)) == processes // 2
    from safetensors.torch import load_file

    saved = load_file(str(output_dir / "model.safetensors"))  # gathered whole from the FSDP2 shards
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)


def test_context_parallel_under_deepspeed_is_ulysses_with_one_process_s_gradients(workspace):
    """context_parallel_size beside deepspeed runs DeepSpeed's Ulysses on packed rows, under ZeRO-2 and ZeRO-3 (which
    average gradients over different rank counts). SGD without clipping, so a gradient of the wrong scale shows in
    the losses (AdamW would hide it: transformers' own Ulysses loss doubles the gradient at 2 ranks under ZeRO-2,
    and weighs accumulated micro-batches alike). Each rank holds half of every row, the two ranks split the same
    batches, the attention keeps the packed examples apart, and losses, gradient norms, eval losses, rows and tokens
    are one process's. The ZeRO-3 run is killed after its checkpoint in the second epoch and resumed, which the
    Trainer can't do with DeepSpeed's data adapter (llmtune's UlyssesResume does)."""
    changes = {"sample_packing": True, "optimizer": "sgd", "max_grad_norm": 0, "learning_rate": 0.5,
               "gradient_accumulation_steps": 2, "val_set_size": 0.75, "eval_steps": 3, "max_steps": 6}  # fmt: skip
    single, _ = run(workspace, "ulysses-single", 1, 1, **changes)  # micro-batches of unequal tokens, accumulated
    assert single["log_history"][-2]["epoch"] > 1  # the runs cross into a second epoch
    killed = {"save_strategy": "steps", "save_steps": 5}
    with pytest.raises(AssertionError):  # the killed run fails (run() asserts success)
        run(workspace, "ulysses-zero3", 2, 1, deepspeed="zero3", context_parallel_size=2,
            env={"LLMTUNE_TEST_EXIT_AFTER_STEP": "5"}, **changes, **killed)  # fmt: skip
    for stage in ("zero2", "zero3"):
        metrics, output_dir = run(workspace, f"ulysses-{stage}", 2, 1, deepspeed=stage, context_parallel_size=2,
                                  **changes, **(killed if stage == "zero3" else {}))  # fmt: skip
        if stage == "zero3":
            assert metrics["resumed_from"].endswith("checkpoint-5") and metrics["steps"] == 6
            metrics["log_history"] = [e for e in single["log_history"] if e.get("step", 0) <= 5] + [
                e for e in metrics["log_history"] if e.get("step", 0) > 5]  # fmt: skip
        plan = json.loads((output_dir / "llmtune" / "plan.json").read_text())["plan"]
        assert plan["mesh"]["sequence_parallel"] == "ulysses" and plan["data_parallel_size"] == 1
        assert plan["kernels"]["batches"]["layout"] == "sequence-split"
        assert losses(metrics) == pytest.approx(losses(single), abs=1e-5), stage
        for key in ("grad_norm", "eval_loss"):  # evaluation: each rank reads whole rows of its own (Ulysses is off)
            ulysses, one = ([e[key] for e in m["log_history"] if key in e] for m in (metrics, single))
            assert len(ulysses) >= 2 and ulysses == pytest.approx(one, rel=1e-4), (stage, key)
        assert metrics["rows_seen"] == single["rows_seen"] == 6 * 2
        if stage == "zero2":  # (the resumed run counts the tokens of its own steps)
            assert metrics["tokens_seen"] == single["tokens_seen"]
        ranks = metrics["ranks"]
        assert all(r["engine"] == "deepspeed" and r["zero_stage"] == int(stage[-1]) for r in ranks)
        assert all(r["sequence_parallel"] == {"size": 2, "rank": r["rank"], "attention": "llmtune_varlen",
                                              "wrapper": "uattn_wrapper"} for r in ranks)  # fmt: skip
        assert ranks[0]["first_batch"] == ranks[1]["first_batch"] and ranks[0]["chunk"] != ranks[1]["chunk"]
        for r in ranks:  # each rank's model sees half of every row
            assert r["chunk_width"] * 2 == r["first_batch_width"] and r["sequence_seen"] == [r["chunk_width"]] * 2
        from safetensors.torch import load_file

        saved = load_file(str(output_dir / "model.safetensors"))  # whole, ZeRO-3's partitions gathered
        assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)


def test_hsdp_killed_after_a_checkpoint_resumes_to_the_same_losses(workspace, reference):
    """accelerate's device mesh (replicas x shards) through a SIGKILL: the rerun resumes from the checkpoint."""
    root = workspace[0]
    changes = {"fsdp_version": 2, "dp_replicate_size": 2, "save_strategy": "steps", "save_steps": 2}
    with pytest.raises(AssertionError):  # the killed run fails (run() asserts success)
        run(workspace, "hsdp-killed", 4, 1, env={"LLMTUNE_TEST_EXIT_AFTER_STEP": "2"}, **changes)
    out = root / "hsdp-killed"
    assert (out / "checkpoint-2" / "llmtune-complete.json").is_file() and not (out / "metrics.json").exists()
    metrics, _ = run(workspace, "hsdp-killed", 4, 1, **changes)
    assert metrics["resumed_from"] == str(out / "checkpoint-2")
    assert losses(metrics) == pytest.approx(reference[0], abs=1e-5)


@pytest.mark.parametrize(("processes", "micro", "mesh"), [(2, GLOBAL_BATCH, {}), (4, 2, {"fsdp_version": 2})],
                         ids=["tp2", "tp2-fsdp2"])  # fmt: skip
def test_tensor_parallel_killed_after_a_checkpoint_resumes_to_the_same_losses(workspace, reference, processes, micro,
                                                                              mesh):  # fmt: skip
    """transformers can't checkpoint a model it sharded at load; llmtune saves the model's and optimizer's DTensor
    states with torch's distributed checkpoint, and the rerun resumes on the uninterrupted losses."""
    root, name = workspace[0], f"tp-killed-{processes}"
    changes = {"tensor_parallel_size": 2, "save_strategy": "steps", "save_steps": 2, **mesh}
    with pytest.raises(AssertionError):  # the killed run fails (run() asserts success)
        run(workspace, name, processes, micro, env={"LLMTUNE_TEST_EXIT_AFTER_STEP": "2"}, **changes)
    checkpoint = root / name / "checkpoint-2"
    assert (checkpoint / "llmtune-complete.json").is_file() and not (root / name / "metrics.json").exists()
    shards = sorted(p.name for p in (checkpoint / "tp_state").iterdir() if p.suffix == ".distcp")
    assert len(shards) == processes, shards  # one file of model and optimizer shards per rank
    metrics, _ = run(workspace, name, processes, micro, **changes)
    assert metrics["resumed_from"] == str(checkpoint)
    assert losses(metrics) == pytest.approx(reference[0], abs=1e-5)
