"""Runs a token-id workload through llama.cpp (llama-cpp-python's low-level `llama_cpp` API).

Run with the peers venv's python (benchmarks/peers/setup_llamacpp.sh builds it):

    .venv-llamacpp/bin/python llamacpp_runner.py --model FILE.gguf --threads N \
        --workload W.json [--mode single|batch] [--repeats R]

The workload is `{"prompts": [[token ids], ...], "max_tokens": 128}` (a tandem workload's
`{"requests": [{"prompt_token_ids": [...], "max_tokens": n}, ...]}` is read too, using the
largest max_tokens). Prompts are token ids, never text, so every engine sees the same tokens.
Decoding is greedy (numpy argmax over the logits) and ignores EOS: every sequence generates
exactly max_tokens tokens.

--mode single: one sequence at a time. For each prompt, prefill it, take the first token, then
decode max_tokens - 1 tokens one by one. Reports `ttft_ms` (median of prefill + first token)
and `decode_ms_per_token` (median over prompts and repeats of decode wall time / decoded
tokens, the prefill and first token excluded).

--mode batch: every prompt at once, as parallel sequences (seq_id i for prompt i, n_seq_max =
number of prompts), as llama.cpp's examples/batched does: one llama_batch of every sequence's
prompt tokens (in chunks of n_batch), logits only for each sequence's last token, then each step
one token per unfinished sequence. Reports `output_tokens_per_s` (generated tokens / wall time
from the start of prefill to the last token) and `decode_tokens_per_s` (tokens after each
sequence's first / decode-only wall time), medians over repeats.

Context: n_ctx holds every sequence (sum of prompt + max_tokens, rounded up to 256), in one KV
buffer shared by all sequences (`kv_unified=True`, as sequences have different lengths).
--no-kv-unified gives each sequence its own KV stream instead (llama.cpp pads each to 256
cells: n_ctx = prompts x (longest prompt + max_tokens, rounded up to 256), more memory); it
reproduces single mode's logits exactly, while the unified buffer's masked attention differs
from single mode by float rounding (which can flip near-ties), and it decoded about 20% faster
(57 vs 46 tokens/s, 64 sequences, 1 thread, busy 2-core AMD EPYC, SmolLM2-135M Q4_1). n_batch
2048 and n_ubatch 512 (llama.cpp's defaults; n_batch is capped at n_ctx) are kept: n_ubatch 128
was no faster (prefill and decode within noise). n_threads = n_threads_batch = --threads; flash
attention is llama.cpp's default (auto). One warm-up (16 tokens, 4 generated) precedes timing.

Prints one JSON object on stdout; llama.cpp's log output is silenced.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

WARMUP_PROMPT = list(range(100, 116))  # the same as tandem.bench.WARMUP_PROMPT
WARMUP_TOKENS = 4
FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Drops llama.cpp / ggml log lines (kept referenced at module level for ctypes)."""


def round_up(n: int, m: int = 256) -> int:
    return -(-n // m) * m


class Engine:
    """One llama.cpp model + context + reusable llama_batch, with numpy views of the batch."""

    def __init__(
        self,
        model_path: str,
        *,
        threads: int,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        n_ubatch: int,
        kv_unified: bool,
        flash_attn: str,
    ) -> None:
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"could not load {model_path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = kv_unified
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("could not create the llama.cpp context")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.settings = {
            "n_ctx": llama_cpp.llama_n_ctx(self.ctx),
            "n_batch": self.n_batch,
            "n_ubatch": llama_cpp.llama_n_ubatch(self.ctx),
            "n_seq_max": llama_cpp.llama_n_seq_max(self.ctx),
            "kv_unified": kv_unified,
            "flash_attn": flash_attn,
        }
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        b, n = self.batch, self.n_batch
        self.tok = np.ctypeslib.as_array(b.token, shape=(n,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        self.want = np.ctypeslib.as_array(b.logits, shape=(n,))
        self.seq_slots = [b.seq_id[i] for i in range(n)]
        self.seq_now = np.full(n, -1, dtype=np.int64)  # what each batch slot's seq_id holds

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    def decode(
        self, tokens: np.ndarray, pos: np.ndarray, seqs: np.ndarray, want: np.ndarray
    ) -> np.ndarray:
        """Decodes one batch (at most n_batch tokens); returns the logits rows of the tokens
        with want != 0, in batch order, as an (n_out, n_vocab) view of llama.cpp's buffer."""
        n = len(tokens)
        self.tok[:n] = tokens
        self.pos[:n] = pos
        self.want[:n] = want
        for i in np.flatnonzero(self.seq_now[:n] != seqs):
            self.seq_slots[i][0] = int(seqs[i])
            self.seq_now[i] = seqs[i]
        self.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = int(np.count_nonzero(want))
        logits = llama_cpp.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(logits, shape=(n_out, self.n_vocab))

    def generate(
        self, prompts: list[list[int]], max_tokens: int
    ) -> tuple[list[list[int]], float, float]:
        """Prefills every prompt (sequence i = prompt i) and decodes greedily until each has
        max_tokens tokens. Returns (tokens per sequence, prefill + first token s, decode s)."""
        self.clear()
        n_seq = len(prompts)
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        tokens = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts])
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        seqs = np.repeat(np.arange(n_seq, dtype=np.int64), lens)
        want = np.zeros(len(tokens), dtype=np.int8)
        want[np.cumsum(lens) - 1] = 1
        last = np.zeros(n_seq, dtype=np.int32)
        out = np.zeros((n_seq, max_tokens), dtype=np.int32)
        start = time.perf_counter()
        for c in range(0, len(tokens), self.n_batch):
            sl = slice(c, c + self.n_batch)
            rows = self.decode(tokens[sl], pos[sl], seqs[sl], want[sl])
            if len(rows):
                done = seqs[sl][want[sl] != 0]
                last[done] = rows.argmax(axis=1)
        out[:, 0] = last
        first = time.perf_counter()
        ones = np.ones(n_seq, dtype=np.int8)
        all_seqs = np.arange(n_seq, dtype=np.int64)
        for step in range(1, max_tokens):
            rows = self.decode(last, (lens + step - 1).astype(np.int32), all_seqs, ones)
            last = rows.argmax(axis=1).astype(np.int32)
            out[:, step] = last
        end = time.perf_counter()
        return out.tolist(), first - start, end - first


def read_workload(path: str) -> tuple[list[list[int]], int]:
    data = json.loads(Path(path).read_text())
    if "prompts" in data:
        return [list(map(int, p)) for p in data["prompts"]], int(data["max_tokens"])
    reqs = data["requests"]
    return [list(r["prompt_token_ids"]) for r in reqs], max(int(r["max_tokens"]) for r in reqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--mode", choices=("single", "batch"), default="single")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument("--n-ubatch", type=int, default=512)
    parser.add_argument("--no-kv-unified", dest="kv_unified", action="store_false")
    parser.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="auto")
    args = parser.parse_args()

    llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    prompts, max_tokens = read_workload(args.workload)
    seq_len = max(len(p) for p in prompts) + max_tokens
    if args.mode == "single":
        n_seq, n_ctx = 1, round_up(max(seq_len, len(WARMUP_PROMPT) + WARMUP_TOKENS))
    elif args.kv_unified:
        n_seq, n_ctx = len(prompts), round_up(sum(len(p) + max_tokens for p in prompts))
    else:
        # llama.cpp pads each sequence's KV stream to 256 cells anyway.
        n_seq, n_ctx = len(prompts), len(prompts) * round_up(seq_len)
    n_batch = max(args.n_batch, n_seq)
    engine = Engine(
        args.model,
        threads=args.threads,
        n_ctx=n_ctx,
        n_seq_max=n_seq,
        n_batch=n_batch,
        n_ubatch=min(args.n_ubatch, n_batch),
        kv_unified=args.kv_unified,
        flash_attn=args.flash_attn,
    )
    engine.generate([WARMUP_PROMPT], WARMUP_TOKENS)

    result: dict[str, Any] = {"mode": args.mode, "threads": args.threads}
    if args.mode == "single":
        ttft, per_token, first_tokens = [], [], None
        for _ in range(args.repeats):
            for prompt in prompts:
                (toks,), prefill_s, decode_s = engine.generate([prompt], max_tokens)
                first_tokens = first_tokens or toks
                ttft.append(prefill_s * 1e3)
                if max_tokens > 1:
                    per_token.append(decode_s * 1e3 / (max_tokens - 1))
        result |= {
            "decode_ms_per_token": statistics.median(per_token) if per_token else None,
            "ttft_ms": statistics.median(ttft),
            "first_tokens": first_tokens,
        }
    else:
        runs, first_tokens = [], None
        for _ in range(args.repeats):
            toks, prefill_s, decode_s = engine.generate(prompts, max_tokens)
            first_tokens = first_tokens or toks[0]
            total = sum(len(t) for t in toks)
            decode_tps = (total - len(toks)) / decode_s if decode_s > 0 else None
            runs.append((total / (prefill_s + decode_s), decode_tps, prefill_s))
        result |= {
            "output_tokens": len(prompts) * max_tokens,
            "output_tokens_per_s": statistics.median(r[0] for r in runs),
            "decode_tokens_per_s": statistics.median(r[1] for r in runs)
            if max_tokens > 1
            else None,
            "prefill_s": statistics.median(r[2] for r in runs),
            "first_tokens": first_tokens,
        }
    result |= {
        "n_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_tokens": max_tokens,
        "repeats": args.repeats,
        **engine.settings,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "llama_cpp_version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
