// Trax's LayerNorm (centered) forward and backward, and its LSH layer's
// keys (`length_normalized` rows, scaled), a row at a time, for XLA's CPU
// backend (src/model/layer_norm.py). XLA's CPU backend runs a reduction
// over a row of more than 32 values as `reduce-window` loops on one
// thread; a 32k window's layer norm took 6.9 ms forward and 20.4 ms
// forward + backward (BENCHMARKS.md "Layer norms and the LSH keys as
// kernels"). Here a row (d_model floats, in L1) is read from memory once
// per pass over the rows, on XLA's threads. Built and loaded by
// src/model/kernels.py; never edited there.
//
// forward: x `[..., d]` float32, scale `[d]`, bias `[d]`, eps ->
// y = (x - mean) / sqrt(var + eps) * scale + bias, mean and var over each
// row's d values (var of the centered values, as Trax computes it).
// backward: x, scale, dy -> dx `[..., d]` and the weights' gradients
// summed per block of rows (the caller adds the blocks in order: the same
// sums whatever thread ran a block). The row statistics are computed
// again (a row is a few hundred floats).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_pool.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jade::NoState;
using jade::v8;

constexpr int64_t kBlockRows = 128;  // Rows a task.

inline v8 load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store(float* p, v8 v) { *reinterpret_cast<v8*>(p) = v; }

inline float lanes(v8 s) {
  float total = 0.f;
  for (int h = 0; h < 8; ++h) total += s[h];
  return total;
}

// sum of a row's d values (d a multiple of 8).
inline float row_sum(const float* x, int64_t d) {
  v8 s0{}, s1{};
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    s0 += load(x + j);
    s1 += load(x + j + 8);
  }
  if (j < d) s0 += load(x + j);
  return lanes(s0 + s1);
}

// 1 / sqrt(mean((x - shift)^2) + eps) over a row's d values.
inline float inverse_root(const float* x, int64_t d, float shift, float eps) {
  const v8 mv = v8{} + shift;
  v8 s0{}, s1{};
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const v8 a = load(x + j) - mv, b = load(x + j + 8) - mv;
    s0 += a * a;
    s1 += b * b;
  }
  if (j < d) {
    const v8 a = load(x + j) - mv;
    s0 += a * a;
  }
  return 1.f / std::sqrt(lanes(s0 + s1) / static_cast<float>(d) + eps);
}

// The mean and 1 / sqrt(var + eps) of a row.
inline void moments(const float* x, int64_t d, float eps, float* mean,
                    float* rstd) {
  *mean = row_sum(x, d) / static_cast<float>(d);
  *rstd = inverse_root(x, d, *mean, eps);
}

// Calls fn(t, r0, r1) for each block t of `kBlockRows` rows [r0, r1) of
// `rows`, on XLA's threads.
inline int64_t blocks(int64_t rows) {
  return (rows + kBlockRows - 1) / kBlockRows;
}
template <class F>
void for_blocks(ffi::ThreadPool& pool, int64_t rows, const F& fn) {
  jade::run_all<NoState>(pool, blocks(rows), [&](int64_t t, NoState&) {
    fn(t, t * kBlockRows, std::min(rows, (t + 1) * kBlockRows));
  });
}

// The width of x's rows (its last dimension; 0 for a scalar).
inline int64_t width_of(const ffi::AnyBuffer& x) {
  const auto xd = x.dimensions();
  return xd.size() ? xd[xd.size() - 1] : 0;
}

// Rows and width of x; scale (and bias) `[d]`; d a multiple of 8.
ffi::Error shape_of(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                    int64_t* rows, int64_t* d) {
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::F32 ||
      scale.element_type() != ffi::DataType::F32 || xd.size() < 1)
    return ffi::Error::InvalidArgument("layer norm: float32 [..., d]");
  *d = xd[xd.size() - 1];
  if (*d <= 0 || *d % 8 != 0 ||
      static_cast<int64_t>(scale.element_count()) != *d)
    return ffi::Error::InvalidArgument(
        "layer norm: d a multiple of 8, scale [d]");
  *rows = static_cast<int64_t>(x.element_count()) / *d;
  return ffi::Error::Success();
}

ffi::Error forward_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                        ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> y, float eps) {
  int64_t rows, d;
  if (auto e = shape_of(x, scale, &rows, &d); e.failure()) return e;
  if (bias.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(bias.element_count()) != d ||
      y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("layer norm: bias [d], y like x");
  const float* src = x.typed_data<float>();
  const float* w = scale.typed_data<float>();
  const float* b = bias.typed_data<float>();
  float* dst = y->typed_data<float>();
  for_blocks(pool, rows, [&](int64_t, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = src + r * d;
      float* out = dst + r * d;
      float mean, rstd;
      moments(in, d, eps, &mean, &rstd);
      const v8 mv = v8{} + mean, rv = v8{} + rstd;
      for (int64_t j = 0; j < d; j += 8)
        store(out + j, (load(in + j) - mv) * rv * load(w + j) + load(b + j));
    }
  });
  return ffi::Error::Success();
}

// The weights' gradients come out as each block's sums (`sums`, `[blocks,
// 2, d]`: of dy * xhat, then of dy), added up by the caller: the kernel
// allocates nothing (a block of the heap taken mid-step can pin glibc's
// heap above a step's freed scratch).
ffi::Error backward_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                         ffi::AnyBuffer scale, ffi::AnyBuffer dy,
                         ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> sums, float eps) {
  int64_t rows, d;
  if (auto e = shape_of(x, scale, &rows, &d); e.failure()) return e;
  if (dy.element_type() != ffi::DataType::F32 ||
      dy.element_count() != x.element_count() ||
      dx->element_count() != x.element_count() ||
      static_cast<int64_t>(sums->element_count()) != blocks(rows) * 2 * d)
    return ffi::Error::InvalidArgument(
        "layer norm backward: dy and dx like x, sums [blocks, 2, d]");
  const float* src = x.typed_data<float>();
  const float* w = scale.typed_data<float>();
  const float* g = dy.typed_data<float>();
  float* out = dx->typed_data<float>();
  float* parts = sums->typed_data<float>();
  const float inv_d = 1.f / static_cast<float>(d);
  for_blocks(pool, rows, [&](int64_t t, int64_t r0, int64_t r1) {
    float* ps = parts + t * 2 * d;
    float* pb = ps + d;
    std::fill(ps, ps + 2 * d, 0.f);
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = src + r * d;
      const float* gr = g + r * d;
      float mean, rstd;
      moments(in, d, eps, &mean, &rstd);
      const v8 mv = v8{} + mean, rv = v8{} + rstd;
      v8 sg{}, sgx{};
      for (int64_t j = 0; j < d; j += 8) {
        const v8 xhat = (load(in + j) - mv) * rv, gj = load(gr + j);
        const v8 gw = gj * load(w + j);
        sg += gw;
        sgx += gw * xhat;
        store(ps + j, load(ps + j) + gj * xhat);
        store(pb + j, load(pb + j) + gj);
      }
      const v8 a = v8{} + lanes(sg) * inv_d, c = v8{} + lanes(sgx) * inv_d;
      float* o = out + r * d;
      for (int64_t j = 0; j < d; j += 8) {
        const v8 xhat = (load(in + j) - mv) * rv;
        store(o + j, rv * (load(gr + j) * load(w + j) - a - xhat * c));
      }
    }
  });
  return ffi::Error::Success();
}

// Rows scaled to a root mean square of `scale` (Trax's `length_normalized`
// times `scale`): y = x / sqrt(mean(x^2) + eps) * scale.
ffi::Error unit_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> y, float eps, float scale) {
  const int64_t d = width_of(x);
  if (x.element_type() != ffi::DataType::F32 || d <= 0 || d % 8 != 0 ||
      y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "unit rows: float32 [..., d], d a multiple of 8, y like x");
  const int64_t rows = static_cast<int64_t>(x.element_count()) / d;
  const float* src = x.typed_data<float>();
  float* dst = y->typed_data<float>();
  for_blocks(pool, rows, [&](int64_t, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = src + r * d;
      const v8 f = v8{} + inverse_root(in, d, 0.f, eps) * scale;
      for (int64_t j = 0; j < d; j += 8) store(dst + r * d + j, load(in + j) * f);
    }
  });
  return ffi::Error::Success();
}

// Their gradient: dx = scale r (dy - xhat mean(dy xhat)), r = 1 / sqrt(
// mean(x^2) + eps), xhat = x r.
ffi::Error unit_backward_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                              ffi::AnyBuffer dy,
                              ffi::Result<ffi::AnyBuffer> dx, float eps,
                              float scale) {
  const int64_t d = width_of(x);
  if (x.element_type() != ffi::DataType::F32 ||
      dy.element_type() != ffi::DataType::F32 || d <= 0 || d % 8 != 0 ||
      dy.element_count() != x.element_count() ||
      dx->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "unit rows backward: float32 x, dy and dx alike, d a multiple of 8");
  const int64_t rows = static_cast<int64_t>(x.element_count()) / d;
  const float* src = x.typed_data<float>();
  const float* g = dy.typed_data<float>();
  float* out = dx->typed_data<float>();
  const float inv_d = 1.f / static_cast<float>(d);
  for_blocks(pool, rows, [&](int64_t, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = src + r * d;
      const float* gr = g + r * d;
      const v8 rv = v8{} + inverse_root(in, d, 0.f, eps);
      v8 sgx{};
      for (int64_t j = 0; j < d; j += 8) sgx += load(gr + j) * load(in + j) * rv;
      const v8 c = v8{} + lanes(sgx) * inv_d, f = rv * scale;
      for (int64_t j = 0; j < d; j += 8)
        store(out + r * d + j, f * (load(gr + j) - load(in + j) * rv * c));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeUnitRows, unit_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeUnitRowsBackward, unit_backward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeLayerNorm, forward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeLayerNormBackward, backward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));
