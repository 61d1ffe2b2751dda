// One decode token of the gated delta rule for every row of a step, on the float32 states where they lie in their
// stacked pool: the CPU kernel behind gdn_jax.model.advance_in_pool (gdn_jax/cpu_kernels.py builds and registers
// it). XLA compiles that update to a copy of each row's state, a product, and an in-place write that runs on one
// thread (about 2.5 passes over the state's bytes more than needed, 256 KiB at a time); here each (row, head) state
// is read once for its products with k and q and written once, its reread served by the core's cache, and the
// (row, head) pairs are shared among XLA's CPU threads (parallel.h).
//
// pool [layers, slots, H, D, D] (dk = dv = D), aliased to the first result and updated in place; layer [1]; src,
// live [B] (row b reads slot src[b] of the layer, zeros where !warm[b], and writes slot live[b]); q, k, v [B, H, D];
// g, beta [B, H], float32 (padding rows already inert: zeros). Results: the pool, o [B, H, D]:
//   e = exp(g), delta = beta (v - e S^T k), o = e S^T q + (k . q) delta, S' = e S + k delta^T.
// No row reads a slot another row writes (the engine checks it for every one-token step), so the pairs are
// independent.
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxDim = 256;

struct Update {
  float* pool;
  int64_t slots, heads, dim;
  int32_t layer;
  const int32_t *src, *live;
  const bool* warm;
  const float *q, *k, *v, *g, *beta;
  float* out;

  void Head(int64_t r, int64_t h) const {
    const int64_t D = dim;
    const size_t size = static_cast<size_t>(D) * D;
    const float* s = pool + ((static_cast<size_t>(layer) * slots + src[r]) * heads + h) * size;
    float* n = pool + ((static_cast<size_t>(layer) * slots + live[r]) * heads + h) * size;
    const size_t at = (static_cast<size_t>(r) * heads + h) * D;
    const float *kk = k + at, *qq = q + at, *vv = v + at;
    const float e = std::exp(g[r * heads + h]), b = beta[r * heads + h];
    const bool w = warm[r];
    float sk[kMaxDim], sq[kMaxDim], delta[kMaxDim], kq = 0.0f;
    for (int64_t j = 0; j < D; j++) sk[j] = sq[j] = 0.0f;
    if (w) {
      for (int64_t i = 0; i < D; i++) {
        const float ki = kk[i], qi = qq[i];
        const float* row = s + i * D;
        for (int64_t j = 0; j < D; j++) {
          sk[j] += ki * row[j];
          sq[j] += qi * row[j];
        }
      }
    }
    for (int64_t i = 0; i < D; i++) kq += kk[i] * qq[i];
    float* o = out + at;
    for (int64_t j = 0; j < D; j++) {
      delta[j] = (vv[j] - e * sk[j]) * b;
      o[j] = e * sq[j] + kq * delta[j];
    }
#if defined(__AVX512F__)
    if (D % 16 == 0 && (reinterpret_cast<uintptr_t>(n) & 63) == 0) {
      // streaming stores: the new state is not read again in this step, and they spare reading its lines first
      const __m512 e16 = _mm512_set1_ps(e);
      for (int64_t i = 0; i < D; i++) {
        const __m512 ki = _mm512_set1_ps(kk[i]);
        for (int64_t j = 0; j < D; j += 16) {
          const __m512 x = w ? _mm512_mul_ps(e16, _mm512_loadu_ps(s + i * D + j)) : _mm512_setzero_ps();
          _mm512_stream_ps(n + i * D + j, _mm512_fmadd_ps(ki, _mm512_loadu_ps(delta + j), x));
        }
      }
      return;
    }
#endif
    for (int64_t i = 0; i < D; i++)
      for (int64_t j = 0; j < D; j++) n[i * D + j] = (w ? e * s[i * D + j] : 0.0f) + kk[i] * delta[j];
  }
};

ffi::Error GdnDecode(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> pool, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::PRED> warm,
                     ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::ResultBuffer<ffi::F32> pool_out,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto dims = pool.dimensions();
  if (dims.size() != 5 || dims[3] != dims[4] || dims[3] > kMaxDim)
    return ffi::Error::InvalidArgument("gdn_decode: pool must be [layers, slots, H, D, D] with D <= 256");
  if (pool_out->typed_data() != pool.typed_data())
    return ffi::Error::InvalidArgument("gdn_decode: the pool must be updated in place (aliased to its result)");
  const Update update{pool_out->typed_data(), dims[1], dims[2], dims[3], layer.typed_data()[0], src.typed_data(),
                      live.typed_data(), warm.typed_data(), q.typed_data(), k.typed_data(), v.typed_data(),
                      g.typed_data(), beta.typed_data(), out->typed_data()};
  const int64_t heads = dims[2];
  const int64_t bytes = 2 * dims[3] * dims[3] * sizeof(float);  // a state read and written
  gdn_jax::ParallelFor(pool_threads, src.element_count() * heads, bytes,
                       [update, heads](int64_t i) { update.Head(i / heads, i % heads); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnJaxGdnDecode, GdnDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // warm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g
                                  .Arg<ffi::Buffer<ffi::F32>>()   // beta
                                  .Ret<ffi::Buffer<ffi::F32>>()   // pool, in place
                                  .Ret<ffi::Buffer<ffi::F32>>());  // o
