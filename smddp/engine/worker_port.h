// One worker's port on the daemon: its channel's two rings, its side socket, the result segments it
// has been told of (docs/engine.md, "The data plane"). Its submit ring is popped by the plane's one
// poller, or by a thread of its own where futex_waitv may not be called (LocalPlane).
//
// Threads and memory: that thread alone pops the submit ring and reads the side socket for
// ATTACH fds, and so alone touches `segments` (the worker's input segments, mapped while the port
// lives or an op record holds them); DONE and SEGMENT go out under `done_mu` from whichever thread
// completes a collective. The port owns the channel mapping (shared), the side socket's end (closed
// with the port) and its thread; the plane owns the port.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "arena.h"
#include "channel.h"
#include "node_state.h"
#include "ring.h"

namespace smddp {

struct WorkerPort {
  WorkerPort(std::uint32_t local, std::uint32_t rank, std::string name, std::shared_ptr<Segment> channel, int side);
  ~WorkerPort();
  WorkerPort(const WorkerPort&) = delete;
  WorkerPort& operator=(const WorkerPort&) = delete;

  // DONE (`frame`, encoded) to this worker, after the SEGMENT of its result segment (`rid`) the first
  // time the worker is sent one, that segment's fd on the side socket before it. A worker whose end
  // has closed is skipped (its connection's end says so). Verdict: why the job fails, or ok.
  Verdict push_done(const std::uint8_t* frame, std::uint32_t rid, const Segment& result, std::uint32_t node,
                    std::int64_t push_timeout_ns);
  // Stop the thread after what the worker had published, and wait for it. Any thread; idempotent.
  void join();

  const std::uint32_t local;
  const std::uint32_t rank;
  const std::string name;
  const std::shared_ptr<Segment> channel;
  const int side;   // the side socket: ATTACH fds read by the thread that pops its ring, SEGMENT fds sent under done_mu
  RingView submit;  // popped by one thread only (the plane's poller, or the port's own)
  RingView done;    // pushed under done_mu
  // The channel's stream block (channel.h): its `in` read by whichever thread reduces, its `ack` and
  // `out` written under the plane's lock; `acking` and `published`, the collectives they speak of
  // (plane's lock: a collective still reducing after a later one took the block over writes neither).
  StreamShared* const stream;
  std::uint64_t acking = 0;
  std::uint64_t published = 0;
  std::map<std::uint32_t, std::shared_ptr<Segment>> segments;  // attached input segments: the thread that pops the ring only
  std::atomic<bool> stop{false};
  std::atomic<bool> said_bye{false};
  std::atomic<bool> retired{false};  // the plane's poller has drained it after `stop` and lets it be
  std::thread thread;  // its own thread, where the plane runs no poller

 private:
  std::mutex done_mu_;
  std::set<std::uint32_t> told_;  // result segments whose SEGMENT went on the done ring (under done_mu_)
  std::mutex join_mu_;  // remove_worker and close may both join, from two threads: one at a time
};

}  // namespace smddp
