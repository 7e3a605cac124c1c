"""`glm5 generate SOURCE`: sample from a trained run, an import or a Hugging Face checkpoint.

Prompts of any lengths are generated together (`--batch-size` at a time; chunk k samples with
`jax.random.fold_in(jax.random.key(seed), k)`), through the library's loop (`generation.generate`, or
`generation.speculative_generate` with `--speculative N` MTP drafts). A row stops at the tokenizer's stop
tokens (end of text, the next role marker) or at `--max-new-tokens`. A lone prompt's text is streamed to
stdout as it is decoded; several prompts print as each batch ends; `--json` prints one record per prompt
(id, prompt and generated token ids, text, logprobs) instead. Progress and speed go to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from glm5_jax.commands.prompts import Prompt, check_context
from glm5_jax.commands.source import CommandError, ModelSource, decode_text
from glm5_jax.distributed.batch_local import context_split
from glm5_jax.generation import GenerationOutput, SamplingParams, generate, speculative_generate


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    sampling: SamplingParams
    seed: int = 0
    speculative: int = 0           # MTP drafts per verify forward; 0 = plain decoding
    batch_size: int = 0            # prompts per batch; 0 = all at once
    collect_routing: bool = False

    def validate(self, source: ModelSource) -> "GenerateOptions":
        self.sampling.validate(source.config.vocab_size)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 0:
            raise CommandError(f"--batch-size={self.batch_size!r} is invalid: must be an integer >= 0 (0 = all)")
        if self.speculative < 0:
            raise CommandError(f"--speculative={self.speculative} is invalid: must be >= 1 drafts (0 = off)")
        if self.speculative and not source.config.num_nextn_predict_layers:
            raise CommandError(f"--speculative={self.speculative} is invalid: {source.path} has no MTP module "
                               "(num_nextn_predict_layers=0) to draft with")
        return self


class TextStream:
    """Writes a row's text to `sink` as tokens arrive, holding back a partly decoded character."""

    def __init__(self, source: ModelSource, sink=sys.stdout):
        self.source, self.sink, self.written = source, sink, ""

    def __call__(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        text = decode_text(self.source, tokens[0, :counts[0]]).rstrip("\ufffd")
        if text.startswith(self.written) and len(text) > len(self.written):
            self.sink.write(text[len(self.written):])
            self.sink.flush()
            self.written = text


def batches(prompts: list[Prompt], batch_size: int) -> Iterator[tuple[int, list[Prompt]]]:
    size = batch_size or len(prompts)
    for index, start in enumerate(range(0, len(prompts), size)):
        yield index, prompts[start:start + size]


def run_batch(source: ModelSource, prompts: list[Prompt], options: GenerateOptions, index: int,
              on_tokens: Callable | None = None) -> GenerationOutput:
    """One batch through the library's generation loop, with batch `index`'s key."""
    rng = jax.random.fold_in(jax.random.key(options.seed), index)
    ids = [list(p.ids) for p in prompts]
    max_len = max(map(len, ids)) + options.sampling.max_new_tokens + options.speculative
    if options.collect_routing:
        # A cache of at least index_topk rows records index_topk indexer slots per position in every batch,
        # so records of different batches train together (replay needs train.seq_len >= index_topk too).
        max_len = min(max(max_len, source.config.index_topk), source.config.max_position_embeddings)
    split = context_split(source.mesh)
    max_len += -max_len % split  # the cache's slots split evenly over `context`
    kwargs = dict(config=source.config, sampling=options.sampling, rng=rng, max_len=max_len,
                  collect_routing=options.collect_routing, on_tokens=on_tokens)
    # The parameters carry their mesh shardings; jit partitions the loop's steps from them.
    if options.speculative:
        return speculative_generate(source.params, ids, num_draft=options.speculative, mesh=source.mesh, **kwargs)
    return generate(source.params, ids, mesh=source.mesh, **kwargs)


def prompt_record(source: ModelSource, prompt: Prompt, output: GenerationOutput, row: int) -> dict:
    n = int(output.lengths[row])
    return {"id": prompt.prompt_id, "prompt_ids": list(prompt.ids), "tokens": output.tokens[row, :n].tolist(),
            "text": decode_text(source, output.tokens[row, :n]),
            "logprobs": [round(float(x), 6) for x in output.logprobs[row, :n]],
            "stopped_on_eos": bool(output.stopped_on_eos[row]), "temperature": output.temperature}


def run_generate(source: ModelSource, prompts: list[Prompt], options: GenerateOptions, *, as_json: bool,
                 out=sys.stdout, log=sys.stderr) -> dict:
    """Generate for every prompt; print as the module docstring says; return a summary."""
    options = options.validate(source)
    check_context(prompts, max_new_tokens=options.sampling.max_new_tokens, lookahead=options.speculative,
                  context=source.config.max_position_embeddings)
    generated, seconds, accepted = 0, 0.0, []
    for index, chunk in batches(prompts, options.batch_size):
        stream = TextStream(source, out) if len(chunk) == 1 and not as_json else None
        start = time.perf_counter()
        output = run_batch(source, chunk, options, index, stream)
        seconds += time.perf_counter() - start
        generated += int(output.lengths.sum())
        if output.acceptance_length is not None:
            accepted.append(output.acceptance_length)
        for row, prompt in enumerate(chunk):
            record = prompt_record(source, prompt, output, row)
            if as_json:
                out.write(json.dumps(record) + "\n")
            elif stream is not None:
                out.write("\n")
            else:
                out.write(f"[{prompt.prompt_id}] {record['text']}\n")
        out.flush()
    summary = {"prompts": len(prompts), "generated_tokens": generated, "seconds": round(seconds, 2),
               "tokens_per_s": round(generated / max(seconds, 1e-9), 1)}
    if accepted:
        length = float(np.mean(accepted))
        summary.update(acceptance_length=round(length, 3),
                       draft_acceptance_rate=round((length - 1) / options.speculative, 3))
    note = (f"; {summary['acceptance_length']} tokens per verify forward, {summary['draft_acceptance_rate']:.1%} "
            f"of {options.speculative} drafts accepted" if accepted else "")
    log.write(f"generated {generated} tokens for {len(prompts)} prompt(s) in {seconds:.1f}s "
              f"({summary['tokens_per_s']} tokens/s, compile included){note}\n")
    return summary
