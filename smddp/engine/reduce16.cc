// The 16-bit float reduction kernel: portable bfloat16 loops (the compiler vectorises them, for the
// baseline and for AVX2) and float16 through F16C, chosen at run time.
#include "reduce16.h"

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define SMDDP_X86 1
#else
#define SMDDP_X86 0
#endif

namespace smddp {
namespace {

// minimum(a, b) is a only when a < b (or a is NaN), so b is taken for equal values (+0 and -0), as
// numpy does. A NaN on either side reaches the result (which one does not matter: numpy redoes it).
inline float fold(float a, float b, Fold op) {
  if (op == Fold::kSum) return a + b;
  if (op == Fold::kMin) return (a < b || a != a) ? a : b;
  return (a > b || a != a) ? a : b;
}

inline float bf16_up(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; only called on non-NaN values.
inline std::uint16_t bf16_down(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// K bfloat16 inputs folded into `acc` in one pass (as reduce.cc's fold_fused): the same left fold as
// the input-at-a-time loops in bf16_block, so the same bits.
template <std::size_t K, Fold kOp>
[[gnu::always_inline]] inline void bf16_fused(const std::uint16_t* const* in, std::size_t off, std::size_t m,
                                              float* acc) {
  const std::uint16_t* x[K];
  for (std::size_t j = 0; j < K; j++) x[j] = in[j] + off;
  for (std::size_t i = 0; i < m; i++) {
    float s = fold(bf16_up(x[0][i]), bf16_up(x[1][i]), kOp);
    for (std::size_t j = 2; j < K; j++) s = fold(s, bf16_up(x[j][i]), kOp);
    acc[i] = s;
  }
}

template <std::size_t K>
[[gnu::always_inline]] inline void bf16_fused(const std::uint16_t* const* in, std::size_t off, std::size_t m,
                                              float* acc, Fold op) {
  if (op == Fold::kSum) bf16_fused<K, Fold::kSum>(in, off, m, acc);
  else if (op == Fold::kMin) bf16_fused<K, Fold::kMin>(in, off, m, acc);
  else bf16_fused<K, Fold::kMax>(in, off, m, acc);
}

// One block of bfloat16; true if it holds a NaN (then `out` is left as it was). Plain loops the
// compiler vectorises: compiled for the baseline and again for AVX2 below (as reduce.cc does), the
// same operations in the same order either way, so the same bits.
[[gnu::always_inline]] inline bool bf16_block(const std::uint16_t* const* in, std::size_t k, std::size_t off,
                                              std::size_t m, std::uint16_t* out, Fold op, float divisor) {
  alignas(32) float acc[kReduceBlock];
  const std::uint16_t* x0 = in[0] + off;
  std::size_t folded = k;  // inputs already in `acc`
  switch (k) {
    case 2: bf16_fused<2>(in, off, m, acc, op); break;
    case 3: bf16_fused<3>(in, off, m, acc, op); break;
    case 4: bf16_fused<4>(in, off, m, acc, op); break;
    case 8: bf16_fused<8>(in, off, m, acc, op); break;
    default:
      for (std::size_t i = 0; i < m; i++) acc[i] = bf16_up(x0[i]);
      folded = 1;
  }
  for (std::size_t j = folded; j < k; j++) {
    const std::uint16_t* x = in[j] + off;
    if (op == Fold::kSum) {
      for (std::size_t i = 0; i < m; i++) acc[i] = acc[i] + bf16_up(x[i]);
    } else if (op == Fold::kMin) {
      for (std::size_t i = 0; i < m; i++) acc[i] = fold(acc[i], bf16_up(x[i]), Fold::kMin);
    } else {
      for (std::size_t i = 0; i < m; i++) acc[i] = fold(acc[i], bf16_up(x[i]), Fold::kMax);
    }
  }
  if (divisor != 0.0f)
    for (std::size_t i = 0; i < m; i++) acc[i] = acc[i] / divisor;
  int nan = 0;  // an int, not a bool: the compiler vectorises this OR-reduction, not a bool's
  for (std::size_t i = 0; i < m; i++) nan |= acc[i] != acc[i];
  if (nan) return true;
  std::uint16_t* o = out + off;
  for (std::size_t i = 0; i < m; i++) o[i] = bf16_down(acc[i]);
  return false;
}

bool block_bf16(const std::uint16_t* const* in, std::size_t k, std::size_t off, std::size_t m, std::uint16_t* out,
                Fold op, float divisor) {
  return bf16_block(in, k, off, m, out, op, divisor);
}

#if SMDDP_X86
// The bfloat16 loops at 8 lanes: at the baseline's 4 they summed 14.3 GB/s of input on one core
// where float16 through F16C summed 23.3 (4 inputs of 16 MiB).
__attribute__((target("avx2"))) bool block_bf16_avx2(const std::uint16_t* const* in, std::size_t k, std::size_t off,
                                                     std::size_t m, std::uint16_t* out, Fold op, float divisor) {
  return bf16_block(in, k, off, m, out, op, divisor);
}

// float16 with F16C conversions, 8 lanes at a time.
__attribute__((target("avx2,f16c"))) bool block_f16(const std::uint16_t* const* in, std::size_t k, std::size_t off,
                                                    std::size_t m, std::uint16_t* out, Fold op, float divisor) {
  alignas(32) float acc[kReduceBlock];
  const std::size_t v = m & ~static_cast<std::size_t>(7);
  const std::uint16_t* x0 = in[0] + off;
  for (std::size_t i = 0; i < v; i += 8)
    _mm256_store_ps(acc + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x0 + i))));
  for (std::size_t i = v; i < m; i++) acc[i] = _cvtsh_ss(x0[i]);
  for (std::size_t j = 1; j < k; j++) {
    const std::uint16_t* x = in[j] + off;
    for (std::size_t i = 0; i < v; i += 8) {
      const __m256 a = _mm256_load_ps(acc + i);
      const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
      __m256 r;
      if (op == Fold::kSum) {
        r = _mm256_add_ps(a, b);
      } else if (op == Fold::kMin) {  // a where a < b or a is NaN, else b: as fold()
        r = _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_LT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
      } else {
        r = _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
      }
      _mm256_store_ps(acc + i, r);
    }
    for (std::size_t i = v; i < m; i++) acc[i] = fold(acc[i], _cvtsh_ss(x[i]), op);
  }
  if (divisor != 0.0f) {
    const __m256 d = _mm256_set1_ps(divisor);
    for (std::size_t i = 0; i < v; i += 8) _mm256_store_ps(acc + i, _mm256_div_ps(_mm256_load_ps(acc + i), d));
    for (std::size_t i = v; i < m; i++) acc[i] = acc[i] / divisor;
  }
  __m256 nan = _mm256_setzero_ps();
  for (std::size_t i = 0; i < v; i += 8) {
    const __m256 a = _mm256_load_ps(acc + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (std::size_t i = v; i < m; i++) has_nan |= acc[i] != acc[i];
  if (has_nan) return true;
  std::uint16_t* o = out + off;
  for (std::size_t i = 0; i < v; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                     _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT));
  for (std::size_t i = v; i < m; i++) o[i] = _cvtss_sh(acc[i], _MM_FROUND_TO_NEAREST_INT);
  return false;
}
#endif

}  // namespace

// Both asked once: every reduction asks (the daemon's, per chunk), and in a virtual machine CPUID
// traps to the hypervisor (asked per call, it cost a 4 KiB float16 sum of 4 inputs 8 us against 1 us).
bool have_avx2() {
#if SMDDP_X86
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

bool have_f16c() {
#if SMDDP_X86
  static const bool yes = [] {
    // F16C from CPUID leaf 1 (ECX bit 29) itself: clang's __builtin_cpu_supports does not know "f16c".
    // (AVX2's check includes the OS's saving of the YMM registers, which F16C's instructions use too.)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    return have_avx2() && f16c;
  }();
  return yes;
#else
  return false;
#endif
}

void reduce16(Half kind, Fold op, const std::uint16_t* const* in, std::size_t k, std::size_t n, std::uint16_t* out,
              float divisor, std::vector<std::size_t>* nan_blocks, bool portable) {
  bool (*block)(const std::uint16_t* const*, std::size_t, std::size_t, std::size_t, std::uint16_t*, Fold, float) =
      block_bf16;
#if SMDDP_X86
  if (kind == Half::kFloat16) block = block_f16;  // (the callers check have_f16c(), which includes AVX2)
  else if (!portable && have_avx2()) block = block_bf16_avx2;
#else
  (void)kind;
  (void)portable;
#endif
  for (std::size_t b = 0, off = 0; off < n; ++b, off += kReduceBlock) {
    const std::size_t m = (n - off < kReduceBlock) ? n - off : kReduceBlock;
    if (block(in, k, off, m, out, op, divisor)) nan_blocks->push_back(b);
  }
}

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t man = h & 0x3FFu;
  std::uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);  // inf, or NaN with its payload
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    std::uint32_t e = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      e--;
    }
    u = sign | (e << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint16_t float_to_half(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // NaN, quiet
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf (or is inf)
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero, rounded to nearest even
    if (abs < 0x33000000u) return sign;  // under half the smallest subnormal
    const std::uint32_t e = abs >> 23;
    const std::uint32_t man = (abs & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // 14..24
    std::uint32_t h = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = ((abs - 0x38000000u) >> 13);  // rebias exponent, keep 10 mantissa bits
  const std::uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return static_cast<std::uint16_t>(sign | h);
}

void reduce16_nan_block(Half kind, Fold op, const std::uint16_t* const* in, std::size_t k, std::size_t n,
                        std::size_t block, std::uint16_t* out, float divisor) {
  const std::size_t off = block * kReduceBlock;
  if (off >= n) return;
  const std::size_t m = (n - off < kReduceBlock) ? n - off : kReduceBlock;
  auto up = [kind](std::uint16_t x) { return kind == Half::kFloat16 ? half_to_float(x) : bf16_up(x); };
  for (std::size_t i = off; i < off + m; i++) {
    float acc = up(in[0][i]);
    for (std::size_t j = 1; j < k; j++) {
      const float b = up(in[j][i]);
      if (acc != acc) continue;  // the first NaN stays
      acc = fold(acc, b, op);
    }
    if (divisor != 0.0f) acc = acc / divisor;
    std::uint32_t u;
    std::memcpy(&u, &acc, 4);
    if (acc != acc) u |= 0x00400000u;  // quieted
    std::memcpy(&acc, &u, 4);
    if (kind == Half::kFloat16) {
      out[i] = float_to_half(acc);
    } else {
      out[i] = acc != acc ? static_cast<std::uint16_t>((u >> 16) | 0x0040u) : bf16_down(acc);
    }
  }
}

}  // namespace smddp
