"""Preference recipes (`rl:`): Axolotl's keys as TRL's config fields, what goes with what (one line naming the key),
and the rows read, length-checked and split before any process starts."""

from __future__ import annotations

import pytest
from recipe_loading import load, refusal

from llmtune.errors import UserError
from llmtune.recipe.preference import loss_types
from llmtune.train.rl.trainers import config_arguments, needs_reference_copy

PAIRS = [{"path": "org/pairs", "type": "chatml.intel"}]
KTO = [{"path": "org/kto", "type": "llama3.ultra"}]


def dpo(**changes):
    return load(**{"rl": "dpo", "datasets": PAIRS, **changes}).recipe


def test_each_method_maps_its_keys_onto_trls_config():
    args = config_arguments(dpo(rl_beta=0.2, dpo_label_smoothing=0.1, dpo_use_weighting=True, sequence_len=512))
    assert args["beta"] == 0.2 and args["loss_type"] == ["sigmoid"] and args["label_smoothing"] == 0.1
    assert args["use_weighting"] is True and args["max_length"] == 512 and args["precompute_ref_log_probs"] is False
    assert config_arguments(dpo(rl="ipo", rl_beta=0.3))["loss_type"] == ["ipo"]
    assert load(dpo_beta=0.05, rl="dpo", datasets=PAIRS).recipe.rl_beta == 0.05  # Axolotl's older spelling
    kto = config_arguments(load(rl="kto", datasets=KTO, kto_desirable_weight=0.5, kto_undesirable_weight=2).recipe)
    assert (kto["desirable_weight"], kto["undesirable_weight"]) == (0.5, 2)
    assert kto["train_sampling_strategy"] == "sequential"  # TRL's KTO pairs neighbours for its KL term
    orpo = config_arguments(dpo(rl="orpo", orpo_alpha=0.25))
    assert orpo["beta"] == 0.25 and "precompute_ref_log_probs" not in orpo  # ORPO has no reference
    simpo = config_arguments(dpo(rl="simpo", simpo_gamma=0.7, cpo_alpha=0.0, rl_beta=2.5))
    assert (simpo["loss_type"], simpo["simpo_gamma"], simpo["cpo_alpha"], simpo["beta"]) == ("simpo", 0.7, 0.0, 2.5)
    trl = config_arguments(dpo(rl_beta=0.2, trl={"beta": 0.4, "sync_ref_model": True, "ref_model_sync_steps": 8}))
    assert trl["beta"] == 0.4 and trl["sync_ref_model"] is True and trl["ref_model_sync_steps"] == 8  # trl: wins


def test_axolotls_loss_shorthands_become_trls_loss_list():
    assert loss_types(dpo(dpo_norm_loss=True)) == (["sigmoid_norm"], None)
    assert loss_types(dpo(rpo_alpha=0.5)) == (["sigmoid", "sft"], [1.0, 0.5])  # RPO: DPO + the chosen NLL
    assert loss_types(dpo(dpo_loss_type=["sigmoid", "bco_pair"], dpo_loss_weights=[0.8, 0.2], rpo_alpha=1.0)) == (
        ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])  # fmt: skip
    assert dpo(dpo_loss_type="hinge").dpo_loss_type == ["hinge"]  # one name or a list


@pytest.mark.parametrize("changes, words", [
    ({"rl": "ebft"}, "rl: ebft (EBFT) is not supported yet"),
    ({"rl": "dpo", "trl": {"num_generations": 4}}, "trl.num_generations is a GRPO setting"),
    ({"rl": "grpo"}, "rl: grpo needs trl.reward_funcs"),
    ({"rl": "dop"}, "did you mean 'dpo'"),
    ({"rl": "kto", "datasets": [{"path": "x", "type": "chat_template.default"}]},
     "datasets[0].type chat_template.default is not a preference type for rl: kto"),
    ({"datasets": [{"path": "x", "type": "alpaca"}]}, "datasets[0].type alpaca is not a preference type for rl: dpo"),
    ({"orpo_alpha": 0.1}, "orpo_alpha belongs to rl: orpo, not rl: dpo"),
    ({"simpo_gamma": 0.5}, "simpo_gamma belongs to rl: simpo"),
    ({"kto_desirable_weight": 1.0}, "kto_desirable_weight belongs to rl: kto"),
    ({"rl": "orpo", "precompute_ref_log_probs": True}, "precompute_ref_log_probs belongs to rl: dpo or ipo or kto"),
    ({"rl": "ipo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing belongs to rl: dpo, not rl: ipo"),
    ({"dpo_loss_type": ["sigmoid", "hinge"], "dpo_loss_weights": [1.0]}, "dpo_loss_weights has 1 weights for 2"),
    ({"dpo_loss_type": ["sigmod"]}, "did you mean 'sigmoid'"),
    ({"dpo_norm_loss": True, "dpo_loss_type": "hinge"}, "dpo_norm_loss is dpo_loss_type: sigmoid_norm"),
    ({"rpo_alpha": 1.0, "dpo_loss_type": ["sigmoid", "sft"]}, "rpo_alpha adds TRL's 'sft' loss"),
    ({"dpo_padding_free": True}, "dpo_padding_free: TRL 1.16's DPO has padding-free batches switched off"),
    ({"dpo_label_smoothing": 0.6}, "dpo_label_smoothing"),
    ({"sample_packing": True}, "rl: dpo with sample_packing is not supported: TRL's preference trainers pad"),
    ({"tensor_parallel_size": 2}, "rl: dpo with tensor_parallel_size > 1 is not supported"),
    ({"pipeline_parallel_size": 2}, "rl: dpo with pipeline_parallel_size > 1 is not supported"),
    ({"context_parallel_size": 2, "fsdp_version": 2}, "rl: dpo with context_parallel_size > 1 is not supported"),
    ({"reward_model": True}, "reward_model"),
    ({"trl": {"num_generations": 8}}, "trl.num_generations is a GRPO setting"),
    ({"trl": {"betta": 0.1}}, "unknown key 'trl.betta'; did you mean 'beta'"),
    ({"rl": "orpo", "trl": {"sync_ref_model": True}}, "trl.sync_ref_model syncs a reference model, which rl: orpo"),
    ({"rl": "orpo", "orpo_alpha": 0.1, "rl_beta": 0.1}, "orpo_alpha and rl_beta both set ORPO's weight"),
    ({"trl": {"sync_ref_model": True}, "adapter": "lora"}, "trl.sync_ref_model with adapter: lora: TRL syncs"),
])  # fmt: skip
def test_what_trl_cant_honour_is_one_line_naming_the_key(changes, words):
    line = refusal(**{"rl": "dpo", "datasets": PAIRS, **changes})
    assert words in line and "Traceback" not in line and "\n" not in line


def test_preference_keys_and_data_without_rl_say_to_set_it():
    assert "rl_beta belongs to preference training or online RL; set rl:" in refusal(rl_beta=0.1)
    assert "datasets[0].type chatml.intel is preference data: set rl: dpo" in refusal(datasets=PAIRS)
    mapping = [{"path": "x", "type": {"field_prompt": "q", "field_chosen": "good", "field_rejected": "bad"}}]
    assert "is a preference mapping" in refusal(datasets=mapping)
    assert load(rl=False).recipe.rl is None  # older recipes write rl: false


def test_a_user_defined_mapping_and_axolotls_dataset_forms_load():
    mapping = {"field_prompt": "q", "field_chosen": "good", "field_rejected": "bad", "prompt_format": "Q: {prompt}"}
    recipe = dpo(datasets=[{"path": "x", "type": mapping}])
    assert recipe.datasets[0].type.field_chosen == "good"
    recipe = dpo(datasets=[{"path": "x", "type": "chat_template.default", "field_messages": "conversation",
                            "field_chosen": "chosen", "field_rejected": "rejected"}])  # fmt: skip
    assert recipe.datasets[0].field_messages == "conversation" and recipe.datasets[0].field_chosen == "chosen"
    assert "user_defined preference key" in refusal(rl="dpo", datasets=[{"path": "x", "type": {"field_system": "s",
                                                                                               "format": "{x}"}}])  # fmt: skip


def test_a_full_fine_tune_keeps_a_reference_copy_unless_the_method_or_adapter_needs_none():
    assert needs_reference_copy(dpo())
    assert not needs_reference_copy(dpo(adapter="lora"))  # the adapter switched off is the reference
    assert not needs_reference_copy(dpo(precompute_ref_log_probs=True))
    assert not needs_reference_copy(dpo(rl="orpo"))


@pytest.fixture
def tokenizer():
    from tiny import load_tokenizer

    return load_tokenizer()


def write_rows(tmp_path, rows: list[dict]):
    from tiny import write_jsonl

    return str(write_jsonl(tmp_path / "rows.jsonl", rows))


def test_rows_are_checked_against_sequence_len_and_max_prompt_len_before_training(tmp_path, tokenizer):
    from llmtune.train.data.prepare import prepare_data

    rows = [{"question": "Repeat " + " ".join(["word"] * n), "chosen": "ok", "rejected": "no"} for n in (1, 2, 40)]
    path = write_rows(tmp_path, rows * 2)
    base = {"datasets": [{"path": path, "type": "chatml.intel"}], "chat_template": "chatml", "dataset_prepared_path": ""}
    prompt_tokens = [len(tokenizer(p["prompt"])["input_ids"]) for p in prepare_data(dpo(**base), tokenizer).train]
    data = prepare_data(dpo(**base, sequence_len=30), tokenizer)
    assert data.stats["dropped_too_long"] == 2 and len(data.train) == 4
    data = prepare_data(dpo(**base, sequence_len=30, excess_length_strategy="truncate"), tokenizer)
    assert data.stats["dropped_too_long"] == 2  # a prompt alone past sequence_len can't be truncated into a pair
    limit = sorted(set(prompt_tokens))[0]
    data = prepare_data(dpo(**base, max_prompt_len=limit), tokenizer)
    assert data.stats["dropped_long_prompt"] == 4 and len(data.train) == 2
    data = prepare_data(dpo(**base, val_set_size=2), tokenizer)
    assert (len(data.train), len(data.eval)) == (4, 2) and set(data.train[0]) == {"prompt", "chosen", "rejected"}


def test_grpo_prompts_past_the_budget_are_dropped_and_counted_or_stop_it_when_asked(tmp_path, tokenizer):
    from llmtune.train.data.online_rows import prepare_online_data

    path = write_rows(tmp_path, [{"prompt": "Say " + " ".join(["word"] * n)} for n in (1, 2, 40)])
    raw = {"rl": "grpo", "datasets": [{"path": path}], "sequence_len": 24,
           "trl": {"reward_funcs": ["rwd.r"], "num_generations": 2, "max_completion_length": 8}}  # fmt: skip
    data = prepare_online_data(load(**raw).recipe, tokenizer, {})
    assert data.stats["dropped_too_long"] == 1 and sorted(row["prompt"].count("word") for row in data.train) == [1, 2]
    with pytest.raises(UserError) as caught:
        prepare_online_data(load(**raw, excess_length_strategy="raise").recipe, tokenizer, {})
    line = caught.value.one_line()
    assert "rows.jsonl line 3: the prompt is" in line and "over the 16 that sequence_len 24 leaves" in line, line


def test_a_malformed_row_is_one_line_naming_the_row_and_field(tmp_path, tokenizer):
    from llmtune.train.data.prepare import prepare_data

    path = write_rows(tmp_path, [{"question": "q", "chosen": "a", "rejected": "b"}, {"question": "q", "chosen": "a"}])
    with pytest.raises(UserError) as caught:
        prepare_data(dpo(datasets=[{"path": path, "type": "chatml.intel"}], chat_template="chatml"), tokenizer)
    assert "rows.jsonl line 2" in caught.value.one_line() and "'rejected'" in caught.value.one_line()


def test_kto_needs_both_labels(tmp_path, tokenizer):
    from llmtune.train.data.prepare import prepare_data

    path = write_rows(tmp_path, [{"prompt": "q", "completion": "a", "label": True}] * 3)
    recipe = load(rl="kto", datasets=[{"path": path, "type": "chatml.ultra"}], chat_template="chatml").recipe
    with pytest.raises(UserError, match="every training row is desirable"):
        prepare_data(recipe, tokenizer)

