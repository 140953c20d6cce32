// Bounded fuzz of the engine's frame decoder, built with AddressSanitizer+UBSan and with ThreadSanitizer
// (make engine-sanitize). Any bytes must give a header or a reason, never a crash or an out-of-bounds
// read; a decoded header must encode back to the same 56 bytes.
//
// usage: fuzz_frame [--seconds S] [--threads T] [--seed N]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "frame.h"

namespace {

struct Rng {  // xorshift64*: reproducible from --seed, no library state shared between threads
  std::uint64_t s;
  std::uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
};

// A valid header to mutate from: the fuzz then explores near the accepted set, not only garbage.
void valid(Rng& r, std::uint8_t out[smddp::kHeaderSize]) {
  static const std::uint8_t kTypes[] = {1, 2, 3, 10, 11, 12, 20, 21, 30, 31, 32, 33, 40, 41, 42, 43, 44};
  smddp::Header h;
  h.type = static_cast<smddp::Msg>(kTypes[r.next() % sizeof(kTypes)]);
  const bool fp = h.type == smddp::Msg::kSubmit || h.type == smddp::Msg::kDone || h.type == smddp::Msg::kPartial ||
                  h.type == smddp::Msg::kResult || h.type == smddp::Msg::kBlock;
  if (fp) {
    h.dtype = static_cast<std::uint8_t>(1 + r.next() % 7);
    h.kind = static_cast<std::uint8_t>(1 + r.next() % 5);
    h.op = static_cast<std::uint8_t>(r.next() % 5);
  }
  h.sender = static_cast<std::uint32_t>(r.next());
  h.seq = r.next() >> 1;
  h.shard = static_cast<std::uint32_t>(r.next());
  h.aux = static_cast<std::uint32_t>(r.next());
  h.offset = r.next() >> 1;
  h.count = r.next() >> 1;
  h.length = 0;
  if (!smddp::encode_header(h, out).empty()) std::abort();  // every header built here is valid
}

int fuzz(std::uint64_t seed, double seconds, std::uint64_t* done) {
  Rng r{seed | 1};
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::uint64_t n = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (int i = 0; i < 1000; ++i, ++n) {
      // Exactly `len` bytes on the heap, so that a read past them is an ASan report, not luck.
      const std::size_t len = (r.next() % 4 == 0) ? r.next() % 120 : smddp::kHeaderSize;
      std::unique_ptr<std::uint8_t[]> buf(new std::uint8_t[len ? len : 1]);
      if (len == smddp::kHeaderSize && r.next() % 2) {
        valid(r, buf.get());
        for (std::uint64_t k = r.next() % 4; k > 0; --k) buf[r.next() % len] ^= static_cast<std::uint8_t>(1u << (r.next() % 8));
      } else {
        for (std::size_t k = 0; k < len; ++k) buf[k] = static_cast<std::uint8_t>(r.next());
      }
      smddp::Header h;
      const std::string why = smddp::decode_header(buf.get(), len, &h);
      if (why.empty()) {
        std::uint8_t again[smddp::kHeaderSize];
        if (!smddp::encode_header(h, again).empty() || std::memcmp(again, buf.get(), smddp::kHeaderSize) != 0) {
          std::fprintf(stderr, "fuzz_frame: a decoded header does not encode back to its bytes (seed %llu)\n",
                       static_cast<unsigned long long>(seed));
          return 1;
        }
      }
    }
  }
  *done = n;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 5;
  int threads = 1;
  std::uint64_t seed = 0x5eed;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--seconds") seconds = std::atof(argv[i + 1]);
    else if (flag == "--threads") threads = std::atoi(argv[i + 1]);
    else if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 0);
  }
  std::vector<std::thread> pool;
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(threads), 0);
  std::vector<int> rcs(static_cast<std::size_t>(threads), 0);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { rcs[static_cast<std::size_t>(t)] = fuzz(seed + static_cast<std::uint64_t>(t), seconds, &counts[static_cast<std::size_t>(t)]); });
  std::uint64_t total = 0;
  int rc = 0;
  for (int t = 0; t < threads; ++t) {
    pool[static_cast<std::size_t>(t)].join();
    total += counts[static_cast<std::size_t>(t)];
    rc |= rcs[static_cast<std::size_t>(t)];
  }
  std::printf("fuzz_frame: %llu inputs on %d thread(s), seed %#llx: %s\n", static_cast<unsigned long long>(total),
              threads, static_cast<unsigned long long>(seed), rc ? "FAILED" : "no crash, no mismatch");
  return rc;
}
