// Left folds over blocks that stay in L1: every input's block is read before the block of `out` is
// written, which is what lets `out` alias an input.
#include "reduce.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "reduce16.h"
#include "wire.h"

namespace smddp {
namespace {

constexpr std::size_t kBlockBytes = 16 << 10;

template <class T>
struct Bits;
template <>
struct Bits<float> {
  using U = std::uint32_t;
  static constexpr U kQuiet = 0x00400000u;
};
template <>
struct Bits<double> {
  using U = std::uint64_t;
  static constexpr U kQuiet = 0x0008000000000000ull;
};

template <class T>
inline typename Bits<T>::U bits(T x) {
  typename Bits<T>::U u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

template <class T>
inline T from_bits(typename Bits<T>::U u) {
  T x;
  std::memcpy(&x, &u, sizeof u);
  return x;
}

// Plain addition: what the loops run. For floats a block whose result holds a NaN is then redone
// with ExactSum (a NaN operand always makes the sum a NaN, so no NaN is missed).
template <class T>
struct Sum {
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      return a + b;
    } else {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));  // wraps, as numpy
    }
  }
};

// The NaN rule of a sum, spelled out: a NaN first operand, quieted; else the hardware's a + b, whose
// only possible NaN operand is b (or no operand: inf - inf gives the CPU's default NaN).
template <class T>
struct ExactSum {
  T operator()(T a, T b) const {
    const T s = a + b;
    return from_bits<T>(a != a ? (bits(a) | Bits<T>::kQuiet) : bits(s));
  }
};

// Branch-free selects, so the compiler vectorises them; a NaN operand is kept as it is (the first).
template <class T>
struct Min {
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) return ((a != a) | (a < b)) ? a : b;  // b NaN: a < b is false
    else return a < b ? a : b;
  }
};

template <class T>
struct Max {
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) return ((a != a) | (a > b)) ? a : b;
    else return a > b ? a : b;
  }
};

template <class T>
inline T average(T sum, std::uint64_t divisor) {
  if constexpr (std::is_floating_point_v<T>) {
    return sum / static_cast<T>(divisor);
  } else if constexpr (std::is_signed_v<T>) {
    // C division truncates toward zero, as numpy's floor division plus a correction does.
    return static_cast<T>(static_cast<std::int64_t>(sum) / static_cast<std::int64_t>(divisor));
  } else {
    return static_cast<T>(static_cast<std::uint64_t>(sum) / divisor);
  }
}

// K inputs (a node's workers, or its peers' partials: a few) folded in one pass over the block: each
// element read once from every input and written once, the same left fold as the loop below.
template <std::size_t K, class T, class F>
[[gnu::always_inline]] inline void fold_fused(const void* const* in_raw, std::size_t i0, std::size_t m, T* acc, F f) {
  const T* x[K];
  for (std::size_t j = 0; j < K; j++) x[j] = static_cast<const T*>(in_raw[j]) + i0;
  for (std::size_t i = 0; i < m; i++) {
    T s = f(x[0][i], x[1][i]);
    for (std::size_t j = 2; j < K; j++) s = f(s, x[j][i]);
    acc[i] = s;
  }
}

template <class T, class F>
[[gnu::always_inline]] inline void fold_block(const void* const* in_raw, std::size_t k, std::size_t i0, std::size_t m,
                                              T* acc, F f) {
  const T* a = static_cast<const T*>(in_raw[0]) + i0;
  switch (k) {
    case 1: std::memmove(acc, a, m * sizeof(T)); return;
    case 2: fold_fused<2>(in_raw, i0, m, acc, f); return;
    case 3: fold_fused<3>(in_raw, i0, m, acc, f); return;
    case 4: fold_fused<4>(in_raw, i0, m, acc, f); return;
    case 8: fold_fused<8>(in_raw, i0, m, acc, f); return;
    default: break;
  }
  const T* b = static_cast<const T*>(in_raw[1]) + i0;
  for (std::size_t i = 0; i < m; i++) acc[i] = f(a[i], b[i]);
  for (std::size_t j = 2; j < k; j++) {
    const T* c = static_cast<const T*>(in_raw[j]) + i0;
    for (std::size_t i = 0; i < m; i++) acc[i] = f(acc[i], c[i]);
  }
}

template <class T>
[[gnu::always_inline]] inline bool any_nan(const T* x, std::size_t m) {
  int nan = 0;  // an int, not a bool, keeps the loop vectorised
  for (std::size_t i = 0; i < m; i++) nan |= x[i] != x[i];
  return nan != 0;
}

template <class T, class F>
[[gnu::always_inline]] inline void fold(const void* const* in_raw, std::size_t k, std::size_t n, void* out_raw, std::uint64_t divisor, F f) {
  constexpr std::size_t kB = kBlockBytes / sizeof(T);
  T acc[kB];
  T* out = static_cast<T*>(out_raw);
  for (std::size_t i0 = 0; i0 < n; i0 += kB) {
    const std::size_t m = n - i0 < kB ? n - i0 : kB;
    // Every input's block is read before `out`'s block is written, so `out` may be any input.
    fold_block<T>(in_raw, k, i0, m, acc, f);
    if constexpr (std::is_floating_point_v<T> && std::is_same_v<F, Sum<T>>) {
      if (k > 1 && any_nan(acc, m)) fold_block<T>(in_raw, k, i0, m, acc, ExactSum<T>{});
    }
    if (divisor != 0)
      for (std::size_t i = 0; i < m; i++) acc[i] = average(acc[i], divisor);
    std::memcpy(out + i0, acc, m * sizeof(T));
  }
}

template <class T>
[[gnu::always_inline]] inline std::string typed(std::uint8_t op, const void* const* in, std::size_t k, std::size_t n, void* out,
                         std::uint64_t divisor) {
  switch (op) {
    case static_cast<std::uint8_t>(ReduceOp::kSum): fold<T>(in, k, n, out, 0, Sum<T>{}); return {};
    case static_cast<std::uint8_t>(ReduceOp::kAvg): fold<T>(in, k, n, out, divisor, Sum<T>{}); return {};
    case static_cast<std::uint8_t>(ReduceOp::kMin): fold<T>(in, k, n, out, 0, Min<T>{}); return {};
    case static_cast<std::uint8_t>(ReduceOp::kMax): fold<T>(in, k, n, out, 0, Max<T>{}); return {};
    default: return "unknown reduce op " + std::to_string(op);
  }
}

[[gnu::always_inline]] inline std::string any_type(std::uint8_t dtype, std::uint8_t op, const void* const* in,
                                                   std::size_t k, std::size_t n, void* out, std::uint64_t divisor) {
  switch (dtype) {
    case static_cast<std::uint8_t>(DType::kUint8): return typed<std::uint8_t>(op, in, k, n, out, divisor);
    case static_cast<std::uint8_t>(DType::kInt32): return typed<std::int32_t>(op, in, k, n, out, divisor);
    case static_cast<std::uint8_t>(DType::kInt64): return typed<std::int64_t>(op, in, k, n, out, divisor);
    case static_cast<std::uint8_t>(DType::kFloat32): return typed<float>(op, in, k, n, out, divisor);
    case static_cast<std::uint8_t>(DType::kFloat64): return typed<double>(op, in, k, n, out, divisor);
    default: return "dtype " + std::to_string(dtype) + " has no kernel here (16-bit floats: reduce16)";
  }
}

// The same loops compiled for the baseline and, on x86-64, for AVX2, chosen per call by the CPU (as
// numpy does): same source, same operations, same bits. A plain runtime check rather than an ifunc
// (target_clones), which the sanitizers' runtimes cannot start under.
std::string any_type_base(std::uint8_t dtype, std::uint8_t op, const void* const* in, std::size_t k, std::size_t n,
                          void* out, std::uint64_t divisor) {
  return any_type(dtype, op, in, k, n, out, divisor);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) std::string any_type_avx2(std::uint8_t dtype, std::uint8_t op, const void* const* in,
                                                          std::size_t k, std::size_t n, void* out,
                                                          std::uint64_t divisor) {
  return any_type(dtype, op, in, k, n, out, divisor);
}
#endif

}  // namespace

bool reduce_supports(std::uint8_t dtype) {
  const DTypeInfo* d = dtype_info(dtype);
  return d != nullptr && !d->widened;
}

std::size_t dtype_size(std::uint8_t dtype) {
  const DTypeInfo* d = dtype_info(dtype);
  return d != nullptr ? d->itemsize : 0;
}

std::string reduce(std::uint8_t dtype, std::uint8_t op, const void* const* in, std::size_t k, std::size_t n, void* out,
                   std::uint64_t divisor) {
  if (k == 0) return "nothing to reduce";
#if defined(__x86_64__) && defined(__GNUC__)
  if (have_avx2()) return any_type_avx2(dtype, op, in, k, n, out, divisor);
#endif
  return any_type_base(dtype, op, in, k, n, out, divisor);
}

std::string reduce_wire(std::uint8_t dtype, std::uint8_t op, const void* const* in, std::size_t k, std::size_t n,
                        void* out, std::uint64_t divisor) {
  const DTypeInfo* d = dtype_info(dtype);
  if (d == nullptr) return "unknown dtype " + std::to_string(dtype);
  if (!d->widened) return reduce(dtype, op, in, k, n, out, divisor);
  if (k == 0) return "nothing to reduce";
  Fold f = Fold::kSum;
  switch (op) {
    case static_cast<std::uint8_t>(ReduceOp::kSum): break;
    case static_cast<std::uint8_t>(ReduceOp::kAvg): break;
    case static_cast<std::uint8_t>(ReduceOp::kMin): f = Fold::kMin; break;
    case static_cast<std::uint8_t>(ReduceOp::kMax): f = Fold::kMax; break;
    default: return "unknown reduce op " + std::to_string(op);
  }
  const Half half = dtype == static_cast<std::uint8_t>(DType::kFloat16) ? Half::kFloat16 : Half::kBfloat16;
  const float div = op == static_cast<std::uint8_t>(ReduceOp::kAvg) ? static_cast<float>(divisor) : 0.0f;
  std::vector<const std::uint16_t*> in16(k);
  for (std::size_t i = 0; i < k; i++) in16[i] = static_cast<const std::uint16_t*>(in[i]);
  auto* out16 = static_cast<std::uint16_t*>(out);
  std::vector<std::size_t> nan_blocks;
  if (half == Half::kFloat16 && !have_f16c()) {
    for (std::size_t b = 0; b * kReduceBlock < n; b++) nan_blocks.push_back(b);  // all by the portable path
  } else {
    reduce16(half, f, in16.data(), k, n, out16, div, &nan_blocks);
  }
  for (std::size_t b : nan_blocks) reduce16_nan_block(half, f, in16.data(), k, n, b, out16, div);
  return {};
}

}  // namespace smddp
