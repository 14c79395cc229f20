"""Preference training (`rl:`) end to end on TRL's trainers, CPU processes over gloo:
- DPO with LoRA in Axolotl's chatml.intel form: its first loss is ln 2 (the policy is its reference: a fresh adapter
  adds nothing); 2 ranks under ZeRO-2 match one process step by step at the same global batch; the ranks trained on
  their own pairs; the reference is the base with the adapter off (no copy on any rank); TRL's reward metrics reach
  metrics.json; the adapter merges into a model whose logits are base + adapter's;
- a full fine-tune DPO at 2 ranks under ZeRO-3 matches one process, with its frozen reference partitioned: each rank
  holds half its parameters, none trainable;
- IPO, KTO, ORPO and SimPO each train, and their first losses are what their loss formulas give with the recipe's
  keys (IPO's (1/2 beta)^2; KTO's weights; ORPO's NLL - alpha * log odds ratio; SimPO's -log sigmoid(margin - gamma)
  + cpo_alpha * NLL, one pair per step), so a key that didn't reach TRL fails the test."""

from __future__ import annotations

import json
import math

import pytest
from harness import LORA, llmtune, losses, make_workspace, train_run
from tiny import write_jsonl

pytestmark = pytest.mark.integration

WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]
FULL = {"adapter": None}


def pairs(shift: int) -> list[dict]:
    return [{"system": "Repeat exactly.", "question": f"Repeat {w}", "chosen": f"{w} {w}",
             "rejected": WORDS[(i + shift) % len(WORDS)]} for i, w in enumerate(WORDS)]  # fmt: skip


def completions() -> list[dict]:
    """KTO rows (chatml.ultra's fields), desirable and undesirable alternating."""
    return [{"prompt": f"Repeat {w}", "completion": f"{w} {w}" if i % 2 == 0 else WORDS[(i + 3) % 8],
             "label": i % 2 == 0} for i, w in enumerate(WORDS * 4)]  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    root, _, model = make_workspace(tmp_path_factory, "preference", tiny_model)
    data = write_jsonl(root / "pairs.jsonl", pairs(1) * 2 + pairs(3) * 2)  # 32 pairs: 4 steps of 8
    write_jsonl(root / "eval.jsonl", pairs(2))  # 8: two full eval batches (TRL averages per batch)
    write_jsonl(root / "kto.jsonl", completions())
    return root, data, model


def dpo(workspace, **changes) -> dict:
    return {"rl": "dpo", "rl_beta": 0.1, "chat_template": "chatml", "max_steps": 4, "lr_scheduler": "constant",
            "datasets": [{"path": str(workspace[1]), "type": "chatml.intel"}], **changes}  # fmt: skip


def first_step(metrics: dict) -> dict:
    return next(e for e in metrics["log_history"] if "loss" in e)


def test_dpo_lora_on_two_ranks_with_zero2_matches_one_process_and_merges(workspace):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    evaluation = {"test_datasets": [{"path": str(workspace[0] / "eval.jsonl"), "type": "chatml.intel"}],
                  "eval_strategy": "no"}  # evaluated once, at the end  # fmt: skip
    single, single_dir = train_run(workspace, "dpo-single", 1, gradient_accumulation_steps=2, **LORA,
                                   **dpo(workspace, **evaluation))  # fmt: skip
    # the reference's log-probs precomputed on two ranks (TRL writes them once, on rank 0, for both to read): the
    # base model's, as the adapter-off reference of one process computes them at each step
    zero2, zero2_dir = train_run(workspace, "dpo-zero2", 2, deepspeed="zero2", **LORA,
                                 **dpo(workspace, precompute_ref_log_probs=True))  # fmt: skip
    assert single["steps"] == zero2["steps"] == 4 and zero2["world_size"] == 2
    assert losses(single)[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    assert losses(zero2) == pytest.approx(losses(single), abs=2e-5)
    assert single["rows_seen"] == zero2["rows_seen"] == 32  # pairs, not sequences
    ranks = zero2["ranks"]
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks trained on the same pairs"
    assert all(r["engine"] == "deepspeed" and r["zero_stage"] == 2 for r in ranks), ranks
    assert all(r["reference"] == "precomputed" and r["adapters"] == ["default"] for r in ranks), ranks
    assert (zero2_dir / "llmtune" / "reference-logps" / "train").is_dir()
    (one,) = single["ranks"]
    assert one["reference"] == "adapter_disabled" and one["adapters"] == ["default"]
    first, last = first_step(single), [e for e in single["log_history"] if "loss" in e][-1]
    assert first["rewards/margins"] == 0.0 and first["rewards/chosen"] == 0.0  # beta * (policy - reference) logps
    assert last["rewards/margins"] != 0.0 and isinstance(last["logps/chosen"], float)
    summary = single["preference"]
    assert summary["method"] == "dpo" and summary["beta"] == 0.1 and summary["reference"] == "adapter_disabled"
    assert summary["last"]["rewards/margins"] == last["rewards/margins"]
    assert not (single_dir / "ref").exists()  # no reference adapter saved beside the trained one

    result = llmtune("merge", single_dir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(single_dir / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workspace[2]), str(single_dir))
    probe = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        want, got = adapted(input_ids=probe).logits, merged(input_ids=probe).logits
        base = AutoModelForCausalLM.from_pretrained(workspace[2])(input_ids=probe).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-4)  # DPO moved the model

    # `llmtune eval` recomputes the rewards over the eval pairs itself (its own tokenization and log-probs, the
    # reference with the adapter off): TRL's eval at the end of training says the same
    result = llmtune("eval", single_dir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((single_dir / "eval.json").read_text())
    assert written["method"] == "dpo" and written["examples"] == 8
    for name in ("rewards/margins", "rewards/chosen", "rewards/rejected", "rewards/accuracies"):
        assert written[name] == pytest.approx(single[f"eval_{name}"], rel=1e-4, abs=1e-7), name
    assert written["rewards/margins"] != 0.0
    # trained on from an adapter (lora_model_dir: an SFT result, here this DPO one): that adapter, frozen, is the
    # reference in training, and `llmtune eval` takes the same one (it took the base model before)
    onward, onward_dir = train_run(workspace, "dpo-onward", 1, gradient_accumulation_steps=2, **LORA,
                                   **dpo(workspace, **evaluation, max_steps=2, lora_model_dir=str(single_dir)))  # fmt: skip
    assert losses(onward)[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == that reference at step 1
    assert onward["preference"]["reference"] == "adapter_copy" and onward["ranks"][0]["adapters"] == ["default", "ref"]
    result = llmtune("eval", onward_dir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((onward_dir / "eval.json").read_text())
    for name in ("rewards/margins", "rewards/chosen", "rewards/rejected"):
        assert written[name] == pytest.approx(onward[f"eval_{name}"], rel=1e-4, abs=1e-7), name


def test_full_dpo_under_zero3_shards_its_reference_and_matches_one_process(workspace):
    from safetensors.torch import load_file

    single, _ = train_run(workspace, "dpo-full", 1, gradient_accumulation_steps=2, **FULL, **dpo(workspace))
    zero3, zero3_dir = train_run(workspace, "dpo-full-zero3", 2, deepspeed="zero3", **FULL, **dpo(workspace))
    assert losses(single)[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses(zero3) == pytest.approx(losses(single), abs=2e-5)
    total = single["total_parameters"]
    for rank in zero3["ranks"]:
        assert rank["engine"] == "deepspeed" and rank["zero_stage"] == 3
        assert rank["reference"] == "DeepSpeedEngine" and rank["reference_zero_stage"] == 3
        assert rank["reference_local_parameters"] == pytest.approx(total / 2, abs=64) and rank["reference_trainable"] == 0
    (single_rank,) = single["ranks"]
    assert single_rank["reference_local_parameters"] == total  # one process holds the whole copy
    weights = load_file(str(zero3_dir / "model.safetensors"))  # one consolidated folder, full-size tensors
    assert sum(t.numel() for t in weights.values()) >= total - 64 * 2
    assert json.loads((zero3_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_ipo_kto_orpo_simpo_start_where_their_losses_say(workspace):
    root = workspace[0]
    ipo, _ = train_run(workspace, "ipo", 1, **LORA, **dpo(workspace, rl="ipo", max_steps=2, precompute_ref_log_probs=True))
    assert losses(ipo)[0] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-5)  # (h - 1/2tau)^2 at h = 0
    assert ipo["preference"]["reference"] == "precomputed"

    kto, _ = train_run(workspace, "kto", 1, shuffle_merged_datasets=False, kto_desirable_weight=2.0, **LORA,
                       **dpo(workspace, rl="kto", max_steps=2,
                             datasets=[{"path": str(root / "kto.jsonl"), "type": "chatml.ultra"}]))  # fmt: skip
    # 2 desirable (weight 2) and 2 undesirable (weight 1) per batch, each 1 - sigmoid(0) = 0.5 at the start
    assert losses(kto)[0] == pytest.approx((2 * 2 * 0.5 + 2 * 0.5) / 4, abs=1e-5)

    orpo, _ = train_run(workspace, "orpo", 1, **LORA, **dpo(workspace, rl="orpo", max_steps=2, rl_beta=None,
                                                             orpo_alpha=0.25))  # fmt: skip
    step = first_step(orpo)
    assert step["loss"] == pytest.approx(step["nll_loss"] - 0.25 * step["log_odds_ratio"], rel=1e-4)

    simpo, _ = train_run(workspace, "simpo", 1, micro_batch_size=1, **LORA,
                         **dpo(workspace, rl="simpo", max_steps=2, rl_beta=2.0, simpo_gamma=0.5, cpo_alpha=0.5))  # fmt: skip
    step = first_step(simpo)  # one pair: the margin is beta * (avg logp chosen - avg logp rejected)
    expected = -math.log(1 / (1 + math.exp(-(step["rewards/margins"] - 0.5)))) + 0.5 * step["nll_loss"]
    assert step["loss"] == pytest.approx(expected, rel=1e-4)
    for run in (ipo, kto, orpo, simpo):
        assert run["steps"] == 2 and all(math.isfinite(v) for v in losses(run))
