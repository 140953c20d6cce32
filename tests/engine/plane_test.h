// What the data plane's C++ tests share: a failure count with a check that names the test, and the
// 56-byte frame headers the tests write into rings and sockets (docs/protocol.md).
#pragma once

#include <errno.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "frame.h"

namespace plane_test {

inline std::atomic<int> failures{0};

inline void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "%s: FAILED: %s\n", program_invocation_short_name, what.c_str());
    failures++;
  }
}

constexpr std::int64_t kSecond = 1'000'000'000;

inline std::vector<std::uint8_t> header(smddp::Msg type, std::uint32_t sender, std::uint64_t seq,
                                        std::uint32_t shard, std::uint64_t offset, std::uint64_t count,
                                        std::uint8_t dtype, std::uint8_t op, std::uint8_t kind, std::uint32_t aux = 0,
                                        std::uint64_t length = 0) {
  smddp::Header h;
  h.type = type;
  h.sender = sender;
  h.seq = seq;
  h.shard = shard;
  h.offset = offset;
  h.count = count;
  h.dtype = dtype;
  h.op = op;
  h.kind = kind;
  h.aux = aux;
  h.length = length;
  std::vector<std::uint8_t> out(smddp::kHeaderSize);
  const std::string why = smddp::encode_header(h, out.data());
  check(why.empty(), "encode: " + why);
  return out;
}

}  // namespace plane_test
