// The project's CPU kernels' 8-float vectors (GCC/Clang vector extensions:
// one AVX register, half an AVX-512 one), the height of their products'
// micro-tiles, their exponential, their float32 product and their
// transpose of 32-bit words (src/model/chunk_attention.cc,
// src/model/lsh_hash.cc, src/model/memory_attention.cc,
// src/model/output_layer.cc, src/model/layer_norm.cc).
#ifndef JADE_VEC8_H_
#define JADE_VEC8_H_

#include <cstdint>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace jade {

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

// Rows of a micro-tile 16 columns (two v8) wide: 8 x 16 floats in 16
// vector registers where the CPU has 32 (AVX-512), 6 x 16 in 12 where it
// has 16 (AVX2: 12 accumulators, two of B and A's broadcast; 4 x 16 left
// the two FMA units waiting on their 4-cycle latency).
#if defined(__AVX512F__)
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 6;
#endif

// exp of 8 floats (Cephes' expf: ~1 ulp); 0 below -87.
inline v8 vexp(v8 x) {
  const v8i live = x > -87.f;
  x = x < 88.f ? x : 88.f;
  x = x > -87.f ? x : -87.f;
  const v8 t = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(t, v8i);
  n += __builtin_convertvector(n, v8) > t;  // Floor: -1 where truncation rounded up.
  const v8 fn = __builtin_convertvector(n, v8);
  const v8 r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  v8 y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const v8i scale = (n + 127) << 23;
  return reinterpret_cast<v8>(reinterpret_cast<v8i>(y * reinterpret_cast<v8>(scale)) & live);
}

// sum_j a[j] b[j] for j < n, in four 8-float sums (an FMA chain of one
// sum would wait on the FMA's latency at every step), then their lanes.
inline float dot(const float* a, const float* b, int64_t n) {
  v8 s0{}, s1{}, s2{}, s3{};
  int64_t j = 0;
  auto at = [](const float* x) { return *reinterpret_cast<const v8*>(x); };
  for (; j + 32 <= n; j += 32) {
    s0 += at(a + j) * at(b + j);
    s1 += at(a + j + 8) * at(b + j + 8);
    s2 += at(a + j + 16) * at(b + j + 16);
    s3 += at(a + j + 24) * at(b + j + 24);
  }
  for (; j + 8 <= n; j += 8) s0 += at(a + j) * at(b + j);
  const v8 s = (s0 + s1) + (s2 + s3);
  float total = 0.f;
  for (int h = 0; h < 8; ++h) total += s[h];
  for (; j < n; ++j) total += a[j] * b[j];
  return total;
}

// A product's micro-tiles are `kTileRows` rows of C; the rows
// left over go 4, 2, 1 at a time.
// Rows [r, r + R) of C (+)= A B, columns [0, cols) in tiles of 16 (then
// one at a time): see `gemm`.
template <int R>
void gemm_rows(int64_t r, int64_t cols, int64_t depth, const float* a,
               int64_t ar, int64_t ak, const float* b, int64_t ldb, float* c,
               int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 16 <= cols; j += 16) {
    v8 acc[R][2];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < 2; ++h)
        acc[i][h] = accumulate ? *reinterpret_cast<const v8*>(
                                     c + (r + i) * ldc + j + 8 * h)
                               : v8{};
    for (int64_t k = 0; k < depth; ++k) {
      const v8 b0 = *reinterpret_cast<const v8*>(b + k * ldb + j);
      const v8 b1 = *reinterpret_cast<const v8*>(b + k * ldb + j + 8);
      for (int i = 0; i < R; ++i) {
        const float x = a[(r + i) * ar + k * ak];
        acc[i][0] += x * b0;
        acc[i][1] += x * b1;
      }
    }
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<v8*>(c + (r + i) * ldc + j + 8 * h) = acc[i][h];
  }
  for (; j < cols; ++j)
    for (int i = 0; i < R; ++i) {
      float x = accumulate ? c[(r + i) * ldc + j] : 0.f;
      for (int64_t k = 0; k < depth; ++k)
        x += a[(r + i) * ar + k * ak] * b[k * ldb + j];
      c[(r + i) * ldc + j] = x;
    }
}

// C[r, c] (+)= sum_k A[r, k] B[k, c]: A's element (r, k) at a[r * ar + k *
// ak] (ak = 1: row-major; ar = 1: A read transposed), B and C row-major.
inline void gemm(int64_t rows, int64_t cols, int64_t depth, const float* a,
          int64_t ar, int64_t ak, const float* b, int64_t ldb, float* c,
          int64_t ldc, bool accumulate) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    gemm_rows<kTileRows>(r, cols, depth, a, ar, ak, b, ldb, c, ldc,
                         accumulate);
  if (kTileRows > 4 && r + 4 <= rows) {
    gemm_rows<4>(r, cols, depth, a, ar, ak, b, ldb, c, ldc, accumulate);
    r += 4;
  }
  if (r + 2 <= rows) {
    gemm_rows<2>(r, cols, depth, a, ar, ak, b, ldb, c, ldc, accumulate);
    r += 2;
  }
  if (r < rows)
    gemm_rows<1>(r, cols, depth, a, ar, ak, b, ldb, c, ldc, accumulate);
}

// out[j * ldo + i] = in[i * ld + j] for an [rows, cols] block of 32-bit
// words (floats, or bfloat16 pairs: moved, never computed on). Blocks of
// 8 x 8 go through 8 vector registers where the CPU has AVX (a scalar
// copy of a column is a store to a new cache line each word: the fused
// attention's windows of keys and values spent ~13% of its time so).
inline void transpose32(int64_t rows, int64_t cols, const void* in_words,
                        int64_t ld, void* out_words, int64_t ldo) {
  const uint32_t* in = static_cast<const uint32_t*>(in_words);
  uint32_t* out = static_cast<uint32_t*>(out_words);
  int64_t i0 = 0;
#if defined(__AVX__)
  for (; i0 + 8 <= rows; i0 += 8) {
    int64_t j0 = 0;
    for (; j0 + 8 <= cols; j0 += 8) {
      const float* a = reinterpret_cast<const float*>(in + i0 * ld + j0);
      __m256 r[8], t[8];
      for (int h = 0; h < 8; ++h) r[h] = _mm256_loadu_ps(a + h * ld);
      for (int h = 0; h < 8; h += 2) {
        t[h] = _mm256_unpacklo_ps(r[h], r[h + 1]);
        t[h + 1] = _mm256_unpackhi_ps(r[h], r[h + 1]);
      }
      for (int h = 0; h < 8; h += 4) {  // Columns (0, 4), (1, 5), (2, 6), (3, 7).
        r[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        r[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
        r[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        r[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
      }
      float* o = reinterpret_cast<float*>(out + j0 * ldo + i0);
      for (int h = 0; h < 4; ++h) {
        _mm256_storeu_ps(o + h * ldo, _mm256_permute2f128_ps(r[h], r[h + 4], 0x20));
        _mm256_storeu_ps(o + (h + 4) * ldo,
                         _mm256_permute2f128_ps(r[h], r[h + 4], 0x31));
      }
    }
    for (int64_t i = i0; i < i0 + 8; ++i)
      for (int64_t j = j0; j < cols; ++j) out[j * ldo + i] = in[i * ld + j];
  }
#endif
  for (int64_t i = i0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * ldo + i] = in[i * ld + j];
}

}  // namespace jade

#endif  // JADE_VEC8_H_
