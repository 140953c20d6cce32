// The TCP fabric between two engines in one process, each with its own progress thread, over a
// socketpair and over loopback TCP: every frame arrives whole, in order, in the memory the Sink
// named, every send is reported once; garbage, a refused frame, a hang-up mid-frame and silence
// each take the link down with a reason; a down link refuses sends. Built and run under
// ASan+UBSan and TSan by `make engine-sanitize`. Exit status 0: every check held.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fabric.h"
#include "frame.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "test_fabric: FAILED: %s\n", what.c_str());
    failures++;
  }
}

std::uint8_t pattern(std::uint64_t seq, std::uint64_t i) { return static_cast<std::uint8_t>(seq * 131 + i * 7 + (i >> 8)); }

void data_header(std::uint64_t seq, std::uint64_t length, std::uint8_t out[smddp::kHeaderSize]) {
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

// A fabric with its own progress thread, stopped and joined on destruction.
struct Engine {
  Recorder sink;
  std::unique_ptr<smddp::Fabric> fabric;
  std::atomic<bool> stop{false};
  std::thread thread;
  explicit Engine(std::int64_t idle_ms) {
    std::string why;
    fabric = smddp::make_tcp_fabric(&sink, idle_ms, &why);
    check(fabric != nullptr, "make_tcp_fabric: " + why);
    thread = std::thread([this] {
      while (!stop.load()) fabric->progress(50);
    });
  }
  ~Engine() {
    stop.store(true);
    fabric->wake();
    thread.join();
  }
};

void pair_of(int fds[2], bool tcp) {
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

// Many frames of many sizes from two sender threads at once, both ways; one of them lets the fabric
// write its frames on its own thread when nothing is queued.
void test_frames_arrive_whole_in_order(bool tcp) {
  Engine a(0), b(0);
  int fds[2];
  pair_of(fds, tcp);
  check(a.fabric->add_peer(1, fds[0]).empty() && b.fabric->add_peer(0, fds[1]).empty(), "add_peer");
  constexpr std::uint64_t kFrames = 600;
  std::vector<std::vector<std::uint8_t>> bufs(kFrames);
  for (std::uint64_t s = 0; s < kFrames; s++) {
    const std::uint64_t len = (s % 7 == 0) ? 0 : (s * 2654435761u) % (s % 5 == 0 ? (1 << 20) : 3000);
    bufs[s].resize(len);
    for (std::uint64_t i = 0; i < len; i++) bufs[s][i] = pattern(s, i);
  }
  // One of a's senders lets the fabric write its frames at once when nothing is queued (`left`).
  std::atomic<std::uint64_t> left_at_once{0};
  auto sender = [&](Engine& e, std::uint64_t first, bool direct) {
    for (std::uint64_t s = first; s < kFrames; s += 2) {
      std::uint8_t h[smddp::kHeaderSize];
      data_header(s, bufs[s].size(), h);
      bool left = false;
      check(e.fabric->send(e.fabric.get() == a.fabric.get() ? 1 : 0, h, bufs[s].data(), bufs[s].size(), s,
                           direct ? &left : nullptr)
                .empty(),
            "send");
      if (left) left_at_once++;
    }
  };
  std::thread t1(sender, std::ref(a), 0, false), t2(sender, std::ref(a), 1, true), t3(sender, std::ref(b), 0, false);
  t1.join();
  t2.join();
  t3.join();
  check(b.sink.wait([&] { return b.sink.frames.size() == kFrames; }), "b got every frame");
  check(a.sink.wait([&] { return a.sink.frames.size() == (kFrames + 1) / 2; }), "a got every frame");
  check(a.sink.wait([&] { return a.sink.sent.size() + left_at_once.load() == kFrames; }),
        "a heard of every send that did not leave at once");
  {
    std::lock_guard<std::mutex> lock(b.sink.mu);
    for (std::uint64_t s = 0; s < kFrames; s++) {
      const auto& got = b.sink.payloads[s];
      bool same = got.size() == bufs[s].size();
      for (std::uint64_t i = 0; same && i < got.size(); i++) same = got[i] == pattern(s, i);
      check(same, "payload of frame " + std::to_string(s));
    }
    // One sender thread's frames keep their order (each thread's seqs are increasing).
    std::uint64_t last_even = 0, last_odd = 1;
    bool ordered = true;
    for (std::size_t i = 0; i < b.sink.frames.size(); i++) {
      const std::uint64_t s = b.sink.frames[i];
      std::uint64_t& last = (s % 2 == 0) ? last_even : last_odd;
      if (s != last && s < last) ordered = false;
      last = s;
    }
    check(ordered, "per-thread order");
  }
  // Small frames one at a time, each after the last arrived: nothing is queued, so each leaves at
  // once on the sender's thread, and no on_sent comes for it.
  std::vector<std::uint8_t> small(100, 7);
  const std::size_t sent_before = [&] {
    std::lock_guard<std::mutex> lock(a.sink.mu);
    return a.sink.sent.size();
  }();
  for (std::uint64_t s = kFrames; s < kFrames + 20; s++) {
    std::uint8_t h[smddp::kHeaderSize];
    data_header(s, small.size(), h);
    bool left = false;
    check(a.fabric->send(1, h, small.data(), small.size(), s, &left).empty() && left, "a small frame left at once");
    check(b.sink.wait([&] { return b.sink.frames.size() == s + 1; }), "it arrived");
  }
  {
    std::lock_guard<std::mutex> lock(a.sink.mu);
    check(a.sink.sent.size() == sent_before, "no on_sent for frames that left at once");
    check(a.sink.downs.empty(), "no link went down at a");
  }
  std::lock_guard<std::mutex> lock(b.sink.mu);
  check(b.sink.downs.empty(), "no link went down at b");
}

void test_garbage_and_hangups() {
  {  // bytes that are not a header
    Engine b(0);
    int fds[2];
    pair_of(fds, false);
    check(b.fabric->add_peer(3, fds[1]).empty(), "add_peer");
    const char junk[smddp::kHeaderSize] = "GET / HTTP/1.1\r\nHost: example\r\n\r\n";
    check(write(fds[0], junk, sizeof junk) == static_cast<ssize_t>(sizeof junk), "write junk");
    check(b.sink.wait([&] { return !b.sink.downs.empty(); }), "garbage took the link down");
    std::lock_guard<std::mutex> lock(b.sink.mu);
    check(b.sink.downs.size() == 1 && b.sink.downs[0].find("bad frame header: bad magic") != std::string::npos,
          "garbage named: " + (b.sink.downs.empty() ? std::string() : b.sink.downs[0]));
    close(fds[0]);
  }
  {  // a frame the owner refuses, then a hang-up in the middle of a frame
    // Declared before the engines: a send's memory must outlive the fabric's use of it.
    std::vector<std::uint8_t> payload(100, 1);
    Engine a(0), b(0);
    {
      std::lock_guard<std::mutex> lock(b.sink.mu);
      b.sink.refuse_seq = "5";
    }
    int fds[2];
    pair_of(fds, false);
    check(a.fabric->add_peer(1, fds[0]).empty() && b.fabric->add_peer(0, fds[1]).empty(), "add_peer");
    std::uint8_t h[smddp::kHeaderSize];
    data_header(4, payload.size(), h);
    check(a.fabric->send(1, h, payload.data(), payload.size(), 4).empty(), "send 4");
    data_header(5, payload.size(), h);
    check(a.fabric->send(1, h, payload.data(), payload.size(), 5).empty(), "send 5");
    check(b.sink.wait([&] { return !b.sink.downs.empty(); }), "refusal took the link down");
    std::lock_guard<std::mutex> lock(b.sink.mu);
    check(b.sink.frames == std::vector<std::uint64_t>{4}, "the frame before the refused one arrived");
    check(b.sink.downs.size() == 1 && b.sink.downs[0] == "frame 5 is not expected", "refusal named");
  }
  {
    Engine b(0);
    int fds[2];
    pair_of(fds, true);
    check(b.fabric->add_peer(2, fds[1]).empty(), "add_peer");
    std::uint8_t h[smddp::kHeaderSize];
    data_header(9, 1000, h);
    check(write(fds[0], h, sizeof h) == static_cast<ssize_t>(sizeof h) && write(fds[0], h, 10) == 10, "write part");
    close(fds[0]);
    check(b.sink.wait([&] { return !b.sink.downs.empty(); }), "hang-up took the link down");
    std::lock_guard<std::mutex> lock(b.sink.mu);
    check(b.sink.downs.size() == 1 && b.sink.downs[0] == "closed the connection in the middle of a frame",
          "hang-up named");
    check(b.fabric->send(2, h, nullptr, 0, 1).find("is down") != std::string::npos, "a down link refuses sends");
    check(b.fabric->send(7, h, nullptr, 0, 1).find("no link") != std::string::npos, "no link to a stranger");
  }
}

void test_silence() {
  Engine b(300);
  int fds[2];
  pair_of(fds, false);
  check(b.fabric->add_peer(1, fds[1]).empty(), "add_peer");
  const auto t0 = std::chrono::steady_clock::now();
  check(b.sink.wait([&] { return !b.sink.downs.empty(); }, 5), "silence took the link down");
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(b.sink.mu);
  check(!b.sink.downs.empty() && b.sink.downs[0].rfind("silent for 0.", 0) == 0, "silence named");
  check(waited >= 0.29 && waited < 4.0, "silence detected within bounds");
  close(fds[0]);
}

}  // namespace

int main() {
  test_frames_arrive_whole_in_order(false);
  test_frames_arrive_whole_in_order(true);
  test_garbage_and_hangups();
  test_silence();
  std::printf("test_fabric: %s\n", failures ? "FAILED" : "every check held");
  return failures ? 1 : 0;
}
