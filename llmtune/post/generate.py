"""`llmtune chat` and `llmtune infer`: generate with a run's adapter, a merged folder, any HF folder or a hub id.

Prompts go through the model's chat template when it has one (`--raw` sends them as plain text); a run trained on one
of Axolotl's instruct formats or ShareGPT conversations (and its merged folder) is prompted with the text training
wrote instead, by training's own prompter; a run whose prompts can't be written so is told it in a note.
Batched generation pads on the left, so every prompt's answer starts at the same column.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError, reading
from llmtune.post.consolidate import plan_recipe
from llmtune.post.prompts import (  # (trained_prompt_format and untrained_prompt_note are imported from here too)
    NO_SYSTEM_SLOT,
    trained_prompt,
    trained_prompt_format,
    untrained_prompt_note,
)


@dataclass
class Loaded:
    model: object
    tokenizer: object
    label: str
    prompt_format: str | None = None  # the run's trained prompt format (prompts.trained_prompt_format)
    stopped_run: str | None = None  # "checkpoint-N of run R": a run without a final save answers from its newest


def prompt_text(loaded: Loaded, row: dict, prompt, raw: bool) -> str:
    """What the model sees for one prompt: the trained prompt for a run with a trained_prompt_format (a row's own
    instruction and input kept apart), else the chat template (render)."""
    if loaded.prompt_format and not raw:
        if isinstance(prompt, list):
            return trained_prompt(loaded.tokenizer, loaded.prompt_format, prompt)
        instruct = not loaded.prompt_format.startswith("sharegpt:") and isinstance(row.get("instruction"), str)
        text, extra = (row["instruction"], str(row.get("input") or "")) if instruct else (prompt, "")
        return trained_prompt(loaded.tokenizer, loaded.prompt_format, [{"role": "user", "content": text}], extra)
    return render(loaded.tokenizer, prompt, raw)


def inference_device() -> tuple[str, object]:
    """The GPU in bf16 where there is one (fp16 on GPUs without bf16), else the CPU in fp32."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", torch.float32
    return "cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def refuse_reward_model(folder: Path, command: str) -> None:
    """A reward model (a run with reward_model / process_reward_model, or its merged folder) has no language-model
    head: commands that generate or score next tokens can't use it."""
    config_file, reward = folder / "config.json", plan_recipe(folder).get("num_labels")
    if not reward and config_file.exists():
        architectures = json.loads(config_file.read_text()).get("architectures") or []
        reward = any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures)
    if reward:
        raise UserError(f"{folder} is a reward model (a classification head, no language-model head): "
                        f"`llmtune {command}` needs a causal LM",
                        "score texts with its eval metrics (eval_accuracy in metrics.json), or load it with "
                        "AutoModelForSequenceClassification / AutoModelForTokenClassification")  # fmt: skip


def looks_like_path(name: str) -> bool:
    """Absolute, ./ or ../, ~, or more than one '/': a folder on disk, never a hub id (namespace/name)."""
    return Path(name).is_absolute() or name.startswith(("./", "../", "~")) or name in (".", "..") or name.count("/") > 1


def check_model_name(name: str, option: str) -> None:
    """Refuse a model that is not here and can't be on the hub, before anything loads or asks the hub."""
    if Path(name).exists():
        return
    hint = f"{option} takes a run's output_dir, a model or adapter folder, or a hub id (namespace/name)"
    shown = name if option == "MODEL" else f"{option} {name}"
    if looks_like_path(name):
        raise UserError(f"{shown} does not exist", hint)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise UserError(f"{shown} is not a folder here, and can't be a hub id", hint) from None


def load_for_generation(target: str, trust_remote_code: bool = False, command: str = "infer") -> Loaded:
    """A run folder (adapter on its base, or its full model), a model folder, or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_name(target, "MODEL")
    path = Path(target)
    device, dtype = inference_device()
    adapter = recipe = prompt_folder = stopped_run = None
    model_dir, tokenizer_dir, label = target, target, target
    if path.is_dir():
        from llmtune.post.consolidate import has_tokenizer, loadable_weights

        weights, prompt_folder = loadable_weights(path, command)
        refuse_reward_model(prompt_folder, command)
        plan_file = prompt_folder / "llmtune" / "plan.json"
        if weights is not None and weights.folder != path.absolute():  # the newest checkpoint, with no final save
            path, label = weights.folder, f"{weights.folder.name} of run {prompt_folder}"
            stopped_run = label
            model_dir = tokenizer_dir = str(path)
        if plan_file.exists():  # a full model loads without it; an adapter needs its base from it
            from llmtune.post.consolidate import run_recipe

            recipe = run_recipe(prompt_folder, needed=(path / "adapter_config.json").exists())
            trust_remote_code = trust_remote_code or bool(recipe and recipe.trust_remote_code)
        if (path / "adapter_config.json").exists():
            adapter = str(path)
            if recipe is not None:
                from llmtune.train.model.load import model_source

                model_dir = model_source(recipe)[0]
            else:
                with reading(path / "adapter_config.json"):
                    model_dir = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
            label = f"{label} (adapter on {model_dir})"
        elif not (path / "config.json").exists():
            raise UserError(f"{target} has no model (config.json) or adapter (adapter_config.json)",
                            "pass a run's output_dir, a merged folder, or a hub id")  # fmt: skip
        if not has_tokenizer(path):
            # saved without its tokenizer (an adapter, a checkpoint): the base model's
            from llmtune.train.model.load import model_source

            tokenizer_dir = model_source(recipe)[0] if recipe is not None and not adapter else model_dir
    elif path.suffix in (".yaml", ".yml", ".json") or path.exists():
        raise UserError(f"{target} is not a model folder", "pass a run's output_dir, a merged folder, or a hub id")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        from llmtune.train.model import linearize

        with reading(model_dir):
            model = linearize.from_pretrained(AutoModelForCausalLM, model_dir, recipe if adapter else None,
                                              dtype=dtype, trust_remote_code=trust_remote_code)  # fmt: skip
    except (OSError, ValueError) as err:
        failed = tokenizer_dir if "tokenizer" not in locals() else model_dir  # which of the two failed
        raise UserError(f"could not load '{failed}' ({str(err).splitlines()[0][:160]})",
                        "check the path or hub id, your network or HF_TOKEN") from None  # fmt: skip
    if adapter is not None:
        from peft import PeftModel

        fit_embeddings(model, tokenizer, recipe)
        with reading(adapter):
            model = PeftModel.from_pretrained(model, adapter)
    model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    prompt_format = trained_prompt_format(prompt_folder) if prompt_folder else None
    templated = tokenizer.chat_template is not None
    note = untrained_prompt_note(prompt_folder, label, templated) if prompt_folder and not prompt_format else None
    if note or (not templated and prompt_format is None):
        print(f"note: {note or f'{label} has no chat template: prompts go in as plain text, as with --raw'}",
              file=sys.stderr)  # fmt: skip
    return Loaded(model, tokenizer, label, prompt_format, stopped_run)


def fit_embeddings(model, tokenizer, recipe) -> None:
    """The base model's embeddings grown to the run's tokenizer, as training grew them (tokens or special_tokens
    added; rounded up to 32 with resize_token_embeddings_to_32x): the adapter holds the grown rows (peft saves an
    embedding whose size changed), which load only onto a base of the same size."""
    from llmtune.train.model.load import embedding_rows

    rows = embedding_rows(recipe, tokenizer)
    if rows > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(rows, mean_resizing=False)  # (the adapter's rows replace the new ones)


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def kwargs(self, tokenizer, model=None) -> dict:
        options = {"max_new_tokens": self.max_new_tokens, "pad_token_id": tokenizer.pad_token_id,
                   "eos_token_id": stop_ids(model, tokenizer)}  # fmt: skip
        if self.temperature > 0:
            options.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return options


def stop_ids(model, tokenizer) -> list[int]:
    """Every token generation stops at: the model's generation config's eos ids (an instruct model lists its turn
    end beside the end of text) and the tokenizer's eos (a recipe's special_tokens.eos_token)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def within_positions(model, prompt_tokens: int, options: dict) -> dict:
    """generate()'s options with max_new_tokens cut to the positions a model with a learned position table has
    (GPT-2's, OPT's): past them its embedding lookup fails. Rotary and ALiBi models have no such table."""
    config = getattr(model, "config", None)
    rotary = any(getattr(config, key, None) is not None for key in ("rope_theta", "rope_scaling", "rope_parameters"))
    table = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if rotary or getattr(config, "alibi", False) or not isinstance(table, int):
        return options
    left = table - prompt_tokens
    if left < 1:
        raise UserError(f"the prompt is {prompt_tokens} tokens, and the model has {table} positions",
                        "shorten the prompt (or, in chat, /reset the conversation)")  # fmt: skip
    return {**options, "max_new_tokens": min(options.get("max_new_tokens") or left, left)}


def generate_ids(model, tokenizer, prompts: list[list[int]], options: dict) -> list[list[int]]:
    """The tokens generated after each prompt (token ids), the batch left-padded; `options`: generate()'s
    (Sampling.kwargs)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    options = within_positions(model, width, options)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **{"pad_token_id": pad, **options})
    return out[:, width:].cpu().tolist()


def generate_texts(model, tokenizer, texts: list[str], options: dict) -> list[str]:
    """generate_ids over rendered prompt texts (their special tokens written in them), decoded."""
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    made = generate_ids(model, tokenizer, prompts, options)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in made]


def render(tokenizer, prompt, raw: bool) -> str:
    """A prompt (text, or a list of chat messages) as the text the model sees (with the recipe's
    chat_template_kwargs)."""
    from llmtune.train.data.templates import template_kwargs

    if not isinstance(prompt, list):
        if raw or tokenizer.chat_template is None:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    elif tokenizer.chat_template is None:
        raise UserError("chat messages need a chat template, and this tokenizer has none", "pass plain prompts")
    return tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **template_kwargs(tokenizer)
    )


def read_prompts(path: Path) -> list[tuple[dict, object]]:
    """(row, prompt) from a .jsonl file (fields prompt / instruction(+input) / messages), a .json array of such rows,
    or a text file, one prompt per line."""
    if not path.exists():
        raise UserError(f"--file {path} does not exist")
    suffix = path.suffix.lower()
    with reading(path):
        text = path.read_text()
    if suffix == ".json":
        try:
            listed = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}: not valid JSON ({err})", "a .json file holds one array of prompt rows; "
                            "for one row per line, name it .jsonl") from None  # fmt: skip
        if not isinstance(listed, list):
            raise UserError(f"{path}: a .json prompts file holds an array of rows", 'write [{"prompt": "..."}, ...]')
        lines = [(number, row) for number, row in enumerate(listed, 1)]
        where = "row"
    else:
        lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        where = "line"
    rows = []
    for number, line in lines:
        if suffix not in (".jsonl", ".json"):
            rows.append(({"prompt": line}, line))
            continue
        try:
            row = line if suffix == ".json" else json.loads(line)  # (an array's rows are parsed already)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {number}: not valid JSON", "one JSON object per line") from None
        rows.append(_prompt_row(row, f"{path} {where} {number}"))
    if not rows:
        raise UserError(f"--file {path} has no prompts")
    return rows


def _prompt_row(row, where: str) -> tuple[dict, object]:
    """One prompt row: a string, or an object with prompt, messages (each a role and a text content) or instruction."""
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with a 'prompt' field")
    if isinstance(row.get("prompt"), str):
        return row, row["prompt"]
    if isinstance(row.get("messages"), list):
        messages = row["messages"]
        bad = next((i for i, m in enumerate(messages) if not isinstance(m, dict) or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)), None)  # fmt: skip
        if bad is not None:
            raise UserError(f"{where}: messages[{bad}] should be an object with a 'role' and a text 'content'",
                            "write {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}")  # fmt: skip
        # a trailing assistant turn is the reference answer: the model writes its own
        prompt = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
        if not prompt:
            raise UserError(f"{where}: messages holds no turn before the answer, so there is nothing to answer",
                            "give at least one user message")  # fmt: skip
        return row, prompt
    if isinstance(row.get("instruction"), str):
        return row, row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    raise UserError(f"{where}: no 'prompt', 'messages' or 'instruction' field", 'write {"prompt": "..."} per line')


def infer(target: str, prompts: list[str], file: Path | None, output: Path | None, sampling: Sampling,
          batch_size: int = 8, raw: bool = False, progress=lambda items, _d, total=None: items) -> list[dict]:  # fmt: skip
    rows = read_prompts(file) if file is not None else [({"prompt": p}, p) for p in prompts]
    if not rows:
        raise UserError("no prompt given", "pass --prompt TEXT (repeatable) or --file prompts.jsonl")
    if raw and any(isinstance(prompt, list) for _, prompt in rows):
        raise UserError("--raw sends prompts without the chat template, and messages rows are read through it",
                        "drop --raw, or write those rows as {\"prompt\": \"...\"}")  # fmt: skip
    from transformers import set_seed  # after the rows are read: a malformed one is said before torch loads

    loaded = load_for_generation(target)
    if loaded.stopped_run:  # no final save: its newest complete checkpoint (said, as chat's header does)
        print(f"note: {loaded.stopped_run}: the run has no final save, so its newest complete checkpoint answers",
              file=sys.stderr)  # fmt: skip
    set_seed(sampling.seed)
    texts = [prompt_text(loaded, row, prompt, raw) for row, prompt in rows]
    outputs, options, starts = [], sampling.kwargs(loaded.tokenizer, loaded.model), range(0, len(texts), batch_size)
    for start in progress(starts, "generating", total=len(starts)):
        outputs += generate_texts(loaded.model, loaded.tokenizer, texts[start : start + batch_size], options)
    results = [{**row, "output": text} for (row, _), text in zip(rows, outputs, strict=True)]
    if output is not None:
        from llmtune.plan.files import atomic_write

        atomic_write(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    return results


def chat(
    target: str, sampling: Sampling, system: str | None = None, raw: bool = False, stdin=None, stdout=None
) -> None:
    """A conversation on the terminal, streamed token by token. /reset forgets it, /exit (or Ctrl-D) ends it."""
    import torch
    from transformers import TextStreamer, set_seed

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    loaded = load_for_generation(target, command="chat")
    tokenizer, model = loaded.tokenizer, loaded.model
    set_seed(sampling.seed)

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            stdout.write(text + ("\n" if stream_end else ""))
            stdout.flush()

    trained = None if raw else loaded.prompt_format
    plain = raw or (trained is None and tokenizer.chat_template is None)
    if system and (plain or trained in NO_SYSTEM_SLOT):  # said, never dropped silently
        why = "messages go in as plain text" if plain else f"the {trained} prompt has no system message"
        print(f"note: --system is not used: {why}", file=sys.stderr)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    stdout.write(f"chatting with {loaded.label}: /reset starts over, /exit ends\n")
    if trained:
        how = "the conversation" if trained.startswith("sharegpt:") else "each message alone, as one instruction"
        slot = ", --system as its system prompt" if system and trained not in NO_SYSTEM_SLOT else ""
        stdout.write(f"(trained on {trained} prompts: {how}, written as training wrote it{slot})\n")
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            stdout.write("\n" if not line else "")
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history = list(start)
            stdout.write("(conversation cleared)\n")
            continue
        history.append({"role": "user", "content": text})
        prompt = trained_prompt(tokenizer, trained, history) if trained else text if plain else render(
            tokenizer, history, raw)  # fmt: skip
        batch = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
        stdout.write("model> ")
        stdout.flush()
        with torch.no_grad():
            out = model.generate(**batch, **within_positions(model, batch["input_ids"].shape[1],
                                                             sampling.kwargs(tokenizer, model)),
                                 streamer=Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True))  # fmt: skip
        answer = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        history.append({"role": "assistant", "content": answer})
