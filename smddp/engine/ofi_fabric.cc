// The ofi fabric (fabric.h): libfabric reliable-datagram endpoints (EFA on AWS; tcp, shm anywhere).
//
// Wire (docs/protocol.md, "The ofi fabric"): every frame travels as one untagged message into a
// receive buffer the fabric keeps posted: a 40-byte prefix (magic, kind, the id the receiver gave
// the sender, credits returned, the receiver's secret, the sender's serial, the number of payload
// parts), then the frame's 56-byte header, then its payload when that is at most the eager limit
// (copied out of the buffer into the place the Sink names). A larger payload follows as tagged
// messages of at most part_bytes each, received straight into that place: their tags mix the
// frame's serial and part number with a key the receiver chose, so only the sender it gave the key
// to can fill them. Secrets, keys, addresses and limits are exchanged over the authenticated stream
// the control plane hands to add_peer, which stays open as the link's liveness: its end without a
// FIN is a closed link, silence past the idle limit a silent one, as on TCP.
//
// Flow control: each peer may have `window` frames in flight to us (32; fewer in jobs of more than
// 64 nodes, down to 4); the receive buffers they sit in are reposted when the frame has been handed
// to the Sink, and the credits go back in the prefix of the next message or, when half a window is
// owed, in a CREDIT message. So receive buffers never run out (window + 3 per peer are posted: the
// window, two CREDITs and a FIN), and what waits for credits waits in the sender's queue, which the
// protocol's collectives bound.
//
// Threads: every libfabric call is made under the fabric's mutex (the domain is opened
// FI_THREAD_DOMAIN); the Sink is called from the progress thread only, without the mutex.
// Ownership: the fabric owns the libfabric objects, its bounce buffers and their registrations, the
// links' streams, and the registrations of memory the owner lends (register_memory), which last until
// the fabric closes. Payload memory of a send is the caller's until on_sent; a receive's destination
// is the Sink's until on_frame or on_link_down, and a link goes down only once the receives posted
// into that memory have completed or been cancelled (or after kCancelWaitMs, when the job is lost).
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fabric.h"
#include "ofi_abi.h"
#include "ofi_wire.h"

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kWakeKey = ~std::uint64_t{0};
constexpr std::uint64_t kCqKey = ~std::uint64_t{0} - 1;
using ofi_wire::kPrefix;
constexpr std::size_t kMsgHead = kPrefix + kHeaderSize;
constexpr std::uint64_t kEagerMax = 16 << 10;  // payloads up to this travel in the frame's message
constexpr std::size_t kBufBytes = (kMsgHead + kEagerMax + 63) / 64 * 64;
// Frames a peer may have in flight to us: 32, less in large jobs, where every peer's window costs
// its receive and send buffers (2 x (window + 3) x 16.6 KiB): 2048 frames over all peers, at least 4
// each (so 7.6 MiB for 63 peers, 232 MiB for 1023).
constexpr std::uint32_t kMaxWindow = 32;
constexpr std::uint32_t kMinWindow = 4;
constexpr std::uint32_t kWindowTotal = 2048;
std::uint32_t window_for(std::uint32_t peers) {
  if (peers == 0) return kMaxWindow;
  return std::max(kMinWindow, std::min(kMaxWindow, kWindowTotal / peers));
}
constexpr std::uint64_t kMaxPart = 1ULL << 30;
constexpr std::uint64_t kMaxParts = 1ULL << 20;  // (a tag has 20 bits for the part)
constexpr int kCancelWaitMs = 1000;
constexpr int kCqBatch = 32;

using ofi_wire::kCredit;
using ofi_wire::kFin;
using ofi_wire::kFrame;
using ofi_wire::kHelloHead;
using ofi_wire::kMaxAddr;
using ofi_wire::kStreamFin;

std::string os_error(const char* what, int err) { return std::string(what) + ": " + std::strerror(err); }

std::uint64_t random64() {
  std::uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) {
    // Never on Linux for 8 bytes; a secret from the clock is still unknown to other hosts.
    v = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ULL;
  }
  return v;
}

// An operation's context: libfabric's own scratch first (FI_CONTEXT / FI_CONTEXT2 ask for it).
enum class OpKind : std::uint8_t { kRxBuf, kTxBuf, kTxPart, kRxPart };
struct Frame;
struct Op {
  void* scratch[8] = {};
  OpKind kind = OpKind::kRxBuf;
  std::uint32_t peer = 0;
  std::uint8_t* buf = nullptr;  // kRxBuf, kTxBuf: the bounce buffer
  void* desc = nullptr;         // its registration's descriptor
  Frame* frame = nullptr;       // kTxPart: the frame it carries a part of
  ofi::FidMr* temp_mr = nullptr;  // a registration made for this operation alone
  std::size_t len = 0;          // kRxBuf: the message's length, once it landed
  ofi_wire::Prefix prefix;      // ... and its prefix, checked
  bool drop = false;            // kRxPart: into the drop buffer (truncation expected)
  bool posted = false;
  bool cancelled = false;
};

// A frame on its way out.
struct Frame {
  std::uint8_t header[kHeaderSize];
  const std::uint8_t* payload = nullptr;
  std::uint64_t length = 0;
  std::uint64_t cookie = 0;
  std::uint64_t serial = 0;
  std::uint64_t parts = 0;
  bool head_posted = false;
  std::uint64_t parts_posted = 0;
  std::uint64_t parts_left = 0;  // completions still to come
  std::vector<Op> part_ops;
  bool report = true;  // on_sent when it has left
};

struct Link {
  std::uint32_t peer = 0;
  int fd = -1;
  enum State { kExchanging, kUp, kDown } state = kExchanging;
  Clock::time_point last_in;
  // The exchange on the stream.
  std::uint8_t blob[kHelloHead + kMaxAddr] = {};  // the peer's hello, as it comes
  std::size_t blob_got = 0;
  std::uint64_t rx_secret = 0, rx_key = 0;  // ours: what the peer must stamp, and its tags' key
  std::uint64_t tx_secret = 0, tx_key = 0;  // the peer's, for what we send it
  std::uint32_t tx_id = 0;                  // what the peer calls us
  ofi::Addr addr = 0;
  std::uint64_t eager = kEagerMax, part_bytes = kMaxPart;
  std::uint32_t window = kMaxWindow;  // what the peer lets us have in flight (its hello)
  // Sending (under the fabric's mutex).
  std::deque<std::unique_ptr<Frame>> queue;  // not yet wholly posted, in order
  std::vector<std::unique_ptr<Frame>> flying;  // posted, completions to come
  std::uint64_t next_serial = 0;
  std::uint32_t in_flight = 0;  // frames the peer has not credited back
  std::uint32_t owed = 0;       // credits we owe the peer
  bool credit_pending = false;  // a CREDIT message could not be posted yet
  bool shut = false, fin_posted = false, wr_closed = false;
  // Receiving (under the fabric's mutex, handed to the Sink by the progress thread).
  std::map<std::uint64_t, Op*> ready;  // messages by serial, waiting their turn
  std::uint64_t next_in = 0;
  std::uint32_t held = 0;  // buffers this peer's messages hold
  bool peer_closing = false;  // its stream said its FIN has left
  bool in_payload = false;
  Header h{};
  std::uint8_t* dest = nullptr;
  std::vector<Op> rx_parts;
  std::uint64_t rx_posted = 0, rx_done = 0, rx_serial = 0;
  std::string down_why;
  LinkEnd down_end = LinkEnd::kClosed;
  Clock::time_point down_at;
  bool reported = false;
};

// The exported functions of the libfabric at `lib`.
std::string load_api(void* lib, ofi::Api* api) {
  api->getinfo = reinterpret_cast<decltype(api->getinfo)>(dlsym(lib, "fi_getinfo"));
  api->freeinfo = reinterpret_cast<decltype(api->freeinfo)>(dlsym(lib, "fi_freeinfo"));
  api->dupinfo = reinterpret_cast<decltype(api->dupinfo)>(dlsym(lib, "fi_dupinfo"));
  api->fabric = reinterpret_cast<decltype(api->fabric)>(dlsym(lib, "fi_fabric"));
  api->strerror = reinterpret_cast<decltype(api->strerror)>(dlsym(lib, "fi_strerror"));
  if (!api->getinfo || !api->freeinfo || !api->dupinfo || !api->fabric || !api->strerror)
    return "not a libfabric: fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric or fi_strerror is missing";
  return {};
}

class OfiFabric final : public Fabric {
 public:
  OfiFabric(Sink* sink, std::int64_t idle_ms, std::uint32_t peers)
      : sink_(sink), idle_ms_(idle_ms), window_(window_for(peers)), bufs_per_peer_(window_ + 3) {}

  std::string open(const std::string& library, const std::string& provider) {
    library_ = library;
    provider_ = provider;
    lib_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) return "cannot load libfabric (" + library + "): " + dlerror();
    std::string w = load_api(lib_, &api_);
    if (!w.empty()) return library + ": " + w;
    std::vector<std::string> offered;
    w = pick(api_, provider, &info_, &offered);
    if (!w.empty()) return w;
    if (info_ == nullptr) {
      std::string list;
      for (const auto& o : offered) list += (list.empty() ? "" : ", ") + o;
      return "libfabric (" + library + ") has no provider '" + provider +
             "' with reliable-datagram endpoints and tagged messages here; it offers: " +
             (list.empty() ? "none" : list);
    }
    ep_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (ep_fd_ < 0) return os_error("epoll_create1", errno);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return os_error("eventfd", errno);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeKey;
    if (epoll_ctl(ep_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) return os_error("epoll_ctl", errno);
    return {};
  }

  ~OfiFabric() override {
    std::lock_guard<std::mutex> lock(mu_);
    // The endpoint goes first: nothing is read into or out of memory after it.
    if (ep_ != nullptr) close_fid(&ep_->fid);
    for (auto& kv : regs_) close_fid(&kv.second.mr->fid);
    for (auto& b : blocks_)
      if (b.mr != nullptr) close_fid(&b.mr->fid);
    if (av_ != nullptr) close_fid(&av_->fid);
    if (cq_ != nullptr) close_fid(&cq_->fid);
    if (domain_ != nullptr) close_fid(&domain_->fid);
    if (fabric_ != nullptr) close_fid(&fabric_->fid);
    for (auto& b : blocks_) std::free(b.mem);
    std::free(drop_);
    for (auto& kv : links_)
      if (kv.second->fd >= 0) ::close(kv.second->fd);
    if (info_ != nullptr) api_.freeinfo(info_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (ep_fd_ >= 0) ::close(ep_fd_);
    // The library stays loaded: providers may keep threads and handlers for the process's life.
  }

  const char* name() const override { return "ofi"; }

  std::string describe() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::string d = "ofi " + provider_;
    if (chosen_ != nullptr) {
      d += " (fabric " + std::string(chosen_->fabric_attr->name ? chosen_->fabric_attr->name : "?") + ", domain " +
           std::string(chosen_->domain_attr->name ? chosen_->domain_attr->name : "?") + ")";
    }
    return d + ", libfabric " + library_;
  }

  std::string register_memory(const void* base, std::uint64_t length) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (length == 0) return {};
    const auto key = reinterpret_cast<std::uintptr_t>(base);
    if (regs_.count(key) != 0 || pending_regs_.count(key) != 0) return {};
    if (domain_ == nullptr) {  // the domain opens with the first link: registered then
      pending_regs_[key] = length;
      return {};
    }
    return register_locked(key, length);
  }

  std::string add_peer(std::uint32_t peer, int fd) override {
    const int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return os_error("fcntl", errno);
    std::lock_guard<std::mutex> lock(mu_);
    if (links_.count(peer) != 0) return "peer " + std::to_string(peer) + " already has a link";
    if (ep_ == nullptr) {
      const std::string w = open_endpoint(fd);
      if (!w.empty()) return w;
    }
    auto link = std::make_unique<Link>();
    link->peer = peer;
    link->fd = fd;
    link->rx_secret = random64();
    link->rx_key = random64();
    std::string w = grow_pool_locked();
    if (!w.empty()) return w;
    // What the peer needs to reach us: written now (a few hundred bytes fit any socket's buffer).
    ofi_wire::Hello hello;
    hello.your_id = peer;  // what the peer writes in what it sends us
    hello.window = window_;
    hello.secret = link->rx_secret;
    hello.tag_key = link->rx_key;
    hello.eager = kEagerMax;
    hello.part_bytes = part_limit_;
    hello.addr.assign(name_, name_ + name_len_);
    std::uint8_t blob[kHelloHead + kMaxAddr] = {};
    const std::size_t n = ofi_wire::encode_hello(hello, blob);
    const ssize_t put = ::send(fd, blob, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (put != static_cast<ssize_t>(n))
      return put < 0 ? os_error("cannot send this daemon's fabric address", errno)
                     : "cannot send this daemon's fabric address: the stream took only part of it";
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = peer;
    if (epoll_ctl(ep_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) return os_error("epoll_ctl", errno);
    link->last_in = Clock::now();  // (after the endpoint and buffers, which take a while the first time)
    links_.emplace(peer, std::move(link));
    return {};
  }

  std::string send(std::uint32_t peer, const std::uint8_t header[kHeaderSize], const std::uint8_t* payload,
                   std::uint64_t length, std::uint64_t cookie, bool* left) override {
    if (left != nullptr) *left = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = links_.find(peer);
      if (it == links_.end()) return "no link to peer " + std::to_string(peer);
      Link& l = *it->second;
      if (l.state == Link::kDown || l.shut) return "the link to peer " + std::to_string(peer) + " is down";
      Frame f;
      std::memcpy(f.header, header, kHeaderSize);
      f.payload = payload;
      f.length = length;
      f.cookie = cookie;
      if (l.state == Link::kUp && l.queue.empty() && left != nullptr && length <= l.eager) {
        // Small, nothing before it: posted now from the caller's thread (its payload is copied),
        // which saves waking the progress thread. (Inline, it has no parts: nothing of it is
        // libfabric's once posted, so it needs no home on the heap.)
        f.report = false;
        bool posted = false;
        const std::string w = post_frame_locked(l, &f, &posted);
        if (!w.empty()) {
          down_locked(l, w, LinkEnd::kError);
          return "the link to peer " + std::to_string(peer) + " is down";
        }
        if (posted) {
          *left = true;
          return {};
        }
        f.report = true;
      }
      // Queued frames live on the heap: their parts' contexts must not move once posted.
      l.queue.push_back(std::make_unique<Frame>(std::move(f)));
      dirty_ = true;
    }
    wake();
    return {};
  }

  void wake() override {
    const std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }

  void shutdown_links() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : links_) {
      Link& l = *kv.second;
      if (l.state == Link::kDown || l.shut) continue;
      l.shut = true;
      // Frames not wholly posted are dropped, as TCP drops what is not in the kernel.
      while (!l.queue.empty() && !l.queue.front()->head_posted) l.queue.pop_front();
      while (!l.queue.empty() && !l.queue.back()->head_posted) l.queue.pop_back();
      if (l.state == Link::kExchanging) {
        (void)::shutdown(l.fd, SHUT_WR);
        l.wr_closed = true;
        continue;
      }
      post_fin_locked(l);
    }
    dirty_ = true;
  }

  bool drained() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : links_) {
      Link& l = *kv.second;
      if (l.state == Link::kDown) continue;
      if (!l.queue.empty() || !l.flying.empty() || (l.shut && !l.wr_closed)) return false;
      int outq = 0;
      if (::ioctl(l.fd, TIOCOUTQ, &outq) == 0 && outq > 0) return false;
    }
    return true;
  }

  int progress(int timeout_ms) override {
    calls_ = 0;
    const int did = work();
    if (did == 0 && timeout_ms > 0) {
      // Sleep in epoll (the wake fd, the streams, the CQ's wait fd) only when the provider agrees
      // that nothing is pending (fi_trywait); without a wait object (EFA's CQ), or with posts the
      // provider refused for now, nap briefly and look again.
      bool sleep = true, nap = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (dirty_) {
          sleep = false;
          nap = true;
        } else if (cq_ != nullptr && cq_fd_ < 0) {
          sleep = false;
          nap = true;
        } else if (cq_ != nullptr) {
          ofi::Fid* fids[1] = {&cq_->fid};
          sleep = fabric_->ops->trywait(fabric_, fids, 1) == 0;
        }
      }
      if (nap) {
        timespec t{0, 20'000};
        nanosleep(&t, nullptr);
      }
      poll_fds(sleep ? timeout_ms : 0);
    } else {
      poll_fds(0);
    }
    (void)work();
    if (idle_ms_ > 0) check_idle();
    report_downs();
    return calls_;
  }

  FabricCounters counters() override {
    std::lock_guard<std::mutex> lock(mu_);
    return counters_;
  }

 private:
  struct Reg {
    std::uint64_t length;
    ofi::FidMr* mr;
  };
  struct Block {
    std::uint8_t* mem = nullptr;
    ofi::FidMr* mr = nullptr;
    std::vector<std::unique_ptr<Op>> ops;
  };


 public:
  // The entries of `provider` (exactly that name) offering what the fabric needs, in libfabric's
  // order, as a list owned by the caller (nullptr: none); *offered names every provider that
  // offers reliable-datagram tagged messages at all.
  static std::string pick(const ofi::Api& api, const std::string& provider, ofi::Info** out,
                          std::vector<std::string>* offered) {
    *out = nullptr;
    ofi::Info* hints = api.dupinfo(nullptr);
    if (hints == nullptr) return "libfabric could not allocate its hints";
    hints->caps = ofi::kMsg | ofi::kTagged;
    hints->mode = ofi::kContext | ofi::kContext2;
    hints->ep_attr->type = ofi::kEpRdm;
    hints->domain_attr->mr_mode = ofi::kMrLocal | ofi::kMrVirtAddr | ofi::kMrAllocated | ofi::kMrProvKey;
    hints->domain_attr->threading = ofi::kThreadDomain;
    ofi::Info* all = nullptr;
    const int r = api.getinfo(ofi::kApiVersion, nullptr, nullptr, 0, hints, &all);
    api.freeinfo(hints);
    if (r != 0 && r != -ofi::kENoData) return std::string("fi_getinfo failed: ") + api.strerror(-r);
    ofi::Info** tail = out;
    for (ofi::Info* i = all; i != nullptr;) {
      ofi::Info* next = i->next;
      const std::string name = i->fabric_attr && i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
      if (std::find(offered->begin(), offered->end(), name) == offered->end()) offered->push_back(name);
      if (name == provider) {  // kept, in order
        i->next = nullptr;
        *tail = i;
        tail = &i->next;
      } else {
        i->next = nullptr;
        api.freeinfo(i);
      }
      i = next;
    }
    return {};
  }

 private:
  void close_fid(ofi::Fid* fid) { (void)fid->ops->close(fid); }

  std::string fi_error(const char* what, long r) {
    return std::string(what) + " failed: " + api_.strerror(static_cast<int>(r < 0 ? -r : r));
  }

  // The fabric, domain, completion queue, address vector and endpoint, on the first link: a
  // provider with socket addresses (tcp) uses the interface the link's stream came in on.
  std::string open_endpoint(int fd) {
    chosen_ = info_;
    sockaddr_storage mine{};
    socklen_t len = sizeof mine;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) == 0 && mine.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&mine);
      for (ofi::Info* i = info_; i != nullptr; i = i->next) {
        if (i->src_addr == nullptr || i->src_addrlen < sizeof(sockaddr_in)) continue;
        const auto* s = static_cast<const sockaddr_in*>(i->src_addr);
        if (s->sin_family == AF_INET && s->sin_addr.s_addr == in->sin_addr.s_addr) {
          chosen_ = i;
          break;
        }
      }
    }
    ofi::Info* info = chosen_;
    mr_local_ = (info->domain_attr->mr_mode & ofi::kMrLocal) != 0;
    part_limit_ = std::min<std::uint64_t>(info->ep_attr->max_msg_size, kMaxPart);
    if (part_limit_ < kBufBytes) return "the provider's messages are too small (" + std::to_string(part_limit_) + " bytes)";
    int r = api_.fabric(info->fabric_attr, &fabric_, nullptr);
    if (r != 0) return fi_error("fi_fabric", r);
    r = fabric_->ops->domain(fabric_, info, &domain_, nullptr);
    if (r != 0) return fi_error("fi_domain", r);
    ofi::CqAttr ca{};
    ca.size = 0;  // the provider's default
    ca.format = ofi::kCqFormatTagged;
    ca.wait_obj = ofi::kWaitFd;
    r = domain_->ops->cq_open(domain_, &ca, &cq_, nullptr);
    if (r != 0) {  // no wait object (EFA's CQ): progress polls
      ca.wait_obj = ofi::kWaitNone;
      r = domain_->ops->cq_open(domain_, &ca, &cq_, nullptr);
      if (r != 0) return fi_error("fi_cq_open", r);
    } else if (cq_->fid.ops->control(&cq_->fid, ofi::kGetWait, &cq_fd_) != 0) {
      cq_fd_ = -1;
    }
    ofi::AvAttr aa{};
    aa.type = ofi::kAvTable;
    r = domain_->ops->av_open(domain_, &aa, &av_, nullptr);
    if (r != 0) return fi_error("fi_av_open", r);
    r = domain_->ops->endpoint(domain_, info, &ep_, nullptr);
    if (r != 0) return fi_error("fi_endpoint", r);
    r = ep_->fid.ops->bind(&ep_->fid, &cq_->fid, ofi::kTransmit | ofi::kRecv);
    if (r != 0) return fi_error("fi_ep_bind (CQ)", r);
    r = ep_->fid.ops->bind(&ep_->fid, &av_->fid, 0);
    if (r != 0) return fi_error("fi_ep_bind (AV)", r);
    r = ep_->fid.ops->control(&ep_->fid, ofi::kEnable, nullptr);
    if (r != 0) return fi_error("fi_enable", r);
    name_len_ = sizeof name_;
    r = ep_->cm->getname(&ep_->fid, name_, &name_len_);
    if (r != 0) return fi_error("fi_getname", r);
    if (name_len_ > kMaxAddr) return "the endpoint's address is longer than " + std::to_string(kMaxAddr) + " bytes";
    if (cq_fd_ >= 0) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kCqKey;
      if (epoll_ctl(ep_fd_, EPOLL_CTL_ADD, cq_fd_, &ev) != 0) return os_error("epoll_ctl", errno);
    }
    drop_ = static_cast<std::uint8_t*>(std::aligned_alloc(64, 4096));
    if (drop_ == nullptr) return "out of memory";
    std::string w = register_locked(reinterpret_cast<std::uintptr_t>(drop_), 4096);
    if (!w.empty()) return w;
    for (const auto& [key, length] : pending_regs_) {
      w = register_locked(key, length);
      if (!w.empty()) return w;
    }
    pending_regs_.clear();
    return {};
  }

  std::string register_locked(std::uintptr_t key, std::uint64_t length) {
    ofi::FidMr* mr = nullptr;
    const int r = domain_->mr->reg(&domain_->fid, reinterpret_cast<const void*>(key), length,
                                   ofi::kAccessSend | ofi::kAccessRecv, 0, 0, 0, &mr, nullptr);
    if (r != 0) return fi_error("fi_mr_reg", r);
    regs_[key] = Reg{length, mr};
    counters_.registrations++;
    return {};
  }

  // The descriptor for [p, p + n): from a registration that holds it, else (where the provider
  // needs one) a registration for this operation alone, which *temp then owns.
  std::string desc_for(const std::uint8_t* p, std::uint64_t n, void** desc, ofi::FidMr** temp) {
    *desc = nullptr;
    *temp = nullptr;
    const auto key = reinterpret_cast<std::uintptr_t>(p);
    auto it = regs_.upper_bound(key);
    if (it != regs_.begin()) {
      --it;
      if (key - it->first + n <= it->second.length) {
        *desc = it->second.mr->mem_desc;
        return {};
      }
    }
    if (!mr_local_) return {};
    const int r = domain_->mr->reg(&domain_->fid, p, n, ofi::kAccessSend | ofi::kAccessRecv, 0, 0, 0, temp, nullptr);
    if (r != 0) return fi_error("fi_mr_reg", r);
    counters_.temp_registrations++;
    *desc = (*temp)->mem_desc;
    return {};
  }

  void drop_temp(Op& op) {
    if (op.temp_mr != nullptr) close_fid(&op.temp_mr->fid);
    op.temp_mr = nullptr;
  }

  // Bounce buffers for one more peer: bufs_per_peer_ to receive into (posted now), as many to send from.
  std::string grow_pool_locked() {
    Block b;
    const std::size_t count = 2 * bufs_per_peer_;
    b.mem = static_cast<std::uint8_t*>(std::aligned_alloc(64, count * kBufBytes));
    if (b.mem == nullptr) return "out of memory for the fabric's buffers";
    std::memset(b.mem, 0, count * kBufBytes);
    ofi::FidMr* mr = nullptr;
    const int r = domain_->mr->reg(&domain_->fid, b.mem, count * kBufBytes, ofi::kAccessSend | ofi::kAccessRecv, 0, 0,
                                   0, &mr, nullptr);
    if (r != 0) {
      std::free(b.mem);
      return fi_error("fi_mr_reg", r);
    }
    b.mr = mr;
    counters_.registrations++;
    for (std::size_t i = 0; i < count; i++) {
      auto op = std::make_unique<Op>();
      op->buf = b.mem + i * kBufBytes;
      op->desc = mr->mem_desc;
      if (i < bufs_per_peer_) {
        op->kind = OpKind::kRxBuf;
        rx_unposted_.push_back(op.get());
      } else {
        op->kind = OpKind::kTxBuf;
        tx_free_.push_back(op.get());
      }
      b.ops.push_back(std::move(op));
    }
    blocks_.push_back(std::move(b));
    repost_locked();
    return {};
  }

  // Post the receive buffers that are free (a provider out of room: the rest wait for the next turn).
  void repost_locked() {
    while (!rx_unposted_.empty()) {
      Op* op = rx_unposted_.back();
      const long r = ep_->msg->recv(ep_, op->buf, kBufBytes, op->desc, ofi::kAddrUnspec, op);
      if (r == -ofi::kEAgain) {
        dirty_ = true;
        return;
      }
      if (r != 0) {
        fatal_ = fi_error("fi_recv", r);
        return;
      }
      op->posted = true;
      rx_unposted_.pop_back();
    }
  }

  // The prefix of a message to `l`, with every credit owed to it (returned: put back if the post fails).
  std::uint32_t fill_prefix(Link& l, std::uint8_t* b, ofi_wire::Kind kind, std::uint64_t serial, std::uint64_t parts) {
    ofi_wire::Prefix p;
    p.kind = kind;
    p.from = l.tx_id;
    p.credits = l.owed;
    p.secret = l.tx_secret;
    p.serial = serial;
    p.parts = static_cast<std::uint32_t>(parts);
    ofi_wire::encode_prefix(p, b);
    l.owed = 0;
    return p.credits;
  }

  // Post a whole frame, or as much of it as the provider takes now (*posted: all of it). "" or a
  // fatal error for the link.
  std::string post_frame_locked(Link& l, Frame* f, bool* posted) {
    *posted = false;
    if (!f->head_posted) {
      if (l.in_flight >= l.window || tx_free_.empty()) return {};
      const bool eager = f->length <= l.eager;
      f->parts = eager ? 0 : (f->length + l.part_bytes - 1) / l.part_bytes;
      if (f->parts > kMaxParts) return "a frame of " + std::to_string(f->length) + " bytes has too many parts";
      Op* op = tx_free_.back();
      f->serial = l.next_serial;
      const std::uint32_t credits = fill_prefix(l, op->buf, kFrame, f->serial, f->parts);
      std::memcpy(op->buf + kPrefix, f->header, kHeaderSize);
      if (eager && f->length != 0) std::memcpy(op->buf + kMsgHead, f->payload, f->length);
      const std::size_t n = kMsgHead + (eager ? f->length : 0);
      op->peer = l.peer;
        const long r = ep_->msg->send(ep_, op->buf, n, op->desc, l.addr, op);
      if (r == -ofi::kEAgain) {
        l.owed += credits;  // not sent: still owed
        return {};
      }
      if (r != 0) return fi_error("fi_send", r);
      tx_free_.pop_back();
      l.next_serial++;
      l.in_flight++;
      f->head_posted = true;
      f->part_ops.resize(f->parts);
      f->parts_left = f->parts;
      counters_.messages_out++;
    }
    while (f->parts_posted < f->parts) {
      const std::uint64_t i = f->parts_posted;
      const std::uint64_t off = i * l.part_bytes;
      const std::uint64_t n = std::min(l.part_bytes, f->length - off);
      Op& op = f->part_ops[i];
      op.kind = OpKind::kTxPart;
      op.peer = l.peer;
      op.frame = f;
      if (!op.posted) {
        void* desc = nullptr;
        if (op.temp_mr == nullptr) {
          const std::string w = desc_for(f->payload + off, n, &desc, &op.temp_mr);
          if (!w.empty()) return w;
        } else {
          desc = op.temp_mr->mem_desc;
        }
        const long r = ep_->tagged->send(ep_, f->payload + off, n, desc, l.addr, ofi_wire::tag_of(l.tx_key, f->serial, i), &op);
        if (r == -ofi::kEAgain) return {};
        if (r != 0) return fi_error("fi_tsend", r);
        op.posted = true;
      }
      f->parts_posted++;
    }
    *posted = true;
    return {};
  }

  void post_fin_locked(Link& l) {
    if (l.fin_posted || l.state != Link::kUp || tx_free_.empty()) {
      if (!l.fin_posted) dirty_ = true;
      return;
    }
    Op* op = tx_free_.back();
    const std::uint32_t credits = fill_prefix(l, op->buf, kFin, l.next_serial, 0);
    op->peer = l.peer;
    const long r = ep_->msg->send(ep_, op->buf, kPrefix, op->desc, l.addr, op);
    if (r == -ofi::kEAgain) {
      l.owed += credits;
      dirty_ = true;
      return;
    }
    if (r != 0) return down_locked(l, fi_error("fi_send", r), LinkEnd::kError);
    tx_free_.pop_back();
    l.next_serial++;
    l.fin_posted = true;
    fin_ops_[op] = l.peer;
  }

  void post_credit_locked(Link& l) {
    if (tx_free_.empty()) {
      l.credit_pending = true;
      dirty_ = true;
      return;
    }
    Op* op = tx_free_.back();
    const std::uint32_t credits = fill_prefix(l, op->buf, kCredit, 0, 0);
    op->peer = l.peer;
    const long r = ep_->msg->send(ep_, op->buf, kPrefix, op->desc, l.addr, op);
    if (r == -ofi::kEAgain) {
      l.owed += credits;
      l.credit_pending = true;
      dirty_ = true;
      return;
    }
    if (r != 0) return down_locked(l, fi_error("fi_send", r), LinkEnd::kError);
    tx_free_.pop_back();
    l.credit_pending = false;
  }

  // Move what can move: queued frames, credits, receive buffers. Under the mutex.
  void flush_locked(std::vector<std::pair<std::uint32_t, std::uint64_t>>* sent) {
    dirty_ = false;
    repost_locked();
    for (auto& kv : links_) {
      Link& l = *kv.second;
      if (l.state != Link::kUp) continue;
      while (!l.queue.empty()) {
        Frame* f = l.queue.front().get();
        bool posted = false;
        const std::string w = post_frame_locked(l, f, &posted);
        if (!w.empty()) {
          down_locked(l, w, LinkEnd::kError);
          break;
        }
        if (!posted) {
          if (l.in_flight < l.window && !tx_free_.empty()) dirty_ = true;  // the provider was full
          break;
        }
        if (f->parts == 0) {
          // Eager: its payload was copied, so its memory is the owner's again.
          if (f->report) sent->emplace_back(l.peer, f->cookie);
          l.queue.pop_front();
        } else {
          l.flying.push_back(std::move(l.queue.front()));
          l.queue.pop_front();
        }
      }
      if (l.state != Link::kUp) continue;
      // Half of our own window owed (what the peer may have in flight to us): send them back.
      if (l.credit_pending || l.owed >= std::max<std::uint32_t>(1, window_ / 2)) post_credit_locked(l);
      if (l.shut && !l.fin_posted) post_fin_locked(l);
    }
  }

  // Read completions and hand frames to the Sink in order. Returns how many things happened.
  int work() {
    std::vector<std::pair<std::uint32_t, std::uint64_t>> sent;
    int did = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ep_ == nullptr) return 0;
      for (int round = 0; round < 4; round++) {
        ofi::CqEntry entries[kCqBatch];
        const long n = cq_->ops->read(cq_, entries, kCqBatch);
        if (n == -ofi::kEAgain) break;
        if (n == -ofi::kEAvail) {
          on_error_locked();
          did++;
          continue;
        }
        if (n < 0) {
          fatal_ = fi_error("fi_cq_read", n);
          break;
        }
        for (long i = 0; i < n; i++) on_completion_locked(entries[i], &sent);
        did += static_cast<int>(n);
        if (n < kCqBatch) break;
      }
      flush_locked(&sent);
      if (!fatal_.empty()) {
        for (auto& kv : links_)
          if (kv.second->state != Link::kDown) down_locked(*kv.second, fatal_, LinkEnd::kError);
      }
    }
    for (const auto& [peer, cookie] : sent) {
      calls_++;
      sink_->on_sent(peer, cookie);
    }
    did += static_cast<int>(sent.size());
    did += deliver();
    return did;
  }

  Link* link_of(std::uint32_t peer) {
    auto it = links_.find(peer);
    return it == links_.end() ? nullptr : it->second.get();
  }

  void on_completion_locked(const ofi::CqEntry& e, std::vector<std::pair<std::uint32_t, std::uint64_t>>* sent) {
    Op* op = static_cast<Op*>(e.op_context);
    if (op == nullptr) return;
    switch (op->kind) {
      case OpKind::kRxBuf:
        op->posted = false;
        return on_message_locked(op, e.len);
      case OpKind::kTxBuf:
        return tx_done_locked(op);
      case OpKind::kTxPart:
        return part_sent_locked(op, sent);
      case OpKind::kRxPart:
        return part_received_locked(op);
    }
  }

  void tx_done_locked(Op* op) {
    auto fin = fin_ops_.find(op);
    if (fin != fin_ops_.end()) {
      Link* l = link_of(fin->second);
      if (l != nullptr && l->state != Link::kDown && !l->wr_closed) {
        // The FIN has left: the stream says so, then ends. A stream that ends without this byte is
        // a peer gone (killed, crashed), taken down at once; after it, the FIN's turn does it.
        const std::uint8_t bye = kStreamFin;
        (void)!::send(l->fd, &bye, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)::shutdown(l->fd, SHUT_WR);
        l->wr_closed = true;
      }
      fin_ops_.erase(fin);
    }
    tx_free_.push_back(op);
  }

  void part_sent_locked(Op* op, std::vector<std::pair<std::uint32_t, std::uint64_t>>* sent) {
    drop_temp(*op);
    Frame* f = op->frame;
    Link* l = link_of(op->peer);
    if (f == nullptr || l == nullptr || f->parts_left == 0) return;
    if (--f->parts_left != 0) return;
    auto it = std::find_if(l->flying.begin(), l->flying.end(), [f](const auto& p) { return p.get() == f; });
    if (it == l->flying.end()) return;
    if (l->state != Link::kDown && f->report) sent->emplace_back(l->peer, f->cookie);
    l->flying.erase(it);
  }

  void part_received_locked(Op* op) {
    drop_temp(*op);
    op->posted = false;
    Link* l = link_of(op->peer);
    if (l == nullptr) return;
    l->rx_done++;
    l->last_in = Clock::now();
  }

  void on_error_locked() {
    ofi::CqErrEntry e{};
    if (cq_->ops->readerr(cq_, &e, 0) < 0) return;
    Op* op = static_cast<Op*>(e.op_context);
    if (op == nullptr) return;
    const bool cancelled = e.err == ofi::kECanceled;
    char text[256] = {};
    const char* prov = cq_->ops->strerror ? cq_->ops->strerror(cq_, e.prov_errno, e.err_data, text, sizeof text) : nullptr;
    const std::string why = std::string(api_.strerror(e.err)) + (prov && *prov ? std::string(" (") + prov + ")" : "");
    switch (op->kind) {
      case OpKind::kRxBuf:
        op->posted = false;
        if (!cancelled) counters_.rejected++;  // a message that did not fit: not one of ours
        rx_unposted_.push_back(op);
        return;
      case OpKind::kTxBuf: {
        tx_done_locked(op);
        Link* l = link_of(op->peer);
        if (l != nullptr && l->state != Link::kDown) down_locked(*l, "a send failed: " + why, LinkEnd::kError);
        return;
      }
      case OpKind::kTxPart: {
        std::vector<std::pair<std::uint32_t, std::uint64_t>> none;
        Link* l = link_of(op->peer);
        if (l != nullptr && l->state != Link::kDown) down_locked(*l, "a send failed: " + why, LinkEnd::kError);
        part_sent_locked(op, &none);
        return;
      }
      case OpKind::kRxPart: {
        const bool fine = op->drop && e.err == ofi::kETrunc;  // a dropped payload, cut as meant
        part_received_locked(op);
        Link* l = link_of(op->peer);
        if (!fine && !cancelled && l != nullptr && l->state != Link::kDown)
          down_locked(*l, "a receive failed: " + why, LinkEnd::kError);
        return;
      }
    }
  }

  // A message landed in receive buffer `op`: authenticated and queued by its serial, or dropped.
  void on_message_locked(Op* op, std::size_t len) {
    ofi_wire::Prefix p;
    bool identified = false;
    const std::string bad = ofi_wire::decode_prefix(op->buf, len, kHeaderSize, &p, &identified);
    // Our secret, which only the peer we gave it to knows: a peer that has our address may send
    // before we have its own (its messages wait for the link to come up).
    Link* l = identified ? link_of(p.from) : nullptr;
    if (l != nullptr && p.secret != l->rx_secret) l = nullptr;
    if (l == nullptr || l->state == Link::kDown) {
      // Not from a peer we let in (or from one gone): dropped, its buffer posted again.
      if (l == nullptr) counters_.rejected++;
      rx_unposted_.push_back(op);
      return;
    }
    if (!bad.empty()) {
      rx_unposted_.push_back(op);
      return down_locked(*l, "sent " + bad, LinkEnd::kBadFrame);
    }
    l->last_in = Clock::now();
    counters_.messages_in++;
    if (p.credits > l->in_flight) {
      rx_unposted_.push_back(op);
      return down_locked(*l, "returned more credits than it had", LinkEnd::kBadFrame);
    }
    l->in_flight -= p.credits;
    if (p.credits != 0) dirty_ = true;
    if (p.kind == kCredit) {
      rx_unposted_.push_back(op);
      return;
    }
    std::string wrong;
    if (p.serial < l->next_in || p.serial - l->next_in >= bufs_per_peer_ || l->ready.count(p.serial) != 0)
      wrong = "sent message " + std::to_string(p.serial) + " out of turn (expected " + std::to_string(l->next_in) + ")";
    else if (l->held >= bufs_per_peer_)
      wrong = "sent more than its window of frames";
    if (!wrong.empty()) {
      rx_unposted_.push_back(op);
      return down_locked(*l, wrong, LinkEnd::kBadFrame);
    }
    op->peer = l->peer;
    op->len = len;
    op->prefix = p;
    l->ready.emplace(p.serial, op);
    l->held++;
  }

  // Give the Sink what is next, link by link, in order. Without the mutex while calling it.
  int deliver() {
    int did = 0;
    std::vector<std::uint32_t> peers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : links_)
        if (kv.second->state == Link::kUp) peers.push_back(kv.first);
    }
    for (std::uint32_t peer : peers) {
      for (int turn = 0; turn < 64; turn++) {
        const int n = deliver_one(peer);
        if (n == 0) break;
        did += n;
      }
    }
    return did;
  }

  // One step for one link: a payload finished, or the next message started. Returns 0 when none.
  int deliver_one(std::uint32_t peer) {
    Op* op = nullptr;
    Header h;
    std::size_t len = 0;
    std::uint64_t eager = 0, part_bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Link* l = link_of(peer);
      if (l == nullptr || l->state != Link::kUp) return 0;
      eager = l->eager;
      part_bytes = l->part_bytes;
      if (l->in_payload) {
        if (l->rx_posted < l->rx_parts.size()) post_parts_locked(*l);
        if (l->state != Link::kUp || l->rx_done < l->rx_parts.size()) return 0;
        l->in_payload = false;
        l->rx_parts.clear();
        h = l->h;
      } else {
        auto it = l->ready.find(l->next_in);
        if (it == l->ready.end()) return 0;
        op = it->second;
        l->ready.erase(it);
        l->next_in++;
        len = op->len;
        if (op->prefix.kind == kFin) {
          release_locked(*l, op, false);
          down_locked(*l, "closed the connection", LinkEnd::kClosed);
          return 1;
        }
      }
    }
    if (op == nullptr) {  // a large payload is in place
      calls_++;
      sink_->on_frame(peer, h);
      return 1;
    }
    // A frame's message: its header checked, its place asked of the Sink, its payload copied or posted.
    const std::uint8_t* b = op->buf;
    const std::uint64_t parts = op->prefix.parts;
    std::string why = decode_header(b + kPrefix, kHeaderSize, &h);
    std::uint8_t* dest = nullptr;
    if (why.empty()) {
      why = ofi_wire::check_frame(parts, h.length, len, kHeaderSize, eager, part_bytes);
      if (!why.empty()) why = "sent a bad frame: " + why;
    } else {
      why = "sent a bad frame header: " + why;
    }
    if (why.empty()) {
      calls_++;
      why = sink_->on_header(peer, h, &dest);
      if (why.empty() && h.length <= eager) {
        if (dest != nullptr && h.length != 0) std::memcpy(dest, b + kMsgHead, h.length);
        std::lock_guard<std::mutex> lock(mu_);
        release_locked(*link_of(peer), op);
      }
    }
    if (!why.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      Link* l = link_of(peer);
      release_locked(*l, op);
      down_locked(*l, why, LinkEnd::kBadFrame);
      return 1;
    }
    if (h.length <= eager) {
      calls_++;
      sink_->on_frame(peer, h);
      return 1;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Link* l = link_of(peer);
    const std::uint64_t serial = op->prefix.serial;
    release_locked(*l, op);
    if (l->state != Link::kUp) return 1;
    l->in_payload = true;
    l->h = h;
    l->dest = dest;
    l->rx_serial = serial;
    l->rx_parts.assign(parts, Op{});
    l->rx_posted = 0;
    l->rx_done = 0;
    post_parts_locked(*l);
    return 1;
  }

  void post_parts_locked(Link& l) {
    while (l.rx_posted < l.rx_parts.size()) {
      const std::uint64_t i = l.rx_posted;
      Op& op = l.rx_parts[i];
      op.kind = OpKind::kRxPart;
      op.peer = l.peer;
      const std::uint64_t off = i * l.part_bytes;
      const std::uint64_t n = std::min(l.part_bytes, l.h.length - off);
      std::uint8_t* into = drop_;
      std::uint64_t room = 64;  // a dropped part is cut short, as meant
      op.drop = l.dest == nullptr;
      void* desc = nullptr;
      if (!op.drop) {
        into = l.dest + off;
        room = n;
        if (op.temp_mr == nullptr) {
          const std::string w = desc_for(into, room, &desc, &op.temp_mr);
          if (!w.empty()) return down_locked(l, w, LinkEnd::kError);
        } else {
          desc = op.temp_mr->mem_desc;
        }
      } else {
        ofi::FidMr* none = nullptr;
        (void)desc_for(into, room, &desc, &none);
      }
      // From any source (FI_DIRECTED_RECV is not asked for): the tag, keyed by us, names the sender.
      const long r = ep_->tagged->recv(ep_, into, room, desc, ofi::kAddrUnspec, ofi_wire::tag_of(l.rx_key, l.rx_serial, i), 0, &op);
      if (r == -ofi::kEAgain) {
        dirty_ = true;
        return;
      }
      if (r != 0) return down_locked(l, fi_error("fi_trecv", r), LinkEnd::kError);
      op.posted = true;
      l.rx_posted++;
    }
  }

  // A message's buffer goes back to the pool, and its credit to its sender.
  void release_locked(Link& l, Op* op, bool credit = true) {
    rx_unposted_.push_back(op);
    if (l.held > 0) l.held--;
    if (credit) l.owed++;
    dirty_ = true;
  }

  // The link goes down now; the Sink hears of it once no receive is posted into its memory.
  void down_locked(Link& l, const std::string& why, LinkEnd end) {
    if (l.state == Link::kDown) return;
    const bool was_up = l.state == Link::kUp;
    l.state = Link::kDown;
    l.down_why = why;
    l.down_end = end;
    l.down_at = Clock::now();
    // Queued frames are dropped (their memory is the owner's, who hears of the link's end), but not
    // the parts libfabric still holds: those frames wait for their completions.
    for (auto& f : l.queue) {
      if (!f->head_posted) continue;
      f->parts_left -= f->parts - f->parts_posted;
      f->report = false;
      if (f->parts_left != 0) l.flying.push_back(std::move(f));
    }
    l.queue.clear();
    for (auto& kv : l.ready) rx_unposted_.push_back(kv.second);
    l.ready.clear();
    l.held = 0;
    if (was_up && ep_ != nullptr)
      for (Op& op : l.rx_parts)
        if (op.posted && !op.cancelled) {
          op.cancelled = true;
          (void)ep_->ops->cancel(&ep_->fid, &op);
        }
    if (l.fd >= 0) {
      (void)epoll_ctl(ep_fd_, EPOLL_CTL_DEL, l.fd, nullptr);
      // Read what the stream still holds (the peer's closing byte, say): a socket closed with bytes
      // unread is reset, and the peer would take its orderly end for a failure.
      std::uint8_t spare[64];
      for (int i = 0; i < 16 && ::recv(l.fd, spare, sizeof spare, MSG_DONTWAIT) > 0; i++) {
      }
      ::close(l.fd);
      l.fd = -1;
    }
    dirty_ = true;
    downs_.push_back(l.peer);
    wake();  // (from a sender's thread: the progress thread reports it)
  }

  void report_downs() {
    std::vector<std::pair<std::uint32_t, std::pair<std::string, LinkEnd>>> now;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const Clock::time_point t = Clock::now();
      for (auto it = downs_.begin(); it != downs_.end();) {
        Link* l = link_of(*it);
        bool busy = false;
        for (const Op& op : l->rx_parts) busy = busy || op.posted;
        const bool late = t - l->down_at > std::chrono::milliseconds(kCancelWaitMs);
        if (!l->reported && (!busy || late)) {
          l->reported = true;
          now.push_back({l->peer, {l->down_why, l->down_end}});
        }
        it = l->reported ? downs_.erase(it) : std::next(it);
      }
    }
    for (auto& [peer, why] : now) {
      calls_++;
      sink_->on_link_down(peer, why.first, why.second);
    }
  }

  void poll_fds(int timeout_ms) {
    epoll_event events[64];
    const int n = epoll_wait(ep_fd_, events, 64, timeout_ms);
    if (n <= 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < n; i++) {
      const std::uint64_t key = events[i].data.u64;
      if (key == kWakeKey) {
        std::uint64_t v = 0;
        (void)!::read(wake_fd_, &v, sizeof v);
        continue;
      }
      if (key == kCqKey) continue;  // work() reads the queue
      Link* l = link_of(static_cast<std::uint32_t>(key));
      if (l != nullptr && l->fd >= 0) stream_locked(*l);
    }
  }

  // The link's stream has something: the peer's address (while exchanging), or its end.
  void stream_locked(Link& l) {
    for (;;) {
      std::uint8_t spare[64];
      std::uint8_t* into = spare;
      std::size_t want = sizeof spare;
      if (l.state == Link::kExchanging) {
        std::size_t need = kHelloHead;
        if (l.blob_got >= kHelloHead) {
          const std::string why = ofi_wire::hello_size(l.blob, l.blob_got, &need);
          if (!why.empty()) return down_locked(l, why, LinkEnd::kBadFrame);
        }
        into = l.blob + l.blob_got;
        want = need - l.blob_got;  // (need <= sizeof blob: hello_size bounds the address)
      }
      const ssize_t got = ::recv(l.fd, into, want, 0);
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      // A reset after this side ended its stream (its FIN left, then its closing byte) is the peer
      // closing its socket on that FIN before the byte reached it (the FIN frame and the byte take
      // two connections): an orderly end, named as one.
      if (got < 0 && errno == ECONNRESET && l.wr_closed) return down_locked(l, "closed the connection", LinkEnd::kClosed);
      if (got < 0)
        return down_locked(l, os_error("its stream failed", errno), errno == ECONNRESET ? LinkEnd::kClosed : LinkEnd::kError);
      if (got == 0) {
        // Its end. After its closing byte the peer's FIN is on its way (its turn takes the link down,
        // after every frame before it); without it the peer is gone.
        if (l.peer_closing) {
          (void)epoll_ctl(ep_fd_, EPOLL_CTL_DEL, l.fd, nullptr);
          return;
        }
        return down_locked(l, l.state == Link::kExchanging ? "closed the connection before its fabric address came"
                                                             : "closed the connection",
                           LinkEnd::kClosed);
      }
      l.last_in = Clock::now();
      if (l.state != Link::kExchanging) {
        if (got == 1 && spare[0] == kStreamFin && !l.peer_closing) {
          l.peer_closing = true;
          continue;
        }
        return down_locked(l, "sent bytes on its stream after the exchange", LinkEnd::kBadFrame);
      }
      l.blob_got += static_cast<std::size_t>(got);
      std::size_t need = kHelloHead;
      if (l.blob_got >= kHelloHead) {
        const std::string why = ofi_wire::hello_size(l.blob, l.blob_got, &need);
        if (!why.empty()) return down_locked(l, why, LinkEnd::kBadFrame);
      }
      if (l.blob_got < need) continue;
      ofi_wire::Hello hello;
      const std::string why = ofi_wire::decode_hello(l.blob, l.blob_got, &hello);
      if (!why.empty()) return down_locked(l, why, LinkEnd::kBadFrame);
      return exchanged_locked(l, hello);
    }
  }

  void exchanged_locked(Link& l, const ofi_wire::Hello& hello) {
    l.tx_id = hello.your_id;
    l.window = std::min<std::uint32_t>(hello.window, kMaxWindow);
    l.tx_secret = hello.secret;
    l.tx_key = hello.tag_key;
    l.eager = std::min<std::uint64_t>(hello.eager, kEagerMax);
    l.part_bytes = std::min<std::uint64_t>(hello.part_bytes, part_limit_);
    if (l.part_bytes < kBufBytes) return down_locked(l, "offered a message size too small", LinkEnd::kBadFrame);
    // fi_av_insert reads as many bytes as the provider's addresses have: the same provider's are
    // as long as ours, and anything else is refused before libfabric reads it.
    if (hello.addr.size() != name_len_)
      return down_locked(l,
                         "sent a fabric address of " + std::to_string(hello.addr.size()) + " bytes (this provider's have " +
                             std::to_string(name_len_) + ")",
                         LinkEnd::kBadFrame);
    ofi::Addr a = 0;
    const int r = av_->ops->insert(av_, hello.addr.data(), 1, &a, 0, nullptr);
    if (r != 1) return down_locked(l, "its fabric address was refused: " + fi_error("fi_av_insert", r), LinkEnd::kError);
    l.addr = a;
    l.state = Link::kUp;
    if (l.shut) {  // shut while exchanging: nothing more will go
      post_fin_locked(l);
    }
    dirty_ = true;
  }

  void check_idle() {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    for (auto& kv : links_) {
      Link& l = *kv.second;
      if (l.state == Link::kDown) continue;
      const auto quiet = std::chrono::duration_cast<std::chrono::milliseconds>(now - l.last_in).count();
      if (quiet > idle_ms_) {
        char text[48];
        std::snprintf(text, sizeof text, "silent for %.1f s", static_cast<double>(quiet) / 1000.0);
        down_locked(l, text, LinkEnd::kSilent);
      }
    }
  }

  Sink* sink_;
  std::int64_t idle_ms_;
  const std::uint32_t window_;         // frames each peer may have in flight to us
  const std::uint32_t bufs_per_peer_;  // receive buffers posted per peer: the window, two CREDITs, a FIN
  std::string library_, provider_;
  void* lib_ = nullptr;
  ofi::Api api_;
  ofi::Info* info_ = nullptr;    // the provider's entries (owned)
  ofi::Info* chosen_ = nullptr;  // the one opened (one of info_'s)
  ofi::FidFabric* fabric_ = nullptr;
  ofi::FidDomain* domain_ = nullptr;
  ofi::FidCq* cq_ = nullptr;
  ofi::FidAv* av_ = nullptr;
  ofi::FidEp* ep_ = nullptr;
  int cq_fd_ = -1;  // the CQ's wait fd (the provider's; not ours to close)
  bool mr_local_ = false;
  std::uint64_t part_limit_ = kMaxPart;
  std::uint8_t name_[kMaxAddr] = {};
  std::size_t name_len_ = 0;
  int ep_fd_ = -1;
  int wake_fd_ = -1;
  int calls_ = 0;
  std::string fatal_;
  std::uint8_t* drop_ = nullptr;
  std::mutex mu_;  // every libfabric call, and everything below
  std::unordered_map<std::uint32_t, std::unique_ptr<Link>> links_;  // never removed before destruction
  std::map<std::uintptr_t, Reg> regs_;
  std::map<std::uintptr_t, std::uint64_t> pending_regs_;
  std::vector<Block> blocks_;
  std::vector<Op*> rx_unposted_, tx_free_;
  std::unordered_map<Op*, std::uint32_t> fin_ops_;
  std::vector<std::uint32_t> downs_;
  bool dirty_ = false;
  FabricCounters counters_;
};

}  // namespace

std::unique_ptr<Fabric> make_ofi_fabric(Sink* sink, const OfiOptions& opts, std::string* why) {
  auto f = std::make_unique<OfiFabric>(sink, opts.idle_ms, opts.peers);
  *why = f->open(opts.library, opts.provider);
  if (!why->empty()) return nullptr;
  return f;
}

std::string ofi_providers(const std::string& library, std::vector<std::string>* names) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return "cannot load libfabric (" + library + "): " + dlerror();
  ofi::Api api;
  const std::string bad = load_api(lib, &api);
  if (!bad.empty()) return library + ": " + bad;
  ofi::Info* none = nullptr;
  const std::string w = OfiFabric::pick(api, "", &none, names);
  if (none != nullptr) api.freeinfo(none);
  return w;
}

}  // namespace smddp
