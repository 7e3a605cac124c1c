"""GLM-5 chat rendering: a conversation -> token ids, a per-token loss mask and per-token annotations.

Follows GLM-5's published chat template (zai-org/GLM-5 `chat_template.jinja`, the GLM-4.7 layout):

    [gMASK]<sop><|system|>{system}<|user|>{user}<|assistant|><think>{reasoning}</think>{content}
    <tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value></tool_call>
    <|observation|><tool_response>{result}</tool_response><|assistant|><think>...

(one stream, no newlines after markers; tools, when given, are listed in a leading system block).
Reasoning of assistant turns before the last user message is dropped when `clear_thinking` (the template's
default) and kept otherwise (preserved thinking). One deliberate difference from the template: an assistant
turn without shown reasoning renders an empty block "<think></think>" (the template writes a bare "</think>",
GLM-5.3 the empty block), so the generation prompt "<|assistant|><think>" or, with thinking off,
"<|assistant|><think></think>" is always an exact token prefix of the turn that continues it.

Loss: reasoning, content, tool calls and the closing "</think>" of a thinking turn are trained; markers,
"<think>" (part of the generation prompt), system, user and observation tokens are not. GLM has no
end-of-turn token, so the marker that follows an assistant turn (or "<|endoftext|>" / "<|observation|>"
after a final one) is its stop signal and is trained. Erroneous messages and `error_spans` stay in the
context with loss 0, and so does the stop signal of an erroneous message.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

import numpy as np

from glm5_jax.data.pretrain import DataError
from glm5_jax.data.tokenizer import GLM_SPECIAL_TOKENS, Tokenizer

ROLES = ("system", "user", "assistant", "observation")
ROLE_ALIASES = {"tool": "observation"}  # the Hugging Face / OpenAI name for tool results
ROLE_MARKERS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "observation": "<|observation|>",
}
NO_THINK_SUFFIX = "/nothink"  # GLM's user-side switch: the reply to this message does not think

# Per-token segment kinds (RenderedChat.segment holds indices into this tuple).
SEGMENT_NAMES = ("template", "system", "user", "reasoning", "content", "tool_call", "observation")
SEGMENT = {name: index for index, name in enumerate(SEGMENT_NAMES)}

DROP_REASONS = ("bad_field", "empty", "unknown_role", "orphan_observation", "too_long", "no_loss_tokens")

TOOLS_HEADER = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML "
    "format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)


class ChatError(ValueError):
    """A conversation that cannot be rendered; `reason` is one of DROP_REASONS."""

    def __init__(self, record_id: Any, reason: str, detail: str):
        super().__init__(f"chat record {record_id!r}: {detail}")
        self.record_id = record_id
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """One rendered conversation; all arrays have one entry per token.

    message_index: the message a token belongs to (a role marker belongs to the message it opens), -1 for
    template tokens outside any message (prefix, tools block, generation prompt, final stop token).
    segment: index into SEGMENT_NAMES.
    """

    ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int32, 1 = trained
    message_index: np.ndarray  # int32
    segment: np.ndarray  # int8

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass(frozen=True)
class _Message:
    role: str
    content: str
    reasoning: str
    tool_calls: tuple[tuple[str, dict[str, Any]], ...]
    thinking: bool | None
    error: bool
    error_spans: tuple[tuple[int, int], ...]


class _Builder:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        names = list(GLM_SPECIAL_TOKENS)
        self.special_ids = dict(zip(names, tokenizer.add_special_tokens(names)))
        self.ids: list[int] = []
        self.loss: list[int] = []
        self.owner: list[int] = []
        self.segment: list[int] = []

    def _append(self, token: int, loss: bool, owner: int, segment: str) -> None:
        self.ids.append(token)
        self.loss.append(int(loss))
        self.owner.append(owner)
        self.segment.append(SEGMENT[segment])

    def special(self, name: str, *, loss: bool, owner: int, segment: str) -> None:
        self._append(self.special_ids[name], loss, owner, segment)

    def text(
        self,
        text: str,
        *,
        loss: bool,
        owner: int,
        segment: str,
        allow_special: bool = False,
        masked_spans: Sequence[tuple[int, int]] = (),
    ) -> None:
        ids, offsets = self.tokenizer.encode_with_offsets(text, allow_special=allow_special)
        for token, (start, end) in zip(ids, offsets):
            masked = any(start < span_end and span_start < end for span_start, span_end in masked_spans)
            self._append(token, loss and not masked, owner, segment)

    def finish(self) -> RenderedChat:
        return RenderedChat(
            ids=np.asarray(self.ids, np.int32),
            loss_mask=np.asarray(self.loss, np.int32),
            message_index=np.asarray(self.owner, np.int32),
            segment=np.asarray(self.segment, np.int8),
        )


def _parse_tool_call(call: Any, where: str, record_id: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]  # OpenAI style {"type": "function", "function": {...}}
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        detail = f"{where}: a tool call needs a non-empty string 'name', got {call!r}"
        raise ChatError(record_id, "bad_field", detail)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            detail = f"{where}: tool call arguments {arguments!r} are not valid JSON ({error})"
            raise ChatError(record_id, "bad_field", detail) from None
    if not isinstance(arguments, dict):
        detail = f"{where}: tool call arguments must be an object, got {arguments!r}"
        raise ChatError(record_id, "bad_field", detail)
    return call["name"], arguments


def _parse_message(message: Any, index: int, record_id: Any) -> _Message:
    where = f"message {index}"

    def bad_field(detail: str) -> ChatError:
        return ChatError(record_id, "bad_field", f"{where}{detail}")

    if not isinstance(message, dict):
        raise bad_field(f" must be a dict with 'role' and 'content', got {message!r}")
    role = ROLE_ALIASES.get(message.get("role"), message.get("role"))
    if role not in ROLES:
        raise ChatError(
            record_id,
            "unknown_role",
            f"{where} has unknown role {message.get('role')!r}; valid roles: {ROLES + tuple(ROLE_ALIASES)}",
        )
    content = message.get("content")
    content = "" if content is None else content
    reasoning = message.get("reasoning_content")
    reasoning = "" if reasoning is None else reasoning
    for field, value in (("content", content), ("reasoning_content", reasoning)):
        if not isinstance(value, str):
            raise bad_field(f" ({role}): '{field}' must be a string, got {value!r}")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise bad_field(f": 'tool_calls' must be a list, got {raw_calls!r}")
    tool_calls = tuple(_parse_tool_call(call, where, record_id) for call in raw_calls)
    if role != "assistant" and (tool_calls or reasoning):
        raise bad_field(": only assistant messages may have tool_calls or reasoning_content")
    thinking = message.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_field(f": 'thinking' must be true or false, got {thinking!r}")
    if thinking is False and reasoning.strip():
        raise bad_field(" sets thinking=false but has reasoning_content")
    error = message.get("error", False)
    if not isinstance(error, bool):
        raise bad_field(f": 'error' must be true or false, got {error!r}")
    spans = []
    for span in message.get("error_spans") or []:
        valid = (
            isinstance(span, (list, tuple))
            and len(span) == 2
            and all(isinstance(bound, int) and not isinstance(bound, bool) for bound in span)
            and 0 <= span[0] < span[1] <= len(content)
        )
        if not valid:
            raise bad_field(
                f": error span {span!r} must be [start, end] with 0 <= start < end <= {len(content)} "
                "(character offsets into 'content')"
            )
        spans.append((span[0], span[1]))
    if not (content.strip() or reasoning.strip() or tool_calls):
        raise ChatError(record_id, "empty", f"{where} ({role}) has no content")
    return _Message(role, content, reasoning, tool_calls, thinking, error, tuple(spans))


def _parse_conversation(messages: Any, tools: Any, record_id: Any) -> list[_Message]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError(record_id, "empty", f"'messages' must be a non-empty list, got {messages!r}")
    if tools is not None and (
        not isinstance(tools, (list, tuple)) or not all(isinstance(tool, dict) for tool in tools)
    ):
        raise ChatError(record_id, "bad_field", f"'tools' must be a list of dicts, got {tools!r}")
    parsed = [_parse_message(message, index, record_id) for index, message in enumerate(messages)]
    for index, message in enumerate(parsed):
        if message.role != "observation":
            continue
        caller = next((m for m in reversed(parsed[:index]) if m.role != "observation"), None)
        if caller is None or caller.role != "assistant" or not caller.tool_calls:
            raise ChatError(
                record_id,
                "orphan_observation",
                f"message {index} is a tool result (observation) with no preceding assistant tool call",
            )
    return parsed


def _argument_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _ends_with_no_think(message: _Message) -> bool:
    return message.role == "user" and message.content.rstrip().endswith(NO_THINK_SUFFIX)


def render_chat(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    tools: Sequence[dict] | None = None,
    enable_thinking: bool = True,
    clear_thinking: bool = True,
    add_generation_prompt: bool = False,
    max_length: int | None = None,
    record_id: Any = None,
) -> RenderedChat:
    """Renders `messages` (and `tools`) into ids, loss mask and annotations.

    enable_thinking: the default thinking switch of assistant turns; a turn overrides it with the message
      field "thinking": true/false, and a user message ending in "/nothink" turns it off for the replies
      that follow it. A turn with thinking off renders "<think></think>".
    clear_thinking: drop the reasoning of assistant turns before the last user message (the template's
      default); False keeps every turn's reasoning (preserved thinking).
    add_generation_prompt: end with "<|assistant|><think>" (or "<|assistant|><think></think>" when the next
      turn does not think) instead of the final stop token.
    Raises ChatError (naming `record_id`) for unknown roles, tool results without a preceding tool call,
    empty conversations or messages, malformed fields, and renderings longer than `max_length`.
    """
    for name, flag in (
        ("enable_thinking", enable_thinking),
        ("clear_thinking", clear_thinking),
        ("add_generation_prompt", add_generation_prompt),
    ):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    turns = _parse_conversation(messages, tools, record_id)

    builder = _Builder(tokenizer)
    builder.special("[gMASK]", loss=False, owner=-1, segment="template")
    builder.special("<sop>", loss=False, owner=-1, segment="template")
    if tools:
        builder.special("<|system|>", loss=False, owner=-1, segment="template")
        builder.text(TOOLS_HEADER, loss=False, owner=-1, segment="template", allow_special=True)
        for tool in tools:
            tool_line = json.dumps(tool, ensure_ascii=False) + "\n"
            builder.text(tool_line, loss=False, owner=-1, segment="template")
        builder.text(TOOLS_FOOTER, loss=False, owner=-1, segment="template", allow_special=True)

    last_user = max((index for index, turn in enumerate(turns) if turn.role == "user"), default=-1)
    thinking = enable_thinking
    for index, turn in enumerate(turns):
        previous = turns[index - 1] if index else None
        marker_loss = previous is not None and previous.role == "assistant" and not previous.error
        if turn.role == "user":
            thinking = enable_thinking and not _ends_with_no_think(turn)
        if turn.role == "observation":
            if previous.role != "observation":  # consecutive results share one marker, as in the template
                builder.special("<|observation|>", loss=marker_loss, owner=index, segment="template")
            builder.special("<tool_response>", loss=False, owner=index, segment="observation")
            builder.text(turn.content, loss=False, owner=index, segment="observation")
            builder.special("</tool_response>", loss=False, owner=index, segment="observation")
        elif turn.role in ("system", "user"):
            builder.special(ROLE_MARKERS[turn.role], loss=marker_loss, owner=index, segment="template")
            builder.text(turn.content, loss=False, owner=index, segment=turn.role)
        else:
            _render_assistant(
                builder,
                turn,
                index,
                thinking=thinking if turn.thinking is None else turn.thinking,
                show_reasoning=not clear_thinking or index > last_user,
                marker_loss=marker_loss,
            )

    last = turns[-1]
    if add_generation_prompt:
        marker_loss = last.role == "assistant" and not last.error
        builder.special("<|assistant|>", loss=marker_loss, owner=-1, segment="template")
        builder.special("<think>", loss=False, owner=-1, segment="reasoning")
        if not thinking:
            builder.special("</think>", loss=False, owner=-1, segment="reasoning")
    elif last.role == "assistant":
        # A final tool call is answered by a tool result, so the model stops with the observation marker.
        stop = "<|observation|>" if last.tool_calls else "<|endoftext|>"
        builder.special(stop, loss=not last.error, owner=-1, segment="template")

    rendered = builder.finish()
    if max_length is not None and len(rendered) > max_length:
        raise ChatError(
            record_id, "too_long", f"renders to {len(rendered)} tokens, more than max_length={max_length}"
        )
    return rendered


def _render_assistant(
    builder: _Builder, turn: _Message, index: int, *, thinking: bool, show_reasoning: bool, marker_loss: bool
) -> None:
    trained = not turn.error
    builder.special("<|assistant|>", loss=marker_loss, owner=index, segment="template")
    # "<think>" belongs to the generation prompt; "</think>" is sampled only when the turn really thinks.
    builder.special("<think>", loss=False, owner=index, segment="reasoning")
    shows_thinking = thinking and show_reasoning
    if shows_thinking and turn.reasoning.strip():
        builder.text(turn.reasoning.strip(), loss=trained, owner=index, segment="reasoning")
    builder.special("</think>", loss=trained and shows_thinking, owner=index, segment="reasoning")

    content = turn.content.strip()
    if content:
        shift = len(turn.content) - len(turn.content.lstrip())
        spans = [(start - shift, end - shift) for start, end in turn.error_spans]
        builder.text(content, loss=trained, owner=index, segment="content", masked_spans=spans)
    for name, arguments in turn.tool_calls:
        builder.special("<tool_call>", loss=trained, owner=index, segment="tool_call")
        builder.text(name, loss=trained, owner=index, segment="tool_call")
        for key, value in arguments.items():
            builder.special("<arg_key>", loss=trained, owner=index, segment="tool_call")
            builder.text(str(key), loss=trained, owner=index, segment="tool_call")
            builder.special("</arg_key>", loss=trained, owner=index, segment="tool_call")
            builder.special("<arg_value>", loss=trained, owner=index, segment="tool_call")
            builder.text(_argument_text(value), loss=trained, owner=index, segment="tool_call")
            builder.special("</arg_value>", loss=trained, owner=index, segment="tool_call")
        builder.special("</tool_call>", loss=trained, owner=index, segment="tool_call")


@dataclasses.dataclass(frozen=True)
class RenderedDataset:
    """Rendered records plus every drop, counted by reason (DROP_REASONS) and kept with its error."""

    examples: list[RenderedChat]
    record_ids: list[Any]
    drop_counts: dict[str, int]
    drop_errors: list[ChatError]

    @property
    def num_dropped(self) -> int:
        return sum(self.drop_counts.values())

    def drop_report(self) -> str:
        """Counts per reason, then the first dropped record of each reason with its error."""
        counts = ", ".join(f"{reason}={n}" for reason, n in self.drop_counts.items() if n)
        firsts = {}
        for error in self.drop_errors:
            firsts.setdefault(error.reason, str(error))
        return f"dropped {self.num_dropped} ({counts})" + "".join(
            f"\n  first {reason}: {message}" for reason, message in firsts.items())

    def require_examples(self, source: str) -> "RenderedDataset":
        """Refuse an SFT set every record of which was dropped, saying why each was."""
        if not self.examples:
            raise DataError(f"{source}: the SFT dataset is empty: {self.num_dropped} record(s) read, none usable; "
                            f"{self.drop_report()}")
        return self


def render_dataset(
    records: Iterable[dict],
    tokenizer: Tokenizer,
    *,
    max_length: int | None = None,
    enable_thinking: bool = True,
    clear_thinking: bool = True,
) -> RenderedDataset:
    """Renders records {"id"?, "messages", "tools"?} for SFT; bad records are dropped and counted by reason.

    A record without an "id" is named by its position ("#3"). A record with no trained token (no assistant
    turn, or only erroneous ones) is dropped as "no_loss_tokens".
    """
    examples, record_ids, errors = [], [], []
    counts = collections.Counter({reason: 0 for reason in DROP_REASONS})
    for position, record in enumerate(records):
        record_id = record.get("id", f"#{position}") if isinstance(record, dict) else f"#{position}"
        try:
            if not isinstance(record, dict):
                detail = f"a record must be a dict with 'messages', got {record!r}"
                raise ChatError(record_id, "bad_field", detail)
            rendered = render_chat(
                record.get("messages"),
                tokenizer,
                tools=record.get("tools"),
                enable_thinking=enable_thinking,
                clear_thinking=clear_thinking,
                max_length=max_length,
                record_id=record_id,
            )
            if not rendered.loss_mask.any():
                detail = "has no trained token (no non-erroneous assistant turn)"
                raise ChatError(record_id, "no_loss_tokens", detail)
        except ChatError as error:
            counts[error.reason] += 1
            errors.append(error)
            continue
        examples.append(rendered)
        record_ids.append(record_id)
    return RenderedDataset(examples, record_ids, dict(counts), errors)


def read_chat_jsonl(path: str | os.PathLike, *, location_ids: bool = False) -> list[dict]:
    """Reads one chat record per line; a malformed line raises ValueError naming the file and line.
    `location_ids`: a record without an "id" is named "<path>:<line>", so a later drop names where it is."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"chat data file {path!r} does not exist")
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number}: a chat record must be a JSON object, got {record!r}")
            if location_ids and "id" not in record:
                record = {"id": f"{path}:{line_number}", **record}
            records.append(record)
    return records
