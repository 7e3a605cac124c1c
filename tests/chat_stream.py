"""Parsing a rendered chat stream back into messages: the inverse of `glm5_jax.data.chat.render_chat` (up to
what rendering drops), the oracle of the chat tests' round trips."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from glm5_jax.data.chat import ROLE_MARKERS, TOOLS_FOOTER, TOOLS_HEADER
from glm5_jax.data.tokenizer import GLM_SPECIAL_TOKENS, Tokenizer


def split_by_role(ids: Sequence[int], tokenizer: Tokenizer) -> list[dict]:
    """Parses a rendered stream back into messages (the inverse of render_chat, up to what it drops).

    Returns {"role", "content"} dicts; assistant messages also carry "reasoning_content" when non-empty
    and "tool_calls" ([{"name", "arguments"}], argument values as the rendered strings). The tools block is
    skipped; a role marker with nothing after it at the end of the stream (a stop signal) opens no message,
    and "<|endoftext|>" ends the stream. Raises ValueError naming the position of a malformed stream.
    """
    special = dict(zip(GLM_SPECIAL_TOKENS, tokenizer.add_special_tokens(list(GLM_SPECIAL_TOKENS))))
    role_of = {special[marker]: role for role, marker in ROLE_MARKERS.items()}
    ids = [int(token) for token in ids]
    position = 0
    for prefix in ("[gMASK]", "<sop>"):
        if position < len(ids) and ids[position] == special[prefix]:
            position += 1
    end = _find(ids, special["<|endoftext|>"], position, len(ids))
    starts = [index for index in range(position, end) if ids[index] in role_of]
    if position < end and starts[:1] != [position]:
        raise ValueError(f"ids[{position}]: expected a role marker, got token {ids[position]}")

    messages = []
    for start, stop in zip(starts, starts[1:] + [end]):
        role = role_of[ids[start]]
        body = _Span(ids, start + 1, stop)
        if body.start == body.stop and stop == end:
            continue
        if role == "assistant":
            messages.append(_split_assistant(body, special, tokenizer))
        elif role == "observation":
            messages.extend(_split_observations(body, special, tokenizer))
        else:
            text = tokenizer.decode(ids[body.start : body.stop])
            if role == "system" and text.startswith(TOOLS_HEADER) and text.endswith(TOOLS_FOOTER):
                continue
            messages.append({"role": role, "content": text})
    return messages


def _find(ids: list[int], token: int, start: int, stop: int) -> int:
    """Index of the first `token` in ids[start:stop], or `stop`."""
    for index in range(start, stop):
        if ids[index] == token:
            return index
    return stop


@dataclasses.dataclass(frozen=True)
class _Span:
    """ids[start:stop] of a stream, kept as positions so errors can name where the stream is malformed."""

    ids: list[int]
    start: int
    stop: int

    def expect(self, position: int, token: int, name: str) -> None:
        if position >= self.stop or self.ids[position] != token:
            found = self.ids[position] if position < self.stop else "the end of the message"
            raise ValueError(f"ids[{position}]: expected {name}, got {found}")

    def closing(self, position: int, token: int, name: str) -> int:
        close = _find(self.ids, token, position, self.stop)
        if close == self.stop:
            raise ValueError(f"ids[{position}]: {name} is never closed")
        return close


def _split_assistant(body: _Span, special: dict[str, int], tokenizer: Tokenizer) -> dict:
    ids, cursor = body.ids, body.start
    reasoning = ""
    if cursor < body.stop and ids[cursor] == special["<think>"]:
        # A generation prompt leaves the block open: everything after "<think>" is reasoning so far.
        close = _find(ids, special["</think>"], cursor, body.stop)
        reasoning = tokenizer.decode(ids[cursor + 1 : close])
        cursor = min(close + 1, body.stop)
    first_call = _find(ids, special["<tool_call>"], cursor, body.stop)
    message: dict[str, Any] = {"role": "assistant", "content": tokenizer.decode(ids[cursor:first_call])}
    if reasoning:
        message["reasoning_content"] = reasoning

    calls = []
    cursor = first_call
    while cursor < body.stop:
        body.expect(cursor, special["<tool_call>"], "<tool_call>")
        call_end = body.closing(cursor, special["</tool_call>"], "<tool_call>")
        name_end = _find(ids, special["<arg_key>"], cursor, call_end)
        arguments = {}
        inner = name_end
        while inner < call_end:
            body.expect(inner, special["<arg_key>"], "<arg_key>")
            key_end = body.closing(inner, special["</arg_key>"], "<arg_key>")
            body.expect(key_end + 1, special["<arg_value>"], "<arg_value>")
            value_end = body.closing(key_end + 1, special["</arg_value>"], "<arg_value>")
            key = tokenizer.decode(ids[inner + 1 : key_end])
            arguments[key] = tokenizer.decode(ids[key_end + 2 : value_end])
            inner = value_end + 1
        calls.append({"name": tokenizer.decode(ids[cursor + 1 : name_end]), "arguments": arguments})
        cursor = call_end + 1
    if calls:
        message["tool_calls"] = calls
    return message


def _split_observations(body: _Span, special: dict[str, int], tokenizer: Tokenizer) -> list[dict]:
    results = []
    cursor = body.start
    while cursor < body.stop:
        body.expect(cursor, special["<tool_response>"], "<tool_response>")
        close = body.closing(cursor, special["</tool_response>"], "<tool_response>")
        results.append({"role": "observation", "content": tokenizer.decode(body.ids[cursor + 1 : close])})
        cursor = close + 1
    return results
