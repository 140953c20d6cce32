// Bounded fuzz of the engine's frame decoder, built with AddressSanitizer+UBSan and with ThreadSanitizer
// (make engine-sanitize). Any bytes must give a header or a reason, never a crash or an out-of-bounds
// read; a decoded header must encode back to the same 56 bytes.
#include <cstring>
#include <memory>

#include "frame.h"
#include "fuzz.h"

namespace {

// A valid header to mutate from: the fuzz then explores near the accepted set, not only garbage.
void valid(fuzz::Rng& r, std::uint8_t out[smddp::kHeaderSize]) {
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

bool round(fuzz::Rng& r, std::uint64_t seed) {
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
  if (!smddp::decode_header(buf.get(), len, &h).empty()) return true;
  std::uint8_t again[smddp::kHeaderSize];
  if (smddp::encode_header(h, again).empty() && std::memcmp(again, buf.get(), smddp::kHeaderSize) == 0) return true;
  std::fprintf(stderr, "fuzz_frame: a decoded header does not encode back to its bytes (seed %llu)\n",
               static_cast<unsigned long long>(seed));
  return false;
}

}  // namespace

SMDDP_FUZZ_MAIN("fuzz_frame", 0x5eed, round)
