"""The prompt a run trained on, for `llmtune chat` and `llmtune infer`: the format every dataset of the run shares
(an instruct prompter, a ShareGPT conversation), and that prompt written by training's own code, BOS included."""

from __future__ import annotations

from pathlib import Path

from llmtune.post.consolidate import plan_recipe

NO_SYSTEM_SLOT = {"sharegpt:gemma"}  # trained prompts without a system message (every instruct prompter has one)


def _prompt_key(spec: dict) -> str | None:
    """A dataset entry's prompt format where chat can write it as training did: an instruct type in its style
    ('alpaca', 'oasst', 'alpaca:chat', 'alpaca_chat:chatml') or 'sharegpt:<conversation>'; else None."""
    from llmtune.recipe.sharegpt import sharegpt_conversation
    from llmtune.train.data.instruct import PROMPTED, prompt_style
    from llmtune.train.data.sharegpt import SHAREGPT_FORMATS

    kind = spec.get("type")
    name, _, style = kind.partition(":") if isinstance(kind, str) else ("", "", "")
    if name in PROMPTED:  # plain `alpaca` writes the text of PROMPTED's alpaca in its instruct style
        default = PROMPTED[name][2]
        style = prompt_style(name, kind, spec.get("conversation"), default)
        return name if style == default else f"{name}:{style}"
    if name in SHAREGPT_FORMATS and not style:
        return "sharegpt:" + sharegpt_conversation(spec.get("conversation"), name == "sharegpt.load_glaive")
    return None


def trained_prompt_format(folder: Path) -> str | None:
    """The prompt format (_prompt_key) every dataset of the run (or merged folder) at `folder` trained on, where
    chat and infer can write it as training did; None for mixed formats, chat templates and the rest."""
    from llmtune.recipe.sharegpt import default_system_of

    recipe = plan_recipe(folder)
    keys = {_prompt_key(spec) for spec in recipe.get("datasets") or [] if isinstance(spec, dict)}
    key = keys.pop() if len(keys) == 1 and not recipe.get("rl") else None
    system = default_system_of(recipe.get("default_system_message"), recipe.get("chat_template"))
    if key and system and key == f"sharegpt:{system[0]}":
        return None  # training swapped in the recipe's system message (default_system_of): not written here
    return key


def untrained_prompt_note(folder: Path, label: str, templated: bool = True) -> str | None:
    """What to tell the user when the run trained on prompts chat can't write (mixed formats, completion text, ...)."""
    recipe = plan_recipe(folder)
    kinds = [spec.get("type") for spec in recipe.get("datasets") or [] if isinstance(spec, dict)]
    types = sorted({k if isinstance(k, str) else "user-defined (type: {...})" if k else "pretokenized" for k in kinds})
    if not types or recipe.get("rl") or all(kind.startswith("chat_template") for kind in types):
        return None
    how = "through the tokenizer's chat template (--raw sends them as plain text)" if templated else "in as plain text"
    return f"{label} trained on {', '.join(types)} data, which chat can't prompt as training did: prompts go {how}"


def trained_prompt(tokenizer, prompt_format: str, messages: list[dict], extra: str = "") -> str:
    """The prompt a run trained on `prompt_format` sees for `messages`, written by training's own prompter, with
    the BOS training's tokenizer call added: an instruct format takes the last user message alone (`extra` its
    input), a ShareGPT conversation the whole thread, up to its assistant's role prefix."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    thread = [m for m in messages if m["role"] != "system"]
    name, _, style = prompt_format.partition(":")
    if name == "sharegpt":
        from llmtune.train.data.sharegpt import CONVERSATIONS, turns

        pieces = turns(CONVERSATIONS[style], None if prompt_format in NO_SYSTEM_SLOT else system,
                       [(m["role"], m["content"], None) for m in thread] + [("assistant", "", None)])  # fmt: skip
        eos = tokenizer.eos_token or ""  # training closed each answer with EOS (chatml's, whose separator it is)
        closed = [r + t + (eos if k == "assistant" and not (r + t).endswith(eos) and not (
            style == "chatml" and CONVERSATIONS[style].sep == eos) else "") for k, r, t, _ in pieces[:-1]]  # fmt: skip
        # FastChat's generation prompt: the role prefix without its trailing space ("ASSISTANT:", "[/INST]")
        text = "".join(closed) + pieces[-1][1].rstrip(" ")
        opened = pieces[0][0] == "system" and bool(pieces[0][1] + pieces[0][2])  # only that piece took the BOS
    else:
        from llmtune.train.data.instruct import PROMPTED

        make, _, default = PROMPTED[name]
        users = [m["content"] for m in thread if m["role"] == "user"]
        text, opened = make(style or default).prompt(users[-1] if users else "", extra, system), True
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    adds_bos = opened and tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    return (tokenizer.bos_token if adds_bos else "") + text
