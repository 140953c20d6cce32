// The engine's frame header codec (docs/protocol.md): every field checked before anything trusts it.
//
// Pure: no I/O, no allocation but the error text, no Python. What the rules check against (codes,
// offsets, limits, which messages carry a fingerprint) is wire.h, generated from smddp/proto, whose
// frames.py is the Python codec of the same rules; tests/engine checks that both take and refuse
// the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "wire.h"  // codes, offsets and limits, generated from smddp/proto

namespace smddp {

constexpr std::uint64_t kMaxU63 = (std::uint64_t{1} << 63) - 1;

// One decoded header. dtype, op and kind are wire codes (0 where the type carries none).
struct Header {
  Msg type = Msg::kBye;
  std::uint16_t flags = 0;
  std::uint8_t dtype = 0;
  std::uint8_t op = 0;
  std::uint8_t kind = 0;
  std::uint32_t sender = 0;
  std::uint64_t seq = 0;
  std::uint32_t shard = 0;
  std::uint32_t aux = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint64_t count = 0;
};

// The name of a known message type, or nullptr for a code that is none.
inline const char* msg_name(std::uint8_t code) {
  const MsgInfo* m = msg_info(code);
  return m != nullptr ? m->name : nullptr;
}

// Decodes `n` bytes at `data` into `*out`. Returns the empty string on success, else why the bytes
// are not a header (then `*out` is unspecified). Reads exactly kHeaderSize bytes and no more.
std::string decode_header(const std::uint8_t* data, std::size_t n, Header* out);

// Encodes `h` into `out`; refuses (returns why) what decode_header would refuse.
std::string encode_header(const Header& h, std::uint8_t out[kHeaderSize]);

}  // namespace smddp
