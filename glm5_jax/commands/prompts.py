"""Prompts of `glm5 generate / rollout`: `--prompt TEXT` or a JSONL file, one object per line with one of

    {"prompt": "text"}                      encoded as is (with --chat: one user message)
    {"prompt_ids": [1, 2, 3]}               token ids as given
    {"messages": [...], "tools": [...]}     rendered through the GLM-5 chat template

plus an optional "id" (the rollout group id; default the line number) and any other fields, which reach the
reward function untouched (e.g. "answer"). With --chat the template ends with the generation prompt in the
chosen thinking mode: `on` (think; earlier turns' reasoning cleared, the template's default), `off`
("<think></think>", no reasoning) or `interleaved` (think, and every earlier turn's reasoning kept in the
context: interleaved / preserved thinking across turns). A bad line is refused as FILE:LINE.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from glm5_jax.commands.source import CommandError
from glm5_jax.data.chat import render_chat

THINKING_MODES = ("on", "off", "interleaved")
_PROMPT_KEYS = ("prompt", "prompt_ids", "messages")


@dataclasses.dataclass(frozen=True)
class Prompt:
    where: str           # "FILE:LINE" or "--prompt"
    prompt_id: str
    ids: tuple[int, ...]
    record: dict         # the JSON object as given (what reward functions see)


def _encode(record: dict, where: str, tokenizer, *, chat: bool, thinking: str) -> list[int]:
    given = [key for key in _PROMPT_KEYS if key in record]
    if len(given) != 1:
        raise CommandError(f"{where}: a prompt needs exactly one of {list(_PROMPT_KEYS)}, got "
                           f"{given or sorted(record)}")
    key = given[0]
    if key == "prompt_ids":
        ids = record[key]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in ids):
            raise CommandError(f"{where}: field 'prompt_ids' must be a non-empty list of integers")
        return ids
    if key == "prompt":
        text = record[key]
        if not isinstance(text, str) or not text:
            raise CommandError(f"{where}: field 'prompt' must be a non-empty string")
        if not chat:
            return tokenizer.encode(text)
        messages = [{"role": "user", "content": text}]
    else:
        messages = record[key]
    try:
        return render_chat(messages, tokenizer, tools=record.get("tools"), enable_thinking=thinking != "off",
                           clear_thinking=thinking != "interleaved", add_generation_prompt=True,
                           record_id=where).ids.tolist()
    except ValueError as err:
        raise CommandError(f"{where}: {err}") from None


def make_prompt(record: dict, where: str, default_id: str, tokenizer, *, vocab_size: int, chat: bool,
                thinking: str) -> Prompt:
    if not isinstance(record, dict):
        raise CommandError(f"{where}: a prompt must be a JSON object, got {json.dumps(record)[:80]}")
    ids = _encode(record, where, tokenizer, chat=chat, thinking=thinking)
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise CommandError(f"{where}: token id {outside[0]} is outside the model's vocabulary [0, {vocab_size}) "
                           "(a tokenizer the model was not trained with? see --tokenizer)")
    prompt_id = record.get("id", default_id)
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
        raise CommandError(f"{where}: field 'id' must be a string or an integer, got {prompt_id!r}")
    return Prompt(where, str(prompt_id), tuple(ids), record)


def read_prompts(*, text: str | None, path: str | None, tokenizer, vocab_size: int, chat: bool,
                 thinking: str) -> list[Prompt]:
    """The prompts of `--prompt TEXT` or `--prompts FILE.jsonl` (exactly one of them), encoded."""
    if (text is None) == (path is None):
        raise CommandError("give exactly one of --prompt TEXT and --prompts FILE.jsonl")
    if thinking not in THINKING_MODES:
        raise CommandError(f"--thinking={thinking!r} is invalid: must be one of {THINKING_MODES}")
    kwargs = dict(vocab_size=vocab_size, chat=chat, thinking=thinking)
    if text is not None:
        return [make_prompt({"prompt": text}, "--prompt", "prompt", tokenizer, **kwargs)]
    file = Path(path)
    if not file.is_file():
        raise CommandError(f"prompts file {path!r} does not exist")
    prompts, seen = [], {}
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CommandError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        prompt = make_prompt(record, where, f"line{number}", tokenizer, **kwargs)
        if prompt.prompt_id in seen:
            raise CommandError(f"{where}: id {prompt.prompt_id!r} is also the id of {seen[prompt.prompt_id]}; "
                               "prompt ids must be unique")
        seen[prompt.prompt_id] = where
        prompts.append(prompt)
    if not prompts:
        raise CommandError(f"prompts file {path!r} holds no prompt (every line is blank)")
    return prompts


def check_context(prompts: list[Prompt], *, max_new_tokens: int, lookahead: int, context: int) -> None:
    """Refuse, naming it, a prompt that leaves no room for the new tokens in the model's context."""
    for prompt in prompts:
        needed = len(prompt.ids) + max_new_tokens + lookahead
        if needed > context:
            extra = f" + {lookahead} draft slots" if lookahead else ""
            raise CommandError(f"{prompt.where}: the prompt has {len(prompt.ids)} tokens; with --max-new-tokens="
                               f"{max_new_tokens}{extra} it needs {needed} positions, more than the model's "
                               f"context (max_position_embeddings={context})")
