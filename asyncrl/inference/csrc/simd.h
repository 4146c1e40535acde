// Shared helpers of the CPU kernels: GCC vector types, bf16 conversion, a vectorizable exp.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace asyncrl {

// GCC vector extensions: 16 floats, lowered to whatever the target has (one AVX-512 register, two
// AVX2 ones, ...). aligned(4) lets these types load from any float address.
typedef float V16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t U16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t W16 __attribute__((vector_size(64), aligned(4)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

struct Bf16 {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(Bf16 x) {
  uint32_t u = (uint32_t)x.bits << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(Bf16* p, float x) {  // round to nearest even, like torch's conversion
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p->bits = 0x7fc0;  // NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p->bits = (uint16_t)(u >> 16);
}

inline V16 load16(const float* p) { return *(const V16*)p; }
inline V16 load16(const Bf16* p) {
  W16 wide = __builtin_convertvector(*(const U16*)p, W16) << 16;
  return (V16)wide;
}

// Tree sum of the lanes (memcpy halves, not __builtin_shufflevector, which needs GCC >= 12).
inline float hsum(V16 v) {
  V8 lo, hi;
  memcpy(&lo, &v, sizeof lo);
  memcpy(&hi, (const char*)&v + sizeof lo, sizeof hi);
  lo += hi;
  V4 a, b;
  memcpy(&a, &lo, sizeof a);
  memcpy(&b, (const char*)&lo + sizeof a, sizeof b);
  a += b;
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// Cephes expf (about 1 ulp; inputs here are <= 0), generic over float and V16 so the softmax
// runs 16 lanes at a time. Rounding by the 1.5 * 2^23 trick instead of floorf keeps it plain
// arithmetic (no -ffast-math, which could also reorder the sums this code relies on).
template <typename F>
inline F exp_le0(F x) {
  x = x < -87.0f ? F{} - 87.0f : x;
  F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  F y = p * r * r + r + 1.0f;
  if constexpr (sizeof(F) == sizeof(float)) {
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
  } else {
    I16 bits = (__builtin_convertvector(n, I16) + 127) << 23;
    return y * (V16)bits;
  }
}

// In place: p[0:t] -> softmax(p[0:t]).
inline void softmax(float* p, int64_t t) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < t; ++j) mx = p[j] > mx ? p[j] : mx;
  V16 vsum = {};
  int64_t j = 0;
  for (; j + 16 <= t; j += 16) {
    V16 e = exp_le0(load16(p + j) - mx);
    *(V16*)(p + j) = e;
    vsum += e;
  }
  float sum = hsum(vsum);
  for (; j < t; ++j) {
    p[j] = exp_le0(p[j] - mx);
    sum += p[j];
  }
  float inv = 1.0f / sum;
  for (j = 0; j < t; ++j) p[j] *= inv;
}

// x * sigmoid(x) from one exp of -|x| (no overflow for any x).
inline V16 silu(V16 x) {
  V16 e = exp_le0(x < 0 ? x : -x);
  V16 num = x < 0 ? e : V16{} + 1.0f;
  return x * num / (e + 1.0f);
}

}  // namespace asyncrl
