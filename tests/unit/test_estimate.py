"""Memory estimates follow the ZeRO paper's accounting (Rajbhandari et al., Table 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtune.plan.memory.buffers import GB, MAX_LIVE_PARAMETERS
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.peak import estimate
from llmtune.plan.memory.states import state_bytes
from llmtune.recipe.loader import recipe_from_mapping


def recipe(**changes):
    base = {"base_model": "m", "datasets": [{"path": "d", "type": "alpaca"}], "bf16": True, "optimizer": "adamw_torch"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


class SevenPointFiveB(ModelFacts):
    def total_params(self) -> int:
        return 7_500_000_000


FACTS = SevenPointFiveB("llama", 4096, 32, 32, 32, 11008, 32000, False)


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    b = state_bytes("adamw_torch", mixed=True)
    assert (b.params, b.grads, b.optimizer) == (2, 2, 12)


@pytest.mark.parametrize(
    ("strategy", "expected_gb"),
    [("single / DDP", 120), ("ZeRO-1", 31.4), ("ZeRO-2", 16.6), ("ZeRO-3", 1.9)],
)
def test_model_states_match_the_zero_paper_table(strategy, expected_gb):
    # Table 1 of the ZeRO paper: Psi = 7.5B, K = 12, N_d = 64
    rows = {e.strategy: e for e in estimate(recipe(), FACTS, data_parallel=64, gpus_per_machine=8)}
    row = rows[strategy]
    assert (row.params + row.grads + row.optimizer) / GB == pytest.approx(expected_gb, abs=0.05)


def test_offload_moves_states_to_cpu():
    rows = {e.strategy: e for e in estimate(recipe(), FACTS, data_parallel=8, gpus_per_machine=8)}
    off = rows["ZeRO-3 + CPU offload"]
    assert off.params == 0 and off.optimizer == 0
    # the whole machine's shards: 16-bit params and grads, the fp32 gradient copy, the optimizer's 12 bytes
    assert off.cpu == pytest.approx((2 + 2 + 4 + 12) * 7.5e9)


def test_llama3_8b_parameter_count():
    llama = ModelFacts("llama", 4096, 32, 32, 8, 14336, 128256, False)
    assert llama.total_params() == pytest.approx(8.03e9, rel=0.005)


def test_lora_keeps_the_base_frozen_in_16_bits():
    llama = ModelFacts("llama", 4096, 32, 32, 8, 14336, 128256, False)
    [ddp, *_] = estimate(recipe(adapter="lora", lora_r=16, lora_target_linear=True), llama, 1, 1)
    assert ddp.params == pytest.approx(2 * llama.total_params() + 4 * 41_943_040, rel=1e-6)
    assert ddp.optimizer == pytest.approx(8 * 41_943_040)


def test_estimate_command_recommends_by_the_seeds_rules(run_cli, tmp_path):
    import json

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "r.yaml"
    path.write_text(f"base_model: {tmp_path}\ndatasets:\n  - path: org/d\n    type: alpaca\nbf16: true\n"
                    "sequence_len: 2048\ngradient_checkpointing: true\n")  # fmt: skip
    one = run_cli("estimate", path, "--gpus-per-machine", "1", "--gpu-memory", "80GB")
    assert one.code == 0 and "8.03B parameters" in one.out
    # the settings every row is for, said under the table
    said = " ".join(one.out.split())
    assert ("for: full, sequence_len 2048, micro_batch_size 1, gradient checkpointing on, optimizer adamw_torch, "
            "precision bf16") in said, said  # fmt: skip
    assert "recommended: ZeRO-2 + CPU offload" in one.out  # 16 bytes x 8B = 128 GB of states can't fit one 80 GB GPU
    eight = run_cli("estimate", path, "--gpus-per-machine", "8", "--gpu-memory", "80GB")
    assert "recommended: ZeRO-1" in eight.out
    tiny = run_cli("estimate", path, "--gpus-per-machine", "8", "--gpu-memory", "4GB")
    assert "recommended: ZeRO-3 + CPU offload" in tiny.out or "nothing fits" in tiny.out
    bad = run_cli("estimate", path, "--gpu-memory", "lots")
    assert bad.code == 2 and "--gpu-memory" in bad.err


LLAMA_7B = ModelFacts("llama", 4096, 32, 32, 32, 11008, 32000, False)


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 1), (1, 8), (4, 8)])
def test_agrees_with_deepspeeds_own_estimates(nodes, gpus):
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs, term by term (GPU side)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi, n = LLAMA_7B.total_params(), nodes * gpus
    largest = max(LLAMA_7B.layer_params(), LLAMA_7B.embedding_params())
    rows = {e.strategy: e for e in estimate(recipe(), LLAMA_7B, data_parallel=n, gpus_per_machine=gpus)}
    states = {name: row.model_states + row.step_copy for name, row in rows.items()}

    # ZeRO-2: 2 (16-bit params) + 18/N (16-bit grads, fp32 grads, fp32 params, Adam moments): exactly ours
    _, ds = estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=False)
    assert states["ZeRO-2"] == pytest.approx(ds, abs=1)
    _, ds = estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=True)
    assert states["ZeRO-2 + CPU offload"] == pytest.approx(ds, abs=1)  # only the 16-bit params stay
    # ZeRO-3 + full offload: DeepSpeed's function keeps only the largest layer (with its gradient) on the GPU;
    # we keep what stage3_max_live_parameters lets stay gathered, when that is more (measured on an H100)
    live = 2 * min(MAX_LIVE_PARAMETERS, psi)
    _, ds, _ = estimate_zero3_model_states_mem_needs(psi, largest, gpus, nodes, cpu_offload=True)
    assert states["ZeRO-3 + CPU offload"] == 0
    assert rows["ZeRO-3 + CPU offload"].gathered == pytest.approx(max(ds, live), abs=1)
    # ZeRO-3: DeepSpeed counts 18/N; we also count the 16-bit gradient partition its stage-3 optimizer
    # accumulates into before the fp32 copy (2/N more), which the CPU rehearsal measures (test_distributed),
    # and the live parameters gathered from the other ranks
    _, ds, _ = estimate_zero3_model_states_mem_needs(psi, largest, gpus, nodes, cpu_offload=False)
    layer = ds - 18 * psi / n
    gathered = max(layer, live * (1 - 1 / n))
    assert rows["ZeRO-3"].gathered + states["ZeRO-3"] == pytest.approx(ds - layer + gathered + 2 * psi / n, abs=1)


def test_train_refuses_a_plan_that_cannot_fit(run_cli, tmp_path):
    path = tmp_path / "r.yaml"
    out = tmp_path / "out"
    path.write_text(f"base_model: meta-llama/Llama-3.1-8B\ndatasets:\n  - path: org/d\n    type: alpaca\n"
                    f"bf16: true\ngradient_checkpointing: true\noutput_dir: {out}\n")  # fmt: skip
    result = run_cli("train", path, "--num-processes", "8", "--gpu-memory", "40GB")
    assert result.code == 2 and "needs about 165.7 GB per GPU under single / DDP" in result.err
    assert "the GPUs have 40 GB and llmtune refuses above 95% of that, 38.0 GB" in result.err
    assert "hint: ZeRO-2 would fit" in result.err and "--no-memory-check" in result.err
    assert not out.exists()  # refused before anything is written


def test_fit_check_passes_what_the_estimate_allows():
    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.memory.fit import check_fits, row_for_plan

    lora = recipe(base_model="meta-llama/Llama-3.1-8B", adapter="lora", lora_r=16, lora_target_linear=True,
                  gradient_checkpointing=True, deepspeed="zero3")  # fmt: skip
    plan = make_plan(lora, make_cluster(num_processes=8, device="cpu"))
    assert row_for_plan(plan) == "ZeRO-3"
    summary = check_fits(lora, plan, 80e9)
    assert "per GPU under ZeRO-3" in summary and "refuses above 95% of that, 76.0 GB" in summary
    with pytest.raises(Exception, match="needs about"):
        check_fits(lora, plan, 4e9)


def test_the_fit_check_counts_the_offload_and_sharding_the_plan_really_runs(monkeypatch):
    """Offloads and shardings the table has no row for were checked as another row: parameter-only offload as full
    offload (the optimizer's 106 GB per GPU left out for 70B), HSDP as sharding over every GPU, FSDP's CPU offload
    as none (refusing runs that fit); and no row's CPU memory was checked at all."""
    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.memory import fit

    def planned(world=8, machines=1, **changes):
        recipe_ = recipe(base_model="meta-llama/Llama-3.1-70B", bf16=True, gradient_checkpointing=True, **changes)
        cluster = make_cluster(world, num_machines=machines, main_process_ip="10.0.0.1" if machines > 1 else None,
                               device="cuda")  # fmt: skip
        plan = make_plan(recipe_, cluster)
        report = fit.estimate_recipe(recipe_, world // machines, machines, 80e9)
        return fit.planned_row(report, plan), report

    def zero3(**offload):
        return {"zero_optimization": {"stage": 3, **{k: {"device": "cpu"} for k in offload}}}

    params_out, report = planned(deepspeed=zero3(offload_param=1))
    both, optimizer_out = report.row("ZeRO-3 + CPU offload"), planned(deepspeed=zero3(offload_optimizer=1))[0]
    assert params_out.params == both.params and params_out.optimizer == report.row("ZeRO-3").optimizer > 100e9 / 8
    assert optimizer_out.params == report.row("ZeRO-3").params and optimizer_out.optimizer == 0
    # what leaves the GPU is counted where it goes: the parameters' share on the CPU, NVMe states off the CPU
    assert params_out.cpu == pytest.approx((report.row("ZeRO-3").params - both.params) * 8) and params_out.nvme == 0
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nv"}}}
    to_nvme = planned(deepspeed=nvme)[0]
    assert to_nvme.nvme == pytest.approx(report.row("ZeRO-3").optimizer * 8) and to_nvme.optimizer == 0
    assert to_nvme.cpu == report.row("ZeRO-3 + NVMe offload").cpu < optimizer_out.cpu
    assert to_nvme.strategy == "ZeRO-3 + offload (optimizer to NVMe)"
    assert planned(deepspeed=zero3(offload_param=1, offload_optimizer=1))[0] == both  # the table's own row
    zero1 = planned(deepspeed={"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})[0]
    assert zero1.grads == report.row("ZeRO-1").grads and zero1.optimizer == 0 and zero1.cpu > 0
    fsdp = planned(fsdp_version=2, fsdp_config={"offload_params": True})[0]
    assert fsdp.model_states == 0 and fsdp.cpu == pytest.approx(8 * sum(
        getattr(report.row("FSDP full shard"), k) for k in ("params", "grads", "optimizer")))  # fmt: skip
    hybrid, report = planned(16, 2, fsdp_version=2, dp_replicate_size=2, dp_shard_size=8)
    assert hybrid.params == pytest.approx(2 * report.row("FSDP full shard").params)
    # the CPU side: a row that fits the GPUs but not this machine's memory is refused, naming both
    offloaded = recipe(base_model="meta-llama/Llama-3.1-70B", bf16=True, gradient_checkpointing=True,
                       deepspeed="zero3_offload")  # fmt: skip
    plan = make_plan(offloaded, make_cluster(8, device="cuda"))
    monkeypatch.setattr(fit, "cpu_memory_of_this_machine", lambda: 256e9)
    with pytest.raises(Exception, match=r"ZeRO-3 \+ CPU offload offloads about 1411 GB to this machine's CPU memory, "
                                        "which has 256 GB"):  # fmt: skip
        fit.check_fits(offloaded, plan, 80e9)
    monkeypatch.setattr(fit, "cpu_memory_of_this_machine", lambda: 2048e9)
    assert "under ZeRO-3 + CPU offload" in fit.check_fits(offloaded, plan, 80e9)
    # what would help, of what the recipe doesn't do already (it advised checkpointing and LoRA where both were on)
    lora = recipe(adapter="lora", gradient_checkpointing=True, micro_batch_size=1, sequence_len=32768)
    assert fit.remedy(lora) == "add GPUs, shorten sequence_len, or use QLoRA (adapter: qlora)"
    assert fit.remedy(recipe(micro_batch_size=4)) == ("add GPUs, lower micro_batch_size, turn on "
                                                      "gradient_checkpointing, or use LoRA")  # fmt: skip


def test_recommendation_follows_the_interconnect():
    from llmtune.plan.memory.fit import estimate_recipe

    llama = ModelFacts("llama", 4096, 32, 32, 8, 14336, 128256, False)
    full = recipe(gradient_checkpointing=True, sequence_len=2048)
    fast = estimate_recipe(full, 8, 4, 32e9, interconnect="fast", facts=llama)
    slow = estimate_recipe(full, 8, 4, 32e9, interconnect="slow", facts=llama)
    assert fast.choice[0].strategy == "ZeRO-2"  # ZeRO scales over a fast interconnect
    assert slow.choice[0].strategy.startswith("pipeline")  # DP + PP keeps the traffic inside machines


# Issue 17: CUDA peaks measured on one H100 by benchmarks/gpu_memory.py (tests/fixtures/h100_memory.json): Llama
# shapes of 1B and 8B with SmolLM2's 49,152-token vocabulary, bf16, seq 1024, under both allocator modes.
ONE_B = ModelFacts("llama", 2048, 16, 32, 8, 8192, 49152, True)
EIGHT_B = ModelFacts("llama", 4096, 32, 32, 8, 14336, 49152, False)
RUN = {"sequence_len": 1024, "micro_batch_size": 8}
H100_FILE = json.loads((Path(__file__).parent.parent / "fixtures" / "h100_memory.json").read_text())
H100 = H100_FILE["rows"]
# The CUDA context of a process alone on the H100 (after one matmul). The rows' own runs shared the GPU with the
# test groups, so a total - free reading during them counted other processes (issue 32); a row that recorded its
# rank's own context (benchmarks/gpu_memory.py's rank_context_bytes) is compared with that instead.
H100_CONTEXT = H100_FILE["cuda_context_bytes"]
SHAPES = {"1b": ONE_B, "8b": EIGHT_B}
# Bounds on estimate total / (reserved + context). Expandable segments (what llmtune's workers run with): an
# estimate that is low costs an OOM, so never more than 5% under; at most 10% over. A user's own allocator config
# without them: no constant fits every run (gpu_memory.RESERVE_FRACTION), within 25% either way.
BOUNDS = {True: (0.95, 1.10), False: (0.75, 1.25)}


def measured_recipe(run: dict):
    """The recipe of a measured run: its keys as benchmarks/gpu_memory.py recorded them."""
    c = run["configuration"]
    changes = {"bf16": True, "sequence_len": c["sequence_len"], "micro_batch_size": c["micro_batch_size"],
               "optimizer": c["optimizer"], "sample_packing": c["layout"] == "packed",
               "gradient_checkpointing": c["checkpointing"] == "on", **run["recipe_keys"]}  # fmt: skip
    if c["attention"] != "sdpa":
        changes["attn_implementation"] = c["attention"]
    return recipe(**changes)


def measured_row(run: dict):
    """The estimate of a measured run: the row benchmarks/gpu_memory.py recorded for it."""
    c = run["configuration"]
    expandable = run["allocator"].startswith("expandable")
    rows = estimate(measured_recipe(run), SHAPES[c["shape"]], data_parallel=1, gpus_per_machine=1,
                    expandable=expandable, fused=False)  # fmt: skip (they stepped foreach AdamW)
    label = " ".join(str(c[k]) for k in ("shape", "method", "strategy", "checkpointing", "layout"))
    return label, {e.strategy: e for e in rows}[run["estimate_row"]], expandable


def like_for_like(run: dict) -> float:
    """Estimate total (context included) / (reserved + the CUDA context): the same quantity on both sides."""
    _, row, _ = measured_row(run)
    return row.total / (run["measured_reserved_bytes"] + run.get("rank_context_bytes", H100_CONTEXT))


@pytest.mark.parametrize("run", H100, ids=lambda r: f"{r['allocator'][:10]}-" + "-".join(
    str(r["configuration"][k]) for k in ("shape", "method", "strategy", "checkpointing", "layout")))  # fmt: skip
def test_each_estimate_term_lands_on_the_quantity_it_predicts(run):
    label, row, expandable = measured_row(run)
    allocated, reserved = run["measured_allocated_bytes"], run["measured_reserved_bytes"]
    context = run.get("rank_context_bytes", H100_CONTEXT)
    ratio = like_for_like(run)
    print(f"{label}: allocated {row.allocated / GB:.2f} vs {allocated / GB:.2f}; allocated + reserve "
          f"{(row.allocated + row.reserve) / GB:.2f} vs reserved {reserved / GB:.2f}; total {row.total / GB:.2f} vs "
          f"reserved + context {(reserved + context) / GB:.2f} ({ratio:.3f})")  # fmt: skip
    assert 0.98 <= row.allocated / allocated <= 1.02  # the counted bytes, before any allocator constant
    assert row.overhead == pytest.approx(context, rel=0.01)  # the estimate's context is the measured one
    low, high = BOUNDS[expandable]
    assert low <= ratio <= high  # the whole: what nvidia-smi would show for the process
    if expandable:  # the allocator's side alone (the context is the same 0.72 GB on both sides)
        assert low <= (row.allocated + row.reserve) / reserved <= high


def test_the_published_calibration_range_is_the_like_for_like_one():
    """README.md, docs/estimate.md and tests/gpu/RESULTS.md quote the range these rows give today (issue 32: the
    figure published before set the total against reserved memory alone)."""
    import re

    ratios = [like_for_like(run) for run in H100 if run["allocator"].startswith("expandable")]
    today = f"{min(ratios):.3f}-{max(ratios):.3f}"
    root = Path(__file__).parent.parent.parent
    claims = {"README.md": "The total is ", "docs/estimate.md": "Total against reserved \\+ context: ",
              "tests/gpu/RESULTS.md": "The same rows now give "}  # fmt: skip
    for doc, lead in claims.items():
        quoted = re.search(lead + r"(\d\.\d{3}-\d\.\d{3})", (root / doc).read_text())
        assert quoted and quoted.group(1) == today, f"{doc} should quote {today} after {lead!r}"


def test_the_calibration_covers_what_the_issue_asks():
    runs = [r["configuration"] for r in H100 if r["allocator"].startswith("expandable")]
    covered = {key: {c[key] for c in runs} for key in ("shape", "method", "strategy", "checkpointing", "layout")}
    assert covered["shape"] == {"1b", "8b"} and covered["method"] == {"full", "lora", "qlora"}
    assert covered["strategy"] == {"single", "zero2", "zero3", "zero3_offload", "fsdp2"}
    assert covered["checkpointing"] == {"on", "off"} and covered["layout"] == {"packed", "padded"}


QLORA_8B = {**RUN, "micro_batch_size": 4, "sample_packing": True, "adapter": "qlora", "load_in_4bit": True,
            "lora_r": 8, "lora_target_linear": True, "gradient_checkpointing": True}  # fmt: skip


def test_qlora_counts_what_bitsandbytes_and_peft_keep():
    row = estimate(recipe(**QLORA_8B), EIGHT_B, 1, 1)[0]
    # issue 17: 5.27 GB of parameters held (4-bit layers, their absmax, fp32 embeddings and lm_head, adapters)
    assert row.params / GB == pytest.approx(5.27, abs=0.05)


def test_json_shows_the_gpu_terms(run_cli, tmp_path):
    import json

    path = tmp_path / "r.yaml"
    path.write_text("base_model: meta-llama/Llama-3.2-1B\ndatasets:\n  - path: org/d\n    type: alpaca\nbf16: true\n")
    result = run_cli("estimate", path, "--json")
    report = json.loads(result.out)
    row = report["rows"][0]
    for key in (
        "logits",
        "weight_copies",
        "reserve",
        "overhead",
        "allocated",
        "peak_at",
        "at_loss",
        "at_step",
        "total",
    ):
        assert key in row, key
    assert row["total"] == pytest.approx(row["allocated"] + row["reserve"] + row["overhead"])
    assert report["fit_fraction"] == 0.95
    table = run_cli("estimate", path)
    assert "logits" in table.out and "reserve" in table.out and "context" in table.out


def test_eight_bit_optimizers_and_fused_adam_cost_less_at_the_step():
    full = {**RUN, "sample_packing": True}
    torch_adam, fused, eight = (estimate(recipe(**full, optimizer=name), ONE_B, 1, 1, fused=False)[0]
                                for name in ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit"))  # fmt: skip
    psi = ONE_B.total_params()
    assert torch_adam.temporaries == pytest.approx(4 * psi)  # foreach AdamW's sqrt(v) for every parameter at once
    assert fused.temporaries == 0 and eight.temporaries == 0
    # on CUDA the plan steps adamw_torch fused: no scratch, except in the pipeline's own loop, which steps foreach
    planned = {row.name: row for row in estimate(recipe(**full, optimizer="adamw_torch"), ONE_B, 4, 4, stages=4)}
    assert all(planned[name].temporaries == 0 for name in ("single / DDP", "ZeRO-1", "ZeRO-3", "FSDP full shard"))
    assert planned["pipeline"].temporaries > 0
    # 8 bytes of moments -> 2, but for the input embedding, whose states the Trainer keeps in 32 bits
    assert torch_adam.optimizer - eight.optimizer == pytest.approx(6 * (psi - ONE_B.embedding_params()))


def test_padded_batches_reserve_more_than_packed_ones_without_expandable_segments():
    def rows(expandable: bool, **changes):
        return estimate(recipe(**RUN, **changes), ONE_B, 1, 1, expandable=expandable)[0]

    packed, padded = rows(False, sample_packing=True), rows(False)
    assert packed.allocated == padded.allocated and padded.reserve > packed.reserve
    assert rows(False, pad_to_sequence_len=True).reserve == packed.reserve  # padded to sequence_len: fixed shapes
    # expandable segments reuse freed pages at any size: the H100 measured 39.1 GB reserved for both
    assert rows(True, sample_packing=True).reserve == rows(True).reserve


def test_the_allocator_mode_follows_the_environment_the_workers_get(monkeypatch):
    from llmtune.plan.memory.buffers import expandable_segments

    assert expandable_segments({})  # llmtune's workers default to it
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert not expandable_segments({"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    legacy = estimate(recipe(**RUN), ONE_B, 1, 1)[0]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert legacy.reserve == estimate(recipe(**RUN), ONE_B, 1, 1, expandable=False)[0].reserve
    assert legacy.reserve > estimate(recipe(**RUN), ONE_B, 1, 1)[0].reserve


def test_tensor_parallel_row_splits_states_and_the_split_part_of_the_activations():
    from llmtune.plan.memory.parallel import TP_REPLICATED_ACTIVATIONS

    r = recipe(sequence_len=8192, micro_batch_size=1)
    rows = {e.name: e for e in estimate(r, FACTS, data_parallel=8, gpus_per_machine=8)}
    tp, single = rows["tensor parallel"], rows["single / DDP"]
    assert tp.strategy == "tensor parallel (8-way)"  # the largest degree inside a machine that divides the heads
    assert tp.params == pytest.approx(single.params / 8) and tp.optimizer == pytest.approx(single.optimizer / 8)
    share = TP_REPLICATED_ACTIVATIONS + (1 - TP_REPLICATED_ACTIVATIONS) / 8
    assert tp.activations == pytest.approx(single.activations * share)
    assert tp.logits == single.logits  # the head's output is gathered whole on every rank for the loss
    # the recipe's own degree, with FSDP2 over dp_shard_size ranks on top
    r2 = recipe(sequence_len=8192, tensor_parallel_size=2, dp_shard_size=4)
    row = {e.name: e for e in estimate(r2, FACTS, data_parallel=4, gpus_per_machine=8)}["tensor parallel"]
    assert row.strategy == "tensor parallel (2-way)" and row.params == pytest.approx(single.params / 8)


def test_tensor_parallel_is_recommended_when_only_split_activations_fit():
    from llmtune.plan.memory.buffers import FIT_FRACTION
    from llmtune.plan.memory.fit import recommend

    # packed rows: context parallelism can't split them (no context-parallel row), tensor parallelism can
    r = recipe(sequence_len=65536, micro_batch_size=1, gradient_checkpointing=False, sample_packing=True)
    rows = estimate(r, FACTS, data_parallel=8, gpus_per_machine=8)
    by_name = {e.name: e for e in rows}
    assert "context parallel" not in by_name
    tp = by_name["tensor parallel"]
    # a memory where the tensor-parallel row fits but no sharding of states alone does
    budget = tp.total / FIT_FRACTION * 1.01
    assert all(not by_name[n].fits(budget) for n in ("ZeRO-3", "FSDP full shard", "pipeline") if n in by_name)
    choice = recommend(rows, budget)
    assert choice is not None and choice[0].name == "tensor parallel" and "activations" in choice[1]


def test_context_parallel_row_splits_every_activation_and_is_preferred_for_long_rows():
    from llmtune.plan.memory.buffers import FIT_FRACTION
    from llmtune.plan.memory.fit import recommend

    r = recipe(sequence_len=65536, micro_batch_size=1)
    rows = estimate(r, FACTS, data_parallel=8, gpus_per_machine=8)
    by_name = {e.name: e for e in rows}
    cp, fsdp = by_name["context parallel"], by_name["FSDP full shard"]
    assert cp.strategy == "context parallel (8-way)"
    assert cp.params == pytest.approx(fsdp.params) and cp.optimizer == pytest.approx(fsdp.optimizer)
    assert cp.activations == pytest.approx(fsdp.activations / 8) and cp.logits == pytest.approx(fsdp.logits / 8)
    budget = cp.total / FIT_FRACTION * 1.01
    assert not fsdp.fits(budget)
    choice = recommend(rows, budget)
    assert choice is not None and choice[0].name == "context parallel" and "long sequences" in choice[1]


def test_zero_rows_under_ulysses_split_the_activations_and_logits_not_the_states():
    """context_parallel_size beside deepspeed (Ulysses): each rank holds 1/C of every row, so the ZeRO rows' saved
    activations and logits are 1/C of the same recipe's without it; ZeRO's sharding of the states is unchanged."""
    plain = {e.name: e for e in estimate(recipe(sequence_len=65536, micro_batch_size=1, deepspeed="zero3"), FACTS,
                                         data_parallel=8, gpus_per_machine=8)}  # fmt: skip
    split = {e.name: e for e in estimate(recipe(sequence_len=65536, micro_batch_size=1, deepspeed="zero3",
                                                context_parallel_size=4), FACTS, data_parallel=8, gpus_per_machine=8)}  # fmt: skip
    for name in ("ZeRO-2", "ZeRO-3", "ZeRO-3 + CPU offload"):
        assert split[name].activations == pytest.approx(plain[name].activations / 4), name
        assert split[name].logits == pytest.approx(plain[name].logits / 4), name
        assert split[name].params == pytest.approx(plain[name].params) and split[name].total < plain[name].total
    assert split["FSDP full shard"].activations == pytest.approx(plain["FSDP full shard"].activations)


# Issue 32: every row says whether a recorded GPU run covers it ("measured on H100") or not ("modelled").
def test_the_measured_table_is_what_the_gpu_runs_recorded():
    from llmtune.plan.memory.basis import MEASURED, MEASURED_ATTENTION, MEASURED_OPTIMIZERS

    recorded = {("expandable" if r["allocator"].startswith("expandable") else "default", r["estimate_row"],
                 r["configuration"]["method"]) for r in H100}  # fmt: skip
    assert MEASURED == recorded
    assert {r["configuration"]["processes"] for r in H100} == {1}  # hence: world size > 1 is modelled
    assert {r["configuration"]["optimizer"] for r in H100} <= set(MEASURED_OPTIMIZERS)
    assert {r["configuration"]["attention"] for r in H100} <= set(MEASURED_ATTENTION) | {"sdpa"}


def test_every_recorded_run_is_labelled_measured_and_a_change_of_kind_is_not(monkeypatch):
    from llmtune.plan.memory.fit import labelled

    for run in H100:
        if run["allocator"].startswith("expandable"):
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
        _, row, _ = measured_row(run)
        r = measured_recipe(run)
        assert labelled(row, r, 1, "llama").basis == "measured on H100", run["configuration"]
        assert labelled(row, r, 2, "llama").basis == "modelled"
        assert labelled(row, r, 1, "qwen2").basis == "modelled"
        # the same run as the plan steps it on CUDA (adamw_torch fused): measured where the fused step changes no
        # figure, modelled where the recorded peak was the foreach step's scratch
        c = run["configuration"]
        fused = {e.strategy: e for e in estimate(r, SHAPES[c["shape"]], 1, 1, expandable=run["allocator"].startswith(
            "expandable"))}[run["estimate_row"]]  # fmt: skip
        said = labelled(fused, r, 1, "llama", foreach=row)
        if abs(fused.total - row.total) > 0.005 * row.total:
            assert said.basis == "modelled" and "adamw_torch_fused" in said.basis_reason and row.peak_at == "step"
        else:
            assert said.basis == "measured on H100", c
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # llmtune's default again: expandable segments
    single = estimate(recipe(**RUN), ONE_B, 1, 1)[0]
    for changes, reason in (({"optimizer": "adamw_torch_fused"}, "optimizer"), ({"fp16": True, "bf16": False}, "fp16"),
                            ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
                            ({"attn_implementation": "eager"}, "eager"),
                            ({"adapter": "lora", "load_in_8bit": True}, "8-bit")):  # fmt: skip
        row = labelled(single, recipe(**RUN, **changes), 1, "llama")
        assert row.basis == "modelled" and reason in row.basis_reason, changes


def llama_1b_recipe(tmp_path, extra: str = "") -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 49152,
              "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "r.yaml"
    path.write_text(f"base_model: {tmp_path}\ndatasets:\n  - path: org/d\n    type: alpaca\nbf16: true\n"
                    f"sequence_len: 1024\nmicro_batch_size: 8\nsample_packing: true\n{extra}")  # fmt: skip
    return path


def labels(run_cli, path, *flags) -> tuple[dict, dict]:
    """{strategy: basis} from the table (its first and last cells) and from --json."""
    table = run_cli("estimate", path, *flags).out
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    report = json.loads(run_cli("estimate", path, *flags, "--json").out)
    return {c[0]: c[-1] for c in cells}, {r["strategy"]: r["basis"] for r in report["rows"]}


def test_estimate_says_which_rows_a_gpu_run_measured(run_cli, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    table, as_json = labels(run_cli, llama_1b_recipe(tmp_path), "--gpus-per-machine", "1")
    measured = {"single / DDP", "ZeRO-2", "ZeRO-3", "ZeRO-3 + CPU offload", "FSDP full shard"}  # what the H100 ran
    assert table == as_json and set(table) >= measured | {"ZeRO-1", "ZeRO-2 + CPU offload", "ZeRO-3 + NVMe offload"}
    for strategy, basis in table.items():
        assert basis == ("measured on H100" if strategy in measured else "modelled"), strategy
    out = run_cli("estimate", llama_1b_recipe(tmp_path), "--gpus-per-machine", "1").out
    assert "modelled (ZeRO-3 + NVMe offload): full under ZeRO-3 + NVMe offload: never measured" in out


def test_estimate_labels_world_size_two_and_unmeasured_offload_modelled(run_cli, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    table, as_json = labels(run_cli, llama_1b_recipe(tmp_path), "--gpus-per-machine", "2")
    assert table == as_json and len(table) >= 10 and set(table.values()) == {"modelled"}
    report = json.loads(run_cli("estimate", llama_1b_recipe(tmp_path), "--gpus-per-machine", "2", "--json").out)
    assert all("world size 2" in row["basis_reason"] for row in report["rows"])
    # one GPU, LoRA: only the single-GPU row was measured with an adapter; its offload rows are modelled
    table, as_json = labels(run_cli, llama_1b_recipe(tmp_path, "adapter: lora\nlora_r: 8\nlora_target_linear: true\n"))
    assert table == as_json and table.pop("single / DDP") == "measured on H100"
    assert table["ZeRO-3 + CPU offload"] == table["ZeRO-2 + CPU offload"] == "modelled"
    assert set(table.values()) == {"modelled"}


@pytest.mark.parametrize(("config", "billions"), [
    # config.json as each family writes it; the parameter counts of the real models (meta-device init)
    ({"model_type": "opt", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "ffn_dim": 8192,
      "vocab_size": 50272, "word_embed_proj_dim": 2048}, 1.316),
    ({"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257, "n_inner": None}, 1.558),
    ({"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
      "multi_query": True, "vocab_size": 65024}, 6.922),
    ({"model_type": "gpt_neox", "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
      "intermediate_size": 24576, "vocab_size": 50432, "tie_word_embeddings": False}, 20.55),
])  # fmt: skip
def test_families_without_a_gated_mlp_or_with_other_key_names_are_counted_right(config, billions):
    from llmtune.plan.memory.facts import facts_from_config

    assert facts_from_config(config).total_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_an_axolotl_memory_key_llmtune_does_not_apply_is_said_under_the_estimate(run_cli, tmp_path):
    """quantize_moe_experts (4-bit fused experts in Axolotl) does nothing here: the experts load in 16 bits, and the
    estimate, which counts them so, says it beside its figures rather than only among validate's notes."""
    import json

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
              "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
              "vocab_size": 151936}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "r.yaml"
    path.write_text(f"base_model: {tmp_path}\ndatasets:\n  - path: org/d\n    type: alpaca\nbf16: true\nadapter: qlora\n"
                    "load_in_4bit: true\nquantize_moe_experts: true\nlora_target_modules: [q_proj, v_proj]\n")  # fmt: skip
    table = run_cli("estimate", path, "--gpus-per-machine", "1")
    assert table.code == 0 and "note: quantize_moe_experts: accepted, has no effect" in table.out
    assert "the routed experts, most of the model, stay in the compute dtype, 16 bits" in " ".join(table.out.split())
    as_json = json.loads(run_cli("estimate", path, "--json").out)
    assert [note.split(":")[0] for note in as_json["notes"]] == ["quantize_moe_experts"]
    without = path.read_text().replace("quantize_moe_experts: true\n", "")
    path.write_text(without)
    assert "quantize_moe_experts" not in run_cli("estimate", path, "--gpus-per-machine", "1").out


def test_a_local_base_model_without_a_config_is_named_as_such(run_cli, write_recipe, tmp_path):
    """An empty folder or a data file as base_model: the estimate said the model was "not local, not cached, Hub
    unreachable", though the path is local."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hi"}\n')
    for base, words in ((empty, "holds no model config (config.json)"), (rows, "holds no model config (config.json): it is a file")):
        result = run_cli("estimate", write_recipe({"base_model": str(base)}))
        assert result.code == 2 and "Traceback" not in result.err, result.err
        assert f"error: {base} {words}" in result.err and "Hub unreachable" not in result.err, result.err
