"""Reward models train end to end, and what they report is recomputed from the saved model:
- reward_model (Bradley-Terry pairs): 2 ranks with ZeRO-2 match one process step by step (the pairs a step averages
  over are the same global batch); the saved model, scored here independently, gives the run's eval loss and
  accuracy; it learned (loss down, eval accuracy up from the untrained head);
- process_reward_model with LoRA: on steps whose label their own words decide, it learns (loss down from the
  untrained head's ln 2, eval accuracy well above the 50% that half true, half false steps give by chance);
  `llmtune merge` folds it into a token-classification model whose logits are the adapter's; `llmtune infer`
  refuses it in one line."""

from __future__ import annotations

import json
import math

import pytest
from harness import LORA, llmtune, losses, make_workspace, train_run
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
    write_jsonl(root / "steps.jsonl", [reasoning(i) for i in range(32)])
    return root, data, model


GOOD, BAD = WORDS[:4], WORDS[4:]


def reasoning(i: int) -> dict:
    """A stepwise_supervised row whose labels a tiny model can learn in a few steps from the steps' words alone: a
    step of a GOOD word is true, of a BAD word false. Half the rows are true, false, false, true and half the
    opposite, so a step's place says nothing; two true and two false steps per row make chance (or always saying one
    label) exactly 50% on any eval split."""
    good, bad = [GOOD[i % 4], GOOD[(i + 1) % 4]], [BAD[i // 4 % 4], BAD[(i // 4 + 1) % 4]]
    steps = [(good[0], True), (bad[0], False), (bad[1], False), (good[1], True)]
    if i % 2:
        steps = [(bad[0], False), (good[0], True), (good[1], True), (bad[1], False)]
    return {"prompt": f"Check {i}", "completions": [" ".join([word] * 4) for word, _ in steps],
            "labels": [label for _, label in steps]}  # fmt: skip


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


def step_accuracy(model, rows: list[dict]) -> float:
    """Share of steps the model labels as the row does: its prediction at the last token of each step's separator
    (a newline), the row encoded here as [BOS] prompt step sep step sep ..."""
    import torch
    from tiny import load_tokenizer

    tok = load_tokenizer()  # the tiny model's own (the fixture tokenizer)
    right = total = 0
    for row in rows:
        ids = [tok.bos_token_id, *tok(row["prompt"], add_special_tokens=False)["input_ids"]]
        ends = []
        for step in row["completions"]:
            ids += tok(step, add_special_tokens=False)["input_ids"] + tok("\n", add_special_tokens=False)["input_ids"]
            ends.append(len(ids) - 1)
        with torch.no_grad():
            predicted = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        right += sum(int(predicted[end]) == int(label) for end, label in zip(ends, row["labels"], strict=True))
        total += len(ends)
    return right / total


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
    # it learned to rank: every eval pair ordered, the loss well under an untrained head's ln 2
    assert metrics["eval_accuracy"] == 1.0 and losses(metrics)[-1] < 0.6 * math.log(2), losses(metrics)
    assert ddp["eval_accuracy"] == metrics["eval_accuracy"]


def test_process_reward_model_lora_merges_into_a_token_classifier_and_is_refused_by_infer(workspace, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    root = workspace[0]
    metrics, output_dir = train_run(
        workspace, "prm-lora", 1, process_reward_model=True, model_type="AutoModelForTokenClassification",
        datasets=[{"path": str(root / "steps.jsonl"), "type": "stepwise_supervised", "step_separator": "\n"}],
        val_set_size=0.25, num_epochs=3, learning_rate=1e-2, **LORA,
    )  # fmt: skip
    assert metrics["steps"] == 18 and metrics["data"]["eval_examples"] == 8  # 24 train rows / 4 x 3 epochs
    history = losses(metrics)
    assert len(history) == 18 and history[0] == pytest.approx(math.log(2), abs=0.1)  # the untrained head: a coin
    assert sum(history[-3:]) / 3 < history[0] / 2, history  # it learned the steps' labels
    assert metrics["eval_accuracy"] >= 0.8, metrics["eval_accuracy"]  # chance is 0.5 (2 of 4 steps true per row)
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
    # the merged model labels the rows' steps as the data says (not only as the run's own encoding of them says)
    assert step_accuracy(folded, [reasoning(i) for i in range(32)]) >= 0.8
    refused = llmtune("infer", output_dir, "--prompt", "hi")
    assert refused.returncode == 2 and "is a reward model" in refused.stderr and "Traceback" not in refused.stderr
