// An int8 weight-only matrix multiply for a few rows of bf16 activations (a decoding step, a verify pass), on
// AVX512-BF16: out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]. The weight comes in tiles, [N / 4, K / 32, 4, 32]: the
// 32 inputs k..k+31 of 4 outputs side by side, so each thread reads one sequential stream. Each weight is read from
// memory once for all rows, cast to bf16 in registers (exact: |w| <= 128) and multiplied with vdpbf16ps into float32
// sums. Row m's sum runs in the same order whatever the number of rows, so a row's output does not depend on the rows
// beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRowBlock = 6;  // rows multiplied together: 6 x 4 float32 sums fill 24 of the 32 vector registers
constexpr int64_t kDepth = 32;  // inputs per vdpbf16ps: in_features must be a multiple
constexpr int kTile = 4;  // outputs per tile: out_features must be a multiple

// out[m, 4 g + j] for m < MB, j < 4; x [MB, K] (row stride K), w the tiles, out row stride ldo.
template <int MB>
inline void tile(const at::BFloat16* x, int64_t K, const int8_t* w, const at::BFloat16* scales, at::BFloat16* out,
                 int64_t ldo, int64_t g) {
  const int64_t n = g * kTile;
  const int8_t* tiles = w + g * K * kTile;  // [K / 32, 4, 32]
  __m512 sums[MB][kTile];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kTile; ++j) sums[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kDepth) {
    __m512bh weights[kTile];
    for (int j = 0; j < kTile; ++j) {
      const int8_t* row = tiles + k * kTile + j * kDepth;
      const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)row)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + 16))));
      weights[j] = _mm512_cvtne2ps_pbh(high, low);  // [32] bf16, in order
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh inputs = (__m512bh)_mm512_loadu_si512((const void*)(x + m * K + k));
      for (int j = 0; j < kTile; ++j) sums[m][j] = _mm512_dpbf16_ps(sums[m][j], inputs, weights[j]);
    }
  }
  for (int j = 0; j < kTile; ++j) {
    const float scale = static_cast<float>(scales[n + j]);
    for (int m = 0; m < MB; ++m) out[m * ldo + n + j] = at::BFloat16(_mm512_reduce_add_ps(sums[m][j]) * scale);
  }
}

using Tile = void (*)(const at::BFloat16*, int64_t, const int8_t*, const at::BFloat16*, at::BFloat16*, int64_t, int64_t);
const Tile kTiles[kRowBlock] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

}  // namespace

// x [M, K] bf16, w [N / 4, K / 32, 4, 32] int8 tiles, scales [N] bf16 -> [M, N] bf16.
torch::Tensor int8_rows_mm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: [M, K] contiguous bf16");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(2) == kTile &&
              w.size(3) == kDepth && w.size(1) * kDepth == x.size(1), "w: [N / 4, K / 32, 4, 32] contiguous int8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.size(0) == w.size(0) * kTile &&
              scales.is_contiguous(), "scales: [N] bf16");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0);
  auto out = torch::empty({M, N}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<int8_t>();
  const auto* sp = scales.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kTile, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {  // more than 6 rows: the tile again, from the cache
        kTiles[std::min<int64_t>(kRowBlock, M - m0) - 1](xp + m0 * K, K, wp, sp, op + m0 * N, N, g);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("int8_rows_mm", &int8_rows_mm, "int8 weight-only rows x weights"); }
