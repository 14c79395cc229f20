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
    kept, notes = _unfrozen_in_shrunk(mapping, shrunk)
    assert kept["unfrozen_parameters"] == ["^lm_head.weight$"]
    assert "model.layers.[23].mlp.experts match no parameter of the 2-layer rehearsal model" in notes[0]
    same, none = _unfrozen_in_shrunk({**mapping, "unfrozen_parameters": ["model.layers.[01].mlp"]}, shrunk)
    assert none == [] and same["unfrozen_parameters"] == ["model.layers.[01].mlp"]
    with pytest.raises(UserError, match="none of its entries matches a parameter of the 2-layer model"):
        _unfrozen_in_shrunk({**mapping, "unfrozen_parameters": ["model.layers.3.mlp"]}, shrunk)
