// A chat's new tokens over a wide LSH layer's key cache, fused for XLA's
// CPU backend: `decode_keys.attend_memory` where every position up to a
// query is kept (`decode_select.keep_mask` unranked), with the chat's far
// keys (`decode_keys.best_far`). XLA computes it as passes over the whole
// cache (the scores' product with every column of each key, the masks,
// eight maximum passes for the far keys' cut, the log-sum-exp, the
// exponentials, the values' product with every column again), each the
// size of all the block's scores. Here each key's score columns are read
// once, only the keys up to the last query's position; the far keys'
// cut is kept per query while the scores are made; only the near keys'
// values and the few far keys kept are read.
// Built and loaded by src/model/kernels.py; never edited there.
//
// Inputs carry any leading dimensions (a layer's examples x heads, one
// task each): q [..., L, W] (the queries laid out as a key, scaled as the
// scores are, zeros against the values), cache [..., mem, W] (the key
// cache: values at columns [v_at, v_at + dv), the rest scored), fresh
// [..., L, W] (the queries' own keys), positions [..., L] int32
// (consecutive). The call writes `fresh` into the cache from the first
// position (as XLA's dynamic-update-slice: the start clamped so the rows
// fit) and returns the cache, its buffer aliased to the input's: the
// caller's state flows through the call in place (a read of a cache
// written by XLA, which the state also returns, made XLA write it twice,
// each into a copy of the whole cache).
// Outputs: [..., L, dv], each query's attention over keys 0..its position
// (its own at -1e5, as Trax's `mask_self_attention` excludes it), the far
// ones (more than `far_from` before it) all but the `far_keys` best
// distinct scores masked (0: all read); and the cache, written.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

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

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kMaxFarKeys = 256;

// Whether any lane of a comparison's mask is set.
inline bool any(v8i m) {
#if defined(__AVX__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(m)) != 0;
#else
  int32_t bits = 0;
  for (int h = 0; h < 8; ++h) bits |= m[h];
  return bits != 0;
#endif
}

inline float dot(const float* a, const float* b, int64_t n) {
  v8 acc{};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    acc += *reinterpret_cast<const v8*>(a + k) *
           *reinterpret_cast<const v8*>(b + k);
  float sum = 0.f;
  for (int h = 0; h < 8; ++h) sum += acc[h];
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

// Rows [r, r + R) of S = K Q^T: key row j's score columns (`d1` from its
// start, `d2` from `off2`) against the queries' (`qt`: [d1 + d2, ld],
// transposed), all `ld` query slots (a multiple of 8), in one pass over
// the row: the rows' score columns are read once, and the rows `kAhead`
// tiles on are fetched meanwhile (the keys stream from memory: without,
// each tile waited on its rows, ~3x the product's time).
constexpr int64_t kAhead = 4;

template <int R>
void score_rows(int64_t r, int64_t n, const float* keys, int64_t width,
                int64_t d1, int64_t off2, int64_t d2, const float* qt,
                int64_t ld, float* S) {
  for (int i = 0; i < R; ++i) {
    const int64_t ahead = std::min(r + i + kAhead * R, n - 1);
    const char* row = reinterpret_cast<const char*>(keys + ahead * width);
    for (int64_t c = 0; c < d1 * 4; c += 64) __builtin_prefetch(row + c);
    for (int64_t c = 0; c < d2 * 4; c += 64)
      __builtin_prefetch(row + off2 * 4 + c);
  }
  const float* a = keys + r * width;
  for (int64_t j = 0; j < ld; j += 16) {
    const bool two = j + 16 <= ld;  // Else the last 8 slots alone.
    v8 acc[R][2] = {};
    // Columns [0, d1) of the rows, then [off2, off2 + d2).
    for (int part = 0; part < 2; ++part) {
      const float* ap = a + (part ? off2 : 0);
      const float* bp = qt + (part ? d1 : 0) * ld + j;
      const int64_t depth = part ? d2 : d1;
      for (int64_t k = 0; k < depth; ++k) {
        const v8 b0 = *reinterpret_cast<const v8*>(bp + k * ld);
        const v8 b1 = two ? *reinterpret_cast<const v8*>(bp + k * ld + 8)
                          : v8{};
        for (int i = 0; i < R; ++i) {
          const float x = ap[i * width + k];
          acc[i][0] += x * b0;
          acc[i][1] += x * b1;
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      *reinterpret_cast<v8*>(S + (r + i) * ld + j) = acc[i][0];
      if (two) *reinterpret_cast<v8*>(S + (r + i) * ld + j + 8) = acc[i][1];
    }
  }
}

struct Shape {
  int64_t batch, n_q, mem, width, v_at, dv, far_from, far_keys;
};

// The `far_keys` best distinct scores seen (descending); `cut()` is the
// last of them once there are that many (-inf before: all are kept).
struct Best {
  float top[kMaxFarKeys];
  int64_t count = 0;

  float cut(int64_t k) const { return count == k ? top[k - 1] : -kInf; }

  void offer(float s, int64_t k) {
    if (count == k && s <= top[k - 1]) return;
    int64_t at = 0;
    while (at < count && top[at] > s) ++at;
    if (at < count && top[at] == s) return;  // Distinct, as `best_far`.
    const int64_t last = std::min(count, k - 1);
    for (int64_t i = last; i > at; --i) top[i] = top[i - 1];
    top[at] = s;
    count = std::min(count + 1, k);
  }
};

// What one task (one head of one example) keeps between calls: its
// scores (key-major, `ld` queries a key) and queries (transposed).
struct Scratch {
  std::vector<float> scores, qt;
  std::vector<Best> best;
};
thread_local Scratch scratch;

struct Call {
  Shape s;
  const float *q, *fresh;
  float* keys;
  const int32_t* pos;
  float* out;

  void operator()(int64_t task, jade::NoState&) const { one(task); }

  // The scores of the `n` keys from `keys` (rows of `width`) for every
  // query: S[j * ld + i].
  void score(const float* q, const float* keys, int64_t n, int64_t ld,
             float* S, Scratch& m) const {
    const int64_t L = s.n_q, W = s.width, v_end = s.v_at + s.dv;
    if (n <= 0) return;
    if (L < 8) {  // A token step: each key's dot with each query.
      for (int64_t j = 0; j < n; ++j) {
        const float* key = keys + j * W;
        const char* next = reinterpret_cast<const char*>(
            keys + std::min(j + 8, n - 1) * W);  // As `score_rows`.
        for (int64_t c = 0; c < s.v_at * 4; c += 64)
          __builtin_prefetch(next + c);
        for (int64_t c = v_end * 4; c < W * 4; c += 64)
          __builtin_prefetch(next + c);
        for (int64_t i = 0; i < L; ++i) {
          const float* row = q + i * W;
          S[j * ld + i] = dot(row, key, s.v_at) +
                          dot(row + v_end, key + v_end, W - v_end);
        }
        for (int64_t i = L; i < ld; ++i) S[j * ld + i] = 0.f;
      }
      return;
    }
    // A block: S = K Q^T over the score columns (`score_rows`).
    const int64_t d2 = W - v_end, depth = s.v_at + d2;
    m.qt.assign(depth * ld, 0.f);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t c = 0; c < s.v_at; ++c) m.qt[c * ld + i] = q[i * W + c];
      for (int64_t c = 0; c < d2; ++c)
        m.qt[(s.v_at + c) * ld + i] = q[i * W + v_end + c];
    }
    int64_t r = 0;
    for (; r + kTileRows <= n; r += kTileRows)
      score_rows<kTileRows>(r, n, keys, W, s.v_at, v_end, d2, m.qt.data(), ld,
                            S);
    for (; r < n; ++r)
      score_rows<1>(r, n, keys, W, s.v_at, v_end, d2, m.qt.data(), ld, S);
  }

  // Per query slot of a task (8 a vector; slots past the queries are
  // pads): position (-1 for a pad: it reads nothing), the far keys' cut
  // (+inf for a pad), the largest score kept, the probabilities' sum.
  struct Slots {
    std::vector<int32_t> at;
    std::vector<float> cut, top, sum;
  };

  // Each query's cut: its `far_keys`-th best distinct score of the keys
  // far from it (before `far_end`), the first `lo` rows far for all.
  void far_cuts(const float* S, int64_t ld, int64_t lo, int64_t far_end,
                Slots& q, Scratch& m) const {
    for (int64_t j = 0; j < far_end; ++j) {
      const float* row = S + j * ld;
      for (int64_t g = 0; g < ld; g += 8) {
        const v8 c = *reinterpret_cast<const v8*>(q.cut.data() + g);
        if (j < lo && !any(*reinterpret_cast<const v8*>(row + g) > c))
          continue;
        for (int64_t i = g; i < g + 8; ++i)
          if (q.at[i] >= 0 && j < q.at[i] - s.far_from && row[i] > q.cut[i]) {
            m.best[i].offer(row[i], s.far_keys);
            q.cut[i] = m.best[i].cut(s.far_keys);
          }
      }
    }
  }

  // Rows [lo, n): for each query slot, whether key j is read and its
  // score as read (its own at -1e5), as vectors of 8 slots from `g`.
  v8i kept(int64_t j, int64_t g, const Slots& q, v8 x) const {
    const v8i p = *reinterpret_cast<const v8i*>(q.at.data() + g);
    v8i keep = p >= int32_t(j);
    if (s.far_keys > 0)  // Far for this query and below its cut: masked.
      keep &= ~((p - int32_t(s.far_from) > int32_t(j)) &
                (x < *reinterpret_cast<const v8*>(q.cut.data() + g)));
    return keep;
  }
  v8 as_read(int64_t j, int64_t g, const Slots& q, v8 x) const {
    const v8i p = *reinterpret_cast<const v8i*>(q.at.data() + g);
    const v8i own = (p == int32_t(j)) & reinterpret_cast<v8i>(v8{} + 1e5f);
    return x - reinterpret_cast<v8>(own);
  }

  void one(int64_t task) const {
    const int64_t L = s.n_q, W = s.width, K = s.far_keys;
    const float* q = this->q + task * L * W;
    float* keys = this->keys + task * s.mem * W;
    const int32_t* pos = this->pos + task * L;
    float* out = this->out + task * L * s.dv;
    Scratch& m = scratch;
    const int64_t ld = (L + 7) / 8 * 8;  // Query slots a key (8 a vector).
    int64_t p_min = s.mem, p_max = -1;
    for (int64_t i = 0; i < L; ++i) {
      p_min = std::min<int64_t>(p_min, pos[i]);
      p_max = std::max<int64_t>(p_max, pos[i]);
    }
    // The queries' own keys into the cache first (then every key read is
    // the cache's), as a dynamic-update-slice writes them.
    const int64_t at0 = std::clamp<int64_t>(pos[0], 0, s.mem - L);
    std::memcpy(keys + at0 * W, fresh + task * L * W, L * W * sizeof(float));
    const int64_t n = std::clamp<int64_t>(p_max + 1, 0, s.mem);
    std::fill(out, out + L * s.dv, 0.f);
    if (n == 0) return;
    if (int64_t(m.scores.size()) < n * ld) m.scores.resize(n * ld);
    float* S = m.scores.data();
    score(q, keys, n, ld, S, m);
    Slots slot{std::vector<int32_t>(ld, -1), std::vector<float>(ld, kInf),
               std::vector<float>(ld, -kInf), std::vector<float>(ld, 0.f)};
    for (int64_t i = 0; i < L; ++i) slot.at[i] = pos[i], slot.cut[i] = -kInf;
    // Keys before `lo` are far for every query; from `lo` each key is
    // read by the rule of its query (near, far, after: `kept`).
    const int64_t lo =
        K > 0 ? std::clamp<int64_t>(p_min - s.far_from, 0, n) : 0;
    m.best.assign(ld, Best{});
    if (K > 0) {
      far_cuts(S, ld, lo, std::clamp<int64_t>(p_max - s.far_from, 0, n),
               slot, m);
      for (int64_t i = 0; i < L; ++i)
        if (m.best[i].count > 0) slot.top[i] = m.best[i].top[0];
    }
    for (int64_t j = lo; j < n; ++j)  // The largest score read, from lo.
      for (int64_t g = 0; g < ld; g += 8) {
        const v8 x = *reinterpret_cast<const v8*>(S + j * ld + g);
        v8& t = *reinterpret_cast<v8*>(slot.top.data() + g);
        const v8 r = as_read(j, g, slot, x);
        t = kept(j, g, slot, x) & (r > t) ? r : t;
      }
    far_values(S, ld, lo, keys, slot, out);
    for (int64_t j = lo; j < n; ++j) {  // Probabilities (unnormalized).
      float* row = S + j * ld;
      for (int64_t g = 0; g < ld; g += 8) {
        const v8 x = *reinterpret_cast<const v8*>(row + g);
        const v8 t = *reinterpret_cast<const v8*>(slot.top.data() + g);
        const v8 e = reinterpret_cast<v8>(
            reinterpret_cast<v8i>(vexp(as_read(j, g, slot, x) - t)) &
            kept(j, g, slot, x));
        *reinterpret_cast<v8*>(row + g) = e;
        *reinterpret_cast<v8*>(slot.sum.data() + g) += e;
      }
    }
    // out += P^T V over keys [lo, n): the values' columns of each key.
    gemm(L, s.dv, n - lo, S + lo * ld, 1, ld, keys + lo * W + s.v_at, W, out,
         s.dv, true);
    for (int64_t i = 0; i < L; ++i) {
      const float scale = slot.sum[i] > 0.f ? 1.f / slot.sum[i] : 0.f;
      for (int64_t c = 0; c < s.dv; ++c) out[i * s.dv + c] *= scale;
    }
  }

  // The far keys kept (before `lo`: far for every query), each one's
  // value added alone (a few a query).
  void far_values(const float* S, int64_t ld, int64_t lo, const float* keys,
                  Slots& q, float* out) const {
    for (int64_t j = 0; j < lo; ++j) {
      const float* row = S + j * ld;
      for (int64_t g = 0; g < ld; g += 8) {
        const v8 c = *reinterpret_cast<const v8*>(q.cut.data() + g);
        if (!any(*reinterpret_cast<const v8*>(row + g) >= c)) continue;
        for (int64_t i = g; i < std::min(g + 8, s.n_q); ++i)
          if (row[i] >= q.cut[i]) {
            const float e = std::exp(row[i] - q.top[i]);
            q.sum[i] += e;
            const float* v = keys + j * s.width + s.v_at;
            for (int64_t c = 0; c < s.dv; ++c) out[i * s.dv + c] += e * v[c];
          }
      }
    }
  }
};

ffi::Error impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer keys,
                ffi::AnyBuffer fresh, ffi::AnyBuffer pos,
                ffi::Result<ffi::AnyBuffer> out,
                ffi::Result<ffi::AnyBuffer> keys_out,
                int64_t v_at, int64_t dv, int64_t far_from, int64_t far_keys) {
  if (q.element_type() != ffi::DataType::F32 ||
      keys.element_type() != ffi::DataType::F32 ||
      fresh.element_type() != ffi::DataType::F32 ||
      out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("memory attention: float32 only");
  if (pos.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("memory attention: int32 positions");
  auto qd = q.dimensions(), kd = keys.dimensions(), od = out->dimensions();
  const size_t rank = qd.size();
  if (rank < 2 || kd.size() != rank || od.size() != rank)
    return ffi::Error::InvalidArgument("memory attention: ranks differ");
  Call c;
  c.s.batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (kd[i] != qd[i] || od[i] != qd[i])
      return ffi::Error::InvalidArgument("memory attention: shapes differ");
    c.s.batch *= qd[i];
  }
  c.s.n_q = qd[rank - 2];
  c.s.width = qd[rank - 1];
  c.s.mem = kd[rank - 2];
  c.s.v_at = v_at;
  c.s.dv = dv;
  c.s.far_from = far_from;
  c.s.far_keys = far_keys;
  if (kd[rank - 1] != c.s.width || od[rank - 2] != c.s.n_q ||
      od[rank - 1] != dv || v_at < 0 || dv <= 0 || v_at + dv > c.s.width ||
      far_from < 0 || far_keys < 0 || far_keys > kMaxFarKeys ||
      pos.element_count() != size_t(c.s.batch * c.s.n_q) ||
      fresh.element_count() != q.element_count() || c.s.n_q > c.s.mem ||
      keys_out->size_bytes() != keys.size_bytes())
    return ffi::Error::InvalidArgument("memory attention: bad shape");
  c.q = q.typed_data<float>();
  // The cache's buffer is the output's (aliased); were it not, a copy.
  if (keys_out->untyped_data() != keys.untyped_data())
    std::memcpy(keys_out->untyped_data(), keys.untyped_data(),
                keys.size_bytes());
  c.keys = keys_out->typed_data<float>();
  c.fresh = fresh.typed_data<float>();
  c.pos = pos.typed_data<int32_t>();
  c.out = out->typed_data<float>();
  jade::run_all<jade::NoState>(pool, c.s.batch, c);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JadeMemoryAttention, impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("v_at")
                                  .Attr<int64_t>("dv")
                                  .Attr<int64_t>("far_from")
                                  .Attr<int64_t>("far_keys"));
