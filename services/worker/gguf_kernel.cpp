// y = x @ W^T (+ bias) (+ residual) over GGUF blocks, float32 activations, float32 accumulation.
//
// Layout (made by gguf_linear.py): the output features in tiles of 16, and per tile and per block of
// 32 inputs one record: the 16 columns' float16 scales d (32 bytes), for Q4_1 their minimums m
// (32 bytes), then the codes, 16 bytes per step, one byte per column: Q4_0/Q4_1 a pair of inputs
// (k low nibble, k + 1 high nibble; 16 steps), Q8_0 one input (signed; 32 steps). So a tile streams
// through memory once, and one 16-byte load widens into the weights of 16 columns, dequantized in
// registers (q * d + m; Q4_0 m = -8 d) and multiplied into up to 16 rows of x at once; or, for up to
// three rows, left unscaled and the block's sums scaled instead (few_kernel).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int TILE = 16;   // output features per tile (one zmm of float32)
constexpr int GROUP = 32;  // inputs per block
enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

constexpr int record_bytes(int kind) {
  return kind == Q4_1 ? 64 + 256 : kind == Q4_0 ? 32 + 256 : 32 + 512;
}

inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The codes of inputs k and k + 1 (k even) in one tile's block record, as floats (unscaled).
template <int KIND>
inline void widen(const uint8_t* rec, int k, __m512& q0, __m512& q1) {
  if constexpr (KIND == Q8_0) {
    const uint8_t* c = rec + 32 + k * TILE;
    q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
    q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + TILE))));
  } else {
    const uint8_t* c = rec + (KIND == Q4_1 ? 64 : 32) + k / 2 * TILE;
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    q0 = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
    q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  }
}

// The block's minimum per column: Q4_1's own, Q4_0's -8 d (Q8_0 has none).
template <int KIND>
inline __m512 minimum(const uint8_t* rec, __m512 d) {
  if constexpr (KIND == Q4_1) return half16(rec + 32);
  return _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
}

template <int MR, int NV>
inline void zero(__m512 (&acc)[MR][NV]) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
}

// y[r, tile v's columns] = acc[r][v] (+ bias) (+ residual), the last tile's columns past n left out.
template <int MR, int NV>
inline void store(__m512 (&acc)[MR][NV], float* y, int64_t ldy, int64_t n0, int64_t n, const float* bias,
                  const float* res, int64_t ldr) {
  for (int v = 0; v < NV; ++v) {
    const int64_t col = n0 + v * TILE;
    const int64_t left = n - col;
    const __mmask16 mask = left >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      __m512 out = _mm512_add_ps(acc[r][v], bv);
      if (res) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, res + r * ldr + col));
      _mm512_mask_storeu_ps(y + r * ldy + col, mask, out);
    }
  }
}

// MR rows of x against NV consecutive tiles: acc[r][v] holds y[r, tile v's 16 columns].
template <int KIND, int MR, int NV>
void tile_kernel(const float* x, int64_t ldx, int64_t blocks, const uint8_t* w, int64_t tile_stride,
                 float* y, int64_t ldy, int64_t n0, int64_t n, const float* bias, const float* res, int64_t ldr) {
  constexpr int REC = record_bytes(KIND);
  __m512 acc[MR][NV];
  zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 d[NV], m[NV];
    const uint8_t* rec[NV];
    for (int v = 0; v < NV; ++v) {
      rec[v] = w + v * tile_stride + b * REC;
      d[v] = half16(rec[v]);
      if constexpr (KIND != Q8_0) m[v] = minimum<KIND>(rec[v], d[v]);
    }
    const float* xb = x + b * GROUP;
    for (int k = 0; k < GROUP; k += 2) {
      for (int v = 0; v < NV; ++v) {
        __m512 w0, w1;
        widen<KIND>(rec[v], k, w0, w1);
        if constexpr (KIND == Q8_0) {
          w0 = _mm512_mul_ps(w0, d[v]);
          w1 = _mm512_mul_ps(w1, d[v]);
        } else {
          w0 = _mm512_fmadd_ps(w0, d[v], m[v]);
          w1 = _mm512_fmadd_ps(w1, d[v], m[v]);
        }
        for (int r = 0; r < MR; ++r) {
          acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k]), w0, acc[r][v]);
          acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k + 1]), w1, acc[r][v]);
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
  __m512 acc[MR][NV];
  zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * GROUP;
    __m512 even[MR][NV], odd[MR][NV];
    zero(even);
    zero(odd);
    for (int k = 0; k < GROUP; k += 2) {
      for (int v = 0; v < NV; ++v) {
        __m512 q0, q1;
        widen<KIND>(w + v * tile_stride + b * REC, k, q0, q1);
        for (int r = 0; r < MR; ++r) {
          even[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k]), q0, even[r][v]);
          odd[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k + 1]), q1, odd[r][v]);
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const uint8_t* rec = w + v * tile_stride + b * REC;
      const __m512 d = half16(rec);
      for (int r = 0; r < MR; ++r) {
        acc[r][v] = _mm512_fmadd_ps(d, _mm512_add_ps(even[r][v], odd[r][v]), acc[r][v]);
        if constexpr (KIND != Q8_0)
          acc[r][v] = _mm512_fmadd_ps(minimum<KIND>(rec, d), _mm512_set1_ps(sx[r * blocks + b]), acc[r][v]);
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
constexpr int few_wide(int mr) { return mr == 1 ? 4 : mr == 2 ? 3 : 2; }

using Fn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                    const float*, const float*, int64_t);

// Tiles side by side for MR rows, as many as the registers hold.
constexpr int wide(int mr) { return mr <= 2 ? 4 : mr <= 4 ? 3 : mr <= 12 ? 2 : 1; }

template <int KIND, int... I>
void tile_table(Fn* one, Fn* many, std::integer_sequence<int, I...>) {
  ((one[I] = &tile_kernel<KIND, I + 1, 1>, many[I] = &tile_kernel<KIND, I + 1, wide(I + 1)>), ...);
}

template <int KIND, int... I>
void few_table(Few* one, Few* many, std::integer_sequence<int, I...>) {
  ((one[I] = &few_kernel<KIND, I + 1, 1>, many[I] = &few_kernel<KIND, I + 1, few_wide(I + 1)>), ...);
}

constexpr int MAX_ROWS = 16;

// By kind and rows: the kernel over one tile and over as many tiles side by side as the rows allow.
struct Kernels {
  Fn one[3][MAX_ROWS];
  Fn many[3][MAX_ROWS];
  Few few_one[3][FEW];
  Few few_many[3][FEW];
  template <int KIND>
  void add() {
    tile_table<KIND>(one[KIND], many[KIND], std::make_integer_sequence<int, MAX_ROWS>{});
    few_table<KIND>(few_one[KIND], few_many[KIND], std::make_integer_sequence<int, FEW>{});
  }
  Kernels() {
    add<Q4_0>();
    add<Q4_1>();
    add<Q8_0>();
  }
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t kind, int64_t n,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "unknown block kind ", kind);
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
    std::vector<float> sums(rows * blocks);  // each row's sum over each block of inputs
    for (int64_t i = 0; i < rows * blocks; ++i) {
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

}  // namespace

TORCH_LIBRARY(tiller_gguf, m) {
  m.def("linear(Tensor x, Tensor w, int kind, int n, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
