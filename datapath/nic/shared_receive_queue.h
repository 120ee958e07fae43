// SPDX-License-Identifier: Apache-2.0
// A shared receive queue as the NIC sees it: the consumer of the driver's posted ring and the
// producer of its free ring (hostif::SrqHeader). QPs attached to it claim receives in posting
// order when a message needs one (docs/spec/verbs-mapping.md §6) and return the slot when it
// completes, in any order.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "datapath/hostif/queues.h"
#include "datapath/nic/tag_matcher.h"

namespace metaroce::nic {

class CompletionQueue;
class Owner;

class SharedReceiveQueue {
 public:
  // ring: formatted by hostif::init_srq; its geometry is read here, once. An XRC SRQ
  // (verbs-mapping.md §17) belongs to domain xrcd (0: a basic SRQ) and completes into cq. A
  // tag-matching SRQ (§19) has a list of max_tags tags and completes into cq.
  SharedReceiveQueue(uint32_t id, Owner* owner, uint32_t pd, hostif::SrqHeader* ring,
                     uint64_t handle, uint32_t xrcd = 0, CompletionQueue* cq = nullptr,
                     uint32_t max_tags = 0);

  uint32_t id() const { return id_; }
  Owner* owner() const { return owner_; }
  uint32_t pd() const { return pd_; }
  uint64_t handle() const { return handle_; }
  uint32_t max_sge() const { return max_sge_; }
  uint32_t xrcd() const { return xrcd_; }
  CompletionQueue* cq() const { return cq_; }
  // A tag-matching SRQ's list; nullptr for other SRQs.
  TagMatcher* tags() const { return tags_.get(); }

  // Takes the oldest posted receive: its slot, owned by the NIC until release(); false when
  // nothing is posted. *limit_hit: the armed limit event is due now (fewer than `limit` left).
  bool claim(uint32_t* slot, bool* limit_hit);
  const uint8_t* slot(uint32_t s) const { return slots_ + size_t{s} * stride_; }
  void release(uint32_t slot);
  // Receives posted and not claimed.
  uint32_t posted() const;

  uint32_t users = 0;  // QPs attached: destroy answers EBUSY meanwhile

 private:
  const uint32_t id_;
  Owner* const owner_;
  const uint32_t pd_;
  hostif::SrqHeader* const ring_;
  const uint64_t handle_;
  const uint32_t xrcd_;
  CompletionQueue* const cq_;
  // Geometry, copied at creation.
  uint8_t* const slots_;
  uint32_t* const posted_;
  uint32_t* const free_;
  const uint32_t mask_, stride_, max_wr_, max_sge_;
  uint32_t tail_ = 0;       // next posted entry to claim (private copy of posted_tail)
  uint32_t free_head_;      // next free-ring entry to fill (private copy of free_head)
  std::vector<bool> held_;  // slots the NIC holds: a slot posted twice is claimed once
  std::unique_ptr<TagMatcher> tags_;
};

}  // namespace metaroce::nic
