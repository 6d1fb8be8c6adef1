// A whole decoder forward for an all-decode step, in one call from Python.
//
// At batch 1 a 30-layer decoder makes about 270 kernel calls per token; from Python each
// costs a few microseconds of argument handling (ctypes, tensor views, allocation), which
// adds up to a few milliseconds a token around about six of memory-bound linears. This
// driver makes the same calls, in the same order, to the same compiled kernels (their
// addresses are handed in: panel_gemm.cpp's linears, fused_ops.cpp's element-wise steps,
// paged_decode.cpp's KV write and attention), so its result is bit-identical to the Python
// loop in `fused_decoder.FusedDecoder.forward`; it only removes the interpreter between
// them.
//
// Contract (checked by the caller, `models/decode_program.py`):
//  - every activation is float32, contiguous; the KV pools are float32 in the decode
//    kernel's layout (keys [blocks, kv_heads, head_dim, block_size], values [blocks,
//    block_size, kv_heads, head_dim]);
//  - every query token attends as a decode (one token per row of `block_tables`);
//  - there is at least one layer, and the scratch buffers hold `rows` rows of their widths.
#include <cstdint>
#include <cstring>

extern "C" int tandem_decode_program_abi_version() { return 1; }

namespace {

typedef void (*QGemm)(const float*, int64_t, const uint32_t*, const void*, const void*,
                      const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int,
                      int, int, int);
typedef void (*PanelGemm)(const float*, int64_t, const void*, const float*, float*, int64_t,
                          int64_t, int64_t, int64_t, int, int);
typedef void (*RmsNorm)(const float*, const float*, float*, int64_t, int64_t, float, int);
typedef void (*AddRmsNorm)(float*, const float*, const float*, float*, int64_t, int64_t, float,
                           int);
typedef void (*Rope)(float*, const int64_t*, const float*, const float*, int64_t, int64_t,
                     int64_t, int64_t, int64_t, int);
typedef void (*SiluMul)(const float*, float*, int64_t, int64_t, int);
typedef void (*WriteKv)(float*, float*, const float*, const float*, const int64_t*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t);
typedef void (*PagedDecode)(const float*, const float*, const float*, const int64_t*,
                            const int64_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, float, int);

// Kernel addresses, in this order (`decode_program.KERNELS`).
struct Kernels {
  QGemm q_gemm;
  PanelGemm f32_gemm;
  PanelGemm bf16_gemm;
  RmsNorm rms_norm;
  AddRmsNorm add_rms_norm;
  Rope rope;
  SiluMul silu_mul;
  WriteKv write_kv;
  PagedDecode paged_decode;
};

// One linear: int64 fields, in this order (`decode_program.LINEAR_FIELDS`).
enum LinearKind : int64_t { kQuant = 0, kF32Panel = 1, kBf16Panel = 2 };
struct Linear {
  int64_t kind, weight, scales, mins, bias, n, k, group, bits, half_scales;
};

// One layer (`decode_program.LAYER_FIELDS`): four linears, then pointers.
struct Layer {
  Linear qkv, o, gate_up, down;
  int64_t ln_in, ln_post, k_pool, v_pool;
};

template <typename T>
T* at(int64_t address) {
  return reinterpret_cast<T*>(address);
}

void run_linear(const Kernels& kern, const Linear& l, const float* x, float* y, int64_t rows,
                int threads) {
  const float* bias = at<const float>(l.bias);
  if (l.kind == kQuant) {
    kern.q_gemm(x, l.k, at<const uint32_t>(l.weight), at<const void>(l.scales),
                at<const void>(l.mins), bias, y, l.n, rows, l.n, l.k, l.group,
                static_cast<int>(l.bits), static_cast<int>(l.half_scales), threads, 0);
  } else {
    PanelGemm gemm = l.kind == kF32Panel ? kern.f32_gemm : kern.bf16_gemm;
    gemm(x, l.k, at<const void>(l.weight), bias, y, l.n, rows, l.n, l.k, threads, 0);
  }
}

}  // namespace

// shape: num_layers, hidden, q_heads, kv_heads, head_dim, rope_dim, block_size, max_blocks,
//        rows, threads.
// step:  h (residual stream [rows, hidden], updated in place), x (out: the final-normed
//        hidden states), final_norm, rope index, cos, sin, slots, block_tables, seq_lens,
//        then the scratch buffers qkv, query, attn, delta, gate_up, act.
extern "C" void tandem_decode_program_run(const int64_t* kernels, const int64_t* layers,
                                          const int64_t* shape, const int64_t* step, float eps,
                                          float scale) {
  Kernels kern;
  static_assert(sizeof(Kernels) == 9 * sizeof(void*), "kernel table");
  std::memcpy(&kern, kernels, sizeof(Kernels));
  const int64_t num_layers = shape[0], hidden = shape[1], q_heads = shape[2];
  const int64_t kv_heads = shape[3], head_dim = shape[4], rope_dim = shape[5];
  const int64_t block_size = shape[6], max_blocks = shape[7], rows = shape[8];
  const int threads = static_cast<int>(shape[9]);
  float* h = at<float>(step[0]);
  float* x = at<float>(step[1]);
  const float* final_norm = at<const float>(step[2]);
  const int64_t* rope_index = at<const int64_t>(step[3]);
  const float* cos = at<const float>(step[4]);
  const float* sin = at<const float>(step[5]);
  const int64_t* slots = at<const int64_t>(step[6]);
  const int64_t* block_tables = at<const int64_t>(step[7]);
  const int64_t* seq_lens = at<const int64_t>(step[8]);
  float* qkv = at<float>(step[9]);
  float* query = at<float>(step[10]);
  float* attn = at<float>(step[11]);
  float* delta = at<float>(step[12]);
  float* gate_up = at<float>(step[13]);
  float* act = at<float>(step[14]);

  const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t width = q_size + 2 * kv_size;
  const Layer* table = reinterpret_cast<const Layer*>(layers);
  kern.rms_norm(h, at<const float>(table[0].ln_in), x, rows, hidden, eps, threads);
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer& layer = table[i];
    const float* next_norm =
        i + 1 < num_layers ? at<const float>(table[i + 1].ln_in) : final_norm;
    run_linear(kern, layer.qkv, x, qkv, rows, threads);
    kern.rope(qkv, rope_index, cos, sin, rows, width, q_heads, kv_heads, rope_dim, threads);
    float* k_pool = at<float>(layer.k_pool);
    float* v_pool = at<float>(layer.v_pool);
    kern.write_kv(k_pool, v_pool, qkv + q_size, qkv + q_size + kv_size, slots, rows, width,
                  width, kv_heads, head_dim, block_size);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(query + r * q_size, qkv + r * width, q_size * sizeof(float));
    kern.paged_decode(query, k_pool, v_pool, block_tables, seq_lens, attn, rows, q_heads,
                      kv_heads, head_dim, block_size, max_blocks, scale, threads);
    run_linear(kern, layer.o, attn, delta, rows, threads);
    kern.add_rms_norm(h, delta, at<const float>(layer.ln_post), x, rows, hidden, eps, threads);
    run_linear(kern, layer.gate_up, x, gate_up, rows, threads);
    kern.silu_mul(gate_up, act, rows, layer.gate_up.n / 2, threads);
    run_linear(kern, layer.down, act, delta, rows, threads);
    kern.add_rms_norm(h, delta, next_norm, x, rows, hidden, eps, threads);
  }
}
