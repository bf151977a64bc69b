"""A conversation's history kept within the model's context: the oldest turns give way first
(`cllm chat`; the HTTP server refuses an over-long conversation instead, with a 400)."""

from __future__ import annotations

from collections.abc import Callable

from cllm.core.errors import UserError


def trim_history(messages: list[dict], prompt_length: Callable[[list[dict]], int], room: int) -> tuple[list[dict], int]:
    """Drop the oldest turns (a system message stays) until the prompt for the next reply is at
    most `room` tokens long. A dropped user message takes the assistant's reply after it along,
    so the history still starts with a user turn. Returns (messages kept, how many dropped);
    raises UserError when the last message alone does not fit."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(head):]
    dropped = 0
    while prompt_length(head + turns) > room:
        if len(turns) <= 1:
            raise UserError(f"this message alone leaves no room for a reply within the model's context "
                            f"({prompt_length(head + turns)} prompt tokens, {room} at most): send a shorter one")
        turns, dropped = turns[1:], dropped + 1
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns, dropped = turns[1:], dropped + 1
    return head + turns, dropped
