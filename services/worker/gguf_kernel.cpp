// y = x @ W^T (+ bias) (+ residual) over GGUF blocks, float32 activations, float32 accumulation.
//
// Layout (made by gguf_linear.py): the output features in tiles of 16, and per tile and per block of
// 32 inputs one record: the 16 columns' float16 scales d (32 bytes), for Q4_1 their minimums m
// (32 bytes), then the codes, 16 bytes per step, one byte per column: Q4_0/Q4_1 a pair of inputs
// (k low nibble, k + 1 high nibble; 16 steps), Q8_0 one input (signed; 32 steps). So a tile streams
// through memory once, and one 16-byte load widens into the weights of 16 columns, dequantized in
// registers (q * d + m; Q4_0 m = -8 d) and multiplied into up to 16 rows of x at once; or, for up to
// three rows, left unscaled and the block's sums scaled instead (few_kernel). Unquantized weights
// (float32, bfloat16, float16) take the same tiles with the values in place of the codes and no scales,
// so a dense layer is read once a step too and runs in the same fused decoder layer. GGUF K-quants
// (256-weight super-blocks of 6- or 8-bit sub-scales) are unpacked to per-32-input float32 scales, which
// hold each product of a super-block's float16 scale and a sub-scale exactly: Q4_K as Q4_1's codes with
// float32 scales and minimums, Q5_K and Q6_K (and a fused projection mixing K-quants) as K8, signed bytes
// with a scale per 16 inputs and a minimum per 32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// ---- 16 float32 lanes: one zmm with AVX-512, two ymm halves with AVX2 (with FMA and F16C). ----
// Everything below is written in these; with AVX-512 each is the one intrinsic it wraps.
#if defined(__AVX512F__)
using V16 = __m512;
using M16 = __mmask16;  // bit i: lane i
constexpr int VREGS = 32;  // vector registers, in V16s
inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vset(float x) { return _mm512_set1_ps(x); }
inline V16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vdiv(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 vmin(V16 a, V16 b) { return _mm512_min_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 vfma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
inline V16 vfnma(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline M16 vtail(int64_t left) { return left >= 16 ? M16(0xFFFF) : M16((1u << left) - 1); }
inline V16 vload_z(M16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // 0 where m is not set
inline V16 vload_or(V16 src, M16 m, const float* p) { return _mm512_mask_loadu_ps(src, m, p); }
inline void vstore_m(float* p, M16 m, V16 v) { _mm512_mask_storeu_ps(p, m, v); }
inline V16 vkeep(M16 m, V16 v) { return _mm512_maskz_mov_ps(m, v); }
inline float vsum(V16 v) { return _mm512_reduce_add_ps(v); }
inline float vmax_of(M16 m, V16 v) { return _mm512_mask_reduce_max_ps(m, v); }
inline V16 vround(V16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V16 vscale2(V16 p, V16 n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n whole
// 16 float16 values; 16 signed bytes; 16 bytes' low and high nibbles.
inline V16 vhalves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V16 vsbytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V16 vbf16(const uint8_t* p) {  // 16 bfloat16 values: their bits are a float32's upper half
  const __m512i q = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(q, 16));
}
inline void vnibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
}
#else
struct V16 {
  __m256 lo, hi;
};
using M16 = uint32_t;  // bit i: lane i
constexpr int VREGS = 8;
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vfnma(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline M16 vtail(int64_t left) { return left >= 16 ? M16(0xFFFF) : M16((1u << left) - 1); }
// eight bits of m as eight lanes of all ones or zeros
inline __m256i lanes(M16 m) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m)), bit), bit);
}
inline V16 vload_z(M16 m, const float* p) {
  return {_mm256_maskload_ps(p, lanes(m)), _mm256_maskload_ps(p + 8, lanes(m >> 8))};
}
inline V16 vload_or(V16 src, M16 m, const float* p) {
  const __m256i lo = lanes(m), hi = lanes(m >> 8);
  return {_mm256_blendv_ps(src.lo, _mm256_maskload_ps(p, lo), _mm256_castsi256_ps(lo)),
          _mm256_blendv_ps(src.hi, _mm256_maskload_ps(p + 8, hi), _mm256_castsi256_ps(hi))};
}
inline void vstore_m(float* p, M16 m, V16 v) {
  _mm256_maskstore_ps(p, lanes(m), v.lo);
  _mm256_maskstore_ps(p + 8, lanes(m >> 8), v.hi);
}
inline V16 vkeep(M16 m, V16 v) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(lanes(m))), _mm256_and_ps(v.hi, _mm256_castsi256_ps(lanes(m >> 8)))};
}
inline float vsum(V16 v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline float vmax_of(M16 m, V16 v) {
  const V16 x = vset(-std::numeric_limits<float>::infinity());
  const __m256 lo = _mm256_blendv_ps(x.lo, v.lo, _mm256_castsi256_ps(lanes(m)));
  const __m256 hi = _mm256_blendv_ps(x.hi, v.hi, _mm256_castsi256_ps(lanes(m >> 8)));
  const __m256 s = _mm256_max_ps(lo, hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline V16 vround(V16 x) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode)};
}
// p 2^n, n whole: 2^n built in the exponent field, n held to float's normal range (exp16's inputs never
// need more than its ends, where the results are within one normal step of 0 or of overflowing)
inline __m256 scale2(__m256 p, __m256 n) {
  const __m256 held = _mm256_max_ps(_mm256_min_ps(n, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-126.0f));
  const __m256i e = _mm256_cvtps_epi32(held);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
}
inline V16 vscale2(V16 p, V16 n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
inline V16 vhalves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline V16 vsbytes(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline V16 vbf16(const uint8_t* p) {  // 16 bfloat16 values: their bits are a float32's upper half
  const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
inline void vnibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m256i low = _mm256_set1_epi32(15);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), _mm256_cvtepi32_ps(_mm256_and_si256(b, low))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
#endif

constexpr int TILE = 16;   // output features per tile (one V16)
constexpr int GROUP = 32;  // inputs per block
// The GGUF's blocks, and unquantized weights in the same tiles (no scales: a record is the 32 inputs'
// 16 column values, input by input, as float32, bfloat16 or float16 as the checkpoint ships them).
enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, F32 = 3, BF16 = 4, F16 = 5, Q4_K = 6, K8 = 7 };
constexpr int KINDS = 8;

constexpr bool is_float(int kind) { return kind == F32 || kind == BF16 || kind == F16; }
constexpr bool has_minimum(int kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q4_K || kind == K8; }

// Q4_K: float32 scales (64 bytes) and minimums (64), nibbles (256). K8: float32 scales of inputs 0-15
// (64 bytes) and of inputs 16-31 (64), float32 minimums (64), signed bytes (512).
constexpr int record_bytes(int kind) {
  return kind == Q4_1 ? 64 + 256 : kind == Q4_0 ? 32 + 256 : kind == Q8_0 ? 32 + 512 : kind == F32 ? 2048
       : kind == Q4_K ? 128 + 256 : kind == K8 ? 192 + 512 : 1024;
}

// Where a record's codes start.
constexpr int codes_at(int kind) { return kind == Q4_1 ? 64 : kind == Q4_K ? 128 : kind == K8 ? 192 : 32; }

// The codes of inputs k and k + 1 (k even) in one tile's block record, as floats (unscaled).
template <int KIND>
inline void widen(const uint8_t* rec, int k, V16& q0, V16& q1) {
  if constexpr (KIND == F32) {
    q0 = vload(reinterpret_cast<const float*>(rec) + k * TILE);
    q1 = vload(reinterpret_cast<const float*>(rec) + (k + 1) * TILE);
  } else if constexpr (KIND == BF16) {
    q0 = vbf16(rec + k * 2 * TILE);
    q1 = vbf16(rec + (k + 1) * 2 * TILE);
  } else if constexpr (KIND == F16) {
    q0 = vhalves(rec + k * 2 * TILE);
    q1 = vhalves(rec + (k + 1) * 2 * TILE);
  } else if constexpr (KIND == Q8_0 || KIND == K8) {
    const uint8_t* c = rec + codes_at(KIND) + k * TILE;
    q0 = vsbytes(c);
    q1 = vsbytes(c + TILE);
  } else {
    vnibbles(rec + codes_at(KIND) + k / 2 * TILE, q0, q1);
  }
}

// The block's scale per column (K8: of its inputs 16-31 when ``second``).
template <int KIND>
inline V16 scale(const uint8_t* rec, bool second = false) {
  if constexpr (KIND == Q4_K) return vload(reinterpret_cast<const float*>(rec));
  if constexpr (KIND == K8) return vload(reinterpret_cast<const float*>(rec) + (second ? TILE : 0));
  return vhalves(rec);
}

// The block's minimum per column: Q4_1's own, Q4_0's -8 d, the K kinds' float32 ones (Q8_0 has none).
template <int KIND>
inline V16 minimum(const uint8_t* rec, V16 d) {
  if constexpr (KIND == Q4_1) return vhalves(rec + 32);
  if constexpr (KIND == Q4_K) return vload(reinterpret_cast<const float*>(rec) + TILE);
  if constexpr (KIND == K8) return vload(reinterpret_cast<const float*>(rec) + 2 * TILE);
  return vmul(d, vset(-8.0f));
}

template <int MR, int NV>
inline void zero(V16 (&acc)[MR][NV]) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
}

// y[r, tile v's columns] = acc[r][v] (+ bias) (+ residual), the last tile's columns past n left out.
template <int MR, int NV>
inline void store(V16 (&acc)[MR][NV], float* y, int64_t ldy, int64_t n0, int64_t n, const float* bias,
                  const float* res, int64_t ldr) {
  for (int v = 0; v < NV; ++v) {
    const int64_t col = n0 + v * TILE;
    const int64_t left = n - col;
    const M16 mask = vtail(left);
    const V16 bv = bias ? vload_z(mask, bias + col) : vzero();
    for (int r = 0; r < MR; ++r) {
      V16 out = vadd(acc[r][v], bv);
      if (res) out = vadd(out, vload_z(mask, res + r * ldr + col));
      vstore_m(y + r * ldy + col, mask, out);
    }
  }
}

// MR rows of x against NV consecutive tiles: acc[r][v] holds y[r, tile v's 16 columns].
template <int KIND, int MR, int NV>
void tile_kernel(const float* x, int64_t ldx, int64_t blocks, const uint8_t* w, int64_t tile_stride,
                 float* y, int64_t ldy, int64_t n0, int64_t n, const float* bias, const float* res, int64_t ldr) {
  constexpr int REC = record_bytes(KIND);
  V16 acc[MR][NV];
  zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    V16 d[NV], m[NV];
    const uint8_t* rec[NV];
    for (int v = 0; v < NV; ++v) {
      rec[v] = w + v * tile_stride + b * REC;
      if constexpr (!is_float(KIND)) {
        d[v] = scale<KIND>(rec[v]);
        if constexpr (has_minimum(KIND)) m[v] = minimum<KIND>(rec[v], d[v]);
      }
    }
    const float* xb = x + b * GROUP;
    for (int k = 0; k < GROUP; k += 2) {
      if constexpr (KIND == K8)
        if (k == GROUP / 2)
          for (int v = 0; v < NV; ++v) d[v] = scale<KIND>(rec[v], true);
      for (int v = 0; v < NV; ++v) {
        V16 w0, w1;
        widen<KIND>(rec[v], k, w0, w1);
        if constexpr (KIND == Q8_0) {
          w0 = vmul(w0, d[v]);
          w1 = vmul(w1, d[v]);
        } else if constexpr (!is_float(KIND)) {
          w0 = vfma(w0, d[v], m[v]);
          w1 = vfma(w1, d[v], m[v]);
        }
        for (int r = 0; r < MR; ++r) {
          acc[r][v] = vfma(vset(xb[r * ldx + k]), w0, acc[r][v]);
          acc[r][v] = vfma(vset(xb[r * ldx + k + 1]), w1, acc[r][v]);
        }
      }
    }
  }
  store(acc, y, ldy, n0, n, bias, res, ldr);
}

// A few rows of x (decode steps of up to FEW sequences) against NV tiles: the codes are read once and
// left unscaled; per block, y += d * sum(x q) (+ m * sum(x) for Q4_0/Q4_1, with each row's block sums
// ``sx``), so each weight costs a widen, a convert and one multiply-add per row. Even and odd inputs go
// to separate accumulators, which keeps enough multiply-adds in flight for one row.
template <int KIND, int MR, int NV>
void few_kernel(const float* x, int64_t ldx, const float* sx, int64_t blocks, const uint8_t* w, int64_t tile_stride,
                float* y, int64_t ldy, int64_t n0, int64_t n, const float* bias, const float* res, int64_t ldr) {
  constexpr int REC = record_bytes(KIND);
  V16 acc[MR][NV];
  zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * GROUP;
    V16 even[MR][NV], odd[MR][NV];
    zero(even);
    zero(odd);
    for (int k = 0; k < GROUP; k += 2) {
      if constexpr (KIND == K8)
        if (k == GROUP / 2) {  // inputs 0-15 done: their own scale
          for (int v = 0; v < NV; ++v) {
            const V16 d = scale<KIND>(w + v * tile_stride + b * REC);
            for (int r = 0; r < MR; ++r) acc[r][v] = vfma(d, vadd(even[r][v], odd[r][v]), acc[r][v]);
          }
          zero(even);
          zero(odd);
        }
      for (int v = 0; v < NV; ++v) {
        V16 q0, q1;
        widen<KIND>(w + v * tile_stride + b * REC, k, q0, q1);
        for (int r = 0; r < MR; ++r) {
          even[r][v] = vfma(vset(xb[r * ldx + k]), q0, even[r][v]);
          odd[r][v] = vfma(vset(xb[r * ldx + k + 1]), q1, odd[r][v]);
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      if constexpr (is_float(KIND)) {
        for (int r = 0; r < MR; ++r) acc[r][v] = vadd(acc[r][v], vadd(even[r][v], odd[r][v]));
        continue;
      }
      const uint8_t* rec = w + v * tile_stride + b * REC;
      const V16 d = scale<KIND>(rec, true);
      for (int r = 0; r < MR; ++r) {
        acc[r][v] = vfma(d, vadd(even[r][v], odd[r][v]), acc[r][v]);
        if constexpr (has_minimum(KIND))
          acc[r][v] = vfma(minimum<KIND>(rec, d), vset(sx[r * blocks + b]), acc[r][v]);
      }
    }
  }
  store(acc, y, ldy, n0, n, bias, res, ldr);
}

using Few = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t,
                     int64_t, const float*, const float*, int64_t);
// Rows up to which few_kernel serves: one thread, 576 x 3072, G multiply-adds/s against tile_kernel's: 1 row
// 23-24 against 17, 2 rows 34 against 30, 3 rows 37-40
// against 35, 4 rows 41 both.
constexpr int FEW = 3;
constexpr int few_wide(int mr) {
  if constexpr (VREGS == 32) return mr == 1 ? 4 : mr == 2 ? 3 : 2;
  return mr == 1 ? 2 : 1;
}

using Fn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                    const float*, const float*, int64_t);

// Tiles side by side for MR rows, as many as the registers hold.
constexpr int wide(int mr) {
  if constexpr (VREGS == 32) return mr <= 2 ? 4 : mr <= 4 ? 3 : mr <= 12 ? 2 : 1;
  return mr <= 2 ? 2 : 1;
}

template <int KIND, int... I>
void tile_table(Fn* one, Fn* many, std::integer_sequence<int, I...>) {
  ((one[I] = &tile_kernel<KIND, I + 1, 1>, many[I] = &tile_kernel<KIND, I + 1, wide(I + 1)>), ...);
}

template <int KIND, int... I>
void few_table(Few* one, Few* many, std::integer_sequence<int, I...>) {
  ((one[I] = &few_kernel<KIND, I + 1, 1>, many[I] = &few_kernel<KIND, I + 1, few_wide(I + 1)>), ...);
}

constexpr int MAX_ROWS = VREGS == 32 ? 16 : 8;  // rows a tile's weights are dequantized for at once

// By kind and rows: the kernel over one tile and over as many tiles side by side as the rows allow.
struct Kernels {
  Fn one[KINDS][MAX_ROWS];
  Fn many[KINDS][MAX_ROWS];
  Few few_one[KINDS][FEW];
  Few few_many[KINDS][FEW];
  template <int KIND>
  void add() {
    tile_table<KIND>(one[KIND], many[KIND], std::make_integer_sequence<int, MAX_ROWS>{});
    few_table<KIND>(few_one[KIND], few_many[KIND], std::make_integer_sequence<int, FEW>{});
  }
  Kernels() {
    add<Q4_0>();
    add<Q4_1>();
    add<Q8_0>();
    add<F32>();
    add<BF16>();
    add<F16>();
    add<Q4_K>();
    add<K8>();
  }
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t kind, int64_t n,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(kind >= 0 && kind < KINDS, "unknown block kind ", kind);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [rows, in]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be packed uint8");
  const int64_t tiles = w.size(0), blocks = w.size(1);
  TORCH_CHECK(w.size(2) == record_bytes(kind), "record size ", w.size(2), " is not kind ", kind, "'s");
  TORCH_CHECK(n > (tiles - 1) * TILE && n <= tiles * TILE, "n does not match the tiles");
  TORCH_CHECK(x_in.size(1) == blocks * GROUP, "x has ", x_in.size(1), " inputs, the weights ", blocks * GROUP);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "bias must be float32 [out]");
    bp = b.data_ptr<float>();
  }
  const float* rp = nullptr;
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.dim() == 2 && res.size(0) == rows && res.size(1) == n,
                "residual must be float32 [rows, out]");
    rp = res.data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = blocks * record_bytes(kind);
  // Row chunks of at most 16, as even as possible: each chunk dequantizes the weights once more.
  const int64_t chunks = (rows + MAX_ROWS - 1) / MAX_ROWS;
  const Kernels& table = kernels();
  // tiles per task: at least ~64k multiply-adds, or one thread does it all
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (k * TILE * std::min<int64_t>(rows, MAX_ROWS)));
  if (rows <= FEW) {
    std::vector<float> sums(is_float(int(kind)) ? 0 : rows * blocks);  // each row's sum over each block of inputs
    for (int64_t i = 0; i < int64_t(sums.size()); ++i) {
      float s = 0;
      for (int j = 0; j < GROUP; ++j) s += xp[(i / blocks) * k + (i % blocks) * GROUP + j];
      sums[i] = s;
    }
    const float* sx = sums.data();
    const Few many = table.few_many[kind][rows - 1], one = table.few_one[kind][rows - 1];
    const int64_t nv = few_wide(int(rows));
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      int64_t t = t0;
      for (; t + nv <= t1; t += nv)
        many(xp, k, sx, blocks, wp + t * stride, stride, yp, n, t * TILE, n, bp, rp, n);
      for (; t < t1; ++t) one(xp, k, sx, blocks, wp + t * stride, stride, yp, n, t * TILE, n, bp, rp, n);
    });
    return y;
  }
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks, mr = r1 - r0;
      const Fn many = table.many[kind][mr - 1], one = table.one[kind][mr - 1];
      const int64_t nv = wide(int(mr));
      int64_t t = t0;
      for (; t + nv <= t1; t += nv)
        many(xp + r0 * k, k, blocks, wp + t * stride, stride, yp + r0 * n, n, t * TILE, n, bp,
             rp ? rp + r0 * n : nullptr, n);
      for (; t < t1; ++t)
        one(xp + r0 * k, k, blocks, wp + t * stride, stride, yp + r0 * n, n, t * TILE, n, bp,
            rp ? rp + r0 * n : nullptr, n);
    }
  });
  return y;
}

// ---- The rest of a decoder layer for float32 rows (fused_ops.py): one call where torch takes several. ----
// Each op runs inline below a grain of work (a decode step of one sequence never forks threads).

constexpr int64_t OP_GRAIN = 1 << 15;  // floats touched per task, about

// exp(x) to about 1 ulp: 2^n exp(r) with n = round(x / ln 2), r = x - n ln 2 (in two parts), exp(r) by
// Cephes' expf polynomial. The scalar std::exp is a call per value: most of a decode step's softmax.
inline V16 exp16(V16 x) {
  x = vmax(vmin(x, vset(88.37f)), vset(-88.37f));
  const V16 n = vround(vmul(x, vset(1.44269504088896341f)));
  V16 r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  V16 p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vscale2(p, n);
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, what, " must be float32 [rows, n]",
              " with unit stride along n");
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == n, "w must be float32 [n]");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, OP_GRAIN / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ldx;
      float* yr = yp + r * n;
      V16 acc = vzero();
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const V16 v = vload(xr + i);
        acc = vfma(v, v, acc);
      }
      float ss = vsum(acc);
      for (; i < n; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / float(n) + float(eps));
      for (i = 0; i < n; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

// gate_up [rows, 2 * m] (gate | up) -> silu(gate) * up [rows, m].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), m = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor y = at::empty({rows, m}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, OP_GRAIN / std::max<int64_t>(m, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * ld;
      const float* u = g + m;
      float* yr = yp + r * m;
      for (int64_t i = 0; i < m; i += 16) {
        const M16 k = vtail(m - i);
        const V16 gv = vload_z(k, g + i);
        const V16 e = vadd(vset(1.0f), exp16(vsub(vzero(), gv)));
        vstore_m(yr + i, k, vmul(vdiv(gv, e), vload_z(k, u + i)));
      }
    }
  });
  return y;
}

// The scores a step samples under the controllers' masks: logits [rows, n] where a token's bit is set, -inf where
// it is not. words [rows, ceil(n / 32)] int32, bit t % 32 of word t / 32 allowing token t: on a little-endian CPU
// each 16-bit half of a word is the lane mask of 16 consecutive tokens, so one masked load writes them. One pass
// over the logits, where an additive bias built from the bits takes several over rows of the vocabulary's size.
at::Tensor masked_scores(const at::Tensor& logits, const at::Tensor& words) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1), per_row = (n + 31) / 32;
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous() && words.size(0) == rows &&
                  words.size(1) == per_row,
              "words must be contiguous int32 [rows, ceil(n / 32)]");
  at::Tensor y = at::empty({rows, n}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(words.data_ptr<int32_t>());
  float* yp = y.data_ptr<float>();
  const int64_t ldx = logits.stride(0);
  const V16 blocked = vset(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, std::max<int64_t>(1, OP_GRAIN / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = xp + r * ldx;
      const uint16_t* m = mp + r * 2 * per_row;
      float* yr = yp + r * n;
      for (int64_t i = 0; i < n; i += 16) {
        const M16 k = vtail(n - i);
        vstore_m(yr + i, k, vload_or(blocked, k & M16(m[i / 16]), x + i));
      }
    }
  });
  return y;
}

// In place on qkv [tokens, heads + 2 kv_heads, dim]: the first ``rotated`` heads (queries and keys)
// rotated, x * cos + roll(x, dim / 2) * sin, with the tables' rows at each token's position (sin's
// first half negated, as paged_llama lays it out); then each token's keys and values copied to its
// slot of the layer's pool [slots, 2 kv_heads, dim].
void rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                int64_t rotated, const at::Tensor& pool, const at::Tensor& slots) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "qkv must be contiguous float32 [tokens, heads, dim]");
  const int64_t tokens = qkv.size(0), all = qkv.size(1), dim = qkv.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && rotated >= 0 && rotated <= all, "bad rotated heads or dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "cos and sin must be float32 [positions, dim]");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.numel() == tokens,
              "positions must be int64 [tokens]");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == tokens,
              "slots must be int64 [tokens]");
  TORCH_CHECK(pool.dim() == 3 && pool.is_contiguous() && pool.scalar_type() == at::kFloat && pool.size(2) == dim,
              "pool must be contiguous float32 [slots, 2 kv_heads, dim]");
  const int64_t stored = pool.size(1), first = all - stored;  // heads copied to the pool: the last ``stored``
  TORCH_CHECK(first >= 0, "the pool holds more heads than qkv");
  float* q = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  const int64_t limit = cos.size(0), capacity = pool.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < limit, "position ", pos[t], " outside the rotary tables");
    TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "slot ", sl[t], " outside the pool");
  }
  at::parallel_for(0, tokens, std::max<int64_t>(1, OP_GRAIN / (all * dim)), [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(dim);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pos[t] * dim;
      const float* s = sp + pos[t] * dim;
      for (int64_t h = 0; h < rotated; ++h) {
        float* x = q + (t * all + h) * dim;
        std::copy(x, x + dim, tmp.begin());
        for (int64_t i = 0; i < dim; ++i) x[i] = tmp[i] * c[i] + tmp[(i + half) % dim] * s[i];
      }
      std::copy(q + (t * all + first) * dim, q + (t + 1) * all * dim, pp + sl[t] * stored * dim);
    }
  });
}

// Attention of decode rows over their paged keys and values, read in place. q [n, heads, dim] (any
// row stride), blocks [num_blocks, block_size, 2 kv_heads, dim] (keys, then values), tables [n, width]
// (each row's blocks in position order), lengths [n] (keys per row, at most width * block_size).
// Grouped-query: query head h reads kv head h / (heads / kv_heads). Returns [n, heads * dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& blocks, const at::Tensor& tables,
                            const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [n, heads, dim], heads side by side");
  TORCH_CHECK(blocks.dim() == 4 && blocks.is_contiguous() && blocks.scalar_type() == at::kFloat,
              "blocks must be contiguous float32 [blocks, block_size, 2 kv_heads, dim]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = blocks.size(0), bs = blocks.size(1), kv_heads = blocks.size(2) / 2;
  TORCH_CHECK(blocks.size(3) == dim && blocks.size(2) % 2 == 0 && kv_heads > 0 && heads % kv_heads == 0,
              "q's heads and dim do not match the blocks'");
  TORCH_CHECK(dim % 16 == 0, "head dim must be a multiple of 16");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == at::kLong && tables.size(0) == n,
              "tables must be int64 [n, width]");
  TORCH_CHECK(lengths.is_contiguous() && lengths.scalar_type() == at::kLong && lengths.numel() == n,
              "lengths must be int64 [n]");
  const int64_t width = tables.size(1), group = heads / kv_heads, lanes = dim / 16;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] > 0 && lp[i] <= width * bs, "row ", i, " has ", lp[i], " keys, its table holds ", width * bs);
    for (int64_t j = 0; j < (lp[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[i * width + j] >= 0 && tp[i * width + j] < num_blocks, "block ", tp[i * width + j],
                  " outside the pool");
    longest = std::max(longest, lp[i]);
  }
  at::Tensor out = at::empty({n, heads * dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* bp = blocks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldq = q.stride(0), slot = 2 * kv_heads * dim, block_stride = bs * slot;
  TORCH_CHECK(lanes <= 8, "head dim must be at most 128");
  // One task per row, its keys and values streamed once in position order (each slot's heads side by
  // side), 16 positions at a time with an online softmax: per head, the chunk's scores, their
  // exponentials against the running maximum, the running sum and output rescaled when it grows.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, longest * dim * heads));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(heads * dim), top(heads), sum(heads);
    alignas(64) float s[16];
    const float* at[16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t len = lp[i];
      const int64_t* row = tp + i * width;
      const float* qi = qp + i * ldq;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t p0 = 0; p0 < len; p0 += 16) {
        const int64_t count = std::min<int64_t>(16, len - p0);
        const M16 k16 = vtail(count);
        for (int64_t j = 0; j < count; ++j) at[j] = bp + row[(p0 + j) / bs] * block_stride + ((p0 + j) % bs) * slot;
        // the next chunk's slots, line by line: its heads' strided reads leave the hardware prefetcher behind
        for (int64_t p = p0 + 16; p < std::min<int64_t>(len, p0 + 32); ++p) {
          const char* next = reinterpret_cast<const char*>(bp + row[p / bs] * block_stride + (p % bs) * slot);
          for (int64_t b = 0; b < slot * int64_t(sizeof(float)); b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
        }
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t g = h / group;
          const float* qh = qi + h * dim;
          for (int64_t j = 0; j < count; ++j) {
            const float* k = at[j] + g * dim;
            V16 d = vzero();
            for (int64_t l = 0; l < lanes; ++l)
              d = vfma(vload(qh + l * 16), vload(k + l * 16), d);
            s[j] = vsum(d) * float(scale);
          }
          const V16 sv = vload_z(k16, s);
          const float most = std::max(top[h], vmax_of(k16, sv));
          const float shrink = std::exp(top[h] - most);  // 0 for the first chunk (top -inf)
          top[h] = most;
          const V16 e = vkeep(k16, exp16(vsub(sv, vset(most))));
          sum[h] = sum[h] * shrink + vsum(e);
          vstore(s, e);
          float* oh = acc.data() + h * dim;
          V16 o[8];
          for (int64_t l = 0; l < lanes; ++l)
            o[l] = vmul(vload(oh + l * 16), vset(shrink));
          for (int64_t j = 0; j < count; ++j) {
            const float* v = at[j] + (kv_heads + g) * dim;
            const V16 w = vset(s[j]);
            for (int64_t l = 0; l < lanes; ++l) o[l] = vfma(w, vload(v + l * 16), o[l]);
          }
          for (int64_t l = 0; l < lanes; ++l) vstore(oh + l * 16, o[l]);
        }
      }
      float* out_row = op + i * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const V16 inv = vset(1.0f / sum[h]);
        for (int64_t l = 0; l < lanes; ++l)
          vstore(out_row + h * dim + l * 16,
                           vmul(vload(acc.data() + h * dim + l * 16), inv));
      }
    }
  });
  return out;
}

// One whole decoder layer for decode rows (one token per sequence, all on GGUF block weights): x +
// attention, then + MLP, as the ops above and ``linear`` compose it in Python, in one call.
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                        const at::Tensor& qkv, int64_t qkv_kind, const std::optional<at::Tensor>& qkv_bias,
                        const at::Tensor& o, int64_t o_kind, const std::optional<at::Tensor>& o_bias,
                        const at::Tensor& gate_up, int64_t gate_up_kind, int64_t intermediate,
                        const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down, int64_t down_kind,
                        const std::optional<at::Tensor>& down_bias, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& positions, int64_t heads, const at::Tensor& blocks, const at::Tensor& slots,
                        const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(blocks.dim() == 4, "blocks must be [blocks, block_size, 2 kv_heads, dim]");
  const int64_t rows = x.size(0), hidden = x.size(1), kv_heads = blocks.size(2) / 2, dim = blocks.size(3);
  const at::Tensor h = rms_norm(x, input_norm, eps);
  const at::Tensor q = linear(h, qkv, qkv_kind, (heads + 2 * kv_heads) * dim, qkv_bias, std::nullopt)
                           .view({rows, heads + 2 * kv_heads, dim});
  rope_store(q, cos, sin, positions, heads + kv_heads, blocks.view({-1, 2 * kv_heads, dim}), slots);
  const at::Tensor attn = decode_attention(q.narrow(1, 0, heads), blocks, tables, lengths, scale);
  const at::Tensor mid = linear(attn, o, o_kind, hidden, o_bias, x);
  const at::Tensor act = silu_mul(
      linear(rms_norm(mid, post_norm, eps), gate_up, gate_up_kind, 2 * intermediate, gate_up_bias, std::nullopt));
  return linear(act, down, down_kind, hidden, down_bias, mid);
}

}  // namespace

TORCH_LIBRARY(tiller_gguf, m) {
  m.def("linear(Tensor x, Tensor w, int kind, int n, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("masked_scores(Tensor logits, Tensor words) -> Tensor");
  m.impl("masked_scores", c10::DispatchKey::CPU, TORCH_FN(masked_scores));
  m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int rotated, Tensor(b!) pool, "
        "Tensor slots) -> ()");
  m.impl("rope_store", c10::DispatchKey::CPU, TORCH_FN(rope_store));
  m.def("decode_attention(Tensor q, Tensor blocks, Tensor tables, Tensor lengths, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
  m.def("decode_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, int qkv_kind, "
        "Tensor? qkv_bias, Tensor o, int o_kind, Tensor? o_bias, Tensor gate_up, int gate_up_kind, int intermediate, "
        "Tensor? gate_up_bias, Tensor down, int down_kind, Tensor? down_bias, Tensor cos, Tensor sin, "
        "Tensor positions, int heads, Tensor(a!) blocks, Tensor slots, Tensor tables, Tensor lengths, float scale) "
        "-> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, TORCH_FN(decode_layer));
}
