"""overrides_of_model_config's RoPE keys on transformers 5, where a config keeps them in `rope_parameters`: the old
names (and Axolotl's top-level rope_scaling, read as one) are folded in, so the rotary embedding the model builds
follows them (rope_theta was ignored, rope_scaling crashed the first forward without a theta)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmtune.errors import UserError
from llmtune.train.model.config_overrides import apply_overrides


def tiny(**kwargs) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **kwargs)


def frequencies(config) -> torch.Tensor:
    return LlamaRotaryEmbedding(config).inv_freq


def test_old_rope_names_reach_the_rotary_embedding_and_a_bad_one_is_one_line():
    said: list[str] = []
    config = tiny()
    base = frequencies(config)
    apply_overrides(config, {"rope_scaling": {"type": "linear", "factor": 2.0}}, said.append)
    assert config.rope_parameters == {"rope_theta": 10000.0, "factor": 2.0, "rope_type": "linear"}
    assert torch.allclose(frequencies(config), base / 2)  # linear scaling: positions divided by the factor
    assert "rope_parameters are" in said[-1]
    config = tiny()
    apply_overrides(config, {"rope_theta": 500000.0, "max_position_embeddings": 512}, said.append)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.max_position_embeddings == 512
    assert torch.allclose(frequencies(config), frequencies(tiny(rope_theta=500000.0)))  # as if built with it
    assert "rope_theta" not in config.to_dict()  # one value in the saved config.json (it held two)
    config = tiny(rope_scaling={"rope_type": "linear", "factor": 4.0})
    apply_overrides(config, {"rope_scaling": None}, said.append)  # null: no scaling, the model's own theta
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(UserError, match=r"rope_scaling: \{'rope_type': 'linear'\}: transformers refuses .*'factor'"):
        apply_overrides(tiny(), {"rope_scaling": {"rope_type": "linear"}}, said.append)
    with pytest.raises(UserError, match="per attention type .*sliding_attention") as refused:
        apply_overrides(Gemma3TextConfig(), {"rope_theta": 1e6}, said.append)
    assert "rope_parameters" in refused.value.hint
