// The AVX-512F kernel set, float32 words, and the vectorised softmax step and key packing the
// bf16-pair and AMX sets share.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "avx512_gemm.h"
#include "avx512_policies.h"
#include "avx512_tile.h"
#include "row_ops.h"
#include "sets.h"

namespace opmesh::core::kernels::avx512 {
namespace {

// exp(x) for x <= 0 (scores minus their running max): 2^n * 2^f with f in [-1/2, 1/2] and a
// degree-7 Taylor polynomial of 2^f (relative error below 1e-7). -inf gives 0, NaN stays NaN.
inline __m512 exp_nonpositive(__m512 x) {
  // MAXPS returns its second operand when either is NaN: (floor, x) keeps a NaN.
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

void gemm(const GemmArgs& g) { Avx512Gemm<Float32Policy>::run(g); }

void score_tile(const ScoreTileArgs& args) { Avx512Tile<Float32Policy>::run(args); }

// In-register transpose of a 16 x 16 block of 4-byte words: out[c] lane i = in[i] lane c.
inline void transpose16(const __m512i in[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  // u[4g + k], 128-bit lane l: rows 4g..4g+3 of column 4l + k.
  for (int g = 0; g < 4; ++g) {
    const __m512i* tg = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(tg[0], tg[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(tg[0], tg[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(tg[1], tg[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(tg[1], tg[3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    out[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    out[8 + k] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    out[4 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

}  // namespace

void pack_keys(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp) {
  __m512i in[16], out[16];
  for (int64_t n0 = 0; n0 < kKeyTile; n0 += 16) {
    for (int64_t d0 = 0; d0 < words; d0 += 16) {
      const int64_t count = std::min<int64_t>(16, words - d0);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
      for (int i = 0; i < 16; ++i) {
        in[i] = n0 + i < valid ? _mm512_maskz_loadu_epi32(mask, rows[n0 + i] + 4 * d0)
                               : _mm512_setzero_si512();
      }
      transpose16(in, out);
      for (int64_t c = 0; c < count; ++c) {
        _mm512_storeu_si512(kp + (d0 + c) * kKeyTile + n0, out[c]);
      }
    }
  }
}

// VCVTPH2PS (AVX-512F) for fp16, a 16-bit shift for bf16: both exact; VCVTPD2PS for float64.
void widen(const void* src, DType dtype, int64_t n, float* dst) {
  int64_t i = 0;
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(
            dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
      }
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (; i + 16 <= n; i += 16) {
        const __m512i w =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      }
      break;
    }
    case DType::kFloat64: {
      const double* s = static_cast<const double*>(src);
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm512_cvtpd_ps(_mm512_loadu_pd(s + i)));
      break;
    }
  }
  // The tail by the portable set (built without AVX-512 flags, like every inline helper the
  // sets could otherwise share across translation units of different flags).
  const size_t elem = dtype == DType::kFloat64 ? 8 : 2;
  scalar::widen(static_cast<const char*>(src) + i * elem, dtype, n - i, dst + i);
}

void softmax(float* s, int64_t rows, int64_t cols, float* m, float* l, float* correction) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    __mmask16 nan = 0;
    __m512 top[2] = {_mm512_set1_ps(m[r]), _mm512_set1_ps(m[r])};
    for (int64_t j = 0; j < cols; j += 32) {
      for (int u = 0; u < 2; ++u) {
        const __m512 v = _mm512_loadu_ps(x + j + 16 * u);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top[u] = _mm512_max_ps(top[u], v);
      }
    }
    float row_max = _mm512_reduce_max_ps(_mm512_max_ps(top[0], top[1]));
    if (nan != 0 || m[r] != m[r]) row_max = std::numeric_limits<float>::quiet_NaN();
    if (row_max == kNegInf) {
      for (int64_t j = 0; j < cols; j += 16) _mm512_storeu_ps(x + j, _mm512_setzero_ps());
      correction[r] = 1.0f;
      continue;
    }
    const __m512 mv = _mm512_set1_ps(row_max);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < cols; j += 32) {
      for (int u = 0; u < 2; ++u) {
        const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16 * u), mv));
        sum[u] = _mm512_add_ps(sum[u], p);
        _mm512_storeu_ps(x + j + 16 * u, p);
      }
    }
    correction[r] = std::exp(m[r] - row_max);
    l[r] = l[r] * correction[r] + _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
    m[r] = row_max;
  }
}

void exp_rows(float* s, int64_t rows, int64_t cols, const float* shift) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 m = _mm512_set1_ps(shift[r]);
    for (int64_t c = 0; c < cols; c += 16) {
      float* x = s + r * cols + c;
      _mm512_storeu_ps(x, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x), m)));
    }
  }
}

const KernelSet& kernel_set() {
  static const KernelSet set{"avx512", Isa::kAvx512, Word::kFloat32, 1,      1,        6,
                             1,        nullptr,      nullptr,        &gemm,  &softmax, &exp_rows,
                             nullptr,  &pack_keys,   &score_tile,    &widen, row_ops()};
  return set;
}

}  // namespace opmesh::core::kernels::avx512
