// SPDX-License-Identifier: Apache-2.0
// Shared segments between the engine and a driver: sealed memfds the engine creates, maps and
// sends; the driver maps them and cannot shrink or grow them under the engine.
#pragma once

#include <cstddef>
#include <string>

namespace metaroce::engine {

class Segment {
 public:
  Segment() = default;
  // A zeroed, mapped segment of `bytes` (a multiple of the page size); empty (!ok()) on failure
  // with errno set.
  static Segment create(const char* name, size_t bytes);
  ~Segment();
  Segment(Segment&& o) noexcept;
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  bool ok() const { return base_ != nullptr; }
  void* base() const { return base_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  // Seals the size (and, read_only, any new writable mapping: the status page) and returns a
  // descriptor to send: the driver's copy. The segment keeps its own until close_fd().
  int share(bool read_only);
  void close_fd();

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace metaroce::engine
