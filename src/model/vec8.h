// The project's CPU kernels' 8-float vectors (GCC/Clang vector extensions:
// one AVX register, half an AVX-512 one) and the height of their products'
// micro-tiles (src/model/chunk_attention.cc, src/model/lsh_hash.cc).
#ifndef JADE_VEC8_H_
#define JADE_VEC8_H_

#include <cstdint>

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

}  // namespace jade

#endif  // JADE_VEC8_H_
