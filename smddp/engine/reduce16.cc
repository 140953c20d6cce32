// The 16-bit float reduction kernel: portable bfloat16 loops (the compiler vectorises them) and
// float16 through F16C, chosen at run time.
#include "reduce16.h"

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
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

// One block of bfloat16; true if it holds a NaN (then `out` is left as it was).
bool block_bf16(const std::uint16_t* const* in, std::size_t k, std::size_t off, std::size_t m, std::uint16_t* out,
                Fold op, float divisor) {
  float acc[kReduceBlock];
  const std::uint16_t* x0 = in[0] + off;
  for (std::size_t i = 0; i < m; i++) acc[i] = bf16_up(x0[i]);
  for (std::size_t j = 1; j < k; j++) {
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

#if SMDDP_X86
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

bool have_f16c() {
#if SMDDP_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

void reduce16(Half kind, Fold op, const std::uint16_t* const* in, std::size_t k, std::size_t n, std::uint16_t* out,
              float divisor, std::vector<std::size_t>* nan_blocks) {
  bool (*block)(const std::uint16_t* const*, std::size_t, std::size_t, std::size_t, std::uint16_t*, Fold, float) =
      block_bf16;
#if SMDDP_X86
  if (kind == Half::kFloat16) block = block_f16;
#else
  (void)kind;
#endif
  for (std::size_t b = 0, off = 0; off < n; ++b, off += kReduceBlock) {
    const std::size_t m = (n - off < kReduceBlock) ? n - off : kReduceBlock;
    if (block(in, k, off, m, out, op, divisor)) nan_blocks->push_back(b);
  }
}

}  // namespace smddp
