// bfloat16 for the project's CPU kernels: XLA's rounding (`to_bf16`,
// src/model/bf16_cast.cc), and matrix products of bfloat16 inputs summed in
// float32 (`gemm_bf16`, src/model/chunk_attention.cc's products under
// `precision.products = 'bfloat16'`) with AVX512-BF16's `vdpbf16ps`, where
// the compiler targets it (`kNativeBf16`; elsewhere callers stay float32).
//
// A product's inputs are read as pairs: two bfloat16 values of the
// contracted dimension in one 32-bit word (the even one in the low half), so
// `vdpbf16ps` adds both products of a pair to each float32 sum. A
// contracted dimension of odd length ends in a pair whose second value is 0.
#ifndef JADE_BF16_H_
#define JADE_BF16_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace jade {

// float32 -> bfloat16 bits: to nearest, ties to even; NaN stays NaN
// (quiet), as XLA's convert.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));

// `to_bf16` of 16 floats, each result in its lane's upper 16 bits.
inline u32x16 round_high(f32x16 x) {
  const u32x16 u = (u32x16)x;
  const u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);  // All ones: NaN.
  const u32x16 near = u + 0x7fffu + ((u >> 16) & 1u);
  return (nan & (u | 0x400000u)) | (~nan & near);
}

inline uint32_t pair(float lo, float hi) {
  return uint32_t(to_bf16(lo)) | uint32_t(to_bf16(hi)) << 16;
}

// Rows as pairs of their own values: out[r * ldo + p] = (x[r, 2p],
// x[r, 2p + 1]) for p < (cols + 1) / 2 (x row-major, `ldx` floats a row).
inline void pairs_in_rows(int64_t rows, int64_t cols, const float* x,
                          int64_t ldx, uint32_t* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * ldx;
    uint16_t* to = reinterpret_cast<uint16_t*>(out + r * ldo);
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      const u32x16 h = round_high(*reinterpret_cast<const f32x16*>(in + j)) >> 16;
      *reinterpret_cast<u16x16*>(to + j) = __builtin_convertvector(h, u16x16);
    }
    for (; j < cols; ++j) to[j] = to_bf16(in[j]);
    if (cols % 2) to[cols] = 0;
  }
}

// Pairs of consecutive rows: out[p * ldo + j] = (x[2p, j], x[2p + 1, j]) for
// p < (rows + 1) / 2, j < cols (an odd last row pairs with 0).
inline void pairs_across_rows(int64_t rows, int64_t cols, const float* x,
                              int64_t ldx, uint32_t* out, int64_t ldo) {
  for (int64_t p = 0; 2 * p < rows; ++p) {
    const float* lo = x + 2 * p * ldx;
    const float* hi = 2 * p + 1 < rows ? lo + ldx : nullptr;
    uint32_t* to = out + p * ldo;
    int64_t j = 0;
    if (hi)
      for (; j + 16 <= cols; j += 16) {
        const u32x16 a = round_high(*reinterpret_cast<const f32x16*>(lo + j));
        const u32x16 b = round_high(*reinterpret_cast<const f32x16*>(hi + j));
        *reinterpret_cast<u32x16*>(to + j) = (a >> 16) | (b & 0xffff0000u);
      }
    for (; j < cols; ++j) to[j] = pair(lo[j], hi ? hi[j] : 0.f);
  }
}

// out[j * ldo + i] = in[i * ld + j] for an [rows, cols] block of words.
inline void transpose_words(int64_t rows, int64_t cols, const uint32_t* in,
                            int64_t ld, uint32_t* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * ldo + i] = in[i * ld + j];
}

#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;

// Rows [r, r + R) of C (+)= A B over `pairs` pairs of the contracted
// dimension: A's pair (r, p) at a[r * ar + p * ak], B's pairs row-major
// (b[p * ldb + j]), C row-major; 32 columns a tile, then 16 under a mask.
template <int R>
inline void gemm_bf16_rows(int64_t r, int64_t cols, int64_t pairs,
                           const uint32_t* a, int64_t ar, int64_t ak,
                           const uint32_t* b, int64_t ldb, float* c,
                           int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 32 <= cols; j += 32) {
    __m512 acc[R][2];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < 2; ++h)
        acc[i][h] = accumulate ? _mm512_loadu_ps(c + (r + i) * ldc + j + 16 * h)
                               : _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * ldb + j);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * ldb + j + 16);
      for (int i = 0; i < R; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(int(a[(r + i) * ar + p * ak]));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < 2; ++h)
        _mm512_storeu_ps(c + (r + i) * ldc + j + 16 * h, acc[i][h]);
  }
  for (; j < cols; j += 16) {
    const int64_t n = cols - j < 16 ? cols - j : 16;
    const __mmask16 live = __mmask16((1u << n) - 1u);
    __m512 acc[R];
    for (int i = 0; i < R; ++i)
      acc[i] = accumulate ? _mm512_maskz_loadu_ps(live, c + (r + i) * ldc + j)
                          : _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(live, b + p * ldb + j);
      for (int i = 0; i < R; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(int(a[(r + i) * ar + p * ak]));
        acc[i] = _mm512_dpbf16_ps(acc[i], x, b0);
      }
    }
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(c + (r + i) * ldc + j, live, acc[i]);
  }
}

// C[r, c] (+)= sum_p A's pair (r, p) . B's pair (p, c), in float32.
inline void gemm_bf16(int64_t rows, int64_t cols, int64_t pairs,
                      const uint32_t* a, int64_t ar, int64_t ak,
                      const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8)
    gemm_bf16_rows<8>(r, cols, pairs, a, ar, ak, b, ldb, c, ldc, accumulate);
  for (; r < rows; ++r)
    gemm_bf16_rows<1>(r, cols, pairs, a, ar, ak, b, ldb, c, ldc, accumulate);
}
#else
constexpr bool kNativeBf16 = false;

inline void gemm_bf16(int64_t, int64_t, int64_t, const uint32_t*, int64_t,
                      int64_t, const uint32_t*, int64_t, float*, int64_t,
                      bool) {}  // Never called: callers check kNativeBf16.
#endif

}  // namespace jade

#endif  // JADE_BF16_H_
