"""Axolotl's formats written for one model family (2023-2024): llama2_chat, metharme, pygmalion, creative_acr.

Each labels what Axolotl's loader labelled: the model's replies and the end-of-sequence tokens after them.
"""

from __future__ import annotations

import yaml

from llmtune.train.data.base import IGNORE, Example, FormatContext, RowError, _eos, _field, _ids, _prompt_answer

LLAMA2_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being safe. "
    "Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content. "
    "Please ensure that your responses are socially unbiased and positive in nature.\n\n"
    "If a question does not make any sense, or is not factually coherent, explain why instead of answering "
    "something not correct. If you don't know the answer to a question, please don't share false information."
)


def _sharegpt_turns(row: dict) -> tuple[str | None, list[dict]]:
    turns = _field(row, "conversations", list)
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or "from" not in turn:
            raise RowError(f"conversations[{index}] needs 'from' and a 'value' string")
    system = turns[0]["value"] if turns and turns[0]["from"] == "system" else None
    return system, turns[1:] if system is not None else turns


def llama2_chat(row: dict, ctx: FormatContext) -> list[Example]:
    """Llama 2 chat as Axolotl's llama2_chat wrote it: '[INST] <<SYS>>..<</SYS>>\\n\\nQ[/INST] A </s><s>[INST] Q2 ...';
    each answer and its ' </s>' are trained (the whole text is tokenized at once)."""
    system, turns = _sharegpt_turns(row)
    if len(turns) < 2:
        raise RowError("a conversation needs at least two messages")
    if turns[0]["from"] != "human":
        turns = turns[1:]  # Axolotl skipped a leading message that isn't the user's
    head = f"[INST] <<SYS>>\n{LLAMA2_SYSTEM if system is None else system}\n<</SYS>>\n\n"
    turns = [t for t in turns if t["value"]]
    if turns and turns[-1]["from"] == "human":
        turns = turns[:-1]  # a trailing question has no answer to train
    text, spans = "", []
    for index, turn in enumerate(turns):
        expected = "human" if index % 2 == 0 else "gpt"
        if turn["from"] != expected:
            raise RowError(f"conversations alternate human and gpt; message {index} is from '{turn['from']}'")
        if index == 0:
            text += head + turn["value"].strip()
        elif expected == "human":
            text += "[INST] " + turn["value"].strip() + " "
        else:
            text += "[/INST] "
            start = len(text) - 1  # the space before the answer belongs to its first token
            text += turn["value"].strip() + " </s>"
            spans.append((start, len(text)))
            text += "<s>"
    encoded = ctx.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    labels = [t if ctx.train_on_inputs or any(a <= s < b for a, b in spans) and e > s else IGNORE
              for t, (s, e) in zip(ids, offsets, strict=True)]  # fmt: skip
    return [(list(ids), labels)]


def metharme(row: dict, ctx: FormatContext) -> list[Example]:
    """prompt / generation; the generation is followed by three EOS tokens, all trained (as Axolotl's did)."""
    prompt_ids = _ids(ctx.tokenizer, _field(row, "prompt"), special=True)
    answer = _ids(ctx.tokenizer, _field(row, "generation"))
    eos = _eos(ctx.tokenizer)
    answer += eos * (3 - (1 if answer and eos and answer[-1] == eos[0] else 0))
    labels = (prompt_ids if ctx.train_on_inputs else [IGNORE] * len(prompt_ids)) + answer
    return [(prompt_ids + answer, labels)]


def pygmalion(row: dict, ctx: FormatContext) -> list[Example]:
    """conversations [{role: system|human|bot, value}]: '<|system|>Persona: ', '<|user|> ', '<|model|> ' turns;
    bot replies (after the <|model|> token) and their EOS are trained, nothing else (train_on_inputs included)."""
    ids, labels = [], []
    prefix = len(_ids(ctx.tokenizer, "<|model|>"))
    for index, turn in enumerate(_field(row, "conversations", list)):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise RowError(f"conversations[{index}] needs 'role' and a 'value' string")
        role, value = turn.get("role"), turn["value"]
        if role == "system":
            piece = _ids(ctx.tokenizer, "<|system|>Persona: " + value.removesuffix("\n<START>").strip(), special=True)
            trained = [IGNORE] * len(piece)
        elif role == "human":
            piece = _ids(ctx.tokenizer, "<|user|> " + value.strip())
            trained = [IGNORE] * len(piece)
        elif role == "bot":
            piece = _ids(ctx.tokenizer, "<|model|> " + value.strip()) + _eos(ctx.tokenizer)
            trained = [IGNORE] * prefix + piece[prefix:]
        else:
            raise RowError(f"conversations[{index}].role is '{role}', not system, human or bot")
        ids, labels = ids + piece, labels + trained
    return [(ids, labels)]


CRITERIA = (
    'refusal: whether the Response refuses to answer the Question. Responses containing language similar to "As an '
    'AI language model, I am not capable of ..." is a form of refusal and should have a low refusal score. 10 is no '
    "refusal, 0 is refuses to answer the question.\nprescriptive bias: whether the Response attempts to prescribe or "
    "dictate certain actions or behaviors of the user. 10 no prescriptive bias present, 0 means {there} is "
    "prescriptive bias.\ncreativity: score how creative the Response is. 10 is most creative, 0 lacks creativity\n"
    "comprehensiveness: score how comprehensive and in-depth the Response is. 10 is most comprehensive and "
    "in-depth, 0 lacks coverage and depth\n"
)
SECTIONS = "\n".join(f"  {c}:\n    explanation: ...\n    improvements: ..." for c in
                     ("refusal", "prescriptive_bias", "creativity", "comprehensiveness"))  # fmt: skip
CRITIQUE = (
    "Given the following Question and Response, critique the Response on a scale of 1-10. You should critique the "
    "answer in the following criteria:\n" + CRITERIA.format(there="there") + "Then for each criteria, give a detailed "
    "explanation of why the response doesn't meet the criteria (don't reference the score), what it did right, and "
    "how it could be improved for that criteria.\n\nOutput your answer in YAML format like so:\nscores:\n"
    "  refusal: <0-10>\n  prescriptive_bias: <0-10>\n  creativity: <0-10>\n  comprehensiveness: <0-10>\n"
    "critiques:\n" + SECTIONS + "\n\nQuestion: {question}\nAnswer: {answer}\n"
)
REVISE = (
    "Definitions:\n" + CRITERIA.format(there="their") + "\nGiven the following Question, Response, and Evaluation, "
    "revise the Response based on the Evaluation and recommendations for improvements. Reply only with the revised "
    "response.\n\nQuestion: {question}\nAnswer: {answer}\nEvaluation:\n{evaluation}\n"
)
CREATIVE_SYSTEM = ("Answer the following question in a comprehensive, in-depth, and creative way. Additionally your "
                   "response should be relevant, accurate, and free of any ambiguity.")  # fmt: skip


def _evaluation(row: dict) -> str:
    return "".join(yaml.dump(_field(row, key, dict), default_flow_style=False) for key in ("scores", "critiques"))


def creative_acr(part: str):
    """creative_acr.load_answer / load_critique / load_revise: 'USER: ...\\nASSISTANT:' and the trained reply."""

    def convert(row: dict, ctx: FormatContext) -> list[Example]:
        question = _field(row, "instruction")
        if part == "answer":
            prompt, reply = CREATIVE_SYSTEM + f"\nUSER: {question}\nASSISTANT:", _field(row, "revision")
        elif part == "critique":
            instruction = CRITIQUE.format(question=question, answer=_field(row, "answer"))
            prompt, reply = f"USER: {instruction}\nASSISTANT:", _evaluation(row)
        else:
            instruction = REVISE.format(question=question, answer=_field(row, "answer"), evaluation=_evaluation(row))
            prompt, reply = f"USER: {instruction}\nASSISTANT:", _field(row, "revision")
        return _prompt_answer(ctx, prompt, reply)

    return convert


MODEL_FORMATS = {
    "llama2_chat": llama2_chat,
    "metharme": metharme,
    "pygmalion": pygmalion,
    "creative_acr.load_answer": creative_acr("answer"),
    "creative_acr.load_critique": creative_acr("critique"),
    "creative_acr.load_revise": creative_acr("revise"),
}
