"""CUDA smoke and speed check: an 8-layer random Llama (hidden 1024, bf16 checkpoint) on the
GPU through tandem (sync, async, async float32; a prefix-cached rerun), against
transformers `generate` on the same GPU (per prompt for token agreement, left-padded batch
for time). 64 prompts of 16-199 tokens, 64 greedy tokens each, medians of 3.

Run on a CUDA machine: `python benchmarks/cuda_smoke.py` (writes $OUT/cuda_smoke.json, or
benchmarks/results/cuda_smoke.json when OUT is unset)."""

import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem import LLM, SamplingParams

out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "cuda_smoke.json"
res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
d = Path(tempfile.mkdtemp()) / "m"
cfg = LlamaConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
g = torch.Generator().manual_seed(1)
lens = torch.randint(16, 200, (64,), generator=g).tolist()
prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in lens]
shared = torch.randint(3, 32000, (96,), generator=g).tolist()
prefixed = [shared + p[:20] for p in prompts[:16]]
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
for name, kw in [
    ("sync", {"async_scheduling": False}),
    ("async", {"async_scheduling": True}),
    ("async_f32", {"async_scheduling": True, "dtype": "float32"}),
]:
    try:
        llm = LLM(model=str(d), max_model_len=512, enable_prefix_caching=True, **kw)
        m = llm.engine.executor.worker.model
        llm.generate(prompts[:2], params, use_tqdm=False)
        times, toks = [], None
        for _ in range(3):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            toks = [list(o.outputs[0].token_ids) for o in outs]
        p1 = [list(o.outputs[0].token_ids) for o in llm.generate(prefixed, params, use_tqdm=False)]
        p2 = [list(o.outputs[0].token_ids) for o in llm.generate(prefixed, params, use_tqdm=False)]
        res[name] = {
            "model_device": str(m.device),
            "kv_dtype": str(m.kv_caches[0][0].dtype),
            "median_s": sorted(times)[1],
            "tokens": toks,
            "prefix_rerun_equal": p1 == p2,
            "out_tok_per_s": 64 * 64 / sorted(times)[1],
        }
        llm.engine.shutdown()
    except Exception:
        res[name] = {"error": traceback.format_exc()[-3000:]}
try:
    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    ref = []
    for p in prompts[:8]:
        o = hf.generate(
            torch.tensor([p], device="cuda"), max_new_tokens=64, do_sample=False, min_new_tokens=64
        )
        ref.append(o[0, len(p) :].tolist())
    res["hf_ref_first8"] = ref
    for name in ("sync", "async"):
        if "tokens" in res.get(name, {}):
            t = res[name]["tokens"]
            res[name]["hf_prefix_agree"] = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), 64)
                for x, y in zip(t[:8], ref, strict=True)
            ]
    if "tokens" in res.get("sync", {}) and "tokens" in res.get("async", {}):
        res["sync_async_equal"] = res["sync"]["tokens"] == res["async"]["tokens"]
    # HF batched greedy (left padding), the same 64 prompts
    pad = max(lens)
    ids = torch.zeros(64, pad, dtype=torch.long)
    mask = torch.zeros(64, pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, pad - len(p) :] = torch.tensor(p)
        mask[i, pad - len(p) :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    res["hf_batched_median_s"] = sorted(times)[1]
except Exception:
    res["hf_error"] = traceback.format_exc()[-3000:]
for name in ("sync", "async", "async_f32"):
    if "tokens" in res.get(name, {}):
        res[name]["tokens"] = res[name]["tokens"][:2]
out.write_text(json.dumps(res, indent=1))
print(
    json.dumps(
        {
            k: (v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "tokens"})
            for k, v in res.items()
            if k != "hf_ref_first8"
        },
        indent=1,
    )
)
