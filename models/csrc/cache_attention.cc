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

// Attend queries[0, count) over their positions [0, w_end), `stride` floats apart; scores is scratch [W].
// kH > 0 fixes the head dim at compile time (the loops over h unroll into registers); kH = 0 takes it at
// run time. Each query is computed on its own, by the same operations in the same order whatever B, T,
// the other queries or the split over threads are.
template <int64_t kH>
static inline __attribute__((always_inline)) void AttendBody(const Query* queries, int64_t count, int64_t stride,
                                                             int64_t h_run_time, float scale,
                                                             float* __restrict scores) {
  const int64_t h = kH > 0 ? kH : h_run_time;
  const float masked = std::numeric_limits<float>::lowest();  // the XLA form's finfo(float32).min
  for (int64_t i = 0; i < count; ++i) {
    const float* __restrict q_i = queries[i].q;
    const bool* __restrict sees_i = queries[i].sees;
    const float* __restrict k_base = queries[i].k;
    const float* __restrict v_base = queries[i].v;
    const int64_t w_end = queries[i].w_end;
    // scores[w] = q_i · k_w / sqrt(H), or `masked`: two 8-lane partial sums over h (even and odd chunks
    // of 8), added, then folded 8 -> 4 -> 2 -> 1
    float top = masked;
    for (int64_t w = 0; w < w_end; ++w) {
      float score = masked;
      if (sees_i[w]) {
        const float* __restrict k_w = k_base + w * stride;
        F8 even = {}, odd = {};
        int64_t j = 0;
        for (; j + 16 <= h; j += 16) {
          even += Load8(q_i + j) * Load8(k_w + j);
          odd += Load8(q_i + j + 8) * Load8(k_w + j + 8);
        }
        if (j < h) even += Load8(q_i + j) * Load8(k_w + j);  // h = 16·m + 8
        score = HorizontalSum(even + odd) * scale;
      }
      scores[w] = score;
      top = std::max(top, score);
    }
    // softmax over w: exp(score - top) / total
    for (int64_t w = 0; w < w_end; ++w) scores[w] = ExpNonPositive(scores[w] - top);
    float sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums, as for the dot products
    int64_t w = 0;
    for (; w + 8 <= w_end; w += 8) {
      for (int64_t l = 0; l < 8; ++l) sums[l] += scores[w + l];
    }
    for (int64_t l = 0; w < w_end; ++w, ++l) sums[l] += scores[w];
    for (int64_t l = 0; l < 4; ++l) sums[l] += sums[l + 4];
    for (int64_t l = 0; l < 2; ++l) sums[l] += sums[l + 2];
    const float inverse = 1.0f / (sums[0] + sums[1]);
    // out_i = sum_w p_w · v_w (positions with p = 0 add exact zeros: skipped)
    float acc[kH > 0 ? kH : kMaxHeadDim] = {};
    for (int64_t w = 0; w < w_end; ++w) {
      const float p = scores[w] * inverse;
      if (p == 0.0f) continue;
      const float* __restrict v_w = v_base + w * stride;
      for (int64_t j = 0; j < h; ++j) acc[j] += p * v_w[j];
    }
    std::copy(acc, acc + h, queries[i].out);
  }
}

// The entry points: the head dims of the supported models unrolled, any other (a multiple of 8) at run
// time. On x86-64 each is compiled twice (AVX2 + FMA and baseline), the variant picked at load time;
// elsewhere (aarch64 hosts) once, for the compiler's default target.
#if defined(__x86_64__)
#define JAXSPEC_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JAXSPEC_CLONES
#endif
#define JAXSPEC_ATTEND_ARGS \
  const Query *queries, int64_t count, int64_t stride, int64_t h, float scale, float *scores
#define JAXSPEC_ATTEND_CALL queries, count, stride, h, scale, scores

JAXSPEC_CLONES void AttendH64(JAXSPEC_ATTEND_ARGS) {
  AttendBody<64>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void AttendH128(JAXSPEC_ATTEND_ARGS) {
  AttendBody<128>(JAXSPEC_ATTEND_CALL);
}
JAXSPEC_CLONES void AttendAnyH(JAXSPEC_ATTEND_ARGS) {
  AttendBody<0>(JAXSPEC_ATTEND_CALL);
}

// The queries of one call, split into chunks that the calling thread and XLA's intra-op pool claim one at a
// time. It lives on the heap, shared by every task: a task the pool starts after the call returned finds no
// chunk left and touches nothing else.
struct SharedWork {
  std::vector<Query> queries;
  int64_t chunk_size, chunks, stride, w_len, h;
  float scale;
  std::atomic<int64_t> next_chunk{0};
  std::atomic<int64_t> chunks_done{0};

  void Run() {
    const auto attend = h == 64 ? AttendH64 : h == 128 ? AttendH128 : AttendAnyH;
    std::vector<float> scores(static_cast<size_t>(w_len));
    for (int64_t c = next_chunk.fetch_add(1); c < chunks; c = next_chunk.fetch_add(1)) {
      const int64_t begin = c * chunk_size;
      attend(queries.data() + begin, std::min(chunk_size, static_cast<int64_t>(queries.size()) - begin), stride, h,
             scale, scores.data());
      chunks_done.fetch_add(1, std::memory_order_release);
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
  work->w_len = w_len;
  work->h = h_dim;
  work->scale = 1.0f / std::sqrt(static_cast<float>(h_dim));
  work->queries.reserve(static_cast<size_t>(b_rows * t_len * n_heads));
  for (int64_t b = 0; b < b_rows; ++b) {
    const int64_t slot = slots.typed_data()[b];
    if (slot < 0 || slot >= s_slots) {
      return ffi::Error::InvalidArgument("cache_attention: slot id " + std::to_string(slot) + " outside the cache");
    }
    for (int64_t t = 0; t < t_len; ++t) {
      const bool* sees = mask.typed_data() + (b * t_len + t) * w_len;  // shared by the N heads
      const int64_t w_end = AttendedPositions(sees, w_len);
      for (int64_t n = 0; n < n_heads; ++n) {  // head n reads kv head g = n / R
        const int64_t row = (b * t_len + t) * n_heads + n;
        const int64_t first = (slot * m_len * g_heads + n / r_per_group) * h_dim;  // position 0 of kv head g
        work->queries.push_back(Query{q.typed_data() + row * h_dim, sees, out->typed_data() + row * h_dim,
                                      k_cache.typed_data() + first, v_cache.typed_data() + first, w_end});
      }
    }
  }
  // about four chunks per thread (the caller and the pool's), at least one query each
  const int64_t total = static_cast<int64_t>(work->queries.size());
  const int64_t threads = 1 + std::max<int64_t>(0, pool.num_threads());
  work->chunk_size = std::max<int64_t>(1, (total + 4 * threads - 1) / (4 * threads));
  work->chunks = (total + work->chunk_size - 1) / work->chunk_size;
  for (int64_t i = 0; i < std::min(threads - 1, work->chunks - 1); ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  // every chunk is claimed now, each by a thread that is running it: wait for those to finish
  while (work->chunks_done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
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
