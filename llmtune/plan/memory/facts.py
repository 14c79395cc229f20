"""What the planner may know about the model without building it: its config.json.

Read from a local folder, a hub id already in the local HF cache, or not at all.
Parameter counts follow the decoder-only layout (embeddings, layers, norm, head).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Model families whose layers mix tokens with something besides attention (state-space or linear-attention layers):
# ring attention splits only the attention, so their other layers would see sequence chunks as whole sequences.
NOT_ATTENTION_ONLY = ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "nemotron_h",
                      "falcon_h1", "granitemoehybrid", "plamo2", "lfm2", "lfm2_moe", "qwen3_next", "minimax",
                      "kimi_linear", "recurrent_gemma", "rwkv")  # fmt: skip


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

    def linear_params(self) -> int:
        """The decoder layers' linear weights: what bitsandbytes quantizes (embeddings, lm_head, norms are not)."""
        return self.num_layers * (self.layer_params() - 2 * self.hidden_size)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size + head


def model_file(name: str, filename: str) -> Path | None:
    """A model's file where it is already on this machine: its local folder, or the HF cache's snapshot of a hub id
    (no download)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path / filename if (path / filename).is_file() else None
    if path.exists() or name.count("/") != 1:
        return None
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    snapshots = hub.expanduser() / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob(f"*/{filename}")) if snapshots.is_dir() else []
    return found[-1] if found else None


# Shapes of common base models (from their public config.json), so estimates work before any download.
# name: hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings
KNOWN_MODELS = {
    "meta-llama/Meta-Llama-3-8B": (4096, 32, 32, 8, 14336, 128256, False),
    "meta-llama/Llama-3.1-8B": (4096, 32, 32, 8, 14336, 128256, False),
    "meta-llama/Llama-3.1-70B": (8192, 80, 64, 8, 28672, 128256, False),
    "meta-llama/Llama-3.2-1B": (2048, 16, 32, 8, 8192, 128256, True),
    "meta-llama/Llama-3.2-3B": (3072, 28, 24, 8, 8192, 128256, True),
    "mistralai/Mistral-7B-v0.1": (4096, 32, 32, 8, 14336, 32000, False),
    "mistralai/Mistral-7B-v0.3": (4096, 32, 32, 8, 14336, 32768, False),
    "Qwen/Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, False),
    "HuggingFaceTB/SmolLM2-135M": (576, 30, 9, 3, 1536, 49152, True),
    "HuggingFaceTB/SmolLM2-360M": (960, 32, 15, 5, 2560, 49152, True),
    "HuggingFaceTB/SmolLM2-1.7B": (2048, 24, 32, 32, 8192, 49152, True),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": (2048, 22, 32, 4, 5632, 32000, False),
}


# Their config.json's model_type, by organisation (SmolLM2 and TinyLlama are llama)
KNOWN_TYPES = {"mistralai": "mistral", "Qwen": "qwen2"}


def known_model_facts(name: str) -> ModelFacts | None:
    """A known base model, or its -Instruct / -Chat / -v0.2 variant."""
    for known, shape in KNOWN_MODELS.items():
        stem = known.split("/")[1].lower()
        if name.lower() == known.lower() or name.split("/")[-1].lower().startswith(stem):
            return ModelFacts(KNOWN_TYPES.get(known.split("/")[0], "llama"), *shape)
    return None


def find_config_json(name: str) -> Path | None:
    """A config.json named directly, else the model's own (its folder, or the HF cache's snapshot)."""
    path = Path(name).expanduser()
    if path.is_file() and path.name == "config.json":
        return path
    return model_file(name, "config.json")


def fetch_hub_config(repo_id: str, timeout: float = 5.0) -> Path | None:
    """config.json from the Hub when it is reachable (one quick try, no retries), kept in llmtune's cache."""
    import urllib.error
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or repo_id.count("/") != 1:
        return None
    cache = Path(os.environ.get("LLMTUNE_CACHE", "~/.cache/llmtune")).expanduser() / "configs"
    target = cache / f"{repo_id.replace('/', '--')}.json"
    if target.is_file():
        return target
    request = urllib.request.Request(f"https://huggingface.co/{repo_id}/resolve/main/config.json")
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")  # gated models; never written anywhere
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        json.loads(body)
    except (OSError, ValueError, urllib.error.URLError):
        return None
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".tmp")
    partial.write_bytes(body)
    partial.replace(target)
    return target


def read_model_facts(name: str, fetch: bool = False) -> ModelFacts | None:
    """Facts from a config.json for a decoder-only LM: local folder, HF cache, a known model, or (with
    fetch) the Hub. None when none of them has it."""
    config_path = find_config_json(name)
    if config_path is None and fetch and not Path(name).expanduser().exists():
        config_path = fetch_hub_config(name)
    if config_path is None:
        return known_model_facts(name) if not Path(name).expanduser().exists() else None
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
