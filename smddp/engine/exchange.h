// The daemon's side of the other daemons: the fabric, each peer's state, control frames, heartbeats,
// and the progress thread that moves them (docs/engine.md, "The data plane").
//
// The plane (local_plane.h) owns one in a job of several nodes. It sends data frames through it
// (PARTIAL, RESULT, BLOCK, out of arena memory the collective keeps until the send has left) and is
// told, as the exchange's Owner, of what comes in: a data frame's header (the plane locates its chunk
// and says where the payload goes), the payload in place, a data frame gone, a peer's control frame,
// and a failure (a link down, a frame no daemon may send, a send the fabric refused).
//
// Threads and memory: the exchange's mutex guards the peers' state, the frames held for a peer not
// yet handed over, and the control frames in flight; it is never held while the Owner is called, and
// the Owner may call the exchange while holding its own lock (lock order: the plane's table, then the
// exchange's, then the fabric's). The progress thread calls the fabric's progress() and, from it,
// this exchange's Sink methods and the Owner. The exchange owns the fabric (and through it the
// links' sockets), the progress thread and the payloads of the control frames it sends until they
// leave; data frames' payloads belong to the plane's op records; the arenas it registers belong to the
// plane's caller and outlive the exchange. close() stops the progress thread and drops the fabric, so
// that no frame in flight points into memory after the plane frees it.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"
#include "fabric.h"
#include "frame.h"
#include "node_state.h"

namespace smddp {

struct ExchangeConfig {
  std::uint32_t node = 0;  // this daemon's node
  std::vector<std::string> node_names;  // node j in messages, one per node
  std::string me;  // how this daemon is named in messages
  std::int64_t spin_ns = 200'000;  // the progress thread polls this long after activity, then sleeps
  std::int64_t heartbeat_ns = 0;   // a HEARTBEAT to every peer each quarter of this; silent links go down
  std::string fabric = "tcp";      // "tcp", or "ofi" (libfabric from ofi_library, provider ofi_provider)
  std::string ofi_library;
  std::string ofi_provider;
};

// One peer daemon's link as the exchange counts it: data frames (PARTIAL, RESULT, BLOCK), headers included.
struct PeerCounters {
  std::uint32_t node = 0;
  bool up = false;          // handed over and not down
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  std::uint64_t queued = 0;  // frames queued to it that have not left yet
};

class Exchange final : private Sink {
 public:
  // What the exchange asks of the plane's table; called without the exchange's lock, on the
  // progress thread (or, for a failure, on the thread that called the exchange).
  class Owner {
   public:
    virtual ~Owner() = default;
    // A data frame's header (PARTIAL, RESULT, BLOCK) came from `peer`: where its payload goes
    // (*dest; nullptr: read and dropped). A frame that fails the job is read and dropped.
    virtual void data_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) = 0;
    // The payload of that frame is in place.
    virtual void data_frame(std::uint32_t peer, const Header& h) = 0;
    // The data frame sent for collective `seq` has left: its memory may go.
    virtual void data_sent(std::uint64_t seq) = 0;
    // A control frame (STATUS, REPORT, ERROR, BYE) from `peer`, whole. After its BYE nothing else
    // comes from it.
    virtual void control_frame(std::uint32_t peer, const Header& h, std::string payload) = 0;
    // The job fails: a link went down, a peer sent what no daemon may, or a send was refused.
    virtual void exchange_failed(const Verdict& v) = 0;
  };

  // The fabric started and the arenas' segments registered with it, or throws why not.
  Exchange(ExchangeConfig cfg, Owner* owner, Arena* results, Arena* scratch);
  ~Exchange() override;
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  // Peer `node`'s link: `fd`, authenticated by Python, owned from now on (closed on a refusal too).
  // The frames queued for it before go first. "" or why not.
  std::string add_peer(std::uint32_t node, int fd);
  // Queue a data frame of collective `seq` to `node`; *left: it went at once (no data_sent comes for
  // it). "" or why not (no such peer; its link is down).
  std::string send_data(std::uint32_t node, const std::uint8_t header[kHeaderSize], const std::uint8_t* payload,
                        std::uint64_t length, std::uint64_t seq, bool* left);
  // A control frame to `node` after everything queued to it before; the payload is the exchange's
  // until it leaves. "" or why not.
  std::string send_control(std::uint32_t node, const std::uint8_t header[kHeaderSize], std::string payload);
  // Wait up to timeout_ns for every control frame to leave (or its link to go down): true if they did.
  bool flush(std::int64_t timeout_ns);
  // A new arena segment: registered with the fabric where it registers memory. "" or why not. Any thread.
  std::string lend(const Segment& seg);
  std::vector<PeerCounters> peer_counters();
  std::string describe();
  FabricCounters counters();
  // End the links after what is queued (waiting briefly for the peers to take it), stop the progress
  // thread, drop the fabric. Idempotent.
  void close();

 private:
  struct Peer;
  // *left: the frame went at once. Under mu_.
  std::string send_locked(std::uint32_t node, const std::uint8_t* header, const std::uint8_t* payload,
                          std::uint64_t length, std::uint64_t cookie, bool* left);
  void progress_loop();
  void beat();
  // Sink (fabric.h): called on the progress thread.
  std::string on_header(std::uint32_t peer, const Header& h, std::uint8_t** dest) override;
  void on_frame(std::uint32_t peer, const Header& h) override;
  void on_sent(std::uint32_t peer, std::uint64_t cookie) override;
  void on_link_down(std::uint32_t peer, const std::string& why, LinkEnd end) override;

  ExchangeConfig cfg_;
  Owner* owner_;
  std::mutex mu_;
  bool closed_ = false;
  std::vector<std::unique_ptr<Peer>> peers_;  // by node; null for this node
  // Control frames in flight: cookie -> (peer, payload).
  std::map<std::uint64_t, std::pair<std::uint32_t, std::string>> control_out_;
  std::uint64_t next_control_ = 0;
  std::condition_variable flush_cv_;  // control_out_ shrank
  std::unique_ptr<Fabric> fabric_;
  std::atomic<bool> progress_stop_{false};
  std::thread progress_;
};

}  // namespace smddp
