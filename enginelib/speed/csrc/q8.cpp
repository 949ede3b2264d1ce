// The q8 kernels: the activations rounded to int8 per group of 32 and integer products, as llama.cpp does,
// with the weights interleaved in blocks of 4 rows (enginelib.speed.cpu_kernels.int8q8_linear, int4q8_linear).
#include "attention.h"
#include "common.h"

#include <omp.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>

namespace {

// ---------------------------------------------------------------- activations rounded to int8 (the q8 kernels)

// Each row's groups of 32 as int8 codes qx and one float scale dx (x ~ qx * dx, |qx| <= 127), and the
// sum of the *rounded* group, dx * sum(qx), for int4's minimum term: both terms then multiply the same
// rounded x, whose error meets the zero-centred weight (c * s + m), not the all-positive codes c alone.
// (GGUF's Q8_1 blocks keep the same sum.) The plain path rounds in a loop, the others with SIMD, to the same bits.
#ifdef __AVX2__
// quantize_x's loop for one group, 8 floats an instruction, to the same bits: the same float products, rounded
// to the nearest even as nearbyint does (the CPU's default mode), the same integer sum. The int32 -> int8
// packs work within 128-bit halves; the permute puts the 4-byte pieces back in order.
void quantize_group_simd(const float* xg, int8_t* qg, float* dx, float* xsum) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_loadu_ps(xg + 8 * c);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[c], magnitude));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  __m256i q[4], sum = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(inv)));
    sum = _mm256_add_epi32(sum, q[c]);
  }
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  *dx = d;
  *xsum = d * float(_mm_cvtsi128_si32(s));
}
#endif

void quantize_x(const float* x, int8_t* qx, float* dx, float* xsum, int64_t groups, bool simd) {
#ifdef __AVX2__
  if (simd) {
    for (int64_t g = 0; g < groups; ++g) quantize_group_simd(x + g * GROUP, qx + g * GROUP, dx + g, xsum + g);
    return;
  }
#endif
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

// The paths a q8 call can take, fastest last; -march=native compiles those the building CPU has, and a call
// takes the fastest one unless it names another (the tests force each): the plain loop; AVX2's
// maddubs + madd (32 byte products, summed in pairs to int16, then to int32); the same tiles with VNNI's
// vpdpbusd, which sums 4 byte products straight into int32 in one instruction (256-bit: AVX-VNNI, or
// AVX-512 VNNI's VL form; the same int32, so the same bits as AVX2); and AVX-512 VNNI with a block's 4 rows
// in one 512-bit register (4x fewer instructions a group than AVX2; the float sums run in another order,
// so its bits differ from AVX2's by float32 rounding, but a row alone and in a batch still agree).
enum Q8Path : int64_t { PLAIN = 0, AVX2 = 1, AVX2_VNNI = 2, AVX512_VNNI = 3 };

#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define Q8_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define Q8_VNNI512 1
#endif

// Which paths this build has, by Q8Path, and their names (cpu_kernels.q8_paths), slowest first.
constexpr bool BUILT[] = {
    true,
#ifdef __AVX2__
    true,
#else
    false,
#endif
#ifdef Q8_VNNI256
    true,
#else
    false,
#endif
#ifdef Q8_VNNI512
    true,
#else
    false,
#endif
};
const char* const NAMES[] = {"plain", "avx2", "avx2_vnni", "avx512_vnni"};

std::vector<std::string> q8_paths() {
  std::vector<std::string> names;
  for (int64_t p = PLAIN; p <= AVX512_VNNI; ++p)
    if (BUILT[p]) names.emplace_back(NAMES[p]);
  return names;
}

int64_t q8_path(int64_t asked) {  // -1: the fastest built
  if (asked < 0)
    for (int64_t p = AVX512_VNNI; p >= PLAIN; --p)
      if (BUILT[p]) return p;
  TORCH_CHECK(asked <= AVX512_VNNI && BUILT[asked], "the q8 kernels' path ", asked, " is not built on this CPU");
  return asked;
}

#ifdef __AVX2__
// The q8 tiles: integer products of 32 codes with 32 rounded activations per instruction pair
// (maddubs: unsigned x signed bytes -> pairs summed to int16; madd with ones -> 8 int32), one float
// multiply-add per group with the two scales, as llama.cpp's Q4_1 x Q8_1 dot product. A tile is MR
// activation rows by one block of ROWS output rows, in the layout above; each output adds its terms in
// the same order whatever MR is, so a row gives the same bits alone or in a batch.
template <bool VNNI>
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#ifdef Q8_VNNI256
  if constexpr (VNNI) return dpbusd256(_mm256_setzero_si256(), u, s);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Software prefetch, PREFETCH bytes (as many groups) ahead in each weight stream. At batch 1 a layer is read
// once, from memory or a far last-level cache, in a few microseconds: the hardware prefetcher starts each call's
// streams cold and stops at every 4 KiB page. So each thread asks for the first lines of its share at once
// (Int8Warm, Int4Warm), then for the line PREFETCH bytes ahead of each one it reads (past a weight's end is
// harmless: a prefetch never faults). Measured on the one-call decode step (fused_step), 2 threads: on a 2-core
// Xeon whose 480 MiB L3 holds the model, no prefetch 6.2 ms a step, 2 KiB ahead 4.2, 8 KiB ahead 3.0 (4 to 12 KiB
// alike within the machine's noise); on a 2-core EPYC 2 KiB ahead made the step's 121 matvecs ~10% faster.
constexpr int64_t PREFETCH = 8192;

inline void prefetch(const void* p, int64_t ahead) {
  _mm_prefetch(static_cast<const char*>(p) + ahead, _MM_HINT_T0);
}

inline void warm(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) prefetch(p, at);
}

// group g of a block: int8, its 4 rows' 128 bytes of codes (and, q8_0, 8 bytes of scales, a line every 8 groups)
inline void prefetch_int8(const int8_t* wb, const uint16_t* gb, int64_t g) {
  prefetch(wb + g * ROWS * GROUP, PREFETCH);
  prefetch(wb + g * ROWS * GROUP, PREFETCH + 64);
  if (gb && g % 8 == 0) prefetch(gb + g * ROWS, PREFETCH / 16);
}

// int4: 64 bytes of codes, and a line of scales and one of minimums every 8 groups
inline void prefetch_int4(const uint8_t* cb, const uint16_t* sb, const uint16_t* mb, int64_t g) {
  prefetch(cb + g * ROWS * 16, PREFETCH);
  if (g % 8 == 0) {
    prefetch(sb + g * ROWS, PREFETCH / 8);
    prefetch(mb + g * ROWS, PREFETCH / 8);
  }
}

// The first PREFETCH bytes of a thread's share of blocks b0:b1 (and as many groups of their scales)
struct Int8Warm {
  static void start(int64_t b0, int64_t b1, const int8_t*, const float*, const int8_t* q, const float*,
                    const uint16_t* gs, float*, int64_t, int64_t K) {
    const int64_t G = K / GROUP, bytes = std::min(PREFETCH, (b1 - b0) * G * ROWS * GROUP);
    warm(q + b0 * G * ROWS * GROUP, bytes);
    if (gs) warm(gs + b0 * G * ROWS, bytes / 16);
  }
};

struct Int4Warm {
  static void start(int64_t b0, int64_t b1, const int8_t*, const float*, const float*, const uint8_t* c,
                    const uint16_t* s, const uint16_t* mn, float*, int64_t, int64_t K) {
    const int64_t G = K / GROUP, bytes = std::min(PREFETCH, (b1 - b0) * G * ROWS * 16);
    warm(c + b0 * G * ROWS * 16, bytes);
    warm(s + b0 * G * ROWS, bytes / 8);
    warm(mn + b0 * G * ROWS, bytes / 8);
  }
};

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
template <int MR, bool GROUPED, bool VNNI>
void int8q8_tile(const int8_t* qx, const float* dx, const int8_t* q, const float* scale, const uint16_t* group_scale,
                 float* y, int64_t N, int64_t K, int64_t m0, int64_t b) {
  const int64_t G = K / GROUP;
  const int8_t* wb = q + b * G * ROWS * GROUP;  // the block's weights, in the order they are read
  __m256 acc[MR][ROWS];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < ROWS; ++j) acc[i][j] = _mm256_setzero_ps();
  alignas(16) float d[MR][ROWS];  // GROUPED: this group's scale x activation scale, per activation and output row
  for (int64_t g = 0; g < G; ++g) {
    prefetch_int8(wb, GROUPED ? group_scale + b * G * ROWS : nullptr, g);
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
        acc[i][j] = fmadd(_mm256_cvtepi32_ps(dot_u8_s8<VNNI>(aw, _mm256_sign_epi8(x[i], w))),
                                    GROUPED ? _mm256_broadcast_ss(&d[i][j]) : dxi[i], acc[i][j]);
    }
  }
  for (int j = 0; j < ROWS && b * ROWS + j < N; ++j)
    for (int i = 0; i < MR; ++i)
      y[(m0 + i) * N + b * ROWS + j] = GROUPED ? hsum(acc[i][j]) : hsum(acc[i][j]) * scale[b * ROWS + j];
}

// int4: per group, the block's 4 scales and 4 minimums in one float16 conversion each; the minimums' share
// (minimum x sum of x) of all 4 outputs in one multiply-add, kept apart from the codes' sums until the end
template <int MR, bool VNNI>
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
    prefetch_int4(cb, sb, mb, g);
    const __m128 s = halves4(sb + g * ROWS), mn = halves4(mb + g * ROWS);
    __m256i x[MR];
    for (int i = 0; i < MR; ++i) {
      _mm_store_ps(d[i], _mm_mul_ps(s, _mm_set1_ps(dx[(m0 + i) * G + g])));
      mins[i] = fmadd(mn, _mm_set1_ps(xsum[(m0 + i) * G + g]), mins[i]);
      x[i] = load32(qx + (m0 + i) * K + g * GROUP);
    }
    for (int j = 0; j < ROWS; ++j) {
      const __m256i c = nibbles(cb + (g * ROWS + j) * 16);
      for (int i = 0; i < MR; ++i)
        acc[i][j] = fmadd(_mm256_cvtepi32_ps(dot_u8_s8<VNNI>(c, x[i])), _mm256_broadcast_ss(&d[i][j]), acc[i][j]);
    }
  }
  alignas(16) float mo[MR][ROWS];
  for (int i = 0; i < MR; ++i) _mm_store_ps(mo[i], mins[i]);
  for (int j = 0; j < ROWS && b * ROWS + j < N; ++j)
    for (int i = 0; i < MR; ++i) y[(m0 + i) * N + b * ROWS + j] = hsum(acc[i][j]) + mo[i][j];
}

template <bool GROUPED, bool VNNI> struct Int8Q8Tile : Int8Warm {
  template <int MR> static void run(const int8_t* qx, const float* dx, const int8_t* q, const float* s,
                                    const uint16_t* gs, float* y, int64_t N, int64_t K, int64_t m, int64_t b) {
    int8q8_tile<MR, GROUPED, VNNI>(qx, dx, q, s, gs, y, N, K, m, b);
  }
};
template <bool VNNI> struct Int4Q8Tile : Int4Warm {
  template <int MR> static void run(const int8_t* qx, const float* dx, const float* xs, const uint8_t* c,
                                    const uint16_t* s, const uint16_t* mn, float* y, int64_t N, int64_t K,
                                    int64_t m, int64_t b) {
    int4q8_tile<MR, VNNI>(qx, dx, xs, c, s, mn, y, N, K, m, b);
  }
};

#ifdef Q8_VNNI512
// AVX-512 VNNI: one register holds a group of the block's 4 rows (int4: 4 x 16 bytes; int8: 2 x 32 bytes, so
// two registers), its activations broadcast to each row's lane; vpdpbusd sums 4 byte products into each int32,
// and each row's scale is spread over its lanes (spread). Each output's lanes are summed once, at the end.
inline __m512 spread(__m128 d4, int per_row) {  // [d0 d1 d2 d3] -> each repeated over its row's lanes
  const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i by8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(per_row == 4 ? by4 : by8, _mm512_castps128_ps512(d4));
}

inline float lanes_sum(const float* v, int n) {  // one output's lanes, in a fixed order
  float t = 0.f;
  for (int k = 0; k < n; ++k) t += v[k];
  return t;
}

template <int MR, bool GROUPED>
void int8q8_tile512(const int8_t* qx, const float* dx, const int8_t* q, const float* scale,
                    const uint16_t* group_scale, float* y, int64_t N, int64_t K, int64_t m0, int64_t b) {
  const int64_t G = K / GROUP;
  const int8_t* wb = q + b * G * ROWS * GROUP;
  __m512 acc[MR][2];  // rows 0-1 and rows 2-3, 8 lanes a row
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    prefetch_int8(wb, GROUPED ? group_scale + b * G * ROWS : nullptr, g);
    __m512i w[2], aw[2];
    __mmask64 neg[2];
    for (int h = 0; h < 2; ++h) {  // |w| as unsigned; its sign moves onto x (AVX-512 has no sign_epi8)
      w[h] = _mm512_loadu_si512(wb + (g * ROWS + 2 * h) * GROUP);
      neg[h] = _mm512_movepi8_mask(w[h]);
      aw[h] = _mm512_abs_epi8(w[h]);
    }
    __m512 d[2];
    const __m128 s4 = GROUPED ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                    group_scale + (b * G + g) * ROWS))) : _mm_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(qx + (m0 + i) * K + g * GROUP)));
      if (GROUPED) {
        const __m128 d4 = _mm_mul_ps(s4, _mm_set1_ps(dx[(m0 + i) * G + g]));
        d[0] = spread(d4, 8);
        d[1] = spread(_mm_movehl_ps(d4, d4), 8);
      } else {
        d[0] = d[1] = _mm512_set1_ps(dx[(m0 + i) * G + g]);
      }
      for (int h = 0; h < 2; ++h) {
        const __m512i sx = _mm512_mask_sub_epi8(x, neg[h], _mm512_setzero_si512(), x);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[h], sx);
        acc[i][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d[h], acc[i][h]);
      }
    }
  }
  alignas(64) float v[2][16];
  for (int i = 0; i < MR; ++i) {
    _mm512_store_ps(v[0], acc[i][0]);
    _mm512_store_ps(v[1], acc[i][1]);
    for (int j = 0; j < ROWS && b * ROWS + j < N; ++j) {
      const float t = lanes_sum(v[j / 2] + 8 * (j % 2), 8);
      y[(m0 + i) * N + b * ROWS + j] = GROUPED ? t : t * scale[b * ROWS + j];
    }
  }
}

template <int MR>
void int4q8_tile512(const int8_t* qx, const float* dx, const float* xsum, const uint8_t* codes, const uint16_t* scale,
                    const uint16_t* minimum, float* y, int64_t N, int64_t K, int64_t m0, int64_t b) {
  const int64_t G = K / GROUP;
  const uint8_t* cb = codes + b * G * ROWS * 16;
  const uint16_t* sb = scale + b * G * ROWS;
  const uint16_t* mb = minimum + b * G * ROWS;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[MR];
  __m128 mins[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm512_setzero_ps();
    mins[i] = _mm_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    prefetch_int4(cb, sb, mb, g);
    const __m512i c = _mm512_loadu_si512(cb + g * ROWS * 16);  // 4 rows x 16 bytes: codes 0-15 low, 16-31 high
    const __m512i lo = _mm512_and_si512(c, low), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
    const __m512 s = spread(halves4(sb + g * ROWS), 4);
    const __m128 mn = halves4(mb + g * ROWS);
    for (int i = 0; i < MR; ++i) {
      const int8_t* xg = qx + (m0 + i) * K + g * GROUP;
      const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xg)));
      const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xg + 16)));
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(dx[(m0 + i) * G + g])),
                               acc[i]);
      mins[i] = fmadd(mn, _mm_set1_ps(xsum[(m0 + i) * G + g]), mins[i]);
    }
  }
  alignas(64) float v[16];
  alignas(16) float mo[ROWS];
  for (int i = 0; i < MR; ++i) {
    _mm512_store_ps(v, acc[i]);
    _mm_store_ps(mo, mins[i]);
    for (int j = 0; j < ROWS && b * ROWS + j < N; ++j) y[(m0 + i) * N + b * ROWS + j] = lanes_sum(v + 4 * j, 4) + mo[j];
  }
}

template <bool GROUPED> struct Int8Q8Tile512 : Int8Warm {
  template <int MR> static void run(const int8_t* qx, const float* dx, const int8_t* q, const float* s,
                                    const uint16_t* gs, float* y, int64_t N, int64_t K, int64_t m, int64_t b) {
    int8q8_tile512<MR, GROUPED>(qx, dx, q, s, gs, y, N, K, m, b);
  }
};
struct Int4Q8Tile512 : Int4Warm {
  template <int MR> static void run(const int8_t* qx, const float* dx, const float* xs, const uint8_t* c,
                                    const uint16_t* s, const uint16_t* mn, float* y, int64_t N, int64_t K,
                                    int64_t m, int64_t b) {
    int4q8_tile512<MR>(qx, dx, xs, c, s, mn, y, N, K, m, b);
  }
};
#endif  // Q8_VNNI512

// Blocks b0:b1 (their first lines asked for at once), L1_BLOCKS at a time (their weights are read from memory once, then from L1 for each tile of
// activation rows), two activation rows a tile (the last row of an odd batch alone).
constexpr int64_t L1_BLOCKS = 4;

template <class Tile, typename... A>
void q8_tiles(int64_t M, int64_t b0, int64_t b1, A... args) {
  Tile::start(b0, b1, args...);
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

// The q8 kernels: x rounded to int8 per group of 32 first (once per call, not per output row), into the
// calling thread's scratch buffer: the int8 codes [M, K], then the scales and the sums, float32 [M, G] each.
// A decode step makes 121 of these calls; the buffer grows to the largest call's size and is reused: no allocation a
// call. (The call's worker threads read it while the caller waits for them, so it outlives their reads.)
struct RoundedX {
  int8_t* qx;
  float *dx, *xsum;
  RoundedX(int8_t* codes, float* scales, float* sums) : qx(codes), dx(scales), xsum(sums) {}  // a caller's buffer
  RoundedX(const at::Tensor& x, bool simd) {
    const int64_t M = x.size(0), K = x.size(1), G = K / GROUP;
    TORCH_CHECK(K % GROUP == 0, "the q8 kernels need K to be a multiple of ", GROUP, ", got ", K);
    thread_local std::vector<float> scratch;  // floats, so the scales after the codes stay aligned
    scratch.resize(std::max<size_t>(scratch.size(), M * K / 4 + 2 * M * G));  // M * K is a multiple of 32
    qx = reinterpret_cast<int8_t*>(scratch.data());
    dx = scratch.data() + M * K / 4;
    xsum = dx + M * G;
    quantize_x(x.data_ptr<float>(), qx, dx, xsum, M * G, simd);
  }
};

void check_rows(const at::Tensor& w, int64_t rows, int64_t bytes) {
  TORCH_CHECK(w.dim() == 4 && w.size(0) == (rows + ROWS - 1) / ROWS && w.size(2) == ROWS && w.size(3) == bytes &&
              w.is_contiguous(), "the q8 kernels take weights in blocks of ", ROWS, " rows (cpu_kernels.interleave): [",
              (rows + ROWS - 1) / ROWS, ", K/32, ", ROWS, ", ", bytes, "] for ", rows, " rows, got ", w.sizes());
}

// Output blocks per task: at least ~64K weights, as grain() above
int64_t block_grain(int64_t K) { return std::max<int64_t>(1, grain(K) / ROWS); }

// y [M, N] = x W^T over W's blocks b0:b1, for x already rounded (r), W int8 in blocks of ROWS rows; scale: one
// float32 per row (sp), or one float16 per group of 32 (gp: q8_0)
void int8q8_blocks(const RoundedX& r, int64_t M, const int8_t* qp, const float* sp, const uint16_t* gp, float* yp,
                   int64_t N, int64_t K, int64_t path, int64_t b0, int64_t b1) {
  const int8_t* qx = r.qx;
  const float* dx = r.dx;
  const bool per_group = gp != nullptr;
  switch (path) {
#ifdef Q8_VNNI512
    case AVX512_VNNI:
      if (per_group) q8_tiles<Int8Q8Tile512<true>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K);
      else q8_tiles<Int8Q8Tile512<false>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K);
      return;
#endif
#ifdef Q8_VNNI256
    case AVX2_VNNI:
      if (per_group) q8_tiles<Int8Q8Tile<true, true>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K);
      else q8_tiles<Int8Q8Tile<false, true>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K);
      return;
#endif
#ifdef __AVX2__
    case AVX2:
      if (per_group) q8_tiles<Int8Q8Tile<true, false>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K);
      else q8_tiles<Int8Q8Tile<false, false>>(M, b0, b1, qx, dx, qp, sp, gp, yp, N, K);
      return;
#endif
    default:
      int8q8_plain(qx, dx, qp, sp, gp, yp, M, N, K, b0, b1);
  }
}

// the same for int4 codes with a float16 scale and minimum per group of 32
void int4q8_blocks(const RoundedX& r, int64_t M, const uint8_t* cp, const uint16_t* sp, const uint16_t* mp, float* yp,
                   int64_t N, int64_t K, int64_t path, int64_t b0, int64_t b1) {
  const int8_t* qx = r.qx;
  const float* dx = r.dx;
  const float* xs = r.xsum;
  switch (path) {
#ifdef Q8_VNNI512
    case AVX512_VNNI: q8_tiles<Int4Q8Tile512>(M, b0, b1, qx, dx, xs, cp, sp, mp, yp, N, K); return;
#endif
#ifdef Q8_VNNI256
    case AVX2_VNNI: q8_tiles<Int4Q8Tile<true>>(M, b0, b1, qx, dx, xs, cp, sp, mp, yp, N, K); return;
#endif
#ifdef __AVX2__
    case AVX2: q8_tiles<Int4Q8Tile<false>>(M, b0, b1, qx, dx, xs, cp, sp, mp, yp, N, K); return;
#endif
    default: int4q8_plain(qx, dx, xs, cp, sp, mp, yp, M, N, K, b0, b1);
  }
}

// The same over all of W's blocks, split among the threads by parallel_for (a layer's own call, eager or compiled)
void int8q8_into(const RoundedX& r, int64_t M, const int8_t* qp, const float* sp, const uint16_t* gp, int64_t blocks,
                 float* yp, int64_t N, int64_t K, int64_t path) {
  at::parallel_for(0, blocks, block_grain(K), [&](int64_t b0, int64_t b1) {
    int8q8_blocks(r, M, qp, sp, gp, yp, N, K, path, b0, b1);
  });
}

void int4q8_into(const RoundedX& r, int64_t M, const uint8_t* cp, const uint16_t* sp, const uint16_t* mp,
                 int64_t blocks, float* yp, int64_t N, int64_t K, int64_t path) {
  at::parallel_for(0, blocks, block_grain(K), [&](int64_t b0, int64_t b1) {
    int4q8_blocks(r, M, cp, sp, mp, yp, N, K, path, b0, b1);
  });
}

bool check_int8(const at::Tensor& q, const at::Tensor& scale, int64_t N) {  // true: one scale per group (q8_0)
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be int8");
  check_rows(q, N, GROUP);
  const bool per_group = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(per_group ? scale.dim() == 3 && scale.sizes() == q.sizes().slice(0, 3) && scale.is_contiguous()
                        : scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "scale must be contiguous float32 [", N, "] or float16 ", q.sizes().slice(0, 3));
  return per_group;
}

void check_int4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& minimum, int64_t N) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "codes must be uint8");
  check_rows(codes, N, 16);
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->sizes() == codes.sizes().slice(0, 3) &&
                t->is_contiguous(), "scale and minimum must be contiguous float16 ", codes.sizes().slice(0, 3));
}

const uint16_t* halves(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

// scale: float32 [N] (one per row), or float16 [N/4, K/32, 4] (one per group of 32, interleaved: q8_0)
at::Tensor int8q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t N, int64_t asked) {
  const bool per_group = check_int8(q, scale, N);
  const int64_t M = x.size(0), K = q.size(1) * GROUP;
  check_x(x, K);
  const int64_t path = q8_path(asked);
  const RoundedX r(x, path != PLAIN);
  at::Tensor y = at::empty({M, N}, x.options());
  int8q8_into(r, M, q.data_ptr<int8_t>(), per_group ? nullptr : scale.data_ptr<float>(),
              per_group ? halves(scale) : nullptr, q.size(0), y.data_ptr<float>(), N, K, path);
  return y;
}

at::Tensor int4q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& minimum, int64_t N, int64_t asked) {
  check_int4(codes, scale, minimum, N);
  const int64_t M = x.size(0), K = codes.size(1) * GROUP;
  check_x(x, K);
  const int64_t path = q8_path(asked);
  const RoundedX r(x, path != PLAIN);
  at::Tensor y = at::empty({M, N}, x.options());
  int4q8_into(r, M, codes.data_ptr<uint8_t>(), halves(scale), halves(minimum), codes.size(0), y.data_ptr<float>(),
              N, K, path);
  return y;
}

// ---------------------------------------------------------------- a whole decode step in one call

// The residual stream's RMSNorm (x * rsqrt(mean(x^2) + eps) * w, in float32), row by row: [M, D] -> out. The sum
// of squares in 16 lanes (simd): one float sum in order waits on each add, ~0.6 us a row of 576, 61 rows a step.
void rms_norm(const float* x, const float* w, float* out, int64_t M, int64_t D, float eps, bool simd) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * D;
    float ss = 0.f;
    int64_t i = 0;
#ifdef __AVX2__
    if (simd) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (; i + 16 <= D; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(xm + i), v1 = _mm256_loadu_ps(xm + i + 8);
        a0 = fmadd(v0, v0, a0);
        a1 = fmadd(v1, v1, a1);
      }
      ss = hsum(_mm256_add_ps(a0, a1));
    }
#endif
    for (; i < D; ++i) ss += xm[i] * xm[i];
    const float r = 1.f / std::sqrt(ss / float(D) + eps);
    for (i = 0; i < D; ++i) out[m * D + i] = xm[i] * r * w[i];
  }
}

// RoPE on one head, the half-split layout of transformer.apply_rope: (x_i, x_{i+D/2}) turned by the angle whose
// cosine and sine are c[i], s[i] (its position times theta^(-2i/D))
void rope(float* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c[i] - x1 * s[i];
    x[i + half] = x1 * c[i] + x0 * s[i];
  }
}

// SwiGLU's product: out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                            _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// The int4 layer at weights[i..i+2] (codes, scales, minimums), N outputs of K inputs, checked before the step's
// threads start (they must not throw)
struct Int4Weight {
  const uint8_t* codes;
  const uint16_t *scale, *minimum;
  int64_t blocks, N, K;
};

Int4Weight int4_weight(at::TensorList w, int64_t i, int64_t N, int64_t K) {
  check_int4(w[i], w[i + 1], w[i + 2], N);
  TORCH_CHECK(w[i].size(1) * GROUP == K, "layer weight ", i, " takes ", w[i].size(1) * GROUP, " inputs, not ", K);
  return {w[i].data_ptr<uint8_t>(), halves(w[i + 1]), halves(w[i + 2]), w[i].size(0), N, K};
}

// Thread t's share of n items split among n threads in at most ceil(n / grain) pieces, as parallel_for splits them
inline std::pair<int64_t, int64_t> share(int64_t t, int64_t n, int64_t items, int64_t grain) {
  const int64_t T = std::min(n, std::max<int64_t>(1, (items + grain - 1) / grain)), per = (items + T - 1) / T;
  const int64_t b0 = std::min(items, t * per);
  return {b0, t < T ? std::min(items, b0 + per) : b0};
}

// The likeliest of (logit, column) a and b, b's columns after a's: the larger logit, a NaN before any number, a on
// ties (a column of -1: none)
inline std::pair<float, int64_t> better(std::pair<float, int64_t> a, std::pair<float, int64_t> b) {
  if (b.second < 0 || std::isnan(a.first)) return a.second < 0 ? b : a;
  return a.second < 0 || std::isnan(b.first) || b.first > a.first ? b : a;
}

// Row y's likeliest column in c0:c1 (-1 if none), as better() orders them: its largest value, then where it first is
std::pair<float, int64_t> argmax(const float* y, int64_t c0, int64_t c1) {
  float mx = -INFINITY;
  bool nan = false;
  int64_t c = c0;
#ifdef __AVX2__
  __m256 m8 = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (; c + 8 <= c1; c += 8) {
    const __m256 v = _mm256_loadu_ps(y + c);
    m8 = _mm256_max_ps(m8, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  for (const float f : lanes) mx = std::max(mx, f);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; c < c1; ++c) {
    if (std::isnan(y[c])) nan = true;
    else mx = std::max(mx, y[c]);
  }
  c = c0;
#ifdef __AVX2__
  const __m256 target = _mm256_set1_ps(mx);
  for (; !nan && c + 8 <= c1; c += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(y + c), target, _CMP_EQ_OQ)))
      return {mx, c + __builtin_ctz(hit)};
#endif
  for (; c < c1; ++c)
    if (nan ? std::isnan(y[c]) : y[c] == mx) return {y[c], c};
  return {NAN, -1};
}

// Where the one-call step's threads meet between its phases: each spins on one counter until all have come. A
// parallel region a phase (what parallel_for opens) cost ~1.5 us a fork and join in the step on a 2-core Xeon
// (libgomp makes two futex calls each), this ~0.2 us; a step meets ~210 times.
struct SpinBarrier {
  alignas(64) std::atomic<int64_t> arrived{0};
  alignas(64) std::atomic<int64_t> generation{0};
  void wait(int64_t n) {
    if (n == 1) return;
    const int64_t g = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {  // the last: open it for all
      arrived.store(0, std::memory_order_relaxed);
      generation.store(g + 1, std::memory_order_release);
    } else {
      while (generation.load(std::memory_order_acquire) == g) {
#ifdef __AVX2__
        _mm_pause();  // a spinning thread yields the core's resources a moment
#endif
      }
    }
  }
};

// The one-call step's weights as its loops read them: raw pointers, each tensor checked once.
struct DecodeModel {
  static constexpr int64_t PER_LAYER = 14;  // tensors a layer: 2 norms, 4 int4 matvecs of 3 tensors each
  std::array<int64_t, 3> shape{-1, -1, -1};  // (num_heads, num_kv_heads, head_dim) it was checked for
  int64_t V = 0, D = 0, I = 0;
  const float *embed = nullptr, *final_norm = nullptr;
  const int8_t* head = nullptr;  // head_blocks blocks of 4 rows
  int64_t head_blocks = 0;
  const float* head_scale = nullptr;  // int8: one scale a row; else q8_0: head_halves, one a group
  const uint16_t* head_halves = nullptr;
  std::vector<const float*> norms;  // each layer's input and post-attention norm
  std::vector<Int4Weight> linears;  // each layer's qkv, o, gate_up, down

  // weights: embedding [V, D] float32, final norm [D], head (codes, scale), then per layer 14 tensors: input norm,
  // qkv (codes, scales, minimums), o, post-attention norm, gate_up, down
  DecodeModel(at::TensorList weights, int64_t H, int64_t KV, int64_t Dh, int64_t L) : shape{H, KV, Dh} {
    TORCH_CHECK(L > 0 && int64_t(weights.size()) == 4 + PER_LAYER * L, "q8_decode_step takes ", 4 + PER_LAYER * L,
                " weights for ", L, " layers, got ", weights.size());
    const at::Tensor& e = weights[0];
    TORCH_CHECK(e.scalar_type() == at::kFloat && e.dim() == 2 && e.is_contiguous(),
                "the embedding must be contiguous float32 [V, D]");
    V = e.size(0), D = e.size(1), I = weights[4 + 11].size(1) * GROUP;  // I: down's inputs
    auto norm = [&](int64_t n) {  // D floats each, read unchecked
      TORCH_CHECK(weights[n].scalar_type() == at::kFloat && weights[n].numel() == D && weights[n].is_contiguous(),
                  "weight ", n, " must be a norm: contiguous float32 [", D, "]");
      return weights[n].data_ptr<float>();
    };
    embed = e.data_ptr<float>(), final_norm = norm(1);
    const int64_t QKV = (H + 2 * KV) * Dh;
    for (int64_t w = 4; w < 4 + PER_LAYER * L; w += PER_LAYER) {
      norms.insert(norms.end(), {norm(w), norm(w + 7)});
      for (const Int4Weight& lw : {int4_weight(weights, w + 1, QKV, D), int4_weight(weights, w + 4, D, H * Dh),
                                   int4_weight(weights, w + 8, 2 * I, D), int4_weight(weights, w + 11, D, I)})
        linears.push_back(lw);
    }
    const at::Tensor &q = weights[2], &scale = weights[3];
    const bool per_group = check_int8(q, scale, V);
    TORCH_CHECK(q.size(1) * GROUP == D, "the head takes ", q.size(1) * GROUP, " inputs, not ", D);
    head = q.data_ptr<int8_t>(), head_blocks = q.size(0);
    if (per_group) head_halves = halves(scale);
    else head_scale = scale.data_ptr<float>();
  }
};

// The one-call step's weights, in DecodeModel's order, held once for the model's life and passed to each step as
// one object: as a list, the 424 tensors of SmolLM2-135M took ~35 us a call to convert (~75 with cold caches), and
// checking them each step ~40 us more (cold: the last step's weights had pushed them out of the caches). So the
// first step checks them, for its shape, and the rest use the pointers it kept (the holder keeps the tensors, and
// so their memory, alive; none may be resized in place after).
struct DecodeWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;
  explicit DecodeWeights(std::vector<at::Tensor> weights) : tensors(std::move(weights)) {}

  std::shared_ptr<const DecodeModel> checked(int64_t H, int64_t KV, int64_t Dh, int64_t L) {
    const std::lock_guard<std::mutex> hold(lock);
    if (!model || model->shape != std::array<int64_t, 3>{H, KV, Dh} || model->linears.size() != size_t(4 * L))
      model = std::make_shared<const DecodeModel>(tensors, H, KV, Dh, L);
    return model;
  }

 private:
  std::mutex lock;
  std::shared_ptr<const DecodeModel> model;
};

// One decode step of a LLaMA-family model with int4 layers and an int8 or q8_0 head, every sequence one new token
// (enginelib.speed.fused_step): the whole forward pass in C++, as llama.cpp runs its graph, with none of a compiled
// graph's per-operator costs (a dispatcher call, tensor handles and an allocation per operator, Python around it).
// weights: the model's, in DecodeModel's order. Returns the logits [M, V] and each row's
// argmax [M], which the threads take as they write the logits (from their caches, not across the cores).
//
// Its threads run in one parallel region, as llama.cpp's do: each thread runs every phase on its share (a
// matvec's blocks, the attention's heads, the rows of RoPE, the groups of SwiGLU) and they meet at a barrier
// between phases. Each keeps its own copy of the residual stream and rounds its own norms' outputs (the same
// bits in every thread), so a norm needs no meeting of its own.
std::tuple<at::Tensor, at::Tensor> q8_decode_step(
    const at::Tensor& token_ids, const at::Tensor& positions, const at::Tensor& block_tables,
    const at::Tensor& context_lens, at::Tensor& k_pools, at::Tensor& v_pools,
    const c10::intrusive_ptr<DecodeWeights>& held, int64_t num_heads, int64_t num_kv_heads, double eps, double theta,
    int64_t asked) {
  const int64_t L = k_pools.size(0), M = token_ids.numel(), Dh = k_pools.size(4);
  const std::shared_ptr<const DecodeModel> held_model = held->checked(num_heads, num_kv_heads, Dh, L);
  const DecodeModel& dm = *held_model;
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
              positions.numel() == M && token_ids.is_contiguous() && positions.is_contiguous(),
              "token_ids and positions must be contiguous int64 [M]");
  const int64_t V = dm.V, D = dm.D, I = dm.I, H = num_heads, KV = num_kv_heads, QKV = (H + 2 * KV) * Dh;
  const int64_t path = q8_path(asked);
  const bool simd = path != PLAIN;
  const float e = float(eps);
  const auto f32 = token_ids.options().dtype(at::kFloat);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(ids[m] >= 0 && ids[m] < V, "token id ", ids[m], " is outside the vocabulary of ", V);
  std::vector<float> cos(M * Dh / 2), sin(M * Dh / 2);  // each row's angles, the same in every layer
  for (int64_t i = 0; i < Dh / 2; ++i) {
    const float inv_freq = 1.f / std::pow(float(theta), float(2 * i) / float(Dh));
    for (int64_t m = 0; m < M; ++m) {
      cos[m * Dh / 2 + i] = std::cos(float(pos[m]) * inv_freq);
      sin[m * Dh / 2 + i] = std::sin(float(pos[m]) * inv_freq);
    }
  }
  at::Tensor qkv = at::empty({M, QKV}, f32), q = at::empty({M, H, Dh}, f32), attn = at::empty({M, H, Dh}, f32);
  at::Tensor k = at::empty({M, KV, Dh}, f32), v = at::empty({M, KV, Dh}, f32), y = at::empty({M, D}, f32);
  at::Tensor gu = at::empty({M, 2 * I}, f32), act = at::empty({M, I}, f32), logits = at::empty({M, V}, f32);
  at::Tensor k0 = k_pools.select(0, 0), v0 = v_pools.select(0, 0);
  const PagedDecode first_layer(q, k, v, k0, v0, block_tables, context_lens);  // checks the tables once
  const int64_t layer_floats = k0.numel();
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  float *vp = v.data_ptr<float>(), *attnp = attn.data_ptr<float>(), *yp = y.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>(), *logitsp = logits.data_ptr<float>();
  // the attention's and SwiGLU's outputs rounded (shared: each thread rounds its share's groups), and each
  // thread's own residual stream x, its norm h and h rounded
  const int64_t KMAX = std::max(H * Dh, I), DG = D / GROUP;
  std::vector<float> shared(M * KMAX / 4 + 2 * M * (KMAX / GROUP));
  const RoundedX rounded(reinterpret_cast<int8_t*>(shared.data()), shared.data() + M * KMAX / 4,
                         shared.data() + M * KMAX / 4 + M * (KMAX / GROUP));
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t own_floats = 2 * M * D + M * D / 4 + 2 * M * DG;
  std::vector<float> own(threads * own_floats);
  at::Tensor tokens = at::empty({M}, token_ids.options());
  std::vector<std::pair<float, int64_t>> best(threads * M, {NAN, -1});  // each thread's (logit, column) a row
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    float *x = own.data() + t * own_floats, *h = x + M * D;
    const RoundedX hr(reinterpret_cast<int8_t*>(h + M * D), h + M * D + M * D / 4, h + M * D + M * D / 4 + M * DG);
    auto norm = [&](const float* w) {  // h = RMSNorm(x) * w, rounded into hr
      rms_norm(x, w, h, M, D, e, simd);
      quantize_x(h, hr.qx, hr.dx, hr.xsum, M * DG, simd);
    };
    auto residual = [&] {
      for (int64_t i = 0; i < M * D; ++i) x[i] += yp[i];
    };
    auto int4 = [&](const Int4Weight& w, const RoundedX& in, float* out) {  // this thread's blocks of out = in W^T
      const auto [b0, b1] = share(t, n, w.blocks, block_grain(w.K));
      if (b0 < b1) int4q8_blocks(in, M, w.codes, w.scale, w.minimum, out, w.N, w.K, path, b0, b1);
    };
    const auto [m0, m1] = share(t, n, M, 1);
    const auto [i0, i1] = share(t, n, M * H, 1);  // (sequence, head) pairs
    const auto [g0, g1] = share(t, n, M * I / GROUP, 1);  // SwiGLU's groups of 32
    for (int64_t m = 0; m < M; ++m) std::copy_n(dm.embed + ids[m] * D, D, x + m * D);
    for (int64_t l = 0; l < L; ++l) {  // each layer: attention, then the MLP, each added to the residual stream x
      const Int4Weight* lw = dm.linears.data() + 4 * l;
      if (l > 0) residual();  // the last layer's MLP
      norm(dm.norms[2 * l]);
      int4(lw[0], hr, qkvp);  // q, k and v in one matvec
      barrier.wait(n);
      PagedDecode attention = first_layer;  // this layer's pools
      attention.kp += l * layer_floats;
      attention.vp += l * layer_floats;
      for (int64_t m = m0; m < m1; ++m) {  // q and k turned, q, k, v apart as the attention takes them
        float* row = qkvp + m * QKV;
        for (int64_t hd = 0; hd < H + KV; ++hd)
          rope(row + hd * Dh, cos.data() + m * Dh / 2, sin.data() + m * Dh / 2, Dh);
        std::copy_n(row, H * Dh, qp + m * H * Dh);
        std::copy_n(row + H * Dh, KV * Dh, kp + m * KV * Dh);
        std::copy_n(row + (H + KV) * Dh, KV * Dh, vp + m * KV * Dh);
      }
      attention.store(m0, m1);
      barrier.wait(n);
      attention.attend(i0, i1, attnp, simd);
      if (Dh % GROUP == 0) {  // this thread's heads rounded, Dh / 32 groups each
        quantize_x(attnp + i0 * Dh, rounded.qx + i0 * Dh, rounded.dx + i0 * Dh / GROUP,
                   rounded.xsum + i0 * Dh / GROUP, (i1 - i0) * Dh / GROUP, simd);
      } else {  // a head's groups span heads: its rows, once all heads are in
        const int64_t G = H * Dh / GROUP;
        barrier.wait(n);
        quantize_x(attnp + m0 * H * Dh, rounded.qx + m0 * H * Dh, rounded.dx + m0 * G, rounded.xsum + m0 * G,
                   (m1 - m0) * G, simd);
      }
      barrier.wait(n);
      int4(lw[1], rounded, yp);  // o_proj
      barrier.wait(n);
      residual();  // the attention's
      norm(dm.norms[2 * l + 1]);
      int4(lw[2], hr, gup);  // gate and up in one matvec
      barrier.wait(n);
      for (int64_t g = g0; g < g1; ++g) {  // SwiGLU, a group of 32 at a time, each rounded
        const int64_t m = g / (I / GROUP), j = g % (I / GROUP) * GROUP;
        silu_mul(gup + m * 2 * I + j, gup + m * 2 * I + I + j, actp + m * I + j, GROUP);
      }
      quantize_x(actp + g0 * GROUP, rounded.qx + g0 * GROUP, rounded.dx + g0, rounded.xsum + g0, g1 - g0, simd);
      barrier.wait(n);
      int4(lw[3], rounded, yp);  // down_proj
      barrier.wait(n);  // the layer's output in y, whole, before any thread adds it
    }
    residual();
    norm(dm.final_norm);
    const auto [b0, b1] = share(t, n, dm.head_blocks, block_grain(D));
    if (b0 < b1) int8q8_blocks(hr, M, dm.head, dm.head_scale, dm.head_halves, logitsp, V, D, path, b0, b1);
    for (int64_t m = 0; m < M; ++m)  // each row's likeliest among the logits this thread just wrote
      best[t * M + m] = argmax(logitsp + m * V, std::min(V, b0 * ROWS), std::min(V, b1 * ROWS));
  }
  int64_t* tokensp = tokens.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {  // the threads' columns in order: the first of ties wins, as numpy's argmax
    std::pair<float, int64_t> b = best[m];
    for (int64_t u = 1; u < threads; ++u) b = better(b, best[u * M + m]);
    tokensp[m] = b.second;
  }
  return {logits, tokens};
}

}  // namespace

// q8_paths has no tensor to dispatch on: declared here, with its one implementation (as has_simd)
TORCH_LIBRARY_FRAGMENT(enginelib, m) {
  m.def("q8_paths() -> str[]", &q8_paths);
  // a whole decode step (enginelib.speed.fused_step), called from Python only: no graph traces it
  m.class_<DecodeWeights>("DecodeWeights").def(torch::init<std::vector<at::Tensor>>());
  m.def("q8_decode_step(Tensor token_ids, Tensor positions, Tensor block_tables, Tensor context_lens, "
        "Tensor(a!) k_pools, Tensor(b!) v_pools, __torch__.torch.classes.enginelib.DecodeWeights weights, "
        "int num_heads, int num_kv_heads, float eps, float theta, int path=-1) -> (Tensor, Tensor)", &q8_decode_step);
}

TORCH_LIBRARY_IMPL(enginelib, CPU, m) {
  m.impl("int8q8_linear", &int8q8_linear);
  m.impl("int4q8_linear", &int4q8_linear);
}
