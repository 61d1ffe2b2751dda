// Decode attention: one query token per row against that row's keys and values where they lie in the paged caches,
// the CPU kernel behind gdn_jax.model.Attention for one-token steps (gdn_jax/cpu_kernels.py builds and registers it).
// XLA's form gathers each chunk of a row's blocks into a contiguous copy before its two products; here each key and
// value row is read once, in place, widened to float32 in registers (bfloat16 caches are stored as their uint16 bit
// patterns, gdn_jax.model.pool_dtype), and used by all the query heads that share its KV head: scores four heads by
// two keys at a time, summed across lanes sixteen keys at once (lanes.h), a vector exponential for the online
// softmax, values accumulated four heads by four vectors at a time, while the next block's rows are prefetched.
// (row, KV head) pairs are shared among XLA's CPU threads (parallel.h).
//
// k_cache, v_cache [kv_heads, layers, blocks, block_size, D] (uint16 bfloat16 bits, or float32); layer [1]; q [B, H,
// D] float32 (normed and rotated; head h uses KV head h / (H / kv_heads)); tables [B, width] int32 (the row's blocks
// in order); keys [B] int32 (how many of the row's first positions it attends to). Result: o [B, H, D] float32, the
// softmax(q k^T / sqrt(D)) v of each query, an online softmax over the row's blocks in float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "lanes.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace gdn_jax;  // lanes.h

constexpr int64_t kMaxGroup = 16;   // query heads per KV head
constexpr int64_t kMaxKeys = 64;    // keys at a time (of one block)
constexpr int64_t kMaxDim = 256;    // head dimension

// e^x in every lane, to about one unit in the last place: 2^n e^r with n the nearest integer to x / ln 2 and a
// polynomial for e^r, |r| <= ln 2 / 2 (the coefficients of the Cephes library's expf); x is clamped to where e^x is a
// normal float32, so -inf gives ~1e-38 (the callers zero such lanes).
inline Lanes Exp(Lanes x) {
  typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
  x = x > 88.3762626f ? Splat(88.3762626f) : x;
  x = x < -87.3365448f ? Splat(-87.3365448f) : x;
  const Lanes t = x * 1.44269504f + 0.5f;
  Ints n = __builtin_convertvector(t, Ints);  // towards zero, then down to the floor
  n -= (__builtin_convertvector(n, Lanes) > t) & 1;
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Lanes y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * reinterpret_cast<Lanes>((n + 127) << 23);
}

constexpr int kHeads = 4;  // query heads multiplied at once (their accumulators in registers)
constexpr int kKeys = 2;   // keys multiplied at once by the scores' products
constexpr int kVectors = 4;  // vectors of the head dimension accumulated at once by the values' products

template <typename T>
struct Attend {
  const T *k, *v;
  int64_t layers, blocks, block_size, dim;
  int32_t layer;
  const float* q;
  const int32_t *tables, *keys;
  int64_t width, heads, kv_heads;
  float* out;

  int64_t Keys(int64_t r) const { return std::clamp<int64_t>(keys[r], 1, width * block_size); }

  // Where key `at` of row r lies in KV head j's cache of this layer, and how many keys from it one step takes: to
  // the end of its block, at most kMaxKeys, at most n - at.
  size_t Offset(int64_t r, int64_t j, int64_t at) const {
    const int64_t block = tables[r * width + at / block_size];
    return (((static_cast<size_t>(j) * layers + layer) * blocks + block) * block_size + at % block_size) * dim;
  }
  int64_t Count(int64_t at, int64_t n) const { return std::min({kMaxKeys, block_size - at % block_size, n - at}); }

  // p[i * kMaxKeys + t] = q_i . key_t * scale for the group's heads i and the count keys t of `rows`; -inf at
  // t in [count, next multiple of 16). kHeads heads by kKeys keys at a time, their dot products in registers, summed
  // across lanes 16 keys at a time (`Sums`).
  void Scores(const float* qq, int64_t group, const T* rows, int64_t count, float scale, float* p) const {
    const int64_t D = dim, whole = D / kLanes * kLanes;
    for (int64_t i0 = 0; i0 < group; i0 += kHeads) {
      const float* qs[kHeads];  // a group of fewer than kHeads repeats its last head (results not kept)
      for (int h = 0; h < kHeads; h++) qs[h] = qq + std::min<int64_t>(i0 + h, group - 1) * D;
      for (int64_t t0 = 0; t0 < count; t0 += kLanes) {
        Lanes part[kHeads][kLanes];
        if (count - t0 < kLanes) std::memset(part, 0, sizeof part);  // lanes past the count: set, then -inf below
        for (int64_t t = t0; t < std::min(count, t0 + kLanes); t += kKeys) {
          const T* key[kKeys];  // past the count: the last key again (results not kept)
          for (int u = 0; u < kKeys; u++) key[u] = rows + std::min(t + u, count - 1) * D;
          Lanes a[kHeads][kKeys] = {};
          for (int64_t c = 0; c < whole; c += kLanes) {
            Lanes kv[kKeys];
            for (int u = 0; u < kKeys; u++) kv[u] = Load(key[u] + c);
            for (int h = 0; h < kHeads; h++) {
              const Lanes qv = Load(qs[h] + c);
              for (int u = 0; u < kKeys; u++) a[h][u] += qv * kv[u];
            }
          }
          for (int h = 0; h < kHeads; h++)
            for (int u = 0; u < kKeys && t + u < t0 + kLanes; u++) part[h][t + u - t0] = a[h][u];
        }
        for (int64_t h = 0; h < std::min<int64_t>(kHeads, group - i0); h++) {
          float* out = p + (i0 + h) * kMaxKeys + t0;
          Store(out, Sums(part[h]));
          for (int64_t t = t0; t < t0 + kLanes; t++) {
            if (t >= count) {
              out[t - t0] = -std::numeric_limits<float>::infinity();
              continue;
            }
            for (int64_t c = whole; c < D; c++) out[t - t0] += qs[h][c] * ToFloat(rows[t * D + c]);
            out[t - t0] *= scale;
          }
        }
      }
    }
  }

  // acc_i[c, c + 16 C) += sum_t p[i * kMaxKeys + t] value_t[c, c + 16 C) for kHeads heads from i0 (ps: their
  // probabilities), C vectors of the head dimension at a time in registers
  template <int C>
  void ValueVectors(const float* const* ps, int64_t heads_here, int64_t i0, const T* rows, int64_t count,
                    int64_t c, float* acc) const {
    const int64_t D = dim;
    Lanes a[kHeads][C] = {};
    for (int64_t t = 0; t < count; t++) {
      Lanes value[C];
      for (int x = 0; x < C; x++) value[x] = Load(rows + t * D + c + x * kLanes);
      for (int h = 0; h < kHeads; h++) {
        const Lanes w = Splat(ps[h][t]);
        for (int x = 0; x < C; x++) a[h][x] += w * value[x];
      }
    }
    for (int64_t h = 0; h < heads_here; h++)
      for (int x = 0; x < C; x++) {
        float* at = acc + (i0 + h) * D + c + x * kLanes;
        Store(at, Load(at) + a[h][x]);
      }
  }

  // acc_i += sum_t p[i * kMaxKeys + t] value_t for the group's heads i
  void Values(int64_t group, const T* rows, int64_t count, const float* p, float* acc) const {
    const int64_t D = dim, whole = D / kLanes * kLanes;
    for (int64_t i0 = 0; i0 < group; i0 += kHeads) {
      const int64_t heads_here = std::min<int64_t>(kHeads, group - i0);
      const float* ps[kHeads];
      for (int h = 0; h < kHeads; h++) ps[h] = p + std::min<int64_t>(i0 + h, group - 1) * kMaxKeys;
      int64_t c = 0;
      for (; c + kVectors * kLanes <= whole; c += kVectors * kLanes)
        ValueVectors<kVectors>(ps, heads_here, i0, rows, count, c, acc);
      for (; c < whole; c += kLanes) ValueVectors<1>(ps, heads_here, i0, rows, count, c, acc);
      for (int64_t h = 0; h < heads_here; h++)
        for (int64_t d = whole; d < D; d++)
          for (int64_t t = 0; t < count; t++) acc[(i0 + h) * D + d] += ps[h][t] * ToFloat(rows[t * D + d]);
    }
  }

  void Pair(int64_t r, int64_t j) const {
    const int64_t D = dim, group = heads / kv_heads;
    const float* qq = q + (r * heads + j * group) * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t n = Keys(r);
    float top[kMaxGroup], total[kMaxGroup];
    alignas(64) float p[kMaxGroup * kMaxKeys], acc[kMaxGroup * kMaxDim];
    std::fill(top, top + group, -std::numeric_limits<float>::infinity());
    std::fill(total, total + group, 0.0f);
    std::fill(acc, acc + group * D, 0.0f);
    for (int64_t at = 0; at < n;) {  // keys [at, at + count)
      const int64_t count = Count(at, n), padded = (count + kLanes - 1) / kLanes * kLanes;
      const size_t base = Offset(r, j, at);
      at += count;
      if (at < n) {  // the next keys and values on their way from memory while these are used (another block)
        const size_t from = Offset(r, j, at);
        const char *nk = reinterpret_cast<const char*>(k + from), *nv = reinterpret_cast<const char*>(v + from);
        for (size_t b = 0; b < Count(at, n) * D * sizeof(T); b += 64) {
          __builtin_prefetch(nk + b);
          __builtin_prefetch(nv + b);
        }
      }
      Scores(qq, group, k + base, count, scale, p);
      for (int64_t i = 0; i < group; i++) {  // online softmax: p becomes the probabilities, unnormalised
        float* pi = p + i * kMaxKeys;
        Lanes most = Load(pi);
        for (int64_t t = kLanes; t < padded; t += kLanes) most = most > Load(pi + t) ? most : Load(pi + t);
        const float new_top = std::max(top[i], Max(most));
        const float shrink = std::exp(top[i] - new_top);  // 0 at the first block
        Lanes sum = {};
        for (int64_t t = 0; t < padded; t += kLanes) {
          Lanes e = Exp(Load(pi + t) - new_top);
          for (int64_t x = std::max(t, count); x < t + kLanes; x++) e[x - t] = 0.0f;  // the padding keys
          Store(pi + t, e);
          sum += e;
        }
        total[i] = total[i] * shrink + Sum(sum);
        top[i] = new_top;
        if (shrink != 1.0f)
          for (int64_t d = 0; d < D; d++) acc[i * D + d] *= shrink;
      }
      Values(group, v + base, count, p, acc);
    }
    float* o = out + (r * heads + j * group) * D;
    for (int64_t i = 0; i < group; i++)
      for (int64_t d = 0; d < D; d++) o[i * D + d] = acc[i * D + d] / total[i];
  }
};

template <typename T>
void Run(ffi::ThreadPool& threads, const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache, int32_t layer,
         const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::S32>& tables, const ffi::Buffer<ffi::S32>& keys,
         float* out) {
  auto dims = k_cache.dimensions();
  auto qd = q.dimensions();
  const Attend<T> attend{static_cast<const T*>(k_cache.untyped_data()), static_cast<const T*>(v_cache.untyped_data()),
                         dims[1], dims[2], dims[3], dims[4], layer, q.typed_data(), tables.typed_data(),
                         keys.typed_data(), tables.dimensions()[1], qd[1], dims[0], out};
  const int64_t kv_heads = dims[0];
  // a pair reads its row's keys and values: the rows' mean count of them, for the split among threads
  int64_t positions = 0;
  for (int64_t r = 0; r < qd[0]; r++) positions += attend.Keys(r);
  const int64_t bytes = 2 * positions / std::max<int64_t>(1, qd[0]) * dims[4] * sizeof(T);
  gdn_jax::ParallelFor(threads, qd[0] * kv_heads, bytes, [attend, kv_heads](int64_t i) {
    attend.Pair(i / kv_heads, i % kv_heads);
  });
}

ffi::Error AttentionDecode(ffi::ThreadPool threads, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> keys, ffi::ResultBuffer<ffi::F32> out) {
  auto dims = k_cache.dimensions();
  auto qd = q.dimensions();
  if (dims.size() != 5 || v_cache.dimensions().size() != 5 || k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("attention_decode: caches must be [kv_heads, layers, blocks, block, D], alike");
  if (qd.size() != 3 || qd[2] != dims[4] || dims[4] > kMaxDim ||
      qd[1] % dims[0] || qd[1] / dims[0] > kMaxGroup)
    return ffi::Error::InvalidArgument("attention_decode: shapes outside the kernel's limits");
  const int32_t at = layer.typed_data()[0];
  if (k_cache.element_type() == ffi::DataType::U16)
    Run<uint16_t>(threads, k_cache, v_cache, at, q, tables, keys, out->typed_data());
  else if (k_cache.element_type() == ffi::DataType::F32)
    Run<float>(threads, k_cache, v_cache, at, q, tables, keys, out->typed_data());
  else
    return ffi::Error::InvalidArgument("attention_decode: caches must be uint16 (bfloat16 bits) or float32");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnJaxAttentionDecode, AttentionDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // keys
                                  .Ret<ffi::Buffer<ffi::F32>>());  // o
