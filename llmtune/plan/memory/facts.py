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
    intermediate_size: int  # a dense layer's MLP width
    vocab_size: int
    tie_word_embeddings: bool
    explicit_head_dim: int = 0  # config head_dim where it isn't hidden / heads (Qwen3, Gemma): 0 when it is
    num_experts: int = 0  # routed experts of a mixture-of-experts layer (0: dense)
    expert_intermediate_size: int = 0  # one expert's MLP width
    experts_per_token: int = 0
    shared_intermediate_size: int = 0  # the always-on shared experts' MLP width, summed
    moe_layers: int = 0  # how many of the layers are mixture-of-experts ones
    latent_attention_params: int = 0  # one layer's attention under multi-head latent attention (DeepSeek), else 0
    mlp_matrices: int = 3  # a dense MLP's weight matrices: gate, up and down (2 where it has no gate: OPT, GPT-2)
    shared_expert_gate: bool = False  # a linear layer gating the shared expert's output (Qwen2-MoE style)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    def _attention_params(self) -> int:
        if self.latent_attention_params:
            return self.latent_attention_params
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv

    def _moe_mlp_params(self) -> int:
        h = self.hidden_size
        return (
            3 * h * (self.num_experts * self.expert_intermediate_size + self.shared_intermediate_size)
            + h * self.num_experts
        )

    def layer_params(self) -> int:
        """One layer's parameters on average (mixture-of-experts and dense layers alike)."""
        return self.layers_params() // self.num_layers

    def largest_layer_params(self) -> int:
        mlp = (
            self._moe_mlp_params() if self.moe_layers else self.mlp_matrices * self.hidden_size * self.intermediate_size
        )
        return self._attention_params() + mlp + 2 * self.hidden_size

    def largest_tensor_params(self) -> int:
        """The largest single weight: the embedding, a dense MLP projection, or a fused experts tensor (gate and up
        of every expert in one, as transformers stores mixture-of-experts weights)."""
        h = self.hidden_size
        return max(
            self.embedding_params(),
            h * self.intermediate_size,
            2 * h * self.expert_intermediate_size * self.num_experts,
        )

    def routed_expert_params(self) -> int:
        """The routed experts' weights: fused 3D tensors in transformers, which bitsandbytes (linear layers only)
        leaves unquantized."""
        return self.moe_layers * 3 * self.hidden_size * self.expert_intermediate_size * self.num_experts

    def layers_params(self) -> int:
        dense = self.num_layers - self.moe_layers
        mlp = (
            dense * self.mlp_matrices * self.hidden_size * self.intermediate_size
            + self.moe_layers * self._moe_mlp_params()
        )
        return self.num_layers * (self._attention_params() + 2 * self.hidden_size) + mlp

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width one token goes through: its chosen experts' and the shared ones' in a mixture of experts."""
        if not self.moe_layers:
            return self.intermediate_size
        return self.experts_per_token * self.expert_intermediate_size + self.shared_intermediate_size

    def linear_params(self) -> int:
        """The decoder layers' linear weights: what bitsandbytes quantizes (embeddings, lm_head, norms are not)."""
        return self.layers_params() - self.num_layers * 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.embedding_params() + self.layers_params() + self.hidden_size + head


# The input and output embedding modules by config model_type (Axolotl's get_linear_embedding_layers)
EMBEDDING_MODULES = {"gpt_neox": ("embed_in", "embed_out"), "falcon": ("word_embeddings", "lm_head"),
                     "nemotron_h": ("embeddings", "lm_head"), "gpt2": ("wte", "lm_head")}  # fmt: skip
DEFAULT_EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def embedding_modules_of(model_type: str | None) -> tuple[str, str]:
    """The names of a model type's input and output embedding modules, as lora_modules_to_save wants them."""
    return EMBEDDING_MODULES.get(model_type or "", DEFAULT_EMBEDDING_MODULES)


# Decoder families whose config class ties the output layer to the embeddings when config.json doesn't say
# (transformers' own defaults; Gemma 3's text_config leaves it out)
TIED_BY_DEFAULT = frozenset({
    "bloom", "cohere", "cohere2", "cohere2_moe", "ernie4_5", "ernie4_5_moe", "falcon", "falcon_mamba", "gemma",
    "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gpt2", "gpt_bigcode",
    "gpt_neo", "jetmoe", "lfm2", "lfm2_moe", "mamba", "minicpm3", "mpt", "opt", "recurrent_gemma", "smollm3",
    "starcoder2", "vaultgemma", "xglm", "zamba", "zamba2",
})  # fmt: skip


# Decoder families whose MLP is two matrices (up, down) with no gate
UNGATED_MLP = frozenset({"opt", "gpt2", "gpt_neox", "gpt_neox_japanese", "falcon", "bloom", "mpt", "gpt_bigcode",
                         "gpt_neo", "gptj", "phi", "starcoder2", "biogpt", "xglm", "codegen"})  # fmt: skip
# the same shape under other config keys (GPT-2's n_head / n_embd / n_layer, MPT's d_model, Falcon's num_kv_heads)
KEYS = {"heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
        "hidden": ("hidden_size", "n_embd", "d_model"), "layers": ("num_hidden_layers", "n_layer", "num_layers",
        "n_layers"), "mlp": ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner")}  # fmt: skip


def _first(text: dict, kind: str, required: bool = True):
    found = next((text[key] for key in KEYS[kind] if isinstance(text.get(key), int)), None)
    if found is None and required:
        raise KeyError(KEYS[kind][0])
    return found


def _kv_heads(text: dict, heads: int) -> int:
    if text.get("num_key_value_heads"):
        return text["num_key_value_heads"]
    if text.get("model_type") == "falcon" and not text.get("new_decoder_architecture"):
        return 1 if text.get("multi_query", True) else heads  # multi-query: one key/value head
    return text.get("num_kv_heads") or heads


def facts_from_config(config: dict) -> ModelFacts:
    """ModelFacts of a decoder-only LM's config.json mapping (a multimodal one's text_config); KeyError/TypeError
    when it has no decoder's shape."""
    text = config.get("text_config") or config
    heads, hidden, layers = _first(text, "heads"), _first(text, "hidden"), _first(text, "layers")
    model_type = text.get("model_type") or config.get("model_type") or "unknown"
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT))
    head_dim = text.get("head_dim") if isinstance(text.get("head_dim"), int) else 0
    dense = _first(text, "mlp", required=False) or 4 * hidden
    experts = next((text[k] for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(text.get(k), int) and text[k] > 1), 0)  # fmt: skip
    expert = text.get("moe_intermediate_size") or dense
    shared = (text.get("shared_expert_intermediate_size") or 0) + (text.get("n_shared_experts") or 0) * expert
    if model_type.startswith("llama4"):  # its dense layers are intermediate_size_mlp wide, its experts + 1 shared
        dense, shared = text.get("intermediate_size_mlp") or dense, expert
    return ModelFacts(
        model_type=model_type, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=_kv_heads({**text, "model_type": model_type}, heads), intermediate_size=dense,
        vocab_size=text["vocab_size"], tie_word_embeddings=bool(tied),
        explicit_head_dim=0 if head_dim == hidden // heads else head_dim, num_experts=experts,
        expert_intermediate_size=expert if experts else 0,
        experts_per_token=(text.get("num_experts_per_tok") or 2) if experts else 0,
        shared_intermediate_size=shared if experts else 0,
        moe_layers=sum(_is_moe_layer(text, i) for i in range(layers)) if experts else 0,
        latent_attention_params=_latent_attention(text, hidden, heads),
        mlp_matrices=2 if model_type in UNGATED_MLP and not experts else 3,
        shared_expert_gate=bool(experts and text.get("shared_expert_intermediate_size")),
    )  # fmt: skip


def _latent_attention(config: dict, hidden: int, heads: int) -> int:
    """Multi-head latent attention's weights (DeepSeek V2/V3, Kimi): queries through an optional low-rank step, keys
    and values through a shared latent; 0 for other attention."""
    latent = config.get("kv_lora_rank")
    if not isinstance(latent, int):
        return 0
    rope, nope = config.get("qk_rope_head_dim") or 0, config.get("qk_nope_head_dim") or 0
    value, q_rank = config.get("v_head_dim") or nope, config.get("q_lora_rank")
    query = heads * (nope + rope)
    queries = hidden * query if not q_rank else hidden * q_rank + q_rank + q_rank * query
    keys_values = hidden * (latent + rope) + latent + latent * heads * (nope + value)
    return queries + keys_values + heads * value * hidden


def _is_moe_layer(config: dict, index: int) -> bool:
    """Whether layer `index` is a mixture-of-experts one, by the keys each family uses to keep some layers dense."""
    if index in (config.get("mlp_only_layers") or []) or index < (config.get("first_k_dense_replace") or 0):
        return False
    frequency = config.get("moe_layer_freq")  # DeepSeek: every frequency-th layer from the first one
    if isinstance(frequency, int) and frequency > 1:
        return index % frequency == 0
    step = config.get("decoder_sparse_step") or config.get("interleave_moe_layer_step")  # Qwen-MoE, Llama 4: the last
    return not isinstance(step, int) or step <= 1 or (index + 1) % step == 0


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


def local_config(name: str) -> dict:
    """A model's config.json already on this machine (found as find_config_json finds it), or {} where there is
    none or it can't be read: the plan's checks that only sharpen what loading would find."""
    found = find_config_json(name)
    try:
        config = json.loads(found.read_text()) if found else {}
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_positions(name: str) -> int | None:
    """max_position_embeddings of a model whose config.json is on this machine (None: not known here)."""
    value = local_config(name).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


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
    try:
        return facts_from_config(json.loads(config_path.read_text()))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
