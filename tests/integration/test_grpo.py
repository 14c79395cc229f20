"""Online RL (`rl: grpo | gdpo`, issue 39) on TRL's GRPOTrainer, CPU processes over gloo, generation in-process:

- a LoRA GRPO run whose reward favours short answers: the mean reward rises over the steps (it can't with a zero
  gradient); TRL's metrics reach metrics.json as numbers, sample completions reach completions.jsonl;
- 2 ranks under ZeRO-2: the ranks see distinct prompts, and two runs with the same seed generate the same
  completions;
- a reward function that raises stops the run with one line naming it and the prompt, exit 2.

The model is a tiny Llama initialised with a wide spread (its next-token distribution is peaked, as a trained
model's is; the fixture's near-uniform one gives LoRA almost nothing to steer in a few dozen steps)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from harness import LORA, llmtune, read_metrics, write_run_recipe
from tiny import write_jsonl

pytestmark = pytest.mark.integration

REWARDS = """
def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def short_reward(completions, **kwargs):
    return [-len(_text(c)) / 10 for c in completions]


def mentions_answer(completions, answer, **kwargs):
    return [1.0 if a in _text(c) else 0.0 for c, a in zip(completions, answer)]


def broken_reward(completions, **kwargs):
    if any("x" in _text(c) for c in completions) or True:
        raise KeyError("answer")


def say_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": "Say " + example["word"]}], "answer": example["word"]}

    return transform_fn, {"remove_columns": ["word"]}
"""


def last_reward(steps: list[dict]) -> float:
    return steps[-1]["reward"]


WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    import torch
    from tiny import load_tokenizer, tiny_llama_config
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    config = tiny_llama_config(512, hidden=64, intermediate=128)
    config.initializer_range = 0.3  # a peaked next-token distribution, as a trained model's
    LlamaForCausalLM(config).save_pretrained(str(root / "model"))
    load_tokenizer().save_pretrained(str(root / "model"))
    (root / "rwd.py").write_text(REWARDS)
    data = write_jsonl(root / "words.jsonl", [{"word": w} for w in WORDS * 8])
    return root, data, root / "model"


def grpo(workspace, name: str, rewards=("rwd.short_reward",), **changes) -> Path:
    keys = {"rl": "grpo", "chat_template": "chatml", "sequence_len": 128, "micro_batch_size": 8, "max_steps": 30,
            "learning_rate": 0.05, "lr_scheduler": "constant", "logging_steps": 1, **LORA,
            "trl": {"num_generations": 8, "max_completion_length": 12, "temperature": 1.0,
                    "reward_funcs": list(rewards), "num_completions_to_print": 2},
            "datasets": [{"path": str(workspace[1]), "type": "rwd.say_transform"}]}  # fmt: skip
    return write_run_recipe(workspace, name, **{**keys, **changes})


def test_a_lora_grpo_run_learns_what_its_reward_favours_and_records_it(workspace):
    path = grpo(workspace, "short")
    result = llmtune("train", path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(path)
    steps = [e for e in metrics["log_history"] if "reward" in e]
    assert len(steps) == 30 and metrics["steps"] == 30
    first, last = statistics.mean(e["reward"] for e in steps[:5]), statistics.mean(e["reward"] for e in steps[-5:])
    assert last > first + 1.0, [round(e["reward"], 2) for e in steps]  # shorter answers: a reward that rose
    entry = steps[0]
    for key in (
        "reward_std",
        "rewards/short_reward/mean",
        "rewards/short_reward/std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "clip_ratio/region_mean",
    ):
        assert isinstance(entry[key], float), key
    summary = metrics["preference"]
    assert summary["method"] == "grpo" and summary["last"]["reward"] == steps[-1]["reward"]
    # tokens seen: the 8 completions of each step (TRL's mean length) and their prompts, read from the masks
    completions = sum(8 * e["completions/mean_length"] for e in steps)
    prompts = metrics["tokens_seen"] - completions
    assert 30 * 8 * 5 < prompts < 30 * 8 * 128, (metrics["tokens_seen"], completions)
    samples = [json.loads(line) for line in (workspace[0] / "short" / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(1, 31)) and len(samples) == 60  # 2 per logging step
    assert samples[0]["prompt"].startswith("user: Say ") and isinstance(samples[0]["rewards"]["short_reward"], float)
    assert "reference model: none (beta 0" in result.stderr
    report = workspace[0] / "short" / "report"
    assert "## Online RL" in (report / "summary.md").read_text()  # and the reward's panel under the loss:
    assert json.loads((report / "curves.json").read_text())["preference"]["margin"]["train"]["value"][
        -1
    ] == last_reward(steps)
    # llmtune eval of a GRPO run: one greedy completion per prompt, scored by the recipe's functions (rwd.py beside
    # the recipe, found from the run's plan), the mean reward under TRL's names
    result = llmtune("eval", workspace[0] / "short", "--data", workspace[1], "--limit", "8", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((workspace[0] / "short" / f"eval-{Path(workspace[1]).stem}.json").read_text())  # (--data's)
    assert written["method"] == "grpo" and written["examples"] == 8 and written["max_new_tokens"] == 12
    assert written["reward"] == written["rewards/short_reward/mean"] > first  # the trained model's answers are short
    shown = written["samples"][0]
    assert shown["prompt"].startswith("Say ") and isinstance(shown["completion"], str)
    assert f"mean reward {written['reward']:.4f}" in result.stdout


def test_two_zero2_ranks_see_their_own_prompts_and_a_fixed_seed_generates_the_same(workspace):
    # every prompt distinct: with the module's 8 words repeated, two ranks' first prompts could be the same word by
    # chance (1 in 8), which the rank guard allows only where the data repeats rows
    distinct = write_jsonl(workspace[0] / "distinct.jsonl", [{"word": f"{w}{i}"} for i in range(8) for w in WORDS])
    runs = []
    for name in ("zero2-a", "zero2-b"):
        path = grpo(workspace, name, deepspeed="zero2", max_steps=3, micro_batch_size=4, gradient_accumulation_steps=2,
                    rewards=("rwd.short_reward", "rwd.mentions_answer"),
                    datasets=[{"path": str(distinct), "type": "rwd.say_transform"}])  # fmt: skip
        result = llmtune("train", path, "--num-processes", "2", timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append((read_metrics(path), (workspace[0] / name / "completions.jsonl").read_text()))
    (metrics, completions), (_, again) = runs
    ranks = metrics["ranks"]
    assert metrics["world_size"] == 2 and all(r["engine"] == "deepspeed" and r["zero_stage"] == 2 for r in ranks)
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks were given the same prompts"
    assert completions and completions == again  # the same seed, the same generations
    assert "rewards/mentions_answer/mean" in metrics["log_history"][0]


FSDP2 = {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}}
FULL_TRAINING = {"adapter": None, "lora_r": None, "lora_alpha": None, "lora_target_linear": None, "learning_rate": 1e-4}


@pytest.mark.parametrize(
    "strategy, keys, engine, reference",
    [
        ("ddp-full", FULL_TRAINING, "ddp", "LlamaForCausalLM"),
        ("zero3-full", {"deepspeed": "zero3", **FULL_TRAINING}, "deepspeed", "DeepSpeedEngine"),
        ("fsdp2-lora", FSDP2, "fsdp2", "adapter_disabled"),
    ],
)
def test_grpo_trains_on_every_strategy_with_its_reference_model(workspace, strategy, keys, engine, reference):
    """beta > 0 brings the reference model: a frozen copy the strategy places for a full fine-tune, the adapter
    switched off for LoRA. Two steps at 2 ranks: each rank really ran the strategy, on its own prompts, and saved."""
    path = grpo(workspace, strategy, max_steps=2, micro_batch_size=4, gradient_accumulation_steps=2,
                trl={"num_generations": 4, "max_completion_length": 8, "beta": 0.04,
                     "reward_funcs": ["rwd.short_reward"]}, **keys)  # fmt: skip
    result = llmtune("train", path, "--num-processes", "2", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(path)
    ranks = metrics["ranks"]
    assert metrics["world_size"] == 2 and metrics["steps"] == 2 and len(ranks) == 2
    assert all(r["engine"] == engine for r in ranks), ranks
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks were given the same prompts"
    assert all(r["reference"] == reference for r in ranks), ranks
    if reference == "adapter_disabled":  # the fresh adapter off is the base model: no copy of it, on any rank
        assert all(r["adapters"] == ["default"] for r in ranks), ranks
    else:  # a frozen copy: whole on each DDP rank, half of it on each ZeRO-3 rank
        total = metrics["total_parameters"]
        share = total / 2 if engine == "deepspeed" else total
        assert all(r["reference_local_parameters"] == pytest.approx(share, abs=64) for r in ranks), ranks
        assert all(r["reference_trainable"] == 0 for r in ranks), ranks
    steps = [e for e in metrics["log_history"] if "reward" in e]
    assert len(steps) == 2 and all(isinstance(e["kl"], float) for e in steps)
    # the reference is the starting policy: no divergence at the first step, some once the policy has moved
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[1]["kl"] > 1e-9, [e["kl"] for e in steps]
    saved = workspace[0] / strategy
    assert (saved / ("adapter_model.safetensors" if "lora" in strategy else "model.safetensors")).exists()


def test_a_reward_model_by_path_scores_beside_a_function(workspace):
    """A sequence-classification model's folder in trl.reward_funcs: TRL loads it and scores each completion with
    it; its reward is logged under its folder's name. A folder that isn't there is refused before launch."""
    import torch
    from tiny import load_tokenizer, tiny_llama_config
    from transformers import LlamaForSequenceClassification

    root = workspace[0]
    torch.manual_seed(1)
    config = tiny_llama_config(512, hidden=32, intermediate=64)
    config.num_labels, config.pad_token_id = 1, load_tokenizer().pad_token_id
    LlamaForSequenceClassification(config).save_pretrained(str(root / "judge"))
    load_tokenizer().save_pretrained(str(root / "judge"))
    path = grpo(workspace, "judged", rewards=("rwd.short_reward", str(root / "judge")), max_steps=2)
    result = llmtune("train", path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [e for e in read_metrics(path)["log_history"] if "reward" in e]
    assert len(steps) == 2 and all(isinstance(e["rewards/judge/mean"], float) for e in steps)
    assert all(e["rewards/judge/std"] > 0 for e in steps)  # the model scored each completion, not a constant
    sample = json.loads((root / "judged" / "completions.jsonl").read_text().splitlines()[0])
    assert set(sample["rewards"]) == {"short_reward", "judge"} and sample["rewards"]["judge"] is None
    missing = grpo(workspace, "unjudged", rewards=("rwd.short_reward", "./no-such-judge"))
    refused = llmtune("validate", missing, timeout=120)
    assert refused.returncode == 2 and "trl.reward_funcs[1]: ./no-such-judge does not exist" in refused.stderr


def test_a_reward_function_that_raises_is_one_line_naming_it(workspace):
    path = grpo(workspace, "broken", rewards=("rwd.short_reward", "rwd.broken_reward"), max_steps=2)
    result = llmtune("train", path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: reward function broken_reward raised KeyError: 'answer' (prompt index 0 of the batch"
    )
    assert "Traceback" not in result.stderr
    assert "KeyError" in (workspace[0] / "broken" / "llmtune" / "logs" / "reward-error.txt").read_text()
