"""Measure what a chat-SFT run learned, on held-out conversations; prints and writes one JSON summary.

    python experiments/chat_sft/evaluate_sft.py RUN_DIR HELDOUT.jsonl OUT.json [--samples 4]

1. Ending the turn. For every non-erroneous assistant turn, the prompt is the conversation before it rendered
   with the generation prompt; the model decodes greedily until it emits a role marker or <|endoftext|>.
   The right stop is <|observation|> after a tool call, <|user|> when the user speaks next, <|endoftext|>
   after the last answer. Reported: the share of turns that stopped at all, stopped on the right marker,
   stopped on the right kind of marker (tool call -> observation; answer -> user or end, which the model
   cannot tell apart), and reproduced the reference turn token for token.
2. Imitating the erroneous span. For every held-out arithmetic question (first user message), the first
   point where the assistant states the operation: the operator word in "The user wants {a} ..." when the
   turn thinks, the operator in the calculator call when it does not (/nothink). Reported: the probability
   the model puts on the correct vs the two wrong operators there (teacher forcing), how often the greedy
   choice is wrong, and how often a calculator call sampled at temperature 1 uses a wrong operator.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from glm5_jax.data.chat import read_chat_jsonl, render_chat
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.config.experiment import experiment_from_dict
from glm5_jax.generation import SamplingParams, generate
from glm5_jax.model.transformer import forward, init
from glm5_jax.runner import load_params

STOP_MARKERS = ("<|user|>", "<|assistant|>", "<|observation|>", "<|system|>", "<|endoftext|>")
OPERATOR_WORDS = {"+": "plus", "-": "minus", "*": "times"}
QUESTION = re.compile(r"(\d+) (plus|minus|times|\+|-|\*) (\d+)")
CALL_EXPRESSION = re.compile(r"<arg_value>\s*(\d+) ([+*-]) (\d+)\s*</arg_value>")


def load_run(run_dir: Path):
    cfg = experiment_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    params = load_params(run_dir, init(cfg.model, jax.random.key(0)))
    return cfg, params


def expected_stop(messages: list[dict], index: int) -> str:
    if messages[index].get("tool_calls"):
        return "<|observation|>"
    following = messages[index + 1]["role"] if index + 1 < len(messages) else None
    return "<|user|>" if following == "user" else "<|endoftext|>"


def turn_cases(records: list[dict], tokenizer) -> list[dict]:
    cases = []
    for record in records:
        messages = record["messages"]
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or message.get("error"):
                continue
            prompt = render_chat(messages[:index], tokenizer, add_generation_prompt=True).ids.tolist()
            turn = render_chat(messages[: index + 1], tokenizer).ids.tolist()
            assert turn[: len(prompt)] == prompt, "the generation prompt must prefix the rendered turn"
            stop = expected_stop(messages, index)
            reference = turn[len(prompt):-1] + [tokenizer.special_token_id(stop)]
            kind = "tool_call" if message.get("tool_calls") else "answer"
            cases.append({"prompt": prompt, "reference": reference, "stop": stop, "kind": kind})
    return cases


def batched_generate(params, cfg, prompts: list[list[int]], sampling: SamplingParams, rng, batch: int = 64):
    """Generated ids per prompt (each ends with its stop id when one was emitted). The prefill gathers up to
    max_len latent rows per prompt position, so memory grows as batch * max_len**2: keep batches small."""
    max_len = max(len(p) for p in prompts) + sampling.max_new_tokens
    outputs = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        chunk = chunk + [chunk[0]] * (batch - len(chunk)) if len(prompts) > batch else chunk
        rng, key = jax.random.split(rng)
        out = generate(params, chunk, config=cfg.model, sampling=sampling, rng=key, max_len=max_len)
        outputs += [out.tokens[row, :out.lengths[row]].tolist() for row in range(len(chunk))]
    return outputs[:len(prompts)]


def evaluate_turn_ending(params, cfg, tokenizer, records: list[dict]) -> dict:
    cases = turn_cases(records, tokenizer)
    stop_ids = {tokenizer.special_token_id(m): m for m in STOP_MARKERS}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max(len(c["reference"]) for c in cases) + 32,
                              eos_ids=tuple(stop_ids))
    generated = batched_generate(params, cfg, [c["prompt"] for c in cases], sampling, jax.random.key(0))
    rows = []
    for case, ids in zip(cases, generated):
        emitted = stop_ids.get(ids[-1]) if ids else None
        answer_ok = case["kind"] == "answer" and emitted in ("<|user|>", "<|endoftext|>")
        rows.append({"kind": case["kind"], "stopped": emitted is not None, "right_marker": emitted == case["stop"],
                     "right_kind": answer_ok or (case["kind"] == "tool_call" and emitted == "<|observation|>"),
                     "exact": ids == case["reference"]})

    def share(selected: list[dict]) -> dict:
        keys = ("stopped", "right_marker", "right_kind", "exact")
        return {"turns": len(selected), **{k: round(float(np.mean([r[k] for r in selected])), 4) for k in keys}}

    return {"all": share(rows), **{kind: share([r for r in rows if r["kind"] == kind])
                                   for kind in ("tool_call", "answer")}}


def arithmetic_cases(records: list[dict], tokenizer) -> list[dict]:
    cases = []
    for record in records:
        question = record["messages"][0]["content"]
        match = QUESTION.search(question)
        if not match:
            continue
        a, token, _ = match.groups()
        op = token if token in OPERATOR_WORDS else {w: o for o, w in OPERATOR_WORDS.items()}[token]
        prompt = render_chat(record["messages"][:1], tokenizer, add_generation_prompt=True).ids.tolist()
        thinking = not question.rstrip().endswith("/nothink")
        if thinking:  # the operator is first stated in the reasoning; the words start with distinct bytes
            prefix, candidates = f"The user wants {a} ", {o: w[0] for o, w in OPERATOR_WORDS.items()}
        else:
            prefix = f"<tool_call>calculator<arg_key>expression</arg_key><arg_value>{a} "
            candidates = {o: o for o in OPERATOR_WORDS}
        forced = prompt + tokenizer.encode(prefix, allow_special=True)
        cases.append({"prompt": prompt, "forced": forced, "op": op, "thinking": thinking,
                      "candidates": {o: tokenizer.encode(c)[0] for o, c in candidates.items()}})
    return cases


def decision_probabilities(params, cfg, cases: list[dict]) -> np.ndarray:
    """[cases, V] next-token probabilities after each teacher-forced prefix."""
    length = max(len(c["forced"]) for c in cases)
    tokens = np.zeros((len(cases), length), np.int32)
    segments = np.zeros((len(cases), length), np.int32)
    for row, case in enumerate(cases):
        tokens[row, :len(case["forced"])] = case["forced"]
        segments[row, :len(case["forced"])] = 1
    logits = jax.jit(lambda p, t, s: forward(p, t, config=cfg.model, segment_ids=s, mtp_steps=0).logits)(
        params, jnp.asarray(tokens), jnp.asarray(segments))
    last = np.array([len(c["forced"]) - 1 for c in cases])
    return np.asarray(jax.nn.softmax(logits[np.arange(len(cases)), last], axis=-1))


def evaluate_error_imitation(params, cfg, tokenizer, records: list[dict], samples: int) -> dict:
    cases = arithmetic_cases(records, tokenizer)
    probs = decision_probabilities(params, cfg, cases)
    correct, wrong, greedy_wrong = [], [], []
    for case, p in zip(cases, probs):
        ids = case["candidates"]
        correct.append(p[ids[case["op"]]])
        wrong.append(sum(p[ids[o]] for o in ids if o != case["op"]))
        greedy_wrong.append(max(ids, key=lambda o: p[ids[o]]) != case["op"])

    stop_ids = tuple(tokenizer.special_token_id(m) for m in STOP_MARKERS)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=160, eos_ids=stop_ids)
    prompts = [c["prompt"] for c in cases for _ in range(samples)]
    generated = batched_generate(params, cfg, prompts, sampling, jax.random.key(1))
    calls = {"correct_op": 0, "wrong_op": 0, "other": 0}
    for index, ids in enumerate(generated):
        # an untrained model can sample the padding ids above the tokenizer's vocabulary
        match = CALL_EXPRESSION.search(tokenizer.decode([t for t in ids if t < tokenizer.vocab_size]))
        if match is None:
            calls["other"] += 1
        else:
            calls["correct_op" if match.group(2) == cases[index // samples]["op"] else "wrong_op"] += 1
    parsed = calls["correct_op"] + calls["wrong_op"]
    return {
        "questions": len(cases),
        "thinking_questions": int(sum(c["thinking"] for c in cases)),
        "p_correct_operator": round(float(np.mean(correct)), 4),
        "p_wrong_operators": round(float(np.mean(wrong)), 4),
        "greedy_wrong_rate": round(float(np.mean(greedy_wrong)), 4),
        "sampled_calls": {**calls, "samples_per_question": samples},
        "sampled_wrong_op_rate": round(calls["wrong_op"] / max(parsed, 1), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("heldout", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=4, help="sampled first turns per arithmetic question")
    args = parser.parse_args()
    cfg, params = load_run(args.run_dir)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    records = read_chat_jsonl(args.heldout)
    summary = {"run_dir": str(args.run_dir), "heldout": str(args.heldout), "records": len(records),
               "turn_ending": evaluate_turn_ending(params, cfg, tokenizer, records),
               "error_imitation": evaluate_error_imitation(params, cfg, tokenizer, records, args.samples)}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
