// The kernels' work-sharing phases, shared by the per-op entry points and the fused decode step.
//
// Each phase is one or more `omp for` loops without an enclosing `omp parallel`: called inside a
// parallel region it splits its work among that region's threads and ends on the loop's barrier,
// so a whole decode step can run in one region; called outside one it runs serially.
#pragma once

#include <stdint.h>

namespace asyncrl {

struct AttnArgs {
  int64_t rows, heads, kv_heads, max_len, row_stride;
  const int64_t* slots;      // cache slot of each row; nullptr: row i is slot i
  const int64_t* positions;  // position of each row's token
  float scale;
  int64_t window;  // > 0: a row attends to its last `window` positions only
  int64_t slot(int64_t row) const { return slots ? slots[row] : row; }
};

enum Epilogue { kStore = 0, kAddResidual = 1, kSiluMul = 2 };

struct Gemm {
  const float* a;
  int64_t lda;
  const float* packed;  // weights in panels of 32 output columns (see gemm.cpp)
  const float* bias;    // padded to the panel count * 32, or nullptr
  float* c;
  int64_t ldc;
  const float* res;  // kAddResidual only; may alias c
  int64_t ldr, m, n, k;
};

bool attention_supports(int64_t head_dim);

// Writes each row's RoPE'd k and v to the cache, then attends (see attention.cpp).
template <typename T>
void attention_phase(const T* qkv, T* cache_k, T* cache_v, const float* cos, const float* sin,
                     T* out, int64_t head_dim, const AttnArgs& a);

template <typename T>
void rms_norm_phase(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps);

void gemm_phase(const Gemm& g, int epilogue);

}  // namespace asyncrl
