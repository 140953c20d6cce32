// What the fabric tests share: a Sink that records what a fabric tells it, frames with a checkable
// pattern, and connected stream pairs (a socketpair, or loopback TCP). Included by
// test_fabric.cc and test_ofi_fabric.cc, each of which sets test_name and has its own Engine.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fabric.h"
#include "frame.h"

namespace fabric_testing {

inline int failures = 0;
inline const char* test_name = "test";  // what failures are reported as (each test sets it)

inline void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "%s: FAILED: %s\n", test_name, what.c_str());
    failures++;
  }
}

inline std::uint8_t pattern(std::uint64_t seq, std::uint64_t i) { return static_cast<std::uint8_t>(seq * 131 + i * 7 + (i >> 8)); }

inline void data_header(std::uint64_t seq, std::uint64_t length, std::uint8_t out[smddp::kHeaderSize]) {
  smddp::Header h;
  h.type = smddp::Msg::kPartial;
  h.dtype = 1;
  h.kind = 1;
  h.op = 1;
  h.seq = seq;
  h.length = length;
  h.count = length;
  const std::string why = smddp::encode_header(h, out);
  check(why.empty(), "encode: " + why);
}

// Records what a fabric tells its owner; hands out a fresh buffer for every payload.
struct Recorder : smddp::Sink {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::uint64_t, std::vector<std::uint8_t>> payloads;  // seq -> bytes
  std::vector<std::uint64_t> frames;                              // seqs, in arrival order
  std::vector<std::uint64_t> sent;                                // cookies, in order
  std::vector<std::string> downs;
  std::string refuse_seq;  // refuse a frame with this seq (decimal), for the refusal test

  std::string on_header(std::uint32_t, const smddp::Header& h, std::uint8_t** dest) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!refuse_seq.empty() && std::to_string(h.seq) == refuse_seq) return "frame " + refuse_seq + " is not expected";
    auto& buf = payloads[h.seq];
    buf.assign(h.length, 0);
    *dest = buf.empty() ? nullptr : buf.data();
    return {};
  }
  void on_frame(std::uint32_t, const smddp::Header& h) override {
    std::lock_guard<std::mutex> lock(mu);
    frames.push_back(h.seq);
    cv.notify_all();
  }
  void on_sent(std::uint32_t, std::uint64_t cookie) override {
    std::lock_guard<std::mutex> lock(mu);
    sent.push_back(cookie);
    cv.notify_all();
  }
  void on_link_down(std::uint32_t, const std::string& why, smddp::LinkEnd) override {
    std::lock_guard<std::mutex> lock(mu);
    downs.push_back(why);
    cv.notify_all();
  }
  template <class Pred>
  bool wait(Pred pred, int seconds = 20) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(seconds), pred);
  }
};

// Every frame of `bufs` (frame s: bufs[s], filled by pattern(s, ...)) arrived at `r` whole, and the
// frames of each of the two sender threads (even and odd seqs) in the order they were sent.
inline void check_arrived(Recorder& r, const std::vector<std::vector<std::uint8_t>>& bufs) {
  std::lock_guard<std::mutex> lock(r.mu);
  for (std::uint64_t s = 0; s < bufs.size(); s++) {
    const auto& got = r.payloads[s];
    bool same = got.size() == bufs[s].size();
    for (std::uint64_t i = 0; same && i < got.size(); i++) same = got[i] == pattern(s, i);
    check(same, "payload of frame " + std::to_string(s));
  }
  std::uint64_t last_even = 0, last_odd = 1;
  bool ordered = true;
  for (const std::uint64_t s : r.frames) {
    std::uint64_t& last = (s % 2 == 0) ? last_even : last_odd;
    if (s != last && s < last) ordered = false;
    last = s;
  }
  check(ordered, "per-thread order");
}

inline void pair_of(int fds[2], bool tcp) {
  if (!tcp) {
    check(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0, "socketpair");
    return;
  }
  const int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  check(bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && listen(l, 1) == 0, "listen");
  check(getsockname(l, reinterpret_cast<sockaddr*>(&a), &n) == 0, "getsockname");
  fds[0] = socket(AF_INET, SOCK_STREAM, 0);
  check(connect(fds[0], reinterpret_cast<sockaddr*>(&a), sizeof a) == 0, "connect");
  fds[1] = accept(l, nullptr, nullptr);
  check(fds[1] >= 0, "accept");
  close(l);
}

}  // namespace fabric_testing
