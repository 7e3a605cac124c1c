"""Prompts files of `glm5 generate / rollout`: the three line kinds, the chat template's thinking modes, ids."""

import json

import pytest

from glm5_jax.commands.prompts import read_prompts
from glm5_jax.commands.source import CommandError
from glm5_jax.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "greet back",
                                                     "content": "hello"}, {"role": "user", "content": "bye"}]


def _read(tmp_path, records, **kwargs):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    options = {"chat": False, "thinking": "on", **kwargs}
    return read_prompts(text=None, path=str(path), tokenizer=TOKENIZER, vocab_size=288, **options)


def _text(prompt) -> str:
    return TOKENIZER.decode(list(prompt.ids))


def test_the_three_kinds_of_line_and_their_ids(tmp_path):
    prompts = _read(tmp_path, [{"prompt": "x = ", "answer": "1"}, {"id": 7, "prompt_ids": [1, 2]},
                               {"messages": CONVERSATION[:1]}])
    assert [p.prompt_id for p in prompts] == ["line1", "7", "line3"]
    assert _text(prompts[0]) == "x = " and prompts[0].record["answer"] == "1"
    assert prompts[1].ids == (1, 2)
    assert _text(prompts[2]) == "[gMASK]<sop><|user|>hi<|assistant|><think>"


@pytest.mark.parametrize("thinking, ending, keeps_reasoning", [
    ("on", "<|assistant|><think>", False), ("off", "<|assistant|><think></think>", False),
    ("interleaved", "<|assistant|><think>", True)])
def test_thinking_modes_of_the_chat_template(tmp_path, thinking, ending, keeps_reasoning):
    (prompt,) = _read(tmp_path, [{"messages": CONVERSATION}], thinking=thinking)
    assert _text(prompt).endswith("<|user|>bye" + ending)
    assert ("greet back" in _text(prompt)) == keeps_reasoning
    (plain,) = _read(tmp_path, [{"prompt": "bye"}], chat=True, thinking=thinking)
    assert _text(plain) == "[gMASK]<sop><|user|>bye" + ending


def test_duplicate_ids_and_bad_fields_are_refused_by_line(tmp_path):
    with pytest.raises(CommandError, match=r"p.jsonl:2: id 'a' is also the id of .*p.jsonl:1"):
        _read(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(CommandError, match=r"p.jsonl:1: field 'prompt_ids' must be a non-empty list of integers"):
        _read(tmp_path, [{"prompt_ids": ["a"]}])
    with pytest.raises(CommandError, match=r"p.jsonl:1: .*role"):
        _read(tmp_path, [{"messages": [{"role": "wizard", "content": "x"}]}])
