"""Which rows a run draws once its datasets are read, as Axolotl draws them: each dataset shuffled before merging
(shuffle_before_merging_datasets), a shard of the merged rows (dataset_shard_num/idx), test rows measured against
eval_sequence_len, and the last partial round of batches dropped (dataloader_drop_last) from training alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import load_tokenizer, make_tiny_model, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.recipe.mixing import merged_order
from llmtune.train.data.base import arrange
from llmtune.train.data.prepare import prepare_data
from llmtune.train.engine.arguments import steps_per_epoch


def recipe(**changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize(("count", "shards", "index"), [(50, 4, 0), (50, 4, 1), (50, 4, 3), (7, 3, 2), (10, 10, 9)])
@pytest.mark.parametrize("seed", [42, 3])
def test_a_shard_of_the_merged_rows_is_the_one_datasets_cuts(count, shards, index, seed):
    """Axolotl: the merged dataset's shuffle(seed), then shard(num_shards, index) (contiguous blocks); with
    curriculum_sampling (or shuffle_merged_datasets: false) the block of the data's own order."""
    from datasets import Dataset

    data = Dataset.from_dict({"i": list(range(count))})
    shard = {"dataset_shard_num": shards, "dataset_shard_idx": index, "seed": seed}
    assert merged_order(count, recipe(**shard)) == data.shuffle(seed=seed).shard(shards, index)["i"]
    assert merged_order(count, recipe(**shard, curriculum_sampling=True)) == data.shard(shards, index)["i"]
    assert merged_order(count, recipe(seed=seed)) == data.shuffle(seed=seed)["i"]  # no shard: the shuffle alone
    assert merged_order(count, recipe(seed=seed), shuffle=False) is None  # eval rows unsharded keep their order


def test_the_shard_is_cut_before_the_eval_split_and_test_rows_are_sharded_alike():
    r = recipe(dataset_shard_num=3, dataset_shard_idx=1, val_set_size=2)
    train, evaluation = arrange(list(range(30)), None, r)
    kept = merged_order(30, r)
    assert len(kept) == 10 and evaluation == kept[-2:] and train == kept[:-2]  # 8 + 2 of the shard's 10
    r = recipe(dataset_shard_num=3, dataset_shard_idx=2, test_datasets=[{"path": "org/test", "type": "alpaca"}])
    train, evaluation = arrange(list(range(30)), list(range(100, 109)), r)
    assert len(train) == 10 and evaluation == [100 + i for i in merged_order(9, r)] and len(evaluation) == 3
    with pytest.raises(UserError, match="dataset_shard_idx 3 of dataset_shard_num 4 holds no training rows"):
        arrange([1, 2, 3], None, recipe(dataset_shard_num=4, dataset_shard_idx=3))


def rows(prefix: str, count: int) -> list[dict]:
    return [{"instruction": prefix, "output": str(i)} for i in range(count)]


def texts(tok, data) -> list[str]:
    """Each row as its instruction and output ("alpha 3")."""
    shown = [tok.decode(row["input_ids"], skip_special_tokens=True) for row in data]
    return [" ".join(text.split("### Instruction:")[1].split("### Response:")).split() for text in shown]


def test_each_dataset_is_shuffled_before_merging_and_keeps_its_block_without_the_merged_shuffle(tmp_path, tok):
    from datasets import Dataset

    first = write_jsonl(tmp_path / "a.jsonl", rows("alpha", 12))
    second = write_jsonl(tmp_path / "b.jsonl", rows("beta", 9))
    specs = [{"path": str(first), "type": "alpaca"}, {"path": str(second), "type": "alpaca"}]
    common = {"datasets": specs, "dataset_prepared_path": str(tmp_path / "prepared"), "seed": 5,
              "shuffle_merged_datasets": False}  # fmt: skip
    got = texts(tok, prepare_data(recipe(**common, shuffle_before_merging_datasets=True), tok).train)
    expected = [["alpha", str(i)] for i in Dataset.from_dict({"i": list(range(12))}).shuffle(seed=5)["i"]]
    expected += [["beta", str(i)] for i in Dataset.from_dict({"i": list(range(9))}).shuffle(seed=5)["i"]]
    assert got == expected  # a curriculum by dataset: alpha's block, then beta's, each in its seed's order
    plain = texts(tok, prepare_data(recipe(**common), tok).train)
    assert plain == [[r["instruction"], r["output"]] for r in rows("alpha", 12) + rows("beta", 9)]
    lone = {**common, "datasets": specs[:1]}  # one dataset: nothing is merged, nothing shuffled (as Axolotl)
    assert texts(tok, prepare_data(recipe(**lone, shuffle_before_merging_datasets=True), tok).train) == plain[:12]
    # the merged shuffle then draws over the pre-shuffled rows; the same seed gives the same run twice
    mixed = recipe(**{**common, "shuffle_merged_datasets": True}, shuffle_before_merging_datasets=True)
    once, again = (texts(tok, prepare_data(mixed, tok).train) for _ in range(2))
    assert once == again and sorted(once) == sorted(plain) and once != plain


def test_test_rows_are_measured_against_eval_sequence_len(tmp_path, tok):
    long_row = {"instruction": " ".join(["word"] * 40), "output": "yes"}
    train = write_jsonl(tmp_path / "train.jsonl", rows("short", 6))
    test = write_jsonl(tmp_path / "test.jsonl", [long_row, *rows("short", 3)])
    common = {"datasets": [{"path": str(train), "type": "alpaca"}], "dataset_prepared_path": str(tmp_path / "prep"),
              "test_datasets": [{"path": str(test), "type": "alpaca"}], "sequence_len": 100}  # fmt: skip
    data = prepare_data(recipe(**common), tok)
    assert len(data.eval) == 3 and data.stats["dropped_too_long"] == 1  # at sequence_len the long row goes
    data = prepare_data(recipe(**common, eval_sequence_len=256), tok)
    assert len(data.eval) == 4 and max(len(r["input_ids"]) for r in data.eval) > 100
    packed = prepare_data(recipe(**common, eval_sequence_len=256, sample_packing=True), tok)
    assert max(len(r["input_ids"]) for r in packed.eval) <= 256 and max(len(r["input_ids"]) for r in packed.train) <= 100
    assert len(packed.eval) < 4  # the short rows share a packed row
    assert sum(len(r["input_ids"]) for r in packed.eval) == sum(len(r["input_ids"]) for r in data.eval)
    with pytest.raises(UserError, match="189 tokens, longer than eval_sequence_len 150") as raised:
        prepare_data(recipe(**common, eval_sequence_len=150, excess_length_strategy="raise"), tok)
    assert "raise eval_sequence_len" in raised.value.hint


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dataset_shard_num": 4}, "dataset_shard_num is set without dataset_shard_idx"),
        ({"dataset_shard_idx": 1}, "dataset_shard_idx is set without dataset_shard_num"),
        ({"dataset_shard_num": 4, "dataset_shard_idx": 4}, r"not one of dataset_shard_num 4's shards \(0 to 3\)"),
        ({"dataset_shard_num": 2, "dataset_shard_idx": 0, "streaming": True, "max_steps": 5}, "datasets\\[\\].shards"),
        ({"eval_sequence_len": 64, "sequence_len": 32, "context_parallel_size": 2, "fsdp_version": 2,
          "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}},
         "context parallelism splits every row"),
    ],
)  # fmt: skip
def test_impossible_mixing_keys_are_one_line(write_recipe, run_cli, changes, message):
    import re

    result = run_cli("validate", write_recipe(changes))
    assert result.code == 2 and re.search(message, result.err), result.err
    assert "Traceback" not in result.err


def test_the_last_partial_round_is_dropped_from_training_alone(tmp_path, tok):
    """10 rows in micro-batches of 4: 3 steps (the last batch half empty) or, with dataloader_drop_last, 2; the 5 eval
    rows in batches of 4 are all evaluated either way (the Trainer would drop eval's last batch too)."""
    from transformers import AutoModelForCausalLM

    from llmtune.train.data.collate import Collator
    from llmtune.train.engine.arguments import training_arguments
    from llmtune.train.engine.trainer import LlmtuneTrainer, Rows

    plan = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "single", "micro_batch_size": 4,
            "data_parallel_size": 1, "gradient_accumulation_steps": 1, "world_size": 1}  # fmt: skip
    assert steps_per_epoch(10, plan) == 3 and steps_per_epoch(10, plan, drop_last=True) == 2
    assert steps_per_epoch(17, {**plan, "data_parallel_size": 2, "gradient_accumulation_steps": 2}, True) == 1
    model_dir = make_tiny_model(tmp_path / "tiny")
    train = [{"input_ids": [1, 5 + i, 9, 2], "labels": [1, 5 + i, 9, 2]} for i in range(10)]
    evaluation = [{"input_ids": [1, 7, 2 + i], "labels": [1, 7, 2 + i]} for i in range(5)]
    steps = {}
    for drop in (False, True):
        r = recipe(output_dir=str(tmp_path / f"out-{drop}"), micro_batch_size=4, num_epochs=1,
                   dataloader_drop_last=drop, logging_steps=1, save_strategy="no")  # fmt: skip
        args = training_arguments(r, plan, len(train), True, eval_strategy="no")
        assert args.dataloader_drop_last is drop
        trainer = LlmtuneTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                                 train_dataset=Rows(train), eval_dataset=Rows(evaluation),
                                 data_collator=Collator(tok.pad_token_id))  # fmt: skip
        trainer.plan = plan
        steps[drop] = trainer.train().global_step
        assert trainer.evaluate()["eval_tokens"] == 5 * 2  # every eval row's 2 predicted tokens
        assert args.dataloader_drop_last is drop  # the eval loader left training's setting as it was
    assert steps == {False: 3, True: 2}


def test_the_plan_says_when_eval_s_forward_carries_more_tokens_than_training_s():
    from llmtune.plan import make_cluster
    from llmtune.plan import make_plan as plan_alone
    from llmtune.plan.checks import eval_notes
    from llmtune.plan.memory.facts import ModelFacts

    test = {"test_datasets": [{"path": "org/test", "type": "alpaca"}], "sequence_len": 1024, "micro_batch_size": 2}
    facts = ModelFacts.__new__(ModelFacts)
    object.__setattr__(facts, "vocab_size", 128_256)
    assert eval_notes(recipe(**test, eval_sequence_len=8192), facts) == [
        "eval: forward passes of up to 16384 tokens per rank (eval_batch_size x eval_sequence_len), more than "
        "training's 2048; the estimate counts training's micro-batches: its fp32 logits alone are 7.83 GiB (no "
        "gradients or saved activations)"]  # fmt: skip
    assert "eval_batch_size x sequence_len" in eval_notes(recipe(**test, eval_batch_size=8), None)[0]
    assert eval_notes(recipe(**test, eval_sequence_len=512), facts) == []  # fewer tokens than training's
    assert eval_notes(recipe(sequence_len=1024, eval_batch_size=8), facts) == []  # no eval data
    plan = plan_alone(recipe(**test, eval_sequence_len=8192), make_cluster(1, device="cpu"))
    assert any(n.startswith("eval: forward passes of up to 16384 tokens") for n in plan.notes)
    # where it measures nothing, as in Axolotl, it says so
    (split,) = eval_notes(recipe(val_set_size=4, eval_sequence_len=64), facts)
    assert split.startswith("eval_sequence_len has no effect here") and "val_set_size's eval rows" in split
    pairs = [{"path": "org/p", "type": "chat_template.default"}]
    preference = recipe(rl="dpo", datasets=pairs, test_datasets=pairs, eval_sequence_len=64)
    assert "preference and GRPO rows" in eval_notes(preference, facts)[0]


def test_eval_and_shard_rows_that_leave_nothing_to_run_are_one_line(tmp_path, tok):
    """Both ended in the Trainer's traceback (exit 1): an eval set emptied by its length or its shard, and
    dataloader_drop_last over fewer rows than one round."""
    from llmtune.train.engine.arguments import training_arguments

    with pytest.raises(UserError, match=r"test_datasets leave no eval rows in shard 9 of 10") as caught:
        arrange(list(range(30)), list(range(7)), recipe(dataset_shard_num=10, dataset_shard_idx=9,
                                                        test_datasets=[{"path": "t", "type": "alpaca"}]))  # fmt: skip
    assert caught.value.hint.startswith("lower dataset_shard_num")
    with pytest.raises(UserError, match=r"test_datasets leave no eval rows \(every row dropped\)") as caught:
        arrange(list(range(30)), [], recipe(eval_sequence_len=80, test_datasets=[{"path": "t", "type": "alpaca"}]))
    assert "check the rows against eval_sequence_len" in caught.value.hint
    plan = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "ddp", "micro_batch_size": 4,
            "data_parallel_size": 2, "gradient_accumulation_steps": 1}  # fmt: skip
    with pytest.raises(UserError, match=r"drops every training row: 7 don't fill one round of micro_batch_size 4 x 2"):
        training_arguments(recipe(output_dir=str(tmp_path), micro_batch_size=4, dataloader_drop_last=True), plan, 7,
                           False)  # fmt: skip
    assert training_arguments(recipe(output_dir=str(tmp_path), micro_batch_size=4), plan, 7, False).max_steps == -1
