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
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

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

// On x86-64 each row count is compiled three times (AVX-512, AVX2 + FMA, baseline), the variant picked at
// load time; elsewhere (aarch64 hosts) once, for the compiler's default target.
#if defined(__x86_64__)
#define JAXSPEC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAXSPEC_CLONES
#endif
#define JAXSPEC_PANEL_ARGS const float *x, int64_t k_len, const float *panel, float *y, int64_t n_len, int64_t columns
#define JAXSPEC_PANEL_CALL x, k_len, panel, y, n_len, columns
JAXSPEC_CLONES void PanelRows1(JAXSPEC_PANEL_ARGS) { PanelRowsBody<1>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows2(JAXSPEC_PANEL_ARGS) { PanelRowsBody<2>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows3(JAXSPEC_PANEL_ARGS) { PanelRowsBody<3>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows4(JAXSPEC_PANEL_ARGS) { PanelRowsBody<4>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows5(JAXSPEC_PANEL_ARGS) { PanelRowsBody<5>(JAXSPEC_PANEL_CALL); }
JAXSPEC_CLONES void PanelRows6(JAXSPEC_PANEL_ARGS) { PanelRowsBody<6>(JAXSPEC_PANEL_CALL); }

using PanelRowsFn = void (*)(JAXSPEC_PANEL_ARGS);
constexpr PanelRowsFn kPanelRows[kMaxGroup + 1] = {nullptr, PanelRows1, PanelRows2, PanelRows3,
                                                   PanelRows4, PanelRows5, PanelRows6};

// The work of one call: units of consecutive panels, claimed one at a time by the calling thread and XLA's
// intra-op pool. It lives on the heap, shared by every task: a task the pool starts after the call returned
// finds no unit left and touches nothing else.
struct SharedWork {
  const float *x, *panels;
  float* y;
  int64_t m_rows, k_len, n_len, q_panels, unit_panels;
  std::atomic<int64_t> next_unit{0};
  std::atomic<int64_t> units_done{0};

  int64_t units() const { return (q_panels + unit_panels - 1) / unit_panels; }

  // Every panel of unit u, each read once for all rows: the rows go in groups of at most kMaxGroup, sized
  // alike (9 rows: 5 + 4), and later groups find the panel in cache.
  void RunUnit(int64_t u) const {
    const int64_t groups = (m_rows + kMaxGroup - 1) / kMaxGroup;
    for (int64_t q = u * unit_panels; q < std::min(q_panels, (u + 1) * unit_panels); ++q) {
      const float* panel = panels + q * k_len * kPanel;
      const int64_t columns = std::min(kPanel, n_len - q * kPanel);
      for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t rows = (m_rows - m + (groups - g) - 1) / (groups - g);
        kPanelRows[rows](x + m * k_len, k_len, panel, y + m * n_len + q * kPanel, n_len, columns);
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
    return ffi::Error::InvalidArgument("panel_matmul: x [" + std::to_string(m_rows) + ", " + std::to_string(k_len) +
                                       "], panels [" + std::to_string(q_panels) + ", " + std::to_string(pd[1]) +
                                       ", " + std::to_string(pd[2]) + "] and y [" + std::to_string(yd[0]) + ", " +
                                       std::to_string(n_len) + "] do not agree");
  }
  if (m_rows == 0 || n_len == 0) return ffi::Error::Success();
  const int64_t panel_bytes = k_len * kPanel * static_cast<int64_t>(sizeof(float));
  auto work = std::make_shared<SharedWork>();
  work->x = x.typed_data();
  work->panels = panels.typed_data();
  work->y = y->typed_data();
  work->m_rows = m_rows;
  work->k_len = k_len;
  work->n_len = n_len;
  work->q_panels = q_panels;
  work->unit_panels = std::max<int64_t>(1, kUnitBytes / std::max<int64_t>(1, panel_bytes));
  const int64_t units = work->units();
  const int64_t threads =
      q_panels * panel_bytes < kBytesWorthAThread ? 1 : std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 0; i < std::min(threads - 1, units - 1); ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  // every unit is claimed now, each by a worker that is running it: wait for those to finish
  while (work->units_done.load(std::memory_order_acquire) < units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y

// The Python module: `handler()` returns the XLA FFI handler as a PyCapsule for jax.ffi.register_ffi_target.
static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&JaxspecPanelMatmul), nullptr, nullptr);
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The panel-matmul XLA FFI handler (a PyCapsule)."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_panel_matmul", nullptr, -1, kMethods};

PyMODINIT_FUNC PyInit__panel_matmul() { return PyModule_Create(&kModule); }
