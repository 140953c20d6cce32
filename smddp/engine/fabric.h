// How daemons move frames to each other: one small interface; TCP and libfabric (EFA) beside it.
//
// A fabric carries whole frames (the 56-byte header of docs/protocol.md, then its payload) between
// this daemon and its peers over links that the control plane has already authenticated. Payloads
// go out from, and come in straight to, memory the owner names: on a header the fabric asks its Sink
// where the payload belongs (the collective state machine locates the chunk, or refuses the frame),
// and reads it there. Nothing is copied on the way but by the kernel.
//
// Threads: progress() runs on one thread (the daemon's progress thread) and calls the Sink from it;
// send() and wake() may be called from any thread. Ownership: the fabric owns its links' sockets
// (adopted in add_peer, closed when the fabric is destroyed or the link fails) and its queues; the
// payload memory of a send belongs to the caller, who must keep it unchanged until on_sent(cookie);
// the destination a Sink hands out must stay valid until on_frame or on_link_down for that peer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "frame.h"

namespace smddp {

// Why a link went down, for the owner to classify the failure without reading its text.
enum class LinkEnd : std::uint8_t {
  kClosed,    // the peer closed the connection (or reset it)
  kSilent,    // nothing came for the idle limit: the peer is frozen, or the link is cut
  kBadFrame,  // the peer sent bytes that are not a frame, or a frame the Sink refused
  kError,     // a local error on the socket
};

class Sink {
 public:
  virtual ~Sink() = default;
  // A valid header arrived from `peer`. Return "" and set *dest to where its h.length payload bytes
  // go (nullptr: the payload is read and dropped, for a frame its owner no longer wants), or return
  // why the frame is refused: the link then fails with that reason and nothing is read into memory.
  virtual std::string on_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) = 0;
  // The payload of the frame whose header came last from `peer` is in place.
  virtual void on_frame(std::uint32_t peer, const Header& h) = 0;
  // The send posted with `cookie` has left this process: its memory may be reused.
  virtual void on_sent(std::uint32_t peer, std::uint64_t cookie) = 0;
  // The link to `peer` is gone, with why. Called once per link; sends still queued on it are dropped
  // (on_sent is not called for them).
  virtual void on_link_down(std::uint32_t peer, const std::string& why, LinkEnd end) = 0;
};

// What a fabric counts, for `smddp status` (fabrics that have no such thing leave it zero).
struct FabricCounters {
  std::uint64_t registrations = 0;       // memory registrations made (arenas, bounce buffers)
  std::uint64_t temp_registrations = 0;  // made for one operation, memory no registration held
  std::uint64_t messages_in = 0;         // fabric messages accepted
  std::uint64_t messages_out = 0;
  std::uint64_t rejected = 0;  // messages dropped: not stamped with a link's secret, or malformed
};

class Fabric {
 public:
  virtual ~Fabric() = default;
  virtual const char* name() const = 0;
  // What it runs on, for status and logs ("tcp"; "ofi tcp (fabric ..., domain lo), libfabric PATH").
  virtual std::string describe() { return name(); }
  // Memory frames will be sent from or received into, for the life of the fabric (an arena's
  // segment): registered once where the fabric needs that. "" or why not. Any thread.
  virtual std::string register_memory(const void* base, std::uint64_t length) {
    (void)base;
    (void)length;
    return {};
  }
  virtual FabricCounters counters() { return {}; }
  // Adopt `fd`, an authenticated stream connected to `peer`, which this fabric owns from now on.
  virtual std::string add_peer(std::uint32_t peer, int fd) = 0;
  // Queue a frame to `peer`: `header` (copied) then `length` bytes at `payload` (not copied: see
  // above). Returns "" or why not (no such link, or it is down). Any thread. With `left` given, the
  // fabric may send the frame at once on the caller's thread when nothing is queued before it (a
  // small frame then costs no wake-up of the progress thread): *left is true when it went whole,
  // and then on_sent is not called for it.
  virtual std::string send(std::uint32_t peer, const std::uint8_t header[kHeaderSize], const std::uint8_t* payload,
                           std::uint64_t length, std::uint64_t cookie, bool* left = nullptr) = 0;
  // Move bytes and call the Sink; waits up to `timeout_ms` (0: not at all) when there is nothing to
  // do. A link silent for longer than its idle limit goes down ("silent for N s"). Returns how many
  // Sink calls it made. One thread only.
  virtual int progress(int timeout_ms) = 0;
  // Make a progress() that waits return at once. Any thread.
  virtual void wake() = 0;
  // The owner is done sending: every link's writing side is closed after what is queued in the
  // kernel, so that the peer reads all of it and then the end. Frames still queued in the fabric are
  // dropped. Reading goes on (keep calling progress()). Any thread.
  virtual void shutdown_links() = 0;
  // Whether every link that is up has nothing left in the fabric or unacknowledged in the kernel.
  // Any thread.
  virtual bool drained() = 0;
};

// The TCP fabric: non-blocking sockets, epoll, vectored sends of header and payload, payloads read
// straight into place. A link that delivers nothing for `idle_ms` milliseconds (heartbeats included)
// goes down as silent (0: never).
std::unique_ptr<Fabric> make_tcp_fabric(Sink* sink, std::int64_t idle_ms, std::string* why);

// The ofi fabric (ofi_fabric.cc): libfabric loaded from `library` at run time, reliable-datagram
// endpoints of `provider` (exactly that name: "efa", "tcp", "shm", "tcp;ofi_rxm"), the link's
// stream kept for the address exchange and liveness. A provider libfabric does not offer here is
// refused at once, naming those it does.
struct OfiOptions {
  std::string library;
  std::string provider;
  std::int64_t idle_ms = 0;
  std::uint32_t peers = 0;  // how many links the job will have (sizes each link's window; 0: unknown)
};
std::unique_ptr<Fabric> make_ofi_fabric(Sink* sink, const OfiOptions& opts, std::string* why);
// The providers `library` offers with reliable-datagram endpoints and tagged messages, in its order.
std::string ofi_providers(const std::string& library, std::vector<std::string>* names);

}  // namespace smddp
