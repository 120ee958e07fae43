// SPDX-License-Identifier: Apache-2.0
// A driver context: its descriptors, its events.
#include "datapath/engine/session.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "kernel/metaroce_ib/metaroce_ib_abi.h"

namespace metaroce::engine {

Session::Session(int sock, pid_t pid, uid_t uid)
    : sock_(sock), pid_(pid), uid_(uid), memory_(pid) {}

Session::~Session() {
  for (auto& [id, fd] : channels_)
    if (fd >= 0) close(fd);
  if (async_fd_ >= 0) close(async_fd_);
  if (pidfd_ >= 0) close(pidfd_);
  close(sock_);
}

bool Session::attach(Link* link, int async_fd, const KernelDevice* kdev) {
  // A pidfd becomes readable when the process exits, even if a child it forked keeps the
  // socket open: that is when its objects are reclaimed.
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
  // Without pidfds (Linux < 5.3, valgrind) the socket's hang-up and a periodic check of the
  // pid stand in (HostEngine::control_main).
  if (fd < 0 && errno != ENOSYS) return false;
  pidfd_ = fd;
  link_ = link;
  async_fd_ = async_fd;
  kdev_ = kdev;
  // A kernel context's memory is its mapped regions only; a kernel-free one's, its shared pages
  // and, for everything else, its address space.
  mapped_ = std::make_unique<MappedMemory>(static_cast<uint32_t>(pid_), kdev_ ? nullptr : &memory_);
  // Events are written from the datapath thread, which must never block on a reader.
  if (async_fd_ >= 0) fcntl(async_fd_, F_SETFL, fcntl(async_fd_, F_GETFL) | O_NONBLOCK);
  return true;
}

void Session::async_event(uint64_t handle, hostif::AsyncEvent ev) {
  if (kdev_) {
    // The handle is the object's kernel number; the module checks it is still this process's.
    const uint32_t kind = ev == hostif::AsyncEvent::kCqErr ? MRIB_KIND_CQ
                          : ev == hostif::AsyncEvent::kSrqErr ||
                                  ev == hostif::AsyncEvent::kSrqLimitReached
                              ? MRIB_KIND_SRQ
                              : MRIB_KIND_QP;
    kdev_->raise(kind, static_cast<uint32_t>(handle), pid_, static_cast<uint32_t>(ev));
    return;
  }
  if (async_fd_ < 0) return;
  // A full pipe drops the event: the application is not reading them.
  const hostif::AsyncEventDesc desc{handle, static_cast<uint32_t>(ev), 0};
  [[maybe_unused]] ssize_t n = write(async_fd_, &desc, sizeof(desc));
}

void Session::cq_event(uint32_t cq_id, uint64_t handle) {
  auto it = channels_.find(cq_id);
  if (it == channels_.end()) return;
  if (kdev_) {
    kdev_->raise(MRIB_KIND_CQ, static_cast<uint32_t>(handle), pid_, MRIB_EVENT_COMPLETION);
    return;
  }
  // One struct ib_uverbs_comp_event_desc naming the CQ, as ibv_get_cq_event reads it. A full
  // socket means the application ignores its events; an unread one is already waiting.
  [[maybe_unused]] ssize_t n =
      send(it->second, &handle, sizeof(handle), MSG_DONTWAIT | MSG_NOSIGNAL);
}

void Session::set_channel(uint32_t cq_id, int fd) {
  drop_channel(cq_id);
  channels_[cq_id] = fd;
}

void Session::drop_channel(uint32_t cq_id) {
  auto it = channels_.find(cq_id);
  if (it == channels_.end()) return;
  if (it->second >= 0) close(it->second);
  channels_.erase(it);
}

}  // namespace metaroce::engine
