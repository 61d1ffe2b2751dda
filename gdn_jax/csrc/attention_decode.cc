// Decode attention: one query token per row against that row's keys and values where they lie in the paged caches,
// the CPU kernel behind gdn_jax.model.Attention for one-token steps (gdn_jax/cpu_kernels.py builds and registers it).
// XLA's form gathers each chunk of a row's blocks into a contiguous copy before its two products; here each key and
// value row is read once, in place, converted to float32 (bfloat16 caches are stored as their uint16 bit patterns,
// gdn_jax.model.pool_dtype), and used by all the query heads that share its KV head, while the next block's rows are
// prefetched. (row, KV head) pairs are shared among XLA's CPU threads (parallel.h).
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

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 16;   // query heads per KV head
constexpr int64_t kMaxKeys = 64;    // keys at a time (of one block)
constexpr int64_t kMaxDim = 256;    // head dimension
constexpr int64_t kLanes = 16;      // float32 lanes of a vector (one AVX-512 register)

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bits) {  // bfloat16 bits -> float32, exact
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof x);
  return x;
}

// 16 float32 lanes in registers (GCC and Clang vector extensions: one AVX-512 register, or two AVX ones, ...).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));

inline Lanes Load(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline float Sum(Lanes x) {  // halves added pairwise: a short chain of additions
  Half lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  lo += hi;
  float s[kLanes / 2];
  std::memcpy(s, &lo, sizeof s);
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

inline float Dot(const float* a, const float* b, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += Load(a + i) * Load(b + i);
  float sum = Sum(acc);
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

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

  void Pair(int64_t r, int64_t j) const {
    const int64_t D = dim, group = heads / kv_heads;
    const float* qq = q + (r * heads + j * group) * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t n = Keys(r);
    float top[kMaxGroup], total[kMaxGroup], p[kMaxGroup * kMaxKeys];
    alignas(64) float acc[kMaxGroup * kMaxDim], row[kMaxKeys * kMaxDim];
    std::fill(top, top + group, -std::numeric_limits<float>::infinity());
    std::fill(total, total + group, 0.0f);
    std::fill(acc, acc + group * D, 0.0f);
    for (int64_t at = 0; at < n;) {  // keys [at, at + count)
      const int64_t count = Count(at, n);
      const size_t base = Offset(r, j, at);
      const T *kb = k + base, *vb = v + base;
      at += count;
      if (at < n) {  // the next keys and values on their way from memory while these are used (another block)
        const size_t from = Offset(r, j, at);
        const char *nk = reinterpret_cast<const char*>(k + from), *nv = reinterpret_cast<const char*>(v + from);
        for (size_t b = 0; b < Count(at, n) * D * sizeof(T); b += 64) {
          __builtin_prefetch(nk + b);
          __builtin_prefetch(nv + b);
        }
      }
      for (int64_t x = 0; x < count * D; x++) row[x] = ToFloat(kb[x]);
      for (int64_t t = 0; t < count; t++)
        for (int64_t i = 0; i < group; i++) p[i * kMaxKeys + t] = Dot(qq + i * D, row + t * D, D) * scale;
      for (int64_t i = 0; i < group; i++) {
        float* pi = p + i * kMaxKeys;
        const float new_top = std::max(top[i], *std::max_element(pi, pi + count));
        const float shrink = std::exp(top[i] - new_top);  // 0 at the first block
        float sum = 0.0f;
        for (int64_t t = 0; t < count; t++) sum += (pi[t] = std::exp(pi[t] - new_top));
        total[i] = total[i] * shrink + sum;
        top[i] = new_top;
        if (shrink != 1.0f)
          for (int64_t d = 0; d < D; d++) acc[i * D + d] *= shrink;
      }
      for (int64_t x = 0; x < count * D; x++) row[x] = ToFloat(vb[x]);
      for (int64_t t = 0; t < count; t++)
        for (int64_t i = 0; i < group; i++) {
          const float w = p[i * kMaxKeys + t];
          float* a = acc + i * D;
          const float* value = row + t * D;
          for (int64_t d = 0; d < D; d++) a[d] += w * value[d];
        }
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
