"""Data refusals name the file and line (or record), the field and the reason, and list what filters dropped."""

import json

import pytest

from glm5_jax.data.chat import read_chat_jsonl, render_dataset
from glm5_jax.data.pretrain import DataError
from glm5_jax.data.rollouts import RolloutError, filter_and_pad, read_rollouts, require_kept
from glm5_jax.data.tokenizer import load_tokenizer


def _rollout(rid, **extra):
    return {"rollout_id": rid, "group_id": "g", "prompt_ids": [1, 2], "response_ids": [3, 4],
            "rollout_logprobs": [-0.5, -0.5], "loss_mask": [1, 1], "reward": 1.0, "temperature": 1.0,
            "weight_versions": [0], **extra}


def test_chat_records_are_named_by_file_and_line_and_every_drop_is_reported(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n"
                    + json.dumps({"id": "named", "text": "no messages"}) + "\n")
    records = read_chat_jsonl(path, location_ids=True)
    assert [r["id"] for r in records] == [f"{path}:1", f"{path}:3", "named"]
    assert "id" not in read_chat_jsonl(path)[0]
    rendered = render_dataset(records, load_tokenizer("byte"))
    report = rendered.drop_report()
    assert report.startswith("dropped 2 (empty=1, unknown_role=1)")
    assert f"chat record '{path}:3': message 0 has unknown role 'bot'" in report
    assert "chat record 'named': 'messages' must be a non-empty list" in report
    rendered.require_examples(str(path))  # one record survived
    nothing = render_dataset(records[1:], load_tokenizer("byte"))
    with pytest.raises(DataError, match=r"chats.jsonl: the SFT dataset is empty: 2 record\(s\) read.*unknown_role=1"):
        nothing.require_examples(str(path))


def test_rollout_jsonl_errors_name_the_file_and_the_real_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_rollout("a")) + "\n\n" + '{"rollout_id": "b", }\n')
    with pytest.raises(RolloutError, match=r"r.jsonl:3: not valid JSON \(Expecting property name"):
        read_rollouts(path)
    path.write_text(json.dumps(_rollout("a")) + "\n" + json.dumps(_rollout("b", reward="high")) + "\n")
    with pytest.raises(RolloutError, match=r"r.jsonl:2: rollout 'b': field 'reward' is 'high'; expected a number"):
        read_rollouts(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(RolloutError, match=r"r.jsonl:1: a rollout record must be a JSON object"):
        read_rollouts(path)


def test_nothing_left_after_filtering_lists_the_counts(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(_rollout(f"r{i}", env_failed=True)) + "\n" for i in range(3)))
    kept, counts = filter_and_pad(read_rollouts(path), current_version=0, max_staleness=None)
    with pytest.raises(RolloutError, match=r"r.jsonl: no rollout left.*input=3, dropped_env_failed=3"):
        require_kept(kept, counts, str(path))
    require_kept([object()], counts, str(path))  # something kept: no error


def test_pretraining_jsonl_without_documents_names_the_file(tmp_path):
    from glm5_jax.data.pretrain import read_jsonl

    path = tmp_path / "blank.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(DataError, match=r"blank.jsonl: no documents \(every line is blank\)"):
        read_jsonl(path)
