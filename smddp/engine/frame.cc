// The frame header codec: little-endian fields at fixed offsets, each checked against its bounds.
#include "frame.h"

#include <cstring>

namespace smddp {
namespace {

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

bool known_dtype(std::uint8_t d) { return dtype_info(d) != nullptr; }
bool known_kind(std::uint8_t k) { return kind_label(k) != nullptr; }
bool known_op(std::uint8_t o) { return reduce_op_label(o) != nullptr; }

std::string num(std::uint64_t v) { return std::to_string(v); }

}  // namespace

std::string decode_header(const std::uint8_t* data, std::size_t n, Header* out) {
  if (data == nullptr || n != kHeaderSize) return "header must be " + num(kHeaderSize) + " bytes, got " + num(n);
  if (std::memcmp(data + kOffMagic, kMagic, 4) != 0) return "bad magic (not an smddp peer)";
  if (data[kOffVersion] != kVersion)
    return "protocol version " + num(data[kOffVersion]) + " is not supported (this side speaks " + num(kVersion) +
           ")";
  const MsgInfo* info = msg_info(data[kOffType]);
  if (info == nullptr) return "unknown message type " + num(data[kOffType]);
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
  const std::string who(info->name);
  if (data[kOffReserved] != 0 || (h.flags & ~info->flags) != 0)
    return who + ": reserved bits set (flags=" + num(h.flags) + ", reserved=" + num(data[kOffReserved]) + ")";
  if (h.seq > kMaxU63 || h.offset > kMaxU63 || h.count > kMaxU63) return who + ": seq/offset/count beyond 2**63";
  const std::uint64_t limit = info->max_payload;
  if (h.length > limit)
    return who + ": payload length " + num(h.length) + " exceeds the limit of " + num(limit) + " bytes";
  if (info->fingerprinted) {
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
  const MsgInfo* info = msg_info(static_cast<std::uint8_t>(h.type));
  if (info == nullptr) return "cannot encode unknown message type " + num(static_cast<std::uint8_t>(h.type));
  const std::string who = std::string("cannot encode ") + info->name;
  if (h.seq > kMaxU63 || h.offset > kMaxU63 || h.count > kMaxU63) return who + ": seq/offset/count beyond 2**63";
  if (h.length > info->max_payload) return who + ": payload length " + num(h.length) + " exceeds the limit";
  if ((h.flags & ~info->flags) != 0) return who + ": flags " + num(h.flags) + " are not defined for it";
  if (info->fingerprinted) {
    if (!known_dtype(h.dtype) || !known_kind(h.kind)) return who + " without its dtype and kind";
    if (h.op != 0 && !known_op(h.op)) return who + ": unknown reduce op " + num(h.op);
  } else if (h.dtype != 0 || h.op != 0 || h.kind != 0) {
    return who + " with a dtype, op or kind";
  }
  std::memcpy(out + kOffMagic, kMagic, 4);
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
