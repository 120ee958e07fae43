// SPDX-License-Identifier: Apache-2.0
// Shared-memory block the NIC updates under a sequence lock.
#include "datapath/nic/telemetry_writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

namespace metaroce::nic {

TelemetryWriter::TelemetryWriter(const std::string& run_dir, const std::string& link,
                                 uint32_t planes) {
  if (run_dir.empty()) return;
  const std::string dir = telemetry_dir(run_dir);
  mkdir(dir.c_str(), 0755);  // may exist
  file_ = dir + "/" + link + "." + std::to_string(getpid());
  int fd = open(file_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (ftruncate(fd, sizeof(TelemetryBlock)) != 0) {
    close(fd);
    unlink(file_.c_str());
    return;
  }
  void* map = mmap(nullptr, sizeof(TelemetryBlock), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    unlink(file_.c_str());
    return;
  }
  block_ = static_cast<TelemetryBlock*>(map);  // zero-filled by ftruncate
  block_->pid = static_cast<uint32_t>(getpid());
  block_->planes = planes;
  std::snprintf(block_->link, sizeof(block_->link), "%s", link.c_str());
  block_->version = kTelemetryVersion;
  std::atomic_thread_fence(std::memory_order_release);
  block_->magic = kTelemetryMagic;
}

TelemetryWriter::~TelemetryWriter() {
  if (!block_) return;
  munmap(block_, sizeof(TelemetryBlock));
  unlink(file_.c_str());
}

TelemetryBlock* TelemetryWriter::begin_update() {
  if (!block_) return nullptr;
  block_->seq.fetch_add(1, std::memory_order_acq_rel);  // odd: readers retry
  std::atomic_thread_fence(std::memory_order_release);
  return block_;
}

void TelemetryWriter::end_update() {
  block_->updated_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
  block_->seq.fetch_add(1, std::memory_order_release);
}

}  // namespace metaroce::nic
