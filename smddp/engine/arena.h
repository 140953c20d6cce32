// Shared memory the engine owns: sealed memfd segments, mapped once, and a first-fit arena over them.
//
// Ownership (docs/engine.md, "Ownership"): a Segment owns its mapping and its fd. Segments an Arena
// creates belong to the Arena (shared_ptr: a Python view of one, or an in-flight operation, keeps
// it mapped until it lets go). A Segment attached from a peer's fd (a worker's input segment, the
// daemon's result segment in a worker) belongs to whoever attached it, and is mapped read-only
// unless asked otherwise. Every range taken from the wire or a ring goes through Segment::range,
// which checks it against the segment's size before any pointer is formed. Nothing is named in
// /dev/shm: the memory lives as long as an fd or a mapping of it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace smddp {

// Slots start on cache-line boundaries: aligned for SIMD loads, away from their neighbours' lines.
constexpr std::uint64_t kSlotAlign = 64;

class Segment {
 public:
  // A new sealed memfd of `size` bytes (pages are allocated only when touched), mapped read-write.
  // Returns nullptr and says why in *why on failure.
  static std::shared_ptr<Segment> create(std::uint32_t id, std::uint64_t size, const std::string& name,
                                         std::string* why);
  // Maps `fd` (taken over: closed on failure too) after checking it is a memfd sealed against
  // shrinking and at least `size` bytes long, so that it cannot shrink under us (SIGBUS).
  static std::shared_ptr<Segment> attach(std::uint32_t id, int fd, std::uint64_t size, bool writable,
                                         std::string* why);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  std::uint32_t id() const { return id_; }
  std::uint64_t size() const { return size_; }
  bool writable() const { return writable_; }
  int fd() const { return fd_; }  // -1 once closed
  void close_fd();
  std::uint8_t* base() const { return base_; }
  // The bytes [offset, offset + nbytes), or why they are not inside this segment.
  std::string range(std::uint64_t offset, std::uint64_t nbytes, std::uint8_t** out) const;

 private:
  Segment(std::uint32_t id, int fd, std::uint64_t size, bool writable, std::uint8_t* base, std::uint64_t mapped)
      : id_(id), fd_(fd), size_(size), writable_(writable), base_(base), mapped_(mapped) {}
  std::uint32_t id_;
  int fd_;
  std::uint64_t size_;
  bool writable_;
  std::uint8_t* base_;
  std::uint64_t mapped_;  // a zero-size segment maps one page it never uses
};

struct Slot {
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t nbytes = 0;
};

// First fit over growing segments of at least `segment_bytes`; thread-safe.
class Arena {
 public:
  Arena(std::string name, std::uint64_t segment_bytes) : name_(std::move(name)), segment_bytes_(segment_bytes) {}

  // A slot of `nbytes`; *fresh is the segment created for it (tell the peers) or nullptr. "" or why not.
  std::string alloc(std::uint64_t nbytes, Slot* out, std::shared_ptr<Segment>* fresh);
  // Gives a slot back; refused (with why) unless it is exactly a live slot.
  std::string free(const Slot& slot);
  std::shared_ptr<Segment> segment(std::uint32_t id) const;
  std::vector<std::shared_ptr<Segment>> segments() const;
  std::uint64_t in_use() const;
  // Drops every segment (mappings go when their last holder lets go) and every slot.
  void close();

 private:
  static std::uint64_t rounded(std::uint64_t nbytes);
  std::string name_;
  std::uint64_t segment_bytes_;
  mutable std::mutex mu_;
  std::map<std::uint32_t, std::shared_ptr<Segment>> segments_;
  std::map<std::uint32_t, std::map<std::uint64_t, std::uint64_t>> free_;  // segment -> offset -> bytes
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::uint64_t> live_;  // (segment, offset) -> bytes
  std::uint32_t next_id_ = 0;
  std::uint64_t in_use_ = 0;
};

}  // namespace smddp
