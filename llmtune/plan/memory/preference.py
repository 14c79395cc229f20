"""Preference training (`rl:`) in the memory estimate: what TRL 1.16's trainers hold beyond supervised fine-tuning.

- The reference model (DPO, IPO, KTO). With an adapter it is the base with the adapter disabled (no second copy);
  with precompute_ref_log_probs its log-probs are computed before training and no reference is kept; ORPO and
  SimPO have none. Otherwise it is a frozen copy of the model: no gradients, no optimizer states, placed like the
  parameters by the row's strategy (TRL's prepare_deepspeed keeps ZeRO-3 and its parameter offload and runs any
  other stage as stage 0; prepare_fsdp shards it as the policy is sharded). Sharded, its layers are gathered one at a
  time for its forward and released after it (no backward reuses them): the row's gathered buffer covers them.
- The batches: chosen and rejected run through the model together, 2 x micro_batch_size sequences per forward.
- The loss: DPO, IPO and KTO score tokens with TRL's fused LM head (trl.trainer.utils.add_fused_lm_head: log-probs
  in tiles, never the tokens x vocab logits); ORPO's and CPO's (SimPO's) trainers take the model's full logits.
The reference's own forward runs under no_grad: none of its activations are kept for backward.
"""

from __future__ import annotations

from dataclasses import replace

from llmtune.plan.memory.facts import ModelFacts
from llmtune.recipe.preference import WITH_REFERENCE

NAMES = {"dpo": "DPO", "ipo": "IPO", "orpo": "ORPO", "kto": "KTO", "simpo": "SimPO", "grpo": "GRPO", "gdpo": "GDPO"}
ONLINE = ("grpo", "gdpo")
DEVICE = {"cpu": "CPU", "nvme": "NVMe"}
FUSED_HEAD = ("dpo", "ipo", "kto")  # TRL 1.16's DPOTrainer and KTOTrainer call the model with fused_lm_head=True


def method(recipe) -> str | None:
    return getattr(recipe, "rl", None) or None


def no_reference(recipe) -> str | None:
    """Why a preference recipe keeps no reference model in memory while training; None when it keeps one (or
    trains without `rl:`)."""
    rl = method(recipe)
    if rl is None:
        return None
    if rl in ONLINE:  # TRL's GRPO keeps a reference only for its KL term (beta > 0; TRL's default beta is 0)
        beta = (recipe.trl or {}).get("beta", recipe.rl_beta)
        if not beta:
            return "none: beta 0, no KL term (TRL's default)"
        if recipe.adapter and not recipe.lora_model_dir:  # (from lora_model_dir: a frozen copy of that adapter)
            return "none: the base model with the adapter disabled is the reference"
        return None
    if rl not in WITH_REFERENCE:
        return f"none: {NAMES[rl]} is reference-free"
    if recipe.adapter and not recipe.lora_model_dir:
        return "none: the base model with the adapter disabled is the reference"
    if recipe.precompute_ref_log_probs and not recipe.adapter:
        return "none: its log-probs are precomputed before training (precompute_ref_log_probs)"
    return None


def reference_bytes(recipe, facts: ModelFacts, mixed: bool, trainable: int) -> float:
    """One whole reference model: every parameter in the training precision (16 bits under bf16/fp16, fp32
    without), frozen, so nothing else. An adapter loaded from lora_model_dir is its own reference: TRL copies it
    into a frozen 'ref' adapter on the same base (fp32, as llmtune's adapters are), precomputed log-probs or not."""
    if method(recipe) is None or no_reference(recipe):
        return 0.0
    if recipe.adapter:
        return 4.0 * trainable
    return (2.0 if mixed else 4.0) * facts.total_params()


def placement(row: str, n: int, per_machine: int) -> tuple[float, str, str]:
    """(share of the whole reference each GPU's process holds, where that share lives, how to say it) under one
    strategy row. Offloaded ZeRO-3 keeps the reference's shard where it keeps the policy's parameters."""
    ranks = {"ZeRO-3": n, "FSDP full shard": n, "FSDP hybrid shard": per_machine, "FSDP shard grad op": n,
             "ZeRO-3 + CPU offload": n, "ZeRO-3 + NVMe offload": n}.get(row, 1)  # fmt: skip
    if ranks == 1:  # DDP, and ZeRO-1/2 (TRL runs their reference as a ZeRO stage-0 engine), or one rank
        where = {"ZeRO-3 + CPU offload": "cpu", "ZeRO-3 + NVMe offload": "nvme"}.get(row, "gpu")
        return 1.0, where, "whole on each GPU" if where == "gpu" else f"offloaded to {DEVICE[where]}"
    if row in ("ZeRO-3 + CPU offload", "ZeRO-3 + NVMe offload"):
        where = "cpu" if "CPU" in row else "nvme"
        return 1 / ranks, where, f"its 1/{ranks} shard offloaded to {DEVICE[where]}"
    if row == "FSDP shard grad op":
        # reshard_after_forward off: FSDP2's reshard() returns early after a forward, and the reference never runs
        # the backward that would reshard it, so its gathered parameters stay beside its shard
        return 1 + 1 / ranks, "gpu", f"a 1/{ranks} shard, gathered whole by its forward and kept"
    within = " (within each machine)" if row == "FSDP hybrid shard" else ""
    return 1 / ranks, "gpu", f"sharded 1/{ranks} per GPU{within}"


def precision_name(precision: str, mixed: bool) -> str:
    """The reference's dtype in words, from a recipe's or a plan's precision (bf16, fp16, no)."""
    if not mixed:
        return "fp32"
    return precision if precision in ("bf16", "fp16") else "16-bit"


def describe(recipe, row: str, n: int, per_machine: int, precision: str) -> str:
    """The reference model under one strategy row, in words (estimate table, plan summary); "" without `rl:`."""
    if method(recipe) is None:
        return ""
    what = "frozen fp32 copy of the lora_model_dir adapter" if recipe.adapter else f"frozen {precision} copy"
    return no_reference(recipe) or f"{what}, {placement(row, n, per_machine)[2]}"


def with_reference(rows: list, recipe, facts: ModelFacts, mixed: bool, trainable: int, n: int,
                   per_machine: int) -> list:  # fmt: skip
    """The rows with the reference's share. It is allocated from one step to the next (Estimate.persistent): it
    raises every phase of the step alike and leaves the allocator's reserve as it was."""
    whole = reference_bytes(recipe, facts, mixed, trainable)
    precision = precision_name(recipe.precision, mixed)
    done = []
    for row in rows:
        share, where, _ = placement(row.name, n, per_machine)
        held = whole * share
        # the offloaded rows count CPU and NVMe per machine, as they count the policy's states
        cpu = held * per_machine if where == "cpu" else 0.0
        nvme = held * per_machine if where == "nvme" else 0.0
        done.append(replace(row, reference=held if where == "gpu" else 0.0, cpu=row.cpu + cpu, nvme=row.nvme + nvme,
                            reference_where=describe(recipe, row.name, n, per_machine, precision)))  # fmt: skip
    return done


def forward_recipe(recipe):
    """The recipe as its forward sees it: DPO, IPO, ORPO and SimPO concatenate chosen and rejected into one batch of
    2 x micro_batch_size sequences. KTO's policy runs micro_batch_size completions with gradients and a KL batch of
    as many mismatched completions under no_grad; counted as 2x too, which overstates KTO's saved activations (the KL
    batch keeps none) and so errs on the side of not fitting."""
    if method(recipe) is None or method(recipe) in ONLINE:  # GRPO: one completion per sequence
        return recipe
    return recipe.model_copy(update={"micro_batch_size": 2 * recipe.micro_batch_size})


def loss_kernel(recipe, kernels):
    """The loss as TRL's trainer computes it: DPO, IPO and KTO through the fused LM head (what the estimate calls the
    fused loss: tiles of logits, an fp32 gradient for the hidden states and, training the head, for its weight);
    ORPO and SimPO from the model's full logits, whatever Liger kernel the recipe asks for (their trainers call the
    model without labels, so no fused loss runs)."""
    rl = method(recipe)
    if rl is None:
        return kernels
    return replace(kernels, loss="fused" if rl in FUSED_HEAD else "torch")


def batch_note(recipe) -> str:
    """One line for `llmtune estimate` and `llmtune plan`: what a preference step runs through the model."""
    rl = method(recipe)
    if rl is None:
        return ""
    micro = recipe.micro_batch_size
    if rl in ONLINE:
        from llmtune.recipe.online import generation_mode, trl_value

        generations = trl_value(recipe, "num_generations", 8)
        return (f"{NAMES[rl]} generates {generations} completions per prompt (up to "
                f"{trl_value(recipe, 'max_completion_length', 512)} tokens, {generation_mode(recipe)}), then trains "
                f"{micro} prompt+completion sequences per forward with the model's full logits")  # fmt: skip
    if rl == "kto":
        pairs = f"{micro} completions with gradients plus a KL batch of {micro} (counted as 2 x {micro} sequences)"
    else:
        pairs = f"chosen and rejected together, 2 x {micro} sequences per forward"
    head = "TRL's fused LM head (no tokens x vocab logits)" if rl in FUSED_HEAD else "the model's full logits"
    return f"{NAMES[rl]} runs {pairs}; log-probs from {head}"
