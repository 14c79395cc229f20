"""The plan promises the batch layout the ranks run (llmtune/plan/padding_free.py): it reads the model's config.json
and transformers' modelling source as text (nothing imported) with the rules the ranks apply to the loaded classes
(train/model/varlen.unsupported), so a model that can't take padding-free batches is planned padded, with the
reason, instead of falling back after loading."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.padding_free import _class_forward, _layers, blocker, modelling_source, passes_boundaries
from llmtune.recipe.batches import PADDED, PADDING_FREE
from llmtune.recipe.loader import recipe_from_mapping

# Families with and without padding-free attention in transformers 5 (Falcon and StableLM: no attention
# backends, nor BLOOM and MPT; Nemotron: its layer drops the row boundaries; gpt-oss: attention sinks; Jamba: state-space layers)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox", "opt",
            "mixtral", "qwen2_moe", "olmoe", "llama4_text", "falcon", "stablelm", "bloom", "mpt", "nemotron",
            "gpt_oss", "jamba"]  # fmt: skip


def recipe(**keys):
    mapping = {"base_model": "m", "datasets": [{"path": "x", "type": "alpaca"}], **keys}
    return recipe_from_mapping(mapping, Path("r.yaml"), check_files=False).recipe


def test_the_text_rules_agree_with_the_loaded_classes():
    """For each family, the modelling file read as text says what its classes say: transformers'
    _supports_attention_backend, and each decoder layer passing the row boundaries on to its attention."""
    from llmtune.train.model.varlen import _passes_boundaries

    planned = {}
    for model_type in FAMILIES:
        source = modelling_source(model_type)
        assert source is not None, model_type
        folder = {"gemma3_text": "gemma3", "llama4_text": "llama4"}.get(model_type, model_type)
        module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]
        backends = all(c.is_backend_compatible() for c in classes if hasattr(c, "is_backend_compatible"))
        layers = [getattr(module, name) for name in _layers(source)]
        assert layers, model_type
        boundaries = all(_passes_boundaries(layer) for layer in layers)
        assert boundaries == all(passes_boundaries(_class_forward(source, c.__name__)) for c in layers), model_type
        why = blocker({"model_type": model_type})
        planned[model_type] = why
        if model_type not in ("gpt_oss", "jamba"):  # sinks and state-space layers: asserted below
            assert (why is None) == (backends and boundaries), model_type
    assert planned["falcon"] == "transformers' falcon modelling code doesn't take its attention backends"
    assert planned["stablelm"] == "transformers' stablelm modelling code doesn't take its attention backends"
    assert planned["nemotron"].startswith("NemotronDecoderLayer doesn't pass the batch's row boundaries")
    assert planned["gpt_oss"] == "gpt_oss has attention sinks (no varlen kernel here takes them)"
    assert planned["jamba"] == "jamba mixes tokens outside attention (linear or state-space layers)"
    assert [t for t, why in planned.items() if why is None] == [
        "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox", "opt", "mixtral",
        "qwen2_moe", "olmoe", "llama4_text"]  # fmt: skip
    assert planned["bloom"] == "transformers' bloom modelling code doesn't take its attention backends"


def write_config(folder: Path, **keys) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"hidden_size": 32, "vocab_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, **keys}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_plan_pads_what_the_rank_would_pad_and_says_why(tmp_path):
    """A tiny Falcon and a tiny Llama: the plan's layout is the one batch_layout picks on the loaded model, and the
    reason reaches the plan; batch_flattening: true on Falcon is refused at plan time, not after loading."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.train.model.kernels import batch_layout

    for model_type, layout in (("falcon", PADDED), ("llama", PADDING_FREE)):
        folder = write_config(tmp_path / model_type, model_type=model_type, intermediate_size=64)
        plan = make_plan(recipe(base_model=folder), make_cluster(1, device="cpu"))
        assert plan.kernels["batches"]["layout"] == layout, model_type
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        ranked = batch_layout(recipe(base_model=folder), {"precision": "no", "cluster": {"device": "cpu"}}, model,
                              lambda _: None)  # fmt: skip
        assert ranked.layout == layout, model_type
    assert "modelling code" not in plan.kernels["batches"]["reason"]  # llama: only the CPU kernel's note
    falcon = str(tmp_path / "falcon")
    reason = make_plan(recipe(base_model=falcon), make_cluster(1, device="cpu")).kernels["batches"]["reason"]
    assert reason == "transformers' falcon modelling code doesn't take its attention backends"
    with pytest.raises(UserError, match="batch_flattening: true can't run with this model: transformers' falcon"):
        make_plan(recipe(base_model=falcon, batch_flattening=True), make_cluster(1, device="cpu"))


def test_the_plan_pads_a_model_whose_config_soft_caps_attention(tmp_path):
    folder = write_config(tmp_path, model_type="gemma2", attn_logit_softcapping=50.0)
    plan = make_plan(recipe(base_model=folder), make_cluster(1, device="cpu"))
    assert plan.kernels["batches"]["layout"] == PADDED and "soft-caps" in plan.kernels["batches"]["reason"]
    with pytest.raises(UserError, match="batch_flattening: true can't run with this model: its attention soft-caps"):
        make_plan(recipe(base_model=folder, batch_flattening=True), make_cluster(1, device="cpu"))
    # flash_attention's CPU note speaks of the padded batches the plan shows (it spoke of padding-free ones)
    notes = make_plan(recipe(base_model=folder, flash_attention=True), make_cluster(1, device="cpu")).notes
    said = [note for note in notes if note.startswith("flash_attention: no effect in CPU rehearsal")]
    assert len(said) == 1 and "padding-free" not in said[0] and "the model's own attention" in said[0], said


def test_unknown_models_keep_the_plan_as_it_was(tmp_path):
    """No config here (a hub id not downloaded), remote code, or a type transformers doesn't have: nothing is
    known at plan time; the rank decides on the loaded model."""
    assert blocker({}) is None
    assert blocker({"model_type": "falcon", "auto_map": {"AutoModelForCausalLM": "modeling.Falcon"}}) is None
    assert blocker({"model_type": "no_such_family"}) is None
    assert blocker({"model_type": "../../etc"}) is None
    plan = make_plan(recipe(base_model="org/not-downloaded"), make_cluster(1, device="cpu"))
    assert plan.kernels["batches"]["layout"] == PADDING_FREE


def test_a_model_that_drops_attention_weights_is_planned_per_row_as_the_rank_attends(tmp_path):
    """torch's varlen_attn has no dropout, so with attention dropout in training the varlen attention runs SDPA per
    row (train/model/varlen.py); the plan and the rank's `batches:` line name that kernel and why (they said
    varlen_attn). Read from config.json (attention_dropout, GPT-2's attn_pdrop) and overrides_of_model_config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.train.model.kernels import batch_layout

    gpu = make_cluster(1, device="cuda")
    plain = write_config(tmp_path / "plain", model_type="llama", intermediate_size=64)
    assert make_plan(recipe(base_model=plain, bf16=True), gpu).kernels["batches"]["kernel"] == "torch_varlen"
    why = "the model's attention dropout is 0.1 in training, and torch's varlen_attn has no dropout"
    dropped = write_config(tmp_path / "dropped", model_type="llama", intermediate_size=64, attention_dropout=0.1)
    gpt2 = write_config(tmp_path / "gpt2", model_type="gpt2", n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.1)
    for changes in ({"base_model": dropped}, {"base_model": gpt2},
                    {"base_model": plain, "overrides_of_model_config": {"attention_dropout": 0.1}}):  # fmt: skip
        batches = make_plan(recipe(**changes, bf16=True), gpu).kernels["batches"]
        assert (batches["layout"], batches["kernel"], batches["reason"]) == (PADDING_FREE, "sdpa_per_row", why)
        assert batches["summary"].endswith(f"attention: exact SDPA per row ({why})"), changes
    # the rank, on the loaded model, says the same
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dropped))
    said = []
    ranked = batch_layout(recipe(base_model=dropped, bf16=True), {"precision": "bf16", "cluster": {"device": "cuda"}},
                          model, said.append)  # fmt: skip
    assert (ranked.kernel, ranked.reason) == ("sdpa_per_row", why) and said == [f"batches: {ranked.describe()}"]


def test_packed_rows_a_model_s_mask_would_mix_are_refused_when_planned(tmp_path):
    """gpt-oss (attention sinks: padded rows) builds its mask without position_ids, so packed examples would attend
    to each other: the ranks refused that after data and model loading (six of Axolotl's gpt-oss examples pack).
    The plan reads the same rule from the modelling source: it agrees with the loaded classes' and refuses first."""
    from llmtune.plan.padding_free import mask_ignores_positions

    leaky = {t for t in FAMILIES if mask_ignores_positions(modelling_source(t))}
    assert {"opt", "gpt_oss"} <= leaky and not {"llama", "mistral", "qwen2", "gemma2", "mixtral"} & leaky
    folder = write_config(tmp_path / "oss", model_type="gpt_oss", num_local_experts=4, intermediate_size=64)
    with pytest.raises(UserError, match="sample_packing on padded rows can't run with gpt_oss") as refused:
        make_plan(recipe(base_model=folder, sample_packing=True), make_cluster(1, device="cpu"))
    assert refused.value.hint == "set sample_packing: false"
    make_plan(recipe(base_model=folder), make_cluster(1, device="cpu"))  # unpacked rows: planned padded
    opt = write_config(tmp_path / "opt", model_type="opt", ffn_dim=64)  # padding-free keeps OPT's examples apart
    make_plan(recipe(base_model=opt, sample_packing=True), make_cluster(1, device="cpu"))
    with pytest.raises(UserError, match="can't run with opt") as refused:
        make_plan(recipe(base_model=opt, sample_packing=True, batch_flattening=False), make_cluster(1, device="cpu"))
    assert refused.value.hint.startswith("remove batch_flattening: false")
