// The fds beside ring descriptors (smddp/engine/fdpass.h): a note and its fd arrive as sent; anything
// else a peer could put on the side socket (nothing, no fd, two fds, a short or long note, another
// segment's note) is refused with a reason naming the segment, and every fd that came is closed.
// Built and run under ASan+UBSan and TSan by `make engine-sanitize`. Exit status 0: every check held.
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fdpass.h"

namespace {

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "test_fdpass: FAILED: %s\n", what.c_str());
    std::exit(1);
  }
}

int open_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  check(d != nullptr, "opendir /proc/self/fd");
  while (readdir(d) != nullptr) n++;
  closedir(d);
  return n;
}

// A raw message on the side socket: `len` bytes of note (id 7, size 4096 when long enough) and `nfds` fds.
void send_raw(int sock, std::size_t len, int nfds, int fd) {
  std::uint8_t note[32] = {7, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0};
  iovec iov{note, len};
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    for (int i = 0; i < nfds; i++) std::memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof(int));
  }
  check(::sendmsg(sock, &msg, 0) == static_cast<ssize_t>(len), "sendmsg");
}

void refused(int sock[2], std::size_t len, int nfds, const std::string& want) {
  const int memfd = memfd_create("test-fdpass", MFD_CLOEXEC);
  check(memfd >= 0, "memfd_create");
  const int before = open_fds();
  send_raw(sock[0], len, nfds, memfd);
  int got = -1;
  const std::string why = smddp::recv_fd(sock[1], 7, 4096, &got);
  check(got == -1 && why.find(want) != std::string::npos, "refused with '" + want + "': '" + why + "'");
  check(why.find("segment 7") == 0, "the reason names the segment: " + why);
  check(open_fds() == before, "every fd that came is closed (" + want + ")");
  ::close(memfd);
}

}  // namespace

int main() {
  int sock[2];
  check(smddp::side_pair(sock).empty(), "side_pair");
  int got = -1;

  // Nothing sent before the descriptor: refused at once, no wait.
  std::string why = smddp::recv_fd(sock[1], 7, 4096, &got);
  check(why == "segment 7's fd was not sent before its descriptor", "nothing there: " + why);

  // A note and its fd, as sent: the same file arrives.
  const int memfd = memfd_create("test-fdpass", MFD_CLOEXEC);
  check(memfd >= 0 && ftruncate(memfd, 4096) == 0, "memfd");
  bool gone = true;
  check(smddp::send_fd(sock[0], 7, 4096, memfd, &gone).empty() && !gone, "send_fd");
  why = smddp::recv_fd(sock[1], 7, 4096, &got);
  check(why.empty() && got >= 0 && got != memfd, "recv_fd: " + why);
  struct stat a, b;
  check(fstat(memfd, &a) == 0 && fstat(got, &b) == 0 && a.st_ino == b.st_ino, "the same file came");
  ::close(got);

  // What a peer could put there instead.
  refused(sock, 16, 0, "with 0 fds, not one");
  refused(sock, 16, 2, "with 2 fds, not one");
  refused(sock, 8, 1, "a note of 8 bytes, not 16");
  refused(sock, 17, 1, "a note of 17 bytes, not 16");
  // Another segment's note (sent for segment 8, taken for 7).
  check(smddp::send_fd(sock[0], 8, 4096, memfd, &gone).empty(), "send_fd 8");
  const int before = open_fds();
  why = smddp::recv_fd(sock[1], 7, 4096, &got);
  check(got == -1 && why.find("names segment 8 of 4096 bytes") != std::string::npos, "another's note: " + why);
  check(open_fds() == before, "its fd closed");

  // The other end gone: the sender is told so.
  ::close(sock[1]);
  why = smddp::send_fd(sock[0], 7, 4096, memfd, &gone);
  check(!why.empty() && gone, "a closed peer: " + why);
  ::close(sock[0]);
  ::close(memfd);
  std::printf("test_fdpass: every check held\n");
  return 0;
}
