"""What a ShareGPT dataset entry means, read alike by training (train/data/sharegpt.py), the plan's notes and chat's
trained prompt: the conversation it is written in, and where the recipe's default_system_message reaches it."""

from __future__ import annotations


def sharegpt_conversation(conversation: str | None, glaive: bool = False) -> str:
    """The FastChat conversation a ShareGPT dataset is written in: its `conversation:`, else its loader's default
    (Glaive's function calling, sharegpt.load_glaive: chatml_glaive; the others: vicuna_v1.1)."""
    return conversation or ("chatml_glaive" if glaive else "vicuna_v1.1")


def default_system_of(message: str | None, chat_template: str | None) -> tuple[str, str] | None:
    """(conversation, message) where default_system_message applies: Axolotl gave it to ShareGPT conversations in
    chatml or llama3 when chat_template named the same template; None where it reaches no dataset."""
    return (chat_template, message) if message and chat_template in ("chatml", "llama3") else None
