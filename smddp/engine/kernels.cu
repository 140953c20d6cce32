// The engine's only device code: the node's fold of its ranks' slices on the GPU (the GPU step,
// docs/gpu.md), one kernel per wire dtype, built to PTX by `make ptx` into kernels_ptx.h, which the
// engine loads through the driver (cuModuleLoadData) so that neither the engine's build nor a user's
// install needs a CUDA toolkit.
//
// Bits: each kernel computes what the daemon's CPU computes for the same call (reduce.h, reduce16.h):
// a left fold over the k inputs in the order given (local-rank order), then one division for an
// average; integers wrap; float16/bfloat16 are widened to float32, folded there and rounded to nearest
// even once. The NaN rules are the CPU's, written out, since the GPU's own differ (its a + b with a NaN
// operand, and inf - inf, give the canonical NaN; x86 keeps the NaN operand's payload, quieted, and
// makes the "default NaN" 0xFFC00000 of inf - inf): a NaN first operand stays, quieted, for a sum; a
// NaN second operand of a sum is the result, quieted; min/max keep a NaN first operand, take a NaN
// second one, else b unless a is strictly smaller/larger; a float16 NaN narrows keeping its top
// payload bits, quieted; a bfloat16 NaN keeps its top 16 bits, quieted. Built with -fmad=false and
// IEEE division (nvcc's default), so nothing is contracted or approximated.
//
// The arguments travel by value (FoldArgs: the layout the engine and the stand-in driver share,
// fold_args.h). Each thread folds elements i, i + stride, ...: `out` may be one of the inputs.

#include "fold_args.h"

namespace {

__device__ __forceinline__ uint32_t fbits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float ffrom(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint64_t dbits(double x) { return (uint64_t)__double_as_longlong(x); }
__device__ __forceinline__ double dfrom(uint64_t u) { return __longlong_as_double((long long)u); }

// x86's a + b for float32, NaN payloads included.
__device__ __forceinline__ float add_f32(float a, float b) {
  if (a != a) return ffrom(fbits(a) | 0x00400000u);
  if (b != b) return ffrom(fbits(b) | 0x00400000u);
  const float s = __fadd_rn(a, b);
  return s != s ? ffrom(0xFFC00000u) : s;  // inf - inf: x86's default NaN
}

__device__ __forceinline__ double add_f64(double a, double b) {
  if (a != a) return dfrom(dbits(a) | 0x0008000000000000ull);
  if (b != b) return dfrom(dbits(b) | 0x0008000000000000ull);
  const double s = __dadd_rn(a, b);
  return s != s ? dfrom(0xFFF8000000000000ull) : s;
}

template <class T>
__device__ __forceinline__ T pick_min(T a, T b) { return ((a != a) | (a < b)) ? a : b; }
template <class T>
__device__ __forceinline__ T pick_max(T a, T b) { return ((a != a) | (a > b)) ? a : b; }

// float32 and float64: the fold, then the division (x86 keeps a NaN's payload through it).
__device__ __forceinline__ float fold_one(const FoldArgs& a, uint64_t i, float) {
  const float* const* s = reinterpret_cast<const float* const*>(a.src);
  float acc = s[0][i];
  for (uint32_t j = 1; j < a.k; j++) {
    const float b = s[j][i];
    acc = a.op <= 2 ? add_f32(acc, b) : a.op == 3 ? pick_min(acc, b) : pick_max(acc, b);
  }
  if (a.divisor != 0 && acc == acc) acc = __fdiv_rn(acc, (float)a.divisor);
  return acc;
}

__device__ __forceinline__ double fold_one(const FoldArgs& a, uint64_t i, double) {
  const double* const* s = reinterpret_cast<const double* const*>(a.src);
  double acc = s[0][i];
  for (uint32_t j = 1; j < a.k; j++) {
    const double b = s[j][i];
    acc = a.op <= 2 ? add_f64(acc, b) : a.op == 3 ? pick_min(acc, b) : pick_max(acc, b);
  }
  if (a.divisor != 0 && acc == acc) acc = __ddiv_rn(acc, (double)a.divisor);
  return acc;
}

// Integers: sums wrap (computed unsigned), an average truncates toward zero.
template <class T, class U>
__device__ __forceinline__ T fold_int(const FoldArgs& a, uint64_t i) {
  const T* const* s = reinterpret_cast<const T* const*>(a.src);
  T acc = s[0][i];
  for (uint32_t j = 1; j < a.k; j++) {
    const T b = s[j][i];
    acc = a.op <= 2 ? (T)(U)((U)acc + (U)b) : a.op == 3 ? (acc < b ? acc : b) : (acc > b ? acc : b);
  }
  if (a.divisor != 0) {
    // In 64 bits, as the CPU's average: a uint8 sum over more than 255 ranks divides correctly.
    if ((T)-1 < (T)0) acc = (T)((int64_t)acc / (int64_t)a.divisor);
    else acc = (T)((uint64_t)acc / a.divisor);
  }
  return acc;
}

__device__ __forceinline__ float half_up(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return ffrom(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return ffrom(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return ffrom(sign);
  uint32_t e = 113;
  while ((man & 0x400u) == 0) {
    man <<= 1;
    e--;
  }
  return ffrom(sign | (e << 23) | ((man & 0x3FFu) << 13));
}

__device__ __forceinline__ uint16_t half_down(float f) {
  const uint32_t u = fbits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
  if (abs < 0x38800000u) {
    if (abs < 0x33000000u) return sign;
    const uint32_t e = abs >> 23;
    const uint32_t man = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = (abs - 0x38000000u) >> 13;
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

__device__ __forceinline__ float bf16_up(uint16_t h) { return ffrom((uint32_t)h << 16); }

__device__ __forceinline__ uint16_t bf16_down(float f) {
  const uint32_t u = fbits(f);
  if (f != f) return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float16/bfloat16: widened, folded in float32 (the first NaN stays), divided, quieted, narrowed.
template <bool kHalf>
__device__ __forceinline__ uint16_t fold16(const FoldArgs& a, uint64_t i) {
  const uint16_t* const* s = reinterpret_cast<const uint16_t* const*>(a.src);
  float acc = kHalf ? half_up(s[0][i]) : bf16_up(s[0][i]);
  for (uint32_t j = 1; j < a.k; j++) {
    const float b = kHalf ? half_up(s[j][i]) : bf16_up(s[j][i]);
    if (acc != acc) continue;
    acc = a.op <= 2 ? (b != b ? b : __fadd_rn(acc, b)) : a.op == 3 ? pick_min(acc, b) : pick_max(acc, b);
    if (acc != acc && b == b) acc = ffrom(0xFFC00000u);  // inf - inf: x86's default NaN
  }
  if (a.divisor != 0 && acc == acc) acc = __fdiv_rn(acc, (float)a.divisor);
  if (acc != acc) acc = ffrom(fbits(acc) | 0x00400000u);
  return kHalf ? half_down(acc) : bf16_down(acc);
}

}  // namespace

#define SMDDP_FOLD(name, T, expr)                                                      \
  extern "C" __global__ void name(const FoldArgs a) {                                 \
    T* out = reinterpret_cast<T*>(a.dst);                                              \
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;                          \
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) \
      out[i] = (expr);                                                                 \
  }

SMDDP_FOLD(smddp_fold_uint8, uint8_t, (fold_int<uint8_t, uint8_t>(a, i)))
SMDDP_FOLD(smddp_fold_int32, int32_t, (fold_int<int32_t, uint32_t>(a, i)))
SMDDP_FOLD(smddp_fold_int64, int64_t, (fold_int<int64_t, uint64_t>(a, i)))
SMDDP_FOLD(smddp_fold_float16, uint16_t, (fold16<true>(a, i)))
SMDDP_FOLD(smddp_fold_bfloat16, uint16_t, (fold16<false>(a, i)))
SMDDP_FOLD(smddp_fold_float32, float, (fold_one(a, i, 0.0f)))
SMDDP_FOLD(smddp_fold_float64, double, (fold_one(a, i, 0.0)))
