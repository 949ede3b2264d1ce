// int8 and int4 weights times float32 activations: the packed bytes read, dequantized in registers and
// multiply-added, never written out as float weights (enginelib.speed.cpu_kernels.int8_linear, int4_linear).
#include "common.h"

namespace {

// ---------------------------------------------------------------- plain C++ (the fallback)

void int8_plain(const float* x, const int8_t* q, const float* scale, float* y,
                int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = q + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xm[k] * static_cast<float>(w[k]);
      y[m * N + n] = acc * scale[n];
    }
  }
}

// xsum[m * G + g]: the sum of x[m] over group g (the minimum's share of the dot product)
void int4_plain(const float* x, const float* xsum, const uint8_t* codes, const uint16_t* scale,
                const uint16_t* minimum, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = codes + (n * G + g) * 16;
        const float* xg = xm + g * GROUP;
        float dot = 0.f;
        for (int j = 0; j < 16; ++j) dot += xg[j] * float(b[j] & 15) + xg[j + 16] * float(b[j] >> 4);
        acc += half_to_float(scale[n * G + g]) * dot + half_to_float(minimum[n * G + g]) * xsum[m * G + g];
      }
      y[m * N + n] = acc;
    }
  }
}

#ifdef __AVX2__
// ---------------------------------------------------------------- AVX2 (+ FMA where the CPU has it)


inline __m256 load_int8x8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// MR activation rows x NR output rows: MR*NR accumulators, each weight vector converted once for MR rows
template <int MR, int NR>
void int8_tile(const float* x, const int8_t* q, const float* scale, float* y,
               int64_t N, int64_t K, int64_t m0, int64_t n0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = load_int8x8(q + (n0 + j) * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = fmadd(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      const float* xm = x + (m0 + i) * K;
      const int8_t* wn = q + (n0 + j) * K;
      for (int64_t k = K8; k < K; ++k) s = std::fma(xm[k], static_cast<float>(wn[k]), s);
      y[(m0 + i) * N + n0 + j] = s * scale[n0 + j];
    }
}

// One group's 32 codes as four vectors of 8 floats: codes 0-7, 8-15 (low nibbles), 16-23, 24-31 (high).
inline void load_codes(const uint8_t* b, __m256 c[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

template <int MR, int NR>
void int4_tile(const float* x, const float* xsum, const uint8_t* codes, const uint16_t* scale,
               const uint16_t* minimum, float* y, int64_t N, int64_t K, int64_t m0, int64_t n0) {
  const int64_t G = K / GROUP;
  __m256 acc[MR][NR];
  float mins[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) { acc[i][j] = _mm256_setzero_ps(); mins[i][j] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    for (int j = 0; j < NR; ++j) {  // one output row's codes at a time: 4 registers, reused by the MR rows
      const int64_t at = (n0 + j) * G + g;
      __m256 c[4];
      load_codes(codes + at * 16, c);
      const __m256 s = _mm256_set1_ps(half_to_float(scale[at]));
      const float mn = half_to_float(minimum[at]);
      for (int i = 0; i < MR; ++i) {
        const float* xg = x + (m0 + i) * K + g * GROUP;
        __m256 d = _mm256_mul_ps(_mm256_loadu_ps(xg), c[0]);
        d = fmadd(_mm256_loadu_ps(xg + 8), c[1], d);
        d = fmadd(_mm256_loadu_ps(xg + 16), c[2], d);
        d = fmadd(_mm256_loadu_ps(xg + 24), c[3], d);
        acc[i][j] = fmadd(d, s, acc[i][j]);    // scale * (codes . x) for this group
        mins[i][j] = std::fma(mn, xsum[(m0 + i) * G + g], mins[i][j]);  // minimum * (sum of x), this group
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + mins[i][j];
}

constexpr int64_t NBLOCK = 16;  // output rows whose weights stay in L1 while every activation row passes

// Tiles over output rows n0:n1, NBLOCK rows at a time (their weights are read from memory once, then from
// L1 for each tile of activation rows): MR=4 activation rows at a time (then 2, then 1) by NR output rows
// (fewer activation rows leave registers for more output rows; the last few output rows go one at a time).
template <template <int, int> class Tile, typename... A>
void block(int64_t M, int64_t n0, int64_t n1, A... args) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) Tile<4, 2>::run(args..., m, n);
    for (; n < n1; ++n) Tile<4, 1>::run(args..., m, n);
  }
  for (; m + 2 <= M; m += 2) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) Tile<2, 4>::run(args..., m, n);
    for (; n < n1; ++n) Tile<2, 1>::run(args..., m, n);
  }
  for (; m < M; ++m) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) Tile<1, 4>::run(args..., m, n);
    for (; n < n1; ++n) Tile<1, 1>::run(args..., m, n);
  }
}

template <template <int, int> class Tile, typename... A>
void tiles(int64_t M, int64_t n0, int64_t n1, A... args) {
  for (int64_t b = n0; b < n1; b += NBLOCK) block<Tile>(M, b, std::min(b + NBLOCK, n1), args...);
}

template <int MR, int NR> struct Int8Tile {
  static void run(const float* x, const int8_t* q, const float* s, float* y, int64_t N, int64_t K,
                  int64_t m, int64_t n) { int8_tile<MR, NR>(x, q, s, y, N, K, m, n); }
};
template <int MR, int NR> struct Int4Tile {
  static void run(const float* x, const float* xs, const uint8_t* c, const uint16_t* s, const uint16_t* mn,
                  float* y, int64_t N, int64_t K, int64_t m, int64_t n) {
    int4_tile<MR, NR>(x, xs, c, s, mn, y, N, K, m, n);
  }
};
#endif  // __AVX2__

void check_int8(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(0) && scale.is_contiguous(),
              "scale must be contiguous float32 [N]");
}

void check_int4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& minimum) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == 16 && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K/32, 16]");
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == codes.size(0) &&
                t->size(1) == codes.size(1) && t->is_contiguous(),
                "scale and minimum must be contiguous float16 [N, K/32]");
}

}  // namespace

bool has_simd() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool simd) {
  check_int8(q, scale);
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  check_x(x, K);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) {
#ifdef __AVX2__
    if (simd) { tiles<Int8Tile>(M, n0, n1, xp, qp, sp, yp, N, K); return; }
#endif
    int8_plain(xp, qp, sp, yp, M, N, K, n0, n1);
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& minimum, bool simd) {
  check_int4(codes, scale, minimum);
  const int64_t M = x.size(0), N = codes.size(0), G = codes.size(1), K = G * GROUP;
  check_x(x, K);
  // [M, G]: each group's sum of x, added in one fixed order (torch's sum may vectorize differently for
  // different M, and a row must give the same bits alone or in a batch)
  at::Tensor xsum = at::empty({M, G}, x.options());
  {
    const float* xp = x.data_ptr<float>();
    float* xs = xsum.data_ptr<float>();
    for (int64_t i = 0; i < M * G; ++i) {
      float t = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) t += xp[i * GROUP + j];
      xs[i] = t;
    }
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) {
#ifdef __AVX2__
    if (simd) { tiles<Int4Tile>(M, n0, n1, xp, xs, cp, sp, mp, yp, N, K); return; }
#endif
    int4_plain(xp, xs, cp, sp, mp, yp, M, N, K, n0, n1);
  });
  return y;
}

// The kernels of the operators that cpu_kernels.py declares: torch's dispatcher calls them without entering
// Python, in eager steps and from inductor's compiled code alike. has_simd has no tensor to dispatch on: it is
// declared here, with its one implementation.
TORCH_LIBRARY_FRAGMENT(enginelib, m) { m.def("has_simd() -> bool", &has_simd); }

TORCH_LIBRARY_IMPL(enginelib, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
