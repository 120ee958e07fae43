// SPDX-License-Identifier: Apache-2.0
// memfd segments.
#include "datapath/engine/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace metaroce::engine {

Segment Segment::create(const char* name, size_t bytes) {
  Segment s;
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return s;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    return s;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int e = errno;
    close(fd);
    errno = e;
    return s;
  }
  s.base_ = base;
  s.size_ = bytes;
  s.fd_ = fd;
  return s;
}

Segment::~Segment() {
  if (base_) munmap(base_, size_);
  close_fd();
}

Segment::Segment(Segment&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), size_(o.size_), fd_(std::exchange(o.fd_, -1)) {}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    if (base_) munmap(base_, size_);
    close_fd();
    base_ = std::exchange(o.base_, nullptr);
    size_ = o.size_;
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

int Segment::share(bool read_only) {
  if (fd_ < 0) return -1;
  int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if (read_only) seals |= F_SEAL_FUTURE_WRITE;
  // Our own writable mapping predates the seals and keeps working.
  if (fcntl(fd_, F_ADD_SEALS, seals) != 0) return -1;
  return fd_;
}

void Segment::close_fd() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

}  // namespace metaroce::engine
