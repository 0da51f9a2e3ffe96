// float32 -> bfloat16 for XLA's CPU backend, as opaque calls: the rounding
// of a bfloat16 product's left operand (`precision.products`,
// src/model/precision.py), and, where that operand's contracted dimension
// comes before its rows, the rounding and the transpose in one pass.
// XLA folds a transpose of its own into the product it feeds (and the
// product's operands into each other's places), and YNNPACK, which runs
// bfloat16 products, takes only a left operand whose contracted dimension
// is its last: a product XLA leaves in another layout goes to its own dot,
// which cannot run bfloat16 (BENCHMARKS.md "bfloat16 products in the whole
// step"). XLA cannot see through these calls.
// Rounding: XLA's convert (`jade::to_bf16`, bf16.h). Built and loaded by
// src/model/kernels.py; never edited there.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jade::NoState;
using jade::to_bf16;

bool f32_to_bf16(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  return x.element_type() == ffi::DataType::F32 &&
         y.element_type() == ffi::DataType::BF16 &&
         x.element_count() == y.element_count();
}

// y = bfloat16(x), any shape (the same).
ffi::Error cast_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> y) {
  if (!f32_to_bf16(x, *y))
    return ffi::Error::InvalidArgument("bf16 cast: float32 in, bfloat16 out");
  constexpr int64_t kBlock = 1 << 16;
  const int64_t n = x.element_count();
  const float* in = x.typed_data<float>();
  auto* out = static_cast<uint16_t*>(y->untyped_data());
  jade::run_all<NoState>(pool, (n + kBlock - 1) / kBlock,
                         [&](int64_t t, NoState&) {
                           const int64_t a = t * kBlock;
                           const int64_t b = std::min(n, a + kBlock);
                           for (int64_t i = a; i < b; ++i) out[i] = to_bf16(in[i]);
                         });
  return ffi::Error::Success();
}

// y[b, m, k] = bfloat16(x[b, k, m]), in tiles of 64 x 64 (each read and
// written within the cache).
ffi::Error cast_transpose_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                               ffi::Result<ffi::AnyBuffer> y) {
  auto d = x.dimensions(), e = y->dimensions();
  if (!f32_to_bf16(x, *y) || d.size() != 3 || e.size() != 3 || e[0] != d[0] ||
      e[1] != d[2] || e[2] != d[1])
    return ffi::Error::InvalidArgument(
        "bf16 cast-transpose: float32 [b, k, m] in, bfloat16 [b, m, k] out");
  constexpr int64_t kTile = 64;
  const int64_t rows = d[1], cols = d[2];
  const int64_t tk = (rows + kTile - 1) / kTile, tm = (cols + kTile - 1) / kTile;
  const float* in = x.typed_data<float>();
  auto* out = static_cast<uint16_t*>(y->untyped_data());
  jade::run_all<NoState>(pool, d[0] * tk * tm, [&](int64_t t, NoState&) {
    const int64_t b = t / (tk * tm), tile = t % (tk * tm);
    const int64_t k0 = tile / tm * kTile, m0 = tile % tm * kTile;
    const int64_t k1 = std::min(rows, k0 + kTile);
    const int64_t m1 = std::min(cols, m0 + kTile);
    const float* src = in + b * rows * cols;
    uint16_t* dst = out + b * rows * cols;
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = k0; k < k1; ++k)
        dst[m * rows + k] = to_bf16(src[k * cols + m]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeCastBf16, cast_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeCastTransposeBf16, cast_transpose_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// 1 where the library was built for AVX512-BF16 (`kernels.native_bf16()`).
extern "C" int JadeNativeBf16() { return jade::kNativeBf16 ? 1 : 0; }

// 1 where the library was built for AMX and Linux lends its tiles
// (`kernels.amx()`): the attention kernel's bfloat16 products run on them.
extern "C" int JadeAmx() { return jade::amx_in_use() ? 1 : 0; }
