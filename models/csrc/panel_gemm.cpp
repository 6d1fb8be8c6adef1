// Panel GEMM with float32 compute: y = x @ W^T (+ bias), W stored once in one of two
// weight formats (the only thing that differs between them is how a packed row is read):
//
//   F32:  float32 panels, natural column order (position c of a (panel, k) row is column
//         panel * 16 + c). The fp32 path's linears (faster than oneDNN at decode row counts).
//   BF16: bf16 bit patterns (uint16), for CPUs without bf16 arithmetic. Within the 16
//         entries of one (panel, k) row, position 2i holds column i and position 2i + 1
//         column 8 + i. Read as eight 32-bit words, `word << 16` is then columns 0..7 as
//         float32 and `word & 0xffff0000` columns 8..15: one integer op per 8 weights, no
//         shuffles (bf16 -> fp32 is exact: the bf16 bits are the float's top half).
//
// x: [m, k] float32, row stride ldx (elements); y: [m, n] float32, row stride ldy.
// W: [n, k], packed by tandem_{f32,bf16}_pack* into panels[ceil(n / 16)][k][16], columns
// past n zero. bias: [n] float32 or null. Accumulation is float32 FMA; the summation order
// differs from torch's (k split into blocks, small row counts split k over several
// accumulators).
//
// Work: a 6-row x 16-column register tile (12 ymm accumulators, two 8-float weight vectors
// per k) streams one panel's k range; with AVX-512, float32 weights take a 6-row x 48-column
// tile over three panels at once (`tile_f32_wide`, x packed once per product) wherever six
// rows fill it. Panels are split between threads in dynamically
// scheduled chunks (rows too when there are fewer panels than threads). Rows are blocked by
// kRowBlock (the x block stays in L2 while the thread's panels pass over it); k only when
// very large (a panel and a tile's x rows stay in L2: L2 bandwidth covers the ~10
// bytes/cycle a tile reads, and blocking k at 256 or 512 to stay in L1 measured slower at
// k = 576 and 1536, from the partial sums' round trips).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_PANEL_AVX2 1
#else
#define TANDEM_PANEL_AVX2 0
#endif
#if TANDEM_PANEL_AVX2 && defined(__AVX512F__)
#define TANDEM_PANEL_AVX512 1
#else
#define TANDEM_PANEL_AVX512 0
#endif

namespace {

constexpr int64_t kPanel = 16;    // output columns per panel
constexpr int64_t kTileRows = 6;  // rows per register tile
// Cache blocking (macros only so that benchmarks can try other values).
#ifndef TANDEM_PANEL_ROW_BLOCK
#define TANDEM_PANEL_ROW_BLOCK 96
#endif
#ifndef TANDEM_PANEL_DEPTH_BLOCK
#define TANDEM_PANEL_DEPTH_BLOCK 4096
#endif
constexpr int64_t kRowBlock = TANDEM_PANEL_ROW_BLOCK;      // rows per cache block
constexpr int64_t kDepthBlock = TANDEM_PANEL_DEPTH_BLOCK;  // k per block when k > limit
constexpr int64_t kDepthLimit = kDepthBlock * 3 / 2;

// Round-to-nearest-even, as torch's scalar float -> bfloat16 (NaN -> 0x7fc0). Integer
// arithmetic only: -ffast-math must not touch the NaN test.
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Weight format: float32 panels, natural column order.
struct F32 {
  using Stored = float;
  static int64_t column_at(int64_t pos) { return pos; }
  static Stored store(float value) { return value; }
  static float widen(Stored value) { return value; }
#if TANDEM_PANEL_AVX2
  static void load(const Stored* row, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(row);
    hi = _mm256_loadu_ps(row + 8);
  }
#endif
};

// Weight format: bf16 bit patterns, columns interleaved (see the header).
struct BF16 {
  using Stored = uint16_t;
  static int64_t column_at(int64_t pos) { return (pos & 1) ? 8 + pos / 2 : pos / 2; }
  static Stored store(float value) { return to_bf16(value); }
  static Stored store(uint16_t bits) { return bits; }
  static float widen(Stored value) { return from_bf16(value); }
#if TANDEM_PANEL_AVX2
  static void load(const Stored* row, __m256& lo, __m256& hi) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
  }
#endif
};

template <typename W>
struct Gemm {
  const float* x;
  int64_t ldx;
  const typename W::Stored* w;
  const float* bias;
  float* y;
  int64_t ldy, m, n, k;
  // float32 weights with AVX-512: x's full six-row tiles packed k-major (`pack_x_tiles`),
  // tile t at `xt + t * 6 * k`; null when the wide tile is not used
  const float* xt = nullptr;
};

// The 16 starting values of a tile row's columns n0..n0+15 (bias, zero or partial sums);
// columns past n read as zero.
template <typename W>
void load_row(const Gemm<W>& g, int64_t row, int64_t n0, bool first, float* out) {
  const int64_t cols = std::min(kPanel, g.n - n0);
  std::fill(out, out + kPanel, 0.f);
  if (!first) {
    std::copy(g.y + row * g.ldy + n0, g.y + row * g.ldy + n0 + cols, out);
  } else if (g.bias != nullptr) {
    std::copy(g.bias + n0, g.bias + n0 + cols, out);
  }
}

template <typename W>
void store_row(const Gemm<W>& g, int64_t row, int64_t n0, const float* values) {
  const int64_t cols = std::min(kPanel, g.n - n0);
  std::copy(values, values + cols, g.y + row * g.ldy + n0);
}

// Portable tile: MR rows x 16 columns over k in [k0, k1). Plain loops (the compiler may
// vectorise them); also the reference the vector tile is tested against.
template <typename W, int MR>
void tile_portable(const Gemm<W>& g, int64_t m0, int64_t panel, int64_t k0, int64_t k1,
                   bool first) {
  float acc[MR][kPanel];
  const int64_t n0 = panel * kPanel;
  for (int i = 0; i < MR; ++i) load_row(g, m0 + i, n0, first, acc[i]);
  const typename W::Stored* w = g.w + panel * g.k * kPanel;
  for (int64_t kk = k0; kk < k1; ++kk) {
    float wf[kPanel];
    for (int64_t pos = 0; pos < kPanel; ++pos)
      wf[W::column_at(pos)] = W::widen(w[kk * kPanel + pos]);
    for (int i = 0; i < MR; ++i) {
      const float xv = g.x[(m0 + i) * g.ldx + kk];
      for (int64_t c = 0; c < kPanel; ++c) acc[i][c] += xv * wf[c];
    }
  }
  for (int i = 0; i < MR; ++i) store_row(g, m0 + i, n0, acc[i]);
}

#if TANDEM_PANEL_AVX2
// Vector tile: MR rows x 16 columns, KU independent accumulator sets over k (so one or
// two rows still keep enough FMAs in flight), summed at the end.
template <typename W, int MR, int KU>
void tile_avx2(const Gemm<W>& g, int64_t m0, int64_t panel, int64_t k0, int64_t k1,
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
  const typename W::Stored* w = g.w + panel * g.k * kPanel;
  // The k loop body is written out twice (KU-unrolled, then the remainder) rather than
  // shared through a lambda: a lambda made GCC keep the accumulators in memory.
  int64_t kk = k0;
  for (; kk + KU <= k1; kk += KU) {
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u) {
      __m256 lo, hi;
      W::load(w + (kk + u) * kPanel, lo, hi);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr[i] + kk + u);
        acc[u][i][0] = _mm256_fmadd_ps(xv, lo, acc[u][i][0]);
        acc[u][i][1] = _mm256_fmadd_ps(xv, hi, acc[u][i][1]);
      }
    }
  }
  for (; kk < k1; ++kk) {
    __m256 lo, hi;
    W::load(w + kk * kPanel, lo, hi);
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

#if TANDEM_PANEL_AVX512
constexpr int64_t kWidePanels = 3;  // panels per wide tile (48 columns)

// Wide tile (AVX-512, float32 weights only): 6 rows x kWidePanels panels, one zmm
// accumulator per (row, panel), 18 in all. Per k, 3 weight loads and 6 broadcasts feed 18
// 16-wide FMAs (the AVX2 tile: 8 loads for 12 8-wide FMAs), which is what limits the AVX2
// tile once rows fill it (prefill and large batches). It reads the tile's six x rows packed
// k-major (`Gemm::xt`): one pointer instead of six. Four panels (24 accumulators) made GCC
// spill accumulators to the stack inside the k loop. Same per-element arithmetic (one
// float32 FMA chain over k).
void tile_f32_wide(const Gemm<F32>& g, int64_t m0, int64_t panel0, int64_t k0, int64_t k1,
                   bool first) {
  const float* xt = g.xt + (m0 / kTileRows) * kTileRows * g.k + k0 * kTileRows;
  constexpr int MR = static_cast<int>(kTileRows);
  constexpr int NP = static_cast<int>(kWidePanels);
  __m512 acc[MR][NP];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      alignas(64) float start[kPanel];
      load_row(g, m0 + i, (panel0 + p) * kPanel, first, start);
      acc[i][p] = _mm512_load_ps(start);
    }
  }
  const int64_t stride = g.k * kPanel;  // floats from one panel to the next
  const float* w = g.w + panel0 * stride + k0 * kPanel;
  const int64_t depth = k1 - k0;
  for (int64_t kk = 0; kk < depth; ++kk, w += kPanel, xt += MR) {
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + p * stride);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(xt[i]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xv, wv[p], acc[i][p]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      alignas(64) float out[kPanel];
      _mm512_store_ps(out, acc[i][p]);
      store_row(g, m0 + i, (panel0 + p) * kPanel, out);
    }
  }
}

// x's full six-row tiles, each k-major (`out[t * 6 * k + kk * 6 + i]` = x[t * 6 + i][kk]),
// split between `threads`.
void pack_x_tiles(const float* x, int64_t ldx, int64_t tiles, int64_t k, float* out,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tiles; ++t) {
    float* dst = out + t * kTileRows * k;
    for (int64_t i = 0; i < kTileRows; ++i) {
      const float* src = x + (t * kTileRows + i) * ldx;
      for (int64_t kk = 0; kk < k; ++kk) dst[kk * kTileRows + i] = src[kk];
    }
  }
}
#endif

template <typename W>
using TileFn = void (*)(const Gemm<W>&, int64_t, int64_t, int64_t, int64_t, bool);

template <typename W>
TileFn<W> pick_tile(int64_t rows, bool portable) {
#if TANDEM_PANEL_AVX2
  if (!portable) {
    switch (rows) {
      case 1: return tile_avx2<W, 1, 4>;
      case 2: return tile_avx2<W, 2, 3>;
      case 3: return tile_avx2<W, 3, 2>;
      case 4: return tile_avx2<W, 4, 1>;
      case 5: return tile_avx2<W, 5, 1>;
      default: return tile_avx2<W, 6, 1>;
    }
  }
#endif
  (void)portable;
  switch (rows) {
    case 1: return tile_portable<W, 1>;
    case 2: return tile_portable<W, 2>;
    case 3: return tile_portable<W, 3>;
    case 4: return tile_portable<W, 4>;
    case 5: return tile_portable<W, 5>;
    default: return tile_portable<W, 6>;
  }
}

// Rows [r0, r1) x panels [p0, p1): row blocks, then k blocks, then panels, then tiles.
template <typename W>
void run_item(const Gemm<W>& g, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
              bool portable) {
  const int64_t depth = g.k > kDepthLimit ? kDepthBlock : std::max<int64_t>(g.k, 1);
  for (int64_t mb = r0; mb < r1; mb += kRowBlock) {
    const int64_t me = std::min(mb + kRowBlock, r1);
    for (int64_t kb = 0; kb < g.k || kb == 0; kb += depth) {
      const int64_t ke = std::min(kb + depth, g.k);
#if TANDEM_PANEL_AVX512
      // float32 weights with packed x: groups of kWidePanels panels take the wide tile over
      // the block's full six-row tiles, the last partial tile and leftover panels the
      // narrow one (tiles start at multiples of six: row blocks and row splits do)
      if constexpr (std::is_same_v<W, F32>) {
        if (g.xt != nullptr && !portable) {
          const int64_t full_end = mb + (me - mb) / kTileRows * kTileRows;
          int64_t p = p0;
          for (; p + kWidePanels <= p1; p += kWidePanels) {
            for (int64_t m = mb; m < full_end; m += kTileRows)
              tile_f32_wide(g, m, p, kb, ke, kb == 0);
            for (int64_t q = p; full_end < me && q < p + kWidePanels; ++q)
              pick_tile<W>(me - full_end, portable)(g, full_end, q, kb, ke, kb == 0);
          }
          for (; p < p1; ++p)
            for (int64_t m = mb; m < me; m += kTileRows)
              pick_tile<W>(std::min(kTileRows, me - m), portable)(g, m, p, kb, ke, kb == 0);
          continue;
        }
      }
#endif
      for (int64_t p = p0; p < p1;) {
        for (int64_t m = mb; m < me; m += kTileRows) {
          const int64_t rows = std::min(kTileRows, me - m);
          pick_tile<W>(rows, portable)(g, m, p, kb, ke, kb == 0);
        }
        ++p;
      }
    }
  }
}

// Splits panels between threads (rows as well when panels are fewer than threads) into
// up to kChunksPerThread contiguous chunks per thread, handed out dynamically: a thread
// the OS delays (another process on its core) then costs its share of chunks, not half
// of the product.
constexpr int64_t kChunksPerThread = 4;

#if TANDEM_PANEL_AVX512
// x's full six-row tiles packed k-major for the wide tile (`pack_x_tiles`), in a
// thread-local buffer valid until this thread's next call; `want` threads pack them.
const float* wide_x_tiles(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t want) {
  thread_local std::vector<float> x_tiles;
  const int64_t full_tiles = m / kTileRows;
  x_tiles.resize(static_cast<size_t>(full_tiles * kTileRows * k));
  pack_x_tiles(x, ldx, full_tiles, k, x_tiles.data(),
               static_cast<int>(std::min(want, full_tiles)));
  return x_tiles.data();
}
#endif

// The product's work items, run by up to `want` threads: panels in contiguous chunks of
// whole `unit`-panel groups (up to kChunksPerThread chunks per thread, handed out
// dynamically), rows too when the groups are fewer than the threads (row parts of whole
// kTileRows tiles). `item(r0, r1, p0, p1)` runs rows [r0, r1) x panels [p0, p1).
template <typename Item>
void split_items(int64_t m, int64_t panels, int64_t unit, int64_t want, const Item& item) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t groups = (panels + unit - 1) / unit;
  const int64_t row_parts = std::min(tiles, (want + groups - 1) / groups);
  const int64_t cols = want == 1 ? 1 : std::min(groups, want * kChunksPerThread);
  const int64_t items = cols * row_parts;
  const int workers = static_cast<int>(std::min(items, want));
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers) if (workers > 1)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t c = i % cols;
    const int64_t r = i / cols;
    item(std::min(m, tiles * r / row_parts * kTileRows),
         std::min(m, tiles * (r + 1) / row_parts * kTileRows),
         std::min(panels, groups * c / cols * unit), std::min(panels, groups * (c + 1) / cols * unit));
  }
}

template <typename W>
void run(Gemm<W> g, int threads, bool portable) {
  const int64_t panels = (g.n + kPanel - 1) / kPanel;
  if (g.m <= 0 || panels <= 0) return;
  const int64_t want = std::max(threads, 1);
  // Chunks of whole wide groups where the wide tile runs (a chunk's leftover panels would
  // take the narrow tile)
  int64_t unit = 1;
#if TANDEM_PANEL_AVX512
  if constexpr (std::is_same_v<W, F32>) {
    if (!portable && g.m >= kTileRows && panels >= kWidePanels) {
      g.xt = wide_x_tiles(g.x, g.ldx, g.m, g.k, want);
      unit = kWidePanels;
    }
  }
#endif
  split_items(g.m, panels, unit, want, [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    run_item(g, r0, r1, p0, p1, portable);
  });
}

// W [n, k] (row stride ldw) -> panels of format F; Src is float (converted by F::store)
// or uint16_t (bf16 bits, BF16 only: copied).
template <typename F, typename Src>
void pack(const Src* w, int64_t ldw, typename F::Stored* out, int64_t n, int64_t k,
          int threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(std::max(threads, 1))
  for (int64_t p = 0; p < panels; ++p) {
    typename F::Stored* dst = out + p * k * kPanel;
    for (int64_t pos = 0; pos < kPanel; ++pos) {
      const int64_t col = p * kPanel + F::column_at(pos);
      for (int64_t kk = 0; kk < k; ++kk)
        dst[kk * kPanel + pos] = col < n ? F::store(w[col * ldw + kk]) : typename F::Stored{0};
    }
  }
}

template <typename W>
void gemm(const float* x, int64_t ldx, const void* packed, const float* bias, float* y,
          int64_t ldy, int64_t m, int64_t n, int64_t k, int threads, bool portable) {
  const Gemm<W> g{x, ldx, static_cast<const typename W::Stored*>(packed), bias, y, ldy, m, n, k};
  run(g, threads, portable);
}


// ---------------------------------------------------------------------------------------
// Quantized weights: weight-only int8 / int4 codes, group-wise affine, float32 compute.
//
//   w[col][kk] = scale[g][col] * code[col][kk] + min[g][col]   (g = kk / group; no min:
//                                                               zero)
//
// Codes are unsigned (0..255 or 0..15; signed formats are stored offset, their min taking
// the offset back). Per 16-column panel p (columns past n have zero codes and scales), in
// "lanes": one 32-bit word per column holds kLaneCodes = 32 / bits consecutive k of that
// column, code j of the word in bits [bits * j, bits * (j + 1)):
//   codes  [p][ceil(k / kLaneCodes)][16] uint32   (k past the end: zero codes)
//   scales, mins [p][groups][16] float32, or fp16 (`half_scales`: 2 bytes a group instead
//   of 4 where every value is an fp16, as GGUF's Q4_0/Q4_1/Q8_0 and load-time int8/int4
//   are; read into float32 per panel), groups = ceil(k / group); group a multiple of
//   kLaneCodes (or one group)
// A word's codes come out with a shift and a mask in each 32-bit lane: no shuffles, the
// integers already where `cvtdq2ps` wants them.
//
// Every format packed here has fp16 scales (GGUF's, or rounded to fp16 when quantizing), so
// scale * code is exact in float32 (11 + 8 significant bits at most) and the FMA of
// `scale * code + min` rounds once, as a separate multiply and add does: each weight the
// kernel uses is bit for bit the float reference's dequantized weight; only the summation
// order of the products differs.
//
// Up to kQDirectRows rows (decode; kQDirectRows512 on the AVX-512 tile, whose 32 registers
// hold 8 rows' partial sums) a tile dequantizes each k row of 16 weights in registers for
// its rows' FMAs (two accumulator sets, even and odd k). Above, each item dequantizes a
// panel once into a float32 panel (thread-local) and runs the float32 tiles over its rows:
// the dequantization is amortised over the rows. (Zen 4, SmolLM2's Q4_1 layers, 2 threads:
// a decode step of 8 rows took 33 ms through the float32 panel, 21-24 ms in one 8-row
// tile; `benchmarks/batch_decode.py`.) With AVX-512, above kQDirectBlockedRows and where
// `g_q_wide` is set, kWidePanels panels are dequantized side by side for the wide float32
// tile instead (x packed in six-row tiles once per call, as the float32 GEMM does): on a
// Sapphire Rapids Xeon the narrow 8-wide tile had made Q4_1 layers at 64 rows slower than
// oneDNN's float32 GEMM (SmolLM2, 64 sequences, 2 threads: 0.88x float32's tokens/s, 1.06x
// with the wide tile); on Zen 4 the wide tile took 1.10-1.40x oneDNN's time against the
// narrow one's 1.00-1.20x.

constexpr int64_t kQDirectRows = 4;
constexpr int64_t kQDirectRows512 = 8;
// Up to this many rows an item runs the AVX-512 direct tile in blocks of kQDirectRows512
// rows per panel (the panel's codes stay in L1 between blocks).
constexpr int64_t kQDirectBlockedRows = 32;
// Whether products above kQDirectBlockedRows take the wide tile (AVX-512 builds): set once
// per process by the caller (`tandem_q_gemm_set_wide`, `quant_linear.choose_wide_tile`); on
// a CPU that runs a zmm FMA as two halves (Zen 4) the narrow tile was the faster.
std::atomic<int> g_q_wide{1};

// fp16 bit patterns -> float32 (exact), `count` a multiple of 16 or not.
void half_to_float(const uint16_t* in, float* out, int64_t count) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
  for (; i < count; ++i) {
    const uint32_t h = in[i];
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
      const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
      out[i] = sign != 0 ? -v : v;
      continue;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    std::memcpy(out + i, &bits, sizeof(float));
  }
}

struct QGemm {
  const float* x;
  int64_t ldx;
  const uint32_t* codes;
  const void* scales;  // float32, or fp16 bits when half_scales
  const void* mins;    // null: zero; else as scales
  const float* bias;
  float* y;
  int64_t ldy, m, n, k, group;
  int bits;
  bool half_scales = false;
  // AVX-512 direct path with mins: xsums[row * groups() + g] = sum of x[row] over group g
  // (q_run fills it; null elsewhere).
  const float* xsums = nullptr;
  // AVX-512, more rows than the direct tile takes: x's full six-row tiles packed k-major
  // for the wide float32 tile (`pack_x_tiles`); null elsewhere.
  const float* xt = nullptr;
  int64_t lane_codes() const { return 32 / bits; }
  int64_t words() const { return (k + lane_codes() - 1) / lane_codes(); }
  int64_t groups() const { return (k + group - 1) / group; }
  const uint32_t* panel_codes(int64_t p) const { return codes + p * words() * kPanel; }
  // Panel p's scales (mins) as float32 [groups][16]: the stored array itself, or for fp16
  // storage a thread-local float32 copy (valid until this thread's next call for the slot).
  const float* panel_scales(int64_t p) const { return panel_floats(scales, p, 0); }
  const float* panel_mins(int64_t p) const {
    return mins != nullptr ? panel_floats(mins, p, 1) : nullptr;
  }
  const float* panel_floats(const void* base, int64_t p, int slot) const {
    const int64_t count = groups() * kPanel;
    if (!half_scales) return static_cast<const float*>(base) + p * count;
    thread_local std::vector<float> copies[2];
    copies[slot].resize(static_cast<size_t>(count));
    half_to_float(static_cast<const uint16_t*>(base) + p * count, copies[slot].data(), count);
    return copies[slot].data();
  }
};

// Panel p's weights as float32 [k][16] (the F32 panel layout), plain loops.
void q_dequant_panel_portable(const QGemm& g, int64_t p, float* out) {
  const uint32_t* codes = g.panel_codes(p);
  const float* scales = g.panel_scales(p);
  const float* mins = g.panel_mins(p);
  const int64_t per = g.lane_codes();
  const uint32_t mask = (1u << g.bits) - 1u;
  for (int64_t kk = 0; kk < g.k; ++kk) {
    const int64_t at = (kk / g.group) * kPanel;
    const int shift = static_cast<int>((kk % per) * g.bits);
    for (int64_t pos = 0; pos < kPanel; ++pos) {
      const float code = static_cast<float>((codes[(kk / per) * kPanel + pos] >> shift) & mask);
      const float product = scales[at + pos] * code;
      out[kk * kPanel + pos] = mins != nullptr ? product + mins[at + pos] : product;
    }
  }
}

#if TANDEM_PANEL_AVX2
struct QGroup {
  __m256 s0, s1, m0, m1;
};

template <bool HasMin>
inline QGroup q_group(const float* scales, const float* mins, int64_t gi) {
  QGroup out;
  out.s0 = _mm256_loadu_ps(scales + gi * kPanel);
  out.s1 = _mm256_loadu_ps(scales + gi * kPanel + 8);
  if constexpr (HasMin) {
    out.m0 = _mm256_loadu_ps(mins + gi * kPanel);
    out.m1 = _mm256_loadu_ps(mins + gi * kPanel + 8);
  } else {
    out.m0 = out.m1 = _mm256_setzero_ps();
  }
  return out;
}

// Code j of the 16 words (two vectors), dequantized.
template <int Bits, bool HasMin>
inline void q_lane_row(__m256i w0, __m256i w1, int j, const QGroup& grp, __m256& lo,
                       __m256& hi) {
  const __m256i mask = _mm256_set1_epi32((1 << Bits) - 1);
  const __m128i shift = _mm_cvtsi32_si128(j * Bits);
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w0, shift), mask));
  hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w1, shift), mask));
  if constexpr (HasMin) {
    lo = _mm256_fmadd_ps(lo, grp.s0, grp.m0);
    hi = _mm256_fmadd_ps(hi, grp.s1, grp.m1);
  } else {
    lo = _mm256_mul_ps(lo, grp.s0);
    hi = _mm256_mul_ps(hi, grp.s1);
  }
}

template <int Bits, bool HasMin>
void q_dequant_panel_avx2(const QGemm& g, int64_t p, float* out) {
  constexpr int kPer = 32 / Bits;
  const uint32_t* codes = g.panel_codes(p);
  const float* scales = g.panel_scales(p);
  const float* mins = g.panel_mins(p);
  QGroup grp = q_group<HasMin>(scales, mins, 0);
  for (int64_t word = 0, k0 = 0; k0 < g.k; ++word, k0 += kPer) {
    if (k0 % g.group == 0) grp = q_group<HasMin>(scales, mins, k0 / g.group);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + word * kPanel));
    const __m256i w1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + word * kPanel + 8));
    const int count = static_cast<int>(std::min<int64_t>(kPer, g.k - k0));
    for (int j = 0; j < count; ++j) {
      __m256 lo, hi;
      q_lane_row<Bits, HasMin>(w0, w1, j, grp, lo, hi);
      _mm256_storeu_ps(out + (k0 + j) * kPanel, lo);
      _mm256_storeu_ps(out + (k0 + j) * kPanel + 8, hi);
    }
  }
}

// MR rows x 16 columns of panel p over all of k, weights dequantized in registers.
template <int MR, int Bits, bool HasMin>
void q_tile_direct(const QGemm& g, int64_t m0, int64_t p) {
  constexpr int kPer = 32 / Bits;
  const int64_t n0 = p * kPanel;
  const int64_t cols = std::min(kPanel, g.n - n0);
  __m256 acc[2][MR][2];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    alignas(32) float start[kPanel] = {};
    if (g.bias != nullptr) std::copy(g.bias + n0, g.bias + n0 + cols, start);
    acc[0][i][0] = _mm256_load_ps(start);
    acc[0][i][1] = _mm256_load_ps(start + 8);
    acc[1][i][0] = acc[1][i][1] = _mm256_setzero_ps();
  }
  const float* xr[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) xr[i] = g.x + (m0 + i) * g.ldx;
  const uint32_t* codes = g.panel_codes(p);
  const float* scales = g.panel_scales(p);
  const float* mins = g.panel_mins(p);
  const int64_t full = g.k / kPer * kPer;  // k in whole words
  QGroup grp = q_group<HasMin>(scales, mins, 0);
  for (int64_t k0 = 0; k0 < full; k0 += kPer) {
    if (k0 % g.group == 0) grp = q_group<HasMin>(scales, mins, k0 / g.group);
    const uint32_t* word = codes + (k0 / kPer) * kPanel;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word + 8));
#pragma GCC unroll 8
    for (int j = 0; j < kPer; ++j) {
      __m256 lo, hi;
      q_lane_row<Bits, HasMin>(w0, w1, j, grp, lo, hi);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr[i] + k0 + j);
        acc[j & 1][i][0] = _mm256_fmadd_ps(xv, lo, acc[j & 1][i][0]);
        acc[j & 1][i][1] = _mm256_fmadd_ps(xv, hi, acc[j & 1][i][1]);
      }
    }
  }
  if (full < g.k) {  // a last, partial word
    if (full % g.group == 0) grp = q_group<HasMin>(scales, mins, full / g.group);
    const uint32_t* word = codes + (full / kPer) * kPanel;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word + 8));
    for (int j = 0; j < static_cast<int>(g.k - full); ++j) {
      __m256 lo, hi;
      q_lane_row<Bits, HasMin>(w0, w1, j, grp, lo, hi);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr[i] + full + j);
        acc[0][i][0] = _mm256_fmadd_ps(xv, lo, acc[0][i][0]);
        acc[0][i][1] = _mm256_fmadd_ps(xv, hi, acc[0][i][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    alignas(32) float out[kPanel];
    _mm256_store_ps(out, _mm256_add_ps(acc[0][i][0], acc[1][i][0]));
    _mm256_store_ps(out + 8, _mm256_add_ps(acc[0][i][1], acc[1][i][1]));
    std::copy(out, out + cols, g.y + (m0 + i) * g.ldy + n0);
  }
}

template <int Bits, bool HasMin>
void q_direct_rows(const QGemm& g, int64_t m0, int64_t rows, int64_t p) {
  switch (rows) {
    case 1: return q_tile_direct<1, Bits, HasMin>(g, m0, p);
    case 2: return q_tile_direct<2, Bits, HasMin>(g, m0, p);
    case 3: return q_tile_direct<3, Bits, HasMin>(g, m0, p);
    default: return q_tile_direct<4, Bits, HasMin>(g, m0, p);
  }
}
#endif

#if TANDEM_PANEL_AVX512
// The AVX-512 decode tile: MR rows x the 16 columns of panel p (one zmm) over all of k.
// Codes are summed against x per group and scaled once per group:
//   y[i][c] += scale[g][c] * sum_k code[c][k] x[i][k]  +  min[g][c] * xsums[i][g]
// so a code costs a shift and a conversion (4-bit: a 16-entry table permute) and one FMA
// per row; the scale and min FMAs are per group. Identity rows still give each weight as
// dequantize() does (scale * code is exact; the min is added with one rounding); in general
// only the summation order differs from the float reference. Needs k % (32 / Bits) == 0.
template <int MR, int Bits, bool HasMin>
void q_tile_direct_512(const QGemm& g, int64_t m0, int64_t p) {
  constexpr int kPer = 32 / Bits;
  const int64_t n0 = p * kPanel;
  const int64_t cols = std::min(kPanel, g.n - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i byte = _mm512_set1_epi32(0xff);
  __m512 acc[MR];
  const float* xr[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    acc[i] = g.bias != nullptr ? _mm512_maskz_loadu_ps(keep, g.bias + n0) : _mm512_setzero_ps();
    xr[i] = g.x + (m0 + i) * g.ldx;
  }
  const uint32_t* codes = g.panel_codes(p);
  const int64_t groups = g.groups();
  // Scales and mins read in place (fp16: converted in the register as they are loaded).
  const auto load16 = [&](const void* base, int64_t gi) {
    const int64_t at = (p * groups + gi) * kPanel;
    if (g.half_scales)
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at)));
    return _mm512_loadu_ps(static_cast<const float*>(base) + at);
  };
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t k0 = gi * g.group;
    const int64_t k1 = std::min(g.k, k0 + g.group);
    __m512 part[2][MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) part[0][i] = part[1][i] = _mm512_setzero_ps();
    for (int64_t kk = k0; kk < k1; kk += kPer) {
      const __m512i w = _mm512_loadu_si512(codes + (kk / kPer) * kPanel);
#pragma GCC unroll 8
      for (int j = 0; j < kPer; ++j) {
        const __m512i shifted = _mm512_srli_epi32(w, j * Bits);
        __m512 q;
        if constexpr (Bits == 4) {
          q = _mm512_permutexvar_ps(shifted, table);  // the low 4 bits index the table
        } else {
          q = _mm512_cvtepi32_ps(j == kPer - 1 ? shifted : _mm512_and_si512(shifted, byte));
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
          part[j & 1][i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i][kk + j]), q, part[j & 1][i]);
      }
    }
    const __m512 s = load16(g.scales, gi);
    __m512 mn = _mm512_setzero_ps();
    if constexpr (HasMin) mn = load16(g.mins, gi);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm512_fmadd_ps(s, _mm512_add_ps(part[0][i], part[1][i]), acc[i]);
      if constexpr (HasMin)
        acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(g.xsums[(m0 + i) * groups + gi]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(g.y + (m0 + i) * g.ldy + n0, keep, acc[i]);
}

template <int Bits, bool HasMin>
void q_direct_rows_512(const QGemm& g, int64_t m0, int64_t rows, int64_t p) {
  switch (rows) {
    case 1: return q_tile_direct_512<1, Bits, HasMin>(g, m0, p);
    case 2: return q_tile_direct_512<2, Bits, HasMin>(g, m0, p);
    case 3: return q_tile_direct_512<3, Bits, HasMin>(g, m0, p);
    case 4: return q_tile_direct_512<4, Bits, HasMin>(g, m0, p);
    case 5: return q_tile_direct_512<5, Bits, HasMin>(g, m0, p);
    case 6: return q_tile_direct_512<6, Bits, HasMin>(g, m0, p);
    case 7: return q_tile_direct_512<7, Bits, HasMin>(g, m0, p);
    default: return q_tile_direct_512<8, Bits, HasMin>(g, m0, p);
  }
}

// The AVX-512 tile applies: a whole number of code words in k.
bool q_direct_512(const QGemm& g) { return g.k % g.lane_codes() == 0; }
#endif

void q_dequant_panel(const QGemm& g, int64_t p, float* out, bool portable) {
#if TANDEM_PANEL_AVX2
  if (!portable) {
    const bool has_min = g.mins != nullptr;
    if (g.bits == 4)
      return has_min ? q_dequant_panel_avx2<4, true>(g, p, out)
                     : q_dequant_panel_avx2<4, false>(g, p, out);
    return has_min ? q_dequant_panel_avx2<8, true>(g, p, out)
                   : q_dequant_panel_avx2<8, false>(g, p, out);
  }
#endif
  q_dequant_panel_portable(g, p, out);
}

// Rows [r0, r1) x panels [p0, p1).
void q_run_item(const QGemm& g, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
                bool portable) {
#if TANDEM_PANEL_AVX2
  const bool has_min = g.mins != nullptr;
#if TANDEM_PANEL_AVX512
  if (!portable && r1 - r0 <= kQDirectBlockedRows && q_direct_512(g) &&
      (!has_min || g.xsums != nullptr)) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t m = r0; m < r1; m += kQDirectRows512) {
        const int64_t rows = std::min(kQDirectRows512, r1 - m);
        if (g.bits == 4) {
          has_min ? q_direct_rows_512<4, true>(g, m, rows, p)
                  : q_direct_rows_512<4, false>(g, m, rows, p);
        } else {
          has_min ? q_direct_rows_512<8, true>(g, m, rows, p)
                  : q_direct_rows_512<8, false>(g, m, rows, p);
        }
      }
    }
    return;
  }
#endif
  if (!portable && r1 - r0 <= kQDirectRows) {
    for (int64_t p = p0; p < p1; ++p) {
      if (g.bits == 4) {
        has_min ? q_direct_rows<4, true>(g, r0, r1 - r0, p)
                : q_direct_rows<4, false>(g, r0, r1 - r0, p);
      } else {
        has_min ? q_direct_rows<8, true>(g, r0, r1 - r0, p)
                : q_direct_rows<8, false>(g, r0, r1 - r0, p);
      }
    }
    return;
  }
#endif
  thread_local std::vector<float> panel;
  int64_t p = p0;
#if TANDEM_PANEL_AVX512
  if (!portable && g.xt != nullptr) {
    // kWidePanels panels dequantized side by side (the float32 panel layout), then the
    // wide tile over the full six-row tiles and the narrow one over the rest: one float32
    // FMA chain over k per element, as the narrow tile computes it.
    const int64_t stride = g.k * kPanel;
    panel.resize(static_cast<size_t>(kWidePanels * stride));
    const int64_t full_end = r0 + (r1 - r0) / kTileRows * kTileRows;
    for (; p + kWidePanels <= p1; p += kWidePanels) {
      for (int64_t q = 0; q < kWidePanels; ++q)
        q_dequant_panel(g, p + q, panel.data() + q * stride, portable);
      const int64_t n0 = p * kPanel;
      Gemm<F32> wide{g.x,  g.ldx, panel.data(), g.bias != nullptr ? g.bias + n0 : nullptr,
                     g.y + n0, g.ldy, g.m, g.n - n0, g.k};
      wide.xt = g.xt;
      for (int64_t m = r0; m < full_end; m += kTileRows) tile_f32_wide(wide, m, 0, 0, g.k, true);
      for (int64_t q = 0; full_end < r1 && q < kWidePanels; ++q)
        pick_tile<F32>(r1 - full_end, portable)(wide, full_end, q, 0, g.k, true);
    }
  }
#endif
  panel.resize(std::max(panel.size(), static_cast<size_t>(g.k * kPanel)));
  for (; p < p1; ++p) {
    q_dequant_panel(g, p, panel.data(), portable);
    const int64_t n0 = p * kPanel;
    const Gemm<F32> one{g.x,  g.ldx, panel.data(), g.bias != nullptr ? g.bias + n0 : nullptr,
                        g.y + n0, g.ldy, g.m, g.n - n0, g.k};
    for (int64_t m = r0; m < r1; m += kTileRows)
      pick_tile<F32>(std::min(kTileRows, r1 - m), portable)(one, m, 0, 0, g.k, true);
  }
}

// Panels split between threads in dynamically scheduled chunks (as `run`); rows too when
// panels are fewer than threads, in row parts of whole kTileRows tiles.
void q_run(QGemm g, int threads, bool portable) {
  const int64_t panels = (g.n + kPanel - 1) / kPanel;
  if (g.m <= 0 || panels <= 0) return;
#if TANDEM_PANEL_AVX512
  // The rows the AVX-512 direct tile takes (m <= kQDirectBlockedRows) need x's per-group
  // sums for the mins.
  thread_local std::vector<float> xsums;
  if (!portable && g.m <= kQDirectBlockedRows && g.mins != nullptr && q_direct_512(g)) {
    const int64_t groups = g.groups();
    xsums.assign(static_cast<size_t>(g.m * groups), 0.0f);
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t kk = 0; kk < g.k; ++kk) xsums[i * groups + kk / g.group] += g.x[i * g.ldx + kk];
    g.xsums = xsums.data();
  }
#endif
  const int64_t want = std::max(threads, 1);
  // Chunks of whole wide groups where the wide tile runs (as `run`)
  int64_t unit = 1;
#if TANDEM_PANEL_AVX512
  if (!portable && g.m > kQDirectBlockedRows && panels >= kWidePanels &&
      g_q_wide.load(std::memory_order_relaxed) != 0) {
    g.xt = wide_x_tiles(g.x, g.ldx, g.m, g.k, want);
    unit = kWidePanels;
  }
#endif
  split_items(g.m, panels, unit, want, [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    q_run_item(g, r0, r1, p0, p1, portable);
  });
}

}  // namespace

extern "C" int tandem_panel_gemm_abi_version() { return 5; }

// Products of more than 32 rows on the wide tile (1, the default) or the narrow one (0);
// returns the previous setting. Process-wide; a no-op without AVX-512.
extern "C" int tandem_q_gemm_set_wide(int wide) { return g_q_wide.exchange(wide != 0 ? 1 : 0); }

// 1 when the AVX2/FMA tile is compiled in, 0 when only the portable loops are.
extern "C" int tandem_panel_gemm_vectorized() { return TANDEM_PANEL_AVX2; }

extern "C" void tandem_f32_pack(const float* w, int64_t ldw, float* out, int64_t n, int64_t k,
                                int threads) {
  pack<F32>(w, ldw, out, n, k, threads);
}

extern "C" void tandem_bf16_pack_f32(const float* w, int64_t ldw, uint16_t* out, int64_t n,
                                     int64_t k, int threads) {
  pack<BF16>(w, ldw, out, n, k, threads);
}

extern "C" void tandem_bf16_pack_bf16(const uint16_t* w, int64_t ldw, uint16_t* out,
                                      int64_t n, int64_t k, int threads) {
  pack<BF16>(w, ldw, out, n, k, threads);
}

// `portable` != 0: the plain-loop tile only (tests; CPUs without AVX2 use it anyway).
extern "C" void tandem_f32_gemm(const float* x, int64_t ldx, const float* packed,
                                const float* bias, float* y, int64_t ldy, int64_t m, int64_t n,
                                int64_t k, int threads, int portable) {
  gemm<F32>(x, ldx, packed, bias, y, ldy, m, n, k, threads, portable != 0);
}

extern "C" void tandem_bf16_gemm(const float* x, int64_t ldx, const uint16_t* packed,
                                 const float* bias, float* y, int64_t ldy, int64_t m,
                                 int64_t n, int64_t k, int threads, int portable) {
  gemm<BF16>(x, ldx, packed, bias, y, ldy, m, n, k, threads, portable != 0);
}

// Quantized weights (see "Quantized weights" above). bits: 4 or 8; mins may be null;
// half_scales: scales and mins are fp16 bit patterns (else float32).
extern "C" void tandem_q_gemm(const float* x, int64_t ldx, const uint32_t* codes,
                              const void* scales, const void* mins, const float* bias,
                              float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                              int64_t group, int bits, int half_scales, int threads,
                              int portable) {
  const QGemm g{x, ldx, codes, scales, mins, bias, y, ldy, m, n, k, group, bits, half_scales != 0};
  q_run(g, threads, portable != 0);
}

// Panel p of the quantized weight dequantized into out [k][16] (tests).
extern "C" void tandem_q_dequant_panel(const uint32_t* codes, const void* scales,
                                       const void* mins, int64_t n, int64_t k, int64_t group,
                                       int bits, int half_scales, int64_t p, float* out,
                                       int portable) {
  const QGemm g{nullptr, 0, codes, scales, mins, nullptr, nullptr, 0,
                0,       n, k,     group,  bits, half_scales != 0};
  q_dequant_panel(g, p, out, portable != 0);
}
