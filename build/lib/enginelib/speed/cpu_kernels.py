"""Our own CPU kernels for int8 and int4 weights: read the packed bytes, dequantize in registers, multiply-add.

Why write them: a decode step at batch 1 reads every weight once, so its time
is the time to stream the weights from memory. On an AVX2 CPU without VNNI,
the library kernels that take int8/int4 weights are slower than float32's
packed matmul (they unpack the weight, or round the activations too), so the
smaller weights bought memory but not speed. These kernels do what llama.cpp
does in spirit: one fused loop per block of output rows that loads 8 int8
(or 32 int4) codes, turns them into floats in a vector register, and
multiply-adds them with the activations, never writing a float weight.

- ``int8_linear(x [M, K] float32, q [N, K] int8, scale [N] float32) -> [M, N]``:
  ``y[m, n] = scale[n] * sum_k x[m, k] q[n, k]``.
- ``int4_linear(x, codes [N, K/32, 16] uint8, scale, minimum [N, K/32] float16)``,
  ``w = code * scale + minimum`` (quant.py's layout, GGUF's Q4_1 block):
  per group, ``sum_k x_k (c_k s + m) = s * sum_k x_k c_k + m * sum_k x_k``, so the
  codes are multiplied as small integers turned floats, and the minimum costs one
  multiply-add per group with the group's sum of ``x`` (computed once per call).

The ``q8`` twins (``int8q8_linear``, ``int4q8_linear``) round the activations to int8 per group of 32
and multiply integers, as llama.cpp does, and take their weights *interleaved* (:func:`interleave`):
output rows in blocks of 4, each block's rows side by side group by group, so a tile reads one sequential
stream of bytes (on a 2-core AVX2 machine the LM head's GEMV went from ~11 to ~20 GB/s).
``int8q8_linear`` also takes one float16 scale per group of 32 instead of one per row: GGUF's Q8_0
block, so a file's Q8_0 tensor runs as it was stored (quant.py's ``q8_0`` format).

Each call works on tiles of ``MR`` activation rows by ``NR`` output rows, so a
weight loaded (and converted) once serves up to 4 rows of a decode batch, and
several independent accumulators hide the multiply-add latency. Output rows are
split among threads with ``at::parallel_for`` (``torch.set_num_threads``).
Accumulation is float32: equal to the reference up to rounding. Each output
adds its products in the same order whatever tile it falls in (and the build
uses ``-ffp-contract=off``, so the compiler fuses nothing on its own), so a
row gives the same bits alone or in any batch: batched greedy decoding equals
one request at a time.

The AVX2+FMA path is compiled under ``#ifdef __AVX2__``; a plain C++ loop is
always compiled too and runs when ``simd=False`` (or on a CPU without AVX2), so
the tests check both. The source is built the first time a kernel is asked for
(never at import), with ``torch.utils.cpp_extension.load_inline``, into
``~/.cache/enginelib/kernels/<hash>`` (``$ENGINELIB_CACHE/kernels``): the hash
covers the source, the flags, torch's version and the CPU's flags, so a build
is reused until one of them changes.
Building needs a C++ compiler and ``ninja``; :func:`unavailable` says which is missing.

The kernels are torch operators (``enginelib::int8_linear``, ``enginelib::int4_linear``),
declared in Python with fake implementations, so ``torch.compile`` traces around
them, and implemented in C++, so a call never re-enters Python.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import torch

from enginelib.core.paged_cache import check_tables

SOURCE = r"""
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
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

// ---------------------------------------------------------------- activations rounded to int8 (the q8 kernels)

// Each row's groups of 32 as int8 codes qx and one float scale dx (x ~ qx * dx, |qx| <= 127), and the
// sum of the *rounded* group, dx * sum(qx), for int4's minimum term: both terms then multiply the same
// rounded x, whose error meets the zero-centred weight (c * s + m), not the all-positive codes c alone.
// (GGUF's Q8_1 blocks keep the same sum.) The SIMD and plain paths share these codes.
void quantize_x(const float* x, int8_t* qx, float* dx, float* xsum, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * GROUP;
    float amax = 0.f;
    for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < GROUP; ++j) {
      qx[g * GROUP + j] = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
      sum += qx[g * GROUP + j];
    }
    dx[g] = d;
    xsum[g] = d * float(sum);
  }
}

// The q8 kernels' weight layout: output rows in blocks of ROWS, and inside a block group by group, the
// ROWS rows' group g side by side: int8 [blocks, G, ROWS, 32]; int4 codes [blocks, G, ROWS, 16], scales and
// minimums [blocks, G, ROWS]. A tile of ROWS outputs then reads its weights as one sequential stream (three
// for int4), which the CPU prefetches well: with each row's bytes in its own place, 4 rows are 4-12 short
// streams, and the same GEMV read memory at half the speed. The last block's missing rows are zeros.
constexpr int64_t ROWS = 4;

inline int64_t at_row(int64_t n, int64_t g, int64_t G) { return ((n / ROWS) * G + g) * ROWS + n % ROWS; }

// scale: one float32 per row; or, where group_scale is given, one float16 per group of 32 (q8_0, GGUF's
// Q8_0), laid out as the codes
void int8q8_plain(const int8_t* qx, const float* dx, const int8_t* q, const float* scale,
                  const uint16_t* group_scale, float* y, int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1) {
  const int64_t G = K / GROUP;
  for (int64_t n = b0 * ROWS; n < std::min(N, b1 * ROWS); ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = at_row(n, g, G);
        const int8_t* w = q + at * GROUP;
        int32_t dot = 0;
        for (int64_t j = 0; j < GROUP; ++j) dot += int32_t(qx[m * K + g * GROUP + j]) * w[j];
        acc += float(dot) * (group_scale ? half_to_float(group_scale[at]) * dx[m * G + g] : dx[m * G + g]);
      }
      y[m * N + n] = group_scale ? acc : acc * scale[n];
    }
}

void int4q8_plain(const int8_t* qx, const float* dx, const float* xsum, const uint8_t* codes, const uint16_t* scale,
                  const uint16_t* minimum, float* y, int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1) {
  const int64_t G = K / GROUP;
  for (int64_t n = b0 * ROWS; n < std::min(N, b1 * ROWS); ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = at_row(n, g, G);
        const uint8_t* b = codes + at * 16;
        const int8_t* xg = qx + m * K + g * GROUP;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += int32_t(xg[j]) * (b[j] & 15) + int32_t(xg[j + 16]) * (b[j] >> 4);
        acc += half_to_float(scale[at]) * dx[m * G + g] * float(dot) + half_to_float(minimum[at]) * xsum[m * G + g];
      }
      y[m * N + n] = acc;
    }
}

#ifdef __AVX2__
// ---------------------------------------------------------------- AVX2 + FMA

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
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
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), c[1], d);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), c[2], d);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), c[3], d);
        acc[i][j] = _mm256_fmadd_ps(d, s, acc[i][j]);    // scale * (codes . x) for this group
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
// The q8 tiles: integer products of 32 codes with 32 rounded activations per instruction pair
// (maddubs: unsigned x signed bytes -> pairs summed to int16; madd with ones -> 8 int32), one float
// multiply-add per group with the two scales, as llama.cpp's Q4_1 x Q8_1 dot product. A tile is MR
// activation rows by one block of ROWS output rows, in the layout above; each output adds its terms in
// the same order whatever MR is, so a row gives the same bits alone or in a batch.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// one group's 16 bytes -> its 32 codes (low nibbles: codes 0-15, high: 16-31)
inline __m256i nibbles(const uint8_t* b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
}

inline __m128 halves4(const uint16_t* p) {  // a block's 4 float16 (one group of its 4 rows) -> 4 float32
#ifdef __F16C__
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm_setr_ps(half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]), half_to_float(p[3]));
#endif
}

// GROUPED (q8_0): per group, the block's 4 float16 scales times the activation's, as llama.cpp's Q8_0 x Q8_0
template <int MR, bool GROUPED>
void int8q8_tile(const int8_t* qx, const float* dx, const int8_t* q, const float* scale, const uint16_t* group_scale,
                 float* y, int64_t N, int64_t K, int64_t m0, int64_t b) {
  const int64_t G = K / GROUP;
  const int8_t* wb = q + b * G * ROWS * GROUP;  // the block's weights, in the order they are read
  __m256 acc[MR][ROWS];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < ROWS; ++j) acc[i][j] = _mm256_setzero_ps();
  alignas(16) float d[MR][ROWS];  // GROUPED: this group's scale x activation scale, per activation and output row
  for (int64_t g = 0; g < G; ++g) {
    __m256i x[MR];
    __m256 dxi[MR];
    for (int i = 0; i < MR; ++i) {
      x[i] = load32(qx + (m0 + i) * K + g * GROUP);
      if (GROUPED)
        _mm_store_ps(d[i], _mm_mul_ps(halves4(group_scale + (b * G + g) * ROWS), _mm_set1_ps(dx[(m0 + i) * G + g])));
      else
        dxi[i] = _mm256_broadcast_ss(dx + (m0 + i) * G + g);
    }
    for (int j = 0; j < ROWS; ++j) {
      const __m256i w = load32(wb + (g * ROWS + j) * GROUP);
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned; its sign moves onto x
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(aw, _mm256_sign_epi8(x[i], w))),
                                    GROUPED ? _mm256_broadcast_ss(&d[i][j]) : dxi[i], acc[i][j]);
    }
  }
  for (int j = 0; j < ROWS && b * ROWS + j < N; ++j)
    for (int i = 0; i < MR; ++i)
      y[(m0 + i) * N + b * ROWS + j] = GROUPED ? hsum(acc[i][j]) : hsum(acc[i][j]) * scale[b * ROWS + j];
}

// int4: per group, the block's 4 scales and 4 minimums in one float16 conversion each; the minimums' share
// (minimum x sum of x) of all 4 outputs in one multiply-add, kept apart from the codes' sums until the end
template <int MR>
void int4q8_tile(const int8_t* qx, const float* dx, const float* xsum, const uint8_t* codes, const uint16_t* scale,
                 const uint16_t* minimum, float* y, int64_t N, int64_t K, int64_t m0, int64_t b) {
  const int64_t G = K / GROUP;
  const uint8_t* cb = codes + b * G * ROWS * 16;
  const uint16_t* sb = scale + b * G * ROWS;
  const uint16_t* mb = minimum + b * G * ROWS;
  __m256 acc[MR][ROWS];
  __m128 mins[MR];
  for (int i = 0; i < MR; ++i) {
    mins[i] = _mm_setzero_ps();
    for (int j = 0; j < ROWS; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  alignas(16) float d[MR][ROWS];  // this group's scale x activation scale, per activation row and output row
  for (int64_t g = 0; g < G; ++g) {
    const __m128 s = halves4(sb + g * ROWS), mn = halves4(mb + g * ROWS);
    __m256i x[MR];
    for (int i = 0; i < MR; ++i) {
      _mm_store_ps(d[i], _mm_mul_ps(s, _mm_set1_ps(dx[(m0 + i) * G + g])));
      mins[i] = _mm_fmadd_ps(mn, _mm_set1_ps(xsum[(m0 + i) * G + g]), mins[i]);
      x[i] = load32(qx + (m0 + i) * K + g * GROUP);
    }
    for (int j = 0; j < ROWS; ++j) {
      const __m256i c = nibbles(cb + (g * ROWS + j) * 16);
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(c, x[i])), _mm256_broadcast_ss(&d[i][j]), acc[i][j]);
    }
  }
  alignas(16) float mo[MR][ROWS];
  for (int i = 0; i < MR; ++i) _mm_store_ps(mo[i], mins[i]);
  for (int j = 0; j < ROWS && b * ROWS + j < N; ++j)
    for (int i = 0; i < MR; ++i) y[(m0 + i) * N + b * ROWS + j] = hsum(acc[i][j]) + mo[i][j];
}

template <bool GROUPED> struct Int8Q8Tile {
  template <int MR> static void run(const int8_t* qx, const float* dx, const int8_t* q, const float* s,
                                    const uint16_t* gs, float* y, int64_t N, int64_t K, int64_t m, int64_t b) {
    int8q8_tile<MR, GROUPED>(qx, dx, q, s, gs, y, N, K, m, b);
  }
};
struct Int4Q8Tile {
  template <int MR> static void run(const int8_t* qx, const float* dx, const float* xs, const uint8_t* c,
                                    const uint16_t* s, const uint16_t* mn, float* y, int64_t N, int64_t K,
                                    int64_t m, int64_t b) {
    int4q8_tile<MR>(qx, dx, xs, c, s, mn, y, N, K, m, b);
  }
};

// Blocks b0:b1, L1_BLOCKS at a time (their weights are read from memory once, then from L1 for each tile of
// activation rows), two activation rows a tile (the last row of an odd batch alone).
constexpr int64_t L1_BLOCKS = 4;

template <class Tile, typename... A>
void q8_tiles(int64_t M, int64_t b0, int64_t b1, A... args) {
  for (int64_t c = b0; c < b1; c += L1_BLOCKS) {
    const int64_t c1 = std::min(c + L1_BLOCKS, b1);
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      for (int64_t b = c; b < c1; ++b) Tile::template run<2>(args..., m, b);
    for (; m < M; ++m)
      for (int64_t b = c; b < c1; ++b) Tile::template run<1>(args..., m, b);
  }
}
#endif  // __AVX2__

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 CPU matrix [M, K]");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

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
                t->size(1) == codes.size(1) && t->is_contiguous(), "scale and minimum must be contiguous float16 [N, K/32]");
}

// Rows per task: at least ~64K weights, so small layers do not pay for threads they cannot use.
int64_t grain(int64_t K) { return std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(K, 1)); }

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

// The q8 kernels: x rounded to int8 per group of 32 first (once per call, not per output row).
struct RoundedX {
  at::Tensor qx, dx, xsum;  // [M, K] int8, [M, G] float32 (scales), [M, G] float32 (sums)
  explicit RoundedX(const at::Tensor& x) {
    const int64_t M = x.size(0), K = x.size(1), G = K / GROUP;
    TORCH_CHECK(K % GROUP == 0, "the q8 kernels need K to be a multiple of ", GROUP, ", got ", K);
    qx = at::empty({M, K}, x.options().dtype(at::kChar));
    dx = at::empty({M, G}, x.options());
    xsum = at::empty({M, G}, x.options());
    quantize_x(x.data_ptr<float>(), qx.data_ptr<int8_t>(), dx.data_ptr<float>(), xsum.data_ptr<float>(), M * G);
  }
};

void check_rows(const at::Tensor& w, int64_t rows, int64_t bytes) {
  TORCH_CHECK(w.dim() == 4 && w.size(0) == (rows + ROWS - 1) / ROWS && w.size(2) == ROWS && w.size(3) == bytes &&
              w.is_contiguous(), "the q8 kernels take weights in blocks of ", ROWS, " rows (cpu_kernels.interleave): [",
              (rows + ROWS - 1) / ROWS, ", K/32, ", ROWS, ", ", bytes, "] for ", rows, " rows, got ", w.sizes());
}

// Output blocks per task: at least ~64K weights, as grain() above
int64_t block_grain(int64_t K) { return std::max<int64_t>(1, grain(K) / ROWS); }

// scale: float32 [N] (one per row), or float16 [N/4, K/32, 4] (one per group of 32, interleaved: q8_0)
at::Tensor int8q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t N, bool simd) {
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be int8");
  check_rows(q, N, GROUP);
  const bool per_group = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(per_group ? scale.dim() == 3 && scale.sizes() == q.sizes().slice(0, 3) && scale.is_contiguous()
                        : scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "scale must be contiguous float32 [", N, "] or float16 ", q.sizes().slice(0, 3));
  const int64_t M = x.size(0), K = q.size(1) * GROUP;
  check_x(x, K);
  const RoundedX r(x);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qx = r.qx.data_ptr<int8_t>();
  const float* dx = r.dx.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const float* sp = per_group ? nullptr : scale.data_ptr<float>();
  const uint16_t* gp = per_group ? reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()) : nullptr;
  at::parallel_for(0, q.size(0), block_grain(K), [&](int64_t b0, int64_t b1) {
#ifdef __AVX2__
    if (simd && per_group) { q8_tiles<Int8Q8Tile<true>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K); return; }
    if (simd) { q8_tiles<Int8Q8Tile<false>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K); return; }
#endif
    int8q8_plain(qx, dx, qp, sp, gp, yp, M, N, K, b0, b1);
  });
  return y;
}

at::Tensor int4q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& minimum, int64_t N, bool simd) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "codes must be uint8");
  check_rows(codes, N, 16);
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->sizes() == codes.sizes().slice(0, 3) &&
                t->is_contiguous(), "scale and minimum must be contiguous float16 ", codes.sizes().slice(0, 3));
  const int64_t M = x.size(0), G = codes.size(1), K = G * GROUP;
  check_x(x, K);
  const RoundedX r(x);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qx = r.qx.data_ptr<int8_t>();
  const float* dx = r.dx.data_ptr<float>();
  const float* xs = r.xsum.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, codes.size(0), block_grain(K), [&](int64_t b0, int64_t b1) {
#ifdef __AVX2__
    if (simd) { q8_tiles<Int4Q8Tile>(M, b0, b1, qx, dx, xs, cp, sp, mp, yp, N, K); return; }
#endif
    int4q8_plain(qx, dx, xs, cp, sp, mp, yp, M, N, K, b0, b1);
  });
  return y;
}

// ---------------------------------------------------------------- decode attention over the paged cache

namespace {

// q . k over one head (d floats), and y += p * v: the two loops attention runs per key
inline float dot(const float* a, const float* b, int64_t d, bool simd) {
  int64_t i = 0;
  float t = 0.f;
#ifdef __AVX2__
  if (simd) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
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
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(y + i)));
  }
#endif
  for (; i < d; ++i) y[i] += p * v[i];
}

// e^x for the scores minus their maximum (x <= 0), 8 at a time: x = n ln2 + r, e^r by Cephes' expf
// polynomial, times 2^n built in the exponent bits; within a few float32 ulps of std::exp.
inline float softmax_exp(float* p, int64_t len, float mx, bool simd) {
  int64_t t = 0;
  float sum = 0.f;
#ifdef __AVX2__
  if (simd) {
    __m256 total = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
      const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(mx)), _mm256_set1_ps(-87.f));
      const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
      r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
      __m256 y = _mm256_set1_ps(1.9875691500e-4f);
      y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
      y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
      y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
      y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
      y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
      y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
      const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
      const __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
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
template <int DV>
void attend_head(const float* qi, const float* ki, const float* vi, const int64_t* rows, int64_t len, float scale,
                 float* p, float* o) {
  __m256 q[DV];
  for (int r = 0; r < DV; ++r) q[r] = _mm256_loadu_ps(qi + 8 * r);
  const __m128 sc = _mm_set1_ps(scale);
  __m128 mx4 = _mm_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {
    const float *k0 = ki + rows[t], *k1 = ki + rows[t + 1], *k2 = ki + rows[t + 2], *k3 = ki + rows[t + 3];
    __m256 a0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k3));
    for (int r = 1; r < DV; ++r) {
      a0 = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k0 + 8 * r), a0);
      a1 = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k1 + 8 * r), a1);
      a2 = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k2 + 8 * r), a2);
      a3 = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k3 + 8 * r), a3);
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
    for (int r = 0; r < DV; ++r) acc[r] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * r), acc[r]);
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
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool,
                            at::Tensor& v_pool, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            bool simd) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 [S, H, D]");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous() && t->size(0) == q.size(0) &&
                t->size(1) == k_pool.size(2) && t->size(2) == q.size(2), "k and v must be contiguous float32 [S, KV, D]");
  for (const at::Tensor* t : {&k_pool, &v_pool})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->is_contiguous() && t->sizes() == k_pool.sizes(),
                "k_pool and v_pool must be contiguous float32 [num_blocks, block_size, KV, D]");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_pool.size(0), BS = k_pool.size(1), KV = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && H % KV == 0, "q has ", H, " heads of ", D, ", the cache ", KV, " of ", k_pool.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == S &&
              block_tables.is_contiguous(), "block_tables must be contiguous int64 [S, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.numel() == S && context_lens.is_contiguous(),
              "context_lens must be contiguous int64 [S]");
  const int64_t W = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {  // checked here: an exception inside the threads below would be late
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= W * BS, "sequence ", s, " has ", lens[s], " keys; its table holds ", W * BS);
    for (int64_t b = 0; b < (lens[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(bt[s * W + b] >= 0 && bt[s * W + b] < NB, "block ", bt[s * W + b], " is outside the pool of ", NB);
  }
  for (int64_t s = 0; s < S; ++s) {  // the new keys and values, KV * D floats each, at their slots
    if (lens[s] == 0) continue;  // a padding row
    const int64_t t = lens[s] - 1, slot = bt[s * W + t / BS] * BS + t % BS;
    std::copy_n(k.data_ptr<float>() + s * KV * D, KV * D, k_pool.data_ptr<float>() + slot * KV * D);
    std::copy_n(v.data_ptr<float>() + s * KV * D, KV * D, v_pool.data_ptr<float>() + slot * KV * D);
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  int64_t keys = 0;
  for (int64_t s = 0; s < S; ++s) keys += lens[s];
  // (sequence, head) pairs per task: ~64K multiply-adds each, so a short step runs in this thread alone
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) * S / std::max<int64_t>(1, 2 * keys * D));
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t G = H / KV;
  at::parallel_for(0, S * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    std::vector<int64_t> rows;  // where sequence s's keys start in the pools, found once per task, not per
    int64_t rows_of = -1;       // key and head (the division t / BS costs more than the key's arithmetic)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / H, kvh = (i % H) / G, len = lens[s];
      if (s != rows_of) {
        rows.resize(len);
        for (int64_t t = 0; t < len; ++t) rows[t] = (bt[s * W + t / BS] * BS + t % BS) * KV * D;
        rows_of = s;
      }
      if (len == 0) {  // a padding row
        std::fill(op + i * D, op + (i + 1) * D, 0.f);
        continue;
      }
      p.resize(len);
#ifdef __AVX2__
      if (simd && D == 64) {
        attend_head<8>(qp + i * D, kp + kvh * D, vp + kvh * D, rows.data(), len, scale, p.data(), op + i * D);
        continue;
      }
#endif
      attend_head_any(qp + i * D, kp + kvh * D, vp + kvh * D, rows.data(), len, D, scale, p.data(), op + i * D, simd);
    }
  });
  return out;
}

// The kernels of the operators that cpu_kernels.py declares: torch's dispatcher calls them without
// entering Python, in eager steps and from inductor's compiled code alike.
TORCH_LIBRARY_IMPL(enginelib, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8q8_linear", &int8q8_linear);
  m.impl("int4q8_linear", &int4q8_linear);
  m.impl("decode_attention", &decode_attention);
}
"""

FUNCTIONS = ["int8_linear", "int4_linear", "has_simd"]
# -ffp-contract=off: the compiler fuses no multiply-add on its own, so each output is summed in the order
# written whatever tile it falls in (a row alone or in a batch: the same bits)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
CACHE: Path | None = None  # None: the models' cache folder ($ENGINELIB_CACHE, else ~/.cache/enginelib) / "kernels"

_module: ModuleType | None = None
_failure: str | None = None


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """Where the build lives: a new folder whenever the source, flags, torch or the CPU change."""
    from enginelib.model.weights import cache_dir

    key = "\n".join([SOURCE, " ".join(CFLAGS), torch.__version__, _cpu_flags()])
    return (CACHE or cache_dir() / "kernels") / hashlib.sha256(key.encode()).hexdigest()[:16]


def compiler() -> str:
    """The C++ compiler torch's extension builder will call (``$CXX``, else ``c++``)."""
    return os.environ.get("CXX", "c++")


def _missing_tool() -> str | None:
    if shutil.which(compiler()) is None:
        return (f"no C++ compiler ({compiler()!r}) was found to build enginelib's CPU kernels: install one "
                f"(apt-get install g++; on macOS xcode-select --install) or set $CXX")
    if shutil.which("ninja") is None:
        return "building enginelib's CPU kernels needs ninja, which was not found: pip install ninja"
    return None


def unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can). Builds them the first time it is asked."""
    global _failure
    if _module is not None:
        return None
    if _failure is not None:
        return _failure
    missing = _missing_tool()
    if missing:
        return missing  # not remembered: installing the tool fixes it without a restart
    try:
        load()
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        tail = "\n".join(str(exc).strip().splitlines()[-8:])
        _failure = f"building enginelib's CPU kernels failed (in {build_dir()}); the compiler's last lines:\n{tail}"
        return _failure
    return None


def load() -> ModuleType:
    """The compiled kernels, built on the first call (tens of seconds) and loaded from the cache afterwards."""
    global _module
    if _module is None:
        missing = _missing_tool()
        if missing:
            raise RuntimeError(missing)
        from torch.utils.cpp_extension import load_inline

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        _module = load_inline(name=f"enginelib_cpu_kernels_{directory.name}", cpp_sources=[SOURCE],
                              functions=FUNCTIONS, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=str(directory), verbose=False)
    return _module


def has_simd() -> bool:
    """Whether the build has the AVX2+FMA path (else ``simd=True`` runs the plain loop too)."""
    return bool(load().has_simd())


# ---------------------------------------------------------------- operators, traceable by torch.compile

# Declared here, implemented in C++ (TORCH_LIBRARY_IMPL above, registered when the build loads): a call goes
# straight from torch's dispatcher to the kernel, with no Python in between (a Python custom op costs tens
# of microseconds a call, and a decode step makes 121 of them).
torch.library.define("enginelib::int8_linear", "(Tensor x, Tensor q, Tensor scale, bool simd=True) -> Tensor")
torch.library.define("enginelib::int4_linear",
                     "(Tensor x, Tensor codes, Tensor scale, Tensor minimum, bool simd=True) -> Tensor")
# the q8 kernels (activations rounded to int8 too) take their weights interleaved (see interleave) and the row count
torch.library.define("enginelib::int8q8_linear", "(Tensor x, Tensor q, Tensor scale, int rows, bool simd=True) -> Tensor")
torch.library.define("enginelib::int4q8_linear",
                     "(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int rows, bool simd=True) -> Tensor")
torch.library.define("enginelib::decode_attention", "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, "
                     "Tensor block_tables, Tensor context_lens, bool simd=True) -> Tensor")


@torch.library.register_fake("enginelib::int8_linear")
def _(x, q, scale, simd=True):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.register_fake("enginelib::int4_linear")
def _(x, codes, scale, minimum, simd=True):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("enginelib::int8q8_linear")
def _(x, q, scale, rows, simd=True):
    return x.new_empty(x.shape[0], rows)


@torch.library.register_fake("enginelib::int4q8_linear")
def _(x, codes, scale, minimum, rows, simd=True):
    return x.new_empty(x.shape[0], rows)


@torch.library.register_fake("enginelib::decode_attention")
def _(q, k, v, k_pool, v_pool, block_tables, context_lens, simd=True):
    return torch.empty_like(q)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """A decode step's attention over one layer's paged pool, with one new token per sequence.

    q: [S, H, D], k, v: [S, KV, D] float32, the new token's; k_pool, v_pool:
    [num_blocks, block_size, KV, D]; block_tables: [S, max_blocks] int64;
    context_lens: [S], the keys each sequence has with its new one (0: a padding
    row, left alone, zeros out). Writes k, v at each sequence's last position,
    then returns [S, H, D]: the paged-attention kernel of a decode step, with no
    keys gathered or copied. (A compiled step calls the operator itself, after one
    :func:`check_tables` for all its layers.)
    """
    if _module is None:
        load()
    _check(q.dim() == 3 and k.dim() == v.dim() == 3 and k_pool.dim() == 4 and k.shape == v.shape
           == (q.shape[0], k_pool.shape[2], q.shape[2]) and k_pool.shape == v_pool.shape
           and k_pool.is_contiguous() and v_pool.is_contiguous()
           and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v, k_pool, v_pool)),
           "decode_attention takes float32 CPU q [S, H, D], k and v [S, KV, D], contiguous pools "
           "[blocks, block_size, KV, D]")
    _check(block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.dim() == 2
           and block_tables.shape[0] == context_lens.numel() == q.shape[0],
           "block_tables must be int64 [S, max_blocks] and context_lens int64 [S]")
    check_tables(block_tables, context_lens, k_pool.shape[0], k_pool.shape[1])
    return torch.ops.enginelib.decode_attention(q.contiguous(), k.contiguous(), v.contiguous(), k_pool, v_pool,
                                                block_tables.contiguous(), context_lens.contiguous(), simd)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _ready(x: torch.Tensor, k: int, weight_ok: bool, weight_shape: str) -> torch.Tensor:
    """Build the kernels if needed, and check the arguments here, in Python. The C++ checks them too,
    but an error thrown there must cross torch's dispatcher, and on one machine (torch 2.11, the host's
    g++) that crossing crashed the process instead of raising."""
    if _module is None:
        load()
    _check(weight_ok, f"the weight must be {weight_shape}")
    _check(x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2,
           "x must be a contiguous float32 CPU matrix [M, K]")
    _check(x.shape[1] == k, f"x has {x.shape[1]} columns, the weight {k}")
    return x.contiguous()


def _int8_ok(q: torch.Tensor, scale: torch.Tensor) -> bool:
    return q.dtype == torch.int8 and q.dim() == 2 and scale.dtype == torch.float32 and scale.numel() == q.shape[0]


def _int4_ok(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
    return (codes.dtype == torch.uint8 and codes.dim() == 3 and codes.shape[2] == 16
            and all(t.dtype == torch.float16 and t.shape == codes.shape[:2] for t in (scale, minimum)))


INT8 = "int8 [N, K] with float32 scales [N]"
INT4 = "uint8 codes [N, K/32, 16] with float16 scales and minimums [N, K/32]"


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """``x [M, K] float32 @ (q [N, K] int8 * scale [N, 1]).T`` -> [M, N] float32."""
    x = _ready(x, q.shape[-1], _int8_ok(q, scale), INT8)
    return torch.ops.enginelib.int8_linear(x, q, scale, simd)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                simd: bool = True) -> torch.Tensor:
    """``x [M, K] float32`` times the int4 weight (codes [N, K/32, 16], float16 scale and minimum [N, K/32])."""
    x = _ready(x, codes.shape[1] * 32 if codes.dim() == 3 else -1, _int4_ok(codes, scale, minimum), INT4)
    return torch.ops.enginelib.int4_linear(x, codes, scale, minimum, simd)


ROWS = 4  # output rows per block in the q8 kernels' weight layout


def interleave(t: torch.Tensor) -> torch.Tensor:
    """A weight's per-row tensor [N, G, ...] (G groups of 32 inputs) in the q8 kernels' layout, [ceil(N/4), G, 4, ...]:
    output rows in blocks of 4, and in a block group by group, the 4 rows' group side by side, so a tile of 4
    outputs reads its bytes in one sequential stream. The last block is filled up with zero rows."""
    blocks = -(-t.shape[0] // ROWS)
    padded = torch.cat([t, t.new_zeros(blocks * ROWS - t.shape[0], *t.shape[1:])])
    return padded.reshape(blocks, ROWS, *t.shape[1:]).transpose(1, 2).contiguous()


def deinterleave(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of :func:`interleave`: [blocks, G, 4, ...] -> [rows, G, ...]."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:rows]


def _interleaved_ok(w: torch.Tensor, rows: int, dtype: torch.dtype, size: int) -> bool:
    return (w.dtype == dtype and w.dim() == 4 and w.shape[0] == -(-rows // ROWS) and w.shape[2] == ROWS
            and w.shape[3] == size)


def int8q8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: int, simd: bool = True) -> torch.Tensor:
    """:func:`int8_linear` with ``x`` rounded to int8 per group of 32 and integer products; ``q`` is the
    int8 weight [rows, K] interleaved (``interleave(q.reshape(rows, K // 32, 32))``), ``scale`` float32
    [rows], or float16 [rows, K/32] interleaved (one scale per group of 32: GGUF's Q8_0)."""
    per_row = scale.dtype == torch.float32 and scale.numel() == rows
    per_group = scale.dtype == torch.float16 and q.dim() == 4 and scale.shape == q.shape[:3]
    blocks = -(-rows // ROWS)
    x = _ready(x, q.shape[1] * 32 if q.dim() == 4 else -1, _interleaved_ok(q, rows, torch.int8, 32) and
               (per_row or per_group), f"int8 [{blocks}, K/32, {ROWS}, 32] (cpu_kernels.interleave) with float32 "
               f"scales [{rows}] or float16 scales [{blocks}, K/32, {ROWS}]")
    return torch.ops.enginelib.int8q8_linear(x, q, scale, rows, simd)


def int4q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, rows: int,
                  simd: bool = True) -> torch.Tensor:
    """:func:`int4_linear` with ``x`` rounded to int8 per group of 32 and integer products; the codes, scales
    and minimums interleaved (:func:`interleave`)."""
    ok = (_interleaved_ok(codes, rows, torch.uint8, 16)
          and all(t.dtype == torch.float16 and t.shape == codes.shape[:3] for t in (scale, minimum)))
    x = _ready(x, codes.shape[1] * 32 if codes.dim() == 4 else -1, ok, f"uint8 codes [{-(-rows // ROWS)}, K/32, "
               f"{ROWS}, 16] with float16 scales and minimums [{-(-rows // ROWS)}, K/32, {ROWS}] (cpu_kernels.interleave)")
    return torch.ops.enginelib.int4q8_linear(x, codes, scale, minimum, rows, simd)
