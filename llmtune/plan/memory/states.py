"""The model states, by the ZeRO paper's accounting: parameters, gradients and optimizer states per parameter, the
trainable share (full or LoRA), a k-bit base as bitsandbytes stores it. One full copy; the strategies'
partitioning of it is the peak's (peak.py).

Model states with mixed-precision Adam take (2 + 2 + K)·Ψ bytes, K = 12 (fp32 master weights, momentum,
variance)."""

from __future__ import annotations

from dataclasses import dataclass

from llmtune.plan.memory.facts import ModelFacts

EIGHT_BIT = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit")


@dataclass(frozen=True)
class Bytes:
    """Bytes per parameter for one copy of the model states."""

    params: float
    grads: float
    optimizer: float  # K in the ZeRO paper


def state_bytes(optimizer: str, mixed: bool, master: bool | None = None) -> Bytes:
    """Bytes per parameter. Master weights: fp32 copies kept by the optimizer under mixed precision, and
    by DeepSpeed's ZeRO optimizers always (they clone their fp32 partition even when training in fp32)."""
    master = (4.0 if mixed else 0.0) if master is None else (4.0 if master else 0.0)
    moments = {"sgd": 0.0, "adafactor": 0.1, "lion_32bit": 4.0, "paged_lion_32bit": 4.0}.get(optimizer, 8.0)
    if optimizer in EIGHT_BIT:
        moments = 1.0 if "lion" in optimizer else 2.0
    width = 2.0 if mixed else 4.0
    return Bytes(width, width, master + moments)


def lora_parameters(
    facts: ModelFacts,
    rank: int,
    targets: list[str] | str | None,
    parameters: list[str] | None = None,
    layers: list[int] | None = None,
) -> int:
    """Adapter parameters: r·(in + out) per adapted linear layer; a mixture of experts' routed experts as peft adapts
    them (memory/experts.py: fused 3D tensors in transformers 5, reached in some families only; each expert's linear
    layers in transformers 4); `parameters`: lora_target_parameters. `targets`: "all-linear", names, or both (a list
    holding "all-linear": lora_target_linear with modules listed beside it); the input embedding and the output
    head adapt when named (r·(vocab + hidden) each). `layers`: peft_layers_to_transform, which peft applies to the
    names it matches by suffix: the decoder layers' and the embedding's (in no layer: left out), not the top-level
    head's."""
    from llmtune.plan.memory.experts import fused_expert_lora, peft_maps_experts
    from llmtune.plan.memory.facts import embedding_modules_of

    h, kv, q = facts.hidden_size, facts.num_kv_heads * facts.head_dim, facts.num_heads * facts.head_dim
    named = set(targets) if isinstance(targets, list) else set()
    chosen = None if targets is None or isinstance(targets, str) or "all-linear" in named else named
    embedding, head = embedding_modules_of(facts.model_type)
    outside = rank * (facts.vocab_size + h) * ((head in named) + (embedding in named and not layers))

    def adapted(shapes: dict, copies: int = 1) -> int:
        return copies * sum(rank * (a + b) for name, (a, b) in shapes.items() if chosen is None or name in chosen)

    def mlp(width: int) -> dict:
        if not width:  # no shared expert
            return {}
        gate = {"gate_proj": (h, width)} if facts.mlp_matrices == 3 or width != facts.intermediate_size else {}
        return {**gate, "up_proj": (h, width), "down_proj": (width, h)}

    attention = adapted({"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)})
    dense = facts.num_layers - facts.moe_layers
    mapped = peft_maps_experts(facts.model_type) if facts.num_experts else None
    if mapped is None:  # experts as linear layers
        experts = adapted(mlp(facts.expert_intermediate_size), facts.num_experts)
    else:
        width = facts.expert_intermediate_size
        experts = facts.num_experts * fused_expert_lora(h, width, rank, chosen, parameters or [], mapped)
    router = adapted({"gate": (h, facts.num_experts)}) if mapped is not False else 0  # where peft maps it too
    shared_gate = adapted({"shared_expert_gate": (h, 1)}) if facts.shared_expert_gate else 0
    moe = experts + router + adapted(mlp(facts.shared_intermediate_size)) + shared_gate
    every = facts.num_layers * attention + dense * adapted(mlp(facts.intermediate_size)) + facts.moe_layers * moe
    if layers:  # a mixture of experts' dense and sparse layers counted at their share
        every = every * len({i for i in layers if 0 <= i < facts.num_layers}) // facts.num_layers
    return every + outside


def trainable_parameters(recipe, facts: ModelFacts) -> int:
    if not recipe.adapter:
        from llmtune.plan.memory.unfrozen import unfrozen_share

        share = unfrozen_share(recipe)  # a full fine-tune's unfrozen_parameters: the rest is frozen
        return facts.total_params() if share is None else round(share * facts.total_params())
    targets, listed = recipe.lora_target_modules, recipe.lora_target_modules
    if recipe.lora_target_linear:  # with modules listed beside it, Axolotl's union (train/model/targets.py)
        listed = [listed] if isinstance(listed, str) else list(listed or [])
        targets = ["all-linear", *listed] if listed else "all-linear"
    from llmtune.plan.memory.facts import embedding_modules_of

    # lora_modules_to_save: peft trains a whole copy of each (the input embedding and the output head, in practice)
    saved = set(recipe.lora_modules_to_save or [])
    whole = facts.embedding_params() * len(saved & set(embedding_modules_of(facts.model_type)))
    return whole + lora_parameters(facts, recipe.lora_r, targets, recipe.lora_target_parameters,
                                   recipe.peft_layers_to_transform)  # fmt: skip


NF4_BLOCK = 64  # bitsandbytes' default blocksize for 4-bit weights: one absmax per 64 weights

NESTED_BLOCK = 256  # double quantization: the absmaxes in 8 bits, one fp32 absmax per 256 of them

GPTQ_GROUP = 128


def quantized_base_bytes(recipe, facts: ModelFacts) -> float:
    """A k-bit base as bitsandbytes stores it. NF4/FP4: half a byte per weight plus one absmax per 64-weight
    block (fp32; with double quantization 8 bits, plus an fp32 absmax per 256 blocks). LLM.int8: a byte per
    weight plus an fp32 scale per output row. The modules left unquantized (embeddings, lm_head, norms) are
    made fp32 by peft's prepare_model_for_kbit_training, which llmtune calls. A mixture of experts' fused expert
    tensors are no linear layers: bitsandbytes leaves them in the compute dtype, and llmtune keeps them there."""
    experts = 0 if recipe.gptq or recipe.llama4_linearized_experts else facts.routed_expert_params()
    quantized = facts.linear_params() - experts
    if recipe.gptq:  # GPTQ's common form: 4-bit weights, an fp16 scale and a 4-bit zero point per 128 weights
        per_weight = 0.5 + (2 + 0.5) / GPTQ_GROUP
    elif recipe.load_in_4bit:
        double = recipe.bnb_4bit_use_double_quant
        absmax = (1 + 4 / NESTED_BLOCK) / NF4_BLOCK if double else 4 / NF4_BLOCK
        per_weight = 0.5 + absmax
    else:
        per_weight = 1.0 + 4 / facts.hidden_size
    from llmtune.plan.memory.compute import is_mixed

    return (
        quantized * per_weight
        + (2.0 if is_mixed(recipe) else 4.0) * experts
        + 4.0 * (facts.total_params() - quantized - experts)
    )


def _states(recipe, facts: ModelFacts, mixed: bool, deepspeed: bool) -> tuple[float, float, float]:
    """Params, grads and optimizer bytes of one full copy of the model states.

    DeepSpeed keeps 16-bit params and grads and an fp32 master copy in the optimizer (the ZeRO paper's
    layout). DDP and FSDP as llmtune runs them keep fp32 weights and grads and autocast the compute: the
    same total for every optimizer (4 + 4 + moments = 2 + 2 + 4 + moments), split differently. A k-bit base
    is counted as bitsandbytes stores it, with the modules it leaves in fp32 (gpu_memory.quantized_base_bytes).
    """
    psi = facts.total_params()
    base = state_bytes(recipe.optimizer, mixed, master=True) if deepspeed else state_bytes(recipe.optimizer, False)
    if not recipe.adapter:
        # the Trainer keeps an 8-bit bitsandbytes optimizer's states of nn.Embedding weights in 32 bits (its
        # GlobalOptimManager override, as bitsandbytes advises for embeddings): the input embedding's, tied or not
        wide = state_bytes("lion_32bit" if "lion" in recipe.optimizer else "adamw_torch", False, master=False)
        embedding = (wide.optimizer - state_bytes(recipe.optimizer, False, master=False).optimizer
                     if recipe.optimizer in EIGHT_BIT else 0.0) * facts.embedding_params()  # fmt: skip
        trained = trainable_parameters(recipe, facts)  # fewer under unfrozen_parameters: grads and states only
        if trained < psi:
            from llmtune.plan.memory.facts import embedding_modules_of
            from llmtune.plan.memory.unfrozen import trains_module

            embedding *= trains_module(recipe, embedding_modules_of(facts.model_type)[0])  # frozen: no states
        return base.params * psi, base.grads * trained, base.optimizer * trained + embedding
    trainable = trainable_parameters(recipe, facts)
    width = 2.0 if mixed else 4.0  # the frozen base is kept in the compute dtype
    kbit = recipe.load_in_4bit or recipe.load_in_8bit or recipe.gptq
    frozen = quantized_base_bytes(recipe, facts) if kbit else psi * width
    adapter = state_bytes(recipe.optimizer, False, master=deepspeed)  # adapters train in fp32
    return frozen + adapter.params * trainable, adapter.grads * trainable, adapter.optimizer * trainable


def quantization_state_bytes(recipe, facts: ModelFacts) -> float:
    """The absmax blocks of a 4-bit base (part of quantized_base_bytes). They are attributes beside the packed
    weights, not parameters: ZeRO-3 and FSDP shard the packed weights (stored in the compute dtype) and leave
    these whole on every rank."""
    if not recipe.load_in_4bit:
        return 0.0
    double = recipe.bnb_4bit_use_double_quant
    return facts.linear_params() * ((1 + 4 / NESTED_BLOCK) / NF4_BLOCK if double else 4 / NF4_BLOCK)
