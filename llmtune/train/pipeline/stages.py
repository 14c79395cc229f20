"""The model cut into pipeline stages, generically for Hugging Face decoder-only LMs: input embeddings -> decoder
layers -> final norm -> output head, found from the model's structure; each stage a module of its layers, with the
block-causal mask packed rows need; the (data-parallel x stage) grid of ranks and its process groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmtune.errors import UserError
from llmtune.train.runtime import collectives

NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_layer_norm")


@dataclass
class Parts:
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    rotary: nn.Module | None


def find_parts(model) -> Parts:
    """The pieces of a decoder-only LM, found from its structure rather than a table of model names."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    lists = [m for m in base.children() if isinstance(m, nn.ModuleList)] if base is not None else []
    norm = next((getattr(base, n) for n in NORM_NAMES if base is not None and hasattr(base, n)), None)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not lists or norm is None or embed is None or head is None:
        raise UserError(
            f"pipeline parallelism can't split {type(model).__name__}: it needs input embeddings, a list of decoder "
            "layers, a final norm and an output head",
            "use deepspeed zero3 or fsdp for this model",
        )
    return Parts(embed, max(lists, key=len), norm, head, getattr(base, "rotary_emb", None))


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, L, L]: causal, and no attention across packed examples (positions restart at 0)."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    document = starts.cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)  # on the stage's device, as the mask
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class Stage(nn.Module):
    def __init__(self, parts: Parts, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = parts.embed if first else None
        self.layers = nn.ModuleList(parts.layers[i] for i in layers)
        self.norm = parts.norm if last else None
        self.head = parts.head if last else None
        self.rotary = parts.rotary

    autocast_dtype: torch.dtype | None = None  # bf16 mixed precision on GPUs, as the Trainer's autocast does

    def forward(self, hidden, position_ids):
        if self.autocast_dtype is None:
            return self._forward(hidden, position_ids)
        with torch.autocast(hidden.device.type, dtype=self.autocast_dtype):
            return self._forward(hidden, position_ids)

    def _forward(self, hidden, position_ids):
        if self.embed is not None:
            hidden = self.embed(hidden)
        mask = block_causal_mask(position_ids, hidden.dtype)
        rotary = self.rotary(hidden, position_ids) if self.rotary is not None else None
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.head is not None:
            return self.head(self.norm(hidden))
        return hidden, position_ids


@dataclass
class Grid:
    stages: int
    replicas: int
    stage: int
    replica: int
    pp_group: object
    dp_group: object
    tie_group: object | None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def make_grid(stages: int, tied: bool) -> Grid:
    """Rank r is stage r % stages of replica r // stages. Every rank creates every group, as torch requires."""
    world, rank = collectives.world_size(), collectives.rank()
    replicas = world // stages
    pp_group = dp_group = tie_group = None
    for replica in range(replicas):
        ranks = list(range(replica * stages, (replica + 1) * stages))
        group = collectives.new_group(ranks)
        if rank in ranks:
            pp_group = group
        if tied and stages > 1:
            group = collectives.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                tie_group = group
    for stage in range(stages):
        ranks = list(range(stage, world, stages))
        group = collectives.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return Grid(stages, replicas, rank % stages, rank // stages, pp_group, dp_group, tie_group)


def owned_names(model, stage: Stage) -> dict[str, nn.Parameter]:
    """Full HF names of the parameters this stage holds (for saving under the model's own names)."""
    mine = {id(p) for p in stage.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in mine}
