// Few-row bfloat16 and float32 products, y[n, m] = sum_k x[m, k] w[n, k] for the 2-16 rows of a decode step: the
// CPU kernel behind gdn_jax.model's products with the weight on the left where it is the faster form
// (`Forms.rows_kernel_rows`, `Forms.f32_rows_kernel_rows`; gdn_jax/backends/cpu/kernels.py registers it).
//
// A decode step reads every weight once for a few rows, so its products should run as fast as memory delivers the
// weight. XLA's CPU routines do not at 2-16 bfloat16 rows on an AMD EPYC without matrix units (13-14 GB/s where one
// row streams 30). Here each weight row is read once, where it lies in the HF layout [n_out, n_in], for all the x
// rows, in one of two forms:
// - up to kRowGroup (8) rows, `Tile`: two weight rows at a time by the x rows, sixteen vector accumulators along k,
//   summed across their lanes at the end by one tree (`Sums`);
// - 9-16 rows, `Packed`: a block of 16 weight rows is packed, a chunk at a time, into [bfloat16 pair][weight row]
//   order in the core's cache (a transpose of 32-bit words), so that each vector of it multiplies every x row's pair,
//   broadcast, into one accumulator per x row whose lanes are the 16 weight rows: one load per M multiply-adds where
//   the first form needs two per eight (at 16 rows ~20% faster than the first form and than XLA).
// Both prefetch the weight rows they multiply next into the L2 cache while they multiply these (into L1 it was ~25%
// slower at 8 rows). Pairs of bfloat16 numbers go to the AVX-512 BF16 dot-product instruction where the CPU has it
// (their float32 products summed in float32); elsewhere the first form widens them to float32 in registers for any
// row count. Float32 weights take the first form at any row count, sixteen lanes at a time (`lanes.h`)
// (XLA's library spends more per call on a few float32 rows than the product costs at the sizes of a verify or
// decode step). Each form adds an output's terms in an order that does not depend on the other rows of the batch, so a
// row's result depends only on which form its batch's row count takes. Blocks of kBlockRows weight rows are shared
// among XLA's CPU threads (parallel.h).
//
// x [M, K] and w [N, K], both bfloat16 or both float32. Result: y [M, N] float32, x @ w.T: the rows' outputs as the
// model uses them (XLA's weight-left form gives [N, M], which the model transposes after the product: 1.2-1.3 ms more
// per 16-row step).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// y[r * N + p] = w_p . x_r for the P weight rows of w and the R x rows of x (row stride K), while `ahead` bytes from
// `next` are prefetched, spread over the loop.
template <typename T, int P, int R>
inline void Tile(const T* x, const T* w, int64_t K, int64_t N, float* y, const char* next, int64_t ahead) {
  Lanes acc[kPair * kRowGroup] = {};  // acc[p * kRowGroup + r]; Sums adds sixteen
  int64_t k = 0, fetched = 0;
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;  // bfloat16 pairs to the dot-product instruction
#else
  constexpr bool kPairs = false;
#endif
  constexpr int64_t kStep = kPairs ? 2 * kLanes : kLanes;  // (32 bfloat16 per vector, summed in pairs)
  const int64_t per_step = 64 * (ahead / 64 / std::max<int64_t>(1, K / kStep) + 1);
  for (; k + kStep <= K; k += kStep) {
    for (const int64_t end = std::min(ahead, fetched + per_step); fetched < end; fetched += 64)
      __builtin_prefetch(next + fetched, 0, 2);
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
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
      continue;
    }
#endif
    Lanes wv[P];
    for (int p = 0; p < P; p++) wv[p] = Load(w + p * K + k);
    for (int r = 0; r < R; r++) {
      const Lanes xv = Load(x + r * K + k);
      for (int p = 0; p < P; p++) acc[p * kRowGroup + r] += wv[p] * xv;
    }
  }
  float sums[kLanes];
  const Lanes total = Sums(acc);
  std::memcpy(sums, &total, sizeof sums);
  for (int p = 0; p < P; p++)
    for (int r = 0; r < R; r++) {
      float s = sums[p * kRowGroup + r];
      for (int64_t kk = k; kk < K; kk++) s += ToFloat(w[p * K + kk]) * ToFloat(x[r * K + kk]);
      y[r * N + p] = s;
    }
}

#if defined(__AVX512BF16__)
constexpr int64_t kChunkPairs = 256;  // bfloat16 pairs of the weight block packed at a time (16 KiB)
static_assert(kBlockRows == 16, "Packed multiplies blocks of 16 weight rows, one per lane");

// The 16 x 16 transpose of 32-bit words, in place: lane j of r[i] becomes lane i of r[j].
inline void Transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows: words interleaved
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)  // quads of rows: word c of each 128-bit lane of theirs in b[i + c]
    for (int h = 0; h < 2; h++) {
      b[i + 2 * h] = _mm512_unpacklo_epi64(a[i + h], a[i + 2 + h]);
      b[i + 2 * h + 1] = _mm512_unpackhi_epi64(a[i + h], a[i + 2 + h]);
    }
  for (int i = 0; i < 16; i += 8)  // 128-bit lanes: two levels of shuffles
    for (int h = 0; h < 4; h++) {
      a[i + h] = _mm512_shuffle_i32x4(b[i + h], b[i + 4 + h], 0x88);
      a[i + 4 + h] = _mm512_shuffle_i32x4(b[i + h], b[i + 4 + h], 0xdd);
    }
  for (int h = 0; h < 8; h++) {
    r[h] = _mm512_shuffle_i32x4(a[h], a[h + 8], 0x88);
    r[h + 8] = _mm512_shuffle_i32x4(a[h], a[h + 8], 0xdd);
  }
}

// y[m * N + n] = w_n . x_m for the count (at most 16) weight rows of a block and M x rows, with the weight block
// packed as bfloat16 pairs, kChunkPairs at a time, into [pair][weight row] order in the core's cache: one vector of
// the packed block then holds one pair of 16 weight rows, and each x row's pair is broadcast to it, so that the M
// accumulators' lanes are the weight rows (no sums across lanes, one load per M multiply-adds). The next chunk (or
// the next block's first) is prefetched into L2 through the multiply loop, a line per pair (prefetches past the
// weight's end are dropped by the CPU). K even.
template <int M>
void Packed(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t count, float* y) {
  alignas(64) uint32_t packed[kChunkPairs * 16];
  const int64_t pairs = K / 2;
  const uint32_t *x32 = reinterpret_cast<const uint32_t*>(x), *w32 = reinterpret_cast<const uint32_t*>(w);
  __m512 acc[M];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += kChunkPairs) {
    const int64_t len = std::min(kChunkPairs, pairs - j0);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 lanes = len - t >= 16 ? 0xffff : (1u << (len - t)) - 1;
      __m512i r[16];
      for (int64_t n = 0; n < 16; n++) {
        r[n] = n < count ? _mm512_maskz_loadu_epi32(lanes, w32 + n * pairs + j0 + t) : _mm512_setzero_si512();
      }
      Transpose16(r);
      for (int c = 0; c < 16; c++) _mm512_store_si512(packed + (t + c) * 16, r[c]);
    }
    // the next chunk (or the next block's first) on its way to the core's L2 cache, one line per pair
    const uint32_t* ahead = j0 + kChunkPairs < pairs ? w32 + j0 + kChunkPairs : w32 + 16 * pairs;
    for (int64_t j = 0; j < len; j++) {
      __builtin_prefetch(ahead + (j & 15) * pairs + (j >> 4) * 16, 0, 2);
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_load_si512(packed + j * 16));
      for (int m = 0; m < M; m++)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, reinterpret_cast<__m512bh>(_mm512_set1_epi32(x32[m * pairs + j0 + j])));
    }
  }
  const __mmask16 rows = count >= 16 ? 0xffff : (1u << count) - 1;  // an accumulator's lanes: the block's rows
  for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(y + m * N, rows, acc[m]);
}

// Packed<M> for M in (kRowGroup, 16]; false for any other M
bool PackedRows(const uint16_t* x, const uint16_t* w, int64_t K, int64_t M, int64_t N, int64_t count, float* y) {
  switch (M) {
#define GDN_PACKED(m) \
  case m:             \
    Packed<m>(x, w, K, N, count, y); \
    return true;
    GDN_PACKED(9) GDN_PACKED(10) GDN_PACKED(11) GDN_PACKED(12) GDN_PACKED(13) GDN_PACKED(14) GDN_PACKED(15)
    GDN_PACKED(16)
#undef GDN_PACKED
  }
  return false;
}
#endif

template <typename T, int P>
inline void Rows(const T* x, const T* w, int64_t K, int64_t N, int64_t rows, float* y,
                 const char* next, int64_t ahead) {
  switch (rows) {  // x rows in this group
#define GDN_ROWS(r) \
  case r:           \
    return Tile<T, P, r>(x, w, K, N, y, next, ahead);
    GDN_ROWS(1) GDN_ROWS(2) GDN_ROWS(3) GDN_ROWS(4) GDN_ROWS(5) GDN_ROWS(6) GDN_ROWS(7) GDN_ROWS(8)
#undef GDN_ROWS
  }
}

template <typename T>
void Run(ffi::ThreadPool& threads, const T* x, const T* w, int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows, groups = (M + kRowGroup - 1) / kRowGroup;
  // each group of x rows prefetches its share of the pair of weight rows two pairs ahead (into L2)
  const int64_t share = (kPair * K * static_cast<int64_t>(sizeof(T)) / groups + 63) / 64 * 64;
  gdn_jax::ParallelFor(threads, blocks, kBlockRows * K * static_cast<int64_t>(sizeof(T)), [=](int64_t block) {
    const int64_t last = std::min(N, (block + 1) * kBlockRows);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (M > kRowGroup && K % 2 == 0 &&
          PackedRows(x, w + block * kBlockRows * K, K, M, N, last - block * kBlockRows, y + block * kBlockRows))
        return;
    }
#endif
    for (int64_t n = block * kBlockRows; n < last; n += kPair) {
      const char* next = reinterpret_cast<const char*>(w + (n + 2 * kPair) * K);
      for (int64_t g = 0; g < groups; g++) {
        const int64_t m = g * kRowGroup, rows = std::min<int64_t>(kRowGroup, M - m);
        if (n + kPair <= last)
          Rows<T, kPair>(x + m * K, w + n * K, K, N, rows, y + m * N + n, next + g * share, share);
        else  // an odd weight row at the end
          Rows<T, 1>(x + m * K, w + n * K, K, N, rows, y + m * N + n, next, 0);
      }
    }
  });
}

ffi::Error RowsProduct(ffi::ThreadPool threads, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_product: x must be [M, K] and w [N, K]");
  if (x.element_type() != w.element_type())
    return ffi::Error::InvalidArgument("rows_product: x and w must have one dtype");
  if (x.element_type() == ffi::DataType::F32)
    Run(threads, static_cast<const float*>(x.untyped_data()), static_cast<const float*>(w.untyped_data()), xd[0],
        wd[0], xd[1], y->typed_data());
  else if (x.element_type() == ffi::DataType::BF16)
    Run(threads, static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint16_t*>(w.untyped_data()),
        xd[0], wd[0], xd[1], y->typed_data());
  else
    return ffi::Error::InvalidArgument("rows_product: x and w must be float32 or bfloat16");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnJaxRowsProduct, RowsProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::AnyBuffer>()           // w
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
