// The ofi fabric's wire (ofi_wire.h): every field from a peer checked before it is used.
#include "ofi_wire.h"

#include <cstring>

namespace smddp {
namespace ofi_wire {
namespace {

constexpr char kHelloMagic[8] = {'S', 'M', 'D', 'D', 'P', 'O', 'F', 'I'};
constexpr std::uint64_t kTagMask = (1ULL << 60) - 1;

void put32(std::uint8_t* p, std::uint32_t v) { std::memcpy(p, &v, 4); }
void put64(std::uint8_t* p, std::uint64_t v) { std::memcpy(p, &v, 8); }
std::uint32_t get32(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
std::uint64_t get64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

void encode_prefix(const Prefix& p, std::uint8_t out[kPrefix]) {
  put32(out, kMagic);
  out[4] = p.kind;
  out[5] = out[6] = out[7] = 0;
  put32(out + 8, p.from);
  put32(out + 12, p.credits);
  put64(out + 16, p.secret);
  put64(out + 24, p.serial);
  put32(out + 32, p.parts);
  put32(out + 36, 0);
}

std::string decode_prefix(const std::uint8_t* msg, std::size_t len, std::size_t header_size, Prefix* out,
                          bool* identified) {
  *identified = false;
  if (len < kPrefix) return "a message of " + std::to_string(len) + " bytes";
  if (get32(msg) != kMagic) return "bad magic";
  Prefix p;
  p.kind = msg[4];
  p.from = get32(msg + 8);
  p.credits = get32(msg + 12);
  p.secret = get64(msg + 16);
  p.serial = get64(msg + 24);
  p.parts = get32(msg + 32);
  *out = p;
  *identified = true;
  if (p.kind != kFrame && p.kind != kCredit && p.kind != kFin) return "a message of unknown kind " + std::to_string(p.kind);
  if (p.kind != kFrame && len != kPrefix)
    return std::string(p.kind == kFin ? "a FIN" : "a CREDIT") + " of " + std::to_string(len) + " bytes";
  if (p.kind == kFrame && len < kPrefix + header_size) return "a frame message of " + std::to_string(len) + " bytes";
  return {};
}

std::size_t encode_hello(const Hello& h, std::uint8_t* out) {
  std::memcpy(out, kHelloMagic, 8);
  put32(out + 8, kHelloVersion);
  put32(out + 12, static_cast<std::uint32_t>(h.addr.size()));
  put32(out + 16, h.your_id);
  put32(out + 20, h.window);
  put64(out + 24, h.secret);
  put64(out + 32, h.tag_key);
  put64(out + 40, h.eager);
  put64(out + 48, h.part_bytes);
  if (!h.addr.empty()) std::memcpy(out + kHelloHead, h.addr.data(), h.addr.size());
  return kHelloHead + h.addr.size();
}

std::string hello_size(const std::uint8_t* head, std::size_t got, std::size_t* need) {
  if (got < kHelloHead) return "a hello of " + std::to_string(got) + " bytes";
  if (std::memcmp(head, kHelloMagic, 8) != 0 || get32(head + 8) != kHelloVersion)
    return "is not an ofi fabric of this version (check that every node runs the same smddp and --fabric)";
  const std::uint32_t n = get32(head + 12);
  if (n == 0 || n > kMaxAddr) return "sent a fabric address of " + std::to_string(n) + " bytes";
  *need = kHelloHead + n;
  return {};
}

std::string decode_hello(const std::uint8_t* b, std::size_t len, Hello* out) {
  std::size_t need = 0;
  std::string why = hello_size(b, len, &need);
  if (!why.empty()) return why;
  if (len != need) return "sent a hello of " + std::to_string(len) + " bytes for " + std::to_string(need);
  Hello h;
  h.your_id = get32(b + 16);
  h.window = get32(b + 20);
  h.secret = get64(b + 24);
  h.tag_key = get64(b + 32);
  h.eager = get64(b + 40);
  h.part_bytes = get64(b + 48);
  if (h.window < 2 || h.eager == 0 || h.part_bytes == 0) return "offered a window or message size too small";
  h.addr.assign(b + kHelloHead, b + len);
  *out = std::move(h);
  return {};
}

std::string check_frame(std::uint64_t parts, std::uint64_t length, std::size_t msg_len, std::size_t header_size,
                        std::uint64_t eager, std::uint64_t part_bytes) {
  const std::uint64_t head = kPrefix + header_size;
  if (length <= eager) {
    if (parts != 0 || msg_len < head || msg_len - head != length) return "a frame message's length does not match its header";
    return {};
  }
  if (part_bytes == 0 || msg_len != head || parts != length / part_bytes + (length % part_bytes != 0 ? 1 : 0))
    return "a frame's payload parts do not match its header";
  return {};
}

std::uint64_t tag_of(std::uint64_t key, std::uint64_t serial, std::uint64_t part) {
  return (key ^ (((serial & ((1ULL << 40) - 1)) << 20) | (part & ((1ULL << 20) - 1)))) & kTagMask;
}

}  // namespace ofi_wire
}  // namespace smddp
