// The product of a few rows with a weight stored in column panels (XLA:CPU custom call; docs/design.md,
// "Matmuls on XLA:CPU").
//
// XLA:CPU's dot of a [T, K] activation with a [K, N] weight costs about twice a T = 1 product at T = 2…16 on
// this project's CPUs (the library packs the weight again on every call), which is what every verify step
// multiplies by. Stored as panels of 64 columns, each panel one contiguous block read once per call, the weight
// streams from memory at the rate a T = 1 product reaches while a few rows share each load.
//
//   x       [M, K] f32       the rows
//   panels  [Q, K, 64] f32   panel q holds columns [64q, 64q + 64) of the [K, N] weight, row after row
//                            (columns past N are zero)
//   y       [M, N] f32       x @ weight, N ≤ 64Q
//
// Every y[m, n] is summed over k in increasing order, one multiply-add at a time (fused where the CPU has FMA),
// starting from zero: the same bits whatever M, the other rows or the split over threads are.
//
// The LM head of a tied embedding multiplies by a table [V, D] stored row by row (the embedding itself), which
// needs no repacking: 64 consecutive table rows are one contiguous block, and a second handler walks those
// blocks the same way, each output a dot product of two contiguous rows.
//
//   x       [M, D] f32       the rows
//   table   [V, D] f32       the embedding
//   y       [M, V] f32       x @ table^T
//
// Every y[m, v] sums x[m, d] · table[v, d] in four sixteen-lane accumulators (accumulator j, lane i takes the
// d ≡ 16j + i mod 64, in increasing order), adds them and their lanes in a fixed tree, then the last D mod 64
// products in order: again the same bits whatever M.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"
#include "target_clones.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;       // columns per panel: four 16-float vectors
constexpr int64_t kMaxGroup = 6;     // rows per pass over a panel: 6 × 4 accumulators stay in registers
constexpr int64_t kUnitBytes = 1 << 18;  // panels a worker claims at a time: about 256 KB of weight
constexpr int64_t kBytesWorthAThread = 1 << 20;  // smaller products run on the calling thread alone

// Sixteen floats (one AVX-512 register, two AVX2 halves), loaded from and stored to any address.
typedef float F16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) F16 Load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline __attribute__((always_inline)) void Store16(float* p, F16 v) { std::memcpy(p, &v, sizeof v); }

// y[r, 0:columns) = x[r, :] @ panel for the kRows rows at x (row stride k_len) and y (row stride n_len);
// columns ≤ kPanel are written (the last panel of a weight may be partly padding).
template <int kRows>
static inline __attribute__((always_inline)) void PanelRowsBody(const float* x, int64_t k_len, const float* panel,
                                                                float* y, int64_t n_len, int64_t columns) {
  F16 acc[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = F16{};
  }
  const float* w = panel;
  for (int64_t k = 0; k < k_len; ++k, w += kPanel) {
    const F16 w0 = Load16(w), w1 = Load16(w + 16), w2 = Load16(w + 32), w3 = Load16(w + 48);
    for (int r = 0; r < kRows; ++r) {
      const float xr = x[r * k_len + k];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
      acc[r][2] += xr * w2;
      acc[r][3] += xr * w3;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    if (columns == kPanel) {
      for (int j = 0; j < 4; ++j) Store16(y + r * n_len + 16 * j, acc[r][j]);
    } else {
      float row[kPanel];
      for (int j = 0; j < 4; ++j) Store16(row + 16 * j, acc[r][j]);
      std::memcpy(y + r * n_len, row, static_cast<size_t>(columns) * sizeof(float));
    }
  }
}

typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef float F2 __attribute__((vector_size(8)));

// The sum of the sixteen lanes of v, always in the same order: lane i + 8 onto lane i, then i + 4, i + 2, i + 1.
static inline __attribute__((always_inline)) float LaneSum(F16 v) {
  const F8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const F4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const F2 p = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return p[0] + p[1];
}

// y[r, v] = x[r, :] · table[v, :] for the kRows rows at x (row stride d_len) and the `columns` ≤ 64 table rows
// at `block` (row stride d_len), written to y (row stride v_len). One table row at a time, read front to back
// (one stream for the prefetcher); four accumulators per output take the d of each 64 in turn.
template <int kRows>
static inline __attribute__((always_inline)) void TableRowsBody(const float* x, int64_t d_len, const float* block,
                                                                float* y, int64_t v_len, int64_t columns) {
  const int64_t d_wide = d_len - d_len % 64;
  for (int64_t v = 0; v < columns; ++v) {
    const float* t = block + v * d_len;
    F16 acc[kRows][4];
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < 4; ++j) acc[r][j] = F16{};
    }
    for (int64_t d = 0; d < d_wide; d += 64) {
      const F16 t0 = Load16(t + d), t1 = Load16(t + d + 16), t2 = Load16(t + d + 32), t3 = Load16(t + d + 48);
      for (int r = 0; r < kRows; ++r) {
        const float* xr = x + r * d_len + d;
        acc[r][0] += Load16(xr) * t0;
        acc[r][1] += Load16(xr + 16) * t1;
        acc[r][2] += Load16(xr + 32) * t2;
        acc[r][3] += Load16(xr + 48) * t3;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float sum = LaneSum((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
      for (int64_t d = d_wide; d < d_len; ++d) sum += x[r * d_len + d] * t[d];
      y[r * v_len + v] = sum;
    }
  }
}

// Each row count's kernel is JAXSPEC_CLONES (per-CPU variants where the platform has them: target_clones.h).
#define JAXSPEC_PANEL_ARGS const float *x, int64_t k_len, const float *panel, float *y, int64_t n_len, int64_t columns
#define JAXSPEC_PANEL_CALL x, k_len, panel, y, n_len, columns
JAXSPEC_CLONES void PanelRows1(JAXSPEC_PANEL_ARGS) { PanelRowsBody<1>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows2(JAXSPEC_PANEL_ARGS) { PanelRowsBody<2>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows3(JAXSPEC_PANEL_ARGS) { PanelRowsBody<3>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows4(JAXSPEC_PANEL_ARGS) { PanelRowsBody<4>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows5(JAXSPEC_PANEL_ARGS) { PanelRowsBody<5>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows6(JAXSPEC_PANEL_ARGS) { PanelRowsBody<6>(JAXSPEC_PANEL_CALL); }

JAXSPEC_CLONES void TableRows1(JAXSPEC_PANEL_ARGS) { TableRowsBody<1>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void TableRows2(JAXSPEC_PANEL_ARGS) { TableRowsBody<2>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void TableRows3(JAXSPEC_PANEL_ARGS) { TableRowsBody<3>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void TableRows4(JAXSPEC_PANEL_ARGS) { TableRowsBody<4>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void TableRows5(JAXSPEC_PANEL_ARGS) { TableRowsBody<5>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void TableRows6(JAXSPEC_PANEL_ARGS) { TableRowsBody<6>(JAXSPEC_PANEL_CALL); }

// Per row count 1..kMaxGroup: one pass of that many rows over a block of 64 output columns.
using BlockRowsFn = void (*)(JAXSPEC_PANEL_ARGS);
constexpr BlockRowsFn kPanelRows[kMaxGroup + 1] = {nullptr, PanelRows1, PanelRows2, PanelRows3,
                                                   PanelRows4, PanelRows5, PanelRows6};
constexpr BlockRowsFn kTableRows[kMaxGroup + 1] = {nullptr, TableRows1, TableRows2, TableRows3,
                                                   TableRows4, TableRows5, TableRows6};

// The work of one call: units of consecutive blocks of 64 output columns (panels, or 64 table rows), claimed
// one at a time by the calling thread and XLA's intra-op pool. It lives on the heap, shared by every task: a
// task the pool starts after the call returned finds no unit left and touches nothing else.
struct SharedWork {
  const BlockRowsFn* kernels;  // kPanelRows or kTableRows
  const float *x, *blocks;     // block q starts at blocks + q · k_len · 64 in both layouts
  float* y;
  int64_t m_rows, k_len, n_len, q_blocks, unit_blocks;
  std::atomic<int64_t> next_unit{0};
  std::atomic<int64_t> units_done{0};

  int64_t units() const { return (q_blocks + unit_blocks - 1) / unit_blocks; }

  // Every block of unit u, each read once for all rows: the rows go in groups of at most kMaxGroup, sized
  // alike (9 rows: 5 + 4), and later groups find the block in cache.
  void RunUnit(int64_t u) const {
    const int64_t groups = (m_rows + kMaxGroup - 1) / kMaxGroup;
    for (int64_t q = u * unit_blocks; q < std::min(q_blocks, (u + 1) * unit_blocks); ++q) {
      const float* block = blocks + q * k_len * kPanel;
      const int64_t columns = std::min(kPanel, n_len - q * kPanel);
      for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t rows = (m_rows - m + (groups - g) - 1) / (groups - g);
        kernels[rows](x + m * k_len, k_len, block, y + m * n_len + q * kPanel, n_len, columns);
        m += rows;
      }
    }
  }

  void Run() {
    for (int64_t u = next_unit.fetch_add(1); u < units(); u = next_unit.fetch_add(1)) {
      RunUnit(u);
      units_done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y [M, N] = x [M, K] times the weight in `blocks` (Q blocks of K × 64 floats), with `kernels` for the layout.
void RunBlocks(ffi::ThreadPool& pool, const BlockRowsFn* kernels, const float* x, const float* blocks, float* y,
               int64_t m_rows, int64_t k_len, int64_t n_len, int64_t q_blocks) {
  if (m_rows == 0 || n_len == 0) return;
  const int64_t block_bytes = k_len * kPanel * static_cast<int64_t>(sizeof(float));
  auto work = std::make_shared<SharedWork>();
  work->kernels = kernels;
  work->x = x;
  work->blocks = blocks;
  work->y = y;
  work->m_rows = m_rows;
  work->k_len = k_len;
  work->n_len = n_len;
  work->q_blocks = q_blocks;
  work->unit_blocks = std::max<int64_t>(1, kUnitBytes / std::max<int64_t>(1, block_bytes));
  const int64_t units = work->units();
  const int64_t threads =
      q_blocks * block_bytes < kBytesWorthAThread ? 1 : std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 0; i < std::min(threads - 1, units - 1); ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  // every unit is claimed now, each by a worker that is running it: wait for those to finish
  while (work->units_done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("panel_matmul: expected x [M, K], panels [Q, K, 64], y [M, N]");
  }
  const int64_t m_rows = xd[0], k_len = xd[1], q_panels = pd[0], n_len = yd[1];
  if (pd[1] != k_len || pd[2] != kPanel || yd[0] != m_rows || n_len > q_panels * kPanel ||
      n_len <= (q_panels - 1) * kPanel) {
    return ffi::Error::InvalidArgument("panel_matmul: x " + Dims(xd) + ", panels " + Dims(pd) + " and y " + Dims(yd) +
                                       " do not agree");
  }
  RunBlocks(pool, kPanelRows, x.typed_data(), panels.typed_data(), y->typed_data(), m_rows, k_len, n_len, q_panels);
  return ffi::Error::Success();
}

ffi::Error TableMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> table,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto td = table.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || td.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("table_matmul: expected x [M, D], table [V, D], y [M, V]");
  }
  const int64_t m_rows = xd[0], d_len = xd[1], v_len = td[0];
  if (td[1] != d_len || yd[0] != m_rows || yd[1] != v_len) {
    return ffi::Error::InvalidArgument("table_matmul: x " + Dims(xd) + ", table " + Dims(td) + " and y " + Dims(yd) +
                                       " do not agree");
  }
  RunBlocks(pool, kTableRows, x.typed_data(), table.typed_data(), y->typed_data(), m_rows, d_len, v_len,
            (v_len + kPanel - 1) / kPanel);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecTableMatmul, TableMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y

// The Python module: `handler()` and `table_handler()` return the XLA FFI handlers as PyCapsules for
// jax.ffi.register_ffi_target.
static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&JaxspecPanelMatmul), nullptr, nullptr);
}

static PyObject* TableHandler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&JaxspecTableMatmul), nullptr, nullptr);
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The panel-matmul XLA FFI handler (a PyCapsule)."},
    {"table_handler", TableHandler, METH_NOARGS, "The table-matmul XLA FFI handler (a PyCapsule)."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_panel_matmul", nullptr, -1, kMethods,
                               nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__panel_matmul() { return PyModule_Create(&kModule); }
