// SPDX-License-Identifier: Apache-2.0
// Framing of control messages over a SOCK_SEQPACKET socket, descriptors and credentials.
#include "datapath/hostif/control.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace metaroce::hostif {

int send_message(int sock, const Message& m, int flags) {
  if (m.body.size() + sizeof(Header) > kMaxMessage || m.fds.size() > kMaxFds) return EMSGSIZE;
  uint8_t buf[kMaxMessage];
  std::memcpy(buf, &m.header, sizeof(Header));
  if (!m.body.empty()) std::memcpy(buf + sizeof(Header), m.body.data(), m.body.size());
  iovec iov{buf, sizeof(Header) + m.body.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (!m.fds.empty()) {
    mh.msg_control = control;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * m.fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * m.fds.size());
    std::memcpy(CMSG_DATA(c), m.fds.data(), sizeof(int) * m.fds.size());
  }
  for (;;) {
    const ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL | flags);
    if (n >= 0) return static_cast<size_t>(n) == iov.iov_len ? 0 : EMSGSIZE;
    if (errno != EINTR) return errno;
  }
}

int recv_message(int sock, Message* m) {
  uint8_t buf[kMaxMessage];
  iovec iov{buf, sizeof(buf)};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds) + CMSG_SPACE(sizeof(ucred))];
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return errno == EPIPE ? ECONNRESET : errno;
  m->fds.clear();
  m->pid = m->uid = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET) continue;
    if (c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        m->fds.push_back(fd);
      }
    } else if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len >= CMSG_LEN(sizeof(ucred))) {
      ucred cr;
      std::memcpy(&cr, CMSG_DATA(c), sizeof(cr));
      m->pid = static_cast<uint32_t>(cr.pid);
      m->uid = cr.uid;
    }
  }
  if (n == 0) {
    close_fds(m);
    return ECONNRESET;
  }
  const bool truncated = (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
  if (truncated || static_cast<size_t>(n) < sizeof(Header) || m->fds.size() > kMaxFds) {
    close_fds(m);
    return EBADMSG;
  }
  std::memcpy(&m->header, buf, sizeof(Header));
  if (m->header.magic != kControlMagic || m->header.version != kControlVersion) {
    close_fds(m);
    return EBADMSG;
  }
  m->body.assign(buf + sizeof(Header), buf + n);
  return 0;
}

bool put_name(char (&dst)[kNameLen], const std::string& name) {
  if (name.size() >= kNameLen) return false;
  std::memset(dst, 0, kNameLen);
  std::memcpy(dst, name.data(), name.size());
  return true;
}

std::string get_name(const char (&src)[kNameLen]) { return std::string(src, strnlen(src, kNameLen)); }

void close_fds(Message* m) {
  for (int fd : m->fds)
    if (fd >= 0) close(fd);
  m->fds.clear();
}

}  // namespace metaroce::hostif
