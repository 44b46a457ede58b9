// IVF list scan over quantized residual codes, with the eligibility filter applied inside the scan.
//
// Score of item i (in list l, probed by query b at probe slot p):
//     coarse[b, p] + scale[i] * qscale[b] * <q[b], code[i]>     (codes hold residuals to l's centroid)
// Items that fail the request's filter, or that the request excludes (its user's seen items, as
// sorted rows), get no score and never take a top-r slot.
//
// The batch is scanned list-major: (query, list) pairs are grouped by list so that a list's codes
// are read from memory once per batch and reused, from cache, by every query that probes it
// (a query-major scan, as in faiss, reads them once per query). Phase 1 writes every pair's scores
// into a buffer (parallel over lists); phase 2 selects each query's best r from its pairs' scores
// (TopStream, or a bounded min-heap; parallel over queries). Large batches are cut into chunks so that the
// buffer stays bounded.
//
// Int8 dot products run on one of three paths, chosen per call at run time (int8_isa): AVX-512 VNNI
// (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd) or portable loops. The SIMD paths are compiled per
// function with a target attribute, so the library loads on any x86-64 and only a CPU that has the
// instructions runs them; $RECSERVE_SCAN_ISA=portable|avx2|vnni forces one (tests and benchmarks
// compare them in one process). Every path computes the same integer dots, and one shared epilogue
// turns them into scores, so the paths return bit-identical results.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RECSERVE_X86 1
#define RECSERVE_TARGET(isa) __attribute__((target(isa)))
#endif
#if defined(__AVX512BW__)  // built with -march=native on an AVX-512 CPU: the heap's 16-wide skip
#define RECSERVE_AVX512_BUILD 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <memory>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A query's candidates up to this multiple of r are selected (nth_element), more go through the heap.
constexpr int64_t kSelectShare = 16;
constexpr int64_t kMaxBufferFloats = int64_t(1) << 25;  // 128 MiB of pair scores per chunk

using Cand = std::pair<float, int64_t>;  // (score, position in list-sorted order)
struct MinFirst {
  bool operator()(const Cand& a, const Cand& b) const { return a.first > b.first; }
};

// A heap order whose worst, among equal scores, is the higher position: pushed in ascending
// position, the heap then keeps the best r by (score, then lower position) whatever else was
// pushed between, and sort_heap lists them in that order (the probe: see probe_one_int8).
struct BetterFirst {
  bool operator()(const Cand& a, const Cand& b) const {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};

// Int8 dot products <q, c>. Every path returns the exact integer result of the portable loop.
enum class Isa { kPortable, kAvx2, kVnni };

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kVnni: return "vnni";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

bool cpu_runs(Isa isa) {
#ifdef RECSERVE_X86
  if (isa == Isa::kVnni) return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");  // every AVX2 path
#endif
  return isa == Isa::kPortable;
}

// The int8 path of this call: $RECSERVE_SCAN_ISA when set (refused if this CPU cannot run it), else
// the best this CPU has. Read per call, so that a test or a benchmark may switch it between calls.
Isa int8_isa() {
  const char* env = std::getenv("RECSERVE_SCAN_ISA");
  const std::string want = env ? env : "";
  if (want.empty() || want == "auto") {
    for (Isa isa : {Isa::kVnni, Isa::kAvx2})
      if (cpu_runs(isa)) return isa;
    return Isa::kPortable;
  }
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kVnni})
    if (want == isa_name(isa)) {
      TORCH_CHECK(cpu_runs(isa), "RECSERVE_SCAN_ISA=", want,
                  ": this CPU cannot run that path; set portable, or unset it for the best path");
      return isa;
    }
  TORCH_CHECK(false, "RECSERVE_SCAN_ISA must be auto, portable, avx2 or vnni; got '", want, "'");
  return Isa::kPortable;
}

inline int32_t dot_i8_portable(const int8_t* __restrict q, const int8_t* __restrict c, int64_t d) {
  int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) acc += int32_t(q[j]) * int32_t(c[j]);
  return acc;
}

void row_dots_portable(const int8_t* q, const int8_t* codes, int64_t n, int64_t d, int32_t* dots) {
  for (int64_t i = 0; i < n; ++i) dots[i] = dot_i8_portable(q, codes + i * d, d);
}

#ifdef RECSERVE_X86
// AVX2: vpmaddubsw multiplies unsigned by signed bytes into saturating s16 pair sums. The code's
// magnitude |c| (<= 128, exact as an unsigned byte even for -128) is the unsigned side and the query
// takes the code's sign (|q| <= 127, so negating it is exact): a pair sums to at most 2 * 128 * 127 =
// 32512 < 2^15, so nothing saturates, and vpmaddwd widens every pair sum to s32 at once.
RECSERVE_TARGET("avx2") inline __m256i madd_i8_avx2(__m256i acc, __m256i q, __m256i c) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The sum of v's 8 int32 lanes.
RECSERVE_TARGET("avx2") inline int32_t sum_lanes_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// The query's last 32 bytes ending at D, its first 32 - D % 32 zeroed (those bytes were in the
// last whole word): a row's tail is then one load ending at its own last byte, never past it.
RECSERVE_TARGET("avx2") inline __m256i tail_query(const int8_t* q, int64_t d) {
  static const int8_t iota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                  16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
  const __m256i keep = _mm256_cmpgt_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(iota)),
                                         _mm256_set1_epi8(static_cast<char>(31 - d % 32)));
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d - 32)), keep);
}

// One row's dot: whole 32-byte words, then (D >= 32) the tail as one word ending at D against
// tail_query; a row shorter than 32 bytes one by one.
RECSERVE_TARGET("avx2") inline int32_t dot_i8_avx2(const int8_t* q, const int8_t* c, int64_t d) {
  if (d < 32) return dot_i8_portable(q, c, d);
  __m256i acc = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32)
    acc = madd_i8_avx2(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j)),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j)));
  if (j < d) acc = madd_i8_avx2(acc, tail_query(q, d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + d - 32)));
  return sum_lanes_epi32(acc);
}

// Lane i of the result = the sum of the 8 lanes of v[i] (as sum_lanes16 below, on 8 rows).
RECSERVE_TARGET("avx2") inline __m256i sum_lanes8(const __m256i* v) {
  __m256i w[4], x[2];
  for (int k = 0; k < 4; ++k)
    w[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                            _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // 128-bit lane L: rows 4k .. 4k + 3, each summed over L
    x[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(w[2 * k], w[2 * k + 1]),
                            _mm256_unpackhi_epi64(w[2 * k], w[2 * k + 1]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(x[0], x[1], 0x20),
                          _mm256_permute2x128_si256(x[0], x[1], 0x31));
}

// 8 rows at a time, summed together by sum_lanes8: each row's whole 32-byte words, then its tail
// as one word ending at D (tail_query; D >= 32: 300-d rows had gone one by one, with a scalar
// tail); rows shorter than 32 bytes, and the last n % 8, one by one. The same integer dots.
RECSERVE_TARGET("avx2") void row_dots_avx2(const int8_t* q, const int8_t* codes, int64_t n, int64_t d, int32_t* dots) {
  int64_t i = 0;
  if (d >= 32) {
    const int64_t full = d / 32 * 32;
    const __m256i qt = tail_query(q, d);  // unused when full == d
    for (; i + 8 <= n; i += 8) {
      const int8_t* c = codes + i * d;
      __m256i acc[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        __m256i a = _mm256_setzero_si256();
        for (int64_t j = 0; j < full; j += 32)
          a = madd_i8_avx2(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * d + j)));
        if (full < d) a = madd_i8_avx2(a, qt, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * d + d - 32)));
        acc[r] = a;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + i), sum_lanes8(acc));
    }
  }
  for (; i < n; ++i) dots[i] = dot_i8_avx2(q, codes + i * d, d);
}

// AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes and adds groups of 4 into s32 without
// saturation. The code is flipped to offset binary (c + 128, one xor) and the excess 128 * sum(q) is
// subtracted. The tail is a masked load: its missing query bytes are zero, so they add nothing.
RECSERVE_TARGET("avx512f,avx512bw,avx512vnni")
int32_t dot_i8_vnni(const int8_t* q, const int8_t* c, int64_t d, int32_t qsum) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 64 <= d; j += 64)
    acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(c + j), flip), _mm512_loadu_si512(q + j));
  if (j < d) {
    const __mmask64 m = (uint64_t(1) << (d - j)) - 1;
    acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, c + j), flip),
                              _mm512_maskz_loadu_epi8(m, q + j));
  }
  return _mm512_reduce_add_epi32(acc) - 128 * qsum;
}

// Lane i of the result = the sum of the 16 lanes of v[i]: four rounds of interleave-and-add, so 16
// rows share ~45 shuffles and adds where a horizontal sum each takes ~9 (most on the shuffle port).
// [a.L0+a.L1, a.L2+a.L3, b.L0+b.L1, b.L2+b.L3] of 128-bit lanes. A function of its own, with its
// target: a lambda inside sum_lanes16 does not inherit the target attribute, so a build for a CPU
// without AVX-512 (-march=haswell) failed to compile it.
RECSERVE_TARGET("avx512f") inline __m512i pair_lanes(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Integer sums: the same result in any order.
RECSERVE_TARGET("avx512f,avx512bw,avx512vnni") inline __m512i sum_lanes16(const __m512i* v) {
  __m512i w[8], x[4];
  for (int k = 0; k < 8; ++k)  // 128-bit lane L: [v2k, v2k+1, v2k, v2k+1] partials
    w[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                            _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: rows 4k .. 4k + 3, each summed over L
    x[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2 * k], w[2 * k + 1]),
                            _mm512_unpackhi_epi64(w[2 * k], w[2 * k + 1]));
  return pair_lanes(pair_lanes(x[0], x[1]), pair_lanes(x[2], x[3]));  // 128-bit lane k: rows 4k .. 4k + 3
}

// 16 rows at a time, each with an accumulator of its own, summed together by sum_lanes16; the last
// n % 16 rows one by one. The same integer dots as dot_i8_vnni. Rows of at most 64 bytes (the
// common D) are one masked load each, with no loop over the row, so the 16 sums stay in registers.
RECSERVE_TARGET("avx512f,avx512bw,avx512vnni")
void row_dots_vnni(const int8_t* q, int32_t qsum, const int8_t* codes, int64_t n, int64_t d, int32_t* dots) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i corr = _mm512_set1_epi32(128 * qsum);
  int64_t i = 0;
  if (d <= 64) {
    const __mmask64 m = d == 64 ? ~uint64_t(0) : (uint64_t(1) << d) - 1;
    const __m512i qv = _mm512_maskz_loadu_epi8(m, q);
    for (; i + 16 <= n; i += 16) {
      const int8_t* c = codes + i * d;
      __m512i acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        acc[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                     _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, c + r * d), flip), qv);
      _mm512_storeu_si512(dots + i, _mm512_sub_epi32(sum_lanes16(acc), corr));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      const int8_t* c = codes + i * d;
      __m512i acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        __m512i a = _mm512_setzero_si512();
        int64_t j = 0;
        for (; j + 64 <= d; j += 64)
          a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_loadu_si512(c + r * d + j), flip),
                                  _mm512_loadu_si512(q + j));
        if (j < d) {
          const __mmask64 m = (uint64_t(1) << (d - j)) - 1;
          a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, c + r * d + j), flip),
                                  _mm512_maskz_loadu_epi8(m, q + j));
        }
        acc[r] = a;
      }
      _mm512_storeu_si512(dots + i, _mm512_sub_epi32(sum_lanes16(acc), corr));
    }
  }
  for (; i < n; ++i) dots[i] = dot_i8_vnni(q, codes + i * d, d, qsum);
}

// VNNI dots of one query against a list transposed by transpose_codes: one vpdpbusd with a broadcast
// group of 4 query bytes advances 16 items, and no horizontal sum is needed. The query is
// zero-padded to groups * 4 bytes; dots must hold n rounded up to 16.
RECSERVE_TARGET("avx512f,avx512bw,avx512vnni")
void block_dots_vnni(const uint32_t* t, int64_t n, int64_t groups, const int8_t* q, int32_t qsum, int32_t* dots) {
  // Four blocks (64 items) at a time, each its own accumulator: one accumulator waited on
  // vpdpbusd's latency at every group (the batched scan ran slower than the AVX2 rows).
  // Integer sums: any split gives the same dots.
  const __m512i corr = _mm512_set1_epi32(128 * qsum);
  const int64_t blocks = (n + 15) / 16, stride = groups * 16;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const uint32_t* blk = t + b * stride;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t qw;
      std::memcpy(&qw, q + 4 * g, 4);
      const __m512i qv = _mm512_set1_epi32(qw);
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(blk + g * 16), qv);
      a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(blk + stride + g * 16), qv);
      a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512(blk + 2 * stride + g * 16), qv);
      a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512(blk + 3 * stride + g * 16), qv);
    }
    _mm512_storeu_si512(dots + b * 16, _mm512_sub_epi32(a0, corr));
    _mm512_storeu_si512(dots + b * 16 + 16, _mm512_sub_epi32(a1, corr));
    _mm512_storeu_si512(dots + b * 16 + 32, _mm512_sub_epi32(a2, corr));
    _mm512_storeu_si512(dots + b * 16 + 48, _mm512_sub_epi32(a3, corr));
  }
  for (; b < blocks; ++b) {  // the last blocks: even and odd groups in two accumulators
    const uint32_t* blk = t + b * stride;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      int32_t qw[2];
      std::memcpy(qw, q + 4 * g, 8);
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(blk + g * 16), _mm512_set1_epi32(qw[0]));
      a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(blk + (g + 1) * 16), _mm512_set1_epi32(qw[1]));
    }
    if (g < groups) {
      int32_t qw;
      std::memcpy(&qw, q + 4 * g, 4);
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(blk + g * 16), _mm512_set1_epi32(qw));
    }
    _mm512_storeu_si512(dots + b * 16, _mm512_sub_epi32(_mm512_add_epi32(a0, a1), corr));
  }
}
#endif

// A list's n codes, flipped to offset binary (c + 128), as blocks of 16 items x 4 bytes: word g of
// item i sits at ((i / 16) * groups + g) * 16 + i % 16, groups = ceil(D / 4). Bytes past D and items
// past the list's end are zero codes (0x80 flipped).
void transpose_codes(const int8_t* codes, int64_t n, int64_t d, std::vector<uint32_t>& out) {
  constexpr uint32_t flip = 0x80808080u;
  const int64_t groups = (d + 3) / 4, full = d / 4;
  out.assign(((n + 15) / 16) * groups * 16, flip);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t* dst = out.data() + (i / 16) * groups * 16 + (i % 16);
    const int8_t* src = codes + i * d;
    for (int64_t g = 0; g < full; ++g) {
      uint32_t word;
      std::memcpy(&word, src + 4 * g, 4);
      dst[g * 16] = word ^ flip;
    }
    if (full < groups) {
      uint32_t word = 0;
      std::memcpy(&word, src + 4 * full, d - 4 * full);
      dst[full * 16] = word ^ flip;
    }
  }
}

// Float query against int8 codes (the exact plan's scores, no quantized query). The portable loop
// follows the AVX2 path's order exactly (16 lanes of fused multiply-adds, the same pairwise sums,
// the same scalar tail), so the two return the same bits, as the int8 scan's paths do.
inline float dot_f32_i8_portable(const float* __restrict q, const int8_t* __restrict c, int64_t d) {
  float a0[8] = {0.f}, a1[8] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= d; j += 16)
    for (int l = 0; l < 8; ++l) {
      a0[l] = std::fma(q[j + l], float(c[j + l]), a0[l]);
      a1[l] = std::fma(q[j + 8 + l], float(c[j + 8 + l]), a1[l]);
    }
  if (j + 8 <= d) {
    for (int l = 0; l < 8; ++l) a0[l] = std::fma(q[j + l], float(c[j + l]), a0[l]);
    j += 8;
  }
  float a[8], s4[4];
  for (int l = 0; l < 8; ++l) a[l] = a0[l] + a1[l];
  for (int l = 0; l < 4; ++l) s4[l] = a[l] + a[l + 4];
  float sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
  for (; j < d; ++j) sum = std::fma(q[j], float(c[j]), sum);
  return sum;
}

#ifdef RECSERVE_X86
RECSERVE_TARGET("avx2,fma") inline float dot_f32_i8_avx2(const float* q, const int8_t* c, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), lo, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), hi, a1);
  }
  if (j + 8 <= d) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), a0);
    j += 8;
  }
  const __m256 a = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float sum = _mm_cvtss_f32(s);
  for (; j < d; ++j) sum = std::fma(q[j], float(c[j]), sum);
  return sum;
}
#endif

// Per-row scales are stored as bfloat16: 2 bytes an item and float32's range. The build rounds
// each scale before it quantizes the row with it, so codes and scale agree exactly and the
// rounding costs no precision (the row's largest value lands within a quarter step of 127).
using Scale = at::BFloat16;

// The one place where integer dots become scores, shared by every path so that they agree bitwise.
inline void dots_to_scores(const int32_t* dots, int64_t n, const Scale* scales, float qscale, float base, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = base + float(scales[i]) * qscale * float(dots[i]);
}

inline float dot_f8(const float* __restrict q, const uint8_t* __restrict c, const float* lut, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) acc += q[j] * lut[c[j]];
  return acc;
}

// An item passes when every clause holds: clause c holds when (sig & mask_c) != 0, negated if neg_c.
inline bool passes(const int64_t* sig, const int64_t* mask, const bool* neg, int64_t c_count, int64_t w) {
  for (int64_t c = 0; c < c_count; ++c) {
    bool hit = false;
    for (int64_t k = 0; k < w; ++k) hit |= (sig[k] & mask[c * w + k]) != 0;
    if (hit == neg[c]) return false;
  }
  return true;
}

struct Index {
  const Scale* scales; const int64_t* offsets; int64_t nlist;
  const int64_t* sig; int64_t w;
};
struct Batch {  // one chunk of queries [b0, b1)
  int64_t b0, b1, p;
  const int64_t* probes; const float* coarse;
  const int64_t* fmask; const bool* fneg; int64_t c_count;
  const int64_t* excl; int64_t s;  // excl [B, s]: rows each query excludes, ascending (int64 max pads)
  const float* floor = nullptr;     // [B]: keep no candidate scoring below it (a second round's K-th)
};

// Pairs of the chunk grouped by list: active[a] is the a-th probed list (ascending), its pairs are
// pairs[active_start[a] .. active_start[a + 1]) = (b - b0) * P + p flat ids, ascending.
// buf_off[(b - b0) * P + p] = where the pair's scores start in the score buffer (-1: no pair).
struct Plan {
  std::vector<int64_t> active, active_start, pairs, buf_off;
  int64_t buf_size = 0;
};

Plan plan_chunk(const Index& ix, const Batch& bt) {
  Plan pl;
  const int64_t total = (bt.b1 - bt.b0) * bt.p;
  const int64_t* probes = bt.probes + bt.b0 * bt.p;
  // (list, pair) keys in list order, pairs ascending within a list: sorted where the pairs are few
  // for the lists (a few queries: no pass over every list), else counted per list
  std::vector<uint64_t> keys;
  keys.reserve(total);
  for (int64_t bp = 0; bp < total; ++bp)
    if (probes[bp] >= 0) keys.push_back((uint64_t(probes[bp]) << 32) | uint64_t(bp));
  if ((int64_t)keys.size() * 8 < ix.nlist) {
    std::sort(keys.begin(), keys.end());
  } else {
    std::vector<int64_t> start(ix.nlist + 1, 0);
    for (uint64_t k : keys) ++start[(k >> 32) + 1];
    for (int64_t l = 0; l < ix.nlist; ++l) start[l + 1] += start[l];
    std::vector<uint64_t> sorted(keys.size());
    for (uint64_t k : keys) sorted[start[k >> 32]++] = k;  // bp order kept within a list
    keys.swap(sorted);
  }
  pl.pairs.resize(keys.size());
  pl.buf_off.assign(total, -1);
  int64_t off = 0;
  for (size_t k = 0; k < keys.size(); ++k) {
    const int64_t l = int64_t(keys[k] >> 32), bp = int64_t(keys[k] & 0xFFFFFFFFu);
    if (pl.active.empty() || pl.active.back() != l) {
      pl.active.push_back(l);
      pl.active_start.push_back((int64_t)k);
    }
    pl.pairs[k] = bp;
    pl.buf_off[bp] = off;
    off += ix.offsets[l + 1] - ix.offsets[l];
  }
  pl.active_start.push_back((int64_t)keys.size());
  pl.buf_size = off;
  return pl;
}

// A filtered pair's items that pass its filter, as offsets in the list -> `some`. One clause over
// one word (the common filter) is branch-free and also fills keep[i - i0] (whether item i passes):
// an offset written always and kept by its count, where a branch per item mispredicted about every
// other item at 50 %; returns true then. Several clauses keep passes()'s early out, which a
// selective first clause makes predictable (a branch-free loop measured 1.3-1.8x slower there).
bool passing(const Index& ix, const Batch& bt, int64_t b, int64_t i0, int64_t i1, std::vector<int64_t>& some,
             std::vector<uint8_t>& keep) {
  const int64_t* fm = bt.fmask + b * bt.c_count * ix.w;
  const bool* fn = bt.fneg + b * bt.c_count;
  const int64_t n = i1 - i0;
  if (bt.c_count == 1 && ix.w == 1) {
    const int64_t mask = fm[0];
    const bool neg = fn[0];
    some.resize(n);
    keep.resize(n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool ok = ((ix.sig[i0 + i] & mask) != 0) != neg;
      keep[i] = ok;
      some[m] = i;
      m += ok;
    }
    some.resize(m);
    return true;
  }
  some.clear();
  for (int64_t i = i0; i < i1; ++i)
    if (passes(ix.sig + i * ix.w, fm, fn, bt.c_count, ix.w)) some.push_back(i - i0);
  return false;
}

// Phase 1: every pair's scores, list by list. A scorer writes `base + scaled dot` for a list's items
// (`prepare` lets it re-lay out the list once for all the queries that probe it). A filtered pair
// first finds the items that pass: when few do (below the scorer's `sparse_share`), only they are
// scored (ineligible items cost no dot product) and the rest is -inf; otherwise the whole list is
// scored and the failing items blanked. Either way the scores are the same bits. Excluded rows
// (seen items) are blanked last.
template <typename MakeScorer>
void score_pairs(const Index& ix, const Batch& bt, const Plan& pl, float* buf, MakeScorer make_scorer) {
  // Small batches (a few probed lists) run on the calling thread: a thread team costs more.
  at::parallel_for(0, (int64_t)pl.active.size(), 16, [&](int64_t a0, int64_t a1) {
    auto scorer = make_scorer();
    std::vector<int64_t> some;
    std::vector<uint8_t> keep;
    const int64_t fw = bt.c_count * ix.w;  // a row's filter: fw mask words and c_count negations
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t l = pl.active[a];
      const int64_t i0 = ix.offsets[l], i1 = ix.offsets[l + 1], n = i1 - i0;
      const int64_t nq = pl.active_start[a + 1] - pl.active_start[a];
      if (nq == 0 || i1 == i0) continue;
      scorer.prepare(i0, i1, nq);
      int64_t passed_for = -1;  // the row whose filter `some` / `keep` hold for this list
      for (int64_t k = pl.active_start[a]; k < pl.active_start[a + 1]; ++k) {
        const int64_t bp = pl.pairs[k], b = bt.b0 + bp / bt.p;
        const float base = bt.coarse[b * bt.p + bp % bt.p];
        float* out = buf + pl.buf_off[bp];
        if (bt.c_count == 0) {
          scorer.score(b, i0, i1, base, out);
        } else {
          // the rows probing a list often share a filter (a batch of one request's pages, a
          // benchmark's): its items are tested once (22 % of a 1000-row batch at 20 %)
          const bool same = passed_for >= 0 &&
                            std::equal(bt.fmask + b * fw, bt.fmask + (b + 1) * fw, bt.fmask + passed_for * fw) &&
                            std::equal(bt.fneg + b * bt.c_count, bt.fneg + (b + 1) * bt.c_count,
                                       bt.fneg + passed_for * bt.c_count);
          if (!same) {
            if (!passing(ix, bt, b, i0, i1, some, keep)) {  // several clauses: keep from some
              keep.assign(n, 0);
              for (const int64_t i : some) keep[i] = 1;
            }
            passed_for = b;
          }
          const int64_t m = (int64_t)some.size();
          if (m < scorer.sparse_share() * n) {
            std::fill(out, out + n, kNegInf);
            scorer.score_some(b, i0, some.data(), m, base, out);
          } else {
            scorer.score(b, i0, i1, base, out);
            for (int64_t i = 0; i < n; ++i) out[i] = keep[i] ? out[i] : kNegInf;  // a select, no branch
          }
        }
        if (bt.s > 0) {  // the list's excluded rows are one run of the sorted exclusions
          const int64_t* e = bt.excl + b * bt.s;
          for (const int64_t* it = std::lower_bound(e, e + bt.s, i0); it != e + bt.s && *it < i1; ++it)
            out[*it - i0] = kNegInf;
        }
      }
    }
  });
}

// With VNNI, a list is transposed for block_dots_vnni when at least this many queries of a batch
// probe it: its scalar transpose costs about what the row dots of ~10 queries do. From 2 (before),
// a batch of 1,000 queries at 64-d (1,024 lists) took 7 % longer and at 256-d 10 %; at 784-d with
// 62 queries a list, the same (thresholds 2 / 16 / never measured; never was 20 % slower there).
constexpr int64_t kTransposeQueries = 16;

// Int8 scorer. With VNNI and at least kTransposeQueries queries on a list, the list is first
// transposed into blocks of 16 items so that every query's dots need no horizontal sums; otherwise
// rows are scanned as stored. AVX2 always scans rows: a transposed layout measured 0.76-1.06x rows
// on an AVX2-only AMD EPYC (d = 64 and 784), its 5 instructions per 32 bytes leaving the horizontal
// sum cheap. Any D: tails are padded (VNNI) or one word ending at D (AVX2, tail_query).
struct Int8Scorer {
  const int8_t* codes; const Scale* scales; int64_t d;
  const int8_t* q; int64_t qstride;  // queries zero-padded to qstride >= round_up(D, 4) bytes
  const float* qscale; const int32_t* qsum;
  Isa isa;
  std::vector<uint32_t> tbuf;
  std::vector<int32_t> dots;
  bool transposed = false;

  void prepare(int64_t i0, int64_t i1, int64_t nq) {
    const int64_t n = i1 - i0;
    dots.resize(((n + 15) / 16) * 16);
    transposed = isa == Isa::kVnni && nq >= kTransposeQueries;
    if (transposed) transpose_codes(codes + i0 * d, n, d, tbuf);
  }

  void score(int64_t b, int64_t i0, int64_t i1, float base, float* out) {
    const int64_t n = i1 - i0, groups = (d + 3) / 4;
    const int8_t* qb = q + b * qstride;
    const int8_t* c = codes + i0 * d;
    int32_t* dp = dots.data();
    switch (isa) {
#ifdef RECSERVE_X86
      case Isa::kVnni:
        if (transposed) block_dots_vnni(tbuf.data(), n, groups, qb, qsum[b], dp);
        else row_dots_vnni(qb, qsum[b], c, n, d, dp);
        break;
      case Isa::kAvx2:
        row_dots_avx2(qb, c, n, d, dp);
        break;
#endif
      default:
        row_dots_portable(qb, c, n, d, dp);
    }
    dots_to_scores(dp, n, scales + i0, qscale[b], base, out);
  }

  // Below this share of a list's items passing, score only them (per-item dots). A transposed
  // list scores 16 items per instruction for every query, so it stays dense down to fewer.
  double sparse_share() const { return transposed ? 0.125 : 0.5; }

  // The scores of items i0 + some[0..m) only, into out[some[k]]: the same integer dots as
  // score(), one item at a time, and the same epilogue.
  void score_some(int64_t b, int64_t i0, const int64_t* some, int64_t m, float base, float* out) {
    const int8_t* qb = q + b * qstride;
    for (int64_t k = 0; k < m; ++k) {
      const int64_t i = i0 + some[k];
      const int8_t* c = codes + i * d;
      int32_t dot;
      switch (isa) {
#ifdef RECSERVE_X86
        case Isa::kVnni: dot = dot_i8_vnni(qb, c, d, qsum[b]); break;
        case Isa::kAvx2: dot = dot_i8_avx2(qb, c, d); break;
#endif
        default: dot = dot_i8_portable(qb, c, d);
      }
      dots_to_scores(&dot, 1, scales + i, qscale[b], base, out + some[k]);
    }
  }
};

struct Fp8Scorer {
  const uint8_t* codes; const Scale* scales; int64_t d;
  const float* q; const float* lut;
  void prepare(int64_t, int64_t, int64_t) {}
  void score(int64_t b, int64_t i0, int64_t i1, float base, float* out) const {
    for (int64_t i = i0; i < i1; ++i) out[i - i0] = base + float(scales[i]) * dot_f8(q + b * d, codes + i * d, lut, d);
  }
  double sparse_share() const { return 1.0; }  // per item either way: score only what passes
  void score_some(int64_t b, int64_t i0, const int64_t* some, int64_t m, float base, float* out) const {
    for (int64_t k = 0; k < m; ++k) {
      const int64_t i = i0 + some[k];
      out[some[k]] = base + float(scales[i]) * dot_f8(q + b * d, codes + i * d, lut, d);
    }
  }
};

// Pushes s[0..n) into a bounded min-heap of the best r (positions pos0 + i). Entries not above the
// current worst are skipped 16 at a time on AVX-512 builds, 8 on AVX2 ones; -inf never enters.
template <class Order = MinFirst>
inline void push_one(float v, int64_t pos, int64_t r, std::vector<Cand>& heap, float& worst) {
  if (v <= worst) return;
  if ((int64_t)heap.size() < r) {
    heap.emplace_back(v, pos);
    std::push_heap(heap.begin(), heap.end(), Order());
    if ((int64_t)heap.size() == r) worst = heap.front().first;
  } else {
    std::pop_heap(heap.begin(), heap.end(), Order());
    heap.back() = Cand(v, pos);
    std::push_heap(heap.begin(), heap.end(), Order());
    worst = heap.front().first;
  }
}

template <class Order = MinFirst>
inline void push_scores(const float* s, int64_t n, int64_t pos0, int64_t r, std::vector<Cand>& heap, float& worst) {
  auto push = [&](float v, int64_t i) { push_one<Order>(v, pos0 + i, r, heap, worst); };
  int64_t i = 0;
#ifdef RECSERVE_AVX512_BUILD
  for (; i + 16 <= n; i += 16) {
    __mmask16 gt = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), _mm512_set1_ps(worst), _CMP_GT_OQ);
    while (gt) {
      const int j = __builtin_ctz(gt);
      gt &= gt - 1;
      push(s[i + j], i + j);
    }
  }
#elif defined(__AVX2__)  // a build for AVX2 CPUs: 8 at a time (the probe's top lists: 6 % of a batch)
  for (; i + 8 <= n; i += 8) {
    unsigned gt = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(worst), _CMP_GT_OQ));
    while (gt) {
      const int j = __builtin_ctz(gt);
      gt &= gt - 1;
      push(s[i + j], i + j);
    }
  }
#endif
  for (; i < n; ++i) push(s[i], i);
}

// Phase 2: each query's best r over its pairs' scores, ordered by BetterFirst (the higher score,
// then the lower position: the order at ties of a selection).

// Selections of up to this many take kth_largest and rank_sort in keep_best (AVX-512 or AVX2).
constexpr int64_t kRankSortMax = 160;

// kth_largest's start: every key lies in [lo, hi], so the k-th shares their common leading bits
// (the bit-by-bit search would set exactly those: a set bit keeps all n keys >= t, a clear one
// none). t = that prefix, top = the highest bit where lo and hi differ; false when lo == hi
// (then t is the answer). The scores of one query share their sign and most exponent bits: a
// quarter or more of the 32 counting passes.
inline bool common_prefix(uint32_t lo, uint32_t hi, uint32_t& t, int& top) {
  if (lo >= hi) {
    t = hi;
    return false;
  }
  top = 31 - __builtin_clz(lo ^ hi);
  t = top == 31 ? 0u : hi & ~((2u << top) - 1);
  return true;
}

#ifdef RECSERVE_AVX512_BUILD
// The kept-th largest of asc[0..n) (1 <= kept <= n): the largest t with at least kept values >= t,
// found bit by bit from the top, each bit one branch-free counting pass (nth_element's partitions
// mispredicted about every other element: ~30 % of a batched scan at 300 candidates a query).
inline uint32_t kth_largest(const uint32_t* asc, int64_t n, int64_t kept) {
  const __mmask16 last = __mmask16((1u << (n % 16)) - 1);
  __m512i lo = _mm512_set1_epi32(-1), hi = _mm512_setzero_si512();
  int64_t i0 = 0;
  for (; i0 + 16 <= n; i0 += 16) {
    const __m512i v = _mm512_loadu_si512(asc + i0);
    lo = _mm512_min_epu32(lo, v), hi = _mm512_max_epu32(hi, v);
  }
  if (i0 < n) {
    lo = _mm512_mask_min_epu32(lo, last, lo, _mm512_maskz_loadu_epi32(last, asc + i0));
    hi = _mm512_mask_max_epu32(hi, last, hi, _mm512_maskz_loadu_epi32(last, asc + i0));
  }
  uint32_t t;
  int top;
  if (!common_prefix(_mm512_reduce_min_epu32(lo), _mm512_reduce_max_epu32(hi), t, top)) return t;
  const __m512i one = _mm512_set1_epi32(1);
  for (int bit = top; bit >= 0; --bit) {
    const uint32_t c = t | (1u << bit);
    const __m512i cv = _mm512_set1_epi32(static_cast<int>(c));
    // counts in lanes (a masked add a compare), summed once: a mask's popcount and a scalar add
    // each compare had made the count's dependency chain the loop's
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      acc = _mm512_mask_add_epi32(acc, _mm512_cmpge_epu32_mask(_mm512_loadu_si512(asc + i), cv), acc, one);
    if (i < n)
      acc = _mm512_mask_add_epi32(acc, _mm512_mask_cmpge_epu32_mask(last, _mm512_maskz_loadu_epi32(last, asc + i), cv), acc, one);
    if (_mm512_reduce_add_epi32(acc) >= kept) t = c;
  }
  return t;
}

// keys[0..n), all distinct, into out in ascending order: each key's rank is the count of smaller
// keys (n^2 / 8 compares, no branch on the data; below kRankSortMax it beats std::sort's mispredicts).
inline void rank_sort_keys(const uint64_t* keys, int64_t n, uint64_t* out) {
  const __mmask8 last = __mmask8((1u << (n % 8)) - 1);
  const __m512i one = _mm512_set1_epi64(1);
  for (int64_t i = 0; i < n; ++i) {
    const __m512i ki = _mm512_set1_epi64(static_cast<long long>(keys[i]));
    __m512i acc = _mm512_setzero_si512();  // counts in lanes, as in kth_largest
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      acc = _mm512_mask_add_epi64(acc, _mm512_cmplt_epu64_mask(_mm512_loadu_si512(keys + j), ki), acc, one);
    if (j < n)
      acc = _mm512_mask_add_epi64(acc, _mm512_mask_cmplt_epu64_mask(last, _mm512_maskz_loadu_epi64(last, keys + j), ki), acc, one);
    out[_mm512_reduce_add_epi64(acc)] = keys[i];
  }
}
#elif defined(__AVX2__)
// kth_largest on a build for AVX2 CPUs: 8 keys a compare. nth_element in its place was 13 % of a
// batch there (and its sort 5 %).
inline uint32_t kth_largest(const uint32_t* asc, int64_t n, int64_t kept) {
  __m256i lo = _mm256_set1_epi32(-1), hi = _mm256_setzero_si256();
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(asc + i0));
    lo = _mm256_min_epu32(lo, v), hi = _mm256_max_epu32(hi, v);
  }
  alignas(32) uint32_t l8[8], h8[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l8), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(h8), hi);
  uint32_t lo1 = *std::min_element(l8, l8 + 8), hi1 = *std::max_element(h8, h8 + 8);
  for (; i0 < n; ++i0) lo1 = std::min(lo1, asc[i0]), hi1 = std::max(hi1, asc[i0]);
  uint32_t t;
  int top;
  if (!common_prefix(lo1, hi1, t, top)) return t;
  for (int bit = top; bit >= 0; --bit) {
    const uint32_t c = t | (1u << bit);
    const __m256i cv = _mm256_set1_epi32(static_cast<int>(c));
    // a >= c (unsigned) as max(a, c) == a: -1 in a lane, subtracted from counts kept in lanes and
    // summed once (a movemask, popcount and scalar add a compare had been the loop's chain)
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(asc + i));
      acc = _mm256_sub_epi32(acc, _mm256_cmpeq_epi32(_mm256_max_epu32(a, cv), a));
    }
    int64_t count = sum_lanes_epi32(acc);
    for (; i < n; ++i) count += asc[i] >= c;
    if (count >= kept) t = c;
  }
  return t;
}

// rank_sort_keys on a build for AVX2 CPUs: 4 keys a compare (signed, on keys with the sign bit
// flipped). A std::sort of the kept keys in its place was 10 % of a 256-d batch there (mispredicts).
// The keys are flipped once into a copy padded to 4 with the largest key (never below another),
// and counts stay in lanes, summed once a key (see kth_largest). n <= kRankSortMax.
inline void rank_sort_keys(const uint64_t* keys, int64_t n, uint64_t* out) {
  alignas(32) int64_t flipped[kRankSortMax + 3];
  const int64_t n4 = (n + 3) & ~int64_t(3);
  for (int64_t j = 0; j < n; ++j) flipped[j] = static_cast<int64_t>(keys[j] ^ 0x8000000000000000ull);
  for (int64_t j = n; j < n4; ++j) flipped[j] = INT64_MAX;
  for (int64_t i = 0; i < n; ++i) {
    const __m256i ki = _mm256_set1_epi64x(flipped[i]);
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = 0; j < n4; j += 4)
      acc = _mm256_sub_epi64(acc, _mm256_cmpgt_epi64(ki, _mm256_load_si256(reinterpret_cast<const __m256i*>(flipped + j))));
    const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    out[_mm_cvtsi128_si64(two) + _mm_extract_epi64(two, 1)] = keys[i];
  }
}
#endif

#if defined(RECSERVE_AVX512_BUILD) || defined(__AVX2__)
// How many of hi[0..n8) are below v (n8 a multiple of the vector width; signed).
inline int64_t count_below(const int32_t* hi, int64_t n8, int32_t v) {
#ifdef RECSERVE_AVX512_BUILD
  const __m512i vv = _mm512_set1_epi32(v), one = _mm512_set1_epi32(1);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t j = 0; j < n8; j += 16)
    acc = _mm512_mask_add_epi32(acc, _mm512_cmplt_epi32_mask(_mm512_load_si512(hi + j), vv), acc, one);
  return _mm512_reduce_add_epi32(acc);
#else
  const __m256i vv = _mm256_set1_epi32(v);
  __m256i acc = _mm256_setzero_si256();
  for (int64_t j = 0; j < n8; j += 8)
    acc = _mm256_sub_epi32(acc, _mm256_cmpgt_epi32(vv, _mm256_load_si256(reinterpret_cast<const __m256i*>(hi + j))));
  return sum_lanes_epi32(acc);
#endif
}

// keys[0..n), all distinct, into out in ascending order (n <= kRankSortMax). Ranked first by
// their upper halves (a candidate's score): twice the keys a compare of rank_sort_keys. Equal
// halves (equal scores) rank alike, so a rank taken twice sends the whole sort to rank_sort_keys.
inline void rank_sort(const uint64_t* keys, int64_t n, uint64_t* out) {
  constexpr int64_t kWidth = 16;  // the padding: a multiple of either build's lane count
  alignas(64) int32_t hi[kRankSortMax + kWidth];
  const int64_t n8 = (n + kWidth - 1) / kWidth * kWidth;
  for (int64_t j = 0; j < n; ++j) hi[j] = static_cast<int32_t>(uint32_t(keys[j] >> 32) ^ 0x80000000u);
  for (int64_t j = n; j < n8; ++j) hi[j] = INT32_MAX;  // never below another
  bool taken[kRankSortMax] = {};
  bool again = false;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t rank = count_below(hi, n8, hi[i]);
    again |= taken[rank];
    taken[rank] = true;
    out[rank] = keys[i];
  }
  if (again) rank_sort_keys(keys, n, out);
}
#endif

// The score's bits, order-preserving as an unsigned integer (higher score, higher key); -0 as +0.
inline uint32_t ascending_bits(float score) {
  uint32_t bits;
  const float s = score + 0.0f;
  std::memcpy(&bits, &s, 4);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// A candidate as one integer that sorts in BetterFirst's order: the score's ascending bits flipped
// (higher first) above the position (lower first). Integer compares have no branch on ties (perf:
// the pair selection was 19 % of a one-query scan). Positions must be below 2^32.
inline uint64_t best_first_key(float score, int64_t pos) {
  return (uint64_t(~ascending_bits(score)) << 32) | uint64_t(pos);
}

// The candidate a best_first_key stands for, its score bit for bit (a -0 reads as +0: the same value).
inline Cand from_key(uint64_t key) {
  const uint32_t ascending = ~uint32_t(key >> 32);
  const uint32_t bits = ascending & 0x80000000u ? ascending & 0x7FFFFFFFu : ~ascending;
  float score;
  std::memcpy(&score, &bits, 4);
  return Cand(score, int64_t(key & 0xFFFFFFFFu));
}

// Scratch of keep_best, owned by the caller's thread (a thread_local in this library is looked up
// again through __tls_get_addr inside every loop that calls out: 13 % of a one-query select).
struct SelectScratch {
  std::vector<uint64_t> keys, sorted;
  std::vector<uint32_t> asc, pos;
  std::vector<int64_t> ties;
};

// The best r of cands, best first. Cheaper than the bounded heap where most candidates would enter
// it (r a large share of them). With AVX-512 or AVX2: the r-th best score by kth_largest, the
// candidates above it and the lowest positions at it (the ties a selection keeps), then rank_sort
// of those kept. Elsewhere: nth_element, then a sort. Both give the same candidates in the same
// order.
inline void keep_best(std::vector<Cand>& cands, int64_t r, SelectScratch& scratch) {
  const int64_t n = (int64_t)cands.size(), kept = std::min<int64_t>(r, n);
  if (std::any_of(cands.begin(), cands.end(), [](const Cand& c) { return uint64_t(c.second) >> 32; })) {
    if (kept < n) std::nth_element(cands.begin(), cands.begin() + kept, cands.end(), BetterFirst());
    cands.resize(kept);
    std::sort(cands.begin(), cands.end(), BetterFirst());
    return;
  }
  std::vector<uint64_t>&keys = scratch.keys, &sorted = scratch.sorted;
  keys.resize(n);
#if defined(RECSERVE_AVX512_BUILD) || defined(__AVX2__)
  if (kept >= 1 && kept <= kRankSortMax) {
    std::vector<uint32_t>& asc = scratch.asc;
    std::vector<int64_t>& ties = scratch.ties;
    asc.resize(n);
    for (int64_t i = 0; i < n; ++i) asc[i] = ascending_bits(cands[i].first);
    const uint32_t t = kth_largest(asc.data(), n, kept);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {  // those above t, without a branch on each
      keys[m] = (uint64_t(~asc[i]) << 32) | uint64_t(cands[i].second);
      m += asc[i] > t;
    }
    ties.clear();
    for (int64_t i = 0; i < n; ++i)
      if (asc[i] == t) ties.push_back(cands[i].second);
    std::sort(ties.begin(), ties.end());  // at the cut, the lower positions
    for (int64_t i = 0; m < kept; ++i) keys[m++] = (uint64_t(~t) << 32) | uint64_t(ties[i]);
    sorted.resize(kept);
    rank_sort(keys.data(), kept, sorted.data());
    cands.resize(kept);
    for (int64_t i = 0; i < kept; ++i) cands[i] = from_key(sorted[i]);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) keys[i] = best_first_key(cands[i].first, cands[i].second);
  if (kept < n) std::nth_element(keys.begin(), keys.begin() + kept, keys.end());
  std::sort(keys.begin(), keys.begin() + kept);
  cands.resize(kept);
  for (int64_t i = 0; i < kept; ++i) cands[i] = from_key(keys[i]);
}

#ifdef RECSERVE_AVX512_BUILD
// The best k (1 <= k <= kRankSortMax) of scores pushed a run at a time, in one pass: each run's
// keys (ascending_bits, 16 at a time) at or above a threshold are compress-stored with their
// positions; when the buffer fills, it is cut to its best k (kth_largest, the lowest positions
// among ties at the cut) and the threshold rises to the k-th key. The bounded heap this replaces
// mispredicted on most of its inserts: ~10 us a row of 2,000 scores for k = 100 (perf: 57 % of an
// exact search of 1,000 queries). Same answer as keep_best over every score pushed: the best k,
// the lower position first among equal scores; -inf and scores below `floor` never count.
// Positions must be below 2^32.
class TopStream {
 public:
  TopStream(int64_t k, float floor, SelectScratch& s)
      : k_(k), cap_(std::max<int64_t>(8 * k, 64)), asc_(s.asc), pos_(s.pos), s_(s) {
    asc_.resize(cap_ + 16);
    pos_.resize(cap_ + 16);
    // admit keys >= t_: above -inf's key, and at or above the floor's
    t_ = std::max(ascending_bits(kNegInf) + 1, floor > kNegInf ? ascending_bits(floor) : 0u);
  }

  // Scores s[0..n) at positions pos0 + i.
  void push(const float* s, int64_t n, int64_t pos0) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i tv = _mm512_set1_epi32(static_cast<int>(t_));
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 in = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512i asc = ascending(_mm512_maskz_loadu_ps(in, s + i));
      const __mmask16 keep = _mm512_mask_cmpge_epu32_mask(in, asc, tv);
      if (!keep) continue;
      _mm512_mask_compressstoreu_epi32(asc_.data() + n_, keep, asc);
      const __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(pos0 + i)));
      _mm512_mask_compressstoreu_epi32(pos_.data() + n_, keep, at);
      n_ += __builtin_popcount(keep);
      if (n_ >= cap_) {
        cut(k_);
        tv = _mm512_set1_epi32(static_cast<int>(t_));
      }
    }
  }

  // The best k pushed, best first, into out.
  void finish(std::vector<Cand>& out) {
    out.clear();
    if (n_ == 0) return;
    cut(std::min(k_, n_));
    std::vector<uint64_t>&keys = s_.keys, &sorted = s_.sorted;
    keys.resize(n_);
    sorted.resize(n_);
    for (int64_t i = 0; i < n_; ++i) keys[i] = (uint64_t(~asc_[i]) << 32) | uint64_t(pos_[i]);
    rank_sort(keys.data(), n_, sorted.data());
    for (int64_t i = 0; i < n_; ++i) out.push_back(from_key(sorted[i]));
  }

 private:
  // Order-preserving keys of 16 scores (ascending_bits: -0 as +0).
  static __m512i ascending(__m512 v) {
    const __m512i bits = _mm512_castps_si512(_mm512_add_ps(v, _mm512_setzero_ps()));
    const __m512i flip = _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(INT32_MIN));
    return _mm512_xor_si512(bits, flip);
  }

  // The buffer cut to its best `kept` (<= n_): those above the kept-th key, then the lowest
  // positions at it; later keys must reach it. Order in the buffer is not kept.
  void cut(int64_t kept) {
    if (kept == n_) return;  // all of them (finish with fewer than k)
    const uint32_t t = kth_largest(asc_.data(), n_, kept);
    std::vector<int64_t>& ties = s_.ties;
    ties.clear();
    for (int64_t i = 0; i < n_; ++i)
      if (asc_[i] == t) ties.push_back(pos_[i]);
    int64_t m = 0;
    for (int64_t i = 0; i < n_; ++i) {  // those above t, without a branch on each
      asc_[m] = asc_[i];
      pos_[m] = pos_[i];
      m += asc_[i] > t;
    }
    if (m + (int64_t)ties.size() > kept) std::sort(ties.begin(), ties.end());
    for (int64_t i = 0; m < kept; ++i, ++m) asc_[m] = t, pos_[m] = uint32_t(ties[i]);
    n_ = kept;
    t_ = t;
  }

  const int64_t k_, cap_;
  std::vector<uint32_t>&asc_, &pos_;
  SelectScratch& s_;
  int64_t n_ = 0;
  uint32_t t_;
};
#endif

void select_top(const Index& ix, const Batch& bt, const Plan& pl, const float* buf, int64_t r,
                int64_t* out_pos, float* out_score) {
  // TopStream where r <= kRankSortMax (an AVX-512 build). Elsewhere: where a query's candidates
  // are few for r (at most kSelectShare * r: one query probing a few short lists for K = 100), most
  // would pass through the heap: keep_best costs less, as in topk_rows. Equal scores at the cut:
  // the lower row first (the heap keeps the first pushed).
#ifdef RECSERVE_AVX512_BUILD
  const bool stream = r <= kRankSortMax && ix.offsets[ix.nlist] <= (int64_t(1) << 32);
#else
  const bool stream = false;
#endif
  at::parallel_for(bt.b0, bt.b1, 1, [&](int64_t q0, int64_t q1) {
    std::vector<Cand> heap;
    SelectScratch scratch;
    heap.reserve(std::min<int64_t>(r, 1 << 16));
    for (int64_t b = q0; b < q1; ++b) {
      heap.clear();
      // Below the floor nothing can change the answer; at it, a lower position still can.
      const float floor_ = bt.floor ? bt.floor[b] : kNegInf;
      int64_t candidates = 0;
      for (int64_t p = 0; p < bt.p; ++p) {
        const int64_t l = bt.probes[b * bt.p + p];
        if (pl.buf_off[(b - bt.b0) * bt.p + p] >= 0) candidates += ix.offsets[l + 1] - ix.offsets[l];
      }
      if (stream) {
#ifdef RECSERVE_AVX512_BUILD
        TopStream top(r, floor_, scratch);
        for (int64_t p = 0; p < bt.p; ++p) {
          const int64_t off = pl.buf_off[(b - bt.b0) * bt.p + p];
          if (off < 0) continue;
          const int64_t l = bt.probes[b * bt.p + p], i0 = ix.offsets[l];
          top.push(buf + off, ix.offsets[l + 1] - i0, i0);
        }
        top.finish(heap);
#endif
      } else if (candidates <= kSelectShare * r) {
        for (int64_t p = 0; p < bt.p; ++p) {
          const int64_t off = pl.buf_off[(b - bt.b0) * bt.p + p];
          if (off < 0) continue;
          const int64_t l = bt.probes[b * bt.p + p], i0 = ix.offsets[l], n = ix.offsets[l + 1] - i0;
          for (int64_t i = 0; i < n; ++i)
            if (buf[off + i] > kNegInf && buf[off + i] >= floor_) heap.emplace_back(buf[off + i], i0 + i);
        }
        keep_best(heap, r, scratch);
      } else {
        float worst = floor_ > kNegInf ? std::nextafter(floor_, kNegInf) : kNegInf;
        for (int64_t p = 0; p < bt.p; ++p) {
          const int64_t off = pl.buf_off[(b - bt.b0) * bt.p + p];
          if (off < 0) continue;
          const int64_t l = bt.probes[b * bt.p + p], i0 = ix.offsets[l];
          push_scores(buf + off, ix.offsets[l + 1] - i0, i0, r, heap, worst);
        }
        std::sort_heap(heap.begin(), heap.end(), MinFirst());  // best first
      }
      for (int64_t k = 0; k < r; ++k) {
        const bool have = k < (int64_t)heap.size();
        out_pos[b * r + k] = have ? heap[k].second : -1;
        out_score[b * r + k] = have ? heap[k].first : kNegInf;
      }
    }
  });
}

// Score buffer reused across calls (uninitialized: every slot read is written first).
float* scratch(int64_t floats) {
  static thread_local std::unique_ptr<float[]> buf;
  static thread_local int64_t cap = 0;
  if (floats > cap) {
    cap = std::max<int64_t>(floats, cap * 2);
    buf.reset(new float[cap]);
  }
  return buf.get();
}

// Cuts the batch into chunks whose score buffer stays bounded, then plans, scores and selects.
template <typename MakeScorer>
void scan(const Index& ix, Batch bt_all, int64_t r, int64_t* out_pos, float* out_score, MakeScorer make_scorer) {
  int64_t chunk = 1;  // one query is one chunk, whatever its lists hold: no pass over every list
  if (bt_all.b1 - bt_all.b0 > 1) {
    int64_t max_list = 1;
    for (int64_t l = 0; l < ix.nlist; ++l) max_list = std::max(max_list, ix.offsets[l + 1] - ix.offsets[l]);
    chunk = std::max<int64_t>(1, kMaxBufferFloats / std::max<int64_t>(1, bt_all.p * max_list));
  }
  for (int64_t b0 = bt_all.b0; b0 < bt_all.b1; b0 += chunk) {
    Batch bt = bt_all;
    bt.b0 = b0;
    bt.b1 = std::min(bt_all.b1, b0 + chunk);
    const Plan pl = plan_chunk(ix, bt);
    float* buf = scratch(pl.buf_size);
    score_pairs(ix, bt, pl, buf, make_scorer);
    select_top(ix, bt, pl, buf, r, out_pos, out_score);
  }
}

struct Checked {
  Index ix;
  Batch bt;
  at::Tensor out_pos, out_score;
};

Checked check(int64_t b_count, int64_t n, const at::Tensor& probes, const at::Tensor& coarse,
              const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
              const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& excl, int64_t r) {
  TORCH_CHECK(r >= 1, "r must be >= 1");
  TORCH_CHECK(probes.dim() == 2 && probes.size(0) == b_count && probes.scalar_type() == at::kLong, "probes must be int64 [B, P]");
  TORCH_CHECK(coarse.sizes() == probes.sizes() && coarse.scalar_type() == at::kFloat, "coarse must be float32 [B, P]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.scalar_type() == at::kBFloat16, "scales must be bfloat16 [N]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 2 && offsets.scalar_type() == at::kLong, "offsets must be int64 [nlist + 1]");
  TORCH_CHECK(sig.dim() == 2 && sig.size(0) == n && sig.scalar_type() == at::kLong, "sig must be int64 [N, W]");
  TORCH_CHECK(fmask.dim() == 3 && fmask.size(0) == b_count && fmask.size(2) == sig.size(1) && fmask.scalar_type() == at::kLong,
              "filter masks must be int64 [B, C, W]");
  TORCH_CHECK(fneg.dim() == 2 && fneg.size(0) == b_count && fneg.size(1) == fmask.size(1) && fneg.scalar_type() == at::kBool,
              "filter negations must be bool [B, C]");
  TORCH_CHECK(excl.dim() == 2 && excl.size(0) == b_count && excl.scalar_type() == at::kLong,
              "exclusions must be int64 [B, S], ascending per row");
  for (const at::Tensor* t : {&probes, &coarse, &scales, &offsets, &sig, &fmask, &fneg, &excl})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "ivf_scan inputs must be contiguous CPU tensors");
  const int64_t nlist = offsets.size(0) - 1;
  // read through raw pointers: an ATen op and .item() per check cost ~10 us of a one-query scan
  TORCH_CHECK(offsets.data_ptr<int64_t>()[nlist] == n, "offsets[-1] must equal N");
  const int64_t* pp = probes.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(pp, pp + probes.numel(), [nlist](int64_t l) { return l < nlist; }),
              "probe ids must be < nlist");
  Checked c{Index{scales.data_ptr<Scale>(), offsets.data_ptr<int64_t>(), nlist, sig.data_ptr<int64_t>(), sig.size(1)},
            Batch{0, b_count, probes.size(1), probes.data_ptr<int64_t>(), coarse.data_ptr<float>(),
                  fmask.data_ptr<int64_t>(), fneg.data_ptr<bool>(), fmask.size(1),
                  excl.data_ptr<int64_t>(), excl.size(1)},
            at::empty({b_count, r}, probes.options()), at::empty({b_count, r}, coarse.options())};
  return c;
}

}  // namespace

// Queries qf [B, D] to int8 rows q8 (stride `stride`, bytes past D left as they are) with a
// per-query scale qs (absmax / 127, round half to even: the same arithmetic as
// retrieval.index.codes.quantize_int8), and each row's code sum qsum (VNNI's offset correction).
void quantize_queries(const float* qf, int64_t b_count, int64_t d, int8_t* q8, int64_t stride, float* qs,
                      int32_t* qsum) {
  at::parallel_for(0, b_count, std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float amax = 0.f;
#ifdef RECSERVE_AVX512_BUILD
      __m512 mx = _mm512_setzero_ps();  // the same maximum: max is exact in any order
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(in, qf + b * d + j)));
      }
      amax = _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__)
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 mx = _mm256_setzero_ps();
      int64_t j0 = 0;
      for (; j0 + 8 <= d; j0 += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(qf + b * d + j0), abs_mask));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      amax = *std::max_element(lanes, lanes + 8);
      for (; j0 < d; ++j0) amax = std::max(amax, std::fabs(qf[b * d + j0]));
#else
      for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(qf[b * d + j]));
#endif
      qs[b] = amax / 127.0f;
      const float safe = qs[b] > 0.f ? qs[b] : 1.f;
      int32_t sum = 0;
      int64_t j = 0;
#ifdef RECSERVE_AVX512_BUILD
      // 16 at a time (a call to nearbyint per element took ~4 ms of a 1000 x 784 batch); the same
      // division, round half to even and clamp, so the same bytes
      const __m512 sv = _mm512_set1_ps(safe), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      __m512i acc = _mm512_setzero_si512();
      for (; j < d; j += 16) {
        const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(in, qf + b * d + j), sv);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i iv = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
        acc = _mm512_add_epi32(acc, iv);
        _mm512_mask_cvtepi32_storeu_epi8(q8 + b * stride + j, in, iv);
      }
      sum = _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)  // 8 at a time, the same arithmetic (a scalar nearbyint was 4 % of a batch)
      const __m256 sv = _mm256_set1_ps(safe), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      __m256i acc = _mm256_setzero_si256();
      for (; j + 8 <= d; j += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(qf + b * d + j), sv);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i iv = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
        acc = _mm256_add_epi32(acc, iv);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q8 + b * stride + j), _mm_packs_epi16(w, w));
      }
      alignas(32) int32_t part[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(part), acc);
      for (int k = 0; k < 8; ++k) sum += part[k];
#endif
      for (; j < d; ++j) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(qf[b * d + j] / safe)));
        q8[b * stride + j] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      qsum[b] = sum;
    }
  });
}

// q: float32 [B, D], quantized here to int8 (quantize_queries); codes: int8 [N, D], list-sorted.
std::tuple<at::Tensor, at::Tensor> ivf_scan_int8(
    const at::Tensor& q, const at::Tensor& probes, const at::Tensor& coarse, const at::Tensor& codes,
    const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask,
    const at::Tensor& fneg, const at::Tensor& excl, int64_t r, const at::Tensor& floor) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == q.size(1) && codes.is_contiguous(),
              "codes must be contiguous int8 [N, D] with the query's D");
  const int64_t b_count = q.size(0), d = q.size(1);
  auto c = check(b_count, codes.size(0), probes, coarse, scales, offsets, sig, fmask, fneg, excl, r);
  const bool floored = floor.defined() && floor.numel() > 0;  // undefined or empty: no floor
  TORCH_CHECK(!floored || (floor.numel() == b_count && floor.scalar_type() == at::kFloat && floor.is_contiguous()),
              "floor must be float32 [B] or empty");
  if (floored) c.bt.floor = floor.data_ptr<float>();
  const Isa isa = int8_isa();
  const int64_t qstride = ((d + 63) / 64) * 64;  // zero-padded rows: SIMD tails read whole words
  std::vector<int8_t> q8(b_count * qstride, 0);
  std::vector<float> qs(b_count);
  std::vector<int32_t> qsum(b_count, 0);
  quantize_queries(q.data_ptr<float>(), b_count, d, q8.data(), qstride, qs.data(), qsum.data());
  const int8_t* cp = codes.data_ptr<int8_t>();
  const Scale* sc = c.ix.scales;
  scan(c.ix, c.bt, r, c.out_pos.data_ptr<int64_t>(), c.out_score.data_ptr<float>(),
       [&] { return Int8Scorer{cp, sc, d, q8.data(), qstride, qs.data(), qsum.data(), isa, {}, {}, false}; });
  return {c.out_pos, c.out_score};
}

#ifdef RECSERVE_AVX512_BUILD
// s0 += v[0:8]^2, s1 += v[8:16]^2, in double (a norm's sum of squares, 16 lanes of it).
inline void accumulate_squares(__m512 v, __m512d& s0, __m512d& s1) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  s0 = _mm512_fmadd_pd(lo, lo, s0);
  s1 = _mm512_fmadd_pd(hi, hi, s1);
}
#elif defined(__AVX2__)
// s0 += v[0:4]^2, s1 += v[4:8]^2, in double (8 lanes of a norm's sum of squares; a float's square
// is exact in double, so each fused add rounds once, as the scalar sum's add does).
inline void accumulate_squares(__m256 v, __m256d& s0, __m256d& s1) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  s0 = _mm256_fmadd_pd(lo, lo, s0);
  s1 = _mm256_fmadd_pd(hi, hi, s1);
}

inline double sum_lanes_pd(__m256d a, __m256d b) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a, b));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
#endif

// The build's codes in one pass, with no float copy of the catalog: row i of the index is item
// order[i] of x [N, D] f32, in list lists[i] (list-sorted); its residual to centroids[lists[i]] is
// quantized as codes.quantize_int8 does (absmax / 127, round half to even, clamp), bit for bit
// -> codes [N, D] int8, scales [N] bf16 (rounded first: the codes use the stored scale),
// and norms [N] f32 = max(|r|, |decoded r|) summed in double
// and rounded up to a float (list_radius is a bound: no rounding may shrink it).
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_int8(const at::Tensor& x, const at::Tensor& order,
                                                           const at::Tensor& lists, const at::Tensor& centroids) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [N, D]");
  TORCH_CHECK(centroids.dim() == 2 && centroids.size(1) == x.size(1) && centroids.scalar_type() == at::kFloat &&
              centroids.is_contiguous(), "centroids must be contiguous float32 [L, D] with x's D");
  TORCH_CHECK(order.dim() == 1 && lists.sizes() == order.sizes() && order.scalar_type() == at::kLong &&
              lists.scalar_type() == at::kLong && order.is_contiguous() && lists.is_contiguous(),
              "order and lists must be contiguous int64 [N]");
  const int64_t n = order.numel(), d = x.size(1), nx = x.size(0), nlist = centroids.size(0);
  const int64_t* op = order.data_ptr<int64_t>();
  const int64_t* lp = lists.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(op[i] >= 0 && op[i] < nx && lp[i] >= 0 && lp[i] < nlist, "order or lists out of range at ", i);
  auto codes = at::empty({n, d}, x.options().dtype(at::kChar));
  auto scales = at::empty({n}, x.options().dtype(at::kBFloat16));
  auto norms = at::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = centroids.data_ptr<float>();
  int8_t* out = codes.data_ptr<int8_t>();
  Scale* sp = scales.data_ptr<Scale>();
  float* np_ = norms.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    std::vector<float> r(d);
    for (int64_t i = i0; i < i1; ++i) {
      const float* xi = xp + op[i] * d;
      const float* c = cp + lp[i] * d;
      float amax = 0.f;
      double exact = 0.0;
      int64_t j = 0;
#ifdef RECSERVE_AVX512_BUILD
      // 16 at a time (one serial double sum per element had been most of the build's encode):
      // the same differences and maximum; the double sums in 8-lane partial sums
      {
        __m512 mx = _mm512_setzero_ps();
        __m512d s0 = _mm512_setzero_pd(), s1 = s0;
        for (; j < d; j += 16) {
          const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
          const __m512 rv = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, xi + j), _mm512_maskz_loadu_ps(in, c + j));
          _mm512_mask_storeu_ps(r.data() + j, in, rv);
          mx = _mm512_max_ps(mx, _mm512_abs_ps(rv));
          accumulate_squares(rv, s0, s1);
        }
        amax = _mm512_reduce_max_ps(mx);
        exact = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
      }
#elif defined(__AVX2__)
      {  // 8 at a time, the same (scalar encode loops were 7.5 % of an AVX2 build of 19k x 300)
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        for (; j + 8 <= d; j += 8) {
          const __m256 rv = _mm256_sub_ps(_mm256_loadu_ps(xi + j), _mm256_loadu_ps(c + j));
          _mm256_storeu_ps(r.data() + j, rv);
          mx = _mm256_max_ps(mx, _mm256_and_ps(rv, abs_mask));
          accumulate_squares(rv, s0, s1);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        amax = *std::max_element(lanes, lanes + 8);
        exact = sum_lanes_pd(s0, s1);
      }
#endif
      for (; j < d; ++j) {
        r[j] = xi[j] - c[j];
        amax = std::max(amax, std::fabs(r[j]));
        exact += double(r[j]) * r[j];
      }
      const Scale stored(amax / 127.0f);  // round to nearest even, as torch's .bfloat16()
      const float scale = float(stored);
      const float safe = scale > 0.f ? scale : 1.f;
      double decoded = 0.0;
      int8_t* code = out + i * d;
      j = 0;
#ifdef RECSERVE_AVX512_BUILD
      {  // the same division, round half to even and clamp as below, so the same bytes
        const __m512 sv = _mm512_set1_ps(safe), back = _mm512_set1_ps(scale);
        const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        __m512d s0 = _mm512_setzero_pd(), s1 = s0;
        for (; j < d; j += 16) {
          const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
          __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(in, r.data() + j), sv);
          v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          _mm512_mask_cvtepi32_storeu_epi8(code + j, in, _mm512_cvtps_epi32(v));
          accumulate_squares(_mm512_mul_ps(v, back), s0, s1);
        }
        decoded = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
      }
#elif defined(__AVX2__)
      {  // the same division, round half to even and clamp as below, so the same bytes
        const __m256 sv = _mm256_set1_ps(safe), back = _mm256_set1_ps(scale);
        const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        for (; j + 8 <= d; j += 8) {
          __m256 v = _mm256_div_ps(_mm256_loadu_ps(r.data() + j), sv);
          v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          const __m256i iv = _mm256_cvtps_epi32(v);
          const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(code + j), _mm_packs_epi16(c16, c16));
          accumulate_squares(_mm256_mul_ps(v, back), s0, s1);
        }
        decoded = sum_lanes_pd(s0, s1);
      }
#endif
      for (; j < d; ++j) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(r[j] / safe)));
        code[j] = static_cast<int8_t>(v);
        const float back = v * scale;
        decoded += double(back) * back;
      }
      const double norm = std::sqrt(std::max(exact, decoded));
      float up = static_cast<float>(norm);
      if (double(up) < norm) up = std::nextafter(up, std::numeric_limits<float>::infinity());
      sp[i] = stored;
      np_[i] = up;
    }
  });
  return {codes, scales, norms};
}

// The inverted index over filter bits: sig [N, W] int64 -> counts [W*64] int64 (items setting each
// bit) and postings [nnz] int32 (the items of bit 0, then bit 1, ..., each ascending). Two passes
// over the words: count, then place (a counting sort by bit).
std::tuple<at::Tensor, at::Tensor> bit_index(const at::Tensor& sig) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous() && sig.device().is_cpu(),
              "sig must be contiguous CPU int64 [N, W]");
  const int64_t n = sig.size(0), w = sig.size(1), bits = w * 64;
  TORCH_CHECK(n < (int64_t(1) << 31), "postings hold int32 positions: at most 2**31 - 1 items");
  const uint64_t* sp = reinterpret_cast<const uint64_t*>(sig.data_ptr<int64_t>());
  auto counts = at::zeros({bits}, sig.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < n * w; ++i)
    for (uint64_t word = sp[i]; word; word &= word - 1) ++cp[(i % w) * 64 + __builtin_ctzll(word)];
  std::vector<int64_t> next(bits + 1, 0);
  for (int64_t b = 0; b < bits; ++b) next[b + 1] = next[b] + cp[b];
  auto postings = at::empty({next[bits]}, sig.options().dtype(at::kInt));
  int32_t* pp = postings.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < w; ++j)
      for (uint64_t word = sp[i * w + j]; word; word &= word - 1) pp[next[j * 64 + __builtin_ctzll(word)]++] = int32_t(i);
  return {counts, postings};
}

// Positions pos [B, k] int64 (-1 pads) -> item ids [B, k] (-1 pads) through item_ids [N] int64, in one
// parallel pass (NumPy's gather and where over a 1,000 x 100 batch were ~6 % of a 256-d search).
at::Tensor ids_of_positions(const at::Tensor& pos, const at::Tensor& item_ids) {
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.device().is_cpu(),
              "pos must be contiguous CPU int64");
  TORCH_CHECK(item_ids.dim() == 1 && item_ids.scalar_type() == at::kLong && item_ids.is_contiguous(),
              "item_ids must be contiguous int64 [N]");
  auto out = at::empty_like(pos);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* ip = item_ids.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = item_ids.numel();
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, pos.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = pp[i];
      if (p >= n) bad.store(i, std::memory_order_relaxed);
      op[i] = p < 0 ? p : ip[p < n ? p : 0];
    }
  });
  TORCH_CHECK(bad.load() < 0, "position out of range at flat index ", bad.load(), " (", n, " items)");
  return out;
}

// The checks shared by the calls that read chosen rows of the int8 codes: pos [M] int64 rows in
// range, codes [N, D] int8, scales [N] bf16, offsets [L + 1] int64, all contiguous.
void check_rows_of_codes(const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes must be contiguous int8 [N, D]");
  TORCH_CHECK(pos.dim() == 1 && pos.scalar_type() == at::kLong && pos.is_contiguous(), "pos must be contiguous int64 [M]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == codes.size(0) && scales.scalar_type() == at::kBFloat16 &&
              scales.is_contiguous(), "scales must be contiguous bfloat16 [N]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 2 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "offsets must be contiguous int64 [L + 1]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t n = codes.size(0);
  for (int64_t i = 0; i < pos.numel(); ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < n, "pos out of range at ", i);
}

// Exact-plan scores of chosen rows, read off the int8 codes without decoding them: q [B, D] f32,
// pos [M] int64 (list-sorted rows), coarse [B, L] = q·centroids -> [B, M] f32,
//     score[b, m] = (q[b] · code[pos[m]]) * scale[pos[m]] + coarse[b, list of pos[m]]
// (the float query against the codes, as IVFIndex.scores_at's torch ops compute it, with no
// [M, D] float copy of the gathered codes). Parallel over the rows.
at::Tensor score_rows_int8(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                           const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& coarse) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  check_rows_of_codes(pos, codes, scales, offsets);
  TORCH_CHECK(codes.size(1) == q.size(1), "codes must have the query's D");
  const int64_t b_count = q.size(0), d = q.size(1), m = pos.numel(), nlist = offsets.size(0) - 1;
  TORCH_CHECK(coarse.dim() == 2 && coarse.size(0) == b_count && coarse.size(1) == nlist &&
              coarse.scalar_type() == at::kFloat && coarse.is_contiguous(), "coarse must be contiguous float32 [B, L]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  auto out = at::empty({b_count, m}, q.options());
  const float* qp = q.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const Scale* sp = scales.data_ptr<Scale>();
  const float* co = coarse.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef RECSERVE_X86
  const bool avx2 = int8_isa() != Isa::kPortable && __builtin_cpu_supports("fma");
#endif
  // ~50 ns a row and query: a thread team (woken, then spinning after) pays off past ~4k rows
  at::parallel_for(0, m, std::max<int64_t>(1, 4096 / std::max<int64_t>(b_count, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = pp[i];
      const int64_t list = std::upper_bound(off, off + nlist + 1, row) - off - 1;
      const int8_t* c = cp + row * d;
      for (int64_t b = 0; b < b_count; ++b) {
        const float* qb = qp + b * d;
#ifdef RECSERVE_X86
        const float acc = avx2 ? dot_f32_i8_avx2(qb, c, d) : dot_f32_i8_portable(qb, c, d);
#else
        const float acc = dot_f32_i8_portable(qb, c, d);
#endif
        op[b * m + i] = acc * float(sp[row]) + co[b * nlist + list];
      }
    }
  });
  return out;
}

// Many queries' scores of chosen rows (the exact plan's, B > a few), as the list scan scores them:
// q [B, D] f32, pos [M], centroids_t [D, L] -> [B, M] f32 = q·c[list] + scale * qscale[b] * dot,
// the query quantized as the scan quantizes it (quantize_queries), every dot from one int8 GEMM
// (at::_int_mm: 3-4x the float matmul of decoded rows it replaces, and no [M, D] float copy), q·c
// as the probe computes it (centroid_dots), the scores written over the int32 dots: into
// `into` (int32, at least B x M elements, reused by the caller: a fresh [B, M] costs its page
// faults, ~10 ms of a 38 MB result) or, undefined, a new tensor.
at::Tensor centroid_dots(const at::Tensor& q, const at::Tensor& centroids_t);

at::Tensor gemm_rows_int8_into(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                               const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& centroids_t,
                               const at::Tensor& into) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  check_rows_of_codes(pos, codes, scales, offsets);
  TORCH_CHECK(codes.size(1) == q.size(1), "codes must have the query's D");
  const int64_t b_count = q.size(0), d = q.size(1), m = pos.numel(), nlist = offsets.size(0) - 1;
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(0) == d && centroids_t.size(1) == nlist &&
              centroids_t.scalar_type() == at::kFloat, "centroids_t must be float32 [D, L]");
  if (b_count == 0 || m == 0) return at::empty({b_count, m}, q.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const Scale* sp = scales.data_ptr<Scale>();
  // runs of rows in one list (pos ascending: a run per list), and every row's scale as a float
  std::vector<int64_t> run_start, run_list;
  std::vector<float> scale(m);
  for (int64_t i = 0, prev = -1; i < m; ++i) {
    const int64_t l = std::upper_bound(off, off + nlist + 1, pp[i]) - off - 1;
    if (l != prev) run_start.push_back(i), run_list.push_back(l), prev = l;
    scale[i] = float(sp[pp[i]]);
  }
  run_start.push_back(m);
  // q·c of every list as the probe computes it: a row's score does not depend on which rows
  // share the call (a chunked scan's and a whole one's agree)
  const at::Tensor coarse = centroid_dots(q, centroids_t);  // [B, L]
  auto q8 = at::empty({b_count, d}, codes.options());
  std::vector<float> qs(b_count);
  std::vector<int32_t> qsum(b_count);
  quantize_queries(q.data_ptr<float>(), b_count, d, q8.data_ptr<int8_t>(), d, qs.data(), qsum.data());
  at::Tensor dots = into.defined() ? into.flatten().narrow(0, 0, b_count * m).view({b_count, m})
                                   : at::empty({b_count, m}, q.options().dtype(at::kInt));
  at::_int_mm_out(dots, q8, codes.index_select(0, pos).t());
  at::Tensor out = dots.view(at::kFloat);  // [B, M], scores over the dots
  float* op = out.data_ptr<float>();
  const float* cp = coarse.data_ptr<float>();
  at::parallel_for(0, b_count, std::max<int64_t>(1, 16384 / m), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* row = op + b * m;
      const float* base = cp + b * nlist;
      const float qscale = qs[b];
      for (size_t r = 0; r + 1 < run_start.size(); ++r) {
        const float c = base[run_list[r]];
        for (int64_t i = run_start[r]; i < run_start[r + 1]; ++i) {
          int32_t dot;
          std::memcpy(&dot, row + i, 4);
          row[i] = c + scale[i] * qscale * float(dot);
        }
      }
    }
  });
  return out;
}


// Float vectors of chosen rows, decoded in one pass: pos [M] int64, codes [N, D] int8, scales [N],
// offsets [L + 1], centroids_t [D, L] f32 (the index keeps its centroids in the probe's layout
// only) -> [M, D] f32, row m = centroid[list] + scale * code. A list's centroid is gathered once
// per run of its rows (pos ascending: once per list a thread meets).
at::Tensor decode_rows_int8(const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& offsets, const at::Tensor& centroids_t) {
  check_rows_of_codes(pos, codes, scales, offsets);
  const int64_t d = codes.size(1), m = pos.numel(), nlist = offsets.size(0) - 1;
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(1) == nlist && centroids_t.size(0) == d &&
              centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous(),
              "centroids_t must be contiguous float32 [D, L]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  auto out = at::empty({m, d}, centroids_t.options());
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const Scale* sp = scales.data_ptr<Scale>();
  const float* ct = centroids_t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> cen(d);
    int64_t have = -1;  // the list whose centroid cen holds
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = pp[i];
      const int64_t list = std::upper_bound(off, off + nlist + 1, row) - off - 1;
      if (list != have) {
        for (int64_t j = 0; j < d; ++j) cen[j] = ct[j * nlist + list];
        have = list;
      }
      const int8_t* c = cp + row * d;
      const float s = float(sp[row]);
      float* o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] = cen[j] + s * float(c[j]);
    }
  });
  return out;
}

// Below this many rows or dimensions, the int8 GEMM's other costs (the queries quantized, the
// lists' q·c, its epilogue over [B, M]) outweigh its faster dots: decoded rows and a float matmul
// cost less (measured at B = 16 and 1000: parity near 512-768 rows at 300-d and 784-d; at 64-d
// the float path stayed ahead up to 4096 rows).
constexpr int64_t kGemmRows = 1024, kGemmDims = 128;

// Many queries' scores of chosen rows (IVFIndex.scores_at past a few queries): q [B, D] f32,
// pos [M] -> [B, M] f32, by gemm_rows_int8_into from kGemmRows rows and kGemmDims dimensions
// (into: as it takes it), else q @ decode_rows_int8(pos)^T.
at::Tensor many_rows_int8(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                          const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& centroids_t,
                          const at::Tensor& into) {
  if (pos.numel() >= kGemmRows && q.size(1) >= kGemmDims)
    return gemm_rows_int8_into(q, pos, codes, scales, offsets, centroids_t, into);
  return at::matmul(q, decode_rows_int8(pos, codes, scales, offsets, centroids_t).t()).contiguous();
}

// Which items pass one request's filter: sig [N, W], fmask [C, W], fneg [C] -> bool [N].
at::Tensor filter_mask(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous(), "sig must be contiguous int64 [N, W]");
  TORCH_CHECK(fmask.dim() == 2 && fmask.size(1) == sig.size(1) && fmask.scalar_type() == at::kLong && fmask.is_contiguous(),
              "fmask must be contiguous int64 [C, W]");
  TORCH_CHECK(fneg.dim() == 1 && fneg.size(0) == fmask.size(0) && fneg.scalar_type() == at::kBool && fneg.is_contiguous(),
              "fneg must be bool [C]");
  const int64_t n = sig.size(0), w = sig.size(1), c_count = fmask.size(0);
  auto out = at::empty({n}, sig.options().dtype(at::kBool));
  const int64_t* sp = sig.data_ptr<int64_t>();
  const int64_t* mp = fmask.data_ptr<int64_t>();
  const bool* np = fneg.data_ptr<bool>();
  bool* op = out.data_ptr<bool>();
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) {
    if (w == 1) {  // one signature word (up to 64 attribute values): branch-free, vectorizes
      for (int64_t i = i0; i < i1; ++i) {
        bool ok = true;
        for (int64_t c = 0; c < c_count; ++c) ok &= ((sp[i] & mp[c]) != 0) != np[c];
        op[i] = ok;
      }
      return;
    }
    for (int64_t i = i0; i < i1; ++i) op[i] = passes(sp + i * w, mp, np, c_count, w);
  });
  return out;
}

// q: float32 [B, D]; codes: float8_e4m3fn [N, D] passed as its uint8 bytes, decoded by lut [256].
// Rows passing one filter (sig [N, W], fmask [C, W], fneg [C]) -> int64 [M] ascending. The most
// selective non-negated clause drives: the postings of its bits (bit_counts [W * 64], postings: each
// bit's rows, bit after bit, ascending) are the only candidates, and only they are checked against
// every clause. With no clause under a quarter of the catalog (or no postings), every row is checked.
at::Tensor eligible_rows(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg,
                         const at::Tensor& bit_counts, const at::Tensor& postings) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous(), "sig must be contiguous int64 [N, W]");
  TORCH_CHECK(fmask.dim() == 2 && fmask.size(1) == sig.size(1) && fmask.scalar_type() == at::kLong && fmask.is_contiguous(),
              "fmask must be contiguous int64 [C, W]");
  TORCH_CHECK(fneg.dim() == 1 && fneg.size(0) == fmask.size(0) && fneg.scalar_type() == at::kBool && fneg.is_contiguous(),
              "fneg must be bool [C]");
  const int64_t n = sig.size(0), w = sig.size(1), c_count = fmask.size(0), bits = w * 64;
  TORCH_CHECK(bit_counts.dim() == 1 && bit_counts.size(0) == bits && bit_counts.scalar_type() == at::kLong &&
              bit_counts.is_contiguous(), "bit_counts must be contiguous int64 [W * 64]");
  TORCH_CHECK(postings.dim() == 1 && postings.scalar_type() == at::kInt && postings.is_contiguous(),
              "postings must be contiguous int32 [nnz]");
  const int64_t* counts = bit_counts.data_ptr<int64_t>();
  const int64_t* mp = fmask.data_ptr<int64_t>();
  const bool* np = fneg.data_ptr<bool>();
  auto set = [&](int64_t c, int64_t bit) { return (mp[c * w + bit / 64] >> (bit % 64)) & 1; };
  int64_t best = -1, best_count = n / 4 + 1;
  for (int64_t c = 0; c < c_count; ++c) {
    if (np[c]) continue;
    int64_t count = 0;
    for (int64_t bit = 0; bit < bits; ++bit) count += set(c, bit) ? counts[bit] : 0;
    if (count < best_count) best = c, best_count = count;
  }
  int64_t nnz = 0;
  for (int64_t bit = 0; bit < bits; ++bit) nnz += counts[bit];
  if (best < 0 || postings.numel() != nnz) return filter_mask(sig, fmask, fneg).nonzero().flatten();
  const int32_t* post = postings.data_ptr<int32_t>();
  const int64_t* sp = sig.data_ptr<int64_t>();
  // One bit's postings are ascending rows. Several bits' are merged through a bitmap of the
  // catalog (an item of a multi-valued attribute may sit under more than one), read back in order.
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t start = 0;
  for (int64_t bit = 0; bit < bits; ++bit) {
    if (set(best, bit) && counts[bit] > 0) runs.emplace_back(start, start + counts[bit]);
    start += counts[bit];
  }
  std::vector<int64_t> rows;
  rows.reserve(best_count);
  if (runs.size() == 1) {
    for (int64_t i = runs[0].first; i < runs[0].second; ++i) rows.push_back(post[i]);
  } else if (runs.size() > 1) {
    std::vector<uint64_t> seen((n + 63) / 64, 0);
    for (const auto& [i0, i1] : runs)
      for (int64_t i = i0; i < i1; ++i) seen[post[i] / 64] |= uint64_t(1) << (post[i] % 64);
    for (int64_t word = 0; word < (int64_t)seen.size(); ++word)
      for (uint64_t m = seen[word]; m; m &= m - 1) rows.push_back(word * 64 + __builtin_ctzll(m));
  }
  int64_t kept = 0;
  for (int64_t r : rows)
    if (passes(sp + r * w, mp, np, c_count, w)) rows[kept++] = r;
  auto out = at::empty({kept}, sig.options());
  std::copy(rows.begin(), rows.begin() + kept, out.data_ptr<int64_t>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> ivf_scan_fp8(
    const at::Tensor& q, const at::Tensor& codes_u8, const at::Tensor& lut, const at::Tensor& probes,
    const at::Tensor& coarse, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& excl, int64_t r) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  TORCH_CHECK(codes_u8.dim() == 2 && codes_u8.scalar_type() == at::kByte && codes_u8.size(1) == q.size(1) && codes_u8.is_contiguous(),
              "codes must be contiguous uint8 [N, D] (fp8 bytes) with the query's D");
  TORCH_CHECK(lut.numel() == 256 && lut.scalar_type() == at::kFloat && lut.is_contiguous(), "lut must be float32 [256]");
  const int64_t b_count = q.size(0), d = q.size(1);
  auto c = check(b_count, codes_u8.size(0), probes, coarse, scales, offsets, sig, fmask, fneg, excl, r);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes_u8.data_ptr<uint8_t>();
  const float* lp = lut.data_ptr<float>();
  const Scale* sc = c.ix.scales;
  scan(c.ix, c.bt, r, c.out_pos.data_ptr<int64_t>(), c.out_score.data_ptr<float>(),
       [&] { return Fp8Scorer{cp, sc, d, qp, lp}; });
  return {c.out_pos, c.out_score};
}

#ifdef __AVX2__
// Candidates of row_topk_few at most: past this the bound let too much through.
constexpr size_t kFewCandidates = 64;

// The best 2 <= k <= 8 of a row of m >= 64 (a probe's top lists of all centroid scores), by a bound:
// the 8 lanes' maxima are 8 distinct elements, so the k-th largest of them is at most the row's
// k-th largest, and only elements at or above it can be in the answer (ties at the cut too). Those
// few are sorted by BetterFirst. 1,000 rows of 1,024 random scores, k = 4: 0.74 -> 0.51 ms on an
// AVX2 build (the bounded heap, mispredicting on its pushes), 1.16 -> 0.29 ms on an AVX-512 one
// (TopStream). (k = 1 keeps those: the heap's filter is an argmax.) False (the caller selects)
// when more than kFewCandidates pass, or the bound is -inf.
inline bool row_topk_few(const float* row, int64_t m, int64_t k, std::vector<Cand>& heap) {
  __m256 mx = _mm256_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  std::sort(lanes, lanes + 8, std::greater<float>());
  const float bound = lanes[k - 1];
  if (!(bound > kNegInf)) return false;
  heap.clear();
  const __m256 bv = _mm256_set1_ps(bound);
  for (i = 0; i + 8 <= m; i += 8) {
    for (unsigned ge = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), bv, _CMP_GE_OQ)); ge; ge &= ge - 1) {
      const int64_t j = i + __builtin_ctz(ge);
      heap.emplace_back(row[j], j);
    }
    if (heap.size() > kFewCandidates) return false;
  }
  for (; i < m; ++i)
    if (row[i] >= bound) heap.emplace_back(row[i], i);
  if (heap.size() > kFewCandidates) return false;
  std::sort(heap.begin(), heap.end(), BetterFirst());
  heap.resize(std::min<size_t>(size_t(k), heap.size()));
  return true;
}
#endif

// The best k of row[0..m) into heap, best first (the lower index first among equal scores at the
// cut; -inf never counts): row_topk_few for 2 <= k <= 8 of a long row (AVX2 or AVX-512 builds);
// TopStream where k <= kRankSortMax on an AVX-512 build; else a selection where k is a large share
// of the row (m <= 16 k), where most items would pass through the heap, else the bounded heap.
inline void row_topk(const float* row, int64_t m, int64_t k, std::vector<Cand>& heap, SelectScratch& scratch) {
#ifdef __AVX2__
  if (k >= 2 && k <= 8 && m >= 64 && row_topk_few(row, m, k, heap)) return;
#endif
  heap.clear();
#ifdef RECSERVE_AVX512_BUILD
  if (k <= kRankSortMax && m <= (int64_t(1) << 32)) {
    TopStream top(k, kNegInf, scratch);
    top.push(row, m, 0);
    top.finish(heap);
    return;
  }
#endif
  if (m <= kSelectShare * k) {
    for (int64_t i = 0; i < m; ++i)
      if (row[i] > kNegInf) heap.emplace_back(row[i], i);
    keep_best(heap, k, scratch);
  } else {
    float worst = kNegInf;
    push_scores(row, m, 0, k, heap, worst);
    std::sort_heap(heap.begin(), heap.end(), MinFirst());
  }
}

// Best k of every row of x [B, M] (float32) -> values [B, k] best first, indices [B, k] (-1 pads).
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous CPU float32 [B, M]");
  TORCH_CHECK(k >= 1, "k must be >= 1");
  const int64_t b_count = x.size(0), m = x.size(1);
  auto values = at::empty({b_count, k}, x.options());
  auto indices = at::empty({b_count, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    std::vector<Cand> heap;
    SelectScratch scratch;
    for (int64_t b = b0; b < b1; ++b) {
      row_topk(xp + b * m, m, k, heap, scratch);
      for (int64_t j = 0; j < k; ++j) {
        const bool have = j < (int64_t)heap.size();
        vp[b * k + j] = have ? heap[j].first : kNegInf;
        ip[b * k + j] = have ? heap[j].second : -1;
      }
    }
  });
  return {values, indices};
}

// Whether rows a and b of masks [B, C, W] / negate [B, C] hold the same filter.
inline bool same_filter(const int64_t* masks, const bool* negate, int64_t c_count, int64_t w, int64_t a, int64_t b) {
  return std::equal(masks + a * c_count * w, masks + (a + 1) * c_count * w, masks + b * c_count * w) &&
         std::equal(negate + a * c_count, negate + (a + 1) * c_count, negate + b * c_count);
}

// out[l] = whether list l may hold an item the filter (mask [C, W], neg [C]) admits: every
// non-negated clause shares a bit with list_bits[l] (a negated clause rules no list out).
inline void lists_admitting(const int64_t* list_bits, int64_t nlist, int64_t w, const int64_t* mask, const bool* neg,
                            int64_t c_count, uint8_t* out) {
  for (int64_t l = 0; l < nlist; ++l) {
    const int64_t* bits = list_bits + l * w;
    bool ok = true;
    for (int64_t c = 0; c < c_count; ++c) {
      if (neg[c]) continue;
      int64_t hit = 0;
      for (int64_t k = 0; k < w; ++k) hit |= bits[k] & mask[c * w + k];
      ok &= hit != 0;
    }
    out[l] = ok;
  }
}

// The filtered first round's lists and the bound check's bounds (retrieval/index/bound.py,
// with_bounds), one pass per row of ip [B, L] = q·c: key = ip - half (the L2 probe; half empty:
// ip) over the lists that may hold an item the row admits (not empty: sizes [L]; and for a row with
// check[b], every non-negated clause of masks [B, C, W] / negate [B, C] shares a bit with the list's
// list_bits [L, W]: bound.py's _may_hold, reused while consecutive rows share a filter);
// the best nprobe[b] of them, as topk_rows picks them -> first [B, P] (-1 padded); bounds [B, L] =
// ip + factor[b] * radius[l] (the product rounded, then the sum, as torch computes it) where
// check[b], -inf for the lists probed first, out of reach, or of a row without a check.
__attribute__((optimize("fp-contract=off")))
std::tuple<at::Tensor, at::Tensor> list_bounds(const at::Tensor& ip, const at::Tensor& half, const at::Tensor& list_bits,
                                               const at::Tensor& masks, const at::Tensor& negate,
                                               const at::Tensor& sizes, const at::Tensor& nprobe,
                                               const at::Tensor& factor, const at::Tensor& radius,
                                               const at::Tensor& check, int64_t p) {
  TORCH_CHECK(ip.dim() == 2 && ip.scalar_type() == at::kFloat && ip.is_contiguous() && ip.device().is_cpu(),
              "ip must be a contiguous CPU float32 [B, L]");
  const int64_t b_count = ip.size(0), nlist = ip.size(1);
  TORCH_CHECK(p >= 1 && p <= nlist, "p must be in [1, L]");
  TORCH_CHECK(half.numel() == 0 || (half.numel() == nlist && half.scalar_type() == at::kFloat && half.is_contiguous()),
              "half must be float32 [L] or empty");
  TORCH_CHECK(masks.dim() == 3 && masks.size(0) == b_count && masks.scalar_type() == at::kLong && masks.is_contiguous(),
              "masks: int64 [B, C, W]");
  TORCH_CHECK(negate.dim() == 2 && negate.size(0) == b_count && negate.size(1) == masks.size(1) &&
              negate.scalar_type() == at::kBool && negate.is_contiguous(), "negate: bool [B, C]");
  const int64_t c_count = masks.size(1), w = masks.size(2);
  const bool has_bits = list_bits.numel() > 0 && c_count > 0 && w > 0;
  TORCH_CHECK(!has_bits || (list_bits.dim() == 2 && list_bits.size(0) == nlist && list_bits.size(1) == w &&
                            list_bits.scalar_type() == at::kLong && list_bits.is_contiguous()),
              "list_bits: int64 [L, W] with the masks' W");
  TORCH_CHECK(sizes.numel() == nlist && sizes.scalar_type() == at::kLong && sizes.is_contiguous(), "sizes: int64 [L]");
  TORCH_CHECK(radius.numel() == nlist && radius.scalar_type() == at::kFloat && radius.is_contiguous(), "radius: float32 [L]");
  TORCH_CHECK(nprobe.numel() == b_count && nprobe.scalar_type() == at::kLong && nprobe.is_contiguous(), "nprobe: int64 [B]");
  TORCH_CHECK(factor.numel() == b_count && factor.scalar_type() == at::kFloat && factor.is_contiguous(), "factor: float32 [B]");
  TORCH_CHECK(check.numel() == b_count && check.scalar_type() == at::kBool && check.is_contiguous(), "check: bool [B]");
  auto first = at::empty({b_count, p}, ip.options().dtype(at::kLong));
  auto bounds = at::empty({b_count, nlist}, ip.options());
  const float* ipp = ip.data_ptr<float>();
  const float* hp = half.numel() ? half.data_ptr<float>() : nullptr;
  const int64_t* lbp = has_bits ? list_bits.data_ptr<int64_t>() : nullptr;
  const int64_t* mp = masks.data_ptr<int64_t>();
  const bool* ngp = negate.data_ptr<bool>();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  const int64_t* np_ = nprobe.data_ptr<int64_t>();
  const float* fp = factor.data_ptr<float>();
  const float* radp = radius.data_ptr<float>();
  const bool* cp = check.data_ptr<bool>();
  int64_t* firstp = first.data_ptr<int64_t>();
  float* bp = bounds.data_ptr<float>();
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> key(nlist);
    std::vector<uint8_t> reach(nlist, 1);
    int64_t reach_of = -1;  // the row whose filter `reach` was computed for
    std::vector<Cand> heap;
    SelectScratch scratch;
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = ipp + b * nlist;
      const bool filtered = has_bits && cp[b];
      if (filtered && !(reach_of >= 0 && same_filter(mp, ngp, c_count, w, reach_of, b))) {
        lists_admitting(lbp, nlist, w, mp + b * c_count * w, ngp + b * c_count, c_count, reach.data());
        reach_of = b;
      }
      for (int64_t l = 0; l < nlist; ++l)
        key[l] = (!filtered || reach[l]) && sp[l] > 0 ? (hp ? row[l] - hp[l] : row[l]) : kNegInf;
      row_topk(key.data(), nlist, p, heap, scratch);
      float* out = bp + b * nlist;
      if (cp[b]) {
        const float f = fp[b];
        for (int64_t l = 0; l < nlist; ++l) {
          const float reach_ = radp[l] * f;  // factor * radius, rounded, then added (no FMA)
          out[l] = key[l] > kNegInf ? row[l] + reach_ : kNegInf;
        }
      } else {
        std::fill(out, out + nlist, kNegInf);
      }
      for (int64_t j = 0; j < p; ++j) {
        const bool have = j < (int64_t)heap.size() && j < np_[b];
        firstp[b * p + j] = have ? heap[j].second : -1;
        if (have) out[heap[j].second] = kNegInf;  // probed in the first round
      }
    }
  });
  return {first, bounds};
}

// The bound check's second round (retrieval/index/search.py, BoundCheck.second_round): per row of
// bounds [B, L], the lists that could still beat kth [B] (bounds > kth) -> todo [B] (some list
// could), exact [B] (todo and their codes, sum of sizes [L], above budget [B]: the exact scan costs
// less) and lists [B, P]: the first P needed lists by index, -1 padded, P = the most a row that
// probes them needs (1 when none does).
std::tuple<at::Tensor, at::Tensor, at::Tensor> second_round_lists(const at::Tensor& bounds, const at::Tensor& kth,
                                                                  const at::Tensor& sizes, const at::Tensor& budget) {
  TORCH_CHECK(bounds.dim() == 2 && bounds.scalar_type() == at::kFloat && bounds.is_contiguous() &&
              bounds.device().is_cpu(), "bounds must be a contiguous CPU float32 [B, L]");
  const int64_t b_count = bounds.size(0), nlist = bounds.size(1);
  TORCH_CHECK(kth.numel() == b_count && kth.scalar_type() == at::kFloat && kth.is_contiguous(), "kth: float32 [B]");
  TORCH_CHECK(budget.numel() == b_count && budget.scalar_type() == at::kFloat && budget.is_contiguous(), "budget: float32 [B]");
  TORCH_CHECK(sizes.numel() == nlist && sizes.scalar_type() == at::kLong && sizes.is_contiguous(), "sizes: int64 [L]");
  auto todo = at::empty({b_count}, bounds.options().dtype(at::kBool));
  auto exact = at::empty({b_count}, bounds.options().dtype(at::kBool));
  std::vector<int64_t> count(b_count);
  const float* bp = bounds.data_ptr<float>();
  const float* kp = kth.data_ptr<float>();
  const float* gp = budget.data_ptr<float>();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  bool* tp = todo.data_ptr<bool>();
  bool* ep = exact.data_ptr<bool>();
  at::parallel_for(0, b_count, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = bp + b * nlist;
      int64_t n = 0, codes = 0;
      for (int64_t l = 0; l < nlist; ++l) {
        const bool need = row[l] > kp[b];
        n += need;
        codes += need ? sp[l] : 0;
      }
      count[b] = n;
      tp[b] = n > 0;
      ep[b] = n > 0 && float(codes) > gp[b];
    }
  });
  int64_t p = 0;
  for (int64_t b = 0; b < b_count; ++b)
    if (tp[b] && !ep[b]) p = std::max(p, count[b]);
  p = std::max<int64_t>(p, 1);
  auto lists = at::full({b_count, p}, -1, bounds.options().dtype(at::kLong));
  int64_t* lp = lists.data_ptr<int64_t>();
  at::parallel_for(0, b_count, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = bp + b * nlist;
      for (int64_t l = 0, j = 0; l < nlist && j < p; ++l)
        if (row[l] > kp[b]) lp[b * p + j++] = l;
    }
  });
  return {todo, exact, lists};
}

// A selective filter's exact search in one call: the rows passing one filter (eligible_rows),
// their scores off the codes as IVFIndex.scores_at computes them (up to `few` queries against the
// float queries, score_rows_int8; more, many_rows_int8), the best k (topk_rows, as
// exact.exact_topk picks them) and the rows' item ids ->
// (ids [B, k], scores [B, k]), -1 / -inf padded. The same answer as the planned path's exact scan.
// Undefined tensors where B x M would pass max_scores (the caller then scans in chunks).
at::Tensor centroid_dots(const at::Tensor& q, const at::Tensor& centroids_t);

std::tuple<at::Tensor, at::Tensor> exact_search_ids_int8(
    const at::Tensor& q, const at::Tensor& centroids_t, const at::Tensor& codes, const at::Tensor& scales,
    const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg,
    const at::Tensor& bit_counts, const at::Tensor& postings, const at::Tensor& item_ids, int64_t k,
    int64_t few, int64_t max_scores) {
  TORCH_CHECK(k >= 1, "k must be >= 1");
  TORCH_CHECK(item_ids.dim() == 1 && item_ids.size(0) == codes.size(0) && item_ids.scalar_type() == at::kLong,
              "item_ids must be int64 [N]");
  const at::Tensor rows = eligible_rows(sig, fmask, fneg, bit_counts, postings);
  const int64_t b_count = q.size(0), m = rows.numel();
  if (b_count * m > max_scores) return {at::Tensor(), at::Tensor()};  // the caller scans in chunks
  // IVFIndex.scores_at's two ways, so that the scores are its bits
  // the many queries' scores in this thread's buffer, kept for its next call (only topk reads them)
  static thread_local at::Tensor buffer;
  if (b_count > few && m >= kGemmRows && q.size(1) >= kGemmDims && (!buffer.defined() || buffer.numel() < b_count * m))
    buffer = at::empty({std::max<int64_t>(b_count * m, buffer.defined() ? 2 * buffer.numel() : 0)},
                       q.options().dtype(at::kInt));
  const at::Tensor scores =
      b_count <= few ? score_rows_int8(q, rows, codes, scales, offsets, centroid_dots(q, centroids_t))
                     : many_rows_int8(q, rows, codes, scales, offsets, centroids_t, buffer);
  auto [best, idx] = topk_rows(scores, k);  // pads -1 / -inf where fewer than k rows pass
  // the positions' item ids in place (six [B, k] tensor ops took ~0.7 ms at B = 1000, k = 100)
  int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* item = item_ids.data_ptr<int64_t>();
  at::parallel_for(0, b_count * k, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) ip[i] = ip[i] >= 0 ? item[rp[ip[i]]] : -1;
  });
  return {idx, best};
}

// q · every centroid: acc[l] = sum over j of q[j] * ct[j, l], j ascending (one fused multiply-add
// per term), so every path gives the same bits. Blocks of lists keep their sums in registers
// across the D terms; one pass of the whole acc row per term was bound by its stores.
constexpr int64_t kProbeBlock = 32;
inline void probe_dots_portable(const float* __restrict q, const float* __restrict ct, int64_t d, int64_t nlist,
                                float* __restrict acc) {
  int64_t l0 = 0;
  for (; l0 + kProbeBlock <= nlist; l0 += kProbeBlock) {
    float sum[kProbeBlock] = {};
    for (int64_t j = 0; j < d; ++j) {
      const float qj = q[j];
      const float* row = ct + j * nlist + l0;
#pragma omp simd
      for (int64_t l = 0; l < kProbeBlock; ++l) sum[l] = std::fma(qj, row[l], sum[l]);
    }
    std::copy(sum, sum + kProbeBlock, acc + l0);
  }
  for (int64_t l = l0; l < nlist; ++l) {
    float sum = 0.f;
    for (int64_t j = 0; j < d; ++j) sum = std::fma(q[j], ct[j * nlist + l], sum);
    acc[l] = sum;
  }
}

#ifdef RECSERVE_X86
// AVX-512: 128 lists at a time in eight 16-lane sums, enough independent FMAs to hide their
// latency. The portable loop's compiled form kept its sums on the stack (GCC's 256-bit default):
// a store-forward per term, ~5 us of a one-query probe over 1024 lists at 64-d.
RECSERVE_TARGET("avx512f")
void probe_dots_avx512(const float* __restrict q, const float* __restrict ct, int64_t d, int64_t nlist,
                       float* __restrict acc) {
  int64_t l0 = 0;
  for (; l0 + 128 <= nlist; l0 += 128) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t j = 0; j < d; ++j) {
      const __m512 qj = _mm512_set1_ps(q[j]);
      const float* row = ct + j * nlist + l0;
      s0 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row), s0);
      s1 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 16), s1);
      s2 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 32), s2);
      s3 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 48), s3);
      s4 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 64), s4);
      s5 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 80), s5);
      s6 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 96), s6);
      s7 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 112), s7);
    }
    float* out = acc + l0;
    _mm512_storeu_ps(out, s0), _mm512_storeu_ps(out + 16, s1), _mm512_storeu_ps(out + 32, s2);
    _mm512_storeu_ps(out + 48, s3), _mm512_storeu_ps(out + 64, s4), _mm512_storeu_ps(out + 80, s5);
    _mm512_storeu_ps(out + 96, s6), _mm512_storeu_ps(out + 112, s7);
  }
  for (; l0 < nlist; l0 += 16) {
    const __mmask16 m = nlist - l0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nlist - l0)) - 1);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j)
      s = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), _mm512_maskz_loadu_ps(m, ct + j * nlist + l0), s);
    _mm512_mask_storeu_ps(acc + l0, m, s);
  }
}
#endif

inline void probe_dots(const float* __restrict q, const float* __restrict ct, int64_t d, int64_t nlist,
                       float* __restrict acc) {
#ifdef RECSERVE_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return probe_dots_avx512(q, ct, d, nlist, acc);
#endif
  probe_dots_portable(q, ct, d, nlist, acc);
}

// The probe's int8 table: the centroids quantized once per index (IVFIndex._refresh), for the
// probe of a few queries. One query's probe read the whole float table (1 MB at 1,024 lists x
// 256-d: ~35 % of the query in perf); the table is a quarter of it. centroids_t [D, L] ->
// words int32 [ceil(L/16) * G * 16] (G = ceil(D/4): blocks of 16 lists x 4 bytes in offset binary,
// block_dots_vnni's layout), per f32 [4, ceil(L/16) * 16] = each list's (scale: symmetric absmax /
// 127, |c - ĉ|, |ĉ|, |c|; pads 0), the norms summed in double, inflated by kSquareSlack and rounded
// up, so they stay upper bounds, and finite bool [1]: false when a centroid is not (then the
// table is never used).
constexpr double kSquareSlack = 1.001;

inline float round_up(double v) {
  const float f = static_cast<float>(v);
  return double(f) < v ? std::nextafter(f, std::numeric_limits<float>::infinity()) : f;
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> probe_table(const at::Tensor& centroids_t) {
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous() &&
              centroids_t.device().is_cpu(), "centroids_t must be contiguous CPU float32 [D, L]");
  const int64_t d = centroids_t.size(0), nlist = centroids_t.size(1), groups = (d + 3) / 4;
  const int64_t blocks = (nlist + 15) / 16;
  auto words = at::full({blocks * groups * 16}, static_cast<int32_t>(0x80808080u), centroids_t.options().dtype(at::kInt));
  auto per = at::zeros({4, blocks * 16}, centroids_t.options());
  auto finite_t = at::empty({1}, centroids_t.options().dtype(at::kBool));
  const float* ct = centroids_t.data_ptr<float>();
  uint32_t* wp = reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>());
  float* sp = per.data_ptr<float>();
  const int64_t stride = blocks * 16;
  std::vector<int8_t> code(groups * 4);
  bool finite = true;
  for (int64_t l = 0; l < nlist; ++l) {
    float amax = 0.f;
    for (int64_t j = 0; j < d; ++j) {
      const float v = ct[j * nlist + l];
      finite &= std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    const float sc = amax > 0.f ? amax / 127.f : 1.f;
    double err = 0, qn = 0, nn = 0;
    std::fill(code.begin(), code.end(), 0);
    for (int64_t j = 0; j < d; ++j) {
      const float v = ct[j * nlist + l];
      const float c = std::min(127.f, std::max(-127.f, std::nearbyint(v / sc)));
      code[j] = static_cast<int8_t>(c);
      const double back = double(c) * sc;
      err += (v - back) * (v - back), qn += back * back, nn += double(v) * v;
    }
    sp[l] = sc;
    sp[stride + l] = round_up(std::sqrt(kSquareSlack * err));
    sp[2 * stride + l] = round_up(std::sqrt(kSquareSlack * qn));
    sp[3 * stride + l] = round_up(std::sqrt(kSquareSlack * nn));
    uint32_t* dst = wp + (l / 16) * groups * 16 + l % 16;
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t w;
      std::memcpy(&w, code.data() + 4 * g, 4);
      dst[g * 16] = w ^ 0x80808080u;
    }
  }
  finite_t.fill_(finite);
  return {words, per, finite_t};
}

#ifdef RECSERVE_X86
// AVX2 dots of one query against blocks of 16 lists (probe_table's words: block_dots_vnni's layout)
// for a CPU without VNNI. vpmaddubsw multiplies the unsigned word bytes (c + 128 <= 255) by the
// query's signed bytes into saturating s16 pair sums, so the query is quantized to |q| <= 63: a pair
// sums to at most 2 * 255 * 63 = 32130 < 2^15 and nothing saturates; vpmaddwd widens each pair
// to s32, and the excess 128 * sum(q) is subtracted. dots must hold n rounded up to 16.
RECSERVE_TARGET("avx2")
void block_dots_avx2(const uint32_t* t, int64_t n, int64_t groups, const int8_t* q, int32_t qsum, int32_t* dots) {
  const __m256i corr = _mm256_set1_epi32(128 * qsum), ones = _mm256_set1_epi16(1);
  const int64_t blocks = (n + 15) / 16, stride = groups * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i* blk = reinterpret_cast<const __m256i*>(t + b * stride);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t qw;
      std::memcpy(&qw, q + 4 * g, 4);
      const __m256i qv = _mm256_set1_epi32(qw);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(blk + 2 * g), qv), ones));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(blk + 2 * g + 1), qv), ones));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + b * 16), _mm256_sub_epi32(a0, corr));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + b * 16 + 8), _mm256_sub_epi32(a1, corr));
  }
}

// The exact q·c of lists idx[0..n) in probe_dots' own arithmetic (per list, fmaf over j from 0 in
// order: the same bits whatever the vector width), 8 lists per AVX2 gather (16 with AVX-512).
RECSERVE_TARGET("avx2,fma")
void probe_dots_of_avx2(const float* q, const float* ct, int64_t d, int64_t nlist, const int32_t* idx, int64_t n,
                        float* out) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    alignas(32) int32_t at[8] = {};  // past n: list 0, gathered and dropped
    alignas(32) float s8[8];
    std::copy(idx + i, idx + i + m, at);
    const __m256i av = _mm256_load_si256(reinterpret_cast<const __m256i*>(at));
    __m256 s = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; ++j)
      s = _mm256_fmadd_ps(_mm256_set1_ps(q[j]), _mm256_i32gather_ps(ct + j * nlist, av, 4), s);
    _mm256_store_ps(s8, s);
    std::copy(s8, s8 + m, out + i);
  }
}

RECSERVE_TARGET("avx512f")
void probe_dots_of_avx512(const float* q, const float* ct, int64_t d, int64_t nlist, const int32_t* idx, int64_t n,
                          float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512i at = _mm512_maskz_loadu_epi32(m, idx + i);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j)
      s = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, at, ct + j * nlist, 4), s);
    _mm512_mask_storeu_ps(out + i, m, s);
  }
}

// Each list's approximate key ± T_l (see probe_one_int8) as lo, hi [L] in float (one vector
// loop): key = dots * qs * scale (- half), T_l = a |c - ĉ| + b |ĉ| + c |c| + e |half|, widened by
// m = (|key| + T_l) 2^-21, which exceeds the rounding of the three float steps after key's (each
// at most 2^-24 of (|key| + T_l + m)).
template <bool kL2>
void key_bounds(const int32_t* dots, float qs, const float* per, int64_t stride, const float* hp, int64_t nlist,
                float a, float b, float c, float e, float* lo, float* hi) {
  const float *cscale = per, *cerr = per + stride, *chat = per + 2 * stride, *cnorm = per + 3 * stride;
  constexpr float kOut = 1.f / (1 << 21), kTiny = 1e-30f;
  for (int64_t l = 0; l < nlist; ++l) {
    const float ip = float(dots[l]) * qs * cscale[l];
    const float key = kL2 ? ip - hp[l] : ip;
    const float t = a * cerr[l] + b * chat[l] + c * cnorm[l] + (kL2 ? e * std::fabs(hp[l]) : 0.f);
    const float m = (std::fabs(key) + t) * kOut + kTiny;
    lo[l] = (key - t) - m;
    hi[l] = (key + t) + m;
  }
}

// One query's probe through the table: approximate q·c of every list (block_dots_vnni, or
// block_dots_avx2 with a 7-bit query), then every list whose approximate key + its error bound T_l
// reaches the p-th best of (approximate key - T_m) over all lists is scored exactly
// (probe_dots_of_*) and ranked by the same heap as the float probe, lists in ascending order. T_l
// bounds |exact float key - approximate key| of list l:
//   |q·c - q̂·ĉ| <= |q| |c - ĉ| + |q - q̂| |ĉ|           (quantization)
//   + 4u |q̂| |ĉ|                                          (the approximation's float rounding)
//   + γ_D |q| |c|                                          (the exact sum's own rounding)
//   + 2u (|q| |c| + |half|)                                (the key's subtraction, both sides)
// The p lists of the best lower bounds all reach the p-th of them, so every list of the float
// probe's best p (ties included) is scored, and the answer is the float probe's. False when the
// query is not finite (the caller takes the float probe).
bool probe_one_int8(Isa isa, const float* qb, int64_t d, const float* ct, int64_t nlist, const float* hp,
                    const uint32_t* words, const float* per, int64_t p, std::vector<Cand>& heap,
                    std::vector<int8_t>& q8, std::vector<int32_t>& dots, std::vector<float>& lo,
                    std::vector<float>& hi, std::vector<int32_t>& cand, std::vector<float>& exact) {
  const int64_t groups = (d + 3) / 4, stride = (nlist + 15) / 16 * 16;
  const float levels = isa == Isa::kVnni ? 127.f : 63.f;  // vpdpbusd's s32 sums; vpmaddubsw's s16 pairs
  double qn = 0;
  float amax = 0.f;
  for (int64_t j = 0; j < d; ++j) qn += double(qb[j]) * qb[j], amax = std::max(amax, std::fabs(qb[j]));
  if (!std::isfinite(qn)) return false;
  const float qs = amax > 0.f ? amax / levels : 1.f;
  q8.assign(groups * 4, 0);
  int32_t qsum = 0;
  double err = 0, qhat = 0;
  for (int64_t j = 0; j < d; ++j) {
    const float c = std::min(levels, std::max(-levels, std::nearbyint(qb[j] / qs)));
    q8[j] = static_cast<int8_t>(c);
    qsum += static_cast<int32_t>(c);
    const double back = double(c) * qs;
    err += (qb[j] - back) * (qb[j] - back), qhat += back * back;
  }
  const double u = std::ldexp(1.0, -24), du = double(d) * u, inflate = 1 + 1e-5;
  const double qnorm = std::sqrt(kSquareSlack * qn), qerr = std::sqrt(kSquareSlack * err);
  const double qhn = std::sqrt(kSquareSlack * qhat);
  // T_l = a |c_l - ĉ_l| + b |ĉ_l| + c |c_l| + e |half_l|, in float: inflated past its own rounding
  const float a = float(qnorm * inflate), b = float((qerr + 4 * u * qhn) * inflate);
  const float c = float((du / (1 - du) + 2 * u) * qnorm * inflate), e = float(2 * u * inflate);
  dots.resize(stride);
  lo.resize(nlist), hi.resize(nlist);
  if (isa == Isa::kVnni)  // any x86 build: the VNNI functions carry their own target
    block_dots_vnni(words, nlist, groups, q8.data(), qsum, dots.data());
  else
    block_dots_avx2(words, nlist, groups, q8.data(), qsum, dots.data());
  if (hp)
    key_bounds<true>(dots.data(), qs, per, stride, hp, nlist, a, b, c, e, lo.data(), hi.data());
  else
    key_bounds<false>(dots.data(), qs, per, stride, hp, nlist, a, b, c, e, lo.data(), hi.data());
  heap.clear();
  float floor_ = kNegInf;
  push_scores(lo.data(), nlist, 0, p, heap, floor_);  // the p-th best lower bound
  cand.clear();
  for (int64_t l = 0; l < nlist; ++l)
    if (hi[l] >= floor_) cand.push_back(static_cast<int32_t>(l));
  exact.resize(cand.size());
  // The AVX2 path gathers 8 lists even where AVX-512 exists, so forcing it tests what an AVX2 CPU runs
  if (isa == Isa::kVnni)
    probe_dots_of_avx512(qb, ct, d, nlist, cand.data(), (int64_t)cand.size(), exact.data());
  else
    probe_dots_of_avx2(qb, ct, d, nlist, cand.data(), (int64_t)cand.size(), exact.data());
  heap.clear();
  float worst = kNegInf;
  for (size_t i = 0; i < cand.size(); ++i)
    push_one<BetterFirst>(hp ? exact[i] - hp[cand[i]] : exact[i], cand[i], p, heap, worst);
  return true;  // exact[i]: the exact q·c of list cand[i] (ascending)
}
#endif

// The lists each query probes: q [B, D], centroids_t [D, L] (the centroids transposed, float32) ->
// coarse [B, P] = q·c of each probed list and probes [B, P], best first by q·c, or by q·c - half[l]
// (half = ||c||^2 / 2: the nearest centroids by L2) when half is not empty; P <= L. The dots run
// over centroids_t [D, L] in blocks of lists (vector-wide, no horizontal sums: probe_dots),
// and the same heap as topk_rows picks and orders the lists: one call instead of a matmul and a
// top-k (~10 us of dispatch each for one query).
using ProbeTable = c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>>;

std::tuple<at::Tensor, at::Tensor> ivf_probe(const at::Tensor& q, const at::Tensor& centroids_t,
                                             const at::Tensor& half, int64_t p, const ProbeTable& table) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "q must be a contiguous CPU float32 [B, D]");
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(0) == q.size(1) &&
              centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous(),
              "centroids_t must be contiguous float32 [D, L] with the query's D");
  const int64_t b_count = q.size(0), d = q.size(1), nlist = centroids_t.size(1);
  TORCH_CHECK(p >= 1 && p <= nlist, "nprobe must be in [1, nlist]");
  const bool by_l2 = half.numel() > 0;
  TORCH_CHECK(!by_l2 || (half.dim() == 1 && half.size(0) == nlist && half.scalar_type() == at::kFloat &&
                         half.is_contiguous()), "half norms must be float32 [L] (or empty)");
  auto coarse = at::empty({b_count, p}, q.options());
  auto probes = at::empty({b_count, p}, q.options().dtype(at::kLong));
  const float* qp = q.data_ptr<float>();
  const float* ct = centroids_t.data_ptr<float>();
  const float* hp = by_l2 ? half.data_ptr<float>() : nullptr;
  float* op = coarse.data_ptr<float>();
  int64_t* pp = probes.data_ptr<int64_t>();
  // The int8 table (probe_table of these centroids) on a CPU with AVX2 or VNNI: the same lists and bits
  const uint32_t* words = nullptr;
  const float* per = nullptr;
  const Isa isa = table.has_value() ? int8_isa() : Isa::kPortable;
#ifdef RECSERVE_X86
  if (isa != Isa::kPortable) {
    const auto& [w, pl, ok] = *table;
    const int64_t blocks = (nlist + 15) / 16, groups = (d + 3) / 4;
    TORCH_CHECK(w.scalar_type() == at::kInt && w.is_contiguous() && w.numel() == blocks * groups * 16 &&
                    pl.scalar_type() == at::kFloat && pl.is_contiguous() && pl.numel() == 4 * blocks * 16 &&
                    ok.scalar_type() == at::kBool && ok.numel() == 1,
                "table: not probe_table(centroids_t) of these centroids");
    if (ok.data_ptr<bool>()[0]) {
      words = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
      per = pl.data_ptr<float>();
    }
  }
#endif
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> ip(words ? 0 : nlist), key(by_l2 ? nlist : 0), hi, exact;
    std::vector<Cand> heap;
    std::vector<int8_t> q8;
    std::vector<int32_t> dots, cand;
    heap.reserve(p);
    for (int64_t b = b0; b < b1; ++b) {
      const float* qb = qp + b * d;
#ifdef RECSERVE_X86
      if (words && probe_one_int8(isa, qb, d, ct, nlist, hp, words, per, p, heap, q8, dots, key, hi, cand, exact)) {
        std::sort_heap(heap.begin(), heap.end(), BetterFirst());
        for (int64_t j = 0; j < p; ++j) {
          const bool have = j < (int64_t)heap.size();
          const int64_t l = have ? heap[j].second : -1;
          pp[b * p + j] = l;
          op[b * p + j] = have ? exact[std::lower_bound(cand.begin(), cand.end(), int32_t(l)) - cand.begin()] : kNegInf;
        }
        continue;
      }
#endif
      ip.resize(nlist);
      probe_dots(qb, ct, d, nlist, ip.data());
      if (by_l2)
        for (int64_t l = 0; l < nlist; ++l) key[l] = ip[l] - hp[l];
      heap.clear();
      float worst = kNegInf;
      push_scores<BetterFirst>(by_l2 ? key.data() : ip.data(), nlist, 0, p, heap, worst);
      std::sort_heap(heap.begin(), heap.end(), BetterFirst());  // equal keys: the lower list first
      for (int64_t j = 0; j < p; ++j) {
        const bool have = j < (int64_t)heap.size();  // fewer only for -inf or NaN keys
        pp[b * p + j] = have ? heap[j].second : -1;
        op[b * p + j] = have ? ip[heap[j].second] : kNegInf;
      }
    }
  });
  return {coarse, probes};
}

// q [B, D] · every centroid -> [B, L] f32, by probe_dots over centroids_t [D, L] (what ivf_probe
// ranks lists by: the same bits). A few queries run on the calling thread: a matmul of one query
// against the centroids woke a second thread, which then spun through the rest of the search.
at::Tensor centroid_dots(const at::Tensor& q, const at::Tensor& centroids_t) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "q must be a contiguous CPU float32 [B, D]");
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(0) == q.size(1) &&
              centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous(),
              "centroids_t must be contiguous float32 [D, L] with the query's D");
  const int64_t b_count = q.size(0), d = q.size(1), nlist = centroids_t.size(1);
  auto out = at::empty({b_count, nlist}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* ct = centroids_t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) probe_dots(qp + b * d, ct, d, nlist, op + b * nlist);
  });
  return out;
}

// The rows of item ids through an index's id order: item_ids [N] int64 (row -> id) and perm [N]
// int32 (rows in ascending id order: 4 bytes an item); a binary search per id. ids [B, S] int64
// -> rows [B, S] int64, `missing` where the index holds no such id (a -1 pad included), each
// row sorted when `ascending` (the scan's exclusions: missing = INT64_MAX sorts last).
void check_id_order(const at::Tensor& item_ids, const at::Tensor& perm) {
  TORCH_CHECK(item_ids.dim() == 1 && perm.sizes() == item_ids.sizes() && item_ids.scalar_type() == at::kLong &&
              perm.scalar_type() == at::kInt && item_ids.is_contiguous() && perm.is_contiguous() &&
              item_ids.device().is_cpu() && perm.device().is_cpu(),
              "item_ids (int64) and perm (int32) must be contiguous CPU [N]");
}

// The first place in id order whose id is >= w, searched from a guess: the place w would take if the
// ids were spread evenly between the smallest and the largest (exact for a contiguous range of ids,
// the common catalog; near for ids spread evenly, a document shard's). From the guess the search
// gallops to bracket w, then bisects the bracket. A plain bisection over the whole order takes
// ~17 dependent loads from ids and order for 100k items, most of them cache misses (~2 us an id
// from a cold cache); a good guess takes two.
inline int64_t first_at_least(const int64_t* ids, const int32_t* order, int64_t n, int64_t lo_id, double slope,
                              int64_t w) {
  const auto at = [&](int64_t j) { return ids[order[j]]; };
  const int64_t g = std::min<int64_t>(n - 1, std::max<int64_t>(0, int64_t(double(w - lo_id) * slope)));
  int64_t lo, hi;  // the answer lies in [lo, hi]: at(lo - 1) < w (or lo == 0), at(hi) >= w (or hi == n)
  if (at(g) < w) {
    int64_t below = g, step = 1;
    hi = g + 1;
    while (hi < n && at(hi) < w) {
      below = hi;
      step <<= 1;
      hi = std::min(n, below + step);
    }
    lo = below + 1;
  } else {
    int64_t below = g - 1, step = 1;
    hi = g;
    while (below >= 0 && at(below) >= w) {
      hi = below;
      step <<= 1;
      below = std::max<int64_t>(-1, hi - step);
    }
    lo = below + 1;
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (at(mid) < w) lo = mid + 1; else hi = mid;
  }
  return lo;
}

void rows_of_ids(const int64_t* ids, const int32_t* order, int64_t n, const int64_t* want, int64_t count,
                 int64_t missing, int64_t* rows) {
  if (n == 0) {
    std::fill(rows, rows + count, missing);
    return;
  }
  const int64_t lo_id = ids[order[0]], hi_id = ids[order[n - 1]];
  const double slope = hi_id > lo_id ? double(n - 1) / (double(hi_id) - double(lo_id)) : 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t w = want[i];
    if (w < lo_id || w > hi_id) {  // a -1 pad, or an id outside the index's range
      rows[i] = missing;
      continue;
    }
    const int64_t j = first_at_least(ids, order, n, lo_id, slope, w);
    rows[i] = j < n && ids[order[j]] == w ? order[j] : missing;
  }
}

at::Tensor id_rows(const at::Tensor& item_ids, const at::Tensor& perm, const at::Tensor& ids, int64_t missing,
                   bool ascending) {
  check_id_order(item_ids, perm);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "ids must be contiguous CPU int64");
  auto rows = at::empty_like(ids);
  int64_t* out = rows.data_ptr<int64_t>();
  rows_of_ids(item_ids.data_ptr<int64_t>(), perm.data_ptr<int32_t>(), item_ids.numel(), ids.data_ptr<int64_t>(),
              ids.numel(), missing, out);
  const int64_t s = ids.dim() ? ids.size(-1) : 1;
  if (ascending && s > 1)
    for (int64_t i = 0; i < ids.numel(); i += s) std::sort(out + i, out + i + s);
  return rows;
}

// Each row's probed lists (probes [B, P], best first, -1 skips) cut to its best ones until they hold
// hold[b] items (hold [B] int64) by sizes [L] (the lists as built), at least `least`: the slots
// past that -1, in place. probe.lists_holding's rule, for the one-call search.
void hold_lists(at::Tensor& probes, const at::Tensor& sizes, int64_t least, const at::Tensor& hold) {
  TORCH_CHECK(sizes.dim() == 1 && sizes.scalar_type() == at::kLong && sizes.is_contiguous(),
              "sizes must be contiguous int64 [L]");
  TORCH_CHECK(hold.dim() == 1 && hold.size(0) == probes.size(0) && hold.scalar_type() == at::kLong &&
              hold.is_contiguous(), "hold must be contiguous int64 [B]");
  const int64_t b_count = probes.size(0), p = probes.size(1), nlist = sizes.size(0);
  int64_t* pp = probes.data_ptr<int64_t>();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  const int64_t* hp = hold.data_ptr<int64_t>();
  for (int64_t b = 0; b < b_count; ++b) {
    int64_t held = 0;
    for (int64_t j = 0; j < p; ++j) {
      int64_t& l = pp[b * p + j];
      if (j >= least && held >= hp[b]) l = -1;
      else if (l >= 0 && l < nlist) held += sp[l];
    }
  }
}

// A plain search keyed by item id, in one call (what a document shard answers most): the item ids
// each query excludes (excl_ids [B, S], -1 pads) -> their rows through the index's id order (a
// binary search over item_ids in perm order; ascending per query, absent ids and pads last as
// INT64_MAX), then ivf_probe (cut by hold_lists where sizes is not empty) and ivf_scan_int8, then
// the rows found -> item ids (-1 pads stay), and whether any row found fewer than r (undefined
// tensors where a kernel is forced).
// The same steps as a dozen tensor ops around the two kernels, which cost a one-query search
// more than the kernels do.
std::tuple<at::Tensor, at::Tensor, bool> ivf_search_ids_int8(
    const at::Tensor& q, const at::Tensor& centroids_t, const at::Tensor& half, int64_t p,
    const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& excl_ids,
    const at::Tensor& item_ids, const at::Tensor& perm, int64_t r, const at::Tensor& sizes, int64_t least,
    const at::Tensor& hold, const ProbeTable& table) {
  // A kernel forced by $RECSERVE_SCAN_KERNEL (retrieval.index.scan.KERNEL_ENV: set, and not
  // "auto"): not this call's to answer, undefined tensors back (the caller takes the step-by-step
  // path through the forced kernel). Read here, ~50 ns, where os.environ took ~1 us a query.
  if (const char* forced = std::getenv("RECSERVE_SCAN_KERNEL"); forced && std::strcmp(forced, "auto") != 0)
    return {at::Tensor(), at::Tensor(), false};
  TORCH_CHECK(excl_ids.dim() == 2 && excl_ids.size(0) == q.size(0) && excl_ids.scalar_type() == at::kLong &&
              excl_ids.is_contiguous(), "excluded ids must be contiguous int64 [B, S]");
  TORCH_CHECK(item_ids.numel() == codes.size(0), "item_ids must be [N] with the codes' N");
  const at::Tensor excl = id_rows(item_ids, perm, excl_ids, std::numeric_limits<int64_t>::max(), true);
  const int64_t* ids = item_ids.data_ptr<int64_t>();
  auto probed = ivf_probe(q, centroids_t, half, p, table);
  if (sizes.numel() && least < p) hold_lists(std::get<1>(probed), sizes, least, hold);
  auto found = ivf_scan_int8(q, std::get<1>(probed), std::get<0>(probed), codes, scales, offsets, sig,
                             fmask, fneg, excl, r, at::Tensor());
  at::Tensor pos = std::get<0>(found);
  int64_t* pp = pos.data_ptr<int64_t>();
  bool short_row = false;  // a row that found fewer than r: its caller widens it
  for (int64_t i = 0; i < pos.numel(); ++i) {
    if (pp[i] >= 0) pp[i] = ids[pp[i]];
    else short_row = true;
  }
  return {pos, std::get<1>(found), short_row};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch only tensors: other Python threads (a server's gRPC threads) run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("topk_rows", &topk_rows, "Best k per row with a bounded heap", nogil);
  m.def("list_bounds", &list_bounds, "A filtered first round's lists and the bound check's bounds", nogil);
  m.def("second_round_lists", &second_round_lists, "The bound check's second-round rows and lists", nogil);
  m.def("ivf_probe", &ivf_probe, "The lists each query probes, best first, and q·c of each", pybind11::arg("q"),
        pybind11::arg("centroids_t"), pybind11::arg("half"), pybind11::arg("p"), pybind11::arg("table") = pybind11::none(),
        nogil);
  m.def("probe_table", &probe_table, "The centroids quantized for the probe of a few queries", nogil);
  m.def("filter_mask", &filter_mask, "Items passing one filter", nogil);
  m.def("many_rows_int8",
        [](const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
           const at::Tensor& offsets, const at::Tensor& centroids_t) {
          return many_rows_int8(q, pos, codes, scales, offsets, centroids_t, at::Tensor());
        },
        "Many queries' scores of chosen rows: one int8 GEMM of quantized queries, or decoded rows and a matmul", nogil);
  m.def("decode_rows_int8", &decode_rows_int8, "Float vectors of chosen rows off the int8 codes, one pass", nogil);
  m.def("exact_search_ids_int8", &exact_search_ids_int8,
        "A selective filter's exact search for a few queries: eligible rows, scores, top-k, ids", nogil);
  m.def("eligible_rows", &eligible_rows, "Rows passing one filter, driven by its most selective clause's postings", nogil);
  m.def("id_rows", &id_rows, "Rows of item ids through the index's id order (missing where absent)", nogil);
  m.def("centroid_dots", &centroid_dots, "q · every centroid, as the probe computes it", nogil);
  m.def("score_rows_int8", &score_rows_int8, "Scores of chosen rows off the int8 codes (the exact plan)", nogil);
  m.def("ids_of_positions", &ids_of_positions, "Positions (-1 pads) -> item ids (-1 pads)", nogil);
  m.def("bit_index", &bit_index, "Per-bit item counts and postings of the filter signatures", nogil);
  m.def("encode_int8", &encode_int8, "The build's int8 residual codes, scales and norms in list-sorted order", nogil);
  m.def("ivf_scan_int8", &ivf_scan_int8, "List-major IVF scan over int8 residual codes with in-scan filter", nogil);
  m.def("int8_isa", [] { return std::string(isa_name(int8_isa())); },
        "The int8 scan's path for the next call: portable, avx2 or vnni ($RECSERVE_SCAN_ISA, else the CPU's best)");
  m.def("stream_select", [] {
#ifdef RECSERVE_AVX512_BUILD
    return true;
#else
    return false;
#endif
  }, "Whether selections of k <= 160 run TopStream (an AVX-512 build): equal scores by position");
  m.def("ivf_search_ids_int8", &ivf_search_ids_int8,
        "Exclusions by id -> rows, probe, int8 scan, rows -> ids: a plain search in one call", pybind11::arg("q"),
        pybind11::arg("centroids_t"), pybind11::arg("half"), pybind11::arg("p"), pybind11::arg("codes"),
        pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("sig"), pybind11::arg("fmask"),
        pybind11::arg("fneg"), pybind11::arg("excl_ids"), pybind11::arg("item_ids"), pybind11::arg("perm"),
        pybind11::arg("r"), pybind11::arg("sizes"), pybind11::arg("least"), pybind11::arg("hold"),
        pybind11::arg("table") = pybind11::none(), nogil);
  m.def("ivf_scan_fp8", &ivf_scan_fp8, "List-major IVF scan over fp8 e4m3 residual codes with in-scan filter", nogil);
}
