// Grouped-query attention that reads each row's window straight from the per-slot KV cache
// (XLA:CPU custom call; docs/design.md, "Attention on XLA:CPU").
//
// XLA:CPU lowers every dot to a kernel whose operands are whole buffers, so the XLA form of decode
// attention first copies each row's window [W, G, H] out of the [S+1, M, G, H] cache, every layer,
// every step. This kernel takes the cache buffer and the slot ids and reads the window in place.
//
//   q     [B, T, N, H] f32     queries (RoPE applied)
//   k, v  [S+1, M, G, H] f32   one layer's cache, this step's keys/values already written
//   slots [B] s32              the cache slot of each row
//   mask  [B, T, W] pred       which window positions each query sees
//   out   [B, T, N, H] f32     softmax(q·k / sqrt(H), masked) · v, over positions [0, W) of the row's slot
//
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

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxHeadDim = 256;

// Eight floats in a vector register (two halves on baseline x86-64), loaded from any address.
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));

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

// One query row: its query vector [H], its mask row [W], where its output [H] goes, position 0 of the
// kv head it reads in its row's slot (position w at k + w·stride), and how many leading positions it
// attends over: one past the last it sees (positions after that add exact zeros), or W if it sees none.
struct Query {
  const float* q;
  const bool* sees;
  float* out;
  const float* k;
  const float* v;
  int64_t w_end;
};

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

// q · k over one head (h/8 chunks of 8): two 8-lane partial sums (even and odd chunks), added, folded.
static inline __attribute__((always_inline)) float Dot(const F8* q_chunks, const float* __restrict k_w,
                                                       int64_t chunks) {
  F8 even = {}, odd = {};
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    even += q_chunks[c] * Load8(k_w + 8 * c);
    odd += q_chunks[c + 1] * Load8(k_w + 8 * c + 8);
  }
  if (c < chunks) even += q_chunks[c] * Load8(k_w + 8 * c);  // h = 16·m + 8
  return HorizontalSum(even + odd);
}

// ExpNonPositive on eight lanes (the same operations lane by lane).
static inline __attribute__((always_inline)) F8 ExpNonPositive8(F8 x) {
  F8 out;
  for (int l = 0; l < 8; ++l) out[l] = ExpNonPositive(x[l]);
  return out;
}

// Attend queries[0, count), which share one kv head of one slot (k, v, stride), over their positions
// [0, w_end). The window is walked in tiles of kTile positions, and every query of the group takes its turn on
// a tile while the tile's keys (then values) are in L1: the group reads the window from memory once, not
// once per query. scores is scratch [count, w_pad] (W rounded up to 8); out accumulates across tiles.
// kH > 0 fixes the head dim at compile time (the query and the output accumulator live in registers); kH = 0
// takes it at run time. Each query is computed on its own, by the same operations in the same order
// (positions in order, tile after tile), whatever B, T, the other queries or the split over threads are.
constexpr int64_t kTile = 32;
// Splitting a call over XLA's intra-op threads: calls with fewer (query, position) pairs than this run on the
// calling thread alone (waking a pool thread costs more than they take), and a (row, kv head) group of fewer
// queries than kQueriesWorthASplit is one unit (a split would read its window twice to save little
// arithmetic). Both set by timing the step on a 2-core host (docs/benchmarks.md, the floor).
constexpr int64_t kPairsWorthAThread = 4096;
constexpr int64_t kQueriesWorthASplit = 8;

template <int64_t kH>
static inline __attribute__((always_inline)) void AttendBody(const Query* queries, int64_t count, int64_t stride,
                                                             int64_t h_run_time, float scale, int64_t w_pad,
                                                             float* __restrict scores) {
  constexpr int64_t kMaxChunks = (kH > 0 ? kH : kMaxHeadDim) / 8;
  const int64_t chunks = kH > 0 ? kH / 8 : h_run_time / 8;
  const float masked = std::numeric_limits<float>::lowest();  // the XLA form's finfo(float32).min
  const float* __restrict k_base = queries[0].k;
  const float* __restrict v_base = queries[0].v;
  int64_t w_max = 0;
  for (int64_t i = 0; i < count; ++i) w_max = std::max(w_max, queries[i].w_end);
  // 1. scores[i, w] = q_i · k_w / sqrt(H), or `masked`; four positions in flight, each its own Dot
  for (int64_t tile = 0; tile < w_max; tile += kTile) {
    for (int64_t i = 0; i < count; ++i) {
      const bool* __restrict sees_i = queries[i].sees;
      float* __restrict scores_i = scores + i * w_pad;
      const int64_t tile_end = std::min(tile + kTile, queries[i].w_end);
      F8 q_chunks[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) q_chunks[c] = Load8(queries[i].q + 8 * c);
      auto score_at = [&](int64_t w) {
        const float dot = Dot(q_chunks, k_base + w * stride, chunks) * scale;
        return sees_i[w] ? dot : masked;
      };
      int64_t w = tile;
      for (; w + 4 <= tile_end; w += 4) {
        const float s0 = score_at(w), s1 = score_at(w + 1), s2 = score_at(w + 2), s3 = score_at(w + 3);
        scores_i[w] = s0, scores_i[w + 1] = s1, scores_i[w + 2] = s2, scores_i[w + 3] = s3;
      }
      for (; w < tile_end; ++w) scores_i[w] = score_at(w);
    }
  }
  // 2. each query's softmax over its positions: p = exp(score - top) / total (the total as eight partial sums
  //    folded in halves; padding to a multiple of 8 adds exact zeros)
  for (int64_t i = 0; i < count; ++i) {
    float* __restrict scores_i = scores + i * w_pad;
    const int64_t w_end = queries[i].w_end, w_padded = (w_end + 7) / 8 * 8;
    for (int64_t w = w_end; w < w_padded; ++w) scores_i[w] = masked;
    F8 top8 = masked - F8{};
    for (int64_t w = 0; w < w_padded; w += 8) top8 = top8 > Load8(scores_i + w) ? top8 : Load8(scores_i + w);
    const float top = std::max(std::max(std::max(top8[0], top8[1]), std::max(top8[2], top8[3])),
                               std::max(std::max(top8[4], top8[5]), std::max(top8[6], top8[7])));
    F8 sums = {};
    for (int64_t w = 0; w < w_padded; w += 8) {
      const F8 e = ExpNonPositive8(Load8(scores_i + w) - top);
      std::memcpy(scores_i + w, &e, sizeof e);
      sums += e;
    }
    const float inverse = 1.0f / HorizontalSum(sums);
    for (int64_t w = 0; w < w_padded; w += 8) {
      const F8 p = Load8(scores_i + w) * inverse;
      std::memcpy(scores_i + w, &p, sizeof p);
    }
  }
  // 3. out_i = sum_w p_w · v_w, in position order, carried in out_i from tile to tile
  for (int64_t tile = 0; tile < w_max; tile += kTile) {
    for (int64_t i = 0; i < count; ++i) {
      const float* __restrict p_i = scores + i * w_pad;
      float* out_i = queries[i].out;
      const int64_t tile_end = std::min(tile + kTile, queries[i].w_end);
      if (tile > 0 && tile >= tile_end) continue;
      F8 acc[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = tile == 0 ? F8{} : Load8(out_i + 8 * c);
      for (int64_t w = tile; w < tile_end; ++w) {
        const float* __restrict v_w = v_base + w * stride;
        for (int64_t c = 0; c < chunks; ++c) acc[c] += p_i[w] * Load8(v_w + 8 * c);
      }
      for (int64_t c = 0; c < chunks; ++c) std::memcpy(out_i + 8 * c, &acc[c], sizeof(F8));
    }
  }
}

// The entry points: the head dims of the supported models unrolled, any other (a multiple of 8) at run
// time. On x86-64 each is compiled three times (AVX-512, AVX2 + FMA, baseline), the variant picked at load time;
// elsewhere (aarch64 hosts) once, for the compiler's default target.
#if defined(__x86_64__)
#define JAXSPEC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAXSPEC_CLONES
#endif
#define JAXSPEC_ATTEND_ARGS \
  const Query *queries, int64_t count, int64_t stride, int64_t h, float scale, int64_t w_pad, float *scores
#define JAXSPEC_ATTEND_CALL queries, count, stride, h, scale, w_pad, scores

JAXSPEC_CLONES void AttendH64(JAXSPEC_ATTEND_ARGS) {
  AttendBody<64>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void AttendH128(JAXSPEC_ATTEND_ARGS) {
  AttendBody<128>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void AttendAnyH(JAXSPEC_ATTEND_ARGS) {
  AttendBody<0>(JAXSPEC_ATTEND_CALL);
}

// The queries of one call, ordered by (row, kv head) and cut into units of queries that share one kv head
// of one slot; the calling thread and XLA's intra-op pool claim units one at a time. It lives on the heap,
// shared by every task: a task the pool starts after the call returned finds no unit left and touches
// nothing else.
struct SharedWork {
  std::vector<Query> queries;
  std::vector<int64_t> unit_starts;  // unit u is queries[unit_starts[u], unit_starts[u + 1])
  int64_t stride, w_pad, h, largest_unit;
  float scale;
  std::atomic<int64_t> next_unit{0};
  std::atomic<int64_t> units_done{0};

  int64_t units() const { return static_cast<int64_t>(unit_starts.size()) - 1; }

  void Run() {
    const auto attend = h == 64 ? AttendH64 : h == 128 ? AttendH128 : AttendAnyH;
    std::vector<float> scores(static_cast<size_t>(largest_unit * w_pad));  // [unit queries, w_pad]
    for (int64_t u = next_unit.fetch_add(1); u < units(); u = next_unit.fetch_add(1)) {
      attend(queries.data() + unit_starts[u], unit_starts[u + 1] - unit_starts[u], stride, h, scale, w_pad,
             scores.data());
      units_done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                              ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> slots,
                              ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto md = mask.dimensions();
  const auto vd = v_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end())) {
    return ffi::Error::InvalidArgument("cache_attention: expected q [B,T,N,H], k and v [S+1,M,G,H], mask [B,T,W]");
  }
  const int64_t b_rows = qd[0], t_len = qd[1], n_heads = qd[2], h_dim = qd[3];
  const int64_t s_slots = kd[0], m_len = kd[1], g_heads = kd[2];
  const int64_t w_len = md[2];
  if (kd[3] != h_dim || md[0] != b_rows || md[1] != t_len || w_len > m_len || g_heads <= 0 ||
      n_heads % g_heads != 0 || h_dim > kMaxHeadDim || h_dim % 8 != 0 ||
      slots.element_count() != static_cast<size_t>(b_rows)) {
    return ffi::Error::InvalidArgument("cache_attention: shapes do not agree");
  }
  const int64_t r_per_group = n_heads / g_heads;
  auto work = std::make_shared<SharedWork>();
  work->stride = g_heads * h_dim;  // floats between consecutive positions of one slot
  work->w_pad = (w_len + 7) / 8 * 8;
  work->h = h_dim;
  work->scale = 1.0f / std::sqrt(static_cast<float>(h_dim));
  std::vector<int64_t> w_ends(static_cast<size_t>(b_rows * t_len));  // per query token, shared by its N heads
  int64_t pairs = 0;  // (query, position) pairs the call attends
  for (int64_t bt = 0; bt < b_rows * t_len; ++bt) {
    w_ends[bt] = AttendedPositions(mask.typed_data() + bt * w_len, w_len);
    pairs += w_ends[bt] * n_heads;
  }
  // units: each (row, kv head) group of T·R queries, cut into pieces (about two units per thread: the caller
  // and the pool's) when there are fewer groups than that and the group is large
  const int64_t group_size = t_len * r_per_group;
  const int64_t threads = pairs < kPairsWorthAThread ? 1 : 1 + std::max<int64_t>(0, pool.num_threads());
  const int64_t groups = b_rows * g_heads;
  const int64_t pieces = group_size < kQueriesWorthASplit
                             ? 1
                             : std::min(group_size, std::max<int64_t>(1, (2 * threads + groups - 1) / groups));
  const int64_t piece_size = (group_size + pieces - 1) / pieces;
  work->largest_unit = piece_size;
  work->queries.reserve(static_cast<size_t>(b_rows * t_len * n_heads));
  for (int64_t b = 0; b < b_rows; ++b) {
    const int64_t slot = slots.typed_data()[b];
    if (slot < 0 || slot >= s_slots) {
      return ffi::Error::InvalidArgument("cache_attention: slot id " + std::to_string(slot) + " outside the cache");
    }
    for (int64_t g = 0; g < g_heads; ++g) {
      const int64_t first = (slot * m_len * g_heads + g) * h_dim;  // position 0 of kv head g in the slot
      for (int64_t j = 0; j < group_size; ++j) {  // query head n = g·R + r reads kv head g
        const int64_t t = j / r_per_group, n = g * r_per_group + j % r_per_group;
        if (j % piece_size == 0) work->unit_starts.push_back(static_cast<int64_t>(work->queries.size()));
        const bool* sees = mask.typed_data() + (b * t_len + t) * w_len;  // shared by the N heads
        const int64_t row = (b * t_len + t) * n_heads + n;
        work->queries.push_back(Query{q.typed_data() + row * h_dim, sees, out->typed_data() + row * h_dim,
                                      k_cache.typed_data() + first, v_cache.typed_data() + first,
                                      w_ends[b * t_len + t]});
      }
    }
  }
  work->unit_starts.push_back(static_cast<int64_t>(work->queries.size()));
  const int64_t units = work->units();
  for (int64_t i = 0; i < std::min(threads - 1, units - 1); ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  // every unit is claimed now, each by a thread that is running it: wait for those to finish
  while (work->units_done.load(std::memory_order_acquire) < units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out

// The Python module: `handler()` returns the XLA FFI handler as a PyCapsule for jax.ffi.register_ffi_target.
static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&JaxspecCacheAttention), nullptr, nullptr);
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The cache-attention XLA FFI handler (a PyCapsule)."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cache_attention", nullptr, -1, kMethods};

PyMODINIT_FUNC PyInit__cache_attention() { return PyModule_Create(&kModule); }
