"""Every strategy really runs on 2 CPU processes (gloo) and matches a single-process run.

A single process with gradient accumulation 2 sees the same global batch of 8 rows per step as
2 ranks with accumulation 1, so the per-step losses must agree. This is what catches the silent
failures (DeepSpeed at world size 1, FSDP turned into DDP): an exit code alone proves nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import LORA, losses, make_workspace, read_metrics, saved_weights, train_run, write_run_recipe

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "dist", tiny_model)


# Every run decays its weights: a strategy that decays what the Trainer leaves out (biases, norms), as DeepSpeed's
# CPU Adam did over one group of every parameter, ends away from one process's weights
DECAY = {"weight_decay": 0.1}


def run(workspace, name: str, processes: int, **changes) -> tuple[dict, Path]:
    """With 5 eval rows: batches of 4 and 1 on one process, and on 2 ranks 4 real rows on one and 1 on the other,
    which the Trainer evens out by repeating rows (llmtune fills with label-free rows and weighs by token)."""
    from tiny import write_jsonl

    held_out = write_jsonl(workspace[0] / "eval.jsonl", [{"instruction": f"Repeat {w}", "output": " ".join([w] * n)}
                                                         for n, w in enumerate(["sun", "moon", "star", "sky", "sea"], 1)])  # fmt: skip
    return train_run(workspace, name, processes, gradient_accumulation_steps=2 // processes,
                     test_datasets=[{"path": str(held_out), "type": "alpaca"}], **DECAY, **changes)  # fmt: skip


@pytest.fixture(scope="module")
def reference(workspace):
    return {"full": run(workspace, "single-full", 1), "lora": run(workspace, "single-lora", 1, **LORA)}


CASES = [
    ("ddp", {}, "full"),
    ("ddp-lora", LORA, "lora"),
    ("zero1", {"deepspeed": "zero1"}, "full"),
    ("zero2", {"deepspeed": "zero2"}, "full"),
    ("zero2-lora", {"deepspeed": "zero2", **LORA}, "lora"),
    ("zero3", {"deepspeed": "zero3"}, "full"),
    ("zero3-lora", {"deepspeed": "zero3", **LORA}, "lora"),
    ("zero3-offload", {"deepspeed": "zero3_offload"}, "full"),
    ("fsdp2", {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}}, "full"),
    # fsdp_config.activation_checkpointing as Axolotl's FSDP2 LoRA examples set it: under FSDP's checkpoint wrapper
    # PEFT saved an empty adapter; the plan gives the recomputation to the model, and the adapter must equal one process's
    ("fsdp2-lora", {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT",
                                                       "activation_checkpointing": True}, **LORA}, "lora"),
    ("fsdp2-sharded", {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}, "full"),
]
SHARDED = ("zero3", "fsdp2")
# What each rank must report it really ran (read from the live engine after training): the variants give the same
# losses by design, so only this tells a strategy from a silent fallback to another.
ENGINES = {
    "ddp": {"engine": "ddp"},
    "zero1": {"engine": "deepspeed", "zero_stage": 1, "offload_optimizer": "none", "offload_param": "none"},
    "zero2": {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": "none", "offload_param": "none"},
    "zero3": {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "none", "offload_param": "none"},
    "zero3-offload": {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
                      "optimizer": "DeepSpeedCPUAdam"},
    "fsdp2": {"engine": "fsdp2", "placements": ["Shard(0)"], "state_dict_type": "FULL_STATE_DICT"},
    "fsdp2-sharded": {"engine": "fsdp2", "placements": ["Shard(0)"], "state_dict_type": "SHARDED_STATE_DICT"},
}  # fmt: skip


def engine_of(name: str) -> dict:
    return ENGINES.get(name) or ENGINES[name.removesuffix("-lora")]


# Measured at the optimizer step. Not ZeRO-1: its full gradients live only during backward, where the
# step-time measurement can't see them. ZeRO-3 + offload holds the same bytes, on the CPU.
ESTIMATE_ROWS = {"ddp": "single / DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP full shard"}


def check_estimate(metrics: dict, output_dir: Path, name: str) -> None:
    """`llmtune estimate` against the bytes each rank really held: params, grads and optimizer states."""
    import json

    from llmtune.plan.memory.facts import read_model_facts
    from llmtune.plan.memory.peak import estimate
    from llmtune.plan.memory.states import trainable_parameters
    from llmtune.recipe import Recipe

    plan = json.loads((output_dir / "llmtune" / "plan.json").read_text())
    recipe = Recipe.model_validate(plan["recipe"])
    facts = read_model_facts(recipe.base_model)
    trainable = trainable_parameters(recipe, facts)
    assert trainable == metrics["trainable_parameters"]
    assert facts.total_params() + (trainable if recipe.adapter else 0) == metrics["total_parameters"]
    rows = {e.strategy: e for e in estimate(recipe, facts, data_parallel=2, gpus_per_machine=2, mixed=False)}
    row = rows[ESTIMATE_ROWS[name.split("-")[0]]]
    expected = row.model_states + row.step_copy
    counted = counted_components(name, metrics, facts)
    for rank in metrics["ranks"]:
        held = rank["model_state_bytes"]
        assert held is not None, f"rank {rank['rank']} measured nothing"
        assert sum(held.values()) == pytest.approx(expected, rel=0.10), (held, row)
        for part in ("params", "grads", "optimizer"):  # each at 1%, against the test's own count
            assert held[part] == pytest.approx(counted[part], rel=0.01), (part, held, counted)


def counted_components(name: str, metrics: dict, facts, n: int = 2) -> dict[str, float]:
    """Bytes per rank of params, grads and optimizer states, counted from the model's shapes and each strategy's
    rules (fp32 in rehearsal), from the parameter counts: torch's Adam keeps two moments (and a 4-byte step per
    tensor, under 0.1% here, left out), DeepSpeed's a fp32 master copy besides."""
    total, trainable = metrics["total_parameters"], metrics["trainable_parameters"]
    tensors = 0  # torch's 4-byte step per tensor: under 0.1% of the optimizer bytes here
    strategy, lora = name.split("-")[0], name.endswith("lora")
    if strategy == "ddp":  # every rank holds everything
        return {"params": 4 * total, "grads": 4 * trainable, "optimizer": 8 * trainable + 4 * tensors}
    if strategy == "fsdp2":  # every tensor sharded along dim 0; the step counters are per tensor, not sharded
        return {"params": 4 * total / n, "grads": 4 * trainable / n, "optimizer": 8 * trainable / n + 4 * tensors}
    # DeepSpeed: the fp32 master partition and two moments (12 bytes per trainable parameter, over N); the gradient
    # partition it reduces into, and the flat fp32 copy of it the optimizer steps on (the estimate's step_copy).
    # ZeRO-1/2 with an adapter step on the reduced partition itself (one copy; measured, 2 ranks, fp32)
    params = 4 * total / n if strategy == "zero3" else 4 * total
    grads = 4 * trainable / n * (1 if lora and strategy != "zero3" else 2)
    return {"params": params, "grads": grads, "optimizer": 12 * trainable / n}


@pytest.mark.parametrize(("name", "changes", "kind"), CASES, ids=[c[0] for c in CASES])
def test_two_ranks_match_single_process(workspace, reference, name, changes, kind):
    metrics, output_dir = run(workspace, name, 2, **changes)
    ref_metrics, ref_dir = reference[kind]
    assert metrics["world_size"] == 2
    ranks = metrics["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks trained on the same data"
    assert metrics["steps"] == ref_metrics["steps"] == 4
    for rank in ranks:
        assert {key: rank.get(key) for key in engine_of(name)} == engine_of(name), rank
        # DeepSpeed is imported by the ranks of a ZeRO plan only (read from each rank's sys.modules)
        assert rank["libraries"].keys() == ({"deepspeed"} if name.startswith("zero") else set()), rank
    # who recomputed activations: none asked for but fsdp2-lora's, which the plan gives to the model (not FSDP's wrapper)
    assert {r["activation_checkpointing"] for r in ranks} == {"model" if name == "fsdp2-lora" else "none"}, ranks
    if name.startswith("zero") and "offload" not in name:
        assert all(r["optimizer"] != "DeepSpeedCPUAdam" for r in ranks)
    if name.startswith("zero"):  # the Trainer's groups, whoever steps them: decay, and none on biases and norms
        # (a LoRA's adapters all decay; DeepSpeed drops the empty group)
        assert all(r["weight_decay"] == ([0.1] if kind == "lora" else [0.1, 0.0]) for r in ranks), ranks
    if name.startswith("zero"):  # DeepSpeed's CPU shared-memory all-reduce (inference only): neither built nor loaded
        assert "deepspeed_shm_comm_op" not in (output_dir / "llmtune" / "logs" / "machine-0.log").read_text()
    assert losses(metrics) == pytest.approx(losses(ref_metrics), abs=2e-5)
    # the eval loss: the mean over every label token of the eval set, as one process's (no row counted twice)
    assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], abs=1e-4)
    assert metrics["eval_tokens"] == ref_metrics["eval_tokens"] > 0
    # the logged learning rate is the step's own, as one process logs it (DeepSpeed's was the next step's)
    rates = [[e["learning_rate"] for e in m["log_history"] if "loss" in e] for m in (metrics, ref_metrics)]
    assert rates[0] == pytest.approx(rates[1], rel=1e-6) and len(set(rates[1])) > 1, rates
    # the saved model (ZeRO-3: gathered from the shards) equals the single-process result
    saved, expected = saved_weights(output_dir), saved_weights(ref_dir)
    assert saved.keys() == expected.keys() and len(saved) > 0
    for key, tensor in expected.items():
        assert saved[key].shape == tensor.shape and saved[key].abs().sum() > 0, key
        assert (saved[key].float() - tensor.float()).abs().max().item() < 1e-4, key
    if name.split("-")[0] in ESTIMATE_ROWS:
        check_estimate(metrics, output_dir, name)
    full_size = ref_metrics["ranks"][0]["local_parameters"]
    if name.startswith(SHARDED):
        # ZeRO-3 and FSDP2 partition every parameter: each rank holds half
        assert all(r["local_parameters"] == pytest.approx(full_size / 2, rel=0.01) for r in ranks), ranks
    else:
        assert all(r["local_parameters"] == full_size for r in ranks), ranks


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_two_machines(workspace, name: str, processes: int, **changes) -> dict:
    """Two llmtune launchers on 127.0.0.1 (machine rank 0 and 1) forming one job, as on two nodes."""
    import os
    import subprocess
    import sys

    path = write_run_recipe(workspace, name, micro_batch_size=4 * 2 // processes, **DECAY, **changes)
    port = free_port()
    flags = ["--num-machines", "2", "--num-processes", str(processes), "--main-process-ip", "127.0.0.1",
             "--main-process-port", str(port)]  # fmt: skip
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "llmtune", "train", str(path), *flags, "--machine-rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ},
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [launcher.communicate(timeout=900)[0] for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return read_metrics(path)


@pytest.mark.parametrize("processes", [2, 4], ids=["2x1", "2x2"])
def test_two_machines_on_localhost_form_one_job(workspace, reference, processes):
    metrics = run_two_machines(workspace, f"machines-{processes}", processes)
    assert metrics["world_size"] == processes
    assert sorted(r["rank"] for r in metrics["ranks"]) == list(range(processes))
    assert len({r["first_batch"] for r in metrics["ranks"]}) == processes
    # 2 x 1 process, micro 4: the global batch of 8 equals the single-process reference
    # 2 x 2 processes, micro 2: the same global batch of 8, split four ways
    assert metrics["global_batch_size"] == 8
    assert losses(metrics) == pytest.approx(losses(reference["full"][0]), abs=2e-5)
