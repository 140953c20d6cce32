// Sealed memfd segments and the first-fit arena over them.
#include "arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace smddp {
namespace {

constexpr std::uint64_t kMaxSegmentBytes = std::uint64_t{1} << 40;

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

std::uint64_t page_size() {
  const long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<std::uint64_t>(p) : 4096;
}

}  // namespace

std::shared_ptr<Segment> Segment::create(std::uint32_t id, std::uint64_t size, const std::string& name,
                                         std::string* why) {
  if (size > kMaxSegmentBytes) {
    *why = "segment of " + std::to_string(size) + " bytes is larger than 1 TiB";
    return nullptr;
  }
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *why = errno_text("memfd_create");
    return nullptr;
  }
  const std::uint64_t mapped = size > 0 ? size : 1;
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *why = errno_text("sealing a memfd");
    ::close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = errno_text("mmap");
    ::close(fd);
    return nullptr;
  }
  return std::shared_ptr<Segment>(new Segment(id, fd, size, true, static_cast<std::uint8_t*>(p), mapped));
}

std::shared_ptr<Segment> Segment::attach(std::uint32_t id, int fd, std::uint64_t size, bool writable,
                                         std::string* why) {
  const std::string who = "segment " + std::to_string(id);
  struct stat st;
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || seals < 0) {
    *why = who + ": fd is not a sealed memfd (" + std::strerror(errno) + ")";
    ::close(fd);
    return nullptr;
  }
  if ((seals & F_SEAL_SHRINK) == 0 || st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) < size ||
      size > kMaxSegmentBytes) {
    *why = who + ": not sealed against shrinking or smaller than " + std::to_string(size) + " bytes";
    ::close(fd);
    return nullptr;
  }
  const std::uint64_t mapped = size > 0 ? size : 1;
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* p = mmap(nullptr, mapped, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = who + ": " + errno_text("mmap");
    ::close(fd);
    return nullptr;
  }
  return std::shared_ptr<Segment>(new Segment(id, fd, size, writable, static_cast<std::uint8_t*>(p), mapped));
}

Segment::~Segment() {
  munmap(base_, mapped_);
  close_fd();
}

void Segment::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string Segment::range(std::uint64_t offset, std::uint64_t nbytes, std::uint8_t** out) const {
  // offset + nbytes without overflow: each bound checked on its own first.
  if (offset > size_ || nbytes > size_ - offset)
    return "segment " + std::to_string(id_) + ": range [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
           ") outside its " + std::to_string(size_) + " bytes";
  *out = base_ + offset;
  return {};
}

std::uint64_t Arena::rounded(std::uint64_t nbytes) {
  const std::uint64_t n = nbytes > 0 ? nbytes : 1;
  return (n + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

std::string Arena::alloc(std::uint64_t nbytes, Slot* out, std::shared_ptr<Segment>* fresh) {
  fresh->reset();
  if (nbytes > kMaxSegmentBytes) return name_ + ": a slot of " + std::to_string(nbytes) + " bytes is larger than 1 TiB";
  const std::uint64_t size = rounded(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [seg, holes] : free_) {
    for (auto it = holes.begin(); it != holes.end(); ++it) {
      if (it->second < size) continue;
      const std::uint64_t off = it->first, avail = it->second;
      holes.erase(it);
      if (avail > size) holes.emplace(off + size, avail - size);
      live_[{seg, off}] = size;
      in_use_ += size;
      *out = Slot{seg, off, nbytes};
      return {};
    }
  }
  const std::uint64_t page = page_size();
  std::uint64_t seg_size = (size + page - 1) / page * page;
  if (seg_size < segment_bytes_) seg_size = segment_bytes_;
  std::string why;
  std::shared_ptr<Segment> seg = Segment::create(next_id_, seg_size, name_, &why);
  if (!seg) return name_ + ": " + why;
  const std::uint32_t id = next_id_++;
  segments_[id] = seg;
  auto& holes = free_[id];
  if (seg_size > size) holes.emplace(size, seg_size - size);
  live_[{id, 0}] = size;
  in_use_ += size;
  *out = Slot{id, 0, nbytes};
  *fresh = std::move(seg);
  return {};
}

std::string Arena::free(const Slot& slot) {
  const std::uint64_t size = rounded(slot.nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find({slot.segment, slot.offset});
  if (it == live_.end() || it->second != size)
    return name_ + ": slot (" + std::to_string(slot.segment) + ", " + std::to_string(slot.offset) + ", " +
           std::to_string(slot.nbytes) + ") is not allocated (double free?)";
  live_.erase(it);
  in_use_ -= size;
  auto& holes = free_[slot.segment];
  auto next = holes.emplace(slot.offset, size).first;
  // Merge with the hole after, then with the one before.
  auto after = std::next(next);
  if (after != holes.end() && next->first + next->second == after->first) {
    next->second += after->second;
    holes.erase(after);
  }
  if (next != holes.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second == next->first) {
      before->second += next->second;
      holes.erase(next);
    }
  }
  return {};
}

std::shared_ptr<Segment> Arena::segment(std::uint32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = segments_.find(id);
  return it == segments_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Segment>> Arena::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Segment>> out;
  for (const auto& kv : segments_) out.push_back(kv.second);
  return out;
}

std::uint64_t Arena::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

void Arena::close() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& kv : segments_) kv.second->close_fd();
  segments_.clear();
  free_.clear();
  live_.clear();
  in_use_ = 0;
}

}  // namespace smddp
