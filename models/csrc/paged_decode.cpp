// Decode attention over paged KV pools: one query token per request, read in place.
//
// k_pool: [num_blocks, kv_heads, head_dim, block_size] (keys transposed per block, so a
//         block's scores are head_dim vector FMAs across its tokens, no reductions).
// v_pool: [num_blocks, block_size, kv_heads, head_dim].
// The pools are float32 (`tandem_paged_decode_f32`) or bfloat16 (`tandem_paged_decode_bf16`,
//         uint16 storage: each value widened to float32 exactly by a 16-bit shift as it is
//         read; everything else, scores, softmax and accumulation, is float32).
// q, out: [num_requests, q_heads, head_dim] float32.
// block_tables: [num_requests, max_blocks] int64; seq_lens: [num_requests] int64 (keys to
//         attend, the new token's included; its K/V are already written).
// All tensors contiguous.
//
// `tandem_write_kv_f32` stores a step's keys and values into float32 pools of that layout
// (`tandem_write_kv_bf16` into bfloat16 pools, rounding to nearest even like torch's cast):
// token t goes to slot slots[t] (block slots[t] / block_size, offset slots[t] % block_size);
// key/value rows are [kv_heads, head_dim] contiguous, rows `*_row_stride` floats apart (the
// views of a fused qkv projection). One pass, no index tensors.
//
// Work item = (request, kv head): the q_heads / kv_heads query heads of a GQA group share
// one pass over the group's keys, a softmax, and one pass over its values. Each key and
// value is read once; nothing is gathered or copied. Common shapes (head_dim 64 or 128,
// block_size 16, up to 8 query heads per KV head) are compiled with those sizes fixed and
// native-width vectors, so the accumulators live in registers; other shapes take the
// generic loop. Measured with one thread, SmolLM2's shape (3 KV heads x 3 query heads,
// head_dim 64), 64 requests of 95-190 keys: 0.68 ms per layer call, ~21 GB/s of KV read,
// against 5.0 ms with 16-float vectors (which GCC kept on the stack on AVX2).

#include <algorithm>
#include <utility>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// T: the pools' element type, float or uint16_t (bfloat16 bits).
template <typename T>
struct Problem {
  const float* q;
  const T* k_pool;
  const T* v_pool;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  float* out;
  int64_t q_heads, kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

constexpr int64_t kPrefetchBlocks = 4;

// The native vector: GCC vector extensions, so any target compiles it (one AVX-512
// register of 16 floats, one AVX2 register of 8, or two SSE ones). A wider type than the
// hardware's makes GCC keep the accumulators on the stack.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// bfloat16 is the top half of a float32: widening is a shift, exact.
typedef uint16_t HalfBits __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t WideBits __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Vec load(const uint16_t* p) {
  HalfBits h;
  __builtin_memcpy(&h, p, sizeof(h));
  const WideBits w = __builtin_convertvector(h, WideBits) << 16;
  Vec v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

inline float to_float(float x) { return x; }

inline float to_float(uint16_t x) {
  const uint32_t w = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &w, sizeof(f));
  return f;
}

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

template <typename T>
void prefetch_block(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

template <typename T>
void prefetch_block_l2(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// exp(s[t] - max s) over s[0..len) in place; returns 1 / their sum (the loops vectorise,
// exp included).
float exp_weights(float* s, int64_t len) {
  float peak = s[0];
  for (int64_t t = 1; t < len; ++t) peak = std::max(peak, s[t]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < len; ++t) {
    const float e = std::exp(s[t] - peak);
    s[t] = e;
    total += e;
  }
  return 1.f / total;
}

// Normalised softmax of s[0..len) in place.
void softmax(float* s, int64_t len) {
  const float inv = exp_weights(s, len);
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

// The specialised item: block size 16, head_dim D a multiple of 16, G query heads per KV
// head. Scores: per key-dimension d one load of the block's 16 keys serves all G heads
// (G x 16 / kLanes accumulators). Values: per 16-wide slice of head_dim, G x 16 / kLanes
// accumulators over every key, so the accumulators stay in registers for G up to 7.
constexpr int64_t kBlock = 16;
constexpr int kPerSlice = 16 / kLanes;

template <typename T, int D, int G>
void decode_item_fast(const Problem<T>& p, int64_t r, int64_t h, float* scores, int64_t padded) {
  const int64_t len = p.seq_lens[r];
  const int64_t num_blocks = (len + kBlock - 1) / kBlock;
  const int64_t* table = p.block_tables + r * p.max_blocks;
  const int64_t v_row = p.kv_heads * D;
  float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = p.q[(r * p.q_heads + h * G + g) * D + d] * p.scale;

  auto key_block = [&](int64_t b) { return p.k_pool + (table[b] * p.kv_heads + h) * D * kBlock; };
  for (int64_t b = 0; b < std::min<int64_t>(kPrefetchBlocks, num_blocks); ++b)
    prefetch_block(key_block(b), D * kBlock);
  // The whole item's keys and values requested into L2 up front: the pages are scattered
  // and cold (a step's pools outgrow the caches), and many misses in flight at once is what
  // makes the item fast; the near prefetches below then find them in L2.
  for (int64_t b = kPrefetchBlocks; b < num_blocks; ++b) prefetch_block_l2(key_block(b), D * kBlock);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const T* vb = p.v_pool + table[b] * kBlock * v_row + h * D;
    const int64_t rows = std::min<int64_t>(kBlock, len - b * kBlock);
    for (int64_t t = 0; t < rows; ++t) prefetch_block_l2(vb + t * v_row, D);
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    // The pages are scattered, so the hardware prefetcher cannot run ahead of them.
    if (b + kPrefetchBlocks < num_blocks) prefetch_block(key_block(b + kPrefetchBlocks), D * kBlock);
    const T* kt = key_block(b);
    Vec acc[G][kPerSlice] = {};
    for (int d = 0; d < D; ++d) {
      Vec k[kPerSlice];
      for (int c = 0; c < kPerSlice; ++c) k[c] = load(kt + d * kBlock + c * kLanes);
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < kPerSlice; ++c) acc[g][c] += qs[g][d] * k[c];
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kPerSlice; ++c) store(scores + g * padded + b * kBlock + c * kLanes, acc[g][c]);
  }
  for (int g = 0; g < G; ++g) softmax(scores + g * padded, len);

  float* o = p.out + (r * p.q_heads + h * G) * D;
  for (int d0 = 0; d0 < D; d0 += 16) {
    Vec acc[G][kPerSlice] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* vb = p.v_pool + table[b] * kBlock * v_row + h * D + d0;
      if (b + 2 < num_blocks) {
        const T* ahead = p.v_pool + table[b + 2] * kBlock * v_row + h * D + d0;
        for (int64_t t = 0; t < kBlock; ++t) __builtin_prefetch(ahead + t * v_row);
      }
      const int64_t rows = std::min<int64_t>(kBlock, len - b * kBlock);
      const float* w = scores + b * kBlock;
      for (int64_t t = 0; t < rows; ++t) {
        Vec v[kPerSlice];
        for (int c = 0; c < kPerSlice; ++c) v[c] = load(vb + t * v_row + c * kLanes);
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < kPerSlice; ++c) acc[g][c] += w[g * padded + t] * v[c];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kPerSlice; ++c) store(o + g * D + d0 + c * kLanes, acc[g][c]);
  }
}

// Any other shape: D, BS, G read from p.
template <typename T>
void decode_item_generic(const Problem<T>& p, int64_t r, int64_t h, float* scores, int64_t padded) {
  const int64_t D = p.head_dim;
  const int64_t BS = p.block_size;
  const int64_t G = p.q_heads / p.kv_heads;
  const int64_t len = p.seq_lens[r];
  const int64_t num_blocks = (len + BS - 1) / BS;
  const int64_t* table = p.block_tables + r * p.max_blocks;
  const float* qg = p.q + (r * p.q_heads + h * G) * D;
  const int64_t v_row = p.kv_heads * D;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const T* kt = p.k_pool + (table[b] * p.kv_heads + h) * D * BS;
    for (int64_t g = 0; g < G; ++g) {
      const float* qv = qg + g * D;
      float* s = scores + g * padded + b * BS;
      std::fill(s, s + BS, 0.f);
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qv[d] * p.scale;
        for (int64_t t = 0; t < BS; ++t) s[t] += qd * to_float(kt[d * BS + t]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax(scores + g * padded, len);
  float* o = p.out + (r * p.q_heads + h * G) * D;
  std::fill(o, o + G * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const T* v = p.v_pool + (table[t / BS] * BS + t % BS) * v_row + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * padded + t];
      for (int64_t d = 0; d < D; ++d) o[g * D + d] += w * to_float(v[d]);
    }
  }
}

template <typename T>
using ItemFn = void (*)(const Problem<T>&, int64_t, int64_t, float*, int64_t);

template <typename T, int D>
ItemFn<T> pick_group(int64_t g) {
  switch (g) {
    case 1: return decode_item_fast<T, D, 1>;
    case 2: return decode_item_fast<T, D, 2>;
    case 3: return decode_item_fast<T, D, 3>;
    case 4: return decode_item_fast<T, D, 4>;
    case 5: return decode_item_fast<T, D, 5>;
    case 6: return decode_item_fast<T, D, 6>;
    case 7: return decode_item_fast<T, D, 7>;
    case 8: return decode_item_fast<T, D, 8>;
    default: return decode_item_generic<T>;
  }
}

template <typename T>
ItemFn<T> pick(int64_t head_dim, int64_t block_size, int64_t group) {
  if (block_size == kBlock && head_dim == 64) return pick_group<T, 64>(group);
  if (block_size == kBlock && head_dim == 128) return pick_group<T, 128>(group);
  return decode_item_generic<T>;
}

// Query tiles: the rows of one request's prefill chunk (or verify span) are consecutive
// queries over the same keys, row i + 1 seeing one key more than row i. A tile of up to Q
// such rows shares each key and value load across its Q x G query heads: per key-dimension
// d one load of a block's 16 keys feeds Q x G accumulators, and per value row one load
// feeds Q x G. Q is set so the accumulators fill the vector registers (24 of AVX-512's
// 32, 12 of AVX2's 16). Every key the tile reads lies before its last row's length, and
// every one of them was written (the chunk's own keys are written before attending), so
// a shorter row's extra scores are finite; its weights past its own length are zeroed
// after its softmax, which keeps each row's result exactly that of its own decode item.
constexpr int kAccumulators = kLanes == 16 ? 24 : 12;

constexpr int tile_rows(int group) {
  const int q = kAccumulators / (group * kPerSlice);
  return q < 1 ? 1 : (q > 16 ? 16 : q);
}

template <typename T, int D, int G>
void tile_item_fast(const Problem<T>& p, int64_t r0, int64_t n, int64_t h, float* scores,
                    int64_t padded) {
  constexpr int Q = tile_rows(G);
  constexpr int R = Q * G;  // score row i = query row (i / G), head (i % G)
  const int64_t last = r0 + n - 1;
  const int64_t len_max = p.seq_lens[last];
  const int64_t num_blocks = (len_max + kBlock - 1) / kBlock;
  const int64_t* table = p.block_tables + last * p.max_blocks;
  const int64_t v_row = p.kv_heads * D;
  // qs[d][i]: row i's scaled query at dimension d (rows past n repeat the last: unused).
  alignas(64) float qs[D][R];
  for (int qi = 0; qi < Q; ++qi) {
    const int64_t r = r0 + std::min<int64_t>(qi, n - 1);
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) qs[d][qi * G + g] = p.q[(r * p.q_heads + h * G + g) * D + d] * p.scale;
  }
  auto key_block = [&](int64_t b) { return p.k_pool + (table[b] * p.kv_heads + h) * D * kBlock; };
  for (int64_t b = 0; b < std::min<int64_t>(kPrefetchBlocks, num_blocks); ++b)
    prefetch_block(key_block(b), D * kBlock);
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (b + kPrefetchBlocks < num_blocks) prefetch_block(key_block(b + kPrefetchBlocks), D * kBlock);
    const T* kt = key_block(b);
    Vec acc[R][kPerSlice] = {};
    for (int d = 0; d < D; ++d) {
      Vec k[kPerSlice];
      for (int c = 0; c < kPerSlice; ++c) k[c] = load(kt + d * kBlock + c * kLanes);
#pragma GCC unroll 64
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < kPerSlice; ++c) acc[i][c] += qs[d][i] * k[c];
    }
#pragma GCC unroll 64
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int c = 0; c < kPerSlice; ++c) store(scores + i * padded + b * kBlock + c * kLanes, acc[i][c]);
  }
  // Softmax per row, normalised while it is transposed key-major (wt[t * R + i]: the value
  // pass broadcasts a key's R weights from one line instead of R rows `padded` apart).
  // Past a row's own length (and in padding rows, whose sums are discarded) weights are 0.
  float* wt = scores + R * padded;
  float inv[R];
  for (int i = 0; i < R; ++i) {
    float* s = scores + i * padded;
    const int64_t len = i / G < n ? p.seq_lens[r0 + i / G] : 0;
    inv[i] = len > 0 ? exp_weights(s, len) : 0.f;
    std::fill(s + len, s + len_max, 0.f);
  }
  for (int64_t t = 0; t < len_max; ++t)
#pragma GCC unroll 64
    for (int i = 0; i < R; ++i) wt[t * R + i] = scores[i * padded + t] * inv[i];
  for (int d0 = 0; d0 < D; d0 += 16) {
    Vec acc[R][kPerSlice] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* vb = p.v_pool + table[b] * kBlock * v_row + h * D + d0;
      if (b + 2 < num_blocks) {
        const T* ahead = p.v_pool + table[b + 2] * kBlock * v_row + h * D + d0;
        for (int64_t t = 0; t < kBlock; ++t) __builtin_prefetch(ahead + t * v_row);
      }
      const int64_t rows = std::min<int64_t>(kBlock, len_max - b * kBlock);
      const float* w = wt + b * kBlock * R;
      for (int64_t t = 0; t < rows; ++t) {
        Vec v[kPerSlice];
        for (int c = 0; c < kPerSlice; ++c) v[c] = load(vb + t * v_row + c * kLanes);
#pragma GCC unroll 64
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
          for (int c = 0; c < kPerSlice; ++c) acc[i][c] += w[t * R + i] * v[c];
      }
    }
#pragma GCC unroll 64
    for (int i = 0; i < R; ++i) {
      if (i / G >= n) continue;
      float* o = p.out + ((r0 + i / G) * p.q_heads + h * G + i % G) * D + d0;
      for (int c = 0; c < kPerSlice; ++c) store(o + c * kLanes, acc[i][c]);
    }
  }
}

template <typename T>
using TileFn = void (*)(const Problem<T>&, int64_t, int64_t, int64_t, float*, int64_t);

// The tile kernel and its rows for (head_dim, block_size, group); {nullptr, 1} where the
// shape has no tile kernel (each row then runs as its own decode item).
template <typename T>
std::pair<TileFn<T>, int> pick_tile(int64_t head_dim, int64_t block_size, int64_t group) {
  if (block_size != kBlock || (head_dim != 64 && head_dim != 128)) return {nullptr, 1};
#define TANDEM_TILE_CASE(G)                                                                    \
  case G:                                                                                      \
    return head_dim == 64 ? std::pair<TileFn<T>, int>{tile_item_fast<T, 64, G>, tile_rows(G)} \
                          : std::pair<TileFn<T>, int>{tile_item_fast<T, 128, G>, tile_rows(G)};
  switch (group) {
    TANDEM_TILE_CASE(1)
    TANDEM_TILE_CASE(2)
    TANDEM_TILE_CASE(3)
    TANDEM_TILE_CASE(4)
    default: return {nullptr, 1};
  }
#undef TANDEM_TILE_CASE
}

// Splits rows into tiles: row r joins the tile of row r - 1 when it sees one key more and
// has the same block table over its keys (rows of one request), up to `max_rows` a tile.
std::vector<std::pair<int64_t, int64_t>> query_tiles(const int64_t* block_tables, const int64_t* seq_lens,
                                                     int64_t num_requests, int64_t max_blocks,
                                                     int64_t block_size, int max_rows) {
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first row, rows)
  for (int64_t r = 0; r < num_requests; ++r) {
    if (!tiles.empty()) {
      auto& tile = tiles.back();
      const int64_t prev = r - 1;
      const int64_t blocks = (seq_lens[r] + block_size - 1) / block_size;
      if (tile.second < max_rows && seq_lens[r] == seq_lens[prev] + 1 &&
          std::equal(block_tables + r * max_blocks, block_tables + r * max_blocks + blocks,
                     block_tables + prev * max_blocks)) {
        ++tile.second;
        continue;
      }
    }
    tiles.emplace_back(r, 1);
  }
  return tiles;
}

template <typename T>
void run(const Problem<T>& p, int64_t num_requests, int num_threads) {
  const int64_t group = p.q_heads / p.kv_heads;
  const ItemFn<T> item_fn = pick<T>(p.head_dim, p.block_size, group);
  const auto [tile_fn, tile_max] = pick_tile<T>(p.head_dim, p.block_size, group);
  const auto tiles = query_tiles(p.block_tables, p.seq_lens, num_requests, p.max_blocks,
                                 p.block_size, tile_fn ? tile_max : 1);
  int64_t longest = 0;
  for (int64_t r = 0; r < num_requests; ++r) longest = std::max(longest, p.seq_lens[r]);
  const int64_t padded = (longest + p.block_size - 1) / p.block_size * p.block_size;
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * p.kv_heads;

#pragma omp parallel num_threads(num_threads)
  {
    // Scores of a tile's rows, and (tiles only) the same again for their transpose.
    std::vector<float> scores(group * std::max<int64_t>(tile_max, 1) * padded * (tile_fn ? 2 : 1));
    // Longest tiles first (a prefill's last rows see the most keys): less idle tail.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t item = num_items - 1 - i;
      const auto [r0, rows] = tiles[item / p.kv_heads];
      const int64_t h = item % p.kv_heads;
      if (rows > 1)
        tile_fn(p, r0, rows, h, scores.data(), padded);
      else
        item_fn(p, r0, h, scores.data(), padded);
    }
  }
}

}  // namespace

extern "C" int tandem_paged_decode_abi_version() { return 5; }

extern "C" void tandem_paged_decode_f32(const float* q, const float* k_pool, const float* v_pool,
                                        const int64_t* block_tables, const int64_t* seq_lens,
                                        float* out, int64_t num_requests, int64_t q_heads,
                                        int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                        int64_t max_blocks, float scale, int num_threads) {
  const Problem<float> p{q,        k_pool,   v_pool,     block_tables, seq_lens, out,  q_heads,
                         kv_heads, head_dim, block_size, max_blocks,   scale};
  run(p, num_requests, num_threads);
}

// The same with bfloat16 pools (raw uint16 bits); q and out stay float32.
extern "C" void tandem_paged_decode_bf16(const float* q, const uint16_t* k_pool,
                                         const uint16_t* v_pool, const int64_t* block_tables,
                                         const int64_t* seq_lens, float* out,
                                         int64_t num_requests, int64_t q_heads, int64_t kv_heads,
                                         int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                         float scale, int num_threads) {
  const Problem<uint16_t> p{q,        k_pool,   v_pool,     block_tables, seq_lens, out,  q_heads,
                            kv_heads, head_dim, block_size, max_blocks,   scale};
  run(p, num_requests, num_threads);
}

namespace {

inline float to_pool(float x, float*) { return x; }

// Round to nearest even (NaN stays a quiet NaN), as torch's float32 -> bfloat16 cast does.
inline uint16_t to_pool(float x, uint16_t*) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
void write_kv(T* k_pool, T* v_pool, const float* key, const float* value, const int64_t* slots,
              int64_t num_tokens, int64_t key_row_stride, int64_t value_row_stride,
              int64_t kv_heads, int64_t head_dim, int64_t block_size) {
  const int64_t width = kv_heads * head_dim;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    const int64_t block = slot / block_size, offset = slot % block_size;
    const float* k_row = key + t * key_row_stride;
    T* k_block = k_pool + block * width * block_size + offset;
    for (int64_t i = 0; i < width; ++i) k_block[i * block_size] = to_pool(k_row[i], k_pool);
    const float* v_row = value + t * value_row_stride;
    T* v_slot = v_pool + slot * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) v_slot[i] = to_pool(v_row[i], v_pool);
  }
}

}  // namespace

extern "C" void tandem_write_kv_f32(float* k_pool, float* v_pool, const float* key,
                                    const float* value, const int64_t* slots, int64_t num_tokens,
                                    int64_t key_row_stride, int64_t value_row_stride,
                                    int64_t kv_heads, int64_t head_dim, int64_t block_size) {
  write_kv(k_pool, v_pool, key, value, slots, num_tokens, key_row_stride, value_row_stride,
           kv_heads, head_dim, block_size);
}

// The same into bfloat16 pools (raw uint16 bits), each value rounded to nearest even.
extern "C" void tandem_write_kv_bf16(uint16_t* k_pool, uint16_t* v_pool, const float* key,
                                     const float* value, const int64_t* slots,
                                     int64_t num_tokens, int64_t key_row_stride,
                                     int64_t value_row_stride, int64_t kv_heads, int64_t head_dim,
                                     int64_t block_size) {
  write_kv(k_pool, v_pool, key, value, slots, num_tokens, key_row_stride, value_row_stride,
           kv_heads, head_dim, block_size);
}
