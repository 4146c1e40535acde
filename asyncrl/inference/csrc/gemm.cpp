// fp32 matmuls against prepacked weights with fused epilogues, for the compact model's layers.
//
// Why hand-written: at decode shapes (64 rows, K = 256..768) oneDNN's packed path runs at about
// 85% of the speed of a large square matmul on the same machine and costs ~14 us of setup per
// call; this register-blocked kernel matches the large matmul with ~4 us per call, and fuses what
// follows each matmul (bias, residual add, SiLU(gate) * up).
//
// Layout: weights W [N, K] (torch Linear) are packed once into panels of 32 output columns,
// packed[p][k][j] = W[32 p + j][k], zero-padded past N, so the inner loop streams one contiguous
// 32-float row of B per k. The gate/up pair is packed as panels of 16 gate + 16 up columns, so a
// tile holds both halves of its 16 outputs and SiLU(gate) * up needs no second pass.

#include "ops.h"
#include "simd.h"

namespace {

using namespace asyncrl;

constexpr int kPanel = 32;     // output columns per packed panel (two vectors)
constexpr int kRowBlock = 64;  // rows per task: A's block stays in L2 across all panels
// Rows per register tile: 8 rows x 2 vectors = 16 of AVX-512's 32 registers. With 16 narrower
// registers (AVX2, NEON) a tile must be smaller; those builds keep oneDNN (see gemm_preferred).
#ifdef __AVX512F__
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 2;
#endif

// MR rows x one panel. The MR * 2 accumulators stay in registers for the whole K loop.
template <int MR, int EPI>
void tile(const Gemm& g, int64_t row, int64_t p) {
  const float* a = g.a + row * g.lda;
  const float* b = g.packed + p * g.k * kPanel;
  V16 acc[MR][2] = {};
  for (int64_t k = 0; k < g.k; ++k) {
    V16 b0 = load16(b + k * kPanel), b1 = load16(b + k * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      float x = a[r * g.lda + k];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
  if (g.bias) {
    V16 b0 = load16(g.bias + p * kPanel), b1 = load16(g.bias + p * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      acc[r][0] += b0;
      acc[r][1] += b1;
    }
  }
  if constexpr (EPI == kSiluMul) {  // 16 outputs per panel: silu(gate) * up
    for (int r = 0; r < MR; ++r)
      *(V16*)(g.c + (row + r) * g.ldc + p * 16) = silu(acc[r][0]) * acc[r][1];
    return;
  }
  const int64_t col = p * kPanel, cols = g.n - col < kPanel ? g.n - col : kPanel;
  for (int r = 0; r < MR; ++r) {
    float* c = g.c + (row + r) * g.ldc + col;
    const float* res = EPI == kAddResidual ? g.res + (row + r) * g.ldr + col : nullptr;
    if (cols == kPanel) {
      if constexpr (EPI == kAddResidual) {
        acc[r][0] += load16(res);
        acc[r][1] += load16(res + 16);
      }
      *(V16*)c = acc[r][0];
      *(V16*)(c + 16) = acc[r][1];
    } else {  // the last, partial panel
      float tmp[kPanel];
      *(V16*)tmp = acc[r][0];
      *(V16*)(tmp + 16) = acc[r][1];
      for (int64_t j = 0; j < cols; ++j) c[j] = tmp[j] + (EPI == kAddResidual ? res[j] : 0.f);
    }
  }
}

template <int EPI>
void rows_of_panel(const Gemm& g, int64_t row0, int64_t row1, int64_t p) {
  int64_t r = row0;
  for (; r + kTileRows <= row1; r += kTileRows) tile<kTileRows, EPI>(g, r, p);
  switch (row1 - r) {  // the remainder, fewer than kTileRows rows
    case 7: tile<7, EPI>(g, r, p); break;
    case 6: tile<6, EPI>(g, r, p); break;
    case 5: tile<5, EPI>(g, r, p); break;
    case 4: tile<4, EPI>(g, r, p); break;
    case 3: tile<3, EPI>(g, r, p); break;
    case 2: tile<2, EPI>(g, r, p); break;
    case 1: tile<1, EPI>(g, r, p); break;
    default: break;
  }
}

template <int EPI>
void gemm_epi(const Gemm& g) {
  // kSiluMul: n = 2 * I packed columns, a multiple of 32, giving 16 outputs per panel.
  const int64_t panels = (g.n + kPanel - 1) / kPanel;
  const int64_t blocks = (g.m + kRowBlock - 1) / kRowBlock, tasks = blocks * panels;
  // Dynamic: equal tasks, but a thread that loses its core to another process hands its share
  // to the other instead of stalling the barrier.
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t block = task / panels, p = task % panels;
    const int64_t row0 = block * kRowBlock;
    const int64_t row1 = row0 + kRowBlock < g.m ? row0 + kRowBlock : g.m;
    rows_of_panel<EPI>(g, row0, row1, p);
  }
}

}  // namespace

namespace asyncrl {

void gemm_phase(const Gemm& g, int epilogue) {
  switch (epilogue) {
    case kAddResidual: gemm_epi<kAddResidual>(g); break;
    case kSiluMul: gemm_epi<kSiluMul>(g); break;
    default: gemm_epi<kStore>(g); break;
  }
}

}  // namespace asyncrl

extern "C" {

// Whether this build's tile fills the vector registers (AVX-512): measured ~20% faster than
// oneDNN there; elsewhere untested, so the model keeps oneDNN for its matmuls.
int gemm_preferred() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

// c[m, n] = a[m, k] @ W^T (+ bias) (+ res) with W packed as above; for kSiluMul, n is 2 * I
// (gate and up) and c is [m, I]. Row strides lda, ldc, ldr are in elements.
void gemm_f32(const float* a, int64_t lda, const float* packed, const float* bias, float* c,
              int64_t ldc, const float* res, int64_t ldr, int64_t m, int64_t n, int64_t k,
              int epilogue, int nthreads) {
  Gemm g{a, lda, packed, bias, c, ldc, res, ldr, m, n, k};
  // A fork costs a few microseconds: not worth it for a matmul that is itself that small.
#pragma omp parallel num_threads(2.0 * m * n * k < 4e6 ? 1 : nthreads)
  gemm_phase(g, epilogue);
}

}  // extern "C"
