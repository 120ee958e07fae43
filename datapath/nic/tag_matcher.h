// SPDX-License-Identifier: Apache-2.0
// Hardware tag matching as a tag-matching SRQ offers it (IBV_SRQT_TM, verbs-mapping.md §19): the
// list of posted tags, the decision for each arriving tagged message (matched, unexpected, or
// carrying no tag), and the unexpected-message count that keeps the NIC's list and the
// application's unexpected queue in step. The headers tagged SENDs carry are read here too.
// Single-threaded like the rest of the NIC; no allocation after construction.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "datapath/hostif/queues.h"

namespace metaroce::nic {

// struct ibv_tmh's opcode (enum ibv_tmh_op).
enum class TmhOp : uint8_t { kNoTag = 0, kRndv = 1, kFin = 2, kEager = 3 };

// The tag-matching header at byte 0 of a tagged SEND (struct ibv_tmh, big-endian fields):
// opcode (1 byte), 3 reserved bytes, the application's context (4), the tag (8).
inline constexpr uint32_t kTmhLen = 16;
struct Tmh {
  TmhOp op = TmhOp::kNoTag;
  uint32_t app_ctx = 0;
  uint64_t tag = 0;
};
// The rendezvous header after a TMH of kRndv (struct ibv_rvh): where the sender's data lies
// (virtual address 8 bytes, rkey 4, length 4, big-endian).
inline constexpr uint32_t kRvhLen = 16;
struct Rvh {
  uint64_t va = 0;
  uint32_t rkey = 0;
  uint32_t len = 0;
};

// nullopt: fewer than kTmhLen bytes, or an opcode TM does not define.
std::optional<Tmh> parse_tmh(std::span<const uint8_t> b);
// b starts at the TMH; nullopt: too short for TMH and RVH.
std::optional<Rvh> parse_rvh(std::span<const uint8_t> b);
// A TMH in b[0, kTmhLen) (the NIC's rendezvous notification, TmhOp::kFin).
void write_tmh(const Tmh& h, std::span<uint8_t> b);

class TagMatcher {
 public:
  // One tagged receive buffer (IBV_WR_TAG_ADD).
  struct Entry {
    uint64_t tag = 0, mask = 0;
    uint64_t recv_wr_id = 0;  // the wr_id of its receive completions
    hostif::Sge sge{};        // where a matched message's payload lands (TM SRQs: one SGE)
    uint32_t handle = 0;
  };
  enum class Verdict : uint8_t {
    kMatched,     // *entry took it; the tag is off the list
    kUnexpected,  // the application's unexpected queue: a plain SRQ receive, counted
    kNoTag,       // not for matching (TmhOp::kNoTag, kFin): a plain SRQ receive, not counted
    kNoRoom,      // it needs a plain receive and none is posted: nothing changed (RNR)
  };

  // max_tags: the list's size (ibv_tm_cap.max_num_tags), at most kMaxTags.
  explicit TagMatcher(uint32_t max_tags);
  static constexpr uint32_t kMaxTags = 0xffff;

  uint32_t max_tags() const { return static_cast<uint32_t>(slots_.size()); }
  uint32_t posted() const { return posted_; }
  // Unexpected messages seen so far (what IBV_WR_TAG_SYNC reports back when in step).
  uint32_t unexpected() const { return unexpected_; }
  // Matching runs only while the application's last reported count equals unexpected():
  // after an unexpected message, a tag it posts may belong to that message, which it alone can
  // see, so every message goes unexpected until it says it caught up.
  bool in_sync() const { return reported_ == unexpected_; }

  // IBV_WR_TAG_ADD: 0 and *handle, or ENOSPC when max_tags are posted. unexpected_cnt is the
  // application's count, as for sync().
  int add(uint64_t tag, uint64_t mask, uint64_t recv_wr_id, const hostif::Sge& sge,
          uint32_t unexpected_cnt, uint32_t* handle);
  // IBV_WR_TAG_DEL: 0, or EINVAL for a handle that names no posted tag (never posted, matched
  // or removed since: a handle is not reused before 2^16 more adds of its slot).
  int remove(uint32_t handle);
  // IBV_WR_TAG_SYNC: the application has handled unexpected_cnt unexpected messages.
  void sync(uint32_t unexpected_cnt) { reported_ = unexpected_cnt; }

  // The decision for a message whose TMH is h: in the order tags were posted, the first whose
  // masked tag equals the message's masked tag takes it (kEager, kRndv while in step).
  // plain_room: a plain SRQ receive is posted, for a message that is not matched.
  Verdict classify(const Tmh& h, Entry* entry, bool plain_room = true);
  // A tagged message the NIC leaves to software whatever the list holds (a rendezvous request
  // whose RVH is not in its first segment): counted as unexpected.
  void note_unexpected() { ++unexpected_; }

 private:
  static constexpr uint32_t kNone = 0xffffffffu;
  struct Slot {
    Entry e;
    uint16_t gen = 0;  // the handle's high half: a stale handle does not name a reused slot
    bool live = false;
    uint32_t prev = kNone, next = kNone;  // posting order among live slots
  };
  void unlink(uint32_t i);

  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  uint32_t head_ = kNone, tail_ = kNone;  // oldest and newest posted
  uint32_t posted_ = 0;
  uint32_t unexpected_ = 0, reported_ = 0;
};

}  // namespace metaroce::nic
