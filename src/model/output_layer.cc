// The output layer and its softmax cross-entropy for one chunk of rows,
// fused on AMX tiles (bfloat16 products summed in float32:
// `precision.products = 'bfloat16'` on a CPU with AMX), for XLA's CPU
// backend (src/model/output_layer.py; src/model/losses.py's `_fused_loss`).
// XLA ran the chunk as three products and four element-wise passes over its
// `[vocab, rows]` logits, every one through memory (64 MB a pass at
// vocabulary 31,392 and 512 rows); here a block of vocabulary rows at a
// time stays in cache: its logits are made twice (once for the rows'
// maximum and sum of exponentials, once for the gradient), and the
// gradient's block feeds both gradient products at once. Operands are
// packed as whole tiles (16 rows of 64 contiguous bytes): tiles read with
// a 1-2 KB stride ran at ~45-70% of the packed rate (BENCHMARKS.md "The
// output layer fused on AMX tiles"). Built and loaded by
// src/model/kernels.py; never edited there.
//
// `JadeOutputPack`: the kernel `[v, d]` float32 -> its packed bfloat16
// pairs (both products' operands, `pack_words` words), once a step.
// `JadeOutputChunk`: packed kernel, rows `[c, d]`, bias `[v]`, int32
// targets `[c]` (clamped into [0, v)), weights `[c]`, the kernel's
// gradient so far `[vp, d]` (vp: v up to a multiple of 32; aliased to
// the output) -> the weighted loss of each row `[c]`, its hit `[c]`, the
// bias's gradient `[v]`, the rows' gradient as `[d, c]`, the kernel's
// gradient with this chunk's added `[vp, d]`. c and d are multiples of 32.
//   top = max_v (logits + bias), total = sum_v exp(logits + bias - top)
//   loss = w (top + log total - true), g = (exp(. - top) / total - onehot) w
// with g rounded to bfloat16 (as XLA's convert) for both products.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "bf16.h"
#include "cpu_pool.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
#if defined(JADE_AMX)

using jade::pair;
using jade::v8;
using jade::v8i;
using jade::vexp;

// Vocabulary rows a block (its logits: 512 KB at 512 rows).
constexpr int64_t kBlock = 256;
constexpr int64_t kTile = 256;  // Words a tile.

inline int64_t up32(int64_t n) { return (n + 31) / 32 * 32; }

// The packed kernel: A tiles of the logits' product (rows v, pairs along
// d: [vp/16][d/32] tiles), then A tiles of the rows' gradient product
// (rows d, pairs across v: [vp/32][d/16] tiles).
int64_t pack_words(int64_t v, int64_t d) { return up32(v) * d; }

// C [rows, cols] (+)= A B on tiles: A's tile (row panel r/16, pair group q)
// at a + (r/16) * ar + q * aq words; B as panels of 16 columns ([cols/16]
// panels of `pairs` x 16 words); C row-major (`ldc` floats). rows, cols
// multiples of 32; pairs of 16.
void tiles_gemm(int64_t rows, int64_t cols, int64_t pairs, const uint32_t* a,
                int64_t ar, int64_t aq, const uint32_t* b, float* c,
                int64_t ldc, bool accumulate) {
  const int64_t groups = pairs / 16, cs = ldc * 4, panel = pairs * 16;
  for (int64_t r = 0; r < rows; r += 32)
    for (int64_t j = 0; j < cols; j += 32) {
      float* c0 = c + r * ldc + j;
      float* c1 = c0 + 16 * ldc;
      if (accumulate) {
        _tile_loadd(0, c0, cs);
        _tile_loadd(1, c0 + 16, cs);
        _tile_loadd(2, c1, cs);
        _tile_loadd(3, c1 + 16, cs);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      const uint32_t* a0 = a + (r / 16) * ar;
      const uint32_t* a1 = a0 + ar;
      const uint32_t* b0 = b + (j / 16) * panel;
      const uint32_t* b1 = b0 + panel;
      for (int64_t q = 0; q < groups; ++q) {
        _tile_loadd(4, a0 + q * aq, 64);
        _tile_loadd(5, a1 + q * aq, 64);
        _tile_loadd(6, b0 + q * kTile, 64);
        _tile_loadd(7, b1 + q * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, cs);
      _tile_stored(1, c0 + 16, cs);
      _tile_stored(2, c1, cs);
      _tile_stored(3, c1 + 16, cs);
    }
}

// Words of x's rows ([rows, cols] floats, `ldx` a row) as B panels of pairs
// across rows: panel p16 holds (x[2p, j], x[2p + 1, j]) at [p][j % 16];
// rows and cols even / multiples of 16 as the callers use them.
void panels_across_rows(int64_t rows, int64_t cols, const float* x,
                        int64_t ldx, uint32_t* out) {
  const int64_t pairs = rows / 2;
  std::vector<uint32_t> row(cols);
  for (int64_t p = 0; p < pairs; ++p) {
    jade::pairs_across_rows(2, cols, x + 2 * p * ldx, ldx, row.data(), cols);
    for (int64_t j = 0; j < cols; j += 16)
      std::memcpy(out + (j / 16) * pairs * 16 + p * 16, row.data() + j, 64);
  }
}

// Words of x's rows as pairs along each row, [rows, cols / 2].
void words_in_rows(int64_t rows, int64_t cols, const float* x, int64_t ldx,
                   uint32_t* out) {
  jade::pairs_in_rows(rows, cols, x, ldx, out, cols / 2);
}

// A tiles from words `w` ([rows, pairs], row-major): [rows/16][pairs/16].
void tiles_from_words(int64_t rows, int64_t pairs, const uint32_t* w,
                      uint32_t* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < pairs; q += 16)
      std::memcpy(out + ((r / 16) * (pairs / 16) + q / 16) * kTile +
                      (r % 16) * 16,
                  w + r * pairs + q, 64);
}

// B panels of pairs along each of `cols` rows: `w` is `[cols, pairs]`
// row-major (`words_in_rows`), panel j / 16 holds w[j, p] at [p][j % 16].
void panels_from_column_words(int64_t cols, int64_t pairs, const uint32_t* w,
                              uint32_t* out) {
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t p = 0; p < pairs; ++p)
      out[(j / 16) * pairs * 16 + p * 16 + j % 16] = w[j * pairs + p];
}

bool is_f32(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F32;
}

struct Call {
  int64_t v, vp, c, d;
  const uint32_t *ka, *kb;
  const float *bias, *w;
  const int32_t* t;
  std::vector<uint32_t> xb, xa;  // The rows as the products' B panels.
  float bias_at(int64_t i) const { return i < v ? bias[i] : -INFINITY; }
  int64_t blocks() const { return (vp + kBlock - 1) / kBlock; }
  int64_t rows(int64_t block) const {
    return std::min(kBlock, vp - block * kBlock);
  }
  // The logits of a block's rows, [rows, c] into `l`.
  void logits(int64_t block, float* l) const {
    const int64_t r0 = block * kBlock;
    tiles_gemm(rows(block), c, d / 2, ka + (r0 / 16) * (d / 32) * kTile,
               (d / 32) * kTile, kTile, xb.data(), l, c, false);
  }
};

struct Scratch {
  std::vector<float> l;
  std::vector<uint32_t> words, ga, gb;
};

// A block's maximum and its sum of exponentials (from that maximum), per row
// of the chunk (`m`, `s`, c each).
void first_pass(const Call& k, int64_t block, Scratch& w, float* m,
                float* s) {
  const int64_t rows = k.rows(block), r0 = block * kBlock, c = k.c;
  w.l.resize(kBlock * c);
  k.logits(block, w.l.data());
  std::fill(m, m + c, -FLT_MAX);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w.l.data() + r * c;
    const float add = k.bias_at(r0 + r);
    for (int64_t j = 0; j < c; j += 8) {
      const v8 x = *reinterpret_cast<const v8*>(row + j) + add;
      v8& t = *reinterpret_cast<v8*>(m + j);
      t = x > t ? x : t;
    }
  }
  for (int64_t j = 0; j < c; j += 8)
    *reinterpret_cast<v8*>(s + j) = v8{};
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w.l.data() + r * c;
    const float add = k.bias_at(r0 + r);
    for (int64_t j = 0; j < c; j += 8)
      *reinterpret_cast<v8*>(s + j) +=
          vexp(*reinterpret_cast<const v8*>(row + j) + add -
               *reinterpret_cast<const v8*>(m + j));
  }
}

// A block's gradient rows, their bias sums and true logits, and both
// gradient products: dk rows += g x, dxT += K^T g.
void second_pass(const Call& k, int64_t block, Scratch& w, const float* top,
                 const float* inv, float* truth, float* db, float* dk,
                 float* dxt) {
  const int64_t rows = k.rows(block), r0 = block * kBlock, c = k.c,
                d = k.d;
  w.l.resize(kBlock * c);
  k.logits(block, w.l.data());
  for (int64_t r = 0; r < rows; ++r) {
    float* row = w.l.data() + r * c;
    const int64_t at = r0 + r;
    const float add = k.bias_at(at);
    v8 sum{};
    for (int64_t j = 0; j < c; j += 8) {
      const v8 x = *reinterpret_cast<const v8*>(row + j) + add;
      const v8 e = vexp(x - *reinterpret_cast<const v8*>(top + j));
      const v8i hit = *reinterpret_cast<const v8i*>(k.t + j) == int32_t(at);
      const v8 one =
          reinterpret_cast<v8>(hit & reinterpret_cast<v8i>(v8{} + 1.f));
      const v8 g = (e * *reinterpret_cast<const v8*>(inv + j) - one) *
                   *reinterpret_cast<const v8*>(k.w + j);
      *reinterpret_cast<v8*>(row + j) = g;
      sum += g;
      for (int i = 0; i < 8; ++i)
        if (hit[i]) truth[j + i] = x[i];
    }
    if (at < k.v) {
      float total = 0.f;
      for (int i = 0; i < 8; ++i) total += sum[i];
      db[at] = total;
    }
  }
  // dk rows [r0, r0 + rows) += g [rows, c] x [c, d]: g's tiles, pairs along c.
  w.words.resize(kBlock * c / 2);
  w.ga.resize(kBlock * c / 2);
  words_in_rows(rows, c, w.l.data(), c, w.words.data());
  tiles_from_words(rows, c / 2, w.words.data(), w.ga.data());
  tiles_gemm(rows, d, c / 2, w.ga.data(), (c / 32) * kTile, kTile,
             k.xa.data(), dk + r0 * d, d, true);
  // dxT [d, c] += K^T [d, rows] g [rows, c]: g's panels, pairs across rows.
  w.gb.resize(kBlock * c / 2);
  panels_across_rows(rows, c, w.l.data(), c, w.gb.data());
  tiles_gemm(d, c, rows / 2, k.kb + (r0 / 32) * (d / 16) * kTile, kTile,
             (d / 16) * kTile, w.gb.data(), dxt, c, true);
}

// XLA's pool threads lend AMX's tiles for a task: configured, released.
struct Tiles {
  Tiles() {
    static const jade::TileConfig config;
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
};
#endif

// The handlers: on AMX tiles where the library was built for them; without
// AMX they refuse (src/model/output_layer.py never calls them there:
// `kernels.amx()` is False).
ffi::Error pack_impl(ffi::ThreadPool pool, ffi::AnyBuffer kernel,
                     ffi::Result<ffi::AnyBuffer> out) {
#if !defined(JADE_AMX)
  return ffi::Error::InvalidArgument("output layer: built without AMX");
#else
  const auto dims = kernel.dimensions();
  if (!is_f32(kernel) || dims.size() != 2 || dims[1] % 32 ||
      out->element_type() != ffi::DataType::U32 ||
      int64_t(out->element_count()) != pack_words(dims[0], dims[1]))
    return ffi::Error::InvalidArgument(
        "output pack: float32 [v, d] (d a multiple of 32) -> uint32 words");
  const int64_t v = dims[0], d = dims[1], vp = up32(v);
  const float* k = kernel.typed_data<float>();
  uint32_t* ka = out->typed_data<uint32_t>();
  uint32_t* kb = ka + vp * d / 2;
  // 32 rows a task, the rows past v zero.
  const int64_t groups = vp / 32;
  jade::run_all<jade::NoState>(pool, groups, [&](int64_t g, jade::NoState&) {
    std::vector<float> rows(32 * d);
    float* x = rows.data();
    for (int64_t r = 0; r < 32; ++r) {
      const int64_t at = g * 32 + r;
      if (at < v)
        std::memcpy(x + r * d, k + at * d, d * 4);
      else
        std::memset(x + r * d, 0, d * 4);
    }
    std::vector<uint32_t> w(32 * d / 2);
    words_in_rows(32, d, x, d, w.data());
    // ka: tiles of rows [32g, 32g + 32): two row panels.
    tiles_from_words(32, d / 2, w.data(), ka + g * 2 * (d / 32) * kTile);
    // kb: rows d (panels of 16), the 16 pairs across these 32 rows.
    std::vector<uint32_t> across(16 * d);
    jade::pairs_across_rows(32, d, x, d, across.data(), d);
    uint32_t* to = kb + g * (d / 16) * kTile;
    for (int64_t kp = 0; kp < d / 16; ++kp)
      for (int64_t kk = 0; kk < 16; ++kk)
        for (int64_t p = 0; p < 16; ++p)
          to[kp * kTile + kk * 16 + p] = across[p * d + kp * 16 + kk];
  });
  return ffi::Error::Success();
#endif
}

ffi::Error chunk_impl(ffi::ThreadPool pool, ffi::AnyBuffer packed,
                     ffi::AnyBuffer rows, ffi::AnyBuffer bias,
                     ffi::AnyBuffer targets, ffi::AnyBuffer weights,
                     ffi::AnyBuffer dk_in, ffi::Result<ffi::AnyBuffer> loss,
                     ffi::Result<ffi::AnyBuffer> hits,
                     ffi::Result<ffi::AnyBuffer> dbias,
                     ffi::Result<ffi::AnyBuffer> dxt,
                     ffi::Result<ffi::AnyBuffer> dk) {
#if !defined(JADE_AMX)
  return ffi::Error::InvalidArgument("output layer: built without AMX");
#else
  const auto rd = rows.dimensions();
  if (!is_f32(rows) || rd.size() != 2 || rd[0] % 32 || rd[1] % 32)
    return ffi::Error::InvalidArgument(
        "output chunk: float32 rows [c, d], multiples of 32");
  Call k;
  k.c = rd[0], k.d = rd[1], k.v = bias.element_count(), k.vp = up32(k.v);
  const int64_t c = k.c, d = k.d, v = k.v, vp = k.vp;
  if (!jade::amx_allowed() || v == 0 || !is_f32(bias) || !is_f32(weights) ||
      int64_t(weights.element_count()) != c ||
      targets.element_type() != ffi::DataType::S32 ||
      int64_t(targets.element_count()) != c ||
      packed.element_type() != ffi::DataType::U32 ||
      int64_t(packed.element_count()) != pack_words(v, d) ||
      !is_f32(dk_in) || int64_t(dk_in.element_count()) != vp * d ||
      !is_f32(*dk) || int64_t(dk->element_count()) != vp * d ||
      !is_f32(*loss) || int64_t(loss->element_count()) != c ||
      !is_f32(*hits) || int64_t(hits->element_count()) != c ||
      !is_f32(*dbias) || int64_t(dbias->element_count()) != v ||
      !is_f32(*dxt) || int64_t(dxt->element_count()) != d * c)
    return ffi::Error::InvalidArgument(
        "output chunk: AMX; packed kernel, rows [c, d], bias [v], int32 "
        "targets [c], weights [c], kernel gradient [vp, d]");
  k.ka = packed.typed_data<uint32_t>();
  k.kb = k.ka + vp * d / 2;
  k.bias = bias.typed_data<float>();
  k.w = weights.typed_data<float>();
  std::vector<int32_t> t(c);
  const int32_t* t_in = targets.typed_data<int32_t>();
  for (int64_t j = 0; j < c; ++j)
    t[j] = std::clamp<int32_t>(t_in[j], 0, int32_t(v - 1));
  k.t = t.data();
  float* dk_out = dk->typed_data<float>();
  if (dk_out != dk_in.typed_data<float>())  // Not aliased: start from it.
    std::memcpy(dk_out, dk_in.typed_data<float>(), vp * d * 4);
  // The rows as B panels: pairs along d (logits), pairs across rows (dk).
  const float* x = rows.typed_data<float>();
  std::vector<uint32_t> words(c * d / 2);
  words_in_rows(c, d, x, d, words.data());
  k.xb.resize(c * d / 2);
  panels_from_column_words(c, d / 2, words.data(), k.xb.data());
  k.xa.resize(c * d / 2);
  panels_across_rows(c, d, x, d, k.xa.data());

  const int64_t blocks = k.blocks();
  std::vector<float> m(blocks * c), s(blocks * c);
  jade::run_all<Scratch>(pool, blocks, [&](int64_t b, Scratch& w) {
    Tiles tiles;
    first_pass(k, b, w, m.data() + b * c, s.data() + b * c);
  });
  std::vector<float> top(c), inv(c), truth(c, 0.f);
  for (int64_t j = 0; j < c; ++j) {
    float high = -FLT_MAX;
    for (int64_t b = 0; b < blocks; ++b) high = std::max(high, m[b * c + j]);
    float total = 0.f;
    for (int64_t b = 0; b < blocks; ++b)
      total += s[b * c + j] * std::exp(m[b * c + j] - high);
    top[j] = high, inv[j] = 1.f / total, s[j] = total;
  }
  float* db = dbias->typed_data<float>();
  float* dx = dxt->typed_data<float>();
  std::memset(dx, 0, d * c * 4);
  // Each thread's K^T g in its own sums, added once every block is done.
  std::mutex adding;
  std::vector<std::unique_ptr<std::vector<float>>> sums;
  struct Worker : Scratch {
    std::vector<float>* dxt = nullptr;
  };
  jade::run_all<Worker>(pool, blocks, [&](int64_t b, Worker& w) {
    if (!w.dxt) {
      std::lock_guard<std::mutex> lock(adding);
      sums.push_back(std::make_unique<std::vector<float>>(d * c, 0.f));
      w.dxt = sums.back().get();
    }
    Tiles tiles;
    second_pass(k, b, w, top.data(), inv.data(), truth.data(), db, dk_out,
                w.dxt->data());
  });
  for (const auto& sum : sums)
    for (int64_t i = 0; i < d * c; ++i) dx[i] += (*sum)[i];
  float* out_loss = loss->typed_data<float>();
  float* out_hits = hits->typed_data<float>();
  for (int64_t j = 0; j < c; ++j) {
    out_loss[j] = k.w[j] * (top[j] + std::log(s[j]) - truth[j]);
    out_hits[j] = truth[j] >= top[j] ? 1.f : 0.f;
  }
  return ffi::Error::Success();
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeOutputPack, pack_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeOutputChunk, chunk_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
