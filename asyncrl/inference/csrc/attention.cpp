// Attention and RMSNorm kernels for the compact model, loaded through ctypes (see kernels.py).
//
// Why hand-written: a decode step attends each sequence's one new query to its own cached keys,
// i.e. n * kv_heads tiny [rep x hd] @ [hd x t] products. Batched BLAS calls spend most of their
// time in per-matrix overhead on these shapes, and the torch path needs separate passes for RoPE,
// the cache write, the mask and the softmax. Here one pass per (row, kv head) does all of it,
// reading only that row's own positions; a prefill is the same computation with one row per
// prompt token. RMSNorm is here because torch's CPU rms_norm runs as about eight separate ops.
//
// All arithmetic is fp32 (bf16 tensors are widened on load and rounded once on store). Plain C
// ABI with raw pointers: no torch headers, so a cold build takes seconds, not a minute.

#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace asyncrl;

// HF rotate_half RoPE: out[d] = x[d] cos[d] + x[d +- hd/2] sin[d], with the sign folded into sin
// (sin = [-sin, sin]), as in decoder.py.
template <typename T>
inline void rope(const T* x, const float* cos, const float* sin, float* out, int hd) {
  int half = hd / 2;
  for (int d = 0; d < half; ++d) out[d] = load(x[d]) * cos[d] + load(x[d + half]) * sin[d];
  for (int d = half; d < hd; ++d) out[d] = load(x[d]) * cos[d] + load(x[d - half]) * sin[d];
}

// RoPE the row's new k for kv head g and store k and v at the row's position of its slot.
template <typename T, int NC>
void store_kv(const T* qkv, T* cache_k, T* cache_v, const float* cos, const float* sin,
              const AttnArgs& a, int64_t row, int64_t g) {
  constexpr int hd = NC * 16;
  const int64_t pos = a.positions[row];
  const int64_t off = ((a.slot(row) * a.kv_heads + g) * a.max_len + pos) * hd;
  const T* src = qkv + row * a.row_stride + (a.heads + g) * hd;
  float k[hd];
  rope(src, cos + pos * hd, sin + pos * hd, k, hd);
  for (int d = 0; d < hd; ++d) store(cache_k + off + d, k[d]);
  memcpy(cache_v + off, src + a.kv_heads * hd, sizeof(T) * hd);
}

// The query heads of kv head g in one row attend to positions [0, pos] of the row's slot (the
// last `window` of them when the layer has a sliding window).
// NC = head_dim / 16 is a template parameter so a query row and an output row each live in NC
// vector registers.
template <typename T, int NC>
void attend(const T* qkv, const T* cache_k, const T* cache_v, const float* cos, const float* sin,
            T* out, const AttnArgs& a, int64_t row, int64_t g, std::vector<float>& buf) {
  constexpr int hd = NC * 16;
  const int64_t rep = a.heads / a.kv_heads, pos = a.positions[row];
  const int64_t first = a.window > 0 && pos >= a.window ? pos - a.window + 1 : 0;
  const int64_t t = pos + 1 - first;
  const int64_t off = ((a.slot(row) * a.kv_heads + g) * a.max_len + first) * hd;
  const T* kc = cache_k + off;
  const T* vc = cache_v + off;
  buf.resize(t);
  float* p = buf.data();
  for (int64_t r = 0; r < rep; ++r) {
    const int64_t head = g * rep + r;
    float q[hd];
    rope(qkv + row * a.row_stride + head * hd, cos + pos * hd, sin + pos * hd, q, hd);
    V16 qv[NC];
    for (int k = 0; k < NC; ++k) qv[k] = load16(q + 16 * k) * a.scale;
    for (int64_t j = 0; j < t; ++j) {
      const T* kj = kc + j * hd;
      V16 dot = qv[0] * load16(kj);
      for (int k = 1; k < NC; ++k) dot += qv[k] * load16(kj + 16 * k);
      p[j] = hsum(dot);
    }
    softmax(p, t);
    V16 acc[NC] = {};
    for (int64_t j = 0; j < t; ++j) {
      const T* vj = vc + j * hd;
      for (int k = 0; k < NC; ++k) acc[k] += p[j] * load16(vj + 16 * k);
    }
    T* o = out + row * a.heads * hd + head * hd;
    for (int k = 0; k < NC; ++k)
      for (int e = 0; e < 16; ++e) store(o + 16 * k + e, acc[k][e]);
  }
}

// Every row's k, v go into the cache first (a prefill row attends to the rows before it), then
// each (row, kv head) attends, reading only its own slot's positions.
template <typename T, int NC>
void attention_nc(const T* qkv, T* cache_k, T* cache_v, const float* cos, const float* sin,
                  T* out, const AttnArgs& a) {
  const int64_t tasks = a.rows * a.kv_heads;
#pragma omp for schedule(static)
  for (int64_t task = 0; task < tasks; ++task)
    store_kv<T, NC>(qkv, cache_k, cache_v, cos, sin, a, task / a.kv_heads, task % a.kv_heads);
  std::vector<float> buf;
  // Dynamic: rows differ in length, and a shared core may stall one thread.
#pragma omp for schedule(dynamic, 4)
  for (int64_t task = 0; task < tasks; ++task)
    attend<T, NC>(qkv, cache_k, cache_v, cos, sin, out, a, task / a.kv_heads, task % a.kv_heads,
                  buf);
}

}  // namespace

namespace asyncrl {

bool attention_supports(int64_t hd) {
  return hd == 32 || hd == 64 || hd == 96 || hd == 128 || hd == 256;
}

template <typename T>
void attention_phase(const T* qkv, T* k, T* v, const float* cos, const float* sin, T* out,
                     int64_t hd, const AttnArgs& a) {
  switch (hd) {  // callers check attention_supports first
    case 32: attention_nc<T, 2>(qkv, k, v, cos, sin, out, a); break;
    case 64: attention_nc<T, 4>(qkv, k, v, cos, sin, out, a); break;
    case 96: attention_nc<T, 6>(qkv, k, v, cos, sin, out, a); break;
    case 128: attention_nc<T, 8>(qkv, k, v, cos, sin, out, a); break;
    case 256: attention_nc<T, 16>(qkv, k, v, cos, sin, out, a); break;
    default: break;
  }
}

// HF Qwen2/Llama RMSNorm: w * (x * rsqrt(mean(x^2) + eps)), statistics in fp32.
template <typename T>
void rms_norm_phase(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x + i * dim;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < dim; ++d) ss += load(xi[d]) * load(xi[d]);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    T* oi = out + i * dim;
    for (int64_t d = 0; d < dim; ++d) {
      T normed;
      store(&normed, load(xi[d]) * inv);  // HF rounds to the model dtype before the weight
      store(oi + d, load(w[d]) * load(normed));
    }
  }
}

template void attention_phase(const float*, float*, float*, const float*, const float*, float*,
                              int64_t, const AttnArgs&);
template void attention_phase(const Bf16*, Bf16*, Bf16*, const float*, const float*, Bf16*,
                              int64_t, const AttnArgs&);
template void rms_norm_phase(const float*, const float*, float*, int64_t, int64_t, float);
template void rms_norm_phase(const Bf16*, const Bf16*, Bf16*, int64_t, int64_t, float);

}  // namespace asyncrl

extern "C" {

int asyncrl_kernels_abi() { return 3; }

// qkv [rows, row_stride] holds each row's q, k, v heads; k, v are one layer's caches
// [slots, kv_heads, max_len, hd]; cos, sin fp32 [max_pos, hd]; out [rows, heads * hd]; scale
// multiplies the queries; window > 0: each row attends to its last `window` positions only.
// Returns -1 for an unsupported head_dim.
#define ASYNCRL_ATTENTION(NAME, T)                                                              \
  int NAME(const T* qkv, T* k, T* v, const float* cos, const float* sin, const int64_t* slots, \
           const int64_t* positions, T* out, int64_t rows, int64_t heads, int64_t kv_heads,    \
           int64_t hd, int64_t max_len, int64_t row_stride, float scale, int64_t window,       \
           int nthreads) {                                                                     \
    if (!attention_supports(hd)) return -1;                                                    \
    AttnArgs a{rows, heads, kv_heads, max_len, row_stride, slots, positions, scale, window};   \
    _Pragma("omp parallel num_threads(nthreads)")                                              \
    attention_phase(qkv, k, v, cos, sin, out, hd, a);                                          \
    return 0;                                                                                  \
  }
ASYNCRL_ATTENTION(attention_f32, float)
ASYNCRL_ATTENTION(attention_bf16, Bf16)

// Each thread's share must be worth a fork: about 64 rows of a 256-wide model.
#define ASYNCRL_RMS_NORM(NAME, T)                                                          \
  void NAME(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps,         \
            int nthreads) {                                                               \
    _Pragma("omp parallel num_threads(rows * dim >= (1 << 15) ? nthreads : 1)")          \
    rms_norm_phase(x, w, out, rows, dim, eps);                                            \
  }
ASYNCRL_RMS_NORM(rms_norm_f32, float)
ASYNCRL_RMS_NORM(rms_norm_bf16, Bf16)

}  // extern "C"
