// The TCP fabric (fabric.h): epoll over non-blocking sockets, vectored sends, payloads read into place.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fabric.h"

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kWakeKey = ~std::uint64_t{0};
constexpr int kMaxIov = 64;                      // frames gathered into one writev: 2 iovecs each
constexpr int kFramesPerTurn = 64;               // a busy link yields to the others after this many
constexpr std::uint64_t kBytesPerTurn = 8 << 20;  // ... or after this many payload bytes
// Frames up to this size may be written by the thread that sends them (send's `left`): larger ones
// always go through the progress thread, so that no sender waits on a slow socket for long.
constexpr std::uint64_t kDirectBytes = 64 << 10;

std::string os_error(const char* what, int err) { return std::string(what) + ": " + std::strerror(err); }

// After a write that ended a frame: have TCP send what it holds now. Linux's autocorking
// (net.ipv4.tcp_autocorking, on by default) keeps a short last segment back while earlier ones of the
// socket wait in a qdisc; a frame of 64 KiB and its header end in such a segment (the GSO packet
// holds 64 KiB), and behind a rate-limiting qdisc (tbf, fq pacing) it waited 2-80 ms: a 256 KiB
// all-reduce on 4 nodes at 1 Gbit/s took 6-14 ms instead of 3.3. Setting TCP_NODELAY again pushes the
// pending segments (tcp_push_pending_frames); on a socket that is not TCP it fails, harmlessly.
// Only after a frame of kPushBytes or more (whatever the size of the write that ended it): shorter
// frames fit one GSO packet, and pushing each of them cost a 4 KiB all-reduce on the same 4 nodes
// about 30% (its partials coalesce while corked).
constexpr std::uint64_t kPushBytes = 64 << 10;
void push_now(int fd, std::uint64_t frame_bytes) {
  if (frame_bytes < kPushBytes) return;
  const int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

struct Out {
  std::uint8_t header[kHeaderSize];
  const std::uint8_t* payload;
  std::uint64_t length;
  std::uint64_t cookie;
  std::uint64_t sent;  // of kHeaderSize + length
};

struct Link {
  std::uint32_t peer = 0;
  int fd = -1;
  // Guarded by the fabric's mutex: whether sends are taken, and what waits to go.
  bool up = true;
  std::deque<Out> queue;
  bool watching_out = false;  // EPOLLOUT is armed (progress thread only)
  // Progress thread only: the frame being read.
  std::uint8_t head[kHeaderSize] = {};
  std::size_t head_got = 0;
  bool in_payload = false;
  Header h;
  std::uint8_t* dest = nullptr;
  std::uint64_t payload_got = 0;
  Clock::time_point last_in;
};

class TcpFabric final : public Fabric {
 public:
  TcpFabric(Sink* sink, std::int64_t idle_ms) : sink_(sink), idle_ms_(idle_ms) {}

  std::string open() {
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    if (ep_ < 0) return os_error("epoll_create1", errno);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return os_error("eventfd", errno);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeKey;
    if (epoll_ctl(ep_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) return os_error("epoll_ctl", errno);
    return {};
  }

  ~TcpFabric() override {
    for (auto& kv : links_)
      if (kv.second->fd >= 0) ::close(kv.second->fd);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (ep_ >= 0) ::close(ep_);
  }

  const char* name() const override { return "tcp"; }

  std::string add_peer(std::uint32_t peer, int fd) override {
    const int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return os_error("fcntl", errno);
    const int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // not TCP (a test's socketpair): fine
    auto link = std::make_unique<Link>();
    link->peer = peer;
    link->fd = fd;
    link->last_in = Clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (links_.count(peer) != 0) return "peer " + std::to_string(peer) + " already has a link";
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = peer;
    if (epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev) != 0) return os_error("epoll_ctl", errno);
    links_.emplace(peer, std::move(link));
    return {};
  }

  std::string send(std::uint32_t peer, const std::uint8_t header[kHeaderSize], const std::uint8_t* payload,
                   std::uint64_t length, std::uint64_t cookie, bool* left) override {
    if (left != nullptr) *left = false;
    bool was_empty = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = links_.find(peer);
      if (it == links_.end()) return "no link to peer " + std::to_string(peer);
      Link& l = *it->second;
      if (!l.up) return "the link to peer " + std::to_string(peer) + " is down";
      Out o{};
      std::memcpy(o.header, header, kHeaderSize);
      o.payload = payload;
      o.length = length;
      o.cookie = cookie;
      was_empty = l.queue.empty();
      if (was_empty && left != nullptr && length <= kDirectBytes) {
        // Nothing queued, so nothing is being written to this socket (the progress thread writes only
        // queued frames, and pops a frame only once it went whole): the caller may write it now,
        // under the lock, without waiting. What does not fit goes to the queue as a frame begun.
        iovec iov[2] = {{o.header, kHeaderSize}, {const_cast<std::uint8_t*>(payload), length}};
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = length != 0 ? 2 : 1;
        const ssize_t put = ::sendmsg(l.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (put == static_cast<ssize_t>(kHeaderSize + length)) {
          push_now(l.fd, kHeaderSize + length);
          *left = true;
          return {};
        }
        if (put > 0) o.sent = static_cast<std::uint64_t>(put);  // (an error: the progress thread meets it again)
      }
      l.queue.push_back(o);
      if (was_empty) dirty_.push_back(peer);
    }
    if (was_empty) wake();
    return {};
  }

  void wake() override {
    const std::uint64_t one = 1;
    // A full counter (never, at 2**64 - 2 wakes) or EAGAIN still leaves the fd readable: a wake-up.
    (void)!::write(wake_fd_, &one, sizeof one);
  }

  void shutdown_links() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : links_) {
      Link& l = *kv.second;
      if (!l.up) continue;  // (its fd is the progress thread's to close)
      l.queue.clear();
      (void)::shutdown(l.fd, SHUT_WR);
    }
  }

  bool drained() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : links_) {
      Link& l = *kv.second;
      if (!l.up) continue;
      int outq = 0;
      // Unsent or unacknowledged bytes (TCP); a socket that has no such count (a socketpair) has
      // handed everything to its peer already.
      if (!l.queue.empty() || (::ioctl(l.fd, TIOCOUTQ, &outq) == 0 && outq > 0)) return false;
    }
    return true;
  }

  int progress(int timeout_ms) override {
    calls_ = 0;
    epoll_event events[64];
    const int n = epoll_wait(ep_, events, 64, timeout_ms);
    if (n < 0 && errno != EINTR) return -1;
    for (int i = 0; i < n; i++) {
      if (events[i].data.u64 == kWakeKey) {
        std::uint64_t v = 0;
        (void)!::read(wake_fd_, &v, sizeof v);
        continue;
      }
      Link* l = find(static_cast<std::uint32_t>(events[i].data.u64));
      if (l == nullptr || l->fd < 0) continue;
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_some(*l);
      if (l->fd >= 0 && (events[i].events & EPOLLOUT)) flush(*l);
    }
    // Links that got their first queued frame since the last turn.
    std::vector<std::uint32_t> dirty;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dirty.swap(dirty_);
    }
    for (std::uint32_t peer : dirty) {
      Link* l = find(peer);
      if (l != nullptr && l->fd >= 0) flush(*l);
    }
    if (idle_ms_ > 0) check_idle();
    return calls_;
  }

 private:
  Link* find(std::uint32_t peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(peer);
    return it == links_.end() ? nullptr : it->second.get();
  }

  void down(Link& l, const std::string& why, LinkEnd end) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      l.up = false;
      l.queue.clear();  // their memory is the owner's, who hears of the link's end below
    }
    (void)epoll_ctl(ep_, EPOLL_CTL_DEL, l.fd, nullptr);
    ::close(l.fd);
    l.fd = -1;
    calls_++;
    sink_->on_link_down(l.peer, why, end);
  }

  void check_idle() {
    const Clock::time_point now = Clock::now();
    std::vector<Link*> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : links_) all.push_back(kv.second.get());
    }
    for (Link* l : all) {
      if (l->fd < 0) continue;
      const auto quiet = std::chrono::duration_cast<std::chrono::milliseconds>(now - l->last_in).count();
      if (quiet > idle_ms_) {
        char text[48];
        std::snprintf(text, sizeof text, "silent for %.1f s", static_cast<double>(quiet) / 1000.0);
        down(*l, text, LinkEnd::kSilent);
      }
    }
  }

  // Read whole frames while the socket has bytes, up to this turn's share.
  void read_some(Link& l) {
    int frames = 0;
    std::uint64_t bytes = 0;
    while (l.fd >= 0 && frames < kFramesPerTurn && bytes < kBytesPerTurn) {
      if (!l.in_payload) {
        const ssize_t got = ::recv(l.fd, l.head + l.head_got, kHeaderSize - l.head_got, 0);
        if (!received(l, got, l.head_got != 0)) return;
        l.head_got += static_cast<std::size_t>(got);
        if (l.head_got < kHeaderSize) continue;
        l.head_got = 0;
        std::string why = decode_header(l.head, kHeaderSize, &l.h);
        if (!why.empty()) return down(l, "sent a bad frame header: " + why, LinkEnd::kBadFrame);
        l.dest = nullptr;
        why = sink_->on_header(l.peer, l.h, &l.dest);
        calls_++;
        if (!why.empty()) return down(l, why, LinkEnd::kBadFrame);
        l.in_payload = true;
        l.payload_got = 0;
      }
      if (l.payload_got < l.h.length) {
        // No destination: the owner does not want this payload; it is read into the drop buffer.
        std::uint64_t want = l.h.length - l.payload_got;
        std::uint8_t* into = drop_;
        if (l.dest != nullptr) into = l.dest + l.payload_got;
        else if (want > sizeof drop_) want = sizeof drop_;
        const ssize_t got = ::recv(l.fd, into, want, 0);
        if (!received(l, got, true)) return;
        l.payload_got += static_cast<std::uint64_t>(got);
        bytes += static_cast<std::uint64_t>(got);
        if (l.payload_got < l.h.length) continue;
      }
      l.in_payload = false;
      frames++;
      calls_++;
      sink_->on_frame(l.peer, l.h);
    }
  }

  // After a recv: true when `got` bytes came; false when there is nothing more now (or the link went down).
  bool received(Link& l, ssize_t got, bool mid_frame) {
    if (got > 0) {
      l.last_in = Clock::now();
      return true;
    }
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (got < 0 && errno == EINTR) return false;  // epoll reports it again
    if (got == 0) down(l, mid_frame ? "closed the connection in the middle of a frame" : "closed the connection", LinkEnd::kClosed);
    else down(l, os_error("receive failed", errno), errno == ECONNRESET ? LinkEnd::kClosed : LinkEnd::kError);
    return false;
  }

  // Write what is queued until the socket is full; completed frames are reported to the Sink.
  void flush(Link& l) {
    for (;;) {
      iovec iov[kMaxIov];
      int n = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        // Deque elements never move on push_back, and only this thread pops: the pointers taken
        // here stay valid after the lock is released.
        for (auto it = l.queue.begin(); it != l.queue.end() && n + 2 <= kMaxIov; ++it) {
          const Out& o = *it;
          if (o.sent < kHeaderSize) {
            iov[n++] = {const_cast<std::uint8_t*>(o.header) + o.sent, kHeaderSize - o.sent};
            if (o.length != 0) iov[n++] = {const_cast<std::uint8_t*>(o.payload), o.length};
          } else {
            const std::uint64_t off = o.sent - kHeaderSize;
            iov[n++] = {const_cast<std::uint8_t*>(o.payload) + off, o.length - off};
          }
        }
      }
      if (n == 0) return arm_out(l, false);
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t put = ::sendmsg(l.fd, &msg, MSG_NOSIGNAL);
      if (put < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return arm_out(l, true);
        if (errno == EINTR) continue;
        return down(l, os_error("send failed", errno), errno == ECONNRESET || errno == EPIPE ? LinkEnd::kClosed : LinkEnd::kError);
      }
      std::vector<std::uint64_t> cookies;
      std::uint64_t largest = 0;  // of the frames this write ended
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::uint64_t left = static_cast<std::uint64_t>(put);
        while (left > 0 && !l.queue.empty()) {
          Out& o = l.queue.front();
          const std::uint64_t rest = kHeaderSize + o.length - o.sent;
          if (left < rest) {
            o.sent += left;
            left = 0;
          } else {
            left -= rest;
            largest = std::max(largest, kHeaderSize + o.length);
            cookies.push_back(o.cookie);
            l.queue.pop_front();
          }
        }
      }
      push_now(l.fd, largest);
      for (std::uint64_t c : cookies) {
        calls_++;
        sink_->on_sent(l.peer, c);
      }
    }
  }

  void arm_out(Link& l, bool on) {
    if (l.watching_out == on || l.fd < 0) return;
    epoll_event ev{};
    ev.events = EPOLLIN | (on ? EPOLLOUT : 0u);
    ev.data.u64 = l.peer;
    if (epoll_ctl(ep_, EPOLL_CTL_MOD, l.fd, &ev) != 0) return down(l, os_error("epoll_ctl", errno), LinkEnd::kError);
    l.watching_out = on;
  }

  Sink* sink_;
  std::int64_t idle_ms_;
  int ep_ = -1;
  int wake_fd_ = -1;
  int calls_ = 0;
  std::uint8_t drop_[64 << 10];  // where unwanted payloads are read (progress thread only)
  std::mutex mu_;  // guards links_ (the map; links are never removed before destruction), each
                   // link's `up` and `queue`, and dirty_
  std::unordered_map<std::uint32_t, std::unique_ptr<Link>> links_;
  std::vector<std::uint32_t> dirty_;
};

}  // namespace

std::unique_ptr<Fabric> make_tcp_fabric(Sink* sink, std::int64_t idle_ms, std::string* why) {
  auto f = std::make_unique<TcpFabric>(sink, idle_ms);
  *why = f->open();
  if (!why->empty()) return nullptr;
  return f;
}

}  // namespace smddp
