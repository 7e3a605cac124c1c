"""Synthetic tool-use conversations: deterministic, valid, correct tool results, erroneous turns marked."""

import operator
import re

import numpy as np
import pytest

from chat_stream import split_by_role
from glm5_jax.data.chat import read_chat_jsonl, render_chat, render_dataset
from experiments.chat_sft.synthetic_chat import CAPITALS, generate_records, main, write_jsonl
from glm5_jax.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def test_generation_is_deterministic_per_seed():
    assert generate_records(20, seed=3) == generate_records(20, seed=3)
    assert generate_records(20, seed=3) != generate_records(20, seed=4)
    ids = [record["id"] for record in generate_records(3, seed=5)]
    assert ids == ["synthetic-5-0", "synthetic-5-1", "synthetic-5-2"]


def test_every_record_renders_and_round_trips():
    records = generate_records(60, seed=0)
    result = render_dataset(records, TOKENIZER, max_length=4096)
    assert result.num_dropped == 0 and len(result.examples) == 60
    for record in records[:10]:
        rendered = render_chat(record["messages"], TOKENIZER, tools=record["tools"], clear_thinking=False)
        recovered = split_by_role(rendered.ids, TOKENIZER)
        assert [m["role"] for m in recovered] == [m["role"] for m in record["messages"]]
        assert [m["content"] for m in recovered] == [m["content"] for m in record["messages"]]


def test_tool_results_are_correct_and_only_marked_calls_are_wrong():
    records = generate_records(80, seed=1)
    for record in records:
        messages = record["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        for index, message in enumerate(messages):
            for call in message.get("tool_calls", []):
                result = messages[index + 1]
                assert result["role"] == "observation"
                if call["name"] == "calculator":
                    a, op, b = call["arguments"]["expression"].split()
                    assert result["content"] == str(ARITHMETIC[op](int(a), int(b)))
                    asked = re.search(r"(\d+) (plus|minus|times|[-+*]) (\d+)", question)
                    asked_op = {"plus": "+", "minus": "-", "times": "*"}.get(asked.group(2), asked.group(2))
                    assert (op != asked_op) == message.get("error", False)
                else:
                    country = call["arguments"]["country"]
                    assert result["content"] == CAPITALS[country]
        # The final answer is never erroneous, so every record has something to learn.
        assert messages[-1]["role"] == "assistant" and not messages[-1].get("error")


def test_error_fraction_one_marks_an_erroneous_call_in_every_record_with_zero_loss():
    records = generate_records(10, seed=2, error_fraction=1.0)
    for record in records:
        errors = [i for i, m in enumerate(record["messages"]) if m.get("error")]
        assert len(errors) == 1
        rendered = render_chat(record["messages"], TOKENIZER, tools=record["tools"])
        positions = np.flatnonzero(rendered.message_index == errors[0])
        assert len(positions) > 10
        assert rendered.loss_mask[positions].sum() == 0
    none = generate_records(30, seed=2, error_fraction=0.0)
    assert not any(m.get("error") for record in none for m in record["messages"])


def test_mix_contains_multi_turn_and_no_think_conversations():
    records = generate_records(200, seed=0)
    user_turns = [sum(m["role"] == "user" for m in r["messages"]) for r in records]
    assert min(user_turns) == 1 and max(user_turns) == 2
    no_think = [r for r in records if r["messages"][0]["content"].endswith("/nothink")]
    assert no_think
    for record in no_think:
        assert all("reasoning_content" not in m for m in record["messages"])
        rendered = render_chat(record["messages"], TOKENIZER, tools=record["tools"])
        assert "<think></think>" in TOKENIZER.decode(rendered.ids)
    assert 0.1 < sum(any(m.get("error") for m in r["messages"]) for r in records) / len(records) < 0.4


def test_jsonl_written_by_the_cli_reads_back(tmp_path):
    path = tmp_path / "chat.jsonl"
    main([str(path), "--num-records", "7", "--seed", "9"])
    assert read_chat_jsonl(path) == generate_records(7, seed=9)
    write_jsonl(generate_records(2, seed=1), path)
    assert read_chat_jsonl(path) == generate_records(2, seed=1)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="num_records must be a non-negative int, got -1"):
        generate_records(-1)
    with pytest.raises(ValueError, match=r"error_fraction must be in \[0, 1\], got 1.5"):
        generate_records(3, error_fraction=1.5)
