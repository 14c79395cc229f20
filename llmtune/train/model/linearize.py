"""llama4_linearized_experts: Llama 4's routed experts as one nn.Linear per expert and projection, as Axolotl lays
them out, so that bitsandbytes quantizes them (QLoRA) and LoRA can target them (experts.gate_projs.N, ...).

transformers keeps them fused: gate_up_proj [E, H, 2I] (gate the first half) and down_proj [E, I, H], multiplied
with bmm. The linear layout computes the same thing expert by expert. Checkpoints saved in the linear layout
(Axolotl's "Linearized" ones) load directly; a fused checkpoint is split into the linear weights after loading
(16/32-bit loads; a quantized load needs a linearized checkpoint, since bitsandbytes quantizes while it loads).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from torch import nn

from llmtune.errors import UserError

LLAMA4 = ("llama4", "llama4_text")
FUSED = re.compile(r"(?:.*\.)?layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)$")


class LinearizedExperts(nn.Module):
    """Llama 4's routed experts, one Linear per expert for each of gate, up and down (no bias, as the fused ones)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.num_experts, self.hidden_size = config.num_local_experts, config.hidden_size
        size = config.intermediate_size
        self.gate_projs = nn.ModuleList(nn.Linear(self.hidden_size, size, bias=False) for _ in range(self.num_experts))
        self.up_projs = nn.ModuleList(nn.Linear(self.hidden_size, size, bias=False) for _ in range(self.num_experts))
        self.down_projs = nn.ModuleList(nn.Linear(size, self.hidden_size, bias=False) for _ in range(self.num_experts))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        import torch

        # the router hands every token to every expert, already scaled: [E * T, H], expert-major
        tokens = hidden_states.view(self.num_experts, -1, self.hidden_size)
        out = [self.down_projs[e](self.up_projs[e](tokens[e]) * self.act_fn(self.gate_projs[e](tokens[e])))
               for e in range(self.num_experts)]  # fmt: skip
        return torch.stack(out).view(-1, self.hidden_size)


@contextlib.contextmanager
def linear_experts(config):
    """While a Llama 4 model is built (from_pretrained): its MoE blocks get LinearizedExperts."""
    from transformers.models.llama4 import modeling_llama4

    moe = modeling_llama4.Llama4TextMoe
    original = moe.__init__

    def init(self, text_config):
        original(self, text_config)
        self.experts = LinearizedExperts(text_config)

    moe.__init__ = init
    try:
        yield
    finally:
        moe.__init__ = original


def applies(recipe, config) -> bool:
    return bool(recipe.llama4_linearized_experts) and getattr(config, "model_type", None) in LLAMA4


def _checkpoint_keys(folder: Path):
    """(file, key) of every tensor a model folder's safetensors files hold (headers only, no tensor is read)."""
    from safetensors import safe_open

    from llmtune.train.model.shards import _weight_files

    for path in _weight_files(folder) if folder.is_dir() else []:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as handle:
                yield from ((path, key) for key in handle.keys())


def _fused_keys(folder: Path) -> dict[tuple[int, str], tuple[Path, str]]:
    """(layer, 'gate_up_proj' | 'down_proj') -> (file, key) of a fused checkpoint's expert tensors."""
    found = {}
    for path, key in _checkpoint_keys(folder):
        match = FUSED.fullmatch(key)
        if match:
            found[(int(match.group(1)), match.group(2))] = (path, key)
    return found


def fill_from_fused(model, source: str, revision: str | None, quantized: bool, log) -> int:
    """Split a fused checkpoint's expert tensors into the linear weights; the number of layers filled (0: the
    checkpoint was already linearized)."""
    import torch
    from safetensors import safe_open

    from llmtune.train.model.shards import base_folder

    folder = base_folder(source, revision)
    fused = _fused_keys(folder)
    if not fused:
        return 0
    if quantized:
        raise UserError(f"llama4_linearized_experts with a 4/8-bit load needs a linearized checkpoint; {source} keeps "
                        "its experts fused (gate_up_proj), and bitsandbytes quantizes while it loads",
                        "use a linearized checkpoint (experts.gate_projs.N.weight), or load in 16 bits (adapter: "
                        "lora)")  # fmt: skip
    layers = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearizedExperts):
            continue
        index = int(re.search(r"layers\.(\d+)\.", name).group(1))
        if (index, "gate_up_proj") not in fused or (index, "down_proj") not in fused:
            raise UserError(f"{source}: layer {index}'s experts are neither fused nor linearized in the checkpoint",
                            "the checkpoint is incomplete")  # fmt: skip
        tensors = {}
        for kind in ("gate_up_proj", "down_proj"):
            path, key = fused[(index, kind)]
            with safe_open(str(path), framework="pt") as handle:
                tensors[kind] = handle.get_tensor(key)
        gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]  # [E, H, 2I], [E, I, H]
        size = gate_up.shape[-1] // 2
        with torch.no_grad():
            for e in range(module.num_experts):
                for linear, weight in ((module.gate_projs[e], gate_up[e, :, :size]),
                                       (module.up_projs[e], gate_up[e, :, size:]), (module.down_projs[e], down[e])):  # fmt: skip
                    if linear.weight.is_meta:  # a rank that loads on the meta device (rank 0 broadcasts)
                        continue
                    if hasattr(linear.weight, "ds_id"):
                        raise UserError("llama4_linearized_experts from a fused checkpoint under DeepSpeed ZeRO-3 "
                                        "is not supported (the weights are partitioned as they load)",
                                        "use a linearized checkpoint, or fsdp")  # fmt: skip
                    linear.weight.copy_(weight.t().to(linear.weight.dtype))
        layers += 1
    log(f"llama4_linearized_experts: split the fused experts of {layers} layers into per-expert linear layers")
    return layers


LINEAR = re.compile(r"(.+\.experts)\.(gate|up|down)_projs\.(\d+)\.weight")


def saved_linear(folder: Path) -> bool:
    """Whether a model folder holds experts in the linear layout (a full fine-tune with llama4_linearized_experts)."""
    return any(LINEAR.fullmatch(key) for _, key in _checkpoint_keys(folder))


class FusedExperts:
    """In front of a ShardWriter: linear-layout expert weights are written back in transformers' fused layout
    (gate_up_proj [E, H, 2I], down_proj [E, I, H]), so a merged model loads with plain transformers."""

    def __init__(self, writer, num_experts: int) -> None:
        self.writer, self.num_experts, self.pending = writer, num_experts, {}

    def add(self, name: str, tensor) -> None:
        match = LINEAR.fullmatch(name)
        if not match:
            self.writer.add(name, tensor)
            return
        parts = self.pending.setdefault(match.group(1), {})
        parts[(match.group(2), int(match.group(3)))] = tensor
        if len(parts) == 3 * self.num_experts:
            self._write(match.group(1), self.pending.pop(match.group(1)))

    def _write(self, prefix: str, parts: dict) -> None:
        import torch

        experts = range(self.num_experts)
        gate_up = torch.stack([torch.cat([parts[("gate", e)].t(), parts[("up", e)].t()], dim=-1) for e in experts])
        self.writer.add(f"{prefix}.gate_up_proj", gate_up.contiguous())
        self.writer.add(f"{prefix}.down_proj", torch.stack([parts[("down", e)].t() for e in experts]).contiguous())

    def check(self) -> None:
        if self.pending:
            prefix, parts = next(iter(self.pending.items()))
            raise UserError(f"{prefix} has {len(parts)} of its {3 * self.num_experts} linear expert weights",
                            "the checkpoint is incomplete")  # fmt: skip


def from_pretrained(auto_class, model_dir: str, recipe, **kwargs):
    """auto_class.from_pretrained, in the linear layout when the recipe trained an adapter on it, or the folder
    holds a linear-layout full fine-tune (infer, eval)."""
    asked = recipe is not None and recipe.llama4_linearized_experts
    if not asked and not saved_linear(Path(model_dir)):
        return auto_class.from_pretrained(model_dir, **kwargs)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=kwargs.get("trust_remote_code", False))
    if getattr(config, "model_type", None) not in LLAMA4:
        return auto_class.from_pretrained(model_dir, **kwargs)
    with linear_experts(config):
        model = auto_class.from_pretrained(model_dir, **kwargs)
    fill_from_fused(model, model_dir, None, False, lambda _line: None)
    return model
