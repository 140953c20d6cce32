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
#include "fabric_testing.h"
#include "frame.h"

namespace {

using namespace fabric_testing;

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
  check_arrived(b.sink, bufs);
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

// Frames written raw: more small ones in one write than a progress turn's share (then nothing more
// until they have all come, so the reader must not leave any of them behind), then the rest, with a
// 100 KiB payload; and the same stream again in odd-sized pieces (headers and payloads split
// anywhere). Every frame arrives whole and in order either way.
void test_a_stream_of_frames_however_it_is_cut(bool tcp) {
  std::vector<std::vector<std::uint8_t>> bufs;
  std::vector<std::uint8_t> stream;
  for (std::uint64_t s = 0; s < 400; s++) {
    const std::uint64_t len = s == 399 ? (100 << 10) : s < 300 ? 0 : (s * 2654435761u) % 5000;
    bufs.emplace_back(len);
    for (std::uint64_t i = 0; i < len; i++) bufs[s][i] = pattern(s, i);
    std::uint8_t h[smddp::kHeaderSize];
    data_header(s, len, h);
    stream.insert(stream.end(), h, h + smddp::kHeaderSize);
    stream.insert(stream.end(), bufs[s].begin(), bufs[s].end());
  }
  for (int cut = 0; cut < 2; cut++) {
    Engine b(0);
    int fds[2];
    pair_of(fds, tcp);
    check(b.fabric->add_peer(1, fds[1]).empty(), "add_peer");
    std::size_t at = 0;
    if (cut == 0) {
      // 200 empty frames in one write, and then nothing until they have all come.
      const std::size_t first = 200 * smddp::kHeaderSize;
      check(write(fds[0], stream.data(), first) == static_cast<ssize_t>(first), "write 200 frames");
      check(b.sink.wait([&] { return b.sink.frames.size() == 200; }, 10), "200 frames of one write arrived");
      at = first;
    }
    std::thread writer([&] {
      for (std::size_t piece = 1; at < stream.size(); piece = piece % 9973 + 37) {
        const std::size_t n = cut == 0 ? stream.size() - at : std::min(piece, stream.size() - at);
        const ssize_t put = write(fds[0], stream.data() + at, n);
        if (put <= 0) break;
        at += static_cast<std::size_t>(put);
      }
    });
    writer.join();
    check(b.sink.wait([&] { return b.sink.frames.size() == bufs.size(); }, 10),
          cut == 0 ? "every frame of one write arrived" : "every frame of a stream cut anywhere arrived");
    check_arrived(b.sink, bufs);
    {
      std::lock_guard<std::mutex> lock(b.sink.mu);
      check(b.sink.downs.empty(), "no link went down");
    }
    close(fds[0]);
  }
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
  test_name = "test_fabric";
  test_frames_arrive_whole_in_order(false);
  test_frames_arrive_whole_in_order(true);
  test_a_stream_of_frames_however_it_is_cut(false);
  test_a_stream_of_frames_however_it_is_cut(true);
  test_garbage_and_hangups();
  test_silence();
  std::printf("test_fabric: %s\n", failures ? "FAILED" : "every check held");
  return failures ? 1 : 0;
}
