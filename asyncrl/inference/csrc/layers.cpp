// A whole fp32 decode forward (layers, final norm, LM head) in one call and one parallel region.
//
// Why: a batch-64 decode step of the 6M-parameter model is about 60 kernel calls of 10-150 us.
// Called one by one from Python, each pays a ctypes call and a fork/join while the other thread
// waits; here the phases of all layers follow each other inside one region, separated only by
// the barriers at the end of each phase's `omp for`. The phases are the same code the per-op
// entry points run, so both paths compute identical results.

#include "ops.h"
#include "simd.h"

using namespace asyncrl;

extern "C" {

// One decoder layer's weights: norms as stored, matrices packed as in gemm.cpp.
struct LayerWeights {
  const float* ln1;
  const float* qkv;
  const float* qkv_bias;  // padded, or nullptr
  const float* o;
  const float* ln2;
  const float* gate_up;
  const float* down;
};

struct ModelDims {
  int64_t num_layers, dim, qkv_n, inter, heads, kv_heads, head_dim, max_len;
  int64_t layer_stride;  // cache elements from layer l's k to layer l + 1's k
  int64_t kv_stride;     // cache elements from a layer's k to its v
  float eps;
  const float* cos;  // fp32 [max_pos, head_dim], sin sign-folded as in decoder.py
  const float* sin;
};

// x [rows, dim] holds the embeddings (it is overwritten); logits [rows, vocab] receives the LM
// head's output. Row r's token sits at positions[r] of cache slot slots[r] (slots == nullptr:
// slot r) and attends to the positions before it. scratch holds
// rows * (dim + qkv_n + heads * head_dim + inter) floats. Returns -1 for an unsupported head_dim.
int forward_f32(const LayerWeights* layers, const ModelDims* d, const float* final_norm,
                const float* lm_head, int64_t vocab, float* x, int64_t rows, float* cache,
                const int64_t* slots, const int64_t* positions, float* scratch, float* logits,
                int nthreads) {
  if (!attention_supports(d->head_dim)) return -1;
  const int64_t q_dim = d->heads * d->head_dim;
  float* h = scratch;
  float* qkv = h + rows * d->dim;
  float* attn = qkv + rows * d->qkv_n;
  float* act = attn + rows * q_dim;
  const AttnArgs args{rows,  d->heads, d->kv_heads, d->max_len, d->qkv_n,
                      slots, positions, 1.0f / sqrtf((float)d->head_dim), 0};
#pragma omp parallel num_threads(nthreads)
  {
    for (int64_t l = 0; l < d->num_layers; ++l) {
      const LayerWeights& w = layers[l];
      float* k = cache + l * d->layer_stride;
      rms_norm_phase(x, w.ln1, h, rows, d->dim, d->eps);
      gemm_phase(
          {h, d->dim, w.qkv, w.qkv_bias, qkv, d->qkv_n, nullptr, 0, rows, d->qkv_n, d->dim},
          kStore);
      attention_phase(qkv, k, k + d->kv_stride, d->cos, d->sin, attn, d->head_dim, args);
      gemm_phase({attn, q_dim, w.o, nullptr, x, d->dim, x, d->dim, rows, d->dim, q_dim},
                 kAddResidual);
      rms_norm_phase(x, w.ln2, h, rows, d->dim, d->eps);
      gemm_phase({h, d->dim, w.gate_up, nullptr, act, d->inter, nullptr, 0, rows, 2 * d->inter,
                  d->dim},
                 kSiluMul);
      gemm_phase({act, d->inter, w.down, nullptr, x, d->dim, x, d->dim, rows, d->dim, d->inter},
                 kAddResidual);
    }
    rms_norm_phase(x, final_norm, h, rows, d->dim, d->eps);
    gemm_phase({h, d->dim, lm_head, nullptr, logits, vocab, nullptr, 0, rows, vocab, d->dim},
               kStore);
  }
  return 0;
}

}  // extern "C"
