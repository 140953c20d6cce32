// The ofi fabric's wire (docs/protocol.md, "Over libfabric"): pure encoders and decoders, no I/O.
//
// Two things come from a peer: its hello on the link's stream (who it is on the fabric, and how to be
// let in) and, for every message, the 40-byte prefix before the frame's header. Each is checked here
// against its bounds before the fabric acts on a field of it; `make engine-sanitize` fuzzes both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace smddp {
namespace ofi_wire {

constexpr std::size_t kPrefix = 40;
constexpr std::uint32_t kMagic = 0x49464f53;  // "SOFI"
enum Kind : std::uint8_t { kFrame = 1, kCredit = 2, kFin = 3 };
constexpr std::uint8_t kStreamFin = 0x46;  // on the stream after the hello: "my FIN has left"

struct Prefix {
  std::uint8_t kind = kFrame;
  std::uint32_t from = 0;     // the id the receiver gave the sender
  std::uint32_t credits = 0;  // frames of the receiver's the sender hands back
  std::uint64_t secret = 0;   // the receiver's secret
  std::uint64_t serial = 0;   // the sender's, per link (frames and FIN)
  std::uint32_t parts = 0;    // tagged payload parts that follow (frames)
};

void encode_prefix(const Prefix& p, std::uint8_t out[kPrefix]);
// The prefix of a message of `len` bytes: "" or why it is not one (short, magic, kind, a CREDIT or
// FIN with more than a prefix, a frame with less than a prefix and a header). *identified says
// whether `from` and `secret` were read (length and magic fine), so that a malformed message can
// still be told apart: from a peer that knows its secret (a broken peer), or from a stranger.
std::string decode_prefix(const std::uint8_t* msg, std::size_t len, std::size_t header_size, Prefix* out,
                          bool* identified);

constexpr std::size_t kHelloHead = 56;
constexpr std::size_t kMaxAddr = 256;
constexpr std::uint32_t kHelloVersion = 1;

struct Hello {
  std::uint32_t your_id = 0;  // what the peer writes in `from` of what it sends us
  std::uint32_t window = 0;   // frames it may have in flight to us
  std::uint64_t secret = 0;   // what it must stamp on them
  std::uint64_t tag_key = 0;  // what its payload parts' tags are keyed with
  std::uint64_t eager = 0;    // our inline limit
  std::uint64_t part_bytes = 0;  // our largest message
  std::vector<std::uint8_t> addr;  // our endpoint's address (1..kMaxAddr bytes)
};

// Writes the hello (kHelloHead + addr bytes, at most kHelloHead + kMaxAddr) and returns its size.
std::size_t encode_hello(const Hello& h, std::uint8_t* out);
// With the first `got` bytes of a hello in (got >= kHelloHead): its whole size in *need, or why the
// head is not one (magic, version, an address of 0 or more than kMaxAddr bytes).
std::string hello_size(const std::uint8_t* head, std::size_t got, std::size_t* need);
// A whole hello of `len` bytes: "" or why not (its head as above, a length that is not its size,
// a window under 2, an inline limit or largest message that is 0).
std::string decode_hello(const std::uint8_t* b, std::size_t len, Hello* out);

// Whether a frame's message of `msg_len` bytes, `parts` payload parts and a header saying `length`
// agrees with the link's inline limit and part size. "" or why not.
std::string check_frame(std::uint64_t parts, std::uint64_t length, std::size_t msg_len, std::size_t header_size,
                        std::uint64_t eager, std::uint64_t part_bytes);

// A payload part's tag: the receiver's key mixed with the frame's serial and the part's number (60 bits).
std::uint64_t tag_of(std::uint64_t key, std::uint64_t serial, std::uint64_t part);

}  // namespace ofi_wire
}  // namespace smddp
