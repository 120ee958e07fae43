// SPDX-License-Identifier: Apache-2.0
// A completion queue as the NIC sees it: the producer side of a ring shared with the driver
// (hostif::CqHeader). Completions are staged during a pass and published at its end, after the
// data they announce has reached application memory.
#pragma once

#include <cstdint>

#include "datapath/hostif/queues.h"

namespace metaroce::nic {

class Owner;

class CompletionQueue {
 public:
  CompletionQueue(uint32_t id, Owner* owner, hostif::CqHeader* ring, uint64_t handle,
                  bool channel)
      : id_(id), owner_(owner), producer_(ring), handle_(handle), channel_(channel) {}

  uint32_t id() const { return id_; }
  Owner* owner() const { return owner_; }
  uint64_t handle() const { return handle_; }
  bool has_channel() const { return channel_; }

  // Writes a completion, visible at publish(); false when the ring is full (the completion is
  // lost and the overflow recorded: IBV_EVENT_CQ_ERR, raised once).
  bool stage(const hostif::Cqe& c);
  bool has_staged() const { return producer_.has_staged(); }
  // Publishes staged completions; true when that should raise a completion event.
  bool publish() { return producer_.publish() && channel_; }
  hostif::CqProducer& producer() { return producer_; }
  // ibv_resize_cq: its completions move to ring (hostif::CqProducer::move_to).
  bool move_to(hostif::CqHeader* ring, uint32_t owed) { return producer_.move_to(ring, owed); }
  // The overflow not yet reported (an async event is due); clears the report.
  bool take_overflow_report();

  uint32_t users = 0;  // QPs using it as send or receive CQ: destroy answers EBUSY meanwhile

 private:
  const uint32_t id_;
  Owner* const owner_;
  hostif::CqProducer producer_;
  const uint64_t handle_;
  const bool channel_;
  bool overflow_reported_ = false;
  bool overflow_due_ = false;
};

}  // namespace metaroce::nic
