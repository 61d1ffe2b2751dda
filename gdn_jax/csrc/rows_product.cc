// Few-row bfloat16 products, y[n, m] = sum_k x[m, k] w[n, k] for the 2-16 rows of a decode step: the CPU kernel
// behind gdn_jax.model's products with the weight on the left where it is the faster form (`model.rows_kernel_rows`;
// gdn_jax/cpu_kernels.py builds and registers it).
//
// A decode step reads every weight once for a few rows, so its products should run as fast as memory delivers the
// weight. XLA's CPU routines do not at 2-16 bfloat16 rows on an AMD EPYC without matrix units (13-14 GB/s where one
// row streams 30). Here each weight row is read once, where it lies in the HF layout [n_out, n_in], for every x row:
// two weight rows at a time are multiplied with up to eight x rows (kRowGroup; more rows: the same two weight rows,
// from the core's cache, with the next eight), sixteen vector accumulators along k, while the next two weight rows
// are prefetched. Pairs of bfloat16 numbers go to the AVX-512 BF16 dot-product instruction where the CPU has it
// (their float32 products summed in float32), else are widened to float32 in registers. The accumulators are summed
// across their lanes by one tree (`Sums`) that adds every output's terms in the same order, so a row's result does
// not depend on the other rows of the batch. Blocks of kBlockRows weight rows are shared among XLA's CPU threads
// (parallel.h).
//
// x [M, K] and w [N, K], bfloat16. Result: y [N, M] float32 (the weight-left form's [n_out, rows], which the model
// transposes once per call site).
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "lanes.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace gdn_jax;  // lanes.h

constexpr int kRowGroup = 8;        // x rows multiplied at once
constexpr int kPair = 2;            // weight rows multiplied at once
constexpr int64_t kBlockRows = 16;  // weight rows per item of work

// y[p * M + r] = w_p . x_r for the P weight rows of w and the R x rows of x (row stride K), while `ahead` bytes from
// `next` are prefetched, spread over the loop.
template <int P, int R>
inline void Tile(const uint16_t* x, const uint16_t* w, int64_t K, int64_t M, float* y, const char* next,
                 int64_t ahead) {
  Lanes acc[kPair * kRowGroup] = {};  // acc[p * kRowGroup + r]; Sums adds sixteen
  int64_t k = 0, fetched = 0;
#if defined(__AVX512BF16__)
  constexpr int64_t kStep = 2 * kLanes;  // 32 bfloat16 per vector, summed in pairs into 16 float32 lanes
#else
  constexpr int64_t kStep = kLanes;
#endif
  const int64_t per_step = 64 * (ahead / 64 / std::max<int64_t>(1, K / kStep) + 1);
  for (; k + kStep <= K; k += kStep) {
    for (const int64_t end = std::min(ahead, fetched + per_step); fetched < end; fetched += 64)
      __builtin_prefetch(next + fetched);
#if defined(__AVX512BF16__)
    __m512i wv[P];
    for (int p = 0; p < P; p++) wv[p] = _mm512_loadu_si512(w + p * K + k);
    for (int r = 0; r < R; r++) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * K + k));
      for (int p = 0; p < P; p++) {
        Lanes& a = acc[p * kRowGroup + r];
        a = reinterpret_cast<Lanes>(
            _mm512_dpbf16_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512bh>(wv[p]), xv));
      }
    }
#else
    Lanes wv[P];
    for (int p = 0; p < P; p++) wv[p] = Load(w + p * K + k);
    for (int r = 0; r < R; r++) {
      const Lanes xv = Load(x + r * K + k);
      for (int p = 0; p < P; p++) acc[p * kRowGroup + r] += wv[p] * xv;
    }
#endif
  }
  float sums[kLanes];
  const Lanes total = Sums(acc);
  std::memcpy(sums, &total, sizeof sums);
  for (int p = 0; p < P; p++)
    for (int r = 0; r < R; r++) {
      float s = sums[p * kRowGroup + r];
      for (int64_t kk = k; kk < K; kk++) s += ToFloat(w[p * K + kk]) * ToFloat(x[r * K + kk]);
      y[p * M + r] = s;
    }
}

template <int P>
inline void Rows(const uint16_t* x, const uint16_t* w, int64_t K, int64_t M, int64_t rows, float* y,
                 const char* next, int64_t ahead) {
  switch (rows) {  // x rows in this group
#define GDN_ROWS(r) \
  case r:           \
    return Tile<P, r>(x, w, K, M, y, next, ahead);
    GDN_ROWS(1) GDN_ROWS(2) GDN_ROWS(3) GDN_ROWS(4) GDN_ROWS(5) GDN_ROWS(6) GDN_ROWS(7) GDN_ROWS(8)
#undef GDN_ROWS
  }
}

void Run(ffi::ThreadPool& threads, const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows, groups = (M + kRowGroup - 1) / kRowGroup;
  // each group of x rows prefetches its share of the next two weight rows
  const int64_t share = (kPair * K * 2 / groups + 63) / 64 * 64;
  gdn_jax::ParallelFor(threads, blocks, kBlockRows * K * 2, [=](int64_t block) {
    const int64_t last = std::min(N, (block + 1) * kBlockRows);
    for (int64_t n = block * kBlockRows; n < last; n += kPair) {
      const char* next = reinterpret_cast<const char*>(w + (n + kPair) * K);
      for (int64_t g = 0; g < groups; g++) {
        const int64_t m = g * kRowGroup, rows = std::min<int64_t>(kRowGroup, M - m);
        if (n + kPair <= last)
          Rows<kPair>(x + m * K, w + n * K, K, M, rows, y + n * M + m, next + g * share, share);
        else  // an odd weight row at the end
          Rows<1>(x + m * K, w + n * K, K, M, rows, y + n * M + m, next, 0);
      }
    }
  });
}

ffi::Error RowsProduct(ffi::ThreadPool threads, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_product: x must be [M, K] and w [N, K]");
  Run(threads, reinterpret_cast<const uint16_t*>(x.typed_data()), reinterpret_cast<const uint16_t*>(w.typed_data()),
      xd[0], wd[0], xd[1], y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnJaxRowsProduct, RowsProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
