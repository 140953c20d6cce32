// What the engine's fuzz drivers share: a seeded generator and the threaded, time-bounded main loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace fuzz {

// xorshift64*: reproducible from --seed, no library state shared between threads. Under libFuzzer
// (SMDDP_LIBFUZZER) the values come from the input's bytes instead, 8 at a time (then zeros): the
// coverage-guided mutator then steers every choice a round makes, not only the bytes it decodes.
struct Rng {
  std::uint64_t s;
  const std::uint8_t* tape = nullptr;
  std::size_t tape_len = 0;
  std::size_t tape_pos = 0;
  std::uint64_t next() {
    if (tape != nullptr) {
      std::uint64_t v = 0;
      for (int i = 0; i < 8 && tape_pos < tape_len; ++i) v |= static_cast<std::uint64_t>(tape[tape_pos++]) << (8 * i);
      return v;
    }
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  // Mostly small values, sometimes any 64-bit value: the bounds live at both ends. (`small` may
  // have wrapped to 0 in a caller's arithmetic on huge values: then any value.)
  std::uint64_t pick(std::uint64_t small) { return (next() % 4 == 0 || small == 0) ? next() : next() % small; }
};

// One round of `name`'s checks: returns false (after printing why) on a failed check.
using Round = bool (*)(Rng& r, std::uint64_t seed);

// usage: DRIVER [--seconds S] [--threads T] [--seed N]; runs rounds on T threads for S seconds.
inline int main(int argc, char** argv, const char* name, std::uint64_t default_seed, Round round) {
  double seconds = 5;
  int threads = 1;
  std::uint64_t seed = default_seed;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--seconds") seconds = std::atof(argv[i + 1]);
    else if (flag == "--threads") threads = std::atoi(argv[i + 1]);
    else if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 0);
  }
  std::vector<std::thread> pool;
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(threads), 0);
  std::vector<int> failed(static_cast<std::size_t>(threads), 0);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const auto k = static_cast<std::size_t>(t);
      const std::uint64_t s = seed + k;
      Rng r{s | 1};
      const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      while (!failed[k] && std::chrono::steady_clock::now() < end) {
        for (int i = 0; i < 1000 && !failed[k]; ++i, ++counts[k]) failed[k] = !round(r, s);
      }
    });
  }
  std::uint64_t total = 0;
  int rc = 0;
  for (std::size_t t = 0; t < pool.size(); ++t) {
    pool[t].join();
    total += counts[t];
    rc |= failed[t];
  }
  std::printf("%s: %llu inputs on %d thread(s), seed %#llx: %s\n", name, static_cast<unsigned long long>(total),
              threads, static_cast<unsigned long long>(seed), rc ? "FAILED" : "no crash, no failed check");
  return rc;
}

}  // namespace fuzz

// Each driver ends with SMDDP_FUZZ_MAIN(name, seed, round): the time-bounded generator driver above
// (g++, make engine-sanitize), or a libFuzzer target (clang -fsanitize=fuzzer -DSMDDP_LIBFUZZER, make
// engine-fuzz and make fuzz) whose input is the round's tape of choices; a failed check aborts, so
// libFuzzer keeps the input as a crash.
#ifdef SMDDP_LIBFUZZER
#define SMDDP_FUZZ_MAIN(name, seed, round)                                                \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {   \
    fuzz::Rng r{(seed) | 1, data, size, 0};                                             \
    if (!round(r, 0)) std::abort();                                                     \
    return 0;                                                                           \
  }
#else
#define SMDDP_FUZZ_MAIN(name, seed, round) \
  int main(int argc, char** argv) { return fuzz::main(argc, argv, name, seed, round); }
#endif
