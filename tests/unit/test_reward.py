"""Reward models: the pair and step rows token by token, the pair batch, the Bradley-Terry loss against its formula,
and the recipe rules (which data goes with which head, what can't go with them)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny import load_tokenizer

from llmtune.errors import UserError
from llmtune.recipe.data import DatasetSpec
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.data.collate import REAL_TOKENS
from llmtune.train.data.formats import IGNORE, FormatContext, RowError
from llmtune.train.data.reward import (
    CHOSEN,
    REJECTED,
    PairCollator,
    converter,
    fit_pair,
    pair_margins,
    pairwise_loss,
    reward_metrics,
)

CHATML = "chatml"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def template(tok):
    from llmtune.train.data.templates import resolve_chat_template

    return resolve_chat_template(CHATML, None, tok)


def run(tok, row, type_, **spec):
    spec = DatasetSpec(path="x", type=type_, **spec)
    return converter(spec)(row, FormatContext(tok, spec, False, 64, template(tok)))


def rendered(tok, messages):
    text = tok.apply_chat_template(messages, chat_template=template(tok), tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_pair_is_stored_as_chosen_then_rejected_each_marked_at_its_last_token(tok):
    row = {"system": "Be exact.", "input": "Repeat cat", "chosen": "cat", "rejected": "dog"}
    [(ids, labels)] = run(tok, row, "bradley_terry.chat_template")
    head = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Repeat cat"}]
    chosen = rendered(tok, [*head, {"role": "assistant", "content": "cat"}])
    rejected = rendered(tok, [*head, {"role": "assistant", "content": "dog"}])
    assert ids == chosen + rejected
    assert labels == [IGNORE] * (len(chosen) - 1) + [CHOSEN] + [IGNORE] * (len(rejected) - 1) + [REJECTED]


def test_pairs_given_as_whole_conversations_with_a_shared_prompt(tok):
    row = {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello"}],
           "rejected": [{"role": "assistant", "content": "Go away"}]}  # fmt: skip
    [(ids, labels)] = run(tok, row, "bradley_terry")  # the alias
    chosen = rendered(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    assert ids[: len(chosen)] == chosen and labels[len(chosen) - 1] == CHOSEN
    with pytest.raises(RowError, match="'rejected' must end with the assistant's reply"):
        run(tok, {**row, "rejected": [{"role": "user", "content": "x"}]}, "bradley_terry.chat_template")
    with pytest.raises(RowError, match="missing field 'input'"):
        run(tok, {"chosen": "a", "rejected": "b"}, "bradley_terry.chat_template")


def test_each_side_of_a_pair_must_fit_sequence_len_or_is_cut_keeping_its_mark():
    ids, labels = [1, 2, 3, 4, 5, 6], [IGNORE, CHOSEN, IGNORE, IGNORE, IGNORE, REJECTED]  # chosen 2, rejected 4
    assert fit_pair(ids, labels, 4, truncate=False) == (ids, labels)
    assert fit_pair(ids, labels, 3, truncate=False) is None
    assert fit_pair(ids, labels, 3, truncate=True) == ([1, 2, 3, 4, 5], [IGNORE, CHOSEN, IGNORE, IGNORE, REJECTED])


def test_step_rows_label_the_last_separator_token_of_each_step(tok):
    row = {"prompt": "2+2?", "completions": ["2 plus 2", "is 5"], "labels": [True, False]}
    [(ids, labels)] = run(tok, row, "stepwise_supervised", step_separator="\n\n")
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = [tok.bos_token_id] * (tok.bos_token_id is not None) + enc("2+2?")
    first, second = enc("2 plus 2") + enc("\n\n"), enc("is 5") + enc("\n\n")
    assert ids == head + first + second
    assert labels == [IGNORE] * (len(head) + len(first) - 1) + [1] + [IGNORE] * (len(second) - 1) + [0]
    [(_, last_only)] = run(tok, row, "stepwise_supervised", step_separator="\n\n", train_on_last_step_only=True)
    assert [x for x in last_only if x != IGNORE] == [0]
    [(cut, cut_labels)] = run(tok, row, "stepwise_supervised", step_separator="\n\n", max_completion_length=len(first))
    assert cut == head + first and [x for x in cut_labels if x != IGNORE] == [1]
    with pytest.raises(RowError, match=r"'labels' must lie in 0..1 .the head's num_labels."):
        run(tok, {**row, "labels": [2, 0]}, "stepwise_supervised")
    with pytest.raises(RowError, match="'completions' has 2 steps and 'labels' 1"):
        run(tok, {**row, "labels": [True]}, "stepwise_supervised")


def test_the_pair_batch_puts_every_chosen_first_and_pads_on_the_right():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, CHOSEN, IGNORE, IGNORE, REJECTED]},
            {"input_ids": [1, 2, 3], "labels": [CHOSEN, IGNORE, REJECTED]}]  # fmt: skip
    batch = PairCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 0], [1, 0, 0], [7, 8, 9], [2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [CHOSEN, CHOSEN, REJECTED, REJECTED]
    assert int(batch[REAL_TOKENS]) == 8


def test_the_pairwise_loss_is_bradley_terry_averaged_over_the_pairs_counted():
    import torch

    rewards = torch.tensor([[2.0], [0.5], [1.0], [1.5]])  # chosen 2.0, 0.5; rejected 1.0, 1.5
    labels = torch.tensor([CHOSEN, CHOSEN, REJECTED, REJECTED])
    out = SimpleNamespace(logits=rewards)
    each = [-math.log(1 / (1 + math.exp(-(2.0 - 1.0)))), -math.log(1 / (1 + math.exp(-(0.5 - 1.5))))]
    assert float(pairwise_loss(None)(out, labels)) == pytest.approx(sum(each) / 2, rel=1e-6)
    # accumulated over 4 micro-batches (16 labels = 8 pairs): this batch's share of the mean over all of them
    assert float(pairwise_loss(None)(out, labels, num_items_in_batch=torch.tensor(16))) == pytest.approx(sum(each) / 8)
    centred = pairwise_loss(0.01)(out, labels)
    assert float(centred) == pytest.approx((sum(each) + 0.01 * ((2.0 + 1.0) ** 2 + (0.5 + 1.5) ** 2)) / 2, rel=1e-6)


def test_eval_works_on_one_margin_per_pair_the_kth_chosen_with_the_kth_rejected():
    import numpy as np
    import torch

    margins = pair_margins(torch.tensor([[2.0], [0.5], [1.0], [1.5]]),
                           torch.tensor([CHOSEN, CHOSEN, REJECTED, REJECTED]))  # fmt: skip
    assert margins.tolist() == [1.0, -1.0]
    prediction = SimpleNamespace(predictions=margins.numpy(), label_ids=np.ones(2))
    assert reward_metrics(prediction) == {"accuracy": 0.5, "margin": pytest.approx(0.0)}
    steps = SimpleNamespace(predictions=np.array([[[0.1, 0.9], [0.8, 0.2], [0.0, 1.0]]]),
                            label_ids=np.array([[IGNORE, 0, 0]]))  # fmt: skip
    assert reward_metrics(steps) == {"accuracy": 0.5}


BASE = {"base_model": "org/m", "output_dir": "/runs/x"}
PAIRS = [{"path": "o/d", "type": "bradley_terry.chat_template"}]
STEPS = [{"path": "o/d", "type": "stepwise_supervised"}]


def load(**keys):
    return recipe_from_mapping({**BASE, **keys}, Path("r.yml"), check_files=False).recipe


def refusal(**keys) -> str:
    with pytest.raises(UserError) as caught:
        load(**keys)
    return caught.value.one_line()


def test_recipe_rules_match_the_head_with_its_data():
    assert load(reward_model=True, datasets=PAIRS).num_labels == 1
    assert load(process_reward_model=True, datasets=STEPS).num_labels == 2
    assert load(process_reward_model=True, datasets=STEPS, num_labels=3).num_labels == 3
    assert "datasets[0].type bradley_terry.chat_template needs reward_model: true" in refusal(datasets=PAIRS)
    assert "reward_model: true trains on bradley_terry.chat_template data, not datasets[0].type alpaca" in refusal(
        reward_model=True, datasets=[{"path": "o/d", "type": "alpaca"}])  # fmt: skip
    assert "num_labels must be 1, not 2" in refusal(reward_model=True, datasets=PAIRS, num_labels=2)
    assert "reward_model with sample_packing is not supported" in refusal(
        reward_model=True, datasets=PAIRS, sample_packing=True)  # fmt: skip
    assert "model_type AutoModelForSequenceClassification trains a classification head: set reward_model" in refusal(
        model_type="AutoModelForSequenceClassification", datasets=[{"path": "o/d", "type": "alpaca"}])  # fmt: skip
    assert "reward_model with context_parallel_size > 1 is not supported" in refusal(
        reward_model=True, datasets=PAIRS, context_parallel_size=2, fsdp_version=2)  # fmt: skip
    assert "center_rewards_coefficient belongs to reward_model" in refusal(
        process_reward_model=True, datasets=STEPS, center_rewards_coefficient=0.01)  # fmt: skip
    assert "replaces the language-model loss, which a reward model doesn't have" in _plan_refusal(
        reward_model=True, datasets=PAIRS, liger_fused_linear_cross_entropy=True)  # fmt: skip


def _plan_refusal(**keys) -> str:
    from llmtune.plan import make_cluster, make_plan

    with pytest.raises(UserError) as caught:
        make_plan(load(**keys), make_cluster(num_processes=1))
    return caught.value.one_line()
