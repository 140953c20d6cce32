// Passing a segment's fd beside its ring descriptor (fdpass.h).
#include "fdpass.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace smddp {
namespace {

void put_le(std::uint8_t* p, std::uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

std::uint64_t get_le(const std::uint8_t* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

// Room for more fds than a sender may pass, so that extra ones are received (and closed), not lost
// into a truncated control message.
constexpr int kMaxFds = 8;

}  // namespace

std::string side_pair(int fds[2]) {
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0)
    return std::string("socketpair: ") + std::strerror(errno);
  return {};
}

std::string send_fd(int sock, std::uint32_t id, std::uint64_t size, int fd, bool* gone) {
  *gone = false;
  std::uint8_t note[kFdNoteBytes] = {};
  put_le(note, id, 4);
  put_le(note + 8, size, 8);
  iovec iov{note, sizeof note};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  for (;;) {
    const ssize_t n = ::sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(sizeof note)) return {};
    if (n >= 0) return "a short send of a segment's note";  // a datagram socket never sends part of one
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET) *gone = true;
    // EAGAIN: hundreds of fds sent and not taken, which a peer that pops its ring never leaves.
    return std::string("sending segment ") + std::to_string(id) + "'s fd: " + std::strerror(errno);
  }
}

std::string recv_fd(int sock, std::uint32_t id, std::uint64_t size, int* fd) {
  *fd = -1;
  std::uint8_t note[kFdNoteBytes + 1];  // one more: a longer message shows as more than a note
  iovec iov{note, sizeof note};
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxFds * sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  const std::string seg = "segment " + std::to_string(id);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return seg + "'s fd was not sent before its descriptor";
    return seg + "'s fd: " + std::strerror(errno);
  }
  if (n == 0) return seg + "'s fd: the side socket closed";
  // Every fd that came is taken, whatever else is wrong, so that none leaks.
  int got[kMaxFds];
  int nfds = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0)) continue;
    const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < k && nfds < kMaxFds; i++)
      std::memcpy(&got[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
  }
  auto refuse = [&](const std::string& why) {
    for (int i = 0; i < nfds; i++) ::close(got[i]);
    return seg + ": " + why;
  };
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) return refuse("its note or fds came truncated");
  if (n != static_cast<ssize_t>(kFdNoteBytes)) return refuse("a note of " + std::to_string(n) + " bytes, not 16");
  if (nfds != 1) return refuse("its note came with " + std::to_string(nfds) + " fds, not one");
  const std::uint64_t nid = get_le(note, 4), nsize = get_le(note + 8, 8);
  if (nid != id || nsize != size || get_le(note + 4, 4) != 0)
    return refuse("the fd's note names segment " + std::to_string(nid) + " of " + std::to_string(nsize) +
                  " bytes, not the descriptor's " + std::to_string(size));
  *fd = got[0];
  return {};
}

}  // namespace smddp
