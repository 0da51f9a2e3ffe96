// LSH buckets for XLA's CPU backend, fused: Trax's `hash_vectors` rotates
// each vector by random rotations and takes the argmax over `[r, -r]`
// (src/model/lsh_hash.py). Here the rotated values are made 16 positions
// at a time against a few rotations, in registers, and folded into each
// position's running maximum and minimum at once: the `[n_buckets / 2,
// length]` rotated rows are never written. XLA's product of the same shape
// and its argmax ran at ~34 GFLOP/s on a Zen 3 (its scan over rotation
// rows, BENCHMARKS.md); these products run near the machine's FMA rate.
// Built and loaded by src/model/kernels.py; never edited there.
//
// Inputs: vectors `[..., n, d]` and rotations `[..., hashes, half, d]`
// (the same leading dimensions: vmap's), float32. Output: `[..., hashes,
// n]` int32, the index in `concatenate([r, -r])` of the first maximum.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_pool.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jade::kTileRows;  // Rotations a micro-tile takes (vec8.h).
using jade::v8;
using jade::v8i;

constexpr int64_t kLanes = 16;  // Positions a tile holds: two vectors.

// The running extremes of 16 positions over the rotations seen so far:
// the largest and smallest rotated value and the first rotation with each.
struct Extremes {
  v8 hi[2], lo[2];
  v8i at_hi[2], at_lo[2];
};

// Rotations [r, r + R) (`rot`: `[half, d]`) against the 16 positions of
// `xt` (`[d, 16]`, transposed), folded into `e` in rotation order (strict
// comparisons: an equal later rotation keeps the first).
template <int R>
inline void fold(int64_t r, int64_t d, const float* rot, const float* xt,
                 Extremes& e) {
  v8 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = v8{};
  for (int64_t k = 0; k < d; ++k) {
    const v8 b0 = *reinterpret_cast<const v8*>(xt + k * kLanes);
    const v8 b1 = *reinterpret_cast<const v8*>(xt + k * kLanes + 8);
    for (int i = 0; i < R; ++i) {
      const float a = rot[(r + i) * d + k];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) {
      const v8 x = acc[i][h];
      const v8i at = v8i{} + static_cast<int32_t>(r + i);
      const v8i up = x > e.hi[h];
      e.hi[h] = up ? x : e.hi[h];
      e.at_hi[h] = up ? at : e.at_hi[h];
      const v8i down = x < e.lo[h];
      e.lo[h] = down ? x : e.lo[h];
      e.at_lo[h] = down ? at : e.at_lo[h];
    }
}

struct Hash {
  int64_t groups, hashes, n, d, half;
  const float *vecs, *rots;
  int32_t* out;

  static constexpr int64_t kBlock = 512;  // Positions a task.
  int64_t blocks() const { return (n + kBlock - 1) / kBlock; }
  int64_t tasks() const { return groups * hashes * blocks(); }

  void operator()(int64_t task, std::vector<float>& xt) const {
    const int64_t gh = task / blocks(), g = gh / hashes;
    const int64_t p0 = (task % blocks()) * kBlock;
    const int64_t p1 = std::min(n, p0 + kBlock);
    const float* rot = rots + gh * half * d;
    const float* x = vecs + g * n * d;
    int32_t* o = out + gh * n;
    xt.resize(d * kLanes);  // Lanes past the last position: zeros, below.
    for (int64_t p = p0; p < p1; p += kLanes) {
      const int64_t m = std::min(kLanes, p1 - p);
      for (int64_t j = 0; j < m; ++j)
        for (int64_t k = 0; k < d; ++k) xt[k * kLanes + j] = x[(p + j) * d + k];
      for (int64_t j = m; j < kLanes; ++j)
        for (int64_t k = 0; k < d; ++k) xt[k * kLanes + j] = 0.f;
      Extremes e;
      for (int h = 0; h < 2; ++h) {
        e.hi[h] = v8{} - INFINITY;
        e.lo[h] = v8{} + INFINITY;
        e.at_hi[h] = e.at_lo[h] = v8i{};
      }
      int64_t r = 0;
      for (; r + kTileRows <= half; r += kTileRows)
        fold<kTileRows>(r, d, rot, xt.data(), e);
      for (; r + 2 <= half; r += 2) fold<2>(r, d, rot, xt.data(), e);
      if (r < half) fold<1>(r, d, rot, xt.data(), e);
      for (int64_t j = 0; j < m; ++j) {
        const int h = j / 8, l = j % 8;
        // `-r` comes second in the concatenation: a tie goes to `r`.
        o[p + j] = e.hi[h][l] >= -e.lo[h][l]
                       ? e.at_hi[h][l]
                       : e.at_lo[h][l] + static_cast<int32_t>(half);
      }
    }
  }
};

ffi::Error hash_impl(ffi::ThreadPool pool, ffi::AnyBuffer vecs,
                     ffi::AnyBuffer rots, ffi::Result<ffi::AnyBuffer> out) {
  const auto vd = vecs.dimensions(), rd = rots.dimensions();
  if (vecs.element_type() != ffi::DataType::F32 ||
      rots.element_type() != ffi::DataType::F32 ||
      out->element_type() != ffi::DataType::S32 || vd.size() < 2 ||
      rd.size() != vd.size() + 1)
    return ffi::Error::InvalidArgument(
        "lsh buckets: float32 [..., n, d] and [..., hashes, half, d] in");
  Hash f;
  f.n = vd[vd.size() - 2];
  f.d = vd[vd.size() - 1];
  f.hashes = rd[rd.size() - 3];
  f.half = rd[rd.size() - 2];
  if (rd[rd.size() - 1] != f.d || f.half < 1 || f.half > (1 << 30))
    return ffi::Error::InvalidArgument("lsh buckets: rotations' shape");
  f.groups = 1;
  for (size_t i = 0; i + 2 < vd.size(); ++i) {
    if (rd[i] != vd[i])
      return ffi::Error::InvalidArgument("lsh buckets: leading dimensions");
    f.groups *= vd[i];
  }
  if (static_cast<int64_t>(out->element_count()) != f.groups * f.hashes * f.n)
    return ffi::Error::InvalidArgument("lsh buckets: output's size");
  f.vecs = vecs.typed_data<float>();
  f.rots = rots.typed_data<float>();
  f.out = out->typed_data<int32_t>();
  jade::run_all<std::vector<float>>(pool, f.tasks(), f);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeLshBuckets, hash_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
