"""How a micro-batch is laid out, and which attention kernel reads it: pure and torch-free, so the schema, the plan
(`llmtune plan` shows it) and the worker (which applies it) decide alike.

Padding-free (the default wherever it can run): a micro-batch is its rows concatenated into one sequence, positions
restarting at each row (each packed example), with the rows' cumulative lengths (`cu_seq_lens`) and the longest
row computed by the collator on the host. No pad token is computed and no attention mask is built (transformers
builds a 4D mask with a host sync for padded and packed rows alike, and SDPA then runs its masked kernel over the
whole L x L). The kernel that reads the rows apart:

- flash-attn 2's varlen kernel, when the recipe asks for flash_attention_2 and it imports (bf16/fp16 on CUDA);
- otherwise torch's own varlen attention (`torch.nn.attention.varlen.varlen_attn`, FlashAttention inside torch),
  bf16/fp16 on CUDA;
- elsewhere (the CPU rehearsal, fp32) exact attention per row with SDPA: the same maths, row by row; also where the
  model drops attention weights in training (its config's attention_dropout), which torch's varlen_attn can't do.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtune.errors import UserError

PADDING_FREE = "padding-free"
PADDED = "padded"
# context parallelism under DeepSpeed (Ulysses): padded rows with position_ids and no mask, split along the sequence
SEQUENCE_SPLIT = "sequence-split"
# The attention implementation llmtune registers with transformers for padding-free batches (train/model/varlen.py).
VARLEN_ATTENTION = "llmtune_varlen"
# A model config's attention dropout, as transformers names it (Llama and most decoders; GPT-2's family).
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop")
KERNELS = {
    "flash_attn": "flash-attn 2 varlen kernel (attn_implementation flash_attention_2)",
    "torch_varlen": "torch's varlen_attn (FlashAttention in torch, causal window)",
    "sdpa_per_row": "exact SDPA per row",
}


@dataclass
class Batches:
    """The plan's batch layout and kernel, with the reason when padded rows were chosen."""

    layout: str  # PADDING_FREE or PADDED
    kernel: str | None = None  # a key of KERNELS for padding-free batches
    attention: str | None = None  # attn_implementation the worker sets (VARLEN_ATTENTION or flash_attention_2)
    reason: str = ""  # why this kernel, or why padded rows

    @property
    def padding_free(self) -> bool:
        return self.layout == PADDING_FREE

    def describe(self) -> str:
        if self.layout == SEQUENCE_SPLIT:
            return ("rows padded to a multiple of the context-parallel size, with position_ids and no mask, each split "
                    "along the sequence by DeepSpeed's Ulysses; attention: "
                    + (f"{KERNELS[self.kernel]}, per example (the boundaries read from position_ids) ({self.reason})"
                       if self.kernel else self.reason))  # fmt: skip
        if not self.padding_free:
            return f"padded rows: an attention mask, or position_ids restarting per example when packed ({self.reason})"
        return f"padding-free (rows concatenated, no pad tokens, no mask); attention: {KERNELS[self.kernel]}" + (
            f" ({self.reason})" if self.reason else ""
        )

    def to_dict(self) -> dict:
        return {"layout": self.layout, "kernel": self.kernel, "attention": self.attention, "reason": self.reason,
                "summary": self.describe()}  # fmt: skip


def _why_padded(recipe, strategy: str | None, mesh: dict | None) -> str | None:
    """The reason this plan can't take padding-free batches, or None when it can."""
    mesh = mesh or {}
    if recipe.batch_flattening is False:
        return "batch_flattening: false"
    if strategy == "pipeline" or recipe.pipeline_parallel_size > 1:
        return "pipeline stages pass fixed-shape activations between them"
    if mesh.get("context_parallel", 1) > 1 or recipe.context_parallel_size > 1:
        return "context parallelism splits each row across ranks in equal chunks"
    if recipe.rl:
        return f"rl: {recipe.rl}: TRL's trainer pads its batches itself"
    if recipe.reward_model or recipe.process_reward_model:
        return "a reward model scores each sequence from its own last token"
    if recipe.neftune_noise_alpha:
        return "neftune_noise_alpha scales its noise by each row's length, which a flattened batch hides"
    if recipe.attn_implementation in ("eager", "flex_attention"):
        return f"attn_implementation: {recipe.attn_implementation} has no varlen path"
    return None


def resolve_batches(recipe, device: str, precision: str, strategy: str | None, flash_installed: bool,
                    varlen_available: bool = True, mesh: dict | None = None) -> Batches:  # fmt: skip
    """Padding-free batches and their kernel where they can run; padded rows (and why) elsewhere. A recipe that says
    batch_flattening: true where it can't run is refused in one line."""
    half = precision in ("bf16", "fp16")
    if recipe.context_parallel_size > 1 and recipe.deepspeed is not None:
        if recipe.batch_flattening is True:
            raise UserError("batch_flattening: true can't run with context parallelism: DeepSpeed's Ulysses splits "
                            "every row of the batch along the sequence", "remove batch_flattening")  # fmt: skip
        kernel = "torch_varlen" if device == "cuda" and half and varlen_available else "sdpa_per_row"
        why = ("Ulysses drops the attention mask, so the attention finds packed examples and padding from "
               "position_ids")  # fmt: skip
        return Batches(SEQUENCE_SPLIT, kernel, VARLEN_ATTENTION, why)
    why = _why_padded(recipe, strategy, mesh)
    if why:
        if recipe.batch_flattening is True:
            raise UserError(f"batch_flattening: true can't run here: {why}",
                            "remove batch_flattening (llmtune then pads these batches)")  # fmt: skip
        return Batches(PADDED, reason=why)
    if device == "cuda" and half and recipe.attn_implementation == "flash_attention_2" and flash_installed:
        return Batches(PADDING_FREE, "flash_attn", "flash_attention_2")
    if device == "cuda" and half and varlen_available:
        return Batches(PADDING_FREE, "torch_varlen", VARLEN_ATTENTION)
    if device != "cuda":
        reason = "CPU rehearsal: torch's varlen kernel runs on CUDA only"
    elif not half:
        reason = f"the varlen kernels need bf16 or fp16, and this run's precision is {precision}"
    else:
        reason = "this torch has no torch.nn.attention.varlen (torch >= 2.10 does)"
    return Batches(PADDING_FREE, "sdpa_per_row", VARLEN_ATTENTION, reason)


def attention_dropout(config: dict) -> float:
    """The attention dropout a model config (config.json's mapping, or a loaded config's to_dict()) applies in
    training, its text_config's included; 0.0 where it sets none."""
    for part in (config, config.get("text_config")):
        for key in ATTENTION_DROPOUT_KEYS if isinstance(part, dict) else ():
            value = part.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                return float(value)
    return 0.0


def with_attention_dropout(batches: Batches, dropout: float) -> Batches:
    """torch's varlen_attn takes no dropout: a model that drops attention weights in training attends per row with
    SDPA instead (train/model/varlen.py), so the plan and the ranks' `batches:` line name that kernel, and why."""
    if batches.kernel != "torch_varlen" or not dropout:
        return batches
    why = f"the model's attention dropout is {dropout:g} in training, and torch's varlen_attn has no dropout"
    return Batches(batches.layout, "sdpa_per_row", batches.attention, f"{batches.reason}; {why}" if batches.reason
                   else why)  # fmt: skip
