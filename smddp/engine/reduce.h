// The reduction kernel for the types reduced in their own width: uint8, int32, int64, float32, float64.
//
// It computes exactly what numpy's ufuncs compute for the same call (tests/engine/test_reduce.py,
// tests/reference.py): fold the inputs left to right element by element, then divide once for an
// average. Integers wrap on overflow (two's complement, as numpy's add) and an integer average
// truncates toward zero. For floats the NaN rules are spelled out rather than left to which operand
// order the compiler picks: a + b is a quieted copy of a when a is a NaN (otherwise the hardware's
// a + b, whose only NaN operand can be b); minimum/maximum keep a NaN operand as it is, the first
// one, and otherwise take b unless a is strictly smaller/larger (so of +0 and -0 the second). The
// 16-bit floats have their own kernel (reduce16.h). Pure: no Python, no allocation, no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace smddp {

// Wire codes (wire.h): every dtype but the 16-bit floats (reduce16.h sums those); ops sum, average,
// min, max.
bool reduce_supports(std::uint8_t dtype);
std::size_t dtype_size(std::uint8_t dtype);  // 0 for a code that is none

// out[i] = fold(in[0][i], ..., in[k-1][i]) for i < n, then / divisor for an average (divisor 0: a
// plain sum, the node partial of an average). `out` may alias any input element-wise. Returns ""
// or why the call is refused (unsupported dtype or op, no inputs); then nothing is written.
std::string reduce(std::uint8_t dtype, std::uint8_t op, const void* const* in, std::size_t k, std::size_t n, void* out,
                   std::uint64_t divisor);

// What the daemon runs for any wire dtype: reduce() above, or for float16/bfloat16 reduce16 with its
// NaN blocks written by reduce16_nan_block (reduce16.h), so every block follows the engine's rules.
// Same contract as reduce(); float16 without F16C goes element by element.
std::string reduce_wire(std::uint8_t dtype, std::uint8_t op, const void* const* in, std::size_t k, std::size_t n,
                        void* out, std::uint64_t divisor);

}  // namespace smddp
