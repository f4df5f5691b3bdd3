// GGUF weights as the file holds them (ggml's blocks, one output row after another) times rows of activations
// quantized on the fly to int8 per group of 32 inputs, on AVX2: out[m, n] = sum_k x[m, k] * w[n, k].
//
// Each block of a row's weights is decoded once per pass into 32-byte vectors of unsigned codes (one vector per group
// of 32 inputs) with their integer scales, exactly as the file defines the weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0:
// w = d * code (+ m) per 32; Q4_K, Q5_K: w = d * sc * code - dmin * m per 32 under a block of 256; Q6_K:
// w = d * sc * (code - 32) per 16), then multiplied with every row: vpmaddubsw of codes and a row's int8
// activations, vpmaddwd with the integer scales. A row's activations are quantized per block of the weight's type
// (32 inputs, or 256 for the K types, as ggml's Q8_0 and Q8_K): scale = max |x| / 127 of the block, round to nearest
// even, from that row alone. So a block's sum is an exact int32 (the K types' 8 sub-blocks added as integers),
// converted and scaled in float32 once, blocks in order, then the offsets' terms from the row's sums per 32. A row's
// sums run in the same order whatever the rows beside it: a verify pass computes each position as a one-token step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // inputs per activation scale
constexpr int kRowBlock = 8;  // rows multiplied with one decoded block (more rows: the block again)
constexpr int64_t kRowTile = 16;  // output rows a task takes (their weights stay in cache across row blocks)

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A block of weights decoded: per group of 32 inputs, 32 unsigned codes (Q8_0: magnitudes, the signs in `sign`), the
// 16-bit integer scales of its two halves for vpmaddwd, a float scale and a float offset per weight.
template <int G>
struct Decoded {
  __m256i codes[G];
  __m256i sign[G];
  __m256i scales[G];
  float scale[G];  // the K types: [0], for the whole block
  float offset[G];  // the 32-input types: per weight; the K types: [0], times each sub-block's integer min
  __m256i mins;  // the K types' integer mins per 32, [8] int32
};

inline __m256i halves(int16_t low, int16_t high) {
  return _mm256_setr_m128i(_mm_set1_epi16(low), _mm_set1_epi16(high));
}

// 32 bits -> 32 bytes of 0x10 where the bit is set (ggml's bytes_from_bits_32, masked to the fifth bit).
inline __m256i fifth_bits(const uint8_t* bits) {
  uint32_t x32;
  std::memcpy(&x32, bits, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(x32)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// 16 bytes of nibbles -> 32 codes: the low nibbles (inputs 0..15), then the high ones (16..31).
inline __m256i nibbles(const uint8_t* q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_setr_m128i(_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

// Q4_K and Q5_K's 6-bit scales and mins of the 8 sub-blocks (ggml's get_scale_min_k4, on 32-bit words as its AVX2
// code does): the scales as vpmaddwd operands, the mins as [8] int32.
inline void scales_mins(const uint8_t* q, __m256i* scales, __m256i& mins) {
  uint32_t u[4];
  std::memcpy(u, q, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t low_mins = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = low_mins;
  u[0] &= kLow6;
  uint8_t bytes[16];  // scales 0..7, then mins 0..7
  std::memcpy(bytes, u, 16);
  for (int j = 0; j < 8; ++j) scales[j] = _mm256_set1_epi16(bytes[j]);
  mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
}

struct Q4_0 {
  static constexpr int kGroups = 1, kBytes = 18, kOffset = 8;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<1>& w) {
    w.codes[0] = nibbles(b + 2);
    w.scales[0] = _mm256_set1_epi16(1);
    w.scale[0] = half(b);
    w.offset[0] = 0.f;
  }
};

struct Q4_1 {
  static constexpr int kGroups = 1, kBytes = 20, kOffset = 0;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<1>& w) {
    w.codes[0] = nibbles(b + 4);
    w.scales[0] = _mm256_set1_epi16(1);
    w.scale[0] = half(b);
    w.offset[0] = half(b + 2);
  }
};

struct Q5_0 {
  static constexpr int kGroups = 1, kBytes = 22, kOffset = 16;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<1>& w) {
    w.codes[0] = _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2));
    w.scales[0] = _mm256_set1_epi16(1);
    w.scale[0] = half(b);
    w.offset[0] = 0.f;
  }
};

struct Q5_1 {
  static constexpr int kGroups = 1, kBytes = 24, kOffset = 0;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<1>& w) {
    w.codes[0] = _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4));
    w.scales[0] = _mm256_set1_epi16(1);
    w.scale[0] = half(b);
    w.offset[0] = half(b + 2);
  }
};

struct Q8_0 {
  static constexpr int kGroups = 1, kBytes = 34, kOffset = 0;
  static constexpr bool kSigned = true;
  static void decode(const uint8_t* b, Decoded<1>& w) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    w.codes[0] = _mm256_sign_epi8(q, q);  // |q| as unsigned bytes (128 for -128)
    w.sign[0] = q;
    w.scales[0] = _mm256_set1_epi16(1);
    w.scale[0] = half(b);
    w.offset[0] = 0.f;
  }
};

struct Q4_K {
  static constexpr int kGroups = 8, kBytes = 144, kOffset = 0;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<8>& w) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + 16;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      w.codes[2 * j] = _mm256_and_si256(bytes, mask);
      w.codes[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    }
    scales_mins(scales, w.scales, w.mins);
    w.scale[0] = d;
    w.offset[0] = -dmin;
  }
};

struct Q5_K {
  static constexpr int kGroups = 8, kBytes = 176, kOffset = 0;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<8>& w) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    const __m256i mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4);
      const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4);
      w.codes[2 * j] = _mm256_or_si256(_mm256_and_si256(bytes, mask), h1);
      w.codes[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask), h2);
    }
    scales_mins(scales, w.scales, w.mins);
    w.scale[0] = d;
    w.offset[0] = -dmin;
  }
};

struct Q6_K {
  static constexpr int kGroups = 8, kBytes = 210, kOffset = 32;
  static constexpr bool kSigned = false;
  static void decode(const uint8_t* b, Decoded<8>& w) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    const __m256i mask = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // two halves of 128 inputs: 64 bytes of low bits, 32 of high bits, 8 scales
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      const __m256i high[4] = {
          _mm256_slli_epi16(_mm256_and_si256(hb, two), 4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4)};
      w.codes[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, mask), high[0]);
      w.codes[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, mask), high[1]);
      w.codes[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask), high[2]);
      w.codes[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask), high[3]);
      for (int g = 0; g < 4; ++g) w.scales[4 * h + g] = halves(sc[8 * h + 2 * g], sc[8 * h + 2 * g + 1]);
    }
    w.mins = _mm256_setzero_si256();
    w.scale[0] = d;
    w.offset[0] = 0.f;
  }
};

// Row codes q [K] int8, scales s [K / B] (one per block of B inputs: 32 or 256), sums c [K / 32] (each group's code
// sum); from x [K] (read as float32).
template <typename T>
inline void quantize_row(const T* x, int64_t K, int64_t B, int8_t* q, float* s, int32_t* c) {
  std::vector<float> xb(B);
  for (int64_t b = 0; b < K / B; ++b) {
    for (int64_t i = 0; i < B; ++i) xb[i] = static_cast<float>(x[b * B + i]);
    float top = 0.f;
    bool is_nan = false;  // std::max drops a NaN: keep it, so that the scale carries it to the output
    for (int64_t i = 0; i < B; ++i) {
      top = std::max(top, std::abs(xb[i]));
      is_nan = is_nan || std::isnan(xb[i]);
    }
    const float scale = is_nan ? std::numeric_limits<float>::quiet_NaN() : top / 127.f;
    for (int64_t i = 0; i < B; ++i) {
      const float code = scale > 0.f ? std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] / scale))) : 0.f;
      q[b * B + i] = static_cast<int8_t>(code);
    }
    s[b] = scale;
  }
  for (int64_t g = 0; g < K / kGroup; ++g) {
    int32_t total = 0;
    for (int64_t i = 0; i < kGroup; ++i) total += q[g * kGroup + i];
    c[g] = total;
  }
}

inline float sum8(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

inline void store(float* out, float value) { *out = value; }
inline void store(at::BFloat16* out, float value) { *out = at::BFloat16(value); }

// out[m, n] for m < MB, the weights of output row n (`row`, K / (32 * kGroups) blocks), the rows' codes q [MB, K],
// scales s [MB, K / block] and sums c [MB, K / 32]. A group's weights are applied to every row in turn, each row's
// block sum held in its own register.
template <typename Q, typename T, int MB>
inline void output(const uint8_t* row, const Decoded<Q::kGroups>* decoded, int64_t K, const int8_t* q, const float* s,
                   const int32_t* c, T* out, int64_t ldo) {
  constexpr int kG = Q::kGroups;
  const int64_t G = K / kGroup, blocks = G / kG;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(Q::kOffset));
  __m256 sums[MB];
  float offsets[MB];
  for (int m = 0; m < MB; ++m) {
    sums[m] = _mm256_setzero_ps();
    offsets[m] = 0.f;
  }
  Decoded<kG> local;
  for (int64_t b = 0; b < blocks; ++b) {
    if (decoded == nullptr) Q::decode(row + b * Q::kBytes, local);
    const Decoded<kG>& w = decoded == nullptr ? local : decoded[b];
    __m256i exact[MB];  // [8] int32 per row: the block's sum, exact
    for (int m = 0; m < MB; ++m) exact[m] = _mm256_setzero_si256();
    for (int g = 0; g < kG; ++g) {
      const __m256i codes = w.codes[g], scales = w.scales[g];
      for (int m = 0; m < MB; ++m) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * K + (b * kG + g) * kGroup));
        __m256i products = Q::kSigned ? _mm256_maddubs_epi16(codes, _mm256_sign_epi8(a, w.sign[g]))
                                      : _mm256_maddubs_epi16(codes, a);
        if (Q::kOffset) products = _mm256_sub_epi16(products, _mm256_maddubs_epi16(offset, a));
        exact[m] = _mm256_add_epi32(exact[m], _mm256_madd_epi16(products, scales));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const float scale = s[m * blocks + b];  // the row's activation scale of this block
      sums[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[m]), _mm256_set1_ps(w.scale[0] * scale), sums[m]);
      if (kG == 1) {
        offsets[m] += w.offset[0] * scale * static_cast<float>(c[m * G + b]);
      } else if (w.offset[0] != 0.f) {  // the mins' term: each sub-block's min times the row's code sum there
        const __m256i code_sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + m * G + b * kG));
        sums[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(w.mins, code_sums)),
                                  _mm256_set1_ps(w.offset[0] * scale), sums[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) store(out + m * ldo, sum8(sums[m]) + offsets[m]);
}

template <typename Q, typename T>
using Output = void (*)(const uint8_t*, const Decoded<Q::kGroups>*, int64_t, const int8_t*, const float*,
                        const int32_t*, T*, int64_t);
template <typename Q, typename T>
const Output<Q, T> kOutputs[kRowBlock] = {output<Q, T, 1>, output<Q, T, 2>, output<Q, T, 3>, output<Q, T, 4>,
                                          output<Q, T, 5>, output<Q, T, 6>, output<Q, T, 7>, output<Q, T, 8>};

template <typename Q, typename T>
void gguf_mm_impl(const T* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, T* op) {
  const int64_t B = kGroup * Q::kGroups, G = K / kGroup, blocks = K / B, row_bytes = blocks * Q::kBytes;
  auto q = torch::empty({M, K}, torch::kChar);
  auto s = torch::empty({M, blocks}, torch::kFloat);
  auto c = torch::empty({M, G}, torch::kInt);
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  int32_t* cp = c.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, B, qp + m * K, sp + m * blocks, cp + m * G);
  });
  at::parallel_for(0, (N + kRowTile - 1) / kRowTile, 1, [&](int64_t t0, int64_t t1) {
    // More rows than one pass takes (a prompt): the tile's blocks decoded once, then read for every pass of rows.
    std::vector<Decoded<Q::kGroups>> decoded(M > kRowBlock ? kRowTile * blocks : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRowTile, n1 = std::min(N, n0 + kRowTile);
      for (int64_t n = n0; n < n1 && !decoded.empty(); ++n) {
        for (int64_t b = 0; b < blocks; ++b) {
          Q::decode(wp + n * row_bytes + b * Q::kBytes, decoded[(n - n0) * blocks + b]);
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const auto multiply = kOutputs<Q, T>[std::min<int64_t>(kRowBlock, M - m0) - 1];
        for (int64_t n = n0; n < n1; ++n) {
          multiply(wp + n * row_bytes, decoded.empty() ? nullptr : decoded.data() + (n - n0) * blocks, K,
                   qp + m0 * K, sp + m0 * blocks, cp + m0 * G, op + m0 * N + n, N);
        }
      }
    }
  });
}

template <typename T>
void dispatch(int64_t type, const T* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, T* op) {
  switch (type) {
    case 2: return gguf_mm_impl<Q4_0, T>(xp, M, K, wp, N, op);
    case 3: return gguf_mm_impl<Q4_1, T>(xp, M, K, wp, N, op);
    case 6: return gguf_mm_impl<Q5_0, T>(xp, M, K, wp, N, op);
    case 7: return gguf_mm_impl<Q5_1, T>(xp, M, K, wp, N, op);
    case 8: return gguf_mm_impl<Q8_0, T>(xp, M, K, wp, N, op);
    case 12: return gguf_mm_impl<Q4_K, T>(xp, M, K, wp, N, op);
    case 13: return gguf_mm_impl<Q5_K, T>(xp, M, K, wp, N, op);
    case 14: return gguf_mm_impl<Q6_K, T>(xp, M, K, wp, N, op);
    default: TORCH_CHECK(false, "gguf_mm: ggml type ", type, " is not one of Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K");
  }
}

int64_t block_inputs(int64_t type) { return type >= 12 ? 256 : 32; }

int64_t block_bytes(int64_t type) {
  switch (type) {
    case 2: return Q4_0::kBytes;
    case 3: return Q4_1::kBytes;
    case 6: return Q5_0::kBytes;
    case 7: return Q5_1::kBytes;
    case 8: return Q8_0::kBytes;
    case 12: return Q4_K::kBytes;
    case 13: return Q5_K::kBytes;
    case 14: return Q6_K::kBytes;
    default: return 0;
  }
}

}  // namespace

// x [M, K] float32 or bf16; w [N, K / block * bytes] uint8, the file's blocks row after row; type: ggml's type id
// -> [M, N] in x's dtype.
torch::Tensor gguf_mm(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(block_bytes(type) > 0, "gguf_mm: unsupported ggml type ", type);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.is_contiguous() && x.size(1) % block_inputs(type) == 0,
              "gguf_mm: x must be [M, K] contiguous float32 or bf16, K a multiple of the block's inputs");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
              w.size(1) == K / block_inputs(type) * block_bytes(type),
              "gguf_mm: w must be [N, K / block * bytes] contiguous uint8");
  const int64_t N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    dispatch(type, x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, out.data_ptr<float>());
  } else {
    dispatch(type, x.data_ptr<at::BFloat16>(), M, K, w.data_ptr<uint8_t>(), N, out.data_ptr<at::BFloat16>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_mm", &gguf_mm, "GGUF weight blocks x rows quantized to int8 per block (AVX2)");
}
