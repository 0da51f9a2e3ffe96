// Chunked attention for XLA's CPU backend, fused: Trax's
// `efficient_attention.attend` (chunks of `chunk` queries, each reading its
// own chunk and the `before` chunks ahead of it, wrapping around as Trax's
// `look_adjacent` does; Trax's `mask_self_attention`), forward and backward,
// a few query rows of a chunk at a time, their scores in cache. XLA runs the
// same computation as whole-length passes (scores, masks, log-sum-exp,
// exponentials, the adjacent-chunk copies), memory-bound at ~15% of the
// matmul rate (BENCHMARKS.md).
// Built and loaded by src/model/kernels.py; never edited there.
//
// Inputs carry any leading dimensions (vmap's): [..., n, d]. Keys arrive
// scaled as Trax scales them; positions (`qi`, `ki`) arrive as `attend`
// masks them (one-based). The chunks of a call are spread over XLA's own
// intra-op threads (the caller works too, so a busy pool never stalls it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16.h"
#include "cpu_pool.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jade::gemm;
using jade::kTileRows;
using jade::v8;
using jade::v8i;
using jade::vexp;

// row[j] = exp(row[j] - shift) for j < width; returns their sum.
inline float exp_row(float* row, int64_t width, float shift) {
  v8 total{};
  int64_t j = 0;
  for (; j + 8 <= width; j += 8) {
    v8 e = vexp(*reinterpret_cast<v8*>(row + j) - shift);
    *reinterpret_cast<v8*>(row + j) = e;
    total += e;
  }
  float sum = 0.f;
  for (int h = 0; h < 8; ++h) sum += total[h];
  for (; j < width; ++j) sum += (row[j] = std::exp(row[j] - shift));
  return sum;
}

struct Shape {
  int64_t batch, n, d, dv, chunk, before, chunks, width;  // width: keys a row.
  int64_t rows;   // Query rows a pass takes at once (its scores in cache).
  int64_t group;  // Chunks one backward task takes (see Backward).
  bool causal, exclude_self, masked;
  bool bf16;  // Products of bfloat16 inputs (flag 8 where the CPU has them).
  bool every_tile;  // Flag 16: score every key tile (see `Call::mark_tiles`).

  // The chunk whose keys fill slot `a` of chunk c's window (Trax's
  // `look_adjacent`: the `before` chunks ahead of it, wrapped, then itself).
  int64_t key_chunk(int64_t c, int64_t a) const {
    int64_t k = (c - before + a) % chunks;
    return k < 0 ? k + chunks : k;
  }
  int64_t row_blocks() const { return (chunk + rows - 1) / rows; }
  // Tiles of 16 keys a chunk (the products' column tiles; the last may be
  // shorter).
  int64_t tiles() const { return (chunk + 15) / 16; }
  int64_t tile_end(int64_t t) const { return std::min(t * 16 + 16, chunk); }
  // Row stride of a chunk's transposed keys: padded, so the rows of a
  // power-of-two chunk do not all fall in the same cache sets.
  int64_t ldt() const { return chunk + 16; }
  static int64_t pairs(int64_t n) { return (n + 1) / 2; }
};

// Trax's `mask_self_attention`, the same float operations.
inline float masked(const Shape& s, float dot, int32_t qi, int32_t ki) {
  if (s.causal && qi < ki) dot -= 1e9f;
  if (s.exclude_self && qi == ki) dot -= 1e5f;
  if (s.masked && ki < 0) dot -= 1e9f;
  return dot;
}

// Trax's mask over `cols` scores of one query row against keys `ki`.
inline void mask_row(const Shape& s, float* row, int32_t qi,
                     const int32_t* ki, int64_t cols) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    v8 x = *reinterpret_cast<v8*>(row + j);
    const v8i k = *reinterpret_cast<const v8i*>(ki + j);
    if (s.causal) x = qi < k ? x - 1e9f : x;
    if (s.exclude_self) x = qi == k ? x - 1e5f : x;
    if (s.masked) x = k < 0 ? x - 1e9f : x;
    *reinterpret_cast<v8*>(row + j) = x;
  }
  for (; j < cols; ++j) row[j] = masked(s, row[j], qi, ki[j]);
}

// The largest of row[0 .. width).
inline float row_max(const float* row, int64_t width) {
  v8 top = v8{} - INFINITY;
  int64_t j = 0;
  for (; j + 8 <= width; j += 8) {
    const v8 x = *reinterpret_cast<const v8*>(row + j);
    top = x > top ? x : top;
  }
  float m = -INFINITY;
  for (int h = 0; h < 8; ++h) m = std::max(m, top[h]);
  for (; j < width; ++j) m = std::max(m, row[j]);
  return m;
}

// A thread's working memory: scores, gradients, and the window's keys and
// values transposed (`[before + 1, d, ldt]`: a row's scores are then
// products over contiguous keys), kept while the thread stays in a chunk.
// Under `bf16` the products read their inputs as bfloat16 pairs (bf16.h):
// the window's keys and values paired along their features and transposed
// (`kp`, `vp`: `[before + 1, pairs(d), ldt]`) or paired across consecutive
// keys (`kn`, `vn`: `[before + 1, pairs(chunk), d]`), and the rows of a
// pass paired along (`ra`) or across them (`rn`, `ga`).
struct Scratch {
  std::vector<float> p, g, kt, vt;
  int64_t kt_of = -1, vt_of = -1;  // The (batch, chunk) they hold.
  std::vector<uint32_t> kp, vp, kn, vn, ra, qn, gn, ga, tmp;
  int64_t kp_of = -1, vp_of = -1, kn_of = -1, vn_of = -1;
  std::vector<uint8_t> live;  // [before + 1, tiles]: the pass's live tiles.
};

// Calls fn(j0, cols) for each run of consecutive live tiles of a slot
// (`live`: its `s.tiles()` flags), in groups of `group` tiles from the
// slot's first: a group with a live tile is read whole.
template <class F>
void live_runs(const Shape& s, const uint8_t* live, F fn, int64_t group = 1) {
  auto alive = [&](int64_t g) {
    for (int64_t t = g * group; t < std::min((g + 1) * group, s.tiles()); ++t)
      if (live[t]) return true;
    return false;
  };
  const int64_t groups = (s.tiles() + group - 1) / group;
  for (int64_t g = 0; g < groups;) {
    int64_t e = g;
    while (e < groups && alive(e)) ++e;
    if (e > g) {
      const int64_t last = std::min(e * group, s.tiles()) - 1;
      fn(g * group * 16, s.tile_end(last) - g * group * 16);
    }
    g = e + 1;
  }
}

// The inputs of one call.
struct Call {
  Shape s;
  const float *q, *k, *v;
  const int32_t *qi, *ki;

  // `x`'s rows of chunk c's window (batch b), transposed into `out`.
  void window(const float* x, int64_t dim, int64_t b, int64_t c,
              std::vector<float>& out, int64_t& of) const {
    if (of == b * s.chunks + c) return;
    out.resize((s.before + 1) * dim * s.ldt());
    for (int64_t a = 0; a <= s.before; ++a) {
      const int64_t k0 = b * s.n + s.key_chunk(c, a) * s.chunk;
      jade::transpose32(s.chunk, dim, x + k0 * dim, dim,
                        out.data() + a * dim * s.ldt(), s.ldt());
    }
    of = b * s.chunks + c;
  }

  // `x`'s rows of chunk c's window (batch b) as bfloat16 pairs into `out`:
  // `across` consecutive rows (`[before + 1, pairs(chunk), dim]`), or along
  // each row's features, transposed (`[before + 1, pairs(dim), ldt]`).
  void window_pairs(const float* x, int64_t dim, int64_t b, int64_t c,
                    bool across, std::vector<uint32_t>& out, int64_t& of,
                    std::vector<uint32_t>& tmp) const {
    if (of == b * s.chunks + c) return;
    const int64_t dp = Shape::pairs(dim);
    const int64_t slot = across ? Shape::pairs(s.chunk) * dim : dp * s.ldt();
    out.resize((s.before + 1) * slot);
    tmp.resize(s.chunk * dp);
    for (int64_t a = 0; a <= s.before; ++a) {
      const float* x0 = x + (b * s.n + s.key_chunk(c, a) * s.chunk) * dim;
      uint32_t* to = out.data() + a * slot;
      if (across) {
        jade::pairs_across_rows(s.chunk, dim, x0, dim, to, dim);
      } else {
        jade::pairs_in_rows(s.chunk, dim, x0, dim, tmp.data(), dp);
        jade::transpose32(s.chunk, dp, tmp.data(), dp, to, s.ldt());
      }
    }
    of = b * s.chunks + c;
  }

  // `m` rows of A (row-major, `lda` floats a row, `depth` wide) paired
  // along their values into `w.ra` (`pairs(depth)` words a row).
  const uint32_t* rows_paired(int64_t m, int64_t depth, const float* a,
                              int64_t lda, Scratch& w) const {
    w.ra.resize(m * Shape::pairs(depth));
    jade::pairs_in_rows(m, depth, a, lda, w.ra.data(), Shape::pairs(depth));
    return w.ra.data();
  }

  // C (+)= A B of `m` rows of A paired as `rows_paired` pairs them, by the
  // window's pairs `bp` (`ldb` words a row).
  static void product_bf16(int64_t m, int64_t cols, int64_t depth,
                           const uint32_t* ap, const uint32_t* bp, int64_t ldb,
                           float* c, int64_t ldc, bool accumulate) {
    const int64_t pa = Shape::pairs(depth);
    jade::gemm_bf16(m, cols, pa, ap, pa, 1, bp, ldb, c, ldc, accumulate);
  }

  // C (+)= A^T B, A `[m, cols]` (`lda` floats a row) and B `[m, n]` paired
  // across their `m` rows (B's pairs given: `bn`).
  void product_t_bf16(int64_t m, int64_t cols, int64_t n, const float* a,
                      int64_t lda, const uint32_t* bn, float* c,
                      bool accumulate, Scratch& w) const {
    w.ga.resize(Shape::pairs(m) * cols);
    jade::pairs_across_rows(m, cols, a, lda, w.ga.data(), cols);
    jade::gemm_bf16(cols, n, Shape::pairs(m), w.ga.data(), 1, cols, bn, n, c,
                    n, accumulate);
  }

  // Which tiles of 16 keys of each slot the pass's `m` rows from `row0`
  // read into `w.live`; whether any is dead. Under the causal mask a tile
  // whose keys all come after every row's position scores 1e9 below the
  // row's live keys (`mask_row`), so its probabilities are exactly 0: none
  // of the seven products needs it (sorted by bucket, then position, LSH
  // chunks end in such tiles: 20-48% of a walkthrough run's).
  bool mark_tiles(int64_t b, int64_t c, int64_t row0, int64_t m,
                  Scratch& w) const {
    w.live.assign((s.before + 1) * s.tiles(), 1);
    if (!s.causal || s.every_tile) return false;
    const int32_t last = *std::max_element(qi + row0, qi + row0 + m);
    bool dead = false;
    for (int64_t a = 0; a <= s.before; ++a) {
      const int32_t* kc = ki + b * s.n + s.key_chunk(c, a) * s.chunk;
      for (int64_t t = 0; t < s.tiles(); ++t) {
        const bool out =
            *std::min_element(kc + t * 16, kc + s.tile_end(t)) > last;
        w.live[a * s.tiles() + t] = !out;
        dead |= out;
      }
    }
    return dead;
  }

  // Masked scores of `m` query rows from `row0` (chunk c, batch b) into
  // `w.p` ([m, width]); dead tiles (`mark_tiles`) -inf. A row with no key
  // scored above -1e8 (every key masked: its softmax reads the masked
  // scores) is scored again with every tile.
  void scores(int64_t b, int64_t c, int64_t row0, int64_t m,
              Scratch& w) const {
    if (!mark_tiles(b, c, row0, m, w)) return live_scores(b, c, row0, m, w);
    live_scores(b, c, row0, m, w);
    for (int64_t i = 0; i < m; ++i)
      if (row_max(w.p.data() + i * s.width, s.width) < -1e8f) {
        w.live.assign(w.live.size(), 1);
        return live_scores(b, c, row0, m, w);
      }
  }

  void live_scores(int64_t b, int64_t c, int64_t row0, int64_t m,
                   Scratch& w) const {
    const uint32_t* qp = nullptr;  // The rows' pairs, once for every slot.
    if (s.bf16) {
      window_pairs(k, s.d, b, c, false, w.kp, w.kp_of, w.tmp);
      qp = rows_paired(m, s.d, q + row0 * s.d, s.d, w);
    } else {
      window(k, s.d, b, c, w.kt, w.kt_of);
    }
    float* p = w.p.data();
    for (int64_t a = 0; a <= s.before; ++a) {
      const int32_t* kc = ki + b * s.n + s.key_chunk(c, a) * s.chunk;
      const uint8_t* live = w.live.data() + a * s.tiles();
      float* pa = p + a * s.chunk;
      live_runs(s, live, [&](int64_t j0, int64_t cols) {
        if (s.bf16)
          product_bf16(m, cols, s.d, qp,
                       w.kp.data() + a * Shape::pairs(s.d) * s.ldt() + j0,
                       s.ldt(), pa + j0, s.width, false);
        else
          gemm(m, cols, s.d, q + row0 * s.d, s.d, 1,
               w.kt.data() + a * s.d * s.ldt() + j0, s.ldt(), pa + j0,
               s.width, false);
        for (int64_t i = 0; i < m; ++i)
          mask_row(s, pa + i * s.width + j0, qi[row0 + i], kc + j0, cols);
      });
      fill_dead(live, m, pa, -INFINITY);
    }
  }

  // `value` in the dead tiles' columns of `m` rows of a slot's scores.
  void fill_dead(const uint8_t* live, int64_t m, float* pa,
                 float value) const {
    for (int64_t t = 0; t < s.tiles(); ++t) {
      if (live[t]) continue;
      for (int64_t i = 0; i < m; ++i)
        std::fill(pa + i * s.width + t * 16, pa + i * s.width + s.tile_end(t),
                  value);
    }
  }

  // C (+)= A B over a slot's keys: A `m` rows of the slot's probabilities
  // or dS (`pa`, `width` apart), B the slot's rows of keys or values
  // (float rows `bk`, or paired across keys: `bn`), summed over the live
  // tiles only (A is 0 in the others: the same sums). `written`: whether C
  // holds a sum yet (some slot of a pass always has a live tile: `scores`
  // scores a pass with none in full).
  void by_keys(int64_t m, int64_t dim, const float* pa, const uint8_t* live,
               const float* bk, const uint32_t* bn, float* c, bool& written,
               Scratch& w) const {
    // Summed over the keys: AMX's sums of bfloat16 pairs round by groups of
    // 16 pairs, so runs start where a pass reading every key starts its
    // groups (`jade::pair_group`): the same sums with the dead tiles
    // skipped or read (their A is 0), bit for bit.
    const int64_t keys = s.bf16 ? 2 * jade::pair_group() : 1;  // A group's.
    const int64_t group = std::max<int64_t>(keys / 16, 1);      // In tiles.
    live_runs(
        s, live,
        [&](int64_t j0, int64_t cols) {
          if (s.bf16)
            product_bf16(m, dim, cols,
                         rows_paired(m, cols, pa + j0, s.width, w),
                         bn + (j0 / 2) * dim, dim, c, dim, written);
          else
            gemm(m, dim, cols, pa + j0, s.width, 1, bk + j0 * dim, dim, c,
                 dim, written);
          written = true;
        },
        group);
  }

  // C (+)= A^T B for a slot's keys (C's rows): A as in `by_keys`, B `m`
  // rows (float `b`, or paired across them: `bn`); a dead tile's keys get
  // nothing (A is 0 there): their rows of C are kept (`add`) or zeroed.
  void to_keys(int64_t m, int64_t dim, const float* pa, const uint8_t* live,
               const float* b, const uint32_t* bn, float* c, bool add,
               Scratch& w) const {
    live_runs(s, live, [&](int64_t j0, int64_t cols) {
      if (s.bf16)
        product_t_bf16(m, cols, dim, pa + j0, s.width, bn, c + j0 * dim, add,
                       w);
      else
        gemm(cols, dim, m, pa + j0, 1, s.width, b, dim, c + j0 * dim, dim,
             add);
    });
    for (int64_t t = 0; t < s.tiles() && !add; ++t)
      if (!live[t])
        std::fill(c + t * 16 * dim, c + s.tile_end(t) * dim, 0.f);
  }
};

struct Forward {
  Call in;
  float *o, *lse;

  int64_t tasks() const {
    return in.s.batch * in.s.chunks * in.s.row_blocks();
  }

  void operator()(int64_t task, Scratch& w) const {
    const Shape& s = in.s;
    const int64_t rb = task % s.row_blocks(), bc = task / s.row_blocks();
    const int64_t b = bc / s.chunks, c = bc % s.chunks;
    const int64_t i0 = rb * s.rows, m = std::min(s.rows, s.chunk - i0);
    const int64_t row0 = b * s.n + c * s.chunk + i0;
    w.p.resize(s.rows * s.width);
    float* p = w.p.data();
    in.scores(b, c, row0, m, w);
    for (int64_t i = 0; i < m; ++i) {
      float* row = p + i * s.width;
      const float top = row_max(row, s.width);
      const float sum = exp_row(row, s.width, top);
      lse[row0 + i] = top + std::log(sum);
      const float scale = 1.f / sum;
      for (int64_t j = 0; j < s.width; ++j) row[j] *= scale;
    }
    if (s.bf16)
      in.window_pairs(in.v, s.dv, b, c, true, w.vn, w.vn_of, w.tmp);
    bool written = false;
    for (int64_t a = 0; a <= s.before; ++a) {
      const int64_t k0 = b * s.n + s.key_chunk(c, a) * s.chunk;
      in.by_keys(m, s.dv, p + a * s.chunk, w.live.data() + a * s.tiles(),
                 in.v + k0 * s.dv,
                 s.bf16 ? w.vn.data() + a * Shape::pairs(s.chunk) * s.dv
                        : nullptr,
                 o + row0 * s.dv, written, w);
    }
  }
};

// A backward task takes a group of `s.group` consecutive chunks: the key
// gradients of a group are summed in place (a chunk's own rows first, then
// what later chunks of the group read of it); what a group's first chunks
// read of the chunks before it (or, wrapping, of the last) goes to `edge`,
// added once every task is done (`fold_edges`).
struct Backward {
  Call in;
  const float *o, *lse, *go, *glse;
  float *gq, *gk, *gv;
  float* edge;  // [batch, groups, before, chunk, d + dv].

  int64_t groups() const { return (in.s.chunks + in.s.group - 1) / in.s.group; }
  int64_t tasks() const { return in.s.batch * groups(); }

  void operator()(int64_t task, Scratch& w) const {
    const Shape& s = in.s;
    const int64_t b = task / groups(), first = (task % groups()) * s.group;
    const int64_t last = std::min(first + s.group, s.chunks);
    w.p.resize(s.rows * s.width);
    w.g.resize(s.rows * s.width);
    for (int64_t c = first; c < last; ++c)
      for (int64_t rb = 0; rb < s.row_blocks(); ++rb)
        rows(b, c, rb, first, task, w);
  }

  void rows(int64_t b, int64_t c, int64_t rb, int64_t first, int64_t task,
            Scratch& w) const {
    const Shape& s = in.s;
    const int64_t i0 = rb * s.rows, m = std::min(s.rows, s.chunk - i0);
    const int64_t row0 = b * s.n + c * s.chunk + i0;
    float *p = w.p.data(), *g = w.g.data();
    in.scores(b, c, row0, m, w);
    for (int64_t i = 0; i < m; ++i)
      exp_row(p + i * s.width, s.width, lse[row0 + i]);
    const uint32_t* gop = nullptr;  // dO's rows paired, once for every slot.
    if (s.bf16) {
      in.window_pairs(in.v, s.dv, b, c, false, w.vp, w.vp_of, w.tmp);
      gop = in.rows_paired(m, s.dv, go + row0 * s.dv, s.dv, w);
    } else {
      in.window(in.v, s.dv, b, c, w.vt, w.vt_of);
    }
    for (int64_t a = 0; a <= s.before; ++a) {  // g = dP = dO V^T.
      const uint8_t* live = w.live.data() + a * s.tiles();
      float* ga = g + a * s.chunk;
      live_runs(s, live, [&](int64_t j0, int64_t cols) {
        if (s.bf16)
          Call::product_bf16(
              m, cols, s.dv, gop,
              w.vp.data() + a * Shape::pairs(s.dv) * s.ldt() + j0, s.ldt(),
              ga + j0, s.width, false);
        else
          gemm(m, cols, s.dv, go + row0 * s.dv, s.dv, 1,
               w.vt.data() + a * s.dv * s.ldt() + j0, s.ldt(), ga + j0,
               s.width, false);
      });
      in.fill_dead(live, m, ga, 0.f);  // P is 0 there: dS is 0.
    }
    // dS = P (dP - <dO, O> + dlse). With bfloat16 products <dO, O> is
    // sum_j P dP, as autodiff sums it: O read P and V rounded, and dS is a
    // difference of near equals.
    for (int64_t i = 0; i < m; ++i) {
      float *gi = g + i * s.width, *pi = p + i * s.width;
      float dot = 0.f;
      if (s.bf16)
        dot = jade::dot(pi, gi, s.width);
      else
        for (int64_t u = 0; u < s.dv; ++u)
          dot += go[(row0 + i) * s.dv + u] * o[(row0 + i) * s.dv + u];
      const float shift = glse[row0 + i] - dot;
      for (int64_t j = 0; j < s.width; ++j) gi[j] = pi[j] * (gi[j] + shift);
    }
    if (s.bf16) {
      in.window_pairs(in.k, s.d, b, c, true, w.kn, w.kn_of, w.tmp);
      w.qn.resize(Shape::pairs(m) * s.d);
      w.gn.resize(Shape::pairs(m) * s.dv);
      jade::pairs_across_rows(m, s.d, in.q + row0 * s.d, s.d, w.qn.data(), s.d);
      jade::pairs_across_rows(m, s.dv, go + row0 * s.dv, s.dv, w.gn.data(),
                              s.dv);
    }
    const int64_t edge_rows = s.chunk * (s.d + s.dv);
    bool written = false;
    for (int64_t a = s.before; a >= 0; --a) {  // Own chunk first.
      const int64_t k0 = b * s.n + s.key_chunk(c, a) * s.chunk;
      const uint8_t* live = w.live.data() + a * s.tiles();
      in.by_keys(m, s.d, g + a * s.chunk, live, in.k + k0 * s.d,  // dQ = dS K.
                 s.bf16 ? w.kn.data() + a * Shape::pairs(s.chunk) * s.d
                        : nullptr,
                 gq + row0 * s.d, written, w);
      // dK, dV of the keys read (dS^T Q, P^T dO), summed in place, or into
      // the edge slot of the chunk `j` before the group.
      float *to_k = gk + k0 * s.d, *to_v = gv + k0 * s.dv;
      bool add = a < s.before || rb > 0;
      const int64_t j = first - (c - s.before + a);
      if (j > 0) {
        to_k = edge + (task * s.before + j - 1) * edge_rows;
        to_v = to_k + s.chunk * s.d;
        add = c > first || rb > 0;
      }
      in.to_keys(m, s.d, g + a * s.chunk, live, in.q + row0 * s.d,
                 w.qn.data(), to_k, add, w);
      in.to_keys(m, s.dv, p + a * s.chunk, live, go + row0 * s.dv,
                 w.gn.data(), to_v, add, w);
    }
  }

  void fold_edges() const {
    const Shape& s = in.s;
    const int64_t edge_rows = s.chunk * (s.d + s.dv);
    for (int64_t task = 0; task < tasks(); ++task) {
      const int64_t b = task / groups(), first = (task % groups()) * s.group;
      for (int64_t j = 1; j <= s.before; ++j) {
        int64_t kc = (first - j) % s.chunks;
        kc = kc < 0 ? kc + s.chunks : kc;
        const float* e = edge + (task * s.before + j - 1) * edge_rows;
        float* to_k = gk + (b * s.n + kc * s.chunk) * s.d;
        float* to_v = gv + (b * s.n + kc * s.chunk) * s.dv;
        for (int64_t i = 0; i < s.chunk * s.d; ++i) to_k[i] += e[i];
        for (int64_t i = 0; i < s.chunk * s.dv; ++i)
          to_v[i] += e[s.chunk * s.d + i];
      }
    }
  }
};

// Query rows a pass of a chunk of `chunk` rows whose window is `width`
// keys: on AVX2 (6-row tiles) 48, measured best for chunks of 512 and 2,048
// on a Zen 3 (1.1-1.2x against 16; BENCHMARKS.md). With bfloat16 products
// on AMX (`bf16`) at least 32: two 16-row tiles of A a block, and the
// rows' pairs of the key gradients' products (`to_keys`) one whole group
// of 16, not padded (the walkthrough's run 4 1.2x against 16; 64 no faster).
int64_t pass_rows(int64_t chunk, int64_t width, bool bf16) {
  const int64_t rows = chunk <= 64       ? chunk
                       : kTileRows == 6  ? 48
                       : width > 2048    ? 16
                                         : 32;
  return bf16 && jade::amx_in_use() && chunk > rows ? std::max<int64_t>(rows, 32)
                                                     : rows;
}

// The shape of a call, checked: any mismatch is the call's error.
ffi::Error shape_of(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer qi, ffi::AnyBuffer ki, int64_t chunk,
                    int64_t before, int64_t flags, int64_t threads, Shape* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = qd.size();
  if (rank < 2 || kd.size() != rank || vd.size() != rank)
    return ffi::Error::InvalidArgument("chunk attention: ranks differ");
  for (auto* x : {&q, &k, &v})
    if (x->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("chunk attention: float32 only");
  for (auto* x : {&qi, &ki})
    if (x->element_type() != ffi::DataType::S32)
      return ffi::Error::InvalidArgument("chunk attention: int32 positions");
  for (size_t i = 0; i + 1 < rank; ++i)
    if (kd[i] != qd[i] || vd[i] != qd[i])
      return ffi::Error::InvalidArgument("chunk attention: shapes differ");
  if (kd[rank - 1] != qd[rank - 1])
    return ffi::Error::InvalidArgument("chunk attention: key width");
  s->n = qd[rank - 2];
  s->d = qd[rank - 1];
  s->dv = vd[rank - 1];
  s->batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) s->batch *= qd[i];
  if (chunk <= 0 || before < 0 || s->n % chunk != 0 ||
      qi.element_count() != size_t(s->batch * s->n) ||
      ki.element_count() != size_t(s->batch * s->n))
    return ffi::Error::InvalidArgument("chunk attention: bad chunking");
  s->chunk = chunk;
  s->before = before;
  s->chunks = s->n / chunk;
  s->width = (before + 1) * chunk;
  s->rows = pass_rows(chunk, s->width, (flags & 8) && jade::kNativeBf16);
  s->group = std::clamp<int64_t>(s->chunks / (4 * std::max<int64_t>(threads, 1)), 1, 16);
  s->causal = flags & 1;
  s->exclude_self = flags & 2;
  s->masked = flags & 4;
  s->bf16 = (flags & 8) && jade::kNativeBf16;
  s->every_tile = flags & 16;
  return ffi::Error::Success();
}

// `in` for the call's inputs, its shape checked.
ffi::Error call_of(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer qi, ffi::AnyBuffer ki,
                   int64_t chunk, int64_t before, int64_t flags, Call* in) {
  if (auto e = shape_of(q, k, v, qi, ki, chunk, before, flags,
                        pool.num_threads(), &in->s);
      e.failure())
    return e;
  in->q = q.typed_data<float>();
  in->k = k.typed_data<float>();
  in->v = v.typed_data<float>();
  in->qi = qi.typed_data<int32_t>();
  in->ki = ki.typed_data<int32_t>();
  return ffi::Error::Success();
}

ffi::Error forward_impl(ffi::ThreadPool pool, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer qi,
                        ffi::AnyBuffer ki, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> lse, int64_t chunk,
                        int64_t before, int64_t flags) {
  Forward f;
  if (auto e = call_of(pool, q, k, v, qi, ki, chunk, before, flags, &f.in);
      e.failure())
    return e;
  f.o = o->typed_data<float>();
  f.lse = lse->typed_data<float>();
  jade::run_all<Scratch>(pool, f.tasks(), f);
  return ffi::Error::Success();
}

ffi::Error backward_impl(ffi::ThreadPool pool, ffi::AnyBuffer q,
                         ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                         ffi::AnyBuffer lse, ffi::AnyBuffer go,
                         ffi::AnyBuffer glse, ffi::AnyBuffer qi,
                         ffi::AnyBuffer ki, ffi::Result<ffi::AnyBuffer> gq,
                         ffi::Result<ffi::AnyBuffer> gk,
                         ffi::Result<ffi::AnyBuffer> gv, int64_t chunk,
                         int64_t before, int64_t flags) {
  Backward f;
  if (auto e = call_of(pool, q, k, v, qi, ki, chunk, before, flags, &f.in);
      e.failure())
    return e;
  f.o = o.typed_data<float>();
  f.lse = lse.typed_data<float>();
  f.go = go.typed_data<float>();
  f.glse = glse.typed_data<float>();
  f.gq = gq->typed_data<float>();
  f.gk = gk->typed_data<float>();
  f.gv = gv->typed_data<float>();
  const Shape& s = f.in.s;
  std::vector<float> edge(f.tasks() * s.before * s.chunk * (s.d + s.dv));
  f.edge = edge.data();
  jade::run_all<Scratch>(pool, f.tasks(), f);
  f.fold_edges();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeChunkAttentionForward, forward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("before")
                                  .Attr<int64_t>("flags"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeChunkAttentionBackward, backward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("before")
                                  .Attr<int64_t>("flags"));

// Query rows a pass of this build's kernel (`chunk_attention.live_share`:
// which key tiles the causal mask lets it skip).
extern "C" int64_t JadeChunkPassRows(int64_t chunk, int64_t width,
                                     int64_t bf16) {
  return pass_rows(chunk, width, bf16 != 0);
}
