"""Reward models train end to end, and what they report is recomputed from the saved model:
- reward_model (Bradley-Terry pairs): 2 ranks with ZeRO-2 match one process step by step (the pairs a step averages
  over are the same global batch); the saved model, scored here independently, gives the run's eval loss and
  accuracy; it learned (loss down, eval accuracy up from the untrained head);
- process_reward_model with LoRA: trains, `llmtune merge` folds it into a token-classification model whose logits
  are the adapter's; `llmtune infer` refuses it in one line."""

from __future__ import annotations

import json
import math

import pytest
from harness import LORA, llmtune, losses, make_workspace, read_metrics, train_run
from tiny import write_jsonl

pytestmark = pytest.mark.integration

WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]


def pairs(words: list[str], shift: int) -> list[dict]:
    return [{"system": "Repeat exactly.", "input": f"Repeat {w}", "chosen": f"{w} {w}",
             "rejected": f"{words[(i + shift) % len(words)]}"} for i, w in enumerate(words)]  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    root, _, model = make_workspace(tmp_path_factory, "reward", tiny_model)
    data = write_jsonl(root / "pairs.jsonl", pairs(WORDS, 1) * 2 + pairs(WORDS, 3) * 2)  # 32 pairs
    write_jsonl(root / "eval.jsonl", pairs(WORDS, 2)[:7])  # 7: the last eval batch is partial on 1 and 2 ranks
    steps = [{"prompt": f"Add 2 and {i}", "completions": [f"2 plus {i}", f"is {i + 2 + i % 2}"],
              "labels": [True, i % 2 == 0]} for i in range(32)]  # fmt: skip
    write_jsonl(root / "steps.jsonl", steps)
    return root, data, model


def reward_recipe(workspace) -> dict:
    root = workspace[0]
    return {"reward_model": True, "model_type": "AutoModelForSequenceClassification", "num_labels": 1,
            "chat_template": "chatml", "datasets": [{"path": str(workspace[1]), "type": "bradley_terry.chat_template"}],
            "test_datasets": [{"path": str(root / "eval.jsonl"), "type": "bradley_terry.chat_template"}],
            "max_steps": 16, "lr_scheduler": "constant", "learning_rate": 1e-3, "center_rewards_coefficient": 0.01}  # fmt: skip


@pytest.fixture(scope="module")
def single(workspace):
    return train_run(workspace, "rm-single", 1, gradient_accumulation_steps=2, **reward_recipe(workspace))


def score(model_dir, rows: list[dict]) -> tuple[float, float]:
    """(Bradley-Terry loss with the centring term, accuracy) of the saved model on pairs, computed here."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()

    def reward(row, side):
        messages = [{"role": "system", "content": row["system"]}, {"role": "user", "content": row["input"]},
                    {"role": "assistant", "content": row[side]}]  # fmt: skip
        ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    total, right = 0.0, 0
    for row in rows:
        c, r = reward(row, "chosen"), reward(row, "rejected")
        total += -math.log(1 / (1 + math.exp(-(c - r)))) + 0.01 * (c + r) ** 2
        right += c > r
    return total / len(rows), right / len(rows)


def test_reward_model_on_two_ranks_matches_one_and_its_saved_model_gives_the_reported_eval(workspace, single):
    metrics, output_dir = single
    ddp, ddp_dir = train_run(workspace, "rm-zero2", 2, deepspeed="zero2", **reward_recipe(workspace))
    assert metrics["steps"] == ddp["steps"] == 16 and ddp["world_size"] == 2
    assert ddp["ranks"][0]["first_batch"] != ddp["ranks"][1]["first_batch"], "both ranks trained on the same pairs"
    assert all(r.get("engine") == "deepspeed" and r.get("zero_stage") == 2 for r in ddp["ranks"]), ddp["ranks"]
    assert losses(ddp) == pytest.approx(losses(metrics), abs=2e-5)
    assert losses(metrics)[0] == pytest.approx(math.log(2), abs=0.1)  # an untrained head scores both sides alike
    config = json.loads((output_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] is not None
    # the run's final eval, recomputed from the saved model on the eval pairs
    loss, accuracy = score(output_dir, pairs(WORDS, 2)[:7])
    assert metrics["eval_loss"] == pytest.approx(loss, abs=1e-4)
    assert metrics["eval_accuracy"] == pytest.approx(accuracy)
    assert metrics["eval_accuracy"] == 1.0 and losses(metrics)[-1] < 0.25, losses(metrics)  # it learned to rank
    assert ddp["eval_accuracy"] == metrics["eval_accuracy"]


def test_process_reward_model_lora_merges_into_a_token_classifier_and_is_refused_by_infer(workspace, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    root = workspace[0]
    metrics, output_dir = train_run(
        workspace, "prm-lora", 1, process_reward_model=True, model_type="AutoModelForTokenClassification",
        datasets=[{"path": str(root / "steps.jsonl"), "type": "stepwise_supervised", "step_separator": "\n"}],
        val_set_size=0.25, num_epochs=2, **LORA,
    )  # fmt: skip
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["steps"] == 12  # 24 train rows / 4 x 2 epochs
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["task_type"] == "TOKEN_CLS" and set(adapter["modules_to_save"]) >= {"score"}
    merged = tmp_path / "merged"
    result = llmtune("merge", output_dir, "--output", merged)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 2
    folded = AutoModelForTokenClassification.from_pretrained(str(merged)).eval()
    base = AutoModelForTokenClassification.from_pretrained(str(workspace[2]), num_labels=2)
    adapted = PeftModel.from_pretrained(base, str(output_dir)).eval()
    ids = torch.tensor([[1, 17, 40, 9, 33, 21, 8]])
    with torch.no_grad():
        assert torch.allclose(folded(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
    refused = llmtune("infer", output_dir, "--prompt", "hi")
    assert refused.returncode == 2 and "is a reward model" in refused.stderr and "Traceback" not in refused.stderr
    assert read_metrics(root / "prm-lora.yaml")["train_loss"] > 0
