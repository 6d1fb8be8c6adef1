// fp32-weight panel GEMM: y = x @ W^T (+ bias), the design of bf16_gemm.cpp with float32
// weights (no conversion), as a candidate against oneDNN at decode row counts.
//
// x: [m, k] float32, row stride ldx (elements); y: [m, n] float32, row stride ldy.
// W: [n, k], stored ONCE as float32 "panels" by tandem_f32_pack:
//     packed[ceil(n / 16)][k][16] float32, natural column order (position c of a
//     (panel, k) row is column panel * 16 + c), columns past n zero.
// bias: [n] float32 or null. Accumulation is float32 FMA; the summation order differs from
// torch's (k split into blocks, small row counts split k over several accumulators).
//
// Work: a 6-row x 16-column register tile (12 ymm accumulators, two 8-float weight loads
// per k) streams one panel's k range. Panels are split between threads in dynamically
// scheduled chunks (rows too when there are fewer panels than threads). Rows are blocked
// by kRowBlock, k only when very large (as in bf16_gemm.cpp).

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_F32_AVX2 1
#else
#define TANDEM_F32_AVX2 0
#endif

namespace {

constexpr int64_t kPanel = 16;    // output columns per panel
constexpr int64_t kTileRows = 6;  // rows per register tile
#ifndef TANDEM_F32_ROW_BLOCK
#define TANDEM_F32_ROW_BLOCK 96
#endif
#ifndef TANDEM_F32_DEPTH_BLOCK
#define TANDEM_F32_DEPTH_BLOCK 4096
#endif
constexpr int64_t kRowBlock = TANDEM_F32_ROW_BLOCK;      // rows per cache block
constexpr int64_t kDepthBlock = TANDEM_F32_DEPTH_BLOCK;  // k per block when k > limit
constexpr int64_t kDepthLimit = kDepthBlock * 3 / 2;

struct Gemm {
  const float* x;
  int64_t ldx;
  const float* w;
  const float* bias;
  float* y;
  int64_t ldy, m, n, k;
};

// The 16 starting values of a tile row's columns n0..n0+15 (bias, zero or partial sums);
// columns past n read as zero.
inline void load_row(const Gemm& g, int64_t row, int64_t n0, bool first, float* out) {
  const int64_t cols = std::min(kPanel, g.n - n0);
  std::fill(out, out + kPanel, 0.f);
  if (!first) {
    std::copy(g.y + row * g.ldy + n0, g.y + row * g.ldy + n0 + cols, out);
  } else if (g.bias != nullptr) {
    std::copy(g.bias + n0, g.bias + n0 + cols, out);
  }
}

inline void store_row(const Gemm& g, int64_t row, int64_t n0, const float* values) {
  const int64_t cols = std::min(kPanel, g.n - n0);
  std::copy(values, values + cols, g.y + row * g.ldy + n0);
}

// Portable tile: MR rows x 16 columns over k in [k0, k1); the reference for the vector one.
template <int MR>
void tile_portable(const Gemm& g, int64_t m0, int64_t panel, int64_t k0, int64_t k1,
                   bool first) {
  float acc[MR][kPanel];
  const int64_t n0 = panel * kPanel;
  for (int i = 0; i < MR; ++i) load_row(g, m0 + i, n0, first, acc[i]);
  const float* w = g.w + panel * g.k * kPanel;
  for (int64_t kk = k0; kk < k1; ++kk) {
    for (int i = 0; i < MR; ++i) {
      const float xv = g.x[(m0 + i) * g.ldx + kk];
      for (int64_t c = 0; c < kPanel; ++c) acc[i][c] += xv * w[kk * kPanel + c];
    }
  }
  for (int i = 0; i < MR; ++i) store_row(g, m0 + i, n0, acc[i]);
}

#if TANDEM_F32_AVX2
// Vector tile: MR rows x 16 columns, KU independent accumulator sets over k (so one or
// two rows still keep enough FMAs in flight), summed at the end.
template <int MR, int KU>
void tile_avx2(const Gemm& g, int64_t m0, int64_t panel, int64_t k0, int64_t k1,
               bool first) {
  const int64_t n0 = panel * kPanel;
  __m256 acc[KU][MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    alignas(32) float start[kPanel];
    load_row(g, m0 + i, n0, first, start);
    acc[0][i][0] = _mm256_load_ps(start);
    acc[0][i][1] = _mm256_load_ps(start + 8);
#pragma GCC unroll 4
    for (int u = 1; u < KU; ++u) acc[u][i][0] = acc[u][i][1] = _mm256_setzero_ps();
  }
  const float* xr[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) xr[i] = g.x + (m0 + i) * g.ldx;
  const float* w = g.w + panel * g.k * kPanel;
  // The k loop body is written out twice (KU-unrolled, then the remainder), as in
  // bf16_gemm.cpp: a shared lambda made GCC keep the accumulators in memory.
  int64_t kk = k0;
  for (; kk + KU <= k1; kk += KU) {
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u) {
      const __m256 lo = _mm256_loadu_ps(w + (kk + u) * kPanel);
      const __m256 hi = _mm256_loadu_ps(w + (kk + u) * kPanel + 8);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr[i] + kk + u);
        acc[u][i][0] = _mm256_fmadd_ps(xv, lo, acc[u][i][0]);
        acc[u][i][1] = _mm256_fmadd_ps(xv, hi, acc[u][i][1]);
      }
    }
  }
  for (; kk < k1; ++kk) {
    const __m256 lo = _mm256_loadu_ps(w + kk * kPanel);
    const __m256 hi = _mm256_loadu_ps(w + kk * kPanel + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(xr[i] + kk);
      acc[0][i][0] = _mm256_fmadd_ps(xv, lo, acc[0][i][0]);
      acc[0][i][1] = _mm256_fmadd_ps(xv, hi, acc[0][i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int u = 1; u < KU; ++u) {
      acc[0][i][0] = _mm256_add_ps(acc[0][i][0], acc[u][i][0]);
      acc[0][i][1] = _mm256_add_ps(acc[0][i][1], acc[u][i][1]);
    }
    alignas(32) float out[kPanel];
    _mm256_store_ps(out, acc[0][i][0]);
    _mm256_store_ps(out + 8, acc[0][i][1]);
    store_row(g, m0 + i, n0, out);
  }
}
#endif

using TileFn = void (*)(const Gemm&, int64_t, int64_t, int64_t, int64_t, bool);

TileFn pick_tile(int64_t rows, bool portable) {
#if TANDEM_F32_AVX2
  if (!portable) {
    switch (rows) {
      case 1: return tile_avx2<1, 4>;
      case 2: return tile_avx2<2, 3>;
      case 3: return tile_avx2<3, 2>;
      case 4: return tile_avx2<4, 1>;
      case 5: return tile_avx2<5, 1>;
      default: return tile_avx2<6, 1>;
    }
  }
#endif
  (void)portable;
  switch (rows) {
    case 1: return tile_portable<1>;
    case 2: return tile_portable<2>;
    case 3: return tile_portable<3>;
    case 4: return tile_portable<4>;
    case 5: return tile_portable<5>;
    default: return tile_portable<6>;
  }
}

// Rows [r0, r1) x panels [p0, p1): row blocks, then k blocks, then panels, then tiles.
void run_item(const Gemm& g, int64_t r0, int64_t r1, int64_t p0, int64_t p1, bool portable) {
  const int64_t depth = g.k > kDepthLimit ? kDepthBlock : std::max<int64_t>(g.k, 1);
  for (int64_t mb = r0; mb < r1; mb += kRowBlock) {
    const int64_t me = std::min(mb + kRowBlock, r1);
    for (int64_t kb = 0; kb < g.k || kb == 0; kb += depth) {
      const int64_t ke = std::min(kb + depth, g.k);
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t m = mb; m < me; m += kTileRows) {
          const int64_t rows = std::min(kTileRows, me - m);
          pick_tile(rows, portable)(g, m, p, kb, ke, kb == 0);
        }
      }
    }
  }
}

// Panels (rows too when panels are fewer than threads) in up to kChunksPerThread
// contiguous chunks per thread, handed out dynamically (as in bf16_gemm.cpp).
constexpr int64_t kChunksPerThread = 4;

void run(const Gemm& g, int threads, bool portable) {
  const int64_t panels = (g.n + kPanel - 1) / kPanel;
  const int64_t tiles = (g.m + kTileRows - 1) / kTileRows;
  if (g.m <= 0 || panels <= 0) return;
  const int64_t want = std::max(threads, 1);
  const int64_t row_parts = std::min(tiles, (want + panels - 1) / panels);
  const int64_t cols = want == 1 ? 1 : std::min(panels, want * kChunksPerThread);
  const int64_t items = cols * row_parts;
  const int workers = static_cast<int>(std::min(items, want));
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers) if (workers > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t c = item % cols;
    const int64_t r = item / cols;
    const int64_t r0 = std::min(g.m, tiles * r / row_parts * kTileRows);
    const int64_t r1 = std::min(g.m, tiles * (r + 1) / row_parts * kTileRows);
    run_item(g, r0, r1, panels * c / cols, panels * (c + 1) / cols, portable);
  }
}

}  // namespace

extern "C" int tandem_f32_gemm_abi_version() { return 1; }

// 1 when the AVX2/FMA tile is compiled in, 0 when only the portable loops are.
extern "C" int tandem_f32_gemm_vectorized() { return TANDEM_F32_AVX2; }

// W [n, k] (row stride ldw) -> panels [ceil(n / 16)][k][16], columns past n zero.
extern "C" void tandem_f32_pack(const float* w, int64_t ldw, float* out, int64_t n, int64_t k,
                                int threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(std::max(threads, 1))
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = out + p * k * kPanel;
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t col = p * kPanel + c;
      for (int64_t kk = 0; kk < k; ++kk)
        dst[kk * kPanel + c] = col < n ? w[col * ldw + kk] : 0.f;
    }
  }
}

extern "C" void tandem_f32_gemm(const float* x, int64_t ldx, const float* packed,
                                const float* bias, float* y, int64_t ldy, int64_t m, int64_t n,
                                int64_t k, int threads) {
  run(Gemm{x, ldx, packed, bias, y, ldy, m, n, k}, threads, false);
}

// The same product through the portable tile only (tests; CPUs without AVX2 use it anyway).
extern "C" void tandem_f32_gemm_portable(const float* x, int64_t ldx, const float* packed,
                                         const float* bias, float* y, int64_t ldy, int64_t m,
                                         int64_t n, int64_t k, int threads) {
  run(Gemm{x, ldx, packed, bias, y, ldy, m, n, k}, threads, true);
}
