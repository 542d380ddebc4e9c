// Fused segment attention for XLA:CPU, called through the XLA FFI (see cpu_attention.py).
//
// Each query row i attends to the keys [lo[i], hi[i]) of its own batch row: its segment, cut further by a
// causal or local-window mask (every mask infjax uses gives one contiguous range). A row with an empty range
// (padding) gets a zero output and a zero log-sum-exp, and no gradient.
//
// Layouts are the model's own: q [B, T, N, D], k and v [B, T, K, D] (N a multiple of K, grouped queries), lo and
// hi [B, T] int32; the log-sum-exp is [B, N, T]. float32 throughout.
//
// Work is split over (batch row, head) pairs on XLA's intra-op thread pool. Inside a pair, R query rows are
// taken at once over the union of their key ranges: their scores [R, L] stay in cache, keys and values are read
// once per block, and nothing outside the rows' segments is computed (a packed row of two segments costs about
// half of a full [T, T] pass). The backward recomputes the scores from the log-sum-exp, as flash attention does.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;  // key columns per register tile of the score product

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp(x) for x <= 0 (scores minus their row maximum), vectorizable: Cody-Waite range reduction and a degree-6
// polynomial, within ~2 ulp of expf; below -87.3 it returns 0.
inline float ExpNonPositive(float x) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float xc = std::max(x, -87.3f);
  const float n = std::nearbyint(xc * kLog2e);
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.0f : p * scale;
}

// 16 floats in one vector value (GCC/Clang vector extension; two AVX2 or one AVX-512 register).
typedef float V16 __attribute__((vector_size(64)));
inline V16 Load(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }

// s[r, j] = sum_d a[r, d] * bt[d, j] for j < lp (a multiple of kTile): a [R, D] rows, bt [D, stride] columns.
template <int D, int R>
inline void RowsByColumns(const float* __restrict a, const float* __restrict bt, int64_t stride, int64_t lp,
                          float* __restrict s) {
  static_assert(kTile == 16, "one V16 per tile");
  for (int64_t j0 = 0; j0 < lp; j0 += kTile) {
    V16 acc[R] = {};
    for (int d = 0; d < D; ++d) {
      const V16 col = Load(bt + d * stride + j0);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r] += a[r * D + d] * col;
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) Store(s + r * stride + j0, acc[r]);
  }
}

// out[r, :] = sum_{j < l} p[r, j] * x[j, :]: p [R, stride], x rows of D floats `x_stride` apart.
template <int D, int R>
inline void WeightsByRows(const float* __restrict p, int64_t stride, const float* __restrict x, int64_t x_stride,
                          int64_t l, float* __restrict out) {
  constexpr int C = D / 16;
  V16 acc[R][C] = {};
  for (int64_t j = 0; j < l; ++j) {
    V16 row[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) row[c] = Load(x + j * x_stride + 16 * c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float w = p[r * stride + j];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] += w * row[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) Store(out + r * D + 16 * c, acc[r][c]);
}

// acc[j, :] += sum_r p[r, j] * y[r, :] for j < l: p [R, stride], y [R, D], acc rows of D floats.
template <int D, int R>
inline void AddWeightedRows(const float* __restrict p, int64_t stride, const float* __restrict y, int64_t l,
                            float* __restrict acc) {
  constexpr int C = D / 16;
  V16 ys[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) ys[r][c] = Load(y + r * D + 16 * c);
  for (int64_t j = 0; j < l; ++j) {
    V16 sum[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) sum[c] = Load(acc + j * D + 16 * c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float w = p[r * stride + j];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) sum[c] += w * ys[r][c];
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) Store(acc + j * D + 16 * c, sum[c]);
  }
}

// max of x[a:b] (b > a).
inline float RangeMax(const float* x, int64_t a, int64_t b) {
  float lanes[kTile];
  for (int i = 0; i < kTile; ++i) lanes[i] = -INFINITY;
  int64_t j = a;
  for (; j + kTile <= b; j += kTile)
    for (int i = 0; i < kTile; ++i) lanes[i] = std::max(lanes[i], x[j + i]);
  float m = -INFINITY;
  for (int i = 0; i < kTile; ++i) m = std::max(m, lanes[i]);
  for (; j < b; ++j) m = std::max(m, x[j]);
  return m;
}

// p[j] = exp(scale * s[j] - shift) for a <= j < b, 0 for the other j < lp; returns the sum.
inline float ExpRange(const float* s, float scale, float shift, int64_t a, int64_t b, int64_t lp, float* p) {
  std::fill(p, p + a, 0.0f);
  std::fill(p + b, p + lp, 0.0f);
  float lanes[kTile] = {};
  int64_t j = a;
  for (; j + kTile <= b; j += kTile)
    for (int i = 0; i < kTile; ++i) {
      const float e = ExpNonPositive(scale * s[j + i] - shift);
      p[j + i] = e;
      lanes[i] += e;
    }
  float total = 0.0f;
  for (; j < b; ++j) {
    p[j] = ExpNonPositive(scale * s[j] - shift);
    total += p[j];
  }
  for (int i = 0; i < kTile; ++i) total += lanes[i];
  return total;
}

// Runs fn(item, scratch) for every item in [0, count) on this thread and on the pool's threads; each thread gets
// its own scratch of `scratch_floats`. Returns when every item is done. A pool task that starts after that finds
// no item left and touches only the shared counters, so the caller never waits for a task to start.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, int64_t scratch_floats, const Fn& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, count, scratch_floats, &fn]() {
    std::vector<float> scratch;
    for (int64_t item; (item = state->next.fetch_add(1)) < count;) {
      if (scratch.empty()) scratch.assign(scratch_floats, 0.0f);
      fn(item, scratch.data());
      if (state->done.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == count; });
}

struct Shape {
  int64_t b, t, n, kv, d;
  int64_t tp() const { return RoundUp(t, kTile) + kTile; }  // padded key stride of the transposed copies
};

// Copies x[b, :, h, :] ([T, D] rows `kv * D` apart) into xt [D, tp], zero beyond T.
template <int D>
void Transpose(const float* x, const Shape& s, int64_t b, int64_t h, float* xt) {
  const int64_t tp = s.tp();
  std::fill(xt, xt + D * tp, 0.0f);
  for (int64_t j = 0; j < s.t; ++j) {
    const float* row = x + ((b * s.t + j) * s.kv + h) * D;
    for (int d = 0; d < D; ++d) xt[d * tp + j] = row[d];
  }
}

// The union [first, last) of the key ranges of rows i0 .. i0 + rows; first >= last when all are empty.
inline void BlockRange(const int32_t* lo, const int32_t* hi, int64_t i0, int64_t rows, int64_t* first,
                       int64_t* last) {
  *first = INT64_MAX;
  *last = 0;
  for (int64_t r = 0; r < rows; ++r)
    if (hi[i0 + r] > lo[i0 + r]) {
      *first = std::min<int64_t>(*first, lo[i0 + r]);
      *last = std::max<int64_t>(*last, hi[i0 + r]);
    }
}

// Copies rows i0 .. i0 + rows of x[b, :, n, :] into block [R, D], zero-filled past `rows`.
template <int D, int R>
void LoadRows(const float* x, const Shape& s, int64_t b, int64_t n, int64_t i0, int64_t rows, float* block) {
  std::fill(block, block + R * D, 0.0f);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(block + r * D, x + ((b * s.t + i0 + r) * s.n + n) * D, D * 4);
}

template <int D, int R>
void Forward(ffi::ThreadPool& pool, const Shape& s, const float* q, const float* k, const float* v,
             const int32_t* lo_all, const int32_t* hi_all, float* out, float* lse) {
  const int64_t tp = s.tp(), groups = s.n / s.kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t scratch = D * tp + 2 * R * D + R * tp;
  ParallelFor(pool, s.b * s.n, scratch, [&](int64_t item, float* buf) {
    const int64_t b = item / s.n, n = item % s.n, h = n / groups;
    float *kt = buf, *qb = kt + D * tp, *ob = qb + R * D, *p = ob + R * D;
    Transpose<D>(k, s, b, h, kt);
    const int32_t *lo = lo_all + b * s.t, *hi = hi_all + b * s.t;
    const float* v_rows = v + (b * s.t * s.kv + h) * D;
    for (int64_t i0 = 0; i0 < s.t; i0 += R) {
      const int64_t rows = std::min<int64_t>(R, s.t - i0);
      int64_t first, last;
      BlockRange(lo, hi, i0, rows, &first, &last);
      if (first >= last) {
        for (int64_t r = 0; r < rows; ++r) {
          std::memset(out + ((b * s.t + i0 + r) * s.n + n) * D, 0, D * 4);
          lse[(b * s.n + n) * s.t + i0 + r] = 0.0f;
        }
        continue;
      }
      const int64_t l = last - first, lp = RoundUp(l, kTile);
      LoadRows<D, R>(q, s, b, n, i0, rows, qb);
      RowsByColumns<D, R>(qb, kt + first, tp, lp, p);
      float inv_total[R];
      for (int64_t r = 0; r < R; ++r) {
        float* pr = p + r * tp;
        const int64_t a = r < rows ? lo[i0 + r] - first : 0, e = r < rows ? hi[i0 + r] - first : 0;
        if (e <= a) {
          std::fill(pr, pr + lp, 0.0f);
          inv_total[r] = 0.0f;
          if (r < rows) lse[(b * s.n + n) * s.t + i0 + r] = 0.0f;
          continue;
        }
        const float top = scale * RangeMax(pr, a, e);
        const float total = ExpRange(pr, scale, top, a, e, lp, pr);
        inv_total[r] = 1.0f / total;
        lse[(b * s.n + n) * s.t + i0 + r] = top + std::log(total);
      }
      WeightsByRows<D, R>(p, tp, v_rows + first * s.kv * D, s.kv * D, l, ob);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out + ((b * s.t + i0 + r) * s.n + n) * D;
        for (int d = 0; d < D; ++d) o[d] = ob[r * D + d] * inv_total[r];
      }
    }
  });
}

template <int D, int R>
void Backward(ffi::ThreadPool& pool, const Shape& s, const float* q, const float* k, const float* v,
              const int32_t* lo_all, const int32_t* hi_all, const float* out, const float* lse,
              const float* d_out, float* d_q, float* d_k, float* d_v) {
  const int64_t tp = s.tp(), groups = s.n / s.kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t scratch = 2 * D * tp + 2 * s.t * D + 3 * R * D + 2 * R * tp;
  ParallelFor(pool, s.b * s.kv, scratch, [&](int64_t item, float* buf) {
    const int64_t b = item / s.kv, h = item % s.kv;
    float *kt = buf, *vt = kt + D * tp, *dk = vt + D * tp, *dv = dk + s.t * D, *qb = dv + s.t * D;
    float *gb = qb + R * D, *dqb = gb + R * D, *p = dqb + R * D, *ds = p + R * tp;
    Transpose<D>(k, s, b, h, kt);
    Transpose<D>(v, s, b, h, vt);
    std::fill(dk, dk + 2 * s.t * D, 0.0f);
    const int32_t *lo = lo_all + b * s.t, *hi = hi_all + b * s.t;
    const float* k_rows = k + (b * s.t * s.kv + h) * D;
    for (int64_t n = h * groups; n < (h + 1) * groups; ++n) {
      for (int64_t i0 = 0; i0 < s.t; i0 += R) {
        const int64_t rows = std::min<int64_t>(R, s.t - i0);
        int64_t first, last;
        BlockRange(lo, hi, i0, rows, &first, &last);
        if (first >= last) {
          for (int64_t r = 0; r < rows; ++r) std::memset(d_q + ((b * s.t + i0 + r) * s.n + n) * D, 0, D * 4);
          continue;
        }
        const int64_t l = last - first, lp = RoundUp(l, kTile);
        LoadRows<D, R>(q, s, b, n, i0, rows, qb);
        LoadRows<D, R>(d_out, s, b, n, i0, rows, gb);
        RowsByColumns<D, R>(qb, kt + first, tp, lp, p);
        RowsByColumns<D, R>(gb, vt + first, tp, lp, ds);
        for (int64_t r = 0; r < R; ++r) {
          float *pr = p + r * tp, *dr = ds + r * tp;
          const int64_t a = r < rows ? lo[i0 + r] - first : 0, e = r < rows ? hi[i0 + r] - first : 0;
          if (e <= a) {
            std::fill(pr, pr + lp, 0.0f);
            std::fill(dr, dr + lp, 0.0f);
            continue;
          }
          const float* o = out + ((b * s.t + i0 + r) * s.n + n) * D;
          float delta = 0.0f;
          for (int d = 0; d < D; ++d) delta += o[d] * gb[r * D + d];
          ExpRange(pr, scale, lse[(b * s.n + n) * s.t + i0 + r], a, e, lp, pr);
          for (int64_t j = 0; j < lp; ++j) dr[j] = pr[j] * (dr[j] - delta) * scale;
        }
        WeightsByRows<D, R>(ds, tp, k_rows + first * s.kv * D, s.kv * D, l, dqb);
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(d_q + ((b * s.t + i0 + r) * s.n + n) * D, dqb + r * D, D * 4);
        AddWeightedRows<D, R>(ds, tp, qb, l, dk + first * D);
        AddWeightedRows<D, R>(p, tp, gb, l, dv + first * D);
      }
    }
    for (int64_t j = 0; j < s.t; ++j) {
      std::memcpy(d_k + ((b * s.t + j) * s.kv + h) * D, dk + j * D, D * 4);
      std::memcpy(d_v + ((b * s.t + j) * s.kv + h) * D, dv + j * D, D * 4);
    }
  });
}

ffi::Error ShapeOf(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, Shape* s) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("q and k must be [B, T, heads, D]");
  *s = Shape{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (kd[0] != s->b || kd[1] != s->t || kd[3] != s->d || s->n % s->kv)
    return ffi::Error::InvalidArgument("k does not match q (batch, length, head size, or query heads per kv head)");
  return ffi::Error::Success();
}

#define INFJAX_DISPATCH(FN, ...)                                                  \
  switch (s.d) {                                                                  \
    case 16: FN<16, 8>(__VA_ARGS__); break;                                      \
    case 32: FN<32, 8>(__VA_ARGS__); break;                                      \
    case 64: FN<64, 4>(__VA_ARGS__); break;                                      \
    case 128: FN<128, 2>(__VA_ARGS__); break;                                    \
    default: return ffi::Error::InvalidArgument("head size must be 16, 32, 64 or 128"); \
  }

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                       ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Shape s;
  if (auto e = ShapeOf(q, k, &s); e.failure()) return e;
  INFJAX_DISPATCH(Forward, pool, s, q.typed_data(), k.typed_data(), v.typed_data(), lo.typed_data(),
                  hi.typed_data(), out->typed_data(), lse->typed_data());
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                        ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_out,
                        ffi::ResultBuffer<ffi::F32> d_q, ffi::ResultBuffer<ffi::F32> d_k,
                        ffi::ResultBuffer<ffi::F32> d_v) {
  Shape s;
  if (auto e = ShapeOf(q, k, &s); e.failure()) return e;
  INFJAX_DISPATCH(Backward, pool, s, q.typed_data(), k.typed_data(), v.typed_data(), lo.typed_data(),
                  hi.typed_data(), out.typed_data(), lse.typed_data(), d_out.typed_data(), d_q->typed_data(),
                  d_k->typed_data(), d_v->typed_data());
  return ffi::Error::Success();
}

// The operands both directions start with: the thread pool, q, k, v, lo, hi.
auto BindOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

}  // namespace

// Forward: (q, k, v, lo, hi) -> (out, lse).
XLA_FFI_DEFINE_HANDLER_SYMBOL(InfjaxAttentionForward, ForwardImpl,
                              BindOperands().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

// Backward: (q, k, v, lo, hi, out, lse, d_out) -> (d_q, d_k, d_v).
XLA_FFI_DEFINE_HANDLER_SYMBOL(InfjaxAttentionBackward, BackwardImpl,
                              BindOperands()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
