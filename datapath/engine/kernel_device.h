// SPDX-License-Identifier: Apache-2.0
// The engine's side of the metaroce_ib module (docs/spec/kernel.md): a link's kernel device,
// attached through /dev/metaroce, whose memory regions the engine maps and whose objects' events
// it raises; and the listener that hears of devices `rdma link add` made for it to serve.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "datapath/nic/link_config.h"

namespace metaroce::engine {

// True when the module is loaded (its character device exists).
bool kernel_module_loaded();

// One memory region's pinned pages, mapped into the engine; unmapped when destroyed.
class RegionMapping {
 public:
  RegionMapping(void* map, size_t bytes, uint32_t offset) : map_(map), bytes_(bytes), offset_(offset) {}
  ~RegionMapping();
  RegionMapping(const RegionMapping&) = delete;
  RegionMapping& operator=(const RegionMapping&) = delete;
  // Where the region's first byte is in the engine's address space.
  uint8_t* start() const { return static_cast<uint8_t*>(map_) + offset_; }

 private:
  void* map_;
  size_t bytes_;
  uint32_t offset_;
};

// What the module says of a region.
struct RegionInfo {
  uint64_t iova = 0, length = 0;
  uint32_t access = 0;
  bool writable = false;
};

class KernelDevice {
 public:
  // Attaches a new file to the kernel device `name` (created over `netdev` first when missing
  // and create is set), announcing the engine's link name, run dir and active MTU. nullptr and
  // a one-line reason on failure.
  static std::unique_ptr<KernelDevice> attach(const std::string& name, const std::string& netdev,
                                              bool create, const std::string& run_dir,
                                              uint32_t active_mtu, std::string* why);
  ~KernelDevice();  // detaches: the port goes DOWN, contexts hear IB_EVENT_DEVICE_FATAL
  KernelDevice(const KernelDevice&) = delete;
  KernelDevice& operator=(const KernelDevice&) = delete;

  // Readable with POLLHUP once the kernel device is gone.
  int fd() const { return fd_; }
  // Unregisters the kernel device (its contexts are disassociated). 0 or an errno.
  int remove();
  // Whether object `id` of `kind` (mrib_kind) is pid's: 0, ENOENT or EPERM. For a QP, *qp_type
  // is its ib_qp_type.
  int check(uint32_t kind, uint32_t id, pid_t pid, uint32_t* qp_type = nullptr) const;
  // Raises an event on an object (MRIB_EVENT_COMPLETION or an ib_event_type): 0 or an errno.
  int raise(uint32_t kind, uint32_t id, pid_t pid, uint32_t event) const;
  // Maps the pinned pages of pid's region `key`: nullptr and errno (ENOENT, EPERM, ...) when not.
  std::unique_ptr<RegionMapping> map_region(uint32_t key, pid_t pid, RegionInfo* info) const;

 private:
  explicit KernelDevice(int fd) : fd_(fd) {}
  int fd_;
};

// A notice of the module: a device waiting for an engine, or one that went away.
struct KernelNotice {
  bool added = false;
  std::string name, netdev;
};

// Opens a listener (nonblocking): every device already waiting for an engine is announced
// first. -1 (errno) when the module is not loaded.
int open_kernel_listener();
// The next notice, or nullopt when none is waiting.
std::optional<KernelNotice> read_kernel_notice(int fd);

// The record of a link the engine makes to serve a device of `rdma link add`: UDP sockets on the
// netdev (docs/spec/link.md §5) at its first IPv4 address, with its MTU. nullopt and a reason
// when the netdev has no IPv4 address.
std::optional<nic::LinkConfig> kernel_link_record(const std::string& name, const std::string& netdev,
                                                  std::string* why);

}  // namespace metaroce::engine
