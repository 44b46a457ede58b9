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

#include <ATen/ops/empty.h>

#include "ivf_scan.h"

namespace ivf {

namespace {

constexpr int64_t kMaxBufferFloats = int64_t(1) << 25;  // 128 MiB of pair scores per chunk

bool cpu_runs(Isa isa) {
#ifdef RECSERVE_X86
  if (isa == Isa::kVnni) return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");  // every AVX2 path
#endif
  return isa == Isa::kPortable;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kVnni: return "vnni";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
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

namespace {

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

#endif

}  // namespace

#ifdef RECSERVE_X86
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

namespace {

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

struct Index {
  const Scale* scales; const int64_t* offsets; int64_t nlist;
  const int64_t* sig; int64_t w;
};
struct Batch {  // one chunk of queries [b0, b1)
  int64_t b0, b1, p;
  const int64_t* probes; const float* coarse;
  const int64_t* fmask; const bool* fneg; int64_t c_count;
  const int64_t* fnone;  // [B, C, W] "none of these bits" parts; nullptr: none
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
// selective first clause makes predictable (a branch-free loop was slower there).
bool passing(const Index& ix, const Batch& bt, int64_t b, int64_t i0, int64_t i1, std::vector<int64_t>& some,
             std::vector<uint8_t>& keep) {
  const int64_t* fm = bt.fmask + b * bt.c_count * ix.w;
  const bool* fn = bt.fneg + b * bt.c_count;
  const int64_t* fo = bt.fnone ? bt.fnone + b * bt.c_count * ix.w : nullptr;
  const int64_t n = i1 - i0;
  if (bt.c_count == 1 && ix.w == 1 && !fo) {
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
    if (passes(ix.sig + i * ix.w, fm, fn, fo, bt.c_count, ix.w)) some.push_back(i - i0);
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
          // benchmark's): its items are tested once, not once a row
          const bool same = passed_for >= 0 &&
                            std::equal(bt.fmask + b * fw, bt.fmask + (b + 1) * fw, bt.fmask + passed_for * fw) &&
                            std::equal(bt.fneg + b * bt.c_count, bt.fneg + (b + 1) * bt.c_count,
                                       bt.fneg + passed_for * bt.c_count) &&
                            (!bt.fnone || std::equal(bt.fnone + b * fw, bt.fnone + (b + 1) * fw,
                                                     bt.fnone + passed_for * fw));
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
// probe it: its scalar transpose costs about what the row dots of several queries do, so a list
// probed by fewer is cheaper scanned as rows; a lower threshold slowed large batches and never
// transposing slowed the widest vectors (bench/RESULTS.md).
constexpr int64_t kTransposeQueries = 16;

// Int8 scorer. With VNNI and at least kTransposeQueries queries on a list, the list is first
// transposed into blocks of 16 items so that every query's dots need no horizontal sums; otherwise
// rows are scanned as stored. AVX2 always scans rows: a transposed layout gained nothing on an
// AVX2-only AMD EPYC, its 5 instructions per 32 bytes leaving the horizontal
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
              const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl,
              int64_t r) {
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
  // read through raw pointers: an ATen op and .item() per check cost more than a one-query scan's work
  TORCH_CHECK(offsets.data_ptr<int64_t>()[nlist] == n, "offsets[-1] must equal N");
  const int64_t* pp = probes.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(pp, pp + probes.numel(), [nlist](int64_t l) { return l < nlist; }),
              "probe ids must be < nlist");
  Checked c{Index{scales.data_ptr<Scale>(), offsets.data_ptr<int64_t>(), nlist, sig.data_ptr<int64_t>(), sig.size(1)},
            Batch{0, b_count, probes.size(1), probes.data_ptr<int64_t>(), coarse.data_ptr<float>(),
                  fmask.data_ptr<int64_t>(), fneg.data_ptr<bool>(), fmask.size(1), none_ptr(fnone, fmask),
                  excl.data_ptr<int64_t>(), excl.size(1)},
            at::empty({b_count, r}, probes.options()), at::empty({b_count, r}, coarse.options())};
  return c;
}

}  // namespace

// q: float32 [B, D], quantized here to int8 (quantize_queries); codes: int8 [N, D], list-sorted.
std::tuple<at::Tensor, at::Tensor> ivf_scan_int8(
    const at::Tensor& q, const at::Tensor& probes, const at::Tensor& coarse, const at::Tensor& codes,
    const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask,
    const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl, int64_t r, const at::Tensor& floor) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == q.size(1) && codes.is_contiguous(),
              "codes must be contiguous int8 [N, D] with the query's D");
  const int64_t b_count = q.size(0), d = q.size(1);
  auto c = check(b_count, codes.size(0), probes, coarse, scales, offsets, sig, fmask, fneg, fnone, excl, r);
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

// q: float32 [B, D]; codes: float8_e4m3fn [N, D] passed as its uint8 bytes, decoded by lut [256].
std::tuple<at::Tensor, at::Tensor> ivf_scan_fp8(
    const at::Tensor& q, const at::Tensor& codes_u8, const at::Tensor& lut, const at::Tensor& probes,
    const at::Tensor& coarse, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl, int64_t r) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  TORCH_CHECK(codes_u8.dim() == 2 && codes_u8.scalar_type() == at::kByte && codes_u8.size(1) == q.size(1) && codes_u8.is_contiguous(),
              "codes must be contiguous uint8 [N, D] (fp8 bytes) with the query's D");
  TORCH_CHECK(lut.numel() == 256 && lut.scalar_type() == at::kFloat && lut.is_contiguous(), "lut must be float32 [256]");
  const int64_t b_count = q.size(0), d = q.size(1);
  auto c = check(b_count, codes_u8.size(0), probes, coarse, scales, offsets, sig, fmask, fneg, fnone, excl, r);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes_u8.data_ptr<uint8_t>();
  const float* lp = lut.data_ptr<float>();
  const Scale* sc = c.ix.scales;
  scan(c.ix, c.bt, r, c.out_pos.data_ptr<int64_t>(), c.out_score.data_ptr<float>(),
       [&] { return Fp8Scorer{cp, sc, d, qp, lp}; });
  return {c.out_pos, c.out_score};
}

}  // namespace ivf
