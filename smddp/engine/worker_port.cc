// One worker's port on the daemon: DONE and SEGMENT out on its done ring, its thread's end.
#include "worker_port.h"

#include <unistd.h>

#include <utility>

#include "fdpass.h"
#include "frame.h"

namespace smddp {

WorkerPort::WorkerPort(std::uint32_t l, std::uint32_t r, std::string n, std::shared_ptr<Segment> ch, int s)
    : local(l),
      rank(r),
      name(std::move(n)),
      channel(std::move(ch)),
      side(s),
      submit(channel->base(), kChannelSlots, false),
      done(channel->base() + done_ring_offset(), kChannelSlots, false),
      stream(stream_block(channel->base())) {}

WorkerPort::~WorkerPort() {
  join();
  ::close(side);
}

Verdict WorkerPort::push_done(const std::uint8_t* frame, std::uint32_t rid, const Segment& result,
                              std::uint32_t node, std::int64_t push_timeout_ns) {
  RingWait r = RingWait::kReady;
  {
    std::lock_guard<std::mutex> g(done_mu_);
    if (!told_.count(rid)) {
      Header sh;
      sh.type = Msg::kSegment;
      sh.sender = node;
      sh.shard = rid;
      sh.offset = result.size();
      std::uint8_t seg_frame[kHeaderSize];
      const std::string sw = encode_header(sh, seg_frame);
      if (!sw.empty()) return Verdict{Fault::kProtocol, name + ": " + sw};
      bool gone = false;
      const std::string sent = send_fd(side, rid, sh.offset, result.fd(), &gone);
      if (gone) return {};
      if (!sent.empty()) return Verdict{Fault::kPeerLost, name + " did not take its result segments: " + sent};
      r = done.push(seg_frame, kHeaderSize, push_timeout_ns, 0);
      if (r == RingWait::kReady) told_.insert(rid);
    }
    if (r == RingWait::kReady) r = done.push(frame, kHeaderSize, push_timeout_ns, 0);
  }
  if (r == RingWait::kTimeout)
    return Verdict{Fault::kPeerLost, name + " did not take its results for " +
                                         std::to_string(static_cast<std::uint64_t>(push_timeout_ns / 1'000'000'000)) +
                                         " s (its done ring stayed full)"};
  if (r == RingWait::kCorrupt) return Verdict{Fault::kProtocol, name + " broke its done ring: " + done.why()};
  return {};
}

void WorkerPort::join() {
  stop.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> g(join_mu_);
  if (thread.joinable()) thread.join();
}

}  // namespace smddp
