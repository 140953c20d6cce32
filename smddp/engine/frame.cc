// The frame header codec: little-endian fields at fixed offsets, each checked against its bounds.
#include "frame.h"

#include <cstring>

namespace smddp {
namespace {

// Byte offsets of the fields (struct "<4sBBHBBBBIQIIQQQ" in smddp/proto/frames.py).
constexpr std::size_t kOffVersion = 4, kOffType = 5, kOffFlags = 6, kOffDtype = 8, kOffOp = 9,
                      kOffKind = 10, kOffReserved = 11, kOffSender = 12, kOffSeq = 16, kOffShard = 24,
                      kOffAux = 28, kOffOffset = 32, kOffLength = 40, kOffCount = 48;

template <typename T>
T load_le(const std::uint8_t* p) {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(p[i]) << (8 * i));
  return v;
}

template <typename T>
void store_le(std::uint8_t* p, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

bool fingerprinted(Msg t) {
  return t == Msg::kSubmit || t == Msg::kDone || t == Msg::kPartial || t == Msg::kResult || t == Msg::kBlock;
}

std::uint64_t length_limit(Msg t) {
  switch (t) {
    case Msg::kAttach:
    case Msg::kSubmit:
    case Msg::kRelease:
    case Msg::kChannel:
    case Msg::kSegment:
    case Msg::kDone:
    case Msg::kHeartbeat:
    case Msg::kBye:
    case Msg::kStatus:
    case Msg::kExited:
      return 0;
    case Msg::kReport:
      return kMaxReportPayload;
    case Msg::kChallenge:
    case Msg::kHello:
    case Msg::kWelcome:
    case Msg::kError:
      return kMaxControlPayload;
    case Msg::kPartial:
    case Msg::kResult:
    case Msg::kBlock:
      return kMaxDataPayload;
  }
  return 0;
}

bool known_dtype(std::uint8_t d) { return d >= 1 && d <= 7; }
bool known_kind(std::uint8_t k) { return k >= 1 && k <= 5; }
bool known_op(std::uint8_t o) { return o >= 1 && o <= 4; }

std::string num(std::uint64_t v) { return std::to_string(v); }

}  // namespace

const char* msg_name(std::uint8_t code) {
  switch (static_cast<Msg>(code)) {
    case Msg::kChallenge: return "CHALLENGE";
    case Msg::kHello: return "HELLO";
    case Msg::kWelcome: return "WELCOME";
    case Msg::kAttach: return "ATTACH";
    case Msg::kSubmit: return "SUBMIT";
    case Msg::kRelease: return "RELEASE";
    case Msg::kChannel: return "CHANNEL";
    case Msg::kSegment: return "SEGMENT";
    case Msg::kDone: return "DONE";
    case Msg::kPartial: return "PARTIAL";
    case Msg::kResult: return "RESULT";
    case Msg::kBlock: return "BLOCK";
    case Msg::kHeartbeat: return "HEARTBEAT";
    case Msg::kError: return "ERROR";
    case Msg::kBye: return "BYE";
    case Msg::kStatus: return "STATUS";
    case Msg::kReport: return "REPORT";
    case Msg::kExited: return "EXITED";
  }
  return nullptr;
}

std::string decode_header(const std::uint8_t* data, std::size_t n, Header* out) {
  if (data == nullptr || n != kHeaderSize) return "header must be 56 bytes, got " + num(n);
  if (std::memcmp(data, "SMDP", 4) != 0) return "bad magic (not an smddp peer)";
  if (data[kOffVersion] != kVersion)
    return "protocol version " + num(data[kOffVersion]) + " is not supported (this side speaks 1)";
  const char* name = msg_name(data[kOffType]);
  if (name == nullptr) return "unknown message type " + num(data[kOffType]);
  Header h;
  h.type = static_cast<Msg>(data[kOffType]);
  h.flags = load_le<std::uint16_t>(data + kOffFlags);
  h.dtype = data[kOffDtype];
  h.op = data[kOffOp];
  h.kind = data[kOffKind];
  h.sender = load_le<std::uint32_t>(data + kOffSender);
  h.seq = load_le<std::uint64_t>(data + kOffSeq);
  h.shard = load_le<std::uint32_t>(data + kOffShard);
  h.aux = load_le<std::uint32_t>(data + kOffAux);
  h.offset = load_le<std::uint64_t>(data + kOffOffset);
  h.length = load_le<std::uint64_t>(data + kOffLength);
  h.count = load_le<std::uint64_t>(data + kOffCount);
  const std::string who(name);
  if (data[kOffReserved] != 0 || h.flags != 0) return who + ": reserved bits set";
  if (h.seq > kMaxU63 || h.offset > kMaxU63 || h.count > kMaxU63) return who + ": seq/offset/count beyond 2**63";
  const std::uint64_t limit = length_limit(h.type);
  if (h.length > limit)
    return who + ": payload length " + num(h.length) + " exceeds the limit of " + num(limit) + " bytes";
  if (fingerprinted(h.type)) {
    if (!known_dtype(h.dtype) || !known_kind(h.kind))
      return who + ": unknown dtype " + num(h.dtype) + " or kind " + num(h.kind);
    if (h.op != 0 && !known_op(h.op)) return who + ": unknown reduce op " + num(h.op);
  } else if (h.dtype != 0 || h.op != 0 || h.kind != 0) {
    return who + ": dtype/op/kind must be zero on this message";
  }
  *out = h;
  return {};
}

std::string encode_header(const Header& h, std::uint8_t out[kHeaderSize]) {
  const char* name = msg_name(static_cast<std::uint8_t>(h.type));
  if (name == nullptr) return "cannot encode unknown message type " + num(static_cast<std::uint8_t>(h.type));
  const std::string who = std::string("cannot encode ") + name;
  if (h.seq > kMaxU63 || h.offset > kMaxU63 || h.count > kMaxU63) return who + ": seq/offset/count beyond 2**63";
  if (h.length > length_limit(h.type)) return who + ": payload length " + num(h.length) + " exceeds the limit";
  if (h.flags != 0) return who + ": no flags are defined in version 1";
  if (fingerprinted(h.type)) {
    if (!known_dtype(h.dtype) || !known_kind(h.kind)) return who + " without its dtype and kind";
    if (h.op != 0 && !known_op(h.op)) return who + ": unknown reduce op " + num(h.op);
  } else if (h.dtype != 0 || h.op != 0 || h.kind != 0) {
    return who + " with a dtype, op or kind";
  }
  std::memcpy(out, "SMDP", 4);
  out[kOffVersion] = kVersion;
  out[kOffType] = static_cast<std::uint8_t>(h.type);
  store_le<std::uint16_t>(out + kOffFlags, h.flags);
  out[kOffDtype] = h.dtype;
  out[kOffOp] = h.op;
  out[kOffKind] = h.kind;
  out[kOffReserved] = 0;
  store_le<std::uint32_t>(out + kOffSender, h.sender);
  store_le<std::uint64_t>(out + kOffSeq, h.seq);
  store_le<std::uint32_t>(out + kOffShard, h.shard);
  store_le<std::uint32_t>(out + kOffAux, h.aux);
  store_le<std::uint64_t>(out + kOffOffset, h.offset);
  store_le<std::uint64_t>(out + kOffLength, h.length);
  store_le<std::uint64_t>(out + kOffCount, h.count);
  return {};
}

}  // namespace smddp
