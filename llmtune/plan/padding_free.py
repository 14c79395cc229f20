"""Whether a model's attention can read padding-free batches, decided at plan time from its config.json and
transformers' modelling source on this machine, as text (nothing is imported: the plan stays quick), so that the
plan promises the layout the ranks will run. The ranks check again on the loaded model
(train/model/varlen.unsupported), with the same rules on the classes themselves.

Where the config or the source isn't on this machine (a hub id not yet downloaded, remote code), nothing is known
here and the plan keeps padding-free batches; a rank that can't run them says so in its `batches:` line.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from llmtune.plan.memory.facts import NOT_ATTENTION_ONLY

ATTENTION_CALL = re.compile(r"self\.(?:self_attn|attn|attention)\(")
SINKS = "self.sinks = nn.Parameter("
TOWERS = ("Vision", "Audio")  # a multimodal model's encoder layers: they attend over patches or frames, not the rows


def passes_boundaries(forward_source: str) -> bool:
    """Whether a decoder layer's forward hands its keyword arguments (cu_seq_lens_q, ...) on to its attention call;
    some modelling code drops them (transformers' Nemotron), so the kernel would see one sequence. True where it has
    no such call."""
    found = ATTENTION_CALL.search(forward_source)
    if found is None:
        return True
    depth, end = 0, found.end() - 1
    for end in range(found.end() - 1, len(forward_source)):
        depth += {"(": 1, ")": -1}.get(forward_source[end], 0)
        if depth == 0:
            break
    return "**" in forward_source[found.end() : end]


def _module_name(root: Path, model_type: str) -> str:
    """transformers' module folder of a model type: its own name, or where its special-names table (read as text)
    puts it (gemma3_text lives in gemma3)."""
    for table in ("auto_mappings.py", "configuration_auto.py"):
        try:
            text = (root / "models" / "auto" / table).read_text(encoding="utf-8")
        except OSError:
            continue
        start = text.find("SPECIAL_MODEL_TYPE_TO_MODULE_NAME = ")
        found = re.search(rf'\(\s*"{re.escape(model_type)}",\s*"(\w+)"\s*\)', text[start:]) if start != -1 else None
        if found:
            return found.group(1)
    return model_type.replace("-", "_")


@functools.cache
def modelling_source(model_type: str) -> str | None:
    """transformers' modeling_<module>.py for this model type, as text; None where it isn't installed here."""
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it (nor torch)
    if spec is None or not spec.origin or not re.fullmatch(r"[a-z0-9_\-]+", model_type):
        return None
    root = Path(spec.origin).parent
    module = _module_name(root, model_type)
    try:
        return (root / "models" / module / f"modeling_{module}.py").read_text(encoding="utf-8")
    except OSError:
        return None


def _class_forward(source: str, name: str) -> str | None:
    start = source.find(f"\nclass {name}(")
    if start == -1:
        return None
    end = source.find("\nclass ", start + 1)
    body = source[start : end if end != -1 else len(source)]
    forward = body.find("\n    def forward(")
    if forward == -1:
        return None
    after = body.find("\n    def ", forward + 1)
    return body[forward : after if after != -1 else len(body)]


def text_layer(name: str) -> bool:
    return not any(tower in name for tower in TOWERS)


def _layers(source: str) -> list[str]:
    """The class names of `_no_split_modules` in a modelling file that run over the text (the decoder layers)."""
    names: list[str] = []
    for found in re.finditer(r"_no_split_modules = \[([^\]]*)\]", source):
        names += re.findall(r"[\"'](\w+)[\"']", found.group(1))
    return [name for name in dict.fromkeys(names) if text_layer(name)]


def blocker(config: dict) -> str | None:
    """Why this model can't take padding-free batches, from its config.json and transformers' source; None where
    it can or where that isn't known here."""
    configs = [c for c in (config, config.get("text_config")) if isinstance(c, dict)]
    if any(c.get("attn_logit_softcapping") for c in configs):
        return "its attention soft-caps the logits (no varlen kernel here does)"
    model_type = str(config.get("model_type") or "")
    for c in configs:
        if c.get("model_type") in NOT_ATTENTION_ONLY:
            return f"{c['model_type']} mixes tokens outside attention (linear or state-space layers)"
    if not model_type or config.get("auto_map"):  # remote code: its source is the model's own
        return None
    source = modelling_source(model_type)
    if source is None:
        return None
    if "_supports_attention_backend = True" not in source:
        return f"transformers' {model_type} modelling code doesn't take its attention backends"
    for name in _layers(source):
        forward = _class_forward(source, name)
        if forward is not None and not passes_boundaries(forward):
            return f"{name} doesn't pass the batch's row boundaries on to its attention (the rows would attend to " \
                   "each other)"  # fmt: skip
    if SINKS in source:
        return f"{model_type} has attention sinks (no varlen kernel here takes them)"
    return None


MASK_FACTORIES = ("create_causal_mask(", "create_sliding_window_causal_mask(", "create_chunked_causal_mask(")


def mask_ignores_positions(source: str) -> bool:
    """Whether modelling source builds an attention mask without position_ids. transformers' mask factories keep
    packed examples apart when they get position_ids (they find the restarts there); code that builds its mask
    without passing them (OPT, BLOOM, MPT, BioGPT, XGLM, gpt-oss in transformers 5) makes one causal mask over the
    whole packed row."""
    for factory in MASK_FACTORIES:
        start = source.find(factory)
        while start != -1:
            depth, end = 0, start + len(factory) - 1
            for end in range(start + len(factory) - 1, len(source)):
                depth += {"(": 1, ")": -1}.get(source[end], 0)
                if depth == 0:
                    break
            call = source[start:end]
            if "**" in call:  # the arguments built beforehand (mask_kwargs = {...}): those of the same function
                call = source[source.rfind("\n    def ", 0, start) : end]
                passed = '"position_ids":' in call or "position_ids=position_ids" in call
            else:
                passed = "position_ids" in call
            if not passed:
                return True
            start = source.find(factory, end)
    return False


def planned_batches(recipe, batches):
    """Padded batches where the model, as read on this machine, can't take padding-free ones: the ranks would fall
    back after loading where the plan had promised them; per-row SDPA instead of torch's varlen_attn where the model
    drops attention weights in training."""
    from llmtune.errors import UserError
    from llmtune.plan.memory.facts import local_config
    from llmtune.recipe.batches import PADDED, Batches, attention_dropout, with_attention_dropout

    if not batches.padding_free and batches.kernel != "torch_varlen":
        if batches.layout == PADDED and recipe.sample_packing:  # asked for (batch_flattening: false), or on CPU
            config = local_config(recipe.base_model_config or recipe.base_model)
            free = recipe.batch_flattening is False and blocker(config) is None
            _check_packing(recipe, config, "remove batch_flattening: false (padding-free batches keep the examples "
                           "apart in this model), or set sample_packing: false" if free else "set sample_packing: false")  # fmt: skip
        return batches
    config = local_config(recipe.base_model_config or recipe.base_model)
    if batches.padding_free:
        why = blocker(config)
        if why is not None:
            if recipe.batch_flattening is True:
                raise UserError(f"batch_flattening: true can't run with this model: {why}", "remove batch_flattening")
            _check_packing(recipe, config)
            return Batches(PADDED, reason=why)
    # overrides_of_model_config is applied to the loaded config (train/model/load.py): its dropout is the one trained
    return with_attention_dropout(batches, attention_dropout({**config, **(recipe.overrides_of_model_config or {})}))


def _check_packing(recipe, config: dict, hint: str = "set sample_packing: false") -> None:
    """Packed rows on the padded path in a model whose mask ignores position_ids: refused when the run is planned,
    as the ranks refuse it after loading (train/model/kernels.batch_layout)."""
    from llmtune.errors import UserError

    model_type = str(config.get("model_type") or "")
    source = modelling_source(model_type) if recipe.sample_packing and not config.get("auto_map") else None
    if source is not None and mask_ignores_positions(source):
        raise UserError(f"sample_packing on padded rows can't run with {model_type}: transformers' modelling code "
                        "builds its attention mask without position_ids, so the examples packed into a row would "
                        "attend to each other", hint)  # fmt: skip
