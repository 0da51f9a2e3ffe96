// Rows gathered by index, and their gradient (rows added back where they
// came from), for XLA's CPU backend: the LSH layer's sort of its queries
// and values into bucket order and its unsort of the outputs
// (src/model/attention.py through src/model/gather_rows.py). XLA's CPU
// gather moved ~2 GB/s here (BENCHMARKS.md "The LSH hash and the row
// gathers as kernels"); a row is a few hundred contiguous bytes, copied
// whole. Built and loaded by src/model/kernels.py; never edited there.
//
// gather: x `[..., n, d]` float32, idx `[..., m]` int32 -> `[..., m, d]`,
// row i of the output is row idx[i] of x (an index outside [0, n) is
// clamped, as XLA's gather clamps it).
// scatter-add: g `[..., m, d]`, idx `[..., m]`, n -> `[..., n, d]`, row j
// the sum of g's rows i with idx[i] = j (the gather's transpose).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jade::NoState;

// The shapes of a call: `groups` leading entries of `m` indices, rows of
// `d` floats, `n` rows to index.
struct Rows {
  int64_t groups, m, n, d;
};

ffi::Error rows_of(const ffi::AnyBuffer& rows, const ffi::AnyBuffer& idx,
                   int64_t n, Rows* r) {
  const auto rd = rows.dimensions(), id = idx.dimensions();
  if (rows.element_type() != ffi::DataType::F32 ||
      idx.element_type() != ffi::DataType::S32 || rd.size() < 2 ||
      id.size() + 1 != rd.size())
    return ffi::Error::InvalidArgument(
        "gather rows: float32 [..., rows, d] and int32 [..., m]");
  r->groups = 1;
  for (size_t i = 0; i + 2 < rd.size(); ++i) {
    if (id[i] != rd[i])
      return ffi::Error::InvalidArgument("gather rows: leading dimensions");
    r->groups *= rd[i];
  }
  r->m = id[id.size() - 1];
  r->d = rd[rd.size() - 1];
  r->n = n;
  return ffi::Error::Success();
}

inline int64_t clamped(int32_t i, int64_t n) {
  return std::min<int64_t>(std::max<int64_t>(i, 0), n - 1);
}

constexpr int64_t kRowsATask = 1024;

ffi::Error gather_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::AnyBuffer idx, ffi::Result<ffi::AnyBuffer> out) {
  Rows r;
  if (auto e = rows_of(x, idx, 0, &r); e.failure()) return e;
  r.n = x.dimensions()[x.dimensions().size() - 2];  // rows_of: rank >= 2.
  if (static_cast<int64_t>(out->element_count()) != r.groups * r.m * r.d)
    return ffi::Error::InvalidArgument("gather rows: output's size");
  if (r.n == 0 && r.m > 0)
    return ffi::Error::InvalidArgument("gather rows: no rows to gather");
  const float* src = x.typed_data<float>();
  const int32_t* at = idx.typed_data<int32_t>();
  float* dst = out->typed_data<float>();
  const int64_t per = (r.m + kRowsATask - 1) / kRowsATask;
  jade::run_all<NoState>(pool, r.groups * per, [&](int64_t t, NoState&) {
    const int64_t g = t / per, i0 = (t % per) * kRowsATask;
    const int64_t i1 = std::min(r.m, i0 + kRowsATask);
    const float* from = src + g * r.n * r.d;
    for (int64_t i = i0; i < i1; ++i)
      std::memcpy(dst + (g * r.m + i) * r.d,
                  from + clamped(at[g * r.m + i], r.n) * r.d,
                  r.d * sizeof(float));
  });
  return ffi::Error::Success();
}

// Each task owns a slice of columns of one group's output (no two tasks
// write the same float), and adds every row of g in order.
ffi::Error scatter_impl(ffi::ThreadPool pool, ffi::AnyBuffer g,
                        ffi::AnyBuffer idx, ffi::Result<ffi::AnyBuffer> out,
                        int64_t n) {
  Rows r;
  if (auto e = rows_of(g, idx, n, &r); e.failure()) return e;
  if (n < 0 ||
      static_cast<int64_t>(out->element_count()) != r.groups * r.n * r.d)
    return ffi::Error::InvalidArgument("scatter rows: output's size");
  if (r.n == 0 && r.m > 0)
    return ffi::Error::InvalidArgument("scatter rows: no rows to add to");
  const float* src = g.typed_data<float>();
  const int32_t* at = idx.typed_data<int32_t>();
  float* dst = out->typed_data<float>();
  std::memset(dst, 0, r.groups * r.n * r.d * sizeof(float));
  const int64_t parts =
      std::clamp<int64_t>(pool.num_threads(), 1, std::max<int64_t>(r.d / 8, 1));
  const int64_t width = (r.d + parts - 1) / parts;
  jade::run_all<NoState>(pool, r.groups * parts, [&](int64_t t, NoState&) {
    const int64_t grp = t / parts, c0 = (t % parts) * width;
    const int64_t c1 = std::min(r.d, c0 + width);
    float* to = dst + grp * r.n * r.d;
    for (int64_t i = 0; i < r.m; ++i) {
      const float* row = src + (grp * r.m + i) * r.d;
      float* into = to + clamped(at[grp * r.m + i], r.n) * r.d;
      for (int64_t c = c0; c < c1; ++c) into[c] += row[c];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeGatherRows, gather_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeScatterAddRows, scatter_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("n"));
