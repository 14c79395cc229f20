"""unfrozen_parameters checked against the model's own parameter names before anything starts, and kept to the
layers a rehearsal's shrunken model has."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.loader import recipe_from_mapping

MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512, "tie_word_embeddings": False}  # fmt: skip


def recipe(folder: Path, patterns: list[str], **changes):
    mapping = {"base_model": str(folder), "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
               "unfrozen_parameters": patterns, **changes}  # fmt: skip
    return recipe_from_mapping(mapping, Path("r.yaml"), check_files=False).recipe


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mixtral")
    (folder / "config.json").write_text(json.dumps(MIXTRAL))
    return folder


def test_a_pattern_that_matches_no_parameter_is_refused_at_plan_time_with_the_names_it_could_mean(mixtral):
    """Axolotl's Mixtral recipes unfreeze `block_sparse_moe` experts, which transformers 5 names `mlp`: the run
    would have trained the embedding and head alone."""
    written = ["^lm_head.weight$", "model.layers.[23].block_sparse_moe.gate", "model.layers.[23].block_sparse_moe.experts"]
    with pytest.raises(UserError) as refused:
        make_plan(recipe(mixtral, written), make_cluster(2, device="cpu"))
    line = refused.value.one_line()
    assert "'model.layers.[23].block_sparse_moe.gate', 'model.layers.[23].block_sparse_moe.experts' match no " in line
    assert "mlp.gate.weight" in line and "unfrozen_parameters" in line
    fixed = [p.replace("block_sparse_moe", "mlp") for p in written]
    make_plan(recipe(mixtral, fixed), make_cluster(2, device="cpu"))  # the names transformers 5 gives: planned
    # an adapter's unfrozen_parameters and a config not on this machine are left to the rank
    make_plan(recipe(mixtral, written, adapter="lora", lora_target_linear=True), make_cluster(1, device="cpu"))
    make_plan(recipe(Path("no-such-org/no-such-model-xyz"), written), make_cluster(1, device="cpu"))


def test_the_rehearsal_leaves_out_the_layers_its_shrunken_model_lacks_and_says_so(mixtral, tmp_path):
    from llmtune.rehearse.flow import _unfrozen_in_shrunk

    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**MIXTRAL, "num_hidden_layers": 2}))
    shrunk = SimpleNamespace(shrunk=SimpleNamespace(num_layers=2))
    mapping = {"base_model": str(small), "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
               "unfrozen_parameters": ["^lm_head.weight$", "model.layers.[23].mlp.experts"]}  # fmt: skip
    full = recipe(mixtral, mapping["unfrozen_parameters"])
    kept, notes = _unfrozen_in_shrunk(mapping, shrunk, full)
    assert kept["unfrozen_parameters"] == ["^lm_head.weight$"]
    assert "model.layers.[23].mlp.experts match no parameter of the 2-layer rehearsal model" in notes[0]
    assert notes[0].endswith("the GPU run trains them")  # the real model's names were read: they match there
    unread = recipe(Path("no-such-org/no-such-model-xyz"), mapping["unfrozen_parameters"])
    assert "names couldn't be read here" in _unfrozen_in_shrunk(mapping, shrunk, unread)[1][0]
    same, none = _unfrozen_in_shrunk({**mapping, "unfrozen_parameters": ["model.layers.[01].mlp"]}, shrunk, full)
    assert none == [] and same["unfrozen_parameters"] == ["model.layers.[01].mlp"]
    with pytest.raises(UserError, match="none of its entries matches a parameter of the 2-layer model"):
        _unfrozen_in_shrunk({**mapping, "unfrozen_parameters": ["model.layers.3.mlp"]}, shrunk, full)


def test_the_names_are_those_of_the_model_the_rank_builds(tmp_path):
    """overrides_of_model_config change the names (untied: an lm_head of its own; more layers); Llama 4's
    linearized experts are renamed after loading, so the plan leaves those to the rank."""
    from llmtune.plan.memory.unfrozen import parameter_names

    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "vocab_size": 512,
                                                  "tie_word_embeddings": True}))  # fmt: skip
    patterns = ["^lm_head.weight$", "model.layers.5."]
    with pytest.raises(UserError, match="'\\^lm_head.weight\\$', 'model.layers.5.' match no parameter"):
        make_plan(recipe(tied, patterns), make_cluster(1, device="cpu"))
    untied = recipe(tied, patterns, overrides_of_model_config={"tie_word_embeddings": False, "num_hidden_layers": 6})
    make_plan(untied, make_cluster(1, device="cpu"))
    assert parameter_names(recipe(tied, patterns, llama4_linearized_experts=True)) is None


def test_an_8bit_optimizer_keeps_the_unfrozen_embedding_s_states_in_32_bits(mixtral):
    from llmtune.plan.memory.facts import facts_from_config
    from llmtune.plan.memory.states import _states

    facts = facts_from_config(MIXTRAL)
    head = _states(recipe(mixtral, ["^lm_head.weight$"], optimizer="adamw_bnb_8bit"), facts, False, False)[2]
    both = _states(recipe(mixtral, ["^lm_head.weight$", "^model.embed_tokens.weight$"], optimizer="adamw_bnb_8bit"),
                   facts, False, False)[2]  # fmt: skip
    assert both - head == 8 * facts.embedding_params()  # the embedding's Adam moments, both in 32 bits


def test_the_rank_refuses_an_entry_that_matches_nothing(tmp_path):
    from tiny import make_tiny_model
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.adapters import freeze_except

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"))
    with pytest.raises(UserError, match="'model.layers.0.block_sparse_moe' match no parameter of the model"):
        freeze_except(model, ["^lm_head.weight$", "model.layers.0.block_sparse_moe"], adapter=False, checkpointing=False)
    freeze_except(model, ["^lm_head.weight$", "model.layers.0.mlp"], adapter=False, checkpointing=False)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "lm_head.weight", *(f"model.layers.0.mlp.{m}_proj.weight" for m in ("gate", "up", "down"))}
