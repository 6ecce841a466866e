// Grouped-query attention that reads each row's window straight from a paged KV cache
// (XLA:CPU custom call; docs/design.md, "Attention on XLA:CPU").
//
// XLA:CPU lowers every dot to a kernel whose operands are whole buffers, so the XLA form of decode
// attention first gathers each row's window [W, G, H] out of the cache, every layer, every step. This
// kernel takes the pool of pages and the block table and reads the window where it lies.
//
//   q      [B, T, N, H] f32       queries (RoPE applied)
//   k, v   [Np, P, G, H] f32      one layer's pool of pages, this step's keys/values already written
//   table  [B, ceil(W/P)] s32     position w of row b lies in page table[b, w / P], offset w % P
//   mask   [B, T, W] pred         which window positions each query sees
//   out    [B, T, N, H] f32       softmax(q·k / sqrt(H), masked) · v, over positions [0, W) of the row
//
// A per-slot cache [S+1, M, G, H] is the case P = M with table = slot ids [B, 1] (one page a slot).
// A row whose mask is all false averages the whole window, as the XLA form does (every score is
// the same large negative number there). Query head n reads kv head n / (N / G).
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "target_clones.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxHeadDim = 256;

// Eight floats in a vector register (two halves on baseline x86-64), loaded from any address.
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) F8 Load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)): the order of a register's fold in halves
static inline __attribute__((always_inline)) float HorizontalSum(F8 x) {
  F4 four = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  F4 two = four + __builtin_shufflevector(four, four, 2, 3, 2, 3);
  return two[0] + two[1];
}

// exp(x) for the softmax's x = score - max ≤ 0, as plain arithmetic so that a loop of it vectorises:
// 2^n · e^r with n = round(x / ln 2), |r| ≤ ln(2)/2, e^r by its Taylor polynomial to degree 7 (relative
// error under 1e-8 before rounding). Exactly 0 below -87 (where e^x leaves the normal floats): a masked
// score (the lowest float) gives an exact 0, as in the XLA form.
static inline __attribute__((always_inline)) float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 · 2^23: adding and subtracting it rounds to an integer
  const float n = (clamped * 1.44269504088896341f + shifter) - shifter;
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln 2 in two parts
  float p = 1.0f / 5040.0f + r * (1.0f / 40320.0f);
  p = 1.0f / 720.0f + r * p;
  p = 1.0f / 120.0f + r * p;
  p = 1.0f / 24.0f + r * p;
  p = 1.0f / 6.0f + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float two_to_n;
  std::memcpy(&two_to_n, &exponent_bits, sizeof two_to_n);
  const float in_range = x < -87.0f ? 0.0f : 1.0f;
  return p * two_to_n * in_range;
}

// One query row: its query vector [H], its mask row [W], where its output [H] goes, its row's block table
// [ceil(W/P)], the offset of the kv head it reads within a position (g·H), how many leading positions it
// attends over (one past the last it sees, as positions after that add exact zeros, or W if it sees none), and
// its partial results, one per chunk of positions it attends (see Partial).
struct Query {
  const float* q;
  const bool* sees;
  float* out;
  const int32_t* pages;
  int64_t head;
  int64_t w_end;
  float* partials;
};

// The pool of pages of one layer: position `offset` of page `page` starts (all kv heads) at
// k + (page·P + offset)·stride, stride = G·H floats.
struct Pool {
  const float* k;
  const float* v;
  int64_t page_size;
  int64_t stride;
};

// Where positions [from, to) of a row lie in the pool: offsets[w - from] = floats from the pool's start to
// position w (all kv heads). Filled page run by page run: the page is looked up once per run of up to P
// contiguous positions, whose offsets then step by the stride.
static inline __attribute__((always_inline)) void PositionOffsets(const int32_t* pages, const Pool& pool,
                                                                  int64_t from, int64_t to, int64_t* offsets) {
  for (int64_t first = from; first < to;) {
    const int64_t page = first / pool.page_size, in_page = first - page * pool.page_size;
    const int64_t end = std::min(to, first + pool.page_size - in_page);
    int64_t offset = (static_cast<int64_t>(pages[page]) * pool.page_size + in_page) * pool.stride;
    for (int64_t w = first; w < end; ++w, offset += pool.stride) offsets[w - from] = offset;
    first = end;
  }
}

// One past the last true entry of mask[0, w_len), or w_len if there is none (a query that sees nothing
// averages the whole window, as in the XLA form). Scans from the end, eight bytes at a time.
int64_t AttendedPositions(const bool* mask, int64_t w_len) {
  int64_t w = w_len;
  for (; w >= 8; w -= 8) {
    uint64_t word;
    std::memcpy(&word, mask + w - 8, sizeof word);
    if (word != 0) break;
  }
  for (; w > 0; --w) {
    if (mask[w - 1]) return w;
  }
  return w_len;
}

// q · k over one head before its fold: two 8-lane partial sums (even and odd chunks of 8), added.
static inline __attribute__((always_inline)) F8 DotLanes(const F8* q_chunks, const float* __restrict k_w,
                                                         int64_t chunks) {
  F8 even = {}, odd = {};
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    even += q_chunks[c] * Load8(k_w + 8 * c);
    odd += q_chunks[c + 1] * Load8(k_w + 8 * c + 8);
  }
  if (c < chunks) even += q_chunks[c] * Load8(k_w + 8 * c);  // h = 16·m + 8
  return even + odd;
}

// The four halves-folded sums of four 8-lane vectors: with f = lanes 0-3 + lanes 4-7 of each,
// ((f0 + f1) + (f2 + f3)) for each, computed side by side.
static inline __attribute__((always_inline)) F4 FoldFour(F8 a, F8 b, F8 c, F8 d) {
  const F4 fa = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const F4 fb = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  const F4 fc = __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
  const F4 fd = __builtin_shufflevector(d, d, 0, 1, 2, 3) + __builtin_shufflevector(d, d, 4, 5, 6, 7);
  const F4 ab = __builtin_shufflevector(fa, fb, 0, 2, 4, 6) + __builtin_shufflevector(fa, fb, 1, 3, 5, 7);
  const F4 cd = __builtin_shufflevector(fc, fd, 0, 2, 4, 6) + __builtin_shufflevector(fc, fd, 1, 3, 5, 7);
  return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
}

// FoldFour of one vector: ((f0 + f1) + (f2 + f3)), the same operations in the same order.
static inline __attribute__((always_inline)) float FoldOne(F8 a) {
  const F4 f = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (f[0] + f[1]) + (f[2] + f[3]);
}

// ExpNonPositive on eight lanes (the same operations lane by lane).
static inline __attribute__((always_inline)) F8 ExpNonPositive8(F8 x) {
  F8 out;
  for (int l = 0; l < 8; ++l) out[l] = ExpNonPositive(x[l]);
  return out;
}

// The window is cut into chunks of kChunk positions, attended one chunk at a time: each query gets a partial
// result per chunk (its top score there, the sum of exp(score - top), and sum exp(score - top) · v), and the
// partials are merged in chunk order at the end. The chunking is fixed, so the result of a query depends on
// what it sees and never on how a call is split over threads; chunks let a call with few rows, a decode
// step's, spread its window over every thread.
constexpr int64_t kChunk = 128;
// Within a chunk the positions are walked in tiles of kTile, and every query of a row takes its turn on a tile
// while the tile's keys (then values) are in L1: the row's queries read the window from memory once, as one
// contiguous run of positions (all kv heads), not once per query.
constexpr int64_t kTile = 32;
// Splitting a call over XLA's intra-op threads: calls with fewer (query, position) pairs than this run on the
// calling thread alone (waking a pool thread costs more than they take), and a row of fewer queries than
// kQueriesWorthASplit is not cut into pieces of queries (pieces read the window apart). Both set by timing
// the step on a 2-core host (docs/benchmarks.md, the floor).
constexpr int64_t kPairsWorthAThread = 4096;
constexpr int64_t kQueriesWorthASplit = 8;

// A query's partial result for one chunk: [top, total, 6 unused, acc[H]] (acc 32-byte aligned in the record).
constexpr int64_t kPartialHeader = 8;
static inline int64_t PartialSize(int64_t h) { return kPartialHeader + h; }

// Lines of 16 floats (64 bytes) from p to p + h: asks for them ahead of use.
static inline __attribute__((always_inline)) void Prefetch(const float* p, int64_t h) {
  for (int64_t f = 0; f < h; f += 16) __builtin_prefetch(p + f, 0, 3);
}

// Attend queries[0, count), which share one row's block table (each reads its kv head), over chunk c
// (positions [c·kChunk, (c + 1)·kChunk) ∩ [0, w_end)), writing each attending query's partial for the chunk.
// Where the chunk's positions lie is worked out once (PositionOffsets) and shared by the queries.
// scores is scratch [count, kChunk]. kH > 0 fixes the head dim at compile time (the query and the
// accumulator live in registers); kH = 0 takes it at run time. Each query is computed on its own, by the same
// operations in the same order, whatever B, T, the other queries or the split over threads are.
template <int64_t kH>
static inline __attribute__((always_inline)) void AttendChunkBody(const Query* queries, int64_t count, int64_t c,
                                                                  const Pool& pool, int64_t h_run_time,
                                                                  float scale, float* __restrict scores) {
  constexpr int64_t kMaxChunks = (kH > 0 ? kH : kMaxHeadDim) / 8;
  const int64_t h = kH > 0 ? kH : h_run_time;
  const int64_t chunks = h / 8;
  const float masked = std::numeric_limits<float>::lowest();  // the XLA form's finfo(float32).min
  const int64_t stride = pool.stride;
  const int64_t w_begin = c * kChunk;
  int64_t w_max = w_begin;  // one past the last position any query attends in this chunk
  for (int64_t i = 0; i < count; ++i) w_max = std::max(w_max, std::min(w_begin + kChunk, queries[i].w_end));
  if (w_max == w_begin) return;
  int64_t offsets[kChunk];  // position w's keys (values) at pool.k (pool.v) + offsets[w - w_begin], all kv heads
  PositionOffsets(queries[0].pages, pool, w_begin, w_max, offsets);
  const bool four_in_a_page = pool.page_size % 4 == 0;  // (chunks and tiles start at multiples of 4)
  // 1. scores[i, w - w_begin] = q_i · k_w / sqrt(H), or `masked`; four positions in flight, each its own Dot.
  //    While a tile's keys are used, the next tile's keys and this tile's values are fetched.
  for (int64_t tile = w_begin; tile < w_max; tile += kTile) {
    for (int64_t w = tile + kTile; w < std::min(tile + 2 * kTile, w_max); ++w) Prefetch(pool.k + offsets[w - w_begin], stride);
    for (int64_t w = tile; w < std::min(tile + kTile, w_max); ++w) Prefetch(pool.v + offsets[w - w_begin], stride);
    for (int64_t i = 0; i < count; ++i) {
      const bool* __restrict sees_i = queries[i].sees;
      float* __restrict scores_i = scores + i * kChunk - w_begin;
      const int64_t tile_end = std::min(tile + kTile, queries[i].w_end);
      F8 q_chunks[kMaxChunks];
      for (int64_t m = 0; m < chunks; ++m) q_chunks[m] = Load8(queries[i].q + 8 * m);
      const float* __restrict k_i = pool.k + queries[i].head;  // + offsets[w - w_begin]: position w, this kv head
      auto lanes_at = [&](int64_t w) { return DotLanes(q_chunks, k_i + offsets[w - w_begin], chunks); };
      int64_t w = tile;
      for (; w + 4 <= tile_end; w += 4) {  // four positions side by side
        // w is a multiple of 4: with P a multiple of 4 the four lie in one page, a stride apart
        const float* __restrict k_w = k_i + offsets[w - w_begin];
        const F4 dots = (four_in_a_page ? FoldFour(DotLanes(q_chunks, k_w, chunks),
                                                   DotLanes(q_chunks, k_w + stride, chunks),
                                                   DotLanes(q_chunks, k_w + 2 * stride, chunks),
                                                   DotLanes(q_chunks, k_w + 3 * stride, chunks))
                                        : FoldFour(lanes_at(w), lanes_at(w + 1), lanes_at(w + 2), lanes_at(w + 3))) *
                         scale;
        const I4 sees = {sees_i[w], sees_i[w + 1], sees_i[w + 2], sees_i[w + 3]};
        const F4 four = sees != 0 ? dots : masked - F4{};
        std::memcpy(scores_i + w, &four, sizeof four);
      }
      for (; w < tile_end; ++w) scores_i[w] = sees_i[w] ? FoldOne(lanes_at(w)) * scale : masked;
    }
  }
  // 2. each attending query's weights over the chunk: e = exp(score - top), their total as eight partial sums
  //    folded in halves (the padding to a multiple of 8 weighs exact zeros, also for a query that sees nothing,
  //    whose top is the masked score itself)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = std::min(w_begin + kChunk, queries[i].w_end) - w_begin, n_padded = (n + 7) / 8 * 8;
    if (n <= 0) continue;
    float* __restrict scores_i = scores + i * kChunk;
    for (int64_t w = n; w < n_padded; ++w) scores_i[w] = masked;
    F8 top8 = masked - F8{};
    for (int64_t w = 0; w < n_padded; w += 8) top8 = top8 > Load8(scores_i + w) ? top8 : Load8(scores_i + w);
    const float top = std::max(std::max(std::max(top8[0], top8[1]), std::max(top8[2], top8[3])),
                               std::max(std::max(top8[4], top8[5]), std::max(top8[6], top8[7])));
    F8 sums = {};
    for (int64_t w = 0; w < n_padded; w += 8) {
      F8 e = ExpNonPositive8(Load8(scores_i + w) - top);
      for (int64_t l = std::max<int64_t>(n - w, 0); l < 8; ++l) e[l] = 0.0f;  // positions past n
      std::memcpy(scores_i + w, &e, sizeof e);
      sums += e;
    }
    float* partial = queries[i].partials + c * PartialSize(h);
    partial[0] = top;
    partial[1] = HorizontalSum(sums);
  }
  // 3. acc_i = sum_w e_w · v_w, in position order, carried in the partial from tile to tile
  for (int64_t tile = w_begin; tile < w_max; tile += kTile) {
    for (int64_t i = 0; i < count; ++i) {
      const float* __restrict e_i = scores + i * kChunk - w_begin;
      float* acc_i = queries[i].partials + c * PartialSize(h) + kPartialHeader;
      const int64_t tile_end = std::min(tile + kTile, queries[i].w_end);
      if (tile >= tile_end) continue;
      F8 acc[kMaxChunks];
      for (int64_t m = 0; m < chunks; ++m) acc[m] = tile == w_begin ? F8{} : Load8(acc_i + 8 * m);
      const float* __restrict v_i = pool.v + queries[i].head;  // + offsets[w - w_begin]: position w, this kv head
      for (int64_t w = tile; w < tile_end;) {  // page run by page run: within one, positions are a stride apart
        const int64_t run_end = std::min(tile_end, (w / pool.page_size + 1) * pool.page_size);
        const float* __restrict v_w = v_i + offsets[w - w_begin];
        for (; w < run_end; ++w, v_w += stride) {
          for (int64_t m = 0; m < chunks; ++m) acc[m] += e_i[w] * Load8(v_w + 8 * m);
        }
      }
      for (int64_t m = 0; m < chunks; ++m) std::memcpy(acc_i + 8 * m, &acc[m], sizeof(F8));
    }
  }
}

// A query's output from its partials, in chunk order: with a_c = exp(top_c - top),
// out = (sum_c a_c · acc_c) / (sum_c a_c · total_c). An empty window (W = 0) gives zeros, as the XLA form does.
template <int64_t kH>
static inline __attribute__((always_inline)) void MergeBody(const Query& query, int64_t h_run_time) {
  constexpr int64_t kMaxChunks = (kH > 0 ? kH : kMaxHeadDim) / 8;
  const int64_t h = kH > 0 ? kH : h_run_time;
  if (query.w_end == 0) {
    std::memset(query.out, 0, static_cast<size_t>(h) * sizeof(float));
    return;
  }
  const int64_t chunks = h / 8, n_chunks = (query.w_end + kChunk - 1) / kChunk;
  float top = std::numeric_limits<float>::lowest();
  for (int64_t c = 0; c < n_chunks; ++c) top = std::max(top, query.partials[c * PartialSize(h)]);
  F8 acc[kMaxChunks] = {};
  float total = 0.0f;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const float* partial = query.partials + c * PartialSize(h);
    const float a = ExpNonPositive(partial[0] - top);
    total += a * partial[1];
    for (int64_t m = 0; m < chunks; ++m) acc[m] += a * Load8(partial + kPartialHeader + 8 * m);
  }
  const float inverse = 1.0f / total;
  for (int64_t m = 0; m < chunks; ++m) {
    const F8 o = acc[m] * inverse;
    std::memcpy(query.out + 8 * m, &o, sizeof o);
  }
}

// The entry points: the head dims of the supported models unrolled, any other (a multiple of 8) at run
// time; each is JAXSPEC_CLONES (per-CPU variants where the platform has them: target_clones.h).
#define JAXSPEC_ATTEND_ARGS \
  const Query *queries, int64_t count, int64_t c, const Pool &pool, int64_t h, float scale, float *scores
#define JAXSPEC_ATTEND_CALL queries, count, c, pool, h, scale, scores

JAXSPEC_CLONES void AttendChunkH64(JAXSPEC_ATTEND_ARGS) {
  AttendChunkBody<64>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void AttendChunkH128(JAXSPEC_ATTEND_ARGS) {
  AttendChunkBody<128>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void AttendChunkAnyH(JAXSPEC_ATTEND_ARGS) {
  AttendChunkBody<0>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void MergeH64(const Query& query, int64_t h) { MergeBody<64>(query, h); }
JAXSPEC_CLONES void MergeH128(const Query& query, int64_t h) { MergeBody<128>(query, h); }
JAXSPEC_CLONES void MergeAnyH(const Query& query, int64_t h) { MergeBody<0>(query, h); }

// Scratch floats kept from call to call on one thread: grown, never shrunk and never zeroed (a call reads only
// floats it wrote), so a step's 30-odd calls do not each allocate, zero and page-fault their partials (up to
// 0.4 MB for a verify step at W = 2048). Each thread has its own, so calls running at once never share one;
// a call needing more than kKeptScratchFloats allocates its own for the call (prefill chunks).
constexpr size_t kKeptScratchFloats = size_t{1} << 21;  // 8 MB

float* ScratchFloats(std::vector<float>& kept, std::vector<float>& owned, size_t floats) {
  std::vector<float>& buffer = floats <= kKeptScratchFloats ? kept : owned;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

thread_local std::vector<float> t_kept_partials, t_kept_scores;

// The work of one call. Its queries are ordered by (row, kv head, token, query head); a piece is a run of
// queries of one row, and a unit is (piece, chunk). The calling thread and XLA's intra-op pool claim units one
// at a time; then the calling thread merges every query's partials. It lives on the heap, shared by every
// task: a task the pool starts after the call returned finds no unit left and touches nothing of the call's
// but the counters.
struct SharedWork {
  std::vector<Query> queries;
  std::vector<int64_t> piece_starts;  // piece p is queries[piece_starts[p], piece_starts[p + 1])
  std::vector<int64_t> unit_pieces, unit_chunks;  // unit u is (piece unit_pieces[u], chunk unit_chunks[u])
  float* partials = nullptr;  // [queries, chunks of the window, PartialSize(H)]: the calling thread's scratch
  std::vector<float> owned_partials;  // the partials of a call too large for that scratch
  Pool pool;
  int64_t h, largest_piece;
  float scale;
  std::atomic<int64_t> next_unit{0};
  std::atomic<int64_t> units_done{0};

  int64_t units() const { return static_cast<int64_t>(unit_pieces.size()); }

  void Run() {
    const auto attend = h == 64 ? AttendChunkH64 : h == 128 ? AttendChunkH128 : AttendChunkAnyH;
    std::vector<float> owned_scores;
    float* scores = ScratchFloats(t_kept_scores, owned_scores, static_cast<size_t>(largest_piece * kChunk));
    for (int64_t u = next_unit.fetch_add(1); u < units(); u = next_unit.fetch_add(1)) {
      const int64_t p = unit_pieces[u];
      attend(queries.data() + piece_starts[p], piece_starts[p + 1] - piece_starts[p], unit_chunks[u], pool, h,
             scale, scores);
      units_done.fetch_add(1, std::memory_order_release);
    }
  }

  void Merge() const {
    const auto merge = h == 64 ? MergeH64 : h == 128 ? MergeH128 : MergeAnyH;
    for (const Query& query : queries) merge(query, h);
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                              ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_table,
                              ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto md = mask.dimensions();
  const auto vd = v_pages.dimensions();
  const auto td = block_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3 || td.size() != 2 ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end())) {
    return ffi::Error::InvalidArgument(
        "paged attention: expected q [B,T,N,H], k and v pages [Np,P,G,H], block table [B,ceil(W/P)], mask [B,T,W]");
  }
  const int64_t b_rows = qd[0], t_len = qd[1], n_heads = qd[2], h_dim = qd[3];
  const int64_t num_pages = kd[0], page_size = kd[1], g_heads = kd[2];
  const int64_t w_len = md[2];
  if (kd[3] != h_dim || md[0] != b_rows || md[1] != t_len || g_heads <= 0 || n_heads % g_heads != 0) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not agree");
  }
  if (h_dim <= 0 || h_dim > kMaxHeadDim || h_dim % 8 != 0) {
    return ffi::Error::InvalidArgument("paged attention: head dim " + std::to_string(h_dim) +
                                       " is not a multiple of 8 in [8, " + std::to_string(kMaxHeadDim) + "]");
  }
  const int64_t window_pages = page_size > 0 ? (w_len + page_size - 1) / page_size : -1;
  if (page_size <= 0 || td[0] != b_rows || td[1] != window_pages) {
    return ffi::Error::InvalidArgument("paged attention: block table [" + std::to_string(td[0]) + ", " +
                                       std::to_string(td[1]) + "] is not [B, ceil(W / P)] = [" +
                                       std::to_string(b_rows) + ", " + std::to_string(window_pages) + "]");
  }
  for (int64_t e = 0; e < b_rows * window_pages; ++e) {
    const int64_t page = block_table.typed_data()[e];
    if (page < 0 || page >= num_pages) {
      return ffi::Error::InvalidArgument("paged attention: block table entry [" + std::to_string(e / window_pages) +
                                         ", " + std::to_string(e % window_pages) + "] = " + std::to_string(page) +
                                         " names no page of the pool (pages 0.." + std::to_string(num_pages - 1) +
                                         "; a per-slot cache's pages are its slots)");
    }
  }
  const int64_t r_per_kv_head = n_heads / g_heads;
  const int64_t window_chunks = (w_len + kChunk - 1) / kChunk;
  auto work = std::make_shared<SharedWork>();
  work->pool = Pool{k_pages.typed_data(), v_pages.typed_data(), page_size, g_heads * h_dim};
  work->h = h_dim;
  work->scale = 1.0f / std::sqrt(static_cast<float>(h_dim));
  std::vector<int64_t> w_ends(static_cast<size_t>(b_rows * t_len));  // per query token, shared by its N heads
  std::vector<int64_t> row_chunks(static_cast<size_t>(b_rows), 0);  // chunks any token of the row attends
  int64_t pairs = 0;  // (query, position) pairs the call attends
  for (int64_t bt = 0; bt < b_rows * t_len; ++bt) {
    w_ends[bt] = AttendedPositions(mask.typed_data() + bt * w_len, w_len);
    pairs += w_ends[bt] * n_heads;
    row_chunks[bt / t_len] = std::max(row_chunks[bt / t_len], (w_ends[bt] + kChunk - 1) / kChunk);
  }
  int64_t row_units = 0;  // (row, chunk) pairs: the units before rows are cut into pieces
  for (int64_t chunks : row_chunks) row_units += chunks;
  // the workers: the calling thread and pool threads, one per pool thread in all (the pool has a thread per
  // core, and the caller takes one); a row of T·N queries is cut into pieces (about two units per worker)
  // when there are fewer (row, chunk) units than that and the row is large
  const int64_t row_queries = t_len * n_heads;
  const int64_t threads = pairs < kPairsWorthAThread ? 1 : std::max<int64_t>(1, thread_pool.num_threads());
  const int64_t pieces = threads == 1 || row_queries < kQueriesWorthASplit
                             ? 1
                             : std::min(row_queries, std::max<int64_t>(1, (2 * threads + row_units - 1) / row_units));
  const int64_t piece_size = (row_queries + pieces - 1) / pieces;
  work->largest_piece = piece_size;
  const int64_t queries = b_rows * t_len * n_heads;
  work->partials = ScratchFloats(t_kept_partials, work->owned_partials,
                                 static_cast<size_t>(queries * window_chunks * PartialSize(h_dim)));
  work->queries.reserve(static_cast<size_t>(queries));
  for (int64_t b = 0; b < b_rows; ++b) {
    const int32_t* pages = block_table.typed_data() + b * window_pages;  // the row's table
    for (int64_t g = 0; g < g_heads; ++g) {
      for (int64_t j = 0; j < t_len * r_per_kv_head; ++j) {  // query head n = g·R + r reads kv head g
        const int64_t t = j / r_per_kv_head, n = g * r_per_kv_head + j % r_per_kv_head;
        const int64_t index = static_cast<int64_t>(work->queries.size());
        if ((g * t_len * r_per_kv_head + j) % piece_size == 0) {  // a new piece: one unit per chunk its row attends
          for (int64_t c = 0; c < row_chunks[b]; ++c) {
            work->unit_pieces.push_back(static_cast<int64_t>(work->piece_starts.size()));
            work->unit_chunks.push_back(c);
          }
          work->piece_starts.push_back(index);
        }
        const bool* sees = mask.typed_data() + (b * t_len + t) * w_len;  // shared by the N heads
        const int64_t row = (b * t_len + t) * n_heads + n;
        work->queries.push_back(Query{q.typed_data() + row * h_dim, sees, out->typed_data() + row * h_dim,
                                      pages, g * h_dim, w_ends[b * t_len + t],
                                      work->partials + index * window_chunks * PartialSize(h_dim)});
      }
    }
  }
  work->piece_starts.push_back(static_cast<int64_t>(work->queries.size()));
  const int64_t units = work->units();
  for (int64_t i = 0; i < std::min(threads - 1, units - 1); ++i) thread_pool.Schedule([work] { work->Run(); });
  work->Run();
  // every unit is claimed now, each by a worker that is running it: wait for those to finish, then merge
  while (work->units_done.load(std::memory_order_acquire) < units) std::this_thread::yield();
  work->Merge();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block table
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out

// The Python module: `handler()` returns the XLA FFI handler as a PyCapsule for jax.ffi.register_ffi_target.
static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&JaxspecPagedAttention), nullptr, nullptr);
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The paged-attention XLA FFI handler (a PyCapsule)."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cache_attention", nullptr, -1, kMethods,
                               nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__cache_attention() { return PyModule_Create(&kModule); }
