"""The rehearsal's own choices about the recipe it runs: the tokenizer it takes, the copy of the recipe the ranks
run (its notes, the CPU stand-ins for GPU-only settings), the shrink's sizes, and what its report says."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtune.errors import UserError

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"


def test_a_local_folder_without_tokenizer_files_takes_the_stand_in(tmp_path):
    """A config.json-only folder as base_model (only the shapes kept) is no tokenizer: the stand-in is used, and
    without one the error names the folder and the flag, not the network."""
    from llmtune.rehearse.model import choose_tokenizer

    (tmp_path / "config.json").write_text("{}")
    recipe = SimpleNamespace(tokenizer_config=None, base_model=str(tmp_path))
    choice = choose_tokenizer(recipe, None, str(FIXTURE_TOKENIZER), online=False)
    assert (choice.location, choice.real) == (str(FIXTURE_TOKENIZER), False) and "STAND-IN" in choice.note
    with pytest.raises(UserError, match="without tokenizer files") as caught:
        choose_tokenizer(recipe, None, None, online=True)
    assert str(tmp_path) in caught.value.message and "--stand-in-tokenizer" in caught.value.hint
    # a folder with a tokenizer is the recipe's own, stand-in or not
    own = choose_tokenizer(SimpleNamespace(tokenizer_config=None, base_model=str(FIXTURE_TOKENIZER)), None,
                           str(tmp_path), online=False)  # fmt: skip
    assert (own.location, own.real) == (str(FIXTURE_TOKENIZER), True)


def _cpu_cluster(processes: int = 2):
    from llmtune.plan import make_cluster

    return make_cluster(processes, 1, 0, "127.0.0.1", 29500, "cpu", "accelerate")


def _rehearsal_of(recipe, tmp_path):
    from llmtune.recipe import Recipe
    from llmtune.rehearse.flow import rehearsal_mapping

    sources = [SimpleNamespace(label=f"datasets[{i}]", spec=spec.model_dump(mode="json", exclude_unset=True))
               for i, spec in enumerate(recipe.datasets)]  # fmt: skip
    mapping = rehearsal_mapping(recipe, tmp_path / "shrunk", str(FIXTURE_TOKENIZER), sources, tmp_path, 128)
    return Recipe.model_validate(mapping)


def test_the_rehearsals_recipe_sets_only_what_the_recipe_set(tmp_path):
    """The rehearsal's copy is rebuilt from the keys the recipe set: a full dump would set every default, and an
    FSDP2 rehearsal would say the recipe's (absent) FSDP1 keys are not used."""
    from llmtune.plan import make_plan
    from llmtune.recipe import Recipe

    recipe = Recipe.model_validate({"base_model": "Qwen/Qwen2.5-0.5B", "sequence_len": 512, "micro_batch_size": 1,
                                    "datasets": [{"path": "rows.jsonl", "type": "completion"}], "fsdp_version": 2,
                                    "fsdp_config": {"fsdp_offload_params": False}, "output_dir": "out"})  # fmt: skip
    rehearsal = _rehearsal_of(recipe, tmp_path)
    assert rehearsal.fsdp_config.model_fields_set == recipe.fsdp_config.model_fields_set
    notes = make_plan(recipe, _cpu_cluster()).notes
    assert make_plan(rehearsal, _cpu_cluster()).notes == notes and not any("FSDP1" in note for note in notes)


@pytest.mark.parametrize("asked", [{"attn_implementation": "flex_attention"}, {"flex_attention": True}])
def test_flex_attention_runs_as_sdpa_in_the_cpu_rehearsal_and_says_so(tmp_path, asked):
    """FlexAttention has no backward on CPU: the rehearsal runs sdpa in its place, says so, and proves the rest."""
    from llmtune.recipe import Recipe
    from llmtune.rehearse.flow import cpu_swaps

    recipe = Recipe.model_validate({"base_model": "Qwen/Qwen2.5-0.5B", "sequence_len": 512, "sample_packing": True,
                                    "datasets": [{"path": "rows.jsonl", "type": "completion"}], "output_dir": "out",
                                    **asked})  # fmt: skip
    assert recipe.attn_implementation == "flex_attention"
    rehearsal = _rehearsal_of(recipe, tmp_path)
    assert (rehearsal.attn_implementation, rehearsal.flex_attention) == ("sdpa", False)
    [note] = cpu_swaps(recipe)[1]
    assert "flex_attention runs as sdpa" in note
    plain = Recipe.model_validate({**recipe.model_dump(exclude_unset=True), "attn_implementation": "sdpa",
                                   "flex_attention": False})  # fmt: skip
    assert cpu_swaps(plain) == ({}, []) and _rehearsal_of(plain, tmp_path).attn_implementation == "sdpa"


@pytest.mark.parametrize(("model", "hidden"), [("meta-llama/Llama-3.2-1B-Instruct", 256),
                                               ("meta-llama/Llama-3.1-8B-Instruct", 512),
                                               ("Qwen/Qwen2.5-7B-Instruct", 7 * 256)])  # fmt: skip
def test_the_shrink_keeps_whole_qat_groups_and_enough_layers_for_lisa(model, hidden):
    """qat.group_size and lisa_n_layers are the real model's business: the shrink widens and deepens the rehearsal's
    model to fit them (and says so) rather than refusing with advice that would change the real recipe."""
    from llmtune.plan.shrink import known_config
    from llmtune.rehearse.model import _input_widths, shrink_for

    recipe = SimpleNamespace(lisa_n_layers=4, qat=SimpleNamespace(block=256))
    shrunk, notes = shrink_for(recipe, known_config(model), 2, 64, None)
    assert shrunk.shrunk.hidden_size == hidden and all(width % 256 == 0 for width in _input_widths(shrunk))
    assert shrunk.shrunk.num_layers == 5 and len(notes) == 2
    assert "keeps 5 layers" in notes[0] and f"hidden size is {hidden}" in notes[1]
    plain, none = shrink_for(SimpleNamespace(lisa_n_layers=None, qat=None), known_config(model), 2, 64, None)
    assert (plain.shrunk.num_layers, none) == (2, []) and plain.shrunk.hidden_size < hidden


def test_tokens_per_step_are_unknown_where_trl_tokenizes_the_rows_never_zero():
    """Preference rows stay strings until TRL's trainer tokenizes them: the check has no token count for them, and
    the report says so instead of '~0 real tokens'."""
    from llmtune.rehearse.report import full_scale_data

    recipe = SimpleNamespace(dataloader_drop_last=False, max_steps=None, num_epochs=1, sample_packing=False,
                             pad_to_sequence_len=False, sequence_len=512)  # fmt: skip
    plan = SimpleNamespace(micro_batch_size=2, data_parallel_size=2, gradient_accumulation_steps=1, global_batch_size=4)
    source = SimpleNamespace(label="datasets[0]", path="rows.jsonl", rows_total=300, rows_sampled=300, stand_in=None)
    preference = {"rows": 300, "train_examples": 285, "eval_examples": 15, "train_rows": 285}
    data = SimpleNamespace(stats=preference, sources=[source], sampled=False)
    assert full_scale_data(recipe, plan, data)["real_tokens_per_step"] is None
    data.stats = {**preference, "train_tokens": 285 * 100}
    assert full_scale_data(recipe, plan, data)["real_tokens_per_step"] == 400


def _report(**changes) -> dict:
    """A rehearsal report as build_report writes it, with the parts report_lines reads."""
    report = {
        "parallel": {"world_size": 2, "num_machines": 1, "processes_per_machine": 2, "data_parallel_size": 2,
                     "pipeline_stages": 1, "global_batch": "4 = micro 2 x accumulation 1 x data-parallel 2"},
        "data": {"steps_per_epoch": 10, "total_steps": 10, "stand_in": False, "steps_per_1000_source_rows": 250.0,
                 "token_slots_per_step": None, "real_tokens_per_step": None, "sampled": False, "sequence_len": 512,
                 "checked_at_real_sequence_len": {"rows": 40, "train_examples": 40, "eval_examples": 0,
                                                  "dropped_too_long": 0, "dropped_no_labels": 0}},
        "ranks": {"checked": False},
        "memory": {"estimate_row": "ZeRO-1", "full_model_states_per_rank_bytes": 73.72e9,
                   "full_gpu_total_per_rank_bytes": 78.70e9, "full_cpu_offload_per_machine_bytes": 0,
                   "gpu_memory_bytes": 80e9, "fits": False, "fit_fraction": 0.95},
        "checkpoint": {"folder": "checkpoint-2", "rotated": "checkpoint-1", "rehearsal_bytes": 2e6,
                       "full_scale_bytes": 3e9, "layout": {"model.safetensors": {"files": 1, "kind": "weights"}}},
        "run": {"steps": 2, "stopped_after_step": 1, "losses": [10.832], "loss_steps": [1], "logging_steps": 10,
                "train_loss": 10.27, "train_loss_steps": [2, 2], "merged_bytes": 1e6},
        "gpu_run_differs": [], "not_checked": [], "timings_s": {"total_s": 3.0},
    }  # fmt: skip
    for part, values in changes.items():
        report[part] = {**report[part], **values}
    return report


def test_the_report_says_unknown_tokens_the_kept_checkpoint_the_logged_steps_and_the_fit_limit():
    from llmtune.rehearse.report import report_lines

    lines = dict(report_lines(_report()))
    assert lines["tokens/step"] == "real tokens unknown (TRL's trainer tokenizes these rows itself)"
    assert lines["checkpoint"].startswith("checkpoint-1 rotated away (save_total_limit); checkpoint-2 kept: ")
    assert "losses 10.832 at step 1 (logging_steps 10); train loss 10.270 over step 2 (the resumed run)" in lines["run"]
    assert lines["full scale"].endswith("does NOT fit 80.00 GB GPUs (llmtune train refuses above 95% of that, 76.00 GB)")
    lines = dict(report_lines(_report(data={"real_tokens_per_step": 1200}, memory={"fits": True},
                                      checkpoint={"rotated": None, "folder": None})))  # fmt: skip
    assert lines["tokens/step"] == "~1,200 real tokens" and lines["checkpoint"] == "none kept"
    assert lines["full scale"].endswith("fits 80.00 GB GPUs (under 95% of that, 76.00 GB, as llmtune train checks)")


def test_a_checkpoint_rotated_away_by_save_total_limit_is_reported_as_the_one_kept(tmp_path):
    from llmtune.plan.checkpoint_layout import MARKER
    from llmtune.plan.shrink import known_config, shrink_config
    from llmtune.rehearse.report import kept_checkpoint

    kept = tmp_path / "checkpoint-2"
    kept.mkdir()
    (kept / MARKER).write_text("{}")
    (kept / "model.safetensors").write_bytes(b"x" * 400)
    recipe = SimpleNamespace(adapter=None, unfrozen_parameters=None, precision="fp32", bf16=False, fp16=False, optimizer="adamw_torch")
    shrunk = shrink_config(known_config("meta-llama/Llama-3.2-1B-Instruct"), hidden=64)
    metrics = {"trainable_parameters": shrunk.shrunk.total_params(), "total_parameters": shrunk.shrunk.total_params()}
    found = kept_checkpoint(recipe, SimpleNamespace(strategy="ddp"), shrunk, tmp_path / "checkpoint-1", tmp_path,
                            metrics)  # fmt: skip
    assert (found["folder"], found["rotated"], found["rehearsal_bytes"]) == ("checkpoint-2", "checkpoint-1", 402)
    assert "rotated" not in kept_checkpoint(recipe, SimpleNamespace(strategy="ddp"), shrunk, kept, tmp_path, metrics)


def test_a_stand_in_tokenizer_lacking_the_recipe_s_tokens_trains_their_rows_instead_of_refusing():
    """Axolotl's llama-3 DPO example adds <|eot_id|>, which Llama 3's tokenizer has and the fixture's stand-in
    doesn't: the rehearsal stopped on 'rows would train frozen ... set lora_modules_to_save', advice the real run
    doesn't need."""
    TOKENIZER_DIR = FIXTURE_TOKENIZER  # noqa: N806
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.rehearse.flow import stand_in_tokens
    from llmtune.rehearse.model import TokenizerChoice

    def recipe(**keys):
        mapping = {"base_model": "m", "datasets": [{"path": "d", "type": "alpaca"}], **keys}
        return recipe_from_mapping({k: v for k, v in mapping.items() if v is not None}, Path("r.yaml"),
                                   check_files=False).recipe  # fmt: skip

    keys = {"adapter": "lora", "lora_target_linear": True, "special_tokens": {"eos_token": "<|eot_id|>"}}
    stand_in = TokenizerChoice(str(TOKENIZER_DIR), False, "")
    changes, notes = stand_in_tokens(recipe(**keys), stand_in, "llama")
    assert changes == {"lora_modules_to_save": ["embed_tokens", "lm_head"]}
    assert notes == ["the stand-in tokenizer lacks <|eot_id|>, which the recipe adds: the rehearsal trains "
                     "embed_tokens and lm_head whole for them (the real run checks its own tokenizer, which may hold "
                     "them)"]  # fmt: skip
    assert stand_in_tokens(recipe(**keys), TokenizerChoice(str(TOKENIZER_DIR), True, ""), "llama") == ({}, [])
    assert stand_in_tokens(recipe(**{**keys, "special_tokens": {"eos_token": "<|im_end|>"}}), stand_in,
                           "llama") == ({}, [])  # the stand-in has it  # fmt: skip
    assert stand_in_tokens(recipe(**{**keys, "adapter": None}), stand_in, "llama") == ({}, [])


def test_a_check_the_rehearsal_fails_is_an_error_line_and_exit_1_in_either_direction():
    from llmtune.rehearse.report import failed_checks

    ranks = {"checked": True, "ok": True, "ranks": 4, "distinct_first_batches": 4}
    memory = {"checked": True, "ok": True, "ratio": 1.02, "full_scaled_measurement_bytes": 20e9}
    assert failed_checks({"ranks": ranks, "memory": memory}) == []
    assert failed_checks({"ranks": {"checked": False}, "memory": {"checked": False}}) == []  # unchecked: not failed
    same = failed_checks({"ranks": {**ranks, "ok": False, "distinct_first_batches": 2}, "memory": memory})
    assert len(same) == 1 and "4 ranks saw 2 distinct first batches where 4 were expected" in same[0]
    assert "trained on the same rows" in same[0]
    grouped = {**ranks, "ok": False, "distinct_first_batches": 4, "ranks_per_batch": 2}  # context parallel pairs
    split = failed_checks({"ranks": grouped, "memory": memory})[0]
    assert "where 2 were expected (one per group of 2 ranks" in split and "share one batch read different" in split
    low = failed_checks({"ranks": ranks, "memory": {**memory, "ok": False, "ratio": 1.39}})
    assert "1.39x" in low[0] and "may run out of memory" in low[0] and "20.00 GB" in low[0]
    high = failed_checks({"ranks": ranks, "memory": {**memory, "ok": False, "ratio": 0.72}})
    assert "0.72x" in high[0] and "more GPUs or offload than the run needs" in high[0]
