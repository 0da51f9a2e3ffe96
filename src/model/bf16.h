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
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
// AMX's products where the compiler targets them on Linux (`JADE_AMX`: the
// tiles are asked of Linux, below).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define JADE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
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

// `gemm_bf16` by `vdpbf16ps` alone.
inline void gemm_bf16_vector(int64_t rows, int64_t cols, int64_t pairs,
                             const uint32_t* a, int64_t ar, int64_t ak,
                             const uint32_t* b, int64_t ldb, float* c,
                             int64_t ldc, bool accumulate) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8)
    gemm_bf16_rows<8>(r, cols, pairs, a, ar, ak, b, ldb, c, ldc, accumulate);
  for (; r < rows; ++r)
    gemm_bf16_rows<1>(r, cols, pairs, a, ar, ak, b, ldb, c, ldc, accumulate);
}

#if defined(JADE_AMX)
// AMX (Intel Sapphire Rapids and later): `tdpbf16ps` adds a [16 x 16 pairs]
// by [16 pairs x 16] product of bfloat16 pairs to a 16 x 16 float32 tile in
// one instruction, ~8x `vdpbf16ps`'s products a cycle. Its pairs are the
// layout above: A's 16 pairs of a row side by side (`ak == 1`), B's pairs
// row-major. Linux hands a process the tiles' state only when asked
// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once, for every
// thread); where it refuses, the products stay on `vdpbf16ps`.
inline bool amx_allowed() {
  static const bool allowed = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return allowed;
}

// The tiles of `amx_block`: 0-3 up to a 32 x 32 block of C (2 x 2 tiles),
// 4-5 up to two 16-row strips of A, 6-7 up to two 16-column strips of B;
// every tile 16 rows of 64 bytes (16 floats, or 16 pairs).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) bytes[t] = 64, rows[t] = 16;
  }
};

// C's [16 NR, 16 NC] block at `c` (+)= A's 16 NR rows at `a` by B's 16 NC
// columns at `b`, over `pairs` (a multiple of 16); A's pairs contiguous
// (`ar` words a row). AMX rounds a group of 16 pairs its own way, not pair
// after pair as `vdpbf16ps`: (0, 0) pairs in a group change no bit of its
// sum, but which pairs share a group does (`pair_group`).
template <int NR, int NC>
inline void amx_block(const uint32_t* a, int64_t ar, const uint32_t* b,
                      int64_t ldb, float* c, int64_t ldc, int64_t pairs,
                      bool accumulate) {
  const int64_t cs = ldc * 4, as = ar * 4, bs = ldb * 4;
  float* c1 = c + 16 * ldc;
  if (accumulate) {
    _tile_loadd(0, c, cs);
    if (NC > 1) _tile_loadd(1, c + 16, cs);
    if (NR > 1) _tile_loadd(2, c1, cs);
    if (NR > 1 && NC > 1) _tile_loadd(3, c1 + 16, cs);
  } else {
    _tile_zero(0);
    if (NC > 1) _tile_zero(1);
    if (NR > 1) _tile_zero(2);
    if (NR > 1 && NC > 1) _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(4, a + p, as);
    _tile_loadd(6, b + p * ldb, bs);
    _tile_dpbf16ps(0, 4, 6);
    if (NC > 1) {
      _tile_loadd(7, b + p * ldb + 16, bs);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (NR > 1) {
      _tile_loadd(5, a + 16 * ar + p, as);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (NR > 1 && NC > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cs);
  if (NC > 1) _tile_stored(1, c + 16, cs);
  if (NR > 1) _tile_stored(2, c1, cs);
  if (NR > 1 && NC > 1) _tile_stored(3, c1 + 16, cs);
}

// `amx_block`s over C: rows, columns and pairs multiples of 16.
inline void amx_tiles(int64_t rows, int64_t cols, int64_t pairs,
                      const uint32_t* a, int64_t ar, const uint32_t* b,
                      int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  static thread_local const TileConfig config;
  _tile_loadconfig(&config);
  for (int64_t r = 0; r < rows; r += 32) {
    const bool two = r + 32 <= rows;
    const uint32_t* ar0 = a + r * ar;
    float* cr = c + r * ldc;
    int64_t j = 0;
    for (; j + 32 <= cols; j += 32)
      two ? amx_block<2, 2>(ar0, ar, b + j, ldb, cr + j, ldc, pairs, accumulate)
          : amx_block<1, 2>(ar0, ar, b + j, ldb, cr + j, ldc, pairs,
                            accumulate);
    if (j < cols)
      two ? amx_block<2, 1>(ar0, ar, b + j, ldb, cr + j, ldc, pairs, accumulate)
          : amx_block<1, 1>(ar0, ar, b + j, ldb, cr + j, ldc, pairs,
                            accumulate);
  }
  _tile_release();
}

inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

// `gemm_bf16` by AMX, every sum (so every call sums alike): where rows,
// columns or pairs are not multiples of 16, or A's pairs are not side by
// side, the operands are copied into zero-padded ones first.
inline void gemm_bf16_amx(int64_t rows, int64_t cols, int64_t pairs,
                          const uint32_t* a, int64_t ar, int64_t ak,
                          const uint32_t* b, int64_t ldb, float* c,
                          int64_t ldc, bool accumulate) {
  static thread_local std::vector<uint32_t> pa, pb;
  static thread_local std::vector<float> pc;
  const int64_t r16 = up16(rows), c16 = up16(cols), p16 = up16(pairs);
  if (ak != 1 || r16 != rows || p16 != pairs) {  // A padded.
    pa.assign(r16 * p16, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < pairs; ++p) pa[r * p16 + p] = a[r * ar + p * ak];
    a = pa.data(), ar = p16;
  }
  if (c16 != cols || p16 != pairs) {  // B padded.
    pb.assign(p16 * c16, 0);
    for (int64_t p = 0; p < pairs; ++p)
      std::memcpy(&pb[p * c16], b + p * ldb, cols * 4);
    b = pb.data(), ldb = c16;
  }
  if (r16 == rows && c16 == cols)
    return amx_tiles(rows, cols, p16, a, ar, b, ldb, c, ldc, accumulate);
  pc.assign(r16 * c16, 0.f);  // C padded.
  for (int64_t r = 0; r < rows && accumulate; ++r)
    std::memcpy(&pc[r * c16], c + r * ldc, cols * 4);
  amx_tiles(r16, c16, p16, a, ar, b, ldb, pc.data(), c16, accumulate);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(c + r * ldc, &pc[r * c16], cols * 4);
}
#endif

// Whether `gemm_bf16` runs on AMX: built for it, and Linux lent the tiles.
inline bool amx_in_use() {
#if defined(JADE_AMX)
  return amx_allowed();
#else
  return false;
#endif
}

// C[r, c] (+)= sum_p A's pair (r, p) . B's pair (p, c), in float32: by AMX
// where the CPU and the system give it, else by `vdpbf16ps`.
inline void gemm_bf16(int64_t rows, int64_t cols, int64_t pairs,
                      const uint32_t* a, int64_t ar, int64_t ak,
                      const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate) {
#if defined(JADE_AMX)
  if (amx_allowed())
    return gemm_bf16_amx(rows, cols, pairs, a, ar, ak, b, ldb, c, ldc,
                         accumulate);
#endif
  gemm_bf16_vector(rows, cols, pairs, a, ar, ak, b, ldb, c, ldc, accumulate);
}
#else
constexpr bool kNativeBf16 = false;

inline bool amx_in_use() { return false; }  // No bfloat16 products here.

inline void gemm_bf16(int64_t, int64_t, int64_t, const uint32_t*, int64_t,
                      int64_t, const uint32_t*, int64_t, float*, int64_t,
                      bool) {}  // Never called: callers check kNativeBf16.
#endif

// The pairs of a contracted dimension summed as one group, whose rounding
// is not that of the same pairs in other groups: 16 under AMX (a sum over
// pairs [0, 24) differs from the sums over [0, 8) and [8, 24) added), 1 with
// `vdpbf16ps` (pair after pair).
inline int64_t pair_group() { return amx_in_use() ? 16 : 1; }

}  // namespace jade

#endif  // JADE_BF16_H_
