// An int8 weight-only matrix multiply for a few rows of bf16 activations (a decoding step, a verify pass), on
// AVX512-BF16: out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]. The weight comes in tiles, [N / 4, K / 32, 4, 32]: the
// 32 inputs k..k+31 of 4 outputs side by side, so each thread reads one sequential stream. Each weight is read from
// memory once for all rows, cast to bf16 in registers (exact: |w| <= 128) and multiplied with vdpbf16ps into float32
// sums. Row m's sum runs in the same order whatever the number of rows, so a row's output does not depend on the rows
// beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

// ---- int8 weights, activations quantized on the fly (w8a8): AVX512-VNNI integer dot products ----
//
// Each row of x is quantized to int8 per group of 32 inputs (scale = max |x| / 127 of the group, round to nearest
// even), so a row's codes and scales depend on that row alone. The weight comes as bytes w + 128 in tiles
// [N / 16, K / 4, 16, 4]: 4 consecutive inputs of 16 outputs per 64-byte vector, so vpdpbusd multiplies 16 outputs by
// one broadcast quad of a row's codes. A group's sum is an exact int32 (the +128 taken out by starting it from
// -128 * the group's code sum), converted and scaled in float32, groups in order: a row's output does not depend on
// the rows beside it, or on how many there are.

constexpr int kDynRowBlock = 8;  // rows per pass over a tile: 8 int32 and 8 float32 accumulators
constexpr int64_t kGroup = 32;  // inputs per activation scale: in_features must be a multiple
constexpr int kLanes = 16;  // outputs per tile: out_features must be a multiple

// Row codes q [K] int8, scales s [K / 32], starts c [K / 32] = -128 * sum of each group's codes; from x [K] (float32
// or bf16, read as float32).
template <typename T>
inline void quantize_row(const T* x, int64_t K, int8_t* q, float* s, int32_t* c) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    float xg[kGroup];
    for (int64_t i = 0; i < kGroup; ++i) xg[i] = static_cast<float>(x[g * kGroup + i]);
    float top = 0.f;
    bool is_nan = false;  // std::max drops a NaN: keep it, so that the scale carries it to the output (as torch's amax)
    for (int64_t i = 0; i < kGroup; ++i) {
      top = std::max(top, std::abs(xg[i]));
      is_nan = is_nan || std::isnan(xg[i]);
    }
    const float scale = is_nan ? std::numeric_limits<float>::quiet_NaN() : top / 127.f;
    int32_t total = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      // clamped as a float before the cast: a non-finite input (whose scale then carries it to the output) never
      // reaches an undefined float-to-int conversion
      const float code = scale > 0.f ? std::min(127.f, std::max(-127.f, std::nearbyint(xg[i] / scale))) : 0.f;
      q[g * kGroup + i] = static_cast<int8_t>(code);
      total += q[g * kGroup + i];
    }
    s[g] = scale;
    c[g] = -128 * total;
  }
}

inline void store16(float* out, __m512 values) { _mm512_storeu_ps(out, values); }
inline void store16(at::BFloat16* out, __m512 values) {  // round to nearest even, as torch converts
  _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(values));
}

// out[m, 16 t + j] for m < MB, j < 16 (float32 or bf16, row stride ldo), from tile t's weights w [K / 4, 16, 4].
template <int MB, typename T>
inline void dyn_tile(const int8_t* q, const float* s, const int32_t* c, int64_t K, const uint8_t* w,
                     const float* wscales, T* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  __m512 sums[MB];
  for (int m = 0; m < MB; ++m) sums[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_set1_epi32(c[m * G + g]);
    const uint8_t* wg = w + g * kGroup * kLanes;  // group g: 8 vectors of [16, 4]
    for (int i = 0; i < kGroup / 4; ++i) {
      const __m512i weights = _mm512_loadu_si512((const void*)(wg + i * 64));
      for (int m = 0; m < MB; ++m) {
        int32_t quad;
        std::memcpy(&quad, q + m * K + g * kGroup + i * 4, 4);
        acc[m] = _mm512_dpbusd_epi32(acc[m], weights, _mm512_set1_epi32(quad));
      }
    }
    for (int m = 0; m < MB; ++m)
      sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(s[m * G + g]), sums[m]);
  }
  const __m512 scales = _mm512_loadu_ps(wscales);
  for (int m = 0; m < MB; ++m) store16(out + m * ldo, _mm512_mul_ps(sums[m], scales));
}

template <typename T>
using DynTile = void (*)(const int8_t*, const float*, const int32_t*, int64_t, const uint8_t*, const float*, T*,
                         int64_t);
template <typename T>
const DynTile<T> kDynTiles[kDynRowBlock] = {dyn_tile<1, T>, dyn_tile<2, T>, dyn_tile<3, T>, dyn_tile<4, T>,
                                            dyn_tile<5, T>, dyn_tile<6, T>, dyn_tile<7, T>, dyn_tile<8, T>};

template <typename T>
void dynamic_mm(const T* xp, int64_t M, int64_t K, const uint8_t* wp, const float* wsp, int64_t N, T* op,
                int8_t* qp, float* sp, int32_t* cp) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, qp + m * K, sp + m * G, cp + m * G);
  });
  // One tile a pass, one sequential stream per thread: two tiles a pass (each broadcast used twice, from two
  // streams) measured slower on AMD EPYC AVX512-BF16, 82 against 69 ms a step of the 1.5B target.
  at::parallel_for(0, N / kLanes, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += kDynRowBlock) {  // more than 8 rows: the tile again, from the cache
        kDynTiles<T>[std::min<int64_t>(kDynRowBlock, M - m0) - 1](qp + m0 * K, sp + m0 * G, cp + m0 * G, K,
                                                                  wp + t * K * kLanes, wsp + t * kLanes,
                                                                  op + m0 * N + t * kLanes, N);
      }
    }
  });
}

}  // namespace

// x [M, K] float32 or bf16, w [N / 16, K / 4, 16, 4] uint8 (w + 128), scales [N] float32 -> [M, N] in x's dtype.
torch::Tensor int8_dynamic_mm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.is_contiguous() && x.size(1) % kGroup == 0,
              "x: [M, K] contiguous float32 or bf16, K a multiple of 32");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == kLanes &&
              w.size(3) == 4 && w.size(1) * 4 == x.size(1), "w: [N / 16, K / 4, 16, 4] contiguous uint8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.size(0) == w.size(0) * kLanes &&
              scales.is_contiguous(), "scales: [N] float32");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0), G = K / kGroup;
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto s = torch::empty({M, G}, x.options().dtype(at::kFloat));
  auto c = torch::empty({M, G}, x.options().dtype(at::kInt));
  auto out = torch::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    dynamic_mm(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, out.data_ptr<float>(),
               q.data_ptr<int8_t>(), s.data_ptr<float>(), c.data_ptr<int32_t>());
  } else {
    dynamic_mm(x.data_ptr<at::BFloat16>(), M, K, w.data_ptr<uint8_t>(), scales.data_ptr<float>(), N,
               out.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), c.data_ptr<int32_t>());
  }
  return out;
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_rows_mm", &int8_rows_mm, "int8 weight-only rows x weights");
  m.def("int8_dynamic_mm", &int8_dynamic_mm, "int8 weights x rows quantized to int8 per group of 32 inputs");
}
