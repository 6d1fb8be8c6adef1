"""`make demo`: generate with the embedded SmolLM2-135M-Instruct on this machine.

Runs a small batch of chat prompts through the full engine (async scheduling, paged
attention, prefix caching), prints each answer, and reports throughput.
"""

from __future__ import annotations

import time

from tandem import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three primary colours.",
    "What is 12 times 12?",
    "Give a short tip for staying focused.",
]


def main() -> None:
    start = time.perf_counter()
    llm = LLM()  # the embedded default model; converted once into ~/.cache/tandem
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=64)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = llm.chat(conversations, params)
    done = time.perf_counter()
    total_tokens = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        completion = out.outputs[0]
        total_tokens += len(completion.token_ids)
        print(
            f"> {prompt}\n{completion.text.strip()}\n  [{len(completion.token_ids)} tokens, {completion.finish_reason}]\n"
        )
    print(
        f"model {llm.config.model.model} | async_scheduling={llm.config.scheduler.async_scheduling} | "
        f"load {loaded - start:.1f}s | {total_tokens} tokens in {done - loaded:.1f}s "
        f"({total_tokens / (done - loaded):.1f} tok/s, batch of {len(PROMPTS)})"
    )


if __name__ == "__main__":
    main()
