// The daemon's side of the other daemons: the fabric, peers, control frames, heartbeats, progress.
#include "exchange.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

// How long close() waits for the peers to acknowledge what was sent to them.
constexpr int kDrainMs = 2000;
// The progress thread's longest sleep in the fabric: close() and heartbeats are never later than this.
constexpr int kProgressSliceMs = 50;
// Send cookies: a data frame's is its collective's sequence number (below 2**63), a control frame's
// has the top bit set.
constexpr std::uint64_t kControlBit = std::uint64_t{1} << 63;

std::string num(std::uint64_t v) { return std::to_string(v); }

}  // namespace

// A peer daemon as the exchange sees it (under the exchange's mutex).
struct Exchange::Peer {
  std::string name;
  bool added = false;  // its link is in the fabric
  bool down = false;
  bool bye = false;  // its BYE came: every frame of it came before
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  std::uint64_t queued = 0;
  struct Held {
    std::array<std::uint8_t, kHeaderSize> header;
    const std::uint8_t* payload;
    std::uint64_t length;
    std::uint64_t cookie;
  };
  std::vector<Held> before;  // frames queued before its link was handed over, in order
  std::string control;  // the control frame being received (REPORT, ERROR): its payload
};

Exchange::Exchange(ExchangeConfig cfg, Owner* owner, Arena* results, Arena* scratch)
    : cfg_(std::move(cfg)), owner_(owner) {
  const auto nn = static_cast<std::uint32_t>(cfg_.node_names.size());
  if (nn < 2 || cfg_.node >= nn) throw std::invalid_argument("an exchange needs a name per node, and two nodes or more");
  peers_.resize(nn);
  for (std::uint32_t j = 0; j < nn; j++) {
    if (j == cfg_.node) continue;
    peers_[j] = std::make_unique<Peer>();
    peers_[j]->name = cfg_.node_names[j];
  }
  std::string why;
  if (cfg_.fabric == "ofi") {
    OfiOptions o;
    o.library = cfg_.ofi_library;
    o.provider = cfg_.ofi_provider;
    o.idle_ms = cfg_.heartbeat_ns / 1'000'000;
    o.peers = nn - 1;
    fabric_ = make_ofi_fabric(this, o, &why);
  } else if (cfg_.fabric == "tcp") {
    fabric_ = make_tcp_fabric(this, cfg_.heartbeat_ns / 1'000'000, &why);
  } else {
    why = "no fabric named '" + cfg_.fabric + "' (tcp or ofi)";
  }
  if (!fabric_) throw std::runtime_error("cannot start the fabric: " + why);
  // Frames go out of and come into the two arenas: their segments are lent to the fabric once
  // (registered, where it registers memory); those created later are lent as they come.
  for (Arena* a : {results, scratch})
    for (const auto& seg : a->segments()) {
      why = fabric_->register_memory(seg->base(), seg->size());
      if (!why.empty()) throw std::runtime_error("cannot register memory with the fabric: " + why);
    }
  progress_ = std::thread([this] { progress_loop(); });
}

Exchange::~Exchange() { close(); }

std::string Exchange::add_peer(std::uint32_t node, int fd) {
  std::string failed;  // a frame held for it that the fabric refused: the job fails, after the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer* p = !closed_ && node < peers_.size() ? peers_[node].get() : nullptr;
    std::string w;
    if (closed_) w = "the plane is closed";
    else if (p == nullptr) w = "no peer node " + num(node) + " in this job";
    else if (p->added || p->down) w = p->name + " connected twice";
    else w = fabric_->add_peer(node, fd);
    if (!w.empty()) {
      ::close(fd);
      return w;
    }
    p->added = true;
    for (const Peer::Held& f : p->before) {
      w = fabric_->send(node, f.header.data(), f.payload, f.length, f.cookie);
      if (!w.empty()) {
        failed = cfg_.me + " cannot send to " + p->name + ": " + w;
        break;
      }
    }
    p->before.clear();
  }
  if (!failed.empty()) owner_->exchange_failed(Verdict{Fault::kPeerLost, failed});
  return {};
}

std::string Exchange::send_data(std::uint32_t node, const std::uint8_t header[kHeaderSize],
                                const std::uint8_t* payload, std::uint64_t length, std::uint64_t seq, bool* left) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return "the plane is closed";
  return send_locked(node, header, payload, length, seq, left);  // below 2**63: decode_header bounds every seq
}

std::string Exchange::send_locked(std::uint32_t node, const std::uint8_t* header, const std::uint8_t* payload,
                                  std::uint64_t length, std::uint64_t cookie, bool* left) {
  *left = false;
  Peer* p = node < peers_.size() ? peers_[node].get() : nullptr;
  if (p == nullptr) return "no peer node " + num(node) + " in this job";
  if (p->down) return "its link is down";
  p->queued++;
  if (!(cookie & kControlBit)) p->bytes_out += kHeaderSize + length;  // data frames, as status counts them
  if (!p->added) {  // not handed over yet: these go first when it is
    Peer::Held held{};
    std::memcpy(held.header.data(), header, kHeaderSize);
    held.payload = payload;
    held.length = length;
    held.cookie = cookie;
    p->before.push_back(held);
    return {};
  }
  const std::string w = fabric_->send(node, header, payload, length, cookie, left);
  if (*left) p->queued--;
  return w;
}

std::string Exchange::send_control(std::uint32_t node, const std::uint8_t header[kHeaderSize], std::string payload) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return "the plane is closed";
  if (node >= peers_.size() || !peers_[node]) return "no peer node " + num(node) + " in this job";
  const std::uint64_t cookie = kControlBit | ++next_control_;
  auto it = control_out_.emplace(cookie, std::make_pair(node, std::move(payload))).first;
  // The map's node, and so the string's bytes, stay where they are until on_sent erases it.
  const std::string& bytes = it->second.second;
  bool left = false;
  const std::string w =
      send_locked(node, header, reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), cookie, &left);
  if (!w.empty() || left) control_out_.erase(it);
  if (left) flush_cv_.notify_all();
  return w;
}

bool Exchange::flush(std::int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  return flush_cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), [this] { return control_out_.empty(); });
}

std::string Exchange::lend(const Segment& seg) {
  // The fabric lives until close(), which runs after every thread that makes op records has ended.
  return fabric_->register_memory(seg.base(), seg.size());
}

void Exchange::beat() {
  Header h;
  h.type = Msg::kHeartbeat;
  h.sender = cfg_.node;
  std::uint8_t frame[kHeaderSize];
  if (!encode_header(h, frame).empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (std::uint32_t j = 0; j < peers_.size(); j++) {
    Peer* p = peers_[j].get();
    if (p == nullptr || !p->added || p->down || p->bye) continue;
    const std::uint64_t cookie = kControlBit | ++next_control_;
    auto it = control_out_.emplace(cookie, std::make_pair(j, std::string())).first;
    bool left = false;
    if (!send_locked(j, frame, nullptr, 0, cookie, &left).empty() || left) control_out_.erase(it);
  }
}

void Exchange::progress_loop() {
  const std::int64_t period_ns = cfg_.heartbeat_ns / 4;
  Clock::time_point busy = Clock::now();
  Clock::time_point next_beat = busy + std::chrono::nanoseconds(period_ns);
  while (!progress_stop_.load(std::memory_order_acquire)) {
    Clock::time_point now = Clock::now();
    // After activity, poll the fabric without waiting for spin_ns (yielding the core between polls, as
    // the rings' waits do: on an oversubscribed machine the peers' and workers' threads run meanwhile),
    // then sleep in it.
    int wait_ms = 0;
    if (std::chrono::duration_cast<std::chrono::nanoseconds>(now - busy).count() >= cfg_.spin_ns) {
      wait_ms = kProgressSliceMs;
      if (period_ns > 0) {
        const auto to_beat = std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - now).count();
        wait_ms = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(wait_ms, to_beat)));
      }
    }
    if (fabric_->progress(wait_ms) > 0)
      busy = Clock::now();
    else if (wait_ms == 0)
      sched_yield();
    if (period_ns > 0 && (now = Clock::now()) >= next_beat) {
      beat();
      next_beat = now + std::chrono::nanoseconds(period_ns);
    }
  }
}

std::string Exchange::on_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) {
  *dest = nullptr;
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
    if (p == nullptr) return "a link to no peer";  // never: the fabric only has links add_peer gave it
    p->control.clear();
    switch (h.type) {
      case Msg::kHeartbeat:
      case Msg::kStatus:
      case Msg::kBye:
        return {};
      case Msg::kReport:
      case Msg::kError:  // decode_header bounded their lengths
        p->control.resize(h.length);
        if (h.length != 0) *dest = reinterpret_cast<std::uint8_t*>(&p->control[0]);
        return {};
      case Msg::kPartial:
      case Msg::kResult:
      case Msg::kBlock:
        break;
      default:
        refused = p->name + " sent " + msg_name(static_cast<std::uint8_t>(h.type)) + ", which daemons may not send";
    }
  }
  if (!refused.empty()) {
    // The job fails, and the frame is read and dropped: the link stays up, so that the failure's
    // ERROR reaches this peer too (a link closed with bytes unread is reset, and what was queued on
    // it lost). Only a header the fabric cannot decode closes a link.
    owner_->exchange_failed(Verdict{Fault::kProtocol, refused});
    return {};
  }
  owner_->data_header(peer, h, dest);
  return {};
}

void Exchange::on_frame(std::uint32_t peer, const Header& h) {
  std::string payload;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer* p = peers_[peer].get();
    switch (h.type) {
      case Msg::kHeartbeat:
        return;
      case Msg::kBye:
        p->bye = true;  // its BYE follows all its frames
        [[fallthrough]];
      case Msg::kStatus:
      case Msg::kReport:
      case Msg::kError:
        payload = std::move(p->control);
        p->control.clear();
        break;
      case Msg::kPartial:
      case Msg::kResult:
      case Msg::kBlock:
        p->bytes_in += kHeaderSize + h.length;  // data frames, as status counts them
        break;
      default:
        return;  // refused at its header (the job failed): read and dropped
    }
  }
  if (h.type == Msg::kPartial || h.type == Msg::kResult || h.type == Msg::kBlock) owner_->data_frame(peer, h);
  else owner_->control_frame(peer, h, std::move(payload));
}

void Exchange::on_sent(std::uint32_t peer, std::uint64_t cookie) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer* p = peers_[peer].get();
    if (p->queued > 0) p->queued--;
    if (cookie & kControlBit) {
      control_out_.erase(cookie);
      flush_cv_.notify_all();
      return;
    }
  }
  owner_->data_sent(cookie);
}

void Exchange::on_link_down(std::uint32_t peer, const std::string& why, LinkEnd end) {
  Verdict v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer* p = peers_[peer].get();
    p->down = true;
    p->queued = 0;
    // Its control frames still queued are dropped with the link: nobody waits for them.
    for (auto it = control_out_.begin(); it != control_out_.end();)
      it = it->second.first == peer ? control_out_.erase(it) : std::next(it);
    flush_cv_.notify_all();
    if (p->bye || closed_) return;
    if (end == LinkEnd::kBadFrame) {  // what it sent cannot be framed: not a lost peer
      v = Verdict{Fault::kProtocol, cfg_.me + ": " + p->name + " " + why};
    } else {
      const char* hint = end == LinkEnd::kSilent ? " (frozen, or the link is down)" : "";
      v = Verdict{Fault::kPeerLost, cfg_.me + " lost contact: " + p->name + " " + why + hint};
    }
  }
  owner_->exchange_failed(v);
}

std::string Exchange::describe() {
  std::lock_guard<std::mutex> lock(mu_);
  return fabric_ ? fabric_->describe() : std::string();
}

FabricCounters Exchange::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  return fabric_ ? fabric_->counters() : FabricCounters{};
}

std::vector<PeerCounters> Exchange::peer_counters() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerCounters> out;
  for (std::uint32_t j = 0; j < peers_.size(); j++) {
    const Peer* p = peers_[j].get();
    if (p != nullptr) out.push_back(PeerCounters{j, p->added && !p->down, p->bytes_in, p->bytes_out, p->queued});
  }
  return out;
}

void Exchange::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ && !fabric_) return;
    closed_ = true;
    flush_cv_.notify_all();
  }
  if (fabric_) {
    // A close with unread bytes would reset the links and drop what is still in flight, such as
    // the ERROR that tells the peers why this job failed: end the writing side after it, read on,
    // and wait (briefly) until the peers' kernels have acknowledged every byte.
    fabric_->shutdown_links();
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(kDrainMs);
    while (!fabric_->drained() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  progress_stop_.store(true, std::memory_order_release);
  if (fabric_) fabric_->wake();
  if (progress_.joinable()) progress_.join();
  std::lock_guard<std::mutex> lock(mu_);
  fabric_.reset();
  for (auto& p : peers_)
    if (p) p->before.clear();
  control_out_.clear();
}

}  // namespace smddp
