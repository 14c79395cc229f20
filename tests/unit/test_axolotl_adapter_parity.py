"""Two Axolotl keys that llmtune read differently, on the tiny Llama.

lora_target_linear with lora_target_modules beside it adapts the union, as Axolotl does (its loaders/adapter.py:
every linear layer's name, the output head's left out, plus the listed ones): llmtune passed peft "all-linear" and
dropped the list without a word (lm_head and embed_tokens named there got no LoRA), and with
peft_layers_to_transform the run died at train start (peft takes layer indices with a list of names only). The
estimate's trainable count is what peft builds.

mean_resizing_embeddings is Axolotl's (default false): new token rows get the model's own initialisation unless the
recipe asks for the mean of the old rows; llmtune always mean-resized and said the key had no effect."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import load_tokenizer, make_tiny_model, tiny_llama_config
from transformers import LlamaForCausalLM

from llmtune.errors import UserError
from llmtune.plan.memory.facts import facts_from_config
from llmtune.plan.memory.states import trainable_parameters
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.model.adapters import attach_adapter, frozen_linears, parameter_counts

HEADS = ["lm_head", "embed_tokens"]


def recipe(**keys):
    raw = {"base_model": "tiny", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "adapter": "lora", **keys}
    return recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe


def model():
    return LlamaForCausalLM(tiny_llama_config(64))


def adapted_names(keys: dict) -> set[str]:
    return set(attach_adapter(model(), recipe(**keys)).base_model.targeted_module_names)


def test_listed_modules_are_adapted_beside_every_linear_layer():
    every_linear = adapted_names({"lora_target_linear": True})
    assert len(every_linear) == 2 * 7 and "lm_head" not in every_linear  # peft's all-linear: the head left out
    adapted = attach_adapter(model(), recipe(lora_target_linear=True, lora_target_modules=HEADS))
    assert set(adapted.base_model.targeted_module_names) == every_linear | {"lm_head", "model.embed_tokens"}
    saved = set(adapted.peft_config["default"].target_modules)
    assert set(HEADS) <= saved and "q_proj" in saved
    trained = {name for name, param in adapted.named_parameters() if param.requires_grad}
    assert any("lm_head.lora_A" in name for name in trained)
    assert any("embed_tokens.lora_embedding_A" in name for name in trained)
    # listing linear layers all-linear selects anyway changes nothing (Axolotl's examples list them beside it)
    assert adapted_names({"lora_target_linear": True, "lora_target_modules": ["q_proj", "v_proj"]}) == every_linear


def test_the_linear_layers_named_are_the_ones_peft_all_linear_selects():
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    from llmtune.train.model.targets import linear_layer_names

    for tied in (False, True):
        base = LlamaForCausalLM(tiny_llama_config(64, tie_word_embeddings=tied))
        chosen = _maybe_include_all_linear_layers(LoraConfig(target_modules="all-linear"), base).target_modules
        assert sorted({name.rsplit(".", 1)[-1] for name in chosen}) == linear_layer_names(base)
        assert "lm_head" not in linear_layer_names(base)


@pytest.mark.parametrize("listed", [[], HEADS])
def test_layers_to_transform_with_lora_target_linear_builds_on_those_layers(listed):
    adapted = attach_adapter(model(), recipe(lora_target_linear=True, peft_layers_to_transform=[1],
                                             lora_target_modules=listed))  # fmt: skip
    names = set(adapted.base_model.targeted_module_names)
    in_layers = {name for name in names if name.startswith("model.layers.")}
    assert len(in_layers) == 7 and all(name.startswith("model.layers.1.") for name in in_layers)
    # the embedding is in no layer: peft leaves it out; the head matches its whole name, which peft takes in any layer
    assert names - in_layers == ({"lm_head"} if listed else set())
    assert frozen_linears(adapted, recipe(lora_target_linear=True, peft_layers_to_transform=[1])) is None
    pattern = attach_adapter(model(), recipe(lora_target_linear=True, peft_layers_to_transform=[0],
                                             peft_layers_pattern="layers"))  # fmt: skip
    assert all(name.startswith("model.layers.0.") for name in pattern.base_model.targeted_module_names)


@pytest.mark.parametrize("keys", [
    {"lora_target_linear": True},
    {"lora_target_linear": True, "lora_target_modules": HEADS},
    {"lora_target_linear": True, "lora_target_modules": ["lm_head"]},
    {"lora_target_linear": True, "peft_layers_to_transform": [1]},
    {"lora_target_linear": True, "peft_layers_to_transform": [0], "lora_target_modules": HEADS},
    {"lora_target_modules": ["q_proj", "v_proj", "lm_head", "embed_tokens"]},
    {"lora_target_modules": ["q_proj", "down_proj"], "peft_layers_to_transform": [0]},
])  # fmt: skip
def test_the_estimates_trainable_count_is_what_peft_builds(keys):
    base = model()
    facts = facts_from_config(base.config.to_dict())
    r = recipe(lora_r=4, **keys)
    assert trainable_parameters(r, facts) == parameter_counts(attach_adapter(base, r))[0]


def test_a_listed_name_of_no_module_beside_lora_target_linear_is_said_not_refused(capsys):
    names = adapted_names({"lora_target_linear": True, "lora_target_modules": ["lm_head", "w1"]})
    assert "lm_head" in names
    said = capsys.readouterr().err
    assert "note: lora_target_modules: w1 names no module of this model (llama)" in said and said.count("note:") == 1
    with pytest.raises(UserError, match="'w1' names no module"):  # without lora_target_linear it is all there is
        attach_adapter(model(), recipe(lora_target_modules=["q_proj", "w1"]))


def test_layers_to_transform_with_a_regex_target_is_one_line():
    for keys in ({"lora_target_modules": ["q_proj", "mlp.(gate|up)_proj"]},
                 {"lora_target_linear": True, "lora_target_modules": ["mlp.(gate|up)_proj"]}):  # fmt: skip
        with pytest.raises(UserError, match="lora_target_modules is a regular expression") as caught:
            attach_adapter(model(), recipe(peft_layers_to_transform=[0], **keys))
        assert "\n" not in caught.value.message and caught.value.hint.startswith("list the modules")


# --- mean_resizing_embeddings ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


NEW = ["<newA>", "<newB>", "<newC>"]


def grown(tiny, **keys):
    """The tiny model as a full fine-tune with three tokens added loads it: (old rows, new rows) of the embedding and
    of the (untied) output head."""
    from llmtune.train.model import load

    base = LlamaForCausalLM.from_pretrained(str(tiny))
    r = recipe(base_model=str(tiny), adapter=None, tokens=NEW, **keys)
    tokenizer = load.load_tokenizer(r, str(tiny))
    loaded = load.load_model(r, str(tiny), tokenizer, "no", device="cpu")
    rows = base.get_input_embeddings().weight.shape[0]
    assert loaded.get_input_embeddings().weight.shape[0] == rows + len(NEW) == len(tokenizer)
    return [(old.weight.detach(), new.weight.detach()[rows:]) for old, new in
            ((base.model.embed_tokens, loaded.model.embed_tokens), (base.lm_head, loaded.lm_head))]  # fmt: skip


def test_mean_resizing_embeddings_starts_new_rows_at_the_mean_of_the_old(tiny):
    for old, new in grown(tiny, mean_resizing_embeddings=True):
        for row in new:  # (transformers draws around the mean with 1e-9 of the old rows' covariance)
            assert (row - old.mean(0)).abs().max() < 1e-4


def test_by_default_new_rows_get_the_models_own_initialisation_from_the_seed(tiny):
    import torch

    first = grown(tiny)
    for (old, new), (_, again) in zip(first, grown(tiny), strict=True):
        assert all((row - old.mean(0)).norm() > 0.1 * old.norm(dim=1).mean() for row in new)  # not the mean
        assert all(not torch.allclose(new[i], new[j]) for i in range(len(new)) for j in range(i))  # nor each other
        assert torch.equal(new, again)  # every load alike: each rank's, a preference run's frozen reference
    assert not torch.equal(first[0][1], grown(tiny, seed=7)[0][1])


def test_resizing_leaves_the_runs_random_stream_as_it_was(tiny):
    import torch

    from llmtune.train.model.load import grow_embeddings

    base = LlamaForCausalLM.from_pretrained(str(tiny))
    state = torch.get_rng_state()
    grow_embeddings(base, len(load_tokenizer()) + 2, recipe(adapter=None))
    assert torch.equal(torch.get_rng_state(), state)


def test_mean_resizing_embeddings_is_a_key_not_a_note(run_cli, write_recipe):
    from llmtune.recipe.axolotl import action

    assert action("mean_resizing_embeddings") == "llmtune"
    done = run_cli("validate", write_recipe({"mean_resizing_embeddings": True}))
    assert done.code == 0 and "no effect" not in done.err + done.out
    assert recipe().mean_resizing_embeddings is False  # Axolotl's default
