"""Optimizer and schedule names Axolotl or transformers take that llmtune doesn't run: each refused in one line
that says why and what to use instead. A name nobody takes gets a did-you-mean."""

from __future__ import annotations

from llmtune.errors import did_you_mean

# name: (what it is, and why llmtune doesn't run it; what to use instead)
OTHER_OPTIMIZERS = {
    "adamw_hf": ("transformers' own AdamW, removed in transformers 5", "adamw_torch"),
    "adamw_apex_fused": ("NVIDIA apex's fused AdamW, which transformers 5 no longer offers", "adamw_torch_fused"),
    "adamw_torch_xla": ("AdamW on TPUs, which llmtune doesn't train on", "adamw_torch"),
    "adamw_torch_npu_fused": ("AdamW on Ascend NPUs, which llmtune doesn't train on", "adamw_torch"),
    "adamw_anyprecision": ("torchdistx's AdamW, a package llmtune doesn't install or check for", "adamw_torch"),
    **{
        name: ("transformers' schedule-free optimizer, from the schedulefree package, which llmtune doesn't install or "
               "check for; its own warm-up and train/eval modes aren't tested with llmtune's trainer", "adamw_torch")
        for name in ("schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd")
    },
    **{
        name: ("transformers' GaLore, which needs optim_target_modules, Axolotl's key that llmtune doesn't take, "
               "and the galore-torch package", "adamw_torch, or adapter: lora for a low-rank update")
        for name in ("galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
                     "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise")
    },
    **{
        name: ("transformers' APOLLO, which needs optim_target_modules, Axolotl's key that llmtune doesn't take, "
               "and the apollo-torch package", "adamw_torch")
        for name in ("apollo_adamw", "apollo_adamw_layerwise")
    },
    **{
        name: ("LOMO, which fuses the update into the backward pass and needs the lomo-optim package; llmtune's "
               "trainer doesn't run it", "adamw_torch, or adafactor for less optimizer memory")
        for name in ("lomo", "adalomo")
    },
    "grokadamw": ("transformers' GrokAdamW, from the grokadamw package, which llmtune doesn't install or check for",
                  "adamw_torch"),
    "stable_adamw": ("transformers' StableAdamW, from the torch-optimi package, which llmtune doesn't install or "
                     "check for", "adamw_torch"),
    **{
        name: ("bitsandbytes' RMSprop, which llmtune doesn't offer", "rmsprop (or adamw_bnb_8bit for 8-bit states)")
        for name in ("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
    },
}  # fmt: skip

OTHER_SCHEDULERS = {
    "rex": ("Axolotl's own REX schedule", "cosine, or linear"),
    "one_cycle": ("Axolotl's own one-cycle schedule, torch's OneCycleLR", "cosine (with warmup_ratio)"),
    "log_sweep": ("Axolotl's learning-rate sweep from log_sweep_min_lr to log_sweep_max_lr", "cosine; for a sweep, "
                  "run one recipe per learning_rate"),
    "reduce_lr_on_plateau": ("transformers' schedule that steps on the evaluation loss; llmtune's schedules step "
                             "per optimizer step, and its warm-up and floor don't apply to it", "cosine"),
    "cosine_warmup_with_min_lr": ("transformers' other name of a floored cosine", "cosine_with_min_lr (warm-up "
                                  "from warmup_steps or warmup_ratio, the floor from cosine_min_lr_ratio)"),
    "greedy": ("transformers' greedy schedule, which steps on the evaluation loss", "cosine"),
}  # fmt: skip


def check_choice(value, key: str, supported: tuple, others: dict) -> None:
    """ValueError for a name in `others` (why, and what to use) or an unknown name (with a did-you-mean); nothing for
    a supported name or a value that isn't a string (pydantic says what it wanted)."""
    if not isinstance(value, str) or value in supported:
        return
    if value in others:
        why, instead = others[value]
        raise ValueError(f"'{value}' ({why}) is not supported; use {instead}")
    guess = did_you_mean(value, [*supported, *others])
    raise ValueError(f"'{value}' is not a name llmtune knows for {key}; use one of {', '.join(supported)}"
                     + (f" (did you mean '{guess}'?)" if guess else ""))  # fmt: skip
