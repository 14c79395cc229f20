"""`llmtune eval` on a preference run (`rl:`): rewards, margins and accuracy over eval pairs, recomputed here.

The rewards are TRL's definitions, computed independently of TRL's trainer code: DPO, IPO and KTO score a reply by
beta x (its log-probability under the trained model - under the reference), summed over the reply's tokens; ORPO
and SimPO, which have no reference, by beta x its mean per-token log-probability. A reply's tokens are what TRL
trains: prompt + reply tokenized together (an eos appended when the reply lacks it), the reply starting where that
and the prompt alone stop agreeing. The chosen reply's loss and perplexity are the SFT view of the same model.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

from llmtune.errors import UserError
from llmtune.recipe.preference import WITH_REFERENCE, beta


def reply_tokens(tokenizer, prompt: str, reply: str) -> tuple[list[int], int]:
    """(prompt + reply ids, where the reply starts), as TRL tokenizes a preference row."""
    eos = tokenizer.eos_token
    if eos and not reply.endswith(eos):
        reply = reply + eos
    prompt_ids = tokenizer(prompt)["input_ids"]
    full = tokenizer(prompt + reply)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, full, strict=False)) if a != b),
                 min(len(prompt_ids), len(full)))  # fmt: skip
    return full, start


def reply_logps(model, sequences: list[tuple[list[int], int]], pad: int, batch_size: int) -> list[tuple[float, int]]:
    """(summed log-probability of each reply's tokens, their count), right-padded batches."""
    import torch

    out = []
    for first in range(0, len(sequences), batch_size):
        chunk = sequences[first : first + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in chunk], device=model.device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in chunk], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        for row, (seq, start) in enumerate(chunk):
            picked = logps[row, start - 1 : len(seq) - 1]
            out.append((float(picked.sum()), int(picked.numel())))
    return out


def _reference_model(info, model, tokenizer):
    """The reference's context: the adapter switched off (a LoRA run), else the starting model loaded apart; None
    for a reference-free method or for the base model itself (policy == reference)."""
    recipe = info.recipe
    if recipe.rl not in WITH_REFERENCE or not info.is_run:
        return None, None
    if info.adapter_dir and not recipe.lora_model_dir:
        return model, model.disable_adapter
    from transformers import AutoModelForCausalLM

    from llmtune.post.generate import fit_embeddings, inference_device
    from llmtune.train.model.load import model_source

    device, dtype = inference_device()
    base = AutoModelForCausalLM.from_pretrained(model_source(recipe)[0], dtype=dtype,
                                                trust_remote_code=recipe.trust_remote_code)  # fmt: skip
    fit_embeddings(base, tokenizer, recipe)  # (tokens the run added: the reference reads the same ids)
    if recipe.lora_model_dir:  # trained on from that adapter: it, frozen, is the reference (as in training), for
        from peft import PeftModel  # the run's own adapter and for its merged folder alike

        base = PeftModel.from_pretrained(base, saved_reference(info))
    return base.to(device).eval(), nullcontext


def saved_reference(info) -> str:
    """The starting adapter as the run froze it (the ref/ folder peft saves beside the run's adapter), for the run
    folder, a checkpoint or a merged folder inside the run; else lora_model_dir as the recipe names it (whose
    contents may have changed since)."""
    places = [Path(info.adapter_dir)] if info.adapter_dir else []
    places += [info.result_file.parent, info.result_file.parent.parent]
    for folder in places:
        if (folder / "ref" / "adapter_config.json").is_file():
            return str(folder / "ref")
    return info.recipe.lora_model_dir


def preference_eval(info, model, tokenizer, rows: list[dict], batch_size: int) -> dict:
    recipe = info.recipe
    if not rows:
        raise UserError("no eval preference rows (val_set_size or test_datasets)", "pass --data FILE")
    b = beta(recipe)
    b = 0.1 if b is None else b  # TRL's default
    kto = recipe.rl == "kto"
    sides = ("completion",) if kto else ("chosen", "rejected")
    sequences = [reply_tokens(tokenizer, row["prompt"], row[side]) for row in rows for side in sides]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = reply_logps(model, sequences, pad, batch_size)
    reference_model, switch = _reference_model(info, model, tokenizer)
    if reference_model is not None:
        with switch():
            reference = reply_logps(reference_model, sequences, pad, batch_size)
    else:
        reference = [(0.0, n) for _, n in policy]
    if recipe.rl in WITH_REFERENCE:
        rewards = [b * (p - r) for (p, _), (r, _) in zip(policy, reference, strict=True)]
    else:  # ORPO, SimPO: the mean per-token log-probability
        rewards = [b * p / max(n, 1) for p, n in policy]
    results: dict = {"target": info.label, "method": recipe.rl, "beta": b, "examples": len(rows)}
    if kto:
        good = [r for r, row in zip(rewards, rows, strict=True) if row["label"]]
        bad = [r for r, row in zip(rewards, rows, strict=True) if not row["label"]]
        mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
        results.update({"rewards/chosen": mean(good), "rewards/rejected": mean(bad)})
        if good and bad:
            results["rewards/margins"] = mean(good) - mean(bad)
        return results
    chosen, rejected = rewards[0::2], rewards[1::2]
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    tokens = sum(n for _, n in policy[0::2])
    loss = -sum(p for p, _ in policy[0::2]) / max(tokens, 1)
    results.update({
        "rewards/chosen": sum(chosen) / len(rows), "rewards/rejected": sum(rejected) / len(rows),
        "rewards/margins": sum(margins) / len(rows), "rewards/accuracies": sum(m > 0 for m in margins) / len(rows),
        "chosen_loss": loss, "chosen_perplexity": math.exp(min(loss, 50)),
    })  # fmt: skip
    return results
