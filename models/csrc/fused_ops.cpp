// Fused element-wise operations of a Llama-family decoder layer, float32, CPU.
//
// Each replaces a chain of torch ops that each read and write the whole activation:
//   rms_norm      out = w * (x * rsqrt(mean(x^2) + eps))                   (6 torch ops)
//   add_rms_norm  h += delta; out = w * (h * rsqrt(mean(h^2) + eps))       (7 torch ops)
//   rope          q, k inside the fused QKV output rotated in place by the cos/sin rows
//                 of each token's position (rotate-half / NeoX layout)     (10 torch ops)
//   silu_mul      out = silu(gate) * up, gate_up = [gate | up] per row       (3 torch ops)
//   rope_bf16     a bf16 GEMM's qkv widened to float32 with q, k rotated as `rope` does, in
//                 one pass (`.float()` then `rope`)
// The arithmetic follows the torch expressions term by term (same products, same order
// of the final multiplications); only the reduction order of mean(x^2) differs, so
// results match torch to float rounding, not bit for bit.
//
// The `_bf16` variants serve a decoder whose linears take and give bfloat16 (oneDNN's
// bf16 GEMM, `FusedDecoder`'s bf16 activation path): a bfloat16 operand is widened to
// float32 exactly, the float32 arithmetic is the same code as above, and a bfloat16 result
// is rounded to nearest even, as torch's float32 -> bfloat16 cast rounds. So a variant's
// output equals the float32 kernel's followed (or preceded) by torch's casts, bit for bit.
//
// All tensors are contiguous rows except where a row stride is passed. Rows are split
// across OpenMP threads only when the work is large enough to pay for waking them.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kParallelMinFloats = 1 << 15;

inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even (NaN stays a quiet NaN), torch's c10::BFloat16 rounding.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void widen(const uint16_t* x, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]);
}

inline void narrow(const float* x, uint16_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(x[i]);
}

// A row of floats per thread, 64-byte aligned like torch's allocations (so the simd loops
// split a row the same way as on a tensor row).
struct RowBuffer {
  explicit RowBuffer(int64_t n) : storage(static_cast<size_t>(n) + 16) {
    auto address = reinterpret_cast<uintptr_t>(storage.data());
    data = reinterpret_cast<float*>((address + 63) & ~static_cast<uintptr_t>(63));
  }
  std::vector<float> storage;
  float* data;
};

}  // namespace

extern "C" int tandem_fused_ops_abi_version() { return 3; }

extern "C" void tandem_rms_norm_f32(const float* x, const float* w, float* out, int64_t rows,
                                    int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= kParallelMinFloats)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    scale_row(xr, w, inv_rms(xr, cols, eps), out + r * cols, cols);
  }
}

extern "C" void tandem_add_rms_norm_f32(float* h, const float* delta, const float* w, float* out,
                                        int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= kParallelMinFloats)
  for (int64_t r = 0; r < rows; ++r) {
    float* hr = h + r * cols;
    const float* dr = delta + r * cols;
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) hr[i] += dr[i];
    scale_row(hr, w, inv_rms(hr, cols, eps), out + r * cols, cols);
  }
}

// qkv: [rows, row_stride]; the first q_heads * head_dim floats of a row are the query heads,
// the next kv_heads * head_dim the key heads. cos, sin: [num_positions, head_dim].
extern "C" void tandem_rope_f32(float* qkv, const int64_t* positions, const float* cos,
                                const float* sin, int64_t rows, int64_t row_stride,
                                int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                int num_threads) {
  const int64_t half = head_dim / 2;
  const int64_t heads = q_heads + kv_heads;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= kParallelMinFloats)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + positions[r] * head_dim;
    const float* s = sin + positions[r] * head_dim;
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* x = qkv + r * row_stride + hd * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i];
        const float b = x[i + half];
        x[i] = a * c[i] + (-b) * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

// qkv: bfloat16 [rows, width] (a bf16 GEMM's output); out: float32 [rows, width], the same
// values widened, with the first q_heads + kv_heads heads of each row rotated by the same
// expressions as tandem_rope_f32 (so out equals widening then tandem_rope_f32, bit for bit).
extern "C" void tandem_rope_bf16(const uint16_t* qkv, float* out, const int64_t* positions,
                                 const float* cos, const float* sin, int64_t rows, int64_t width,
                                 int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                 int num_threads) {
  const int64_t half = head_dim / 2;
  const int64_t rotated = (q_heads + kv_heads) * head_dim;
#pragma omp parallel for num_threads(num_threads) if (rows * width >= kParallelMinFloats)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + positions[r] * head_dim;
    const float* s = sin + positions[r] * head_dim;
    const uint16_t* x = qkv + r * width;
    float* o = out + r * width;
    for (int64_t h = 0; h < rotated; h += head_dim) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = bf16_to_float(x[h + i]);
        const float b = bf16_to_float(x[h + i + half]);
        o[h + i] = a * c[i] + (-b) * s[i];
        o[h + i + half] = b * c[i + half] + a * s[i + half];
      }
    }
    widen(x + rotated, o + rotated, width - rotated);
  }
}

// gate_up: [rows, 2 * cols] (gate then up); out: [rows, cols].
extern "C" void tandem_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t cols,
                                    int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= kParallelMinFloats / 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * cols;
    const float* u = g + cols;
    float* o = out + r * cols;
    silu_mul_row(g, u, o, cols);
  }
}

// rms_norm with a bfloat16 output (the input of a bf16 linear).
extern "C" void tandem_rms_norm_bf16(const float* x, const float* w, uint16_t* out, int64_t rows,
                                     int64_t cols, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * cols >= kParallelMinFloats)
  {
    RowBuffer row(cols);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * cols;
      scale_row(xr, w, inv_rms(xr, cols, eps), row.data, cols);
      narrow(row.data, out + r * cols, cols);
    }
  }
}

// add_rms_norm with a bfloat16 delta (a bf16 linear's output): h stays float32; the norm's
// output is bfloat16 when `out_bf16`, else float32 (`out` then points to floats).
extern "C" void tandem_add_rms_norm_bf16(float* h, const uint16_t* delta, const float* w, void* out,
                                         int out_bf16, int64_t rows, int64_t cols, float eps,
                                         int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * cols >= kParallelMinFloats)
  {
    RowBuffer row(cols);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      float* hr = h + r * cols;
      widen(delta + r * cols, row.data, cols);
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) hr[i] += row.data[i];
      const float scale = inv_rms(hr, cols, eps);
      if (out_bf16) {
        scale_row(hr, w, scale, row.data, cols);
        narrow(row.data, static_cast<uint16_t*>(out) + r * cols, cols);
      } else {
        scale_row(hr, w, scale, static_cast<float*>(out) + r * cols, cols);
      }
    }
  }
}

// silu_mul on bfloat16 gate_up [rows, 2 * cols], bfloat16 out [rows, cols].
extern "C" void tandem_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows,
                                     int64_t cols, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * cols >= kParallelMinFloats / 4)
  {
    RowBuffer gate(cols), up(cols), act(cols);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      widen(gate_up + r * 2 * cols, gate.data, cols);
      widen(gate_up + r * 2 * cols + cols, up.data, cols);
      silu_mul_row(gate.data, up.data, act.data, cols);
      narrow(act.data, out + r * cols, cols);
    }
  }
}
