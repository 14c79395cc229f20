"""What the planner may know about the model without building it: its config.json.

Read from a local folder, a hub id already in the local HF cache, or not at all.
Parameter counts follow the decoder-only layout (embeddings, layers, norm, head).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * h * 2 + h * kv * 2
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size + head


def _hub_cache_config(repo_id: str) -> Path | None:
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    snapshots = hub.expanduser() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
    return found[-1] if found else None


def find_config_json(name: str) -> Path | None:
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file() and path.name == "config.json":
        return path
    if not path.exists() and name.count("/") == 1:
        return _hub_cache_config(name)
    return None


def read_model_facts(name: str) -> ModelFacts | None:
    """Facts from a config.json for a decoder-only LM, or None if it can't be read offline."""
    config_path = find_config_json(name)
    if config_path is None:
        return None
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    try:
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        return ModelFacts(
            model_type=config.get("model_type", "unknown"),
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            intermediate_size=config.get("intermediate_size") or 4 * hidden,
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ZeroDivisionError):
        return None
