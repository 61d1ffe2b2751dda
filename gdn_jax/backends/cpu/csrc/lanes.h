// Vectors of 16 float32 lanes for the CPU kernels of gdn_jax/csrc/ (GCC and Clang vector extensions: one AVX-512
// register, or two AVX ones, ...), and what the kernels do with them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace gdn_jax {

constexpr int64_t kLanes = 16;  // float32 lanes of a vector

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bits) {  // bfloat16 bits -> float32, exact
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof x);
  return x;
}

inline Lanes Load(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void Store(float* p, Lanes x) { std::memcpy(p, &x, sizeof x); }
inline Lanes Splat(float x) { return Lanes{} + x; }

inline float Sum(Lanes x) {  // halves added pairwise: a short chain of additions
  Half lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  lo += hi;
  float s[kLanes / 2];
  std::memcpy(s, &lo, sizeof s);
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

inline float Max(Lanes x) {
  float s[kLanes];
  std::memcpy(s, &x, sizeof s);
  return *std::max_element(s, s + kLanes);
}

// Lanes l and l + s of a and b: the blocks of s lanes at even places of the result come from a, at odd places from
// b; each is the sum of two neighbouring blocks of its source.
template <int s>
inline Lanes Fold(Lanes a, Lanes b) {
#define GDN_LANE(i) ((((i) / s) % 2) * kLanes + 2 * ((i) / s / 2) * s + (i) % s)
#define GDN_LANES(d)                                                                                             \
  GDN_LANE(0) + d, GDN_LANE(1) + d, GDN_LANE(2) + d, GDN_LANE(3) + d, GDN_LANE(4) + d, GDN_LANE(5) + d,          \
      GDN_LANE(6) + d, GDN_LANE(7) + d, GDN_LANE(8) + d, GDN_LANE(9) + d, GDN_LANE(10) + d, GDN_LANE(11) + d,    \
      GDN_LANE(12) + d, GDN_LANE(13) + d, GDN_LANE(14) + d, GDN_LANE(15) + d
  return __builtin_shufflevector(a, b, GDN_LANES(0)) + __builtin_shufflevector(a, b, GDN_LANES(s));
#undef GDN_LANES
#undef GDN_LANE
}

// The lane sums of 16 vectors as one: lane i holds the sum of x[i]'s lanes (four levels of Fold; the level that
// decides bit b of x's index puts it in bit 3 - b of the lane's, so x goes in at bit-reversed places). Every sum is
// added in the same order, whichever lane it ends in.
inline Lanes Sums(const Lanes* x) {
  static constexpr int kReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  Lanes a[8], b[4], c[2];
  for (int i = 0; i < 8; i++) a[i] = Fold<8>(x[kReversed[2 * i]], x[kReversed[2 * i + 1]]);
  for (int i = 0; i < 4; i++) b[i] = Fold<4>(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; i++) c[i] = Fold<2>(b[2 * i], b[2 * i + 1]);
  return Fold<1>(c[0], c[1]);
}

inline Lanes Load(const uint16_t* p) {  // 16 bfloat16 bit patterns -> float32
  typedef uint16_t Bits __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Bits b;
  std::memcpy(&b, p, sizeof b);
  return reinterpret_cast<Lanes>(__builtin_convertvector(b, Words) << 16);
}

}  // namespace gdn_jax
