// The gated delta rule over every token of a prefill step, token by token, on the CPU: the kernel behind
// gdn_jax.model.GatedDeltaNet for steps of more than one token (gdn_jax/cpu_kernels.py builds and registers it).
// XLA's form of the rule is the chunked one (gdn_jax/gated_delta.py): per chunk, a few small products, a blocked
// triangular inversion and the state's recurrence, one library call or loop of a few microseconds after the other.
// Here each (row, head) state stays in the core's cache for the whole row, and one pass over it per token both
// updates it and takes its products with the next token's key and query:
//   e = exp(g_t), delta_t = beta_t (v_t - e S^T k_t), o_t = e S^T q_t + (k_t . q_t) delta_t, S <- e S + k_t delta_t^T
// (the update and the output of gdn_decode.cc, its products summed in the same order). The (row, head) pairs are
// shared among XLA's CPU threads (parallel.h). A state after a given number of a row's tokens is copied out on the
// way (the checkpoints a prefill step saves).
//
// q, k [B, T, Hk, D], v [B, T, H, D] (dk = dv = D; value head h reads key head h / (H / Hk)), g, beta [B, T, H],
// s0 [B, H, D, D]: float32; lengths [B] (tokens at
// t >= lengths[b] are padding: outputs 0, the state left as after the last real token); save_rows, save_counts [S]
// (save s: the state of row save_rows[s] after its first save_counts[s] tokens, clamped to [0, lengths]).
// Results: o [B, T, H, D], the final states [B, H, D, D], the saved states [S, H, D, D].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lanes.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace gdn_jax;  // lanes.h

constexpr int64_t kMaxDim = 256;
// Columns of a state per item where the head dimension is a larger multiple of it (256). Whole states ran faster than
// blocks of them at D = 128 (64 KiB; blocks of 64 columns: 1.2x the time, of 32: 1.7x): each block repeats a token's
// scalar work and reads its key and query again.
constexpr int64_t kBlock = 128;

struct Rule {
  const float *q, *k, *v, *g, *beta, *s0;
  const int32_t *lengths, *save_rows, *save_counts;
  int64_t rows, tokens, heads, key_heads, dim, saves;
  float *out, *final_state, *saved;

  // One pass over a block of the state's columns, S [D, W] with rows `stride` apart: S <- e S + k delta^T, row by
  // row, and (if next_k) the new block's products with the next token's key and query, sk[j] = sum_i next_k[i]
  // S[i, j], sq likewise, accumulated in the order of i. V = W / 16 is a constant, so the accumulators stay in
  // registers.
  template <int V>
  static void Pass(int64_t D, int64_t stride, float* S, float e, const float* k, const float* delta,
                   const float* next_k, const float* next_q, float* sk, float* sq) {
    Lanes d[V], ak[V], aq[V];
    for (int c = 0; c < V; c++) {
      d[c] = Load(delta + kLanes * c);
      ak[c] = aq[c] = Splat(0.0f);
    }
    const Lanes e16 = Splat(e);
    for (int64_t i = 0; i < D; i++) {
      float* row = S + i * stride;
      const Lanes ki = Splat(k[i]);
      if (next_k) {
        const Lanes nk = Splat(next_k[i]), nq = Splat(next_q[i]);
        for (int c = 0; c < V; c++) {
          const Lanes s = e16 * Load(row + kLanes * c) + ki * d[c];
          Store(row + kLanes * c, s);
          ak[c] += nk * s;
          aq[c] += nq * s;
        }
      } else {
        for (int c = 0; c < V; c++) Store(row + kLanes * c, e16 * Load(row + kLanes * c) + ki * d[c]);
      }
    }
    if (next_k)
      for (int c = 0; c < V; c++) {
        Store(sk + kLanes * c, ak[c]);
        Store(sq + kLanes * c, aq[c]);
      }
  }

  // The same for any block width W.
  static void PassAny(int64_t D, int64_t W, int64_t stride, float* S, float e, const float* k, const float* delta,
                      const float* next_k, const float* next_q, float* sk, float* sq) {
    if (next_k) {
      std::fill(sk, sk + W, 0.0f);
      std::fill(sq, sq + W, 0.0f);
    }
    for (int64_t i = 0; i < D; i++) {
      float* row = S + i * stride;
      for (int64_t j = 0; j < W; j++) {
        const float s = e * row[j] + k[i] * delta[j];
        row[j] = s;
        if (next_k) {
          sk[j] += next_k[i] * s;
          sq[j] += next_q[i] * s;
        }
      }
    }
  }

  int64_t Width() const { return dim % kBlock == 0 ? kBlock : dim; }  // columns of the state per item

  // Row r, head h, the block of the state's columns from c0: each column of the state evolves on its own (the
  // products sum over the rows), so a block runs through every token by itself, its part of the state in the
  // core's cache.
  void Block(int64_t r, int64_t h, int64_t c0) const {
    const int64_t D = dim, H = heads, T = tokens, W = Width();
    const size_t size = static_cast<size_t>(D) * D;
    const int64_t n = std::clamp<int64_t>(lengths[r], 0, T);
    float* S = final_state + (static_cast<size_t>(r) * H + h) * size + c0;
    const float* S0 = s0 + (static_cast<size_t>(r) * H + h) * size + c0;
    for (int64_t i = 0; i < D; i++) std::memcpy(S + i * D, S0 + i * D, W * sizeof(float));
    // this row's saves, by the number of tokens before them
    std::vector<std::pair<int64_t, int64_t>> mine;
    for (int64_t s = 0; s < saves; s++)
      if (std::clamp<int64_t>(save_rows[s], 0, rows - 1) == r)
        mine.emplace_back(std::clamp<int64_t>(save_counts[s], 0, n), s);
    std::sort(mine.begin(), mine.end());
    size_t next_save = 0;
    auto save_at = [&](int64_t t) {
      for (; next_save < mine.size() && mine[next_save].first == t; next_save++) {
        float* to = saved + (static_cast<size_t>(mine[next_save].second) * H + h) * size + c0;
        for (int64_t i = 0; i < D; i++) std::memcpy(to + i * D, S + i * D, W * sizeof(float));
      }
    };
    const size_t step = static_cast<size_t>(H) * D;  // one token's stride in v and o
    const size_t key_step = static_cast<size_t>(key_heads) * D;  // in q and k
    const size_t at = (static_cast<size_t>(r) * T * H + h) * D;
    const size_t key_at = (static_cast<size_t>(r) * T * key_heads + h / (H / key_heads)) * D;
    const float *qq = q + key_at, *kk = k + key_at, *vv = v + at + c0;
    const float *gg = g + static_cast<size_t>(r) * T * H + h, *bb = beta + static_cast<size_t>(r) * T * H + h;
    float* o = out + at + c0;
    alignas(64) float sk[kMaxDim], sq[kMaxDim], delta[kMaxDim];
    if (n > 0) {  // the entering state's products with the first token's key and query
      std::fill(sk, sk + W, 0.0f);
      std::fill(sq, sq + W, 0.0f);
      for (int64_t i = 0; i < D; i++) {
        const float* row = S + i * D;
        for (int64_t j = 0; j < W; j++) {
          sk[j] += kk[i] * row[j];
          sq[j] += qq[i] * row[j];
        }
      }
    }
    for (int64_t t = 0; t < n; t++) {
      save_at(t);
      const float *kt = kk + t * key_step, *qt = qq + t * key_step, *vt = vv + t * step;
      const float e = std::exp(gg[t * H]), b = bb[t * H];
      float kq = 0.0f;
      for (int64_t i = 0; i < D; i++) kq += kt[i] * qt[i];
      float* ot = o + t * step;
      for (int64_t j = 0; j < W; j++) {
        delta[j] = (vt[j] - e * sk[j]) * b;
        ot[j] = e * sq[j] + kq * delta[j];
      }
      const float *nk = t + 1 < n ? kt + key_step : nullptr, *nq = t + 1 < n ? qt + key_step : nullptr;
      if (W == 8 * kLanes) Pass<8>(D, D, S, e, kt, delta, nk, nq, sk, sq);
      else if (W == 4 * kLanes) Pass<4>(D, D, S, e, kt, delta, nk, nq, sk, sq);
      else if (W == 2 * kLanes) Pass<2>(D, D, S, e, kt, delta, nk, nq, sk, sq);
      else PassAny(D, W, D, S, e, kt, delta, nk, nq, sk, sq);
    }
    save_at(n);
    for (int64_t t = n; t < T; t++) std::fill(o + t * step, o + t * step + W, 0.0f);
  }
};

ffi::Error GdnPrefill(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                      ffi::Buffer<ffi::F32> s0, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> save_rows,
                      ffi::Buffer<ffi::S32> save_counts, ffi::ResultBuffer<ffi::F32> out,
                      ffi::ResultBuffer<ffi::F32> final_state, ffi::ResultBuffer<ffi::F32> saved) {
  auto dims = v.dimensions(), kd = k.dimensions();
  const bool alike = std::equal(kd.begin(), kd.end(), q.dimensions().begin(), q.dimensions().end());
  if (dims.size() != 4 || dims[3] > kMaxDim || !alike || kd.size() != 4 || kd[0] != dims[0] || kd[1] != dims[1] ||
      kd[3] != dims[3] || kd[2] == 0 || dims[2] % kd[2] != 0)
    return ffi::Error::InvalidArgument("gdn_prefill: q, k [B, T, Hk, D] and v [B, T, H, D] with Hk dividing H, "
                                       "D <= 256, expected");
  const int64_t B = dims[0], T = dims[1], H = dims[2], Hk = kd[2], D = dims[3];
  auto sd = s0.dimensions();
  if (sd.size() != 4 || sd[0] != B || sd[1] != H || sd[2] != D || sd[3] != D || g.element_count() != B * T * H ||
      beta.element_count() != B * T * H || lengths.element_count() != B ||
      save_rows.element_count() != save_counts.element_count())
    return ffi::Error::InvalidArgument("gdn_prefill: s0 [B, H, D, D], g, beta [B, T, H], lengths [B] expected");
  const int64_t S = save_rows.element_count();
  if (B == 0) {
    std::fill(saved->typed_data(), saved->typed_data() + saved->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  const Rule rule{q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), beta.typed_data(),
                  s0.typed_data(), lengths.typed_data(), save_rows.typed_data(), save_counts.typed_data(),
                  B, T, H, Hk, D, S, out->typed_data(), final_state->typed_data(), saved->typed_data()};
  const int64_t W = rule.Width(), blocks = D / W;
  const int64_t bytes = T * D * W * sizeof(float);  // a pass over the block per token
  ParallelFor(threads, B * H * blocks, bytes,
              [rule, H, W, blocks](int64_t i) { rule.Block(i / blocks / H, i / blocks % H, i % blocks * W); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnJaxGdnPrefill, GdnPrefill,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g
                                  .Arg<ffi::Buffer<ffi::F32>>()   // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()   // s0
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // save_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()   // save_counts
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // final states
                                  .Ret<ffi::Buffer<ffi::F32>>());  // saved states
