"""Byte tokenizer ids and round trips, special-token handling, and HFTokenizer on a tiny trained BPE."""

import pytest

from glm5_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# Written out by hand: GLM's special tokens take ids 256.. in this fixed order.
EXPECTED_SPECIAL_IDS = {
    "<|endoftext|>": 256, "[MASK]": 257, "[gMASK]": 258, "[sMASK]": 259, "<sop>": 260, "<eop>": 261,
    "<|system|>": 262, "<|user|>": 263, "<|assistant|>": 264, "<|observation|>": 265,
    "<think>": 266, "</think>": 267, "<tool_call>": 268, "</tool_call>": 269,
    "<arg_key>": 270, "</arg_key>": 271, "<arg_value>": 272, "</arg_value>": 273,
    "<tool_response>": 274, "</tool_response>": 275,
}


def test_byte_tokenizer_ids_are_utf8_bytes_and_stable_specials():
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("A\u00e9") == [65, 0xC3, 0xA9]
    assert {name: tokenizer.special_token_id(name) for name in EXPECTED_SPECIAL_IDS} == EXPECTED_SPECIAL_IDS
    assert tokenizer.vocab_size == 256 + 20
    assert tokenizer.eos_id == 256
    assert tokenizer.eos_ids == (256, 263, 265)  # end of text, <|user|>, <|observation|>
    assert tokenizer.special_token_id("<not registered>") is None


def test_marker_text_is_not_a_special_token_unless_allowed():
    tokenizer = ByteTokenizer()
    plain = tokenizer.encode("hi<|user|>")
    assert plain == list(b"hi<|user|>")
    assert tokenizer.encode("hi<|user|>", allow_special=True) == [104, 105, 263]
    # The longest special wins where one is a prefix of another string.
    assert tokenizer.encode("</think><think>", allow_special=True) == [267, 266]


def test_byte_round_trip_with_specials_and_non_ascii():
    tokenizer = ByteTokenizer()
    text = "h\u00e9llo \u4e16\u754c \U0001f642<think>x</think>[gMASK]\n\t<|observation|>"
    for allow_special in (False, True):
        assert tokenizer.decode(tokenizer.encode(text, allow_special=allow_special)) == text
    ids = tokenizer.encode(text, allow_special=True)
    assert ids.count(266) == ids.count(267) == ids.count(258) == ids.count(265) == 1


def test_byte_offsets_point_at_characters():
    tokenizer = ByteTokenizer()
    ids, offsets = tokenizer.encode_with_offsets("a\u00e9<sop>b", allow_special=True)
    assert ids == [97, 0xC3, 0xA9, 260, 98]
    assert offsets == [(0, 1), (1, 2), (1, 2), (2, 7), (7, 8)]


def test_add_special_tokens_appends_stable_ids():
    tokenizer = ByteTokenizer(extra_special_tokens=["<extra_a>"])
    assert tokenizer.special_token_id("<extra_a>") == 276
    assert tokenizer.add_special_tokens(["<think>", "<extra_b>", "<extra_a>"]) == [266, 277, 276]
    assert tokenizer.vocab_size == 278
    assert tokenizer.decode([277, 104]) == "<extra_b>h"
    with pytest.raises(ValueError, match="non-empty strings"):
        tokenizer.add_special_tokens([""])
    with pytest.raises(ValueError, match="single string"):
        tokenizer.add_special_tokens("<x>")


def test_decode_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="token id 276 is outside the vocabulary"):
        ByteTokenizer().decode([65, 276])
    with pytest.raises(ValueError, match="text must be a str"):
        ByteTokenizer().encode(b"bytes")


def test_load_tokenizer_byte_and_missing_path(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match="nope"):
        load_tokenizer(str(missing))
    with pytest.raises(ValueError, match="does not exist"):
        HFTokenizer(missing)


def _train_tiny_bpe(path, special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=special_tokens
    )
    corpus = ["hello world", "the weather in Paris", "h\u00e9llo w\u00f6rld", "what is 17 times 23?"] * 5
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer


def test_hf_tokenizer_keeps_present_specials_and_adds_missing(tmp_path):
    path = tmp_path / "tokenizer.json"
    base = _train_tiny_bpe(path, special_tokens=["<|endoftext|>", "<think>"])
    base_size = base.get_vocab_size(with_added_tokens=True)
    tokenizer = load_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.special_token_id("<|endoftext|>") == base.token_to_id("<|endoftext|>") == 0
    assert tokenizer.special_token_id("<think>") == base.token_to_id("<think>") == 1
    present = ("<|endoftext|>", "<think>")
    added = [tokenizer.special_token_id(name) for name in EXPECTED_SPECIAL_IDS if name not in present]
    assert sorted(added) == list(range(base_size, base_size + 18))
    assert tokenizer.vocab_size == base_size + 18
    assert tokenizer.eos_id == 0
    assert tokenizer.add_special_tokens(["<think>"]) == [1]


def test_hf_tokenizer_encode_decode_and_marker_injection(tmp_path):
    path = tmp_path / "tokenizer.json"
    base = _train_tiny_bpe(path, special_tokens=["<|endoftext|>"])
    tokenizer = HFTokenizer(path)
    user_id = tokenizer.special_token_id("<|user|>")
    text = "h\u00e9llo <|user|> the weather"
    plain = tokenizer.encode(text)
    assert user_id not in plain
    assert plain == base.encode(text, add_special_tokens=False).ids  # base knows no <|user|>: plain text
    assert tokenizer.decode(plain) == text
    with_special = tokenizer.encode(text, allow_special=True)
    assert with_special.count(user_id) == 1
    assert tokenizer.decode(with_special) == text
    ids, offsets = tokenizer.encode_with_offsets("hello world")
    assert len(ids) == len(offsets) and offsets[0][0] == 0 and offsets[-1][1] == len("hello world")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])
