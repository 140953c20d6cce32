// Fuzz driver for the reduction kernel (smddp/engine/reduce.*): any dtype, op, input count, length
// and bytes, with `out` a separate buffer or one of the inputs, in exactly-sized heap buffers (so
// AddressSanitizer sees any read or write past an end). Checks what holds for any bytes: what is
// refused and what is not, and that a single input summed is copied unchanged.
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz.h"
#include "reduce.h"

namespace {

bool fail(const char* what, std::uint64_t seed) {
  std::fprintf(stderr, "fuzz_reduce: %s (seed %#llx)\n", what, static_cast<unsigned long long>(seed));
  return false;
}

bool round(fuzz::Rng& r, std::uint64_t seed) {
  const std::uint8_t types[] = {1, 2, 3, 6, 7, 4, 0, 9};
  const std::uint8_t dtype = types[r.next() % 8];
  const std::uint8_t op = static_cast<std::uint8_t>(r.next() % 6);
  const std::size_t k = static_cast<std::size_t>(r.next() % 10);  // 2, 3, 4 and 8: the one-pass loops
  const std::size_t n = static_cast<std::size_t>(r.pick(9000) % 9000);
  const std::size_t size = smddp::dtype_size(dtype) ? smddp::dtype_size(dtype) : 1;
  std::vector<std::unique_ptr<std::uint8_t[]>> bufs;
  std::vector<const void*> in;
  for (std::size_t j = 0; j < k; j++) {
    bufs.emplace_back(new std::uint8_t[n * size + 1]);  // +1: never a zero-size allocation
    for (std::size_t i = 0; i < n * size; i++) bufs.back()[i] = static_cast<std::uint8_t>(r.next());
    in.push_back(bufs.back().get());
  }
  std::unique_ptr<std::uint8_t[]> own(new std::uint8_t[n * size + 1]);
  const bool alias = k > 0 && r.next() % 2 == 0;
  std::uint8_t* out = alias ? bufs[r.next() % k].get() : own.get();
  std::vector<std::uint8_t> first(k > 0 ? bufs[0].get() : own.get(), (k > 0 ? bufs[0].get() : own.get()) + n * size);
  const std::uint64_t divisor = op == 2 ? r.next() % 70 : 0;
  const std::string why = smddp::reduce(dtype, op, in.data(), k, n, out, divisor);
  const bool valid = smddp::reduce_supports(dtype) && op >= 1 && op <= 4 && k > 0;
  if (why.empty() != valid) return fail("accepted what it should refuse, or the reverse", seed);
  if (valid && op == 1 && k == 1 && n > 0 && std::memcmp(out, first.data(), n * size) != 0)  // (no memcmp of null)
    return fail("a single input summed is not copied unchanged", seed);
  return true;
}

}  // namespace

SMDDP_FUZZ_MAIN("fuzz_reduce", 0x5eedf00d, round)
