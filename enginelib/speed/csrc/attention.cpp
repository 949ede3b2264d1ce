// A decode step's attention over the paged KV cache, reading the keys where they lie
// (enginelib.speed.cpu_kernels.decode_attention, the compiled step's calls of the operator, and the one-call
// step's own threads, through PagedDecode: attention.h).
#include "attention.h"
#include "common.h"

namespace {

// q . k over one head (d floats), and y += p * v: the two loops attention runs per key
inline float dot(const float* a, const float* b, int64_t d, bool simd) {
  int64_t i = 0;
  float t = 0.f;
#ifdef __AVX2__
  if (simd) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
      acc0 = fmadd(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
      acc1 = fmadd(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    t = hsum(_mm256_add_ps(acc0, acc1));
  }
#endif
  for (; i < d; ++i) t += a[i] * b[i];
  return t;
}

inline void axpy(float p, const float* v, float* y, int64_t d, bool simd) {
  int64_t i = 0;
#ifdef __AVX2__
  if (simd) {
    const __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, fmadd(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(y + i)));
  }
#endif
  for (; i < d; ++i) y[i] += p * v[i];
}

// e^x for the scores minus their maximum (x <= 0), 8 at a time (exp8 in common.h); their sum
inline float softmax_exp(float* p, int64_t len, float mx, bool simd) {
  int64_t t = 0;
  float sum = 0.f;
#ifdef __AVX2__
  if (simd) {
    __m256 total = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
      const __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(p + t, v);
      total = _mm256_add_ps(total, v);
    }
    sum = hsum(total);
  }
#endif
  for (; t < len; ++t) sum += p[t] = std::exp(p[t] - mx);
  return sum;
}

// One query head over its sequence's keys (rows[t]: where key t starts in the pools, ki/vi: the KV head's
// offset): out = softmax(q . K / sqrt(D)) V, scores in p. Any head size, one key at a time.
void attend_head_any(const float* qi, const float* ki, const float* vi, const int64_t* rows, int64_t len,
                     int64_t D, float scale, float* p, float* o, bool simd) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, p[t] = dot(qi, ki + rows[t], D, simd) * scale);
  const float inv = 1.f / softmax_exp(p, len, mx, simd);
  std::fill(o, o + D, 0.f);
  for (int64_t t = 0; t < len; ++t) axpy(p[t] * inv, vi + rows[t], o, D, simd);
}

#ifdef __AVX2__
// The same for a head of DV * 8 floats, with the query and the output in registers: four keys' scores at
// a time (four accumulators, summed across with three horizontal adds, not one full reduction per key),
// then the output as DV accumulators that each value row is multiply-added into, written once at the end.
// fetch (the first of its KV head's query heads here): the keys and values it reads lie in a far cache, evicted by the
// weights a step streams; it asks for each key's row AHEAD keys early, and for each value's row as its key is
// scored (a pass before the values are read).
constexpr int64_t AHEAD = 8;

template <int DV>
void attend_head(const float* qi, const float* ki, const float* vi, const int64_t* rows, int64_t len, float scale,
                 float* p, float* o, bool fetch) {
  __m256 q[DV];
  for (int r = 0; r < DV; ++r) q[r] = _mm256_loadu_ps(qi + 8 * r);
  const __m128 sc = _mm_set1_ps(scale);
  __m128 mx4 = _mm_set1_ps(-INFINITY);
  int64_t t = 0;
  for (int64_t j = 0; fetch && j < std::min(AHEAD, len); ++j)
    for (int r = 0; r < DV; r += 2) _mm_prefetch(reinterpret_cast<const char*>(ki + rows[j] + 8 * r), _MM_HINT_T0);
  for (; t + 4 <= len; t += 4) {
    for (int64_t j = t; fetch && j < t + 4; ++j)
      for (int r = 0; r < DV; r += 2) {  // a 64-byte line holds 2 of the 8-float pieces
        if (j + AHEAD < len) _mm_prefetch(reinterpret_cast<const char*>(ki + rows[j + AHEAD] + 8 * r), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vi + rows[j] + 8 * r), _MM_HINT_T0);
      }
    const float *k0 = ki + rows[t], *k1 = ki + rows[t + 1], *k2 = ki + rows[t + 2], *k3 = ki + rows[t + 3];
    __m256 a0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k3));
    for (int r = 1; r < DV; ++r) {
      a0 = fmadd(q[r], _mm256_loadu_ps(k0 + 8 * r), a0);
      a1 = fmadd(q[r], _mm256_loadu_ps(k1 + 8 * r), a1);
      a2 = fmadd(q[r], _mm256_loadu_ps(k2 + 8 * r), a2);
      a3 = fmadd(q[r], _mm256_loadu_ps(k3 + 8 * r), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // 4 keys, 2 halves each
    const __m128 s4 = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), sc);
    _mm_storeu_ps(p + t, s4);
    mx4 = _mm_max_ps(mx4, s4);
  }
  mx4 = _mm_max_ps(mx4, _mm_movehl_ps(mx4, mx4));
  float mx = _mm_cvtss_f32(_mm_max_ss(mx4, _mm_movehdup_ps(mx4)));
  for (; t < len; ++t) mx = std::max(mx, p[t] = dot(qi, ki + rows[t], 8 * DV, true) * scale);
  const float inv = 1.f / softmax_exp(p, len, mx, true);
  __m256 acc[DV];
  for (int r = 0; r < DV; ++r) acc[r] = _mm256_setzero_ps();
  for (t = 0; t < len; ++t) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    const float* v = vi + rows[t];
    for (int r = 0; r < DV; ++r) acc[r] = fmadd(pt, _mm256_loadu_ps(v + 8 * r), acc[r]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int r = 0; r < DV; ++r) _mm256_storeu_ps(o + 8 * r, _mm256_mul_ps(acc[r], iv));
}
#endif

}  // namespace

// A decode step's attention, one new token per sequence: its key and value k[s], v[s] are written at
// its last position (context_lens[s] - 1, through its block table), then its query attends to its
// first context_lens[s] keys where they lie; no keys are gathered or copied. A sequence with no keys is
// padding (a compiled step's batch filled up to its size): nothing is written and its output is zeros.
// out[s, h] = softmax(q[s, h] . K / sqrt(D)) V, with K, V of KV head h / (H / KV) (grouped-query attention).
PagedDecode::PagedDecode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool,
                         at::Tensor& v_pool, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "q must be contiguous float32 [S, H, D]");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous() && t->size(0) == q.size(0) &&
                t->size(1) == k_pool.size(2) && t->size(2) == q.size(2),
                "k and v must be contiguous float32 [S, KV, D]");
  for (const at::Tensor* t : {&k_pool, &v_pool})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->is_contiguous() && t->sizes() == k_pool.sizes(),
                "k_pool and v_pool must be contiguous float32 [num_blocks, block_size, KV, D]");
  S = q.size(0), H = q.size(1), D = q.size(2);
  NB = k_pool.size(0), BS = k_pool.size(1), KV = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && H % KV == 0, "q has ", H, " heads of ", D, ", the cache ", KV, " of ",
              k_pool.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == S &&
              block_tables.is_contiguous(), "block_tables must be contiguous int64 [S, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.numel() == S && context_lens.is_contiguous(),
              "context_lens must be contiguous int64 [S]");
  W = block_tables.size(1);
  bt = block_tables.data_ptr<int64_t>();
  lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {  // checked here: an exception inside the threads below would be late
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= W * BS, "sequence ", s, " has ", lens[s], " keys; its table holds ", W * BS);
    for (int64_t b = 0; b < (lens[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(bt[s * W + b] >= 0 && bt[s * W + b] < NB, "block ", bt[s * W + b], " is outside the pool of ", NB);
  }
  qp = q.data_ptr<float>(), kn = k.data_ptr<float>(), vn = v.data_ptr<float>();
  kp = k_pool.data_ptr<float>(), vp = v_pool.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) keys += lens[s];
}

void PagedDecode::store(int64_t s0, int64_t s1) const {  // the new keys and values, KV * D floats each, at their slots
  for (int64_t s = s0; s < s1; ++s) {
    if (lens[s] == 0) continue;  // a padding row
    const int64_t t = lens[s] - 1, slot = bt[s * W + t / BS] * BS + t % BS;
    std::copy_n(kn + s * KV * D, KV * D, kp + slot * KV * D);
    std::copy_n(vn + s * KV * D, KV * D, vp + slot * KV * D);
  }
}

void PagedDecode::attend(int64_t i0, int64_t i1, float* out, bool simd) const {
  thread_local std::vector<float> p;  // each thread's, reused from call to call: no allocation a task
  thread_local std::vector<int64_t> rows;  // where sequence s's keys start in the pools, found once per task,
  int64_t rows_of = -1;  // not per key and head (the division t / BS costs more than the key's arithmetic)
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t G = H / KV;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t s = i / H, kvh = (i % H) / G, len = lens[s];
    const bool first = i == i0 || i % H % G == 0;  // of its KV head's query heads, here
    if (s != rows_of) {
      rows.resize(len);
      for (int64_t t = 0; t < len; ++t) rows[t] = (bt[s * W + t / BS] * BS + t % BS) * KV * D;
      rows_of = s;
    }
    if (len == 0) {  // a padding row
      std::fill(out + i * D, out + (i + 1) * D, 0.f);
      continue;
    }
    p.resize(len);
#ifdef __AVX2__
    if (simd && D == 64) {
      attend_head<8>(qp + i * D, kp + kvh * D, vp + kvh * D, rows.data(), len, scale, p.data(), out + i * D,
                     first);
      continue;
    }
#endif
    attend_head_any(qp + i * D, kp + kvh * D, vp + kvh * D, rows.data(), len, D, scale, p.data(), out + i * D, simd);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool,
                            at::Tensor& v_pool, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            bool simd) {
  const PagedDecode a(q, k, v, k_pool, v_pool, block_tables, context_lens);
  a.store(0, a.S);
  at::Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  // (sequence, head) pairs per task: ~64K multiply-adds each, so a short step runs in this thread alone
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) * a.S / std::max<int64_t>(1, 2 * a.keys * a.D));
  at::parallel_for(0, a.S * a.H, grain, [&](int64_t i0, int64_t i1) { a.attend(i0, i1, op, simd); });
  return out;
}

// The kernels of the operators that cpu_kernels.py declares: torch's dispatcher calls them without
// entering Python, in eager steps and from inductor's compiled code alike.
TORCH_LIBRARY_IMPL(enginelib, CPU, m) { m.impl("decode_attention", &decode_attention); }
