"""Preference training in the memory estimate: the reference model's share and the chosen + rejected batches."""

from __future__ import annotations

import json

import pytest

from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.peak import estimate
from llmtune.plan.memory.states import trainable_parameters
from llmtune.recipe import Recipe

FACTS = ModelFacts("llama", 2048, 16, 32, 8, 8192, 128256, True)  # a 1.2B Llama shape, tied embeddings
PSI = FACTS.total_params()
BASE = {"base_model": "m", "bf16": True, "optimizer": "adamw_torch", "sequence_len": 1024}
PAIRS = [{"path": "x.jsonl", "type": "chatml.intel"}]
SFT_DATA = [{"path": "x.jsonl", "type": "alpaca"}]
EVERY_ROW = ("single / DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2 + CPU offload", "ZeRO-3 + CPU offload",
             "ZeRO-3 + NVMe offload", "FSDP full shard", "FSDP shard grad op", "FSDP hybrid shard")  # fmt: skip


def recipe(**changes) -> Recipe:
    data = {"kto": [{"path": "x.jsonl", "type": "chatml.ultra"}], None: SFT_DATA}.get(changes.get("rl"), PAIRS)
    return Recipe.model_validate({**BASE, "datasets": data, **changes})


def rows(r: Recipe, gpus: int = 1, expandable: bool = True) -> dict:
    return {row.name: row for row in estimate(r, FACTS, gpus, gpus, expandable=expandable)}


def test_full_dpo_holds_a_16_bit_reference_placed_like_the_parameters():
    one, four = rows(recipe(rl="dpo"), 1), rows(recipe(rl="dpo"), 4)
    assert one["single / DDP"].reference == 2 * PSI  # bf16: 2 bytes a parameter, whole
    for name in ("single / DDP", "ZeRO-1", "ZeRO-2", "ZeRO-2 + CPU offload"):  # DDP, and ZeRO stage 0 for the rest
        assert four[name].reference == 2 * PSI, name
    for name in ("ZeRO-3", "FSDP full shard", "FSDP hybrid shard"):
        assert four[name].reference == pytest.approx(2 * PSI / 4), name
    # FSDP without resharding after forward: the reference's gathered parameters stay beside its shard
    assert four["FSDP shard grad op"].reference == pytest.approx(2 * PSI * (1 + 1 / 4))
    assert four["single / DDP"].reference_where == "frozen bf16 copy, whole on each GPU"
    assert four["ZeRO-3"].reference_where == "frozen bf16 copy, sharded 1/4 per GPU"


def test_without_mixed_precision_the_reference_is_fp32():
    assert rows(recipe(rl="ipo", bf16=False), 1)["single / DDP"].reference == 4 * PSI


def test_offloaded_zero3_keeps_the_reference_shard_where_it_keeps_the_parameters():
    dpo, sft = rows(recipe(rl="dpo"), 4), rows(recipe(), 4)
    for name, device in (("ZeRO-3 + CPU offload", "cpu"), ("ZeRO-3 + NVMe offload", "nvme")):
        assert dpo[name].reference == 0  # nothing of it on the GPU
        # every GPU's quarter, counted per machine of 4 GPUs like the row's other offloaded states
        assert getattr(dpo[name], device) - getattr(sft[name], device) == pytest.approx(2 * PSI / 4 * 4), name


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"rl": "dpo", "adapter": "lora", "lora_r": 16, "lora_target_linear": True}, "adapter disabled"),
        ({"rl": "kto", "adapter": "qlora", "load_in_4bit": True, "lora_r": 8}, "adapter disabled"),
        ({"rl": "dpo", "precompute_ref_log_probs": True}, "precomputed"),
        ({"rl": "orpo"}, "ORPO is reference-free"),
        ({"rl": "simpo"}, "SimPO is reference-free"),
    ],
)
def test_no_reference_model_is_held(changes, why):
    for row in rows(recipe(**changes), 4).values():
        assert row.reference == 0, row.name
        assert row.reference_where.startswith("none:") and why in row.reference_where, row.name


def test_an_adapter_from_lora_model_dir_is_copied_as_the_reference():
    r = recipe(rl="dpo", adapter="lora", lora_r=16, lora_target_linear=True, lora_model_dir="/sft/adapter")
    assert rows(r, 1)["single / DDP"].reference == 4 * trainable_parameters(r, FACTS)  # TRL's fp32 'ref' adapter


@pytest.mark.parametrize("expandable", [True, False])
def test_the_total_grows_by_the_reference_and_the_doubled_batch(expandable):
    # DPO's loss runs through TRL's fused LM head: compared with SFT under the same fused loss (Liger's), the only
    # differences are the reference and a forward of 2 x micro_batch_size sequences (either allocator mode: the
    # reference is held through the step, so it adds nothing to the allocator's reserve)
    fused = {"liger_fused_linear_cross_entropy": True}
    dpo, sft = rows(recipe(rl="dpo", **fused), 4, expandable), rows(recipe(**fused), 4, expandable)
    sft_double = rows(recipe(micro_batch_size=2, **fused), 4, expandable)
    for name in EVERY_ROW:
        assert dpo[name].activations == pytest.approx(2 * sft[name].activations), name
        doubling = sft_double[name].total - sft[name].total
        assert doubling > 0 or sft_double[name].peak_at == "step", name  # activations count where the loss peaks
        assert dpo[name].total - sft[name].total == pytest.approx(dpo[name].reference + doubling, abs=1), name
    assert dpo["single / DDP"].reference == 2 * PSI  # so the reference really is in the total


@pytest.mark.parametrize("rl", ["dpo", "kto"])
def test_dpo_and_kto_score_tokens_through_trls_fused_head(rl):
    # TRL 1.16's DPO and KTO trainers never make the tokens x vocab logits, Liger or not
    pref = rows(recipe(rl=rl), 1)["single / DDP"]
    fused = rows(recipe(micro_batch_size=2, liger_fused_linear_cross_entropy=True), 1)["single / DDP"]
    assert pref.logits == fused.logits
    assert pref.logits < rows(recipe(micro_batch_size=2), 1)["single / DDP"].logits


def test_orpo_is_sft_at_twice_the_micro_batch_with_the_models_own_logits():
    # ORPO's trainer takes the model's full logits: a Liger fused loss in the recipe doesn't run there
    orpo = rows(recipe(rl="orpo", liger_fused_linear_cross_entropy=True), 2)
    sft_double = rows(recipe(micro_batch_size=2), 2)
    for name in EVERY_ROW:
        assert orpo[name].total == pytest.approx(sft_double[name].total, abs=1), name
        assert orpo[name].logits == sft_double[name].logits, name


def test_kto_counts_its_kl_batch_as_a_second_micro_batch():
    fused = {"liger_fused_linear_cross_entropy": True}  # KTO's loss runs through TRL's fused LM head
    kto, sft = rows(recipe(rl="kto", **fused), 1), rows(recipe(**fused), 1)
    assert kto["single / DDP"].activations == pytest.approx(2 * sft["single / DDP"].activations)
    assert kto["single / DDP"].reference == 2 * PSI


def test_preference_rows_leave_out_the_split_strategies_trl_cannot_run():
    sft = {row.name for row in estimate(recipe(), FACTS, 8, 8, stages=8)}
    dpo = {row.name for row in estimate(recipe(rl="dpo"), FACTS, 8, 8, stages=8)}
    assert {"pipeline", "tensor parallel", "context parallel"} <= sft
    assert dpo == set(EVERY_ROW)


def _recipe_file(tmp_path, extra: str):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
              "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(f"base_model: {tmp_path}\ndatasets:\n  - path: {tmp_path}/x.jsonl\n    type: chatml.intel\n"
                    f"bf16: true\nrl: dpo\n{extra}")  # fmt: skip
    return path


def test_estimate_table_and_json_name_the_reference(run_cli, tmp_path):
    path = _recipe_file(tmp_path, "")
    out = run_cli("estimate", path, "--gpus-per-machine", "4").out
    assert "│ ref │" in out.replace("┃", "│")  # the column header
    assert "reference model (ZeRO-3, FSDP full shard): frozen bf16 copy, sharded 1/4 per GPU" in out
    assert "reference model (single / DDP, ZeRO-1, ZeRO-2, ZeRO-2 + CPU offload): frozen bf16 copy, whole" in out
    assert "DPO runs chosen and rejected together, 2 x 1 sequences per forward" in out
    report = json.loads(run_cli("estimate", path, "--gpus-per-machine", "4", "--json").out)
    zero3 = next(row for row in report["rows"] if row["strategy"] == "ZeRO-3")
    assert zero3["reference"] == pytest.approx(2 * PSI / 4)
    assert zero3["reference_where"] == "frozen bf16 copy, sharded 1/4 per GPU"
    lora = _recipe_file(tmp_path, "adapter: lora\nlora_r: 8\nlora_target_linear: true\n")
    out = run_cli("estimate", lora, "--gpus-per-machine", "4").out
    assert "reference model (every row): none: the base model with the adapter disabled is the reference" in out


def test_sft_estimates_show_no_reference_column(run_cli, tmp_path):
    path = _recipe_file(tmp_path, "")
    path.write_text(path.read_text().replace("rl: dpo\n", "").replace("chatml.intel", "alpaca"))
    out = run_cli("estimate", path, "--gpus-per-machine", "4").out
    assert "│ params │" in out.replace("┃", "│") and "│ ref │" not in out.replace("┃", "│")
    assert "reference model" not in out


def test_plan_summary_names_the_reference_under_the_planned_strategy():
    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.render import summary_lines

    full = recipe(rl="dpo", deepspeed="zero3")
    lines = dict(summary_lines(make_plan(full, make_cluster(2, device="cuda")), full))
    assert lines["reference model"] == "frozen bf16 copy, sharded 1/2 per GPU"
    assert lines["preference"].startswith("DPO runs chosen and rejected together, 2 x 1 sequences")
    ddp = dict(summary_lines(make_plan(recipe(rl="dpo"), make_cluster(2, device="cuda")), recipe(rl="dpo")))
    assert ddp["reference model"] == "frozen bf16 copy, whole on each GPU"
    lora = recipe(rl="dpo", adapter="lora", lora_r=8)
    lines = dict(summary_lines(make_plan(lora, make_cluster(2, device="cuda")), lora))
    assert lines["reference model"] == "none: the base model with the adapter disabled is the reference"
    assert "reference model" not in dict(summary_lines(make_plan(recipe(), make_cluster(2, device="cuda")), recipe()))


def test_preference_rows_are_modelled_not_measured():
    # a full bf16 fine-tune under single / DDP on one GPU is a measured row for SFT, never for preference training
    from llmtune.plan.memory.fit import labelled

    assert labelled(rows(recipe(), 1)["single / DDP"], recipe(), 1, "llama").basis == "measured on H100"
    row = labelled(rows(recipe(rl="dpo"), 1)["single / DDP"], recipe(rl="dpo"), 1, "llama")
    assert row.basis == "modelled" and "preference training" in row.basis_reason
