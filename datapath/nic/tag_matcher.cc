// SPDX-License-Identifier: Apache-2.0
// Tag matching: the posted-tag list in posting order, classification of tagged messages, and
// the unexpected count (verbs-mapping.md §19).
#include "datapath/nic/tag_matcher.h"

#include <cerrno>

namespace metaroce::nic {
namespace {

uint64_t be(std::span<const uint8_t> b, size_t at, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v = (v << 8) | b[at + i];
  return v;
}

void put_be(std::span<uint8_t> b, size_t at, size_t n, uint64_t v) {
  for (size_t i = n; i-- > 0; v >>= 8) b[at + i] = static_cast<uint8_t>(v);
}

// Field offsets in the TMH and RVH.
constexpr size_t kTmhOp = 0, kTmhAppCtx = 4, kTmhTag = 8;
constexpr size_t kRvhVa = kTmhLen, kRvhRkey = kTmhLen + 8, kRvhLenAt = kTmhLen + 12;

}  // namespace

std::optional<Tmh> parse_tmh(std::span<const uint8_t> b) {
  if (b.size() < kTmhLen || b[kTmhOp] > static_cast<uint8_t>(TmhOp::kEager)) return std::nullopt;
  Tmh h;
  h.op = static_cast<TmhOp>(b[kTmhOp]);
  h.app_ctx = static_cast<uint32_t>(be(b, kTmhAppCtx, 4));
  h.tag = be(b, kTmhTag, 8);
  return h;
}

std::optional<Rvh> parse_rvh(std::span<const uint8_t> b) {
  if (b.size() < kTmhLen + kRvhLen) return std::nullopt;
  Rvh r;
  r.va = be(b, kRvhVa, 8);
  r.rkey = static_cast<uint32_t>(be(b, kRvhRkey, 4));
  r.len = static_cast<uint32_t>(be(b, kRvhLenAt, 4));
  return r;
}

void write_tmh(const Tmh& h, std::span<uint8_t> b) {
  for (size_t i = 0; i < kTmhLen; ++i) b[i] = 0;
  b[kTmhOp] = static_cast<uint8_t>(h.op);
  put_be(b, kTmhAppCtx, 4, h.app_ctx);
  put_be(b, kTmhTag, 8, h.tag);
}

TagMatcher::TagMatcher(uint32_t max_tags) : slots_(max_tags < kMaxTags ? max_tags : kMaxTags) {
  free_.reserve(slots_.size());
  for (uint32_t i = static_cast<uint32_t>(slots_.size()); i-- > 0;) free_.push_back(i);
}

int TagMatcher::add(uint64_t tag, uint64_t mask, uint64_t recv_wr_id, const hostif::Sge& sge,
                    uint32_t unexpected_cnt, uint32_t* handle) {
  if (free_.empty()) return ENOSPC;
  const uint32_t i = free_.back();
  free_.pop_back();
  Slot& s = slots_[i];
  s.live = true;
  s.e = Entry{tag & mask, mask, recv_wr_id, sge, (uint32_t{s.gen} << 16) | i};
  s.prev = tail_;
  s.next = kNone;
  if (tail_ != kNone) slots_[tail_].next = i;
  else head_ = i;
  tail_ = i;
  ++posted_;
  reported_ = unexpected_cnt;
  *handle = s.e.handle;
  return 0;
}

void TagMatcher::unlink(uint32_t i) {
  Slot& s = slots_[i];
  if (s.prev != kNone) slots_[s.prev].next = s.next;
  else head_ = s.next;
  if (s.next != kNone) slots_[s.next].prev = s.prev;
  else tail_ = s.prev;
  s.live = false;
  ++s.gen;
  --posted_;
  free_.push_back(i);
}

int TagMatcher::remove(uint32_t handle) {
  const uint32_t i = handle & 0xffff;
  if (i >= slots_.size() || !slots_[i].live || slots_[i].e.handle != handle) return EINVAL;
  unlink(i);
  return 0;
}

TagMatcher::Verdict TagMatcher::classify(const Tmh& h, Entry* entry, bool plain_room) {
  if (h.op != TmhOp::kEager && h.op != TmhOp::kRndv)
    return plain_room ? Verdict::kNoTag : Verdict::kNoRoom;
  if (in_sync()) {
    for (uint32_t i = head_; i != kNone; i = slots_[i].next) {
      const Entry& e = slots_[i].e;
      if ((h.tag & e.mask) != e.tag) continue;
      *entry = e;
      unlink(i);
      return Verdict::kMatched;
    }
  }
  if (!plain_room) return Verdict::kNoRoom;
  ++unexpected_;
  return Verdict::kUnexpected;
}

}  // namespace metaroce::nic
