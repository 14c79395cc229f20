"""The run's final outputs: model or adapter (safetensors), tokenizer, model card, metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from llmtune.plan.files import atomic_write


def model_card(recipe, plan: dict, metrics: dict, gguf_origin: str | None) -> str:
    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(recipe.adapter or "", "full fine-tune")
    datasets = "\n".join(f"- `{d.path}` (type `{d.type or 'pretokenized'}`)" for d in recipe.datasets)
    origin = f" (from the GGUF file `{gguf_origin}`, de-quantized)" if gguf_origin else ""
    rows = "\n".join(
        f"| {k} | {_shown(k, v, metrics)} |" for k, v in metrics.items() if not isinstance(v, (dict, list))
    )
    front = {"library_name": "peft" if recipe.adapter else "transformers", "base_model": recipe.base_model,
             "tags": ["llmtune", method.lower().replace(" ", "-")]}  # fmt: skip
    return (
        f"---\n{yaml.safe_dump(front, sort_keys=False)}---\n\n"
        f"# {Path(recipe.output_dir).name}\n\n"
        f"{method} of `{recipe.base_model}`{origin} with llmtune, strategy {plan['title']} "
        f"on {plan['world_size']} process(es).\n\n## Data\n\n{datasets}\n\n"
        f"## Metrics\n\n{_covers(metrics)}| metric | value |\n| --- | --- |\n{rows}\n\n"
        "## Recipe\n\nThe resolved recipe and the launch plan are in `llmtune/` beside this card.\n"
    )


PACKED = "packed sequences"  # what rows_seen counts where sample_packing packed the examples (the marker's rows_are)


def packed_rows(metrics: dict) -> dict:
    """With sample_packing a row the Trainer draws is a packed sequence of several examples: rows_seen counts those,
    as rows_per_epoch (the packed rows of an epoch) does, so the two give the epoch; said beside them."""
    data = metrics.get("data") or {}
    if metrics.get("packing_efficiency") is None or not data.get("train_rows"):
        return {}
    return {
        "rows_per_epoch": data["train_rows"],
        "rows_are": f"{PACKED} ({data.get('train_examples')} examples packed into {data['train_rows']} per epoch)",
    }


def _shown(key: str, value, metrics: dict):
    if key in ("rows_seen", "rows_seen_this_run", "rows_per_epoch") and metrics.get("rows_are") and value is not None:
        return f"{value} {PACKED}"
    return value


def _covers(metrics: dict) -> str:
    """A resumed run: which figures cover only the launch that resumed it."""
    since = metrics.get("since_resume")
    if not since:
        return ""
    from llmtune.train.runtime.report import span_text

    named = ", ".join(f"`{key}`" for key in since["figures"])
    return (f"Resumed from `{Path(str(metrics.get('resumed_from'))).name}`: {named} cover {span_text(since['steps'])} "
            "(this launch) only; the other figures cover the whole run.\n\n")  # fmt: skip


def write_run_files(output_dir: Path, recipe, plan: dict, metrics: dict, gguf_origin: str | None) -> None:
    """metrics.json and the model card. The report (curves, summary) is drawn by the launcher once the ranks have
    left (launch.runner), off the ranks' critical path."""
    atomic_write(output_dir / "metrics.json", json.dumps(metrics, indent=2, default=str) + "\n")
    atomic_write(output_dir / "README.md", model_card(recipe, plan, metrics, gguf_origin))


def check_saved_adapter(folder: Path, model) -> None:
    """The adapter file holds a tensor for every trainable parameter. PEFT selects the adapter's tensors by module
    name, and a wrapper it doesn't know between the model and its layers (torch's checkpoint wrapper, say) makes it
    select none: the run would end "saved" with an empty adapter, and a merge would write the base model back."""
    from safetensors import safe_open

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        return
    with safe_open(str(weights), framework="pt") as saved:
        count = len(list(saved.keys()))
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if count < trainable:
        raise RuntimeError(f"the adapter saved to {weights} holds {count} tensors for {trainable} trainable "
                           "parameters: PEFT did not find the adapter's weights in the model (a bug in llmtune; "
                           "please report it with the recipe)")  # fmt: skip
