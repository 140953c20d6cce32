// Bounded fuzz of the ofi fabric's wire decoders (ofi_wire.h), built with AddressSanitizer+UBSan and
// with ThreadSanitizer (make engine-sanitize): a message prefix and a stream hello from any bytes of
// any length give a value or a reason, never a crash or a read past the bytes; what decodes encodes
// back to the same bytes; a frame's parts are accepted only when they cover its length exactly.
#include <cstring>
#include <memory>
#include <vector>

#include "frame.h"
#include "fuzz.h"
#include "ofi_wire.h"

namespace {

namespace w = smddp::ofi_wire;

bool fail(const char* what, std::uint64_t seed) {
  std::fprintf(stderr, "fuzz_ofi_wire: %s (seed %llu)\n", what, static_cast<unsigned long long>(seed));
  return false;
}

bool prefix_round(fuzz::Rng& r, std::uint64_t seed) {
  const std::size_t len = r.next() % 3 == 0 ? r.next() % 200 : w::kPrefix + (r.next() % 3) * smddp::kHeaderSize;
  std::unique_ptr<std::uint8_t[]> buf(new std::uint8_t[len ? len : 1]);
  for (std::size_t k = 0; k < len; ++k) buf[k] = static_cast<std::uint8_t>(r.next());
  if (len >= w::kPrefix && r.next() % 2) {  // near the accepted set: a valid prefix, a few bits flipped
    w::Prefix p;
    p.kind = static_cast<std::uint8_t>(1 + r.next() % 3);
    p.from = static_cast<std::uint32_t>(r.next());
    p.credits = static_cast<std::uint32_t>(r.next());
    p.secret = r.next();
    p.serial = r.next();
    p.parts = static_cast<std::uint32_t>(r.next());
    w::encode_prefix(p, buf.get());
    for (std::uint64_t k = r.next() % 3; k > 0; --k) buf[r.next() % len] ^= static_cast<std::uint8_t>(1u << (r.next() % 8));
  }
  w::Prefix p;
  bool identified = false;
  const std::string why = w::decode_prefix(buf.get(), len, smddp::kHeaderSize, &p, &identified);
  if (!why.empty() && !identified) return true;
  if (identified && len < w::kPrefix) return fail("identified a message shorter than a prefix", seed);
  std::uint8_t again[w::kPrefix];
  w::encode_prefix(p, again);
  // Bytes 5-7 and 36-39 are reserved (written as zero, not read): compare the rest.
  if (std::memcmp(again, buf.get(), 5) != 0 || std::memcmp(again + 8, buf.get() + 8, 28) != 0)
    return fail("a decoded prefix does not encode back to its bytes", seed);
  if (why.empty() && p.kind != w::kFrame && len != w::kPrefix) return fail("a CREDIT or FIN longer than a prefix", seed);
  // The frame check: whatever the numbers, parts cover the length exactly, or inline fits the message.
  const std::uint64_t length = r.next() % 4 == 0 ? r.next() : r.next() % (1 << 22);
  const std::uint64_t eager = 1 + r.next() % (1 << 15);
  const std::uint64_t part = r.next() % 8 == 0 ? 0 : 1 + r.next() % (1 << 20);
  const std::uint64_t parts = r.next() % 2 ? p.parts : (part ? length / part + (length % part != 0) : 0);
  if (w::check_frame(parts, length, len, smddp::kHeaderSize, eager, part).empty()) {
    const std::uint64_t head = w::kPrefix + smddp::kHeaderSize;
    const bool inline_ok = length <= eager && parts == 0 && len == head + length;
    // In 128 bits: a length near 2^64 in parts of a few bytes wraps parts * part in 64 (libFuzzer found it).
    using U128 = unsigned __int128;
    const bool parts_ok = length > eager && part != 0 && len == head && U128{parts} * part >= length &&
                          U128{parts - 1} * part < length;
    if (!inline_ok && !parts_ok) return fail("check_frame accepted parts that do not cover the length", seed);
  }
  return true;
}

bool hello_round(fuzz::Rng& r, std::uint64_t seed) {
  std::size_t len = r.next() % (w::kHelloHead + w::kMaxAddr + 40);
  std::vector<std::uint8_t> src(w::kHelloHead + w::kMaxAddr + 40);
  for (auto& b : src) b = static_cast<std::uint8_t>(r.next());
  if (r.next() % 2) {
    w::Hello h;
    h.your_id = static_cast<std::uint32_t>(r.next());
    h.window = static_cast<std::uint32_t>(r.next());
    h.secret = r.next();
    h.tag_key = r.next();
    h.eager = r.next();
    h.part_bytes = r.next();
    h.addr.resize(1 + r.next() % w::kMaxAddr);
    for (auto& b : h.addr) b = static_cast<std::uint8_t>(r.next());
    len = w::encode_hello(h, src.data());
    if (r.next() % 3 == 0) src[r.next() % len] ^= static_cast<std::uint8_t>(1u << (r.next() % 8));
    if (r.next() % 5 == 0) len = r.next() % (len + 20);
  }
  std::unique_ptr<std::uint8_t[]> buf(new std::uint8_t[len ? len : 1]);  // exactly len bytes
  std::memcpy(buf.get(), src.data(), len);
  std::size_t need = 0;
  if (len >= w::kHelloHead && w::hello_size(buf.get(), len, &need).empty() && (need <= w::kHelloHead || need > w::kHelloHead + w::kMaxAddr))
    return fail("hello_size gave a size outside its bounds", seed);
  w::Hello h;
  if (!w::decode_hello(buf.get(), len, &h).empty()) return true;
  if (h.addr.empty() || h.addr.size() > w::kMaxAddr || h.window < 2) return fail("a hello out of bounds decoded", seed);
  std::vector<std::uint8_t> again(w::kHelloHead + w::kMaxAddr);
  const std::size_t n = w::encode_hello(h, again.data());
  if (n != len || std::memcmp(again.data(), buf.get(), len) != 0) return fail("a decoded hello does not encode back", seed);
  // Tags: distinct parts of one frame, and distinct frames, never share a tag under one key.
  const std::uint64_t key = r.next(), serial = r.next() % (1ULL << 40), part = r.next() % (1 << 20);
  if (w::tag_of(key, serial, part) == w::tag_of(key, serial, (part + 1) % (1 << 20)) ||
      w::tag_of(key, serial, part) == w::tag_of(key, (serial + 1) % (1ULL << 40), part) ||
      (w::tag_of(key, serial, part) >> 60) != 0)
    return fail("two payload parts share a tag", seed);
  return true;
}

bool round(fuzz::Rng& r, std::uint64_t seed) { return r.next() % 2 ? prefix_round(r, seed) : hello_round(r, seed); }

}  // namespace

SMDDP_FUZZ_MAIN("fuzz_ofi_wire", 0x0f1, round)
