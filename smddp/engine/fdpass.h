// The fds that go with ring descriptors: a worker's input segment with its ATTACH, the daemon's
// result segment with its SEGMENT, each sent on the channel's side socket just before its
// descriptor is pushed, and taken off it when that descriptor is popped.
//
// The side socket is one end of an AF_UNIX SOCK_SEQPACKET pair the worker makes with its channel
// (its other end goes to the daemon with CHANNEL). A message is a 16-byte note (the segment's id
// and size, as the descriptor names them) with exactly one fd. The ring is the one ordered channel:
// since the fd is sent before its descriptor is pushed, it is on the socket when the descriptor is
// popped, so the taker never waits for it: none there, or a note that does not match the
// descriptor, is a protocol error. Only the thread that pops a ring reads its side socket.
#pragma once

#include <cstdint>
#include <string>

namespace smddp {

constexpr std::size_t kFdNoteBytes = 16;

// A new AF_UNIX SOCK_SEQPACKET pair (close-on-exec): fds[0] and fds[1], or why not.
std::string side_pair(int fds[2]);
// Sends `fd` (a duplicate travels; the caller keeps its own) with the note (id, size), without
// waiting: "" or why not. *gone: the other end has closed (EPIPE/ECONNRESET).
std::string send_fd(int sock, std::uint32_t id, std::uint64_t size, int fd, bool* gone);
// Takes the next message off `sock` without waiting; it must be the note (id, size) with exactly
// one fd, which is returned in *fd (close-on-exec; the caller owns it). Any other fds that came
// with it are closed. "" or why not.
std::string recv_fd(int sock, std::uint32_t id, std::uint64_t size, int* fd);

}  // namespace smddp
