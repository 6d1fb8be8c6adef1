"""The steps of `train_eagle_head.py`: EAGLE head self-distillation for SmolLM2 on the CPU.

Prompts from templates x subjects (`SUBJECTS` for training, `HELD_OUT_SUBJECTS` for
evaluation) in the chat template; the target's greedy generations with tandem's engine
(`make_llm`, `generate`); its last hidden states (`target_features`); the training loop
(`train`: soft cross-entropy through the shared LM head over a draft vocabulary, smooth-L1
on the next hidden state, one unrolled pass); and the held-out comparison of EAGLE against
no speculation on the same engine (`evaluate`). The script beside it is the command line
and the report; it imports this module as a sibling (run it as
`python examples/train_eagle_head.py`).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SUBJECTS = [
    "the water cycle",
    "volcanoes",
    "honey bees",
    "the moon",
    "photosynthesis",
    "rainbows",
    "the roman empire",
    "pyramids",
    "electricity",
    "magnets",
    "the internet",
    "computers",
    "dinosaurs",
    "whales",
    "the ocean",
    "mountains",
    "deserts",
    "rain forests",
    "recycling",
    "exercise",
    "sleep",
    "healthy food",
    "coffee",
    "tea",
    "bread",
    "chess",
    "football",
    "music",
    "painting",
    "poetry",
    "friendship",
    "a dog",
    "a cat",
    "a robot",
    "a dragon",
    "a small village",
    "a big city",
    "trains",
    "airplanes",
    "bicycles",
    "the weather",
    "climate change",
    "solar energy",
    "wind power",
    "the human heart",
    "the brain",
    "gardening",
    "cooking pasta",
    "learning a language",
    "saving money",
    "time management",
    "the stars",
    "black holes",
    "gravity",
    "atoms",
    "the periodic table",
    "earthquakes",
    "snow",
    "the seasons",
    "birds",
    "butterflies",
    "ants",
    "libraries",
    "books",
    "history",
]
HELD_OUT_SUBJECTS = [
    "lighthouses",
    "glaciers",
    "the printing press",
    "owls",
    "chocolate",
    "submarines",
    "kites",
    "coral reefs",
    "the violin",
    "penguins",
    "bridges",
    "the desert fox",
    "tornadoes",
    "a museum",
    "a train station",
    "fireflies",
]
TEMPLATES = [
    "Explain {} in simple terms.",
    "Write a short story about {}.",
    "List five interesting facts about {}.",
    "Why is {} important?",
    "Describe {} to a child.",
    "Write a short poem about {}.",
    "What are the main things to know about {}?",
    "Give me three tips related to {}.",
]


def default_output_dir() -> Path:
    from tandem.schema.cache_dir import cache_root

    return cache_root() / "eagle" / "smollm2-135m-instruct"


def build_prompts(subjects: list[str], n: int, seed: int) -> list[str]:
    pairs = [t.format(s) for s in subjects for t in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def chat_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a one-turn chat, in the model's chat template."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def make_llm(speculative: dict[str, Any] | None = None, **kw: Any) -> Any:
    from tandem.llm import LLM

    return LLM(
        model="default",
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_gib=1.0,  # 23k tokens: plenty for 32 x (prompt + 128), and small
        max_num_seqs=kw.pop("max_num_seqs", 32),
        speculative_config=speculative,
        **kw,
    )


def generate(
    llm: Any, prompt_ids: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], float]:
    from tandem.schema.sampling_params import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def target_features(
    model: Any, sequences: list[list[int]], batch_size: int = 8
) -> list[torch.Tensor]:
    """Last hidden states after the final norm, `[len, hidden]` per sequence (float32)."""
    features: list[torch.Tensor] = []
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    by_index: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = max(len(sequences[i]) for i in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.int64)
            mask = torch.zeros((len(chunk), width), dtype=torch.int64)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, i in enumerate(chunk):
                by_index[i] = hidden[row, : len(sequences[i])].float().clone()
    features = [by_index[i] for i in range(len(sequences))]
    return features


def train(
    target: Any,
    sequences: list[list[int]],
    features: list[torch.Tensor],
    minutes: float,
    batch_size: int,
    lr: float,
    seed: int,
    draft_vocab_size: int,
) -> tuple[Any, dict[str, Any]]:
    from dataclasses import replace

    from tandem.spec_decode.eagle_head import EagleHead, EagleHeadConfig, causal_attend

    torch.manual_seed(seed)
    # The head drafts from the most frequent tokens of the data (its draft vocabulary) and
    # the LM-head losses run over them only: a fraction of the 49k-row LM head, in
    # training and when drafting. Every greedy next token of the generations is a
    # candidate; the rare ones are given up.
    counts = torch.bincount(
        torch.tensor([t for s in sequences for t in s]), minlength=target.config.vocab_size
    )
    used = int((counts > 0).sum())
    if draft_vocab_size and draft_vocab_size < used:
        active = counts.topk(draft_vocab_size).indices.sort().values
    else:
        # Room left: add the unseen tokens with the lowest ids (BPE merges come roughly in
        # frequency order), so held-out text finds more of its tokens in the vocabulary.
        unseen = (counts == 0).nonzero().flatten()[: max(draft_vocab_size - used, 0)]
        active = torch.cat(((counts > 0).nonzero().flatten(), unseen)).sort().values
    size = int(active.numel())
    coverage = float(counts[active].sum() / counts.sum())
    config = replace(EagleHeadConfig.for_target(target.config), draft_vocab_size=size)
    head = EagleHead(config).float().train()
    head.draft_vocab.copy_(active)
    embed = target.model.embed_tokens
    head_weight = target.lm_head.weight.detach()[active]

    def lm_head(x: torch.Tensor) -> torch.Tensor:
        return x @ head_weight.T

    rotary = target.model.rotary_emb
    for p in target.parameters():
        p.requires_grad_(False)
    params = [p for p in head.parameters()]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget = minutes * 60.0
    rng = random.Random(seed)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    start = time.perf_counter()
    step = 0
    history: list[dict[str, float]] = []
    tokens_seen = 0
    warmup = 20
    while True:
        rng.shuffle(batches)
        for chunk in batches:
            elapsed = time.perf_counter() - start
            if elapsed > budget:
                return head.eval(), {
                    "steps": step,
                    "tokens_seen": tokens_seen,
                    "draft_vocab": size,
                    "draft_vocab_token_coverage": round(coverage, 4),
                    "log": history,
                }
            # cosine decay over the time budget, after a short warm-up
            scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
            for group in optim.param_groups:
                group["lr"] = lr * max(scale, 0.05)
            width = max(len(sequences[i]) for i in chunk) - 1  # positions 0 .. L-2
            ids = torch.zeros((len(chunk), width + 1), dtype=torch.int64)
            hid = torch.zeros((len(chunk), width + 1, head.config.hidden_size))
            valid = torch.zeros((len(chunk), width), dtype=torch.bool)
            for row, i in enumerate(chunk):
                n = len(sequences[i])
                ids[row, :n] = torch.tensor(sequences[i])
                hid[row, :n] = features[i]
                valid[row, : n - 1] = True
            positions = torch.arange(width)[None].expand(len(chunk), -1)
            embeds = embed(ids[:, 1:])  # token p+1 at position p
            cos, sin = rotary(embeds, positions)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
            target_feat = hid[:, 1:]  # hidden at p+1
            with torch.no_grad():
                teacher = F.log_softmax(lm_head(target_feat[valid]).float(), dim=-1)
            loss = torch.zeros(())
            inputs = hid[:, :-1]
            logs: dict[str, float] = {}
            for unroll, weight in ((0, 1.0), (1, 0.5)):
                feat = head(embeds, inputs, cos, sin, causal_attend)
                student = F.log_softmax(lm_head(feat[valid]).float(), dim=-1)
                ce = -(teacher.exp() * student).sum(-1).mean()
                reg = F.smooth_l1_loss(feat[valid], target_feat[valid])
                loss = loss + weight * (ce + reg)
                with torch.no_grad():
                    top1 = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
                logs[f"ce{unroll}"], logs[f"top1_{unroll}"] = ce.item(), top1.item()
                logs[f"reg{unroll}"] = reg.item()
                # the next pass reads the head's own feature for p (it stands for hidden p+1)
                inputs = torch.cat((hid[:, :1], feat[:, :-1]), dim=1)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            tokens_seen += int(valid.sum())
            if step % 10 == 0:
                entry = {"step": step, "seconds": round(time.perf_counter() - start, 1)}
                entry.update({k: round(v, 4) for k, v in logs.items()})
                history.append(entry)
                print(json.dumps(entry), flush=True)


def evaluate(
    head_dir: Path, prompt_ids: list[list[int]], max_tokens: int, k: int, batch1_prompts: int
) -> dict[str, Any]:
    """Held-out prompts, no-spec vs EAGLE on the same engine settings (outputs must be
    equal): all prompts at once (batch = len(prompt_ids)), and the first `batch1_prompts`
    one at a time (batch 1, where a CPU decode step is weight streaming and verifying k+1
    tokens costs about as much as one)."""
    results: dict[str, Any] = {}
    eagle = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k}
    for label, prompts, seqs in (
        (f"batch_{len(prompt_ids)}", prompt_ids, len(prompt_ids)),
        ("batch_1", prompt_ids[:batch1_prompts], 1),
    ):
        section: dict[str, Any] = {"prompts": len(prompts)}
        outputs = {}
        for name, spec in (("no_spec", None), ("eagle", eagle)):
            llm = make_llm(spec, max_num_seqs=seqs)
            generate(llm, prompts[:1], 8)  # warm-up
            sched = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
            before = sched.spec_metrics.num_steps
            tokens, seconds = generate(llm, prompts, max_tokens)
            entry: dict[str, Any] = {
                "seconds": round(seconds, 3),
                "output_tokens": sum(len(t) for t in tokens),
            }
            entry["tokens_per_s"] = round(entry["output_tokens"] / seconds, 1)
            if spec is not None:
                entry["warm_up_verify_steps_included"] = before
                entry.update(sched.spec_metrics.as_dict())
            section[name] = entry
            outputs[name] = tokens
            llm.engine.shutdown()
        section["outputs_equal"] = outputs["eagle"] == outputs["no_spec"]
        section["speedup"] = round(section["no_spec"]["seconds"] / section["eagle"]["seconds"], 3)
        results[label] = section
    return results
