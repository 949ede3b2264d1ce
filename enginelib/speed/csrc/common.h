// What the three kernel files share: the group size, float16 reads, the AVX2 helpers and the argument checks.
// Built by enginelib/speed/cpu_kernels.py (torch.utils.cpp_extension.load) with -march=native, so __AVX2__,
// __FMA__ and __F16C__ are defined exactly when the CPU that builds has them; every SIMD path is under
// #ifdef __AVX2__, next to a plain C++ loop that always compiles (simd=false runs it, so the tests check both).
// The files include ATen and torch/library.h only (no torch/extension.h, no pybind11): the library registers
// torch operators and is loaded with torch.ops.load_library, which keeps each file's build short.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;  // int4: weights per (scale, minimum), as GGUF's Q4_1

inline float half_to_float(uint16_t bits) {
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#ifdef __AVX2__
// a * b + c: one fused instruction where the CPU has FMA (-march=native defines __FMA__), else a multiply then
// an add (every AVX2 CPU sold has FMA, but the flag is its own: a build must not assume one from the other).
// Either way each output adds its terms in one fixed order, so a row gives the same bits alone or in a batch.
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) {
#ifdef __FMA__
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

inline __m128 fmadd(__m128 a, __m128 b, __m128 c) {
#ifdef __FMA__
  return _mm_fmadd_ps(a, b, c);
#else
  return _mm_add_ps(_mm_mul_ps(a, b), c);
#endif
}

inline __m256 fnmadd(__m256 a, __m256 b, __m256 c) {  // c - a * b
#ifdef __FMA__
  return _mm256_fnmadd_ps(a, b, c);
#else
  return _mm256_sub_ps(c, _mm256_mul_ps(a, b));
#endif
}

// e^x, 8 at a time, for x <= 88 (below -87 it gives e^-87, ~0 next to any sum it joins): x = n ln2 + r, e^r by
// Cephes' expf polynomial, times 2^n built in the exponent bits; within a few float32 ulps of std::exp.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = fnmadd(n, _mm256_set1_ps(0.693359375f), x);
  r = fnmadd(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = fmadd(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = fmadd(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = fmadd(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = fmadd(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = fmadd(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = fmadd(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif  // __AVX2__

inline void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 CPU matrix [M, K]");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

// Rows per task: at least ~64K weights, so small layers do not pay for threads they cannot use.
inline int64_t grain(int64_t K) { return std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(K, 1)); }

}  // namespace
