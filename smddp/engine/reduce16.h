// The 16-bit float reduction kernel (float16, bfloat16), accumulated in float32.
//
// It computes exactly what numpy's ufuncs compute (tests/reference.py): widen every input to float32,
// fold left to right (+, or numpy's minimum/maximum, which keep the first operand only when it is
// strictly smaller/larger or NaN), divide once for an average, round to nearest even once at the
// end. NaN payload rules are where compiled code and numpy could disagree (which NaN a+b returns,
// how a signalling NaN narrows), so a block whose float32 result holds a NaN is not written: its
// index is reported and the caller writes that block with reduce16_nan_block (reduce_wire in
// reduce.cc does). Pure: no Python, no allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace smddp {

enum class Half : int { kFloat16 = 0, kBfloat16 = 1 };
enum class Fold : int { kSum = 0, kMin = 1, kMax = 2 };

constexpr std::size_t kReduceBlock = 2048;  // elements per block: 8 KiB of float32 accumulator, in L1

// Whether the CPU runs AVX2 (x86-64): the kernels' AVX2 builds are chosen by it, per call. Asked of
// the CPU once.
bool have_avx2();
// Whether float16 can be reduced here (x86-64 with AVX2 and F16C); bfloat16 always can.
bool have_f16c();

// out[i] = fold(in[0][i], in[1][i], ...) / divisor (divisor 0: none) for i < n; `out` may alias an
// input element-wise. Appends to `nan_blocks` the blocks left unwritten because they hold a NaN.
// Requires k >= 1, every in[j] and out holding n elements, and have_f16c() for float16.
// `portable`: bfloat16 by the baseline's loops even where the AVX2 ones would run (their tests
// compare the two: the same bits).
void reduce16(Half kind, Fold op, const std::uint16_t* const* in, std::size_t k, std::size_t n,
              std::uint16_t* out, float divisor, std::vector<std::size_t>* nan_blocks, bool portable = false);

// Writes block `block` of a reduce16 call that left it (it holds a NaN), element by element, by the
// engine's own NaN rule (reduce.h): where a NaN meets a value the first NaN is kept, quieted for a
// sum; a float16 NaN narrows keeping its top payload bits, quieted; a bfloat16 NaN as numpy narrows
// it. For callers that cannot hand the block to numpy (the engine's own threads). Needs no F16C.
void reduce16_nan_block(Half kind, Fold op, const std::uint16_t* const* in, std::size_t k, std::size_t n,
                        std::size_t block, std::uint16_t* out, float divisor);

// Exact float16 <-> float32 conversions without F16C (round to nearest even when narrowing).
float half_to_float(std::uint16_t h);
std::uint16_t float_to_half(float f);

}  // namespace smddp
