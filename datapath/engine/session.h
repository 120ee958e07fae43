// SPDX-License-Identifier: Apache-2.0
// One driver context connected to the engine (an ibv_context of some process): the owner of
// the NIC objects it creates, the address space they reach, where their events go, and the
// shared segments of their rings.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "datapath/engine/kernel_device.h"
#include "datapath/engine/mapped_memory.h"
#include "datapath/engine/process_memory.h"
#include "datapath/engine/shm.h"
#include "datapath/nic/nic.h"

namespace metaroce::engine {

struct Link;

class Session final : public nic::Owner {
 public:
  // sock: the accepted connection; pid, uid: its peer's credentials (SO_PEERCRED).
  Session(int sock, pid_t pid, uid_t uid);
  ~Session() override;  // closes every descriptor and unmaps every segment
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int sock() const { return sock_; }
  pid_t peer_pid() const { return pid_; }
  uid_t uid() const { return uid_; }
  int pidfd() const { return pidfd_; }
  Link* link() const { return link_; }

  // kHello accepted: the session now belongs to link, its events go to async_fd (taken), or
  // through kdev for a kernel context (docs/spec/kernel.md): then its memory is the regions it
  // registers, mapped through the module. Opens a pidfd for the process; false (errno set) when
  // it cannot.
  bool attach(Link* link, int async_fd, const KernelDevice* kdev = nullptr);
  const KernelDevice* kernel() const { return kdev_; }
  // Its mapped regions: a kernel context's, or a kernel-free context's shared pages (whose other
  // accesses go through process_memory()). nullptr before attach.
  MappedMemory* mapped() { return mapped_.get(); }
  const ProcessMemory& process_memory() const { return memory_; }

  // nic::Owner (called on the datapath thread).
  nic::Memory& memory() override { return mapped_ ? static_cast<nic::Memory&>(*mapped_) : memory_; }
  void async_event(uint64_t handle, hostif::AsyncEvent ev) override;
  void cq_event(uint32_t cq_id, uint64_t handle) override;
  uint32_t pid() const override { return static_cast<uint32_t>(pid_); }

  // The process exited: no more access to its memory (its pid may be reused).
  void mark_gone() { memory_.mark_gone(); }

  // Bookkeeping of the control thread: segments by object, channel fds by CQ (the latter read
  // by cq_event on the datapath thread: changed only inside datapath commands).
  void keep_segment(char kind, uint32_t id, Segment seg) {
    Segment& slot = segments_[{kind, id}];
    ring_bytes_ = ring_bytes_ + seg.size() - slot.size();  // a resized CQ's ring replaces its old
    slot = std::move(seg);
  }
  void drop_segment(char kind, uint32_t id) {
    auto it = segments_.find({kind, id});
    if (it == segments_.end()) return;
    ring_bytes_ -= it->second.size();
    segments_.erase(it);
  }
  // What it holds, for the per-process limits (nic::LinkConfig::process_limits, kept by the
  // control thread): objects by kind, and the bytes of its rings.
  enum Kind : uint8_t { kQp, kCq, kSrq, kPd, kMr, kKinds };
  std::array<uint32_t, kKinds> held{};
  size_t ring_bytes() const { return ring_bytes_; }
  void set_channel(uint32_t cq_id, int fd);  // takes fd; -1 for a kernel context's channel
  void drop_channel(uint32_t cq_id);
  // A librdmacm event channel (kCmOpen) rather than a device context: its CM channel number.
  uint32_t cm_channel = 0;

 private:
  const int sock_;
  const pid_t pid_;
  const uid_t uid_;
  int pidfd_ = -1;
  int async_fd_ = -1;
  Link* link_ = nullptr;
  const KernelDevice* kdev_ = nullptr;
  ProcessMemory memory_;
  std::unique_ptr<MappedMemory> mapped_;
  std::map<std::pair<char, uint32_t>, Segment> segments_;
  size_t ring_bytes_ = 0;
  std::unordered_map<uint32_t, int> channels_;
};

}  // namespace metaroce::engine
