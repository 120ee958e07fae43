// SPDX-License-Identifier: Apache-2.0
// Tests of the driver/engine interface (datapath/hostif): the shared rings as both sides use
// them (staging and publication of completions, ring limits, wrap-around, orphan completions),
// the checks a driver makes of a segment the engine hands it, and the control protocol's framing
// over a real SOCK_SEQPACKET socket pair (bodies, descriptors, credentials, malformed messages).
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"

namespace metaroce::hostif {
namespace {

// A zeroed, page-aligned segment, as the engine's memfd is when it formats it.
class Seg {
 public:
  explicit Seg(size_t bytes)
      : bytes_(bytes),
        mem_(static_cast<uint8_t*>(std::aligned_alloc(kPage, round_up(bytes, kPage)))) {
    std::memset(mem_, 0, round_up(bytes, kPage));
  }
  ~Seg() { std::free(mem_); }
  Seg(const Seg&) = delete;
  Seg& operator=(const Seg&) = delete;
  uint8_t* data() const { return mem_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(mem_);
  }

 private:
  static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
  size_t bytes_;
  uint8_t* mem_;
};

Cqe cqe(uint64_t wr_id) {
  Cqe c{};
  c.wr_id = wr_id;
  c.status = WcStatus::kSuccess;
  c.opcode = WcOpcode::kRdmaWrite;
  c.byte_len = static_cast<uint32_t>(wr_id * 3);
  return c;
}

// --- completion queue ------------------------------------------------------------------------

TEST(CqRing, LayoutHoldsAtLeastTheRequestedCompletions) {
  for (uint32_t want : {1u, 2u, 3u, 7u, 8u, 100u, 4095u, kMaxCqe}) {
    const CqLayout l = cq_layout(want);
    EXPECT_GE(l.entries - 1, want) << want;
    EXPECT_EQ(l.entries & (l.entries - 1), 0u) << want;
    EXPECT_EQ(l.bytes % kPage, 0u);
    EXPECT_GE(l.bytes, l.ring_offset + l.entries * sizeof(Cqe));
    Seg s(l.bytes);
    init_cq(s.data(), want);
    EXPECT_TRUE(valid_cq(s.data(), s.size()));
    EXPECT_EQ(s.as<CqHeader>()->capacity, l.entries - 1);
  }
}

TEST(CqRing, StagedCompletionsAreInvisibleUntilPublished) {
  Seg s(cq_layout(16).bytes);
  init_cq(s.data(), 16);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  EXPECT_FALSE(p.has_staged());
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(p.stage(cqe(i)));
  EXPECT_TRUE(p.has_staged());
  EXPECT_EQ(p.staged(), 3u);
  Cqe out[8];
  EXPECT_EQ(cq_poll(h, 8, out), 0) << "a staged completion was visible before publish()";
  EXPECT_EQ(h->head.load(), 0u);
  p.publish();
  EXPECT_FALSE(p.has_staged());
  ASSERT_EQ(cq_poll(h, 8, out), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i].wr_id, static_cast<uint64_t>(i + 1));
    EXPECT_EQ(out[i].byte_len, static_cast<uint32_t>((i + 1) * 3));
  }
  EXPECT_EQ(cq_poll(h, 8, out), 0);
}

TEST(CqRing, CleaningAQpRemovesOnlyItsUnpolledCompletionsInOrderAcrossTheWrap) {
  Seg s(cq_layout(8).bytes);
  init_cq(s.data(), 8);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  Cqe out[16];
  // Move the indices near the wrap of the 8-entry ring first.
  for (uint64_t i = 0; i < 6; ++i) ASSERT_TRUE(p.stage(cqe(100 + i)));
  p.publish();
  ASSERT_EQ(cq_poll(h, 16, out), 6);
  for (uint64_t i = 1; i <= 6; ++i) {
    Cqe c = cqe(i);
    c.qp_num = i % 2 ? 7 : 9;  // 1, 3, 5 of QP 7; 2, 4, 6 of QP 9
    ASSERT_TRUE(p.stage(c));
  }
  p.publish();
  EXPECT_EQ(cq_clean(h, 7), 3);
  EXPECT_EQ(cq_clean(h, 12345), 0);
  // The room freed is the engine's again: all but the 3 kept fit.
  const uint32_t room = h->capacity - 3;
  for (uint64_t i = 0; i < room; ++i) EXPECT_TRUE(p.stage(cqe(50 + i)));
  EXPECT_FALSE(p.stage(cqe(99)));
  p.publish();
  ASSERT_EQ(cq_poll(h, 16, out), static_cast<int>(h->capacity));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i].wr_id, static_cast<uint64_t>(2 * i + 2));
  EXPECT_EQ(out[3].wr_id, 50u);
}

TEST(CqRing, MovingToANewRingKeepsWhatWasNotPolledInOrderAndRefusesARingTooSmall) {
  Seg s(cq_layout(8).bytes);
  init_cq(s.data(), 8);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  Cqe out[64];
  for (uint64_t i = 1; i <= 10; ++i) ASSERT_TRUE(p.stage(cqe(i)));
  p.publish();
  ASSERT_EQ(cq_poll(h, 3, out), 3);  // 4..10 are left, and two more only staged
  ASSERT_TRUE(p.stage(cqe(11)));
  ASSERT_TRUE(p.stage(cqe(12)));
  h->armed.store(1);
  Seg small(cq_layout(4).bytes);
  init_cq(small.data(), 4);
  EXPECT_FALSE(p.move_to(small.as<CqHeader>())) << "9 completions into a ring of 7";
  Seg big(cq_layout(40).bytes);
  init_cq(big.data(), 40);
  auto* b = big.as<CqHeader>();
  ASSERT_TRUE(p.move_to(b));
  EXPECT_EQ(p.header(), b);
  EXPECT_EQ(b->armed.load(), 1u);
  ASSERT_EQ(cq_poll(b, 64, out), 7) << "the staged two wait for publish";
  for (int i = 0; i < 7; ++i) EXPECT_EQ(out[i].wr_id, static_cast<uint64_t>(4 + i));
  EXPECT_TRUE(p.publish()) << "the armed state came along";
  ASSERT_EQ(cq_poll(b, 64, out), 2);
  EXPECT_EQ(out[1].wr_id, 12u);
  for (uint64_t i = 0; i < b->capacity; ++i) EXPECT_TRUE(p.stage(cqe(100 + i)));
  EXPECT_FALSE(p.stage(cqe(999)));
}

TEST(CqRing, AStagedCompletionCanBeAmendedBeforePublish) {
  Seg s(cq_layout(8).bytes);
  init_cq(s.data(), 8);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  ASSERT_TRUE(p.stage(cqe(1)));
  ASSERT_TRUE(p.stage(cqe(2)));
  p.staged_at(1).status = WcStatus::kRemAccessErr;
  p.publish();
  Cqe out[4];
  ASSERT_EQ(cq_poll(h, 4, out), 2);
  EXPECT_EQ(out[0].status, WcStatus::kSuccess);
  EXPECT_EQ(out[1].status, WcStatus::kRemAccessErr);
}

TEST(CqRing, PollTakesNoMoreThanAskedAndLeavesTheRest) {
  Seg s(cq_layout(8).bytes);
  init_cq(s.data(), 8);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(p.stage(cqe(i)));
  p.publish();
  Cqe out[8];
  ASSERT_EQ(cq_poll(h, 2, out), 2);
  EXPECT_EQ(out[1].wr_id, 1u);
  ASSERT_EQ(cq_poll(h, 8, out), 3);
  EXPECT_EQ(out[0].wr_id, 2u);
  EXPECT_EQ(out[2].wr_id, 4u);
}

TEST(CqRing, OrderIsKeptOverManyWrapArounds) {
  constexpr uint32_t kCqe = 5;  // 8 entries, 7 completions
  Seg s(cq_layout(kCqe).bytes);
  init_cq(s.data(), kCqe);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  ASSERT_EQ(p.capacity(), 7u);
  uint64_t next_in = 0, next_out = 0;
  // Batches of every size up to the capacity, polled in pieces of varying size: the indices go
  // round the 8-entry ring about 250 times.
  for (int round = 0; round < 500; ++round) {
    const uint32_t batch = 1 + static_cast<uint32_t>(round) % p.capacity();
    for (uint32_t i = 0; i < batch; ++i) ASSERT_TRUE(p.stage(cqe(next_in++))) << round;
    p.publish();
    Cqe out[8];
    const int ask = 1 + round % 3;
    int got;
    while ((got = cq_poll(h, ask, out)) > 0)
      for (int i = 0; i < got; ++i) ASSERT_EQ(out[i].wr_id, next_out++);
  }
  EXPECT_EQ(next_out, next_in);
  EXPECT_GT(next_in, 100u * h->entries);
  EXPECT_FALSE(p.overflowed());
}

TEST(CqRing, AFullRingRefusesToStageAndRecordsTheOverflow) {
  Seg s(cq_layout(3).bytes);  // 4 entries, 3 completions
  init_cq(s.data(), 3);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  ASSERT_EQ(p.capacity(), 3u);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(p.stage(cqe(i)));
  EXPECT_FALSE(p.overflowed());
  // Staged but unpublished completions hold their entries too.
  EXPECT_FALSE(p.stage(cqe(99)));
  EXPECT_TRUE(p.overflowed());
  EXPECT_NE(h->overflow.load(), 0u);
  p.publish();
  EXPECT_FALSE(p.stage(cqe(99)));
  Cqe out[4];
  ASSERT_EQ(cq_poll(h, 1, out), 1);
  EXPECT_EQ(out[0].wr_id, 0u);
  // One entry free again: one more fits, and the lost one never shows up.
  EXPECT_TRUE(p.stage(cqe(3)));
  EXPECT_FALSE(p.stage(cqe(99)));
  p.publish();
  ASSERT_EQ(cq_poll(h, 4, out), 3);
  EXPECT_EQ(out[0].wr_id, 1u);
  EXPECT_EQ(out[1].wr_id, 2u);
  EXPECT_EQ(out[2].wr_id, 3u);
  EXPECT_TRUE(p.overflowed()) << "the overflow is sticky";
}

TEST(CqRing, PublishAsksForAnEventOnlyWhenArmedAndDisarms) {
  Seg s(cq_layout(16).bytes);
  init_cq(s.data(), 16);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  ASSERT_TRUE(p.stage(cqe(1)));
  EXPECT_FALSE(p.publish()) << "not armed";

  h->armed.store(1);
  EXPECT_FALSE(p.publish()) << "nothing staged: no event, and the arming stays";
  EXPECT_EQ(h->armed.load(), 1u);
  ASSERT_TRUE(p.stage(cqe(2)));
  EXPECT_TRUE(p.publish());
  EXPECT_EQ(h->armed.load(), 0u) << "an event disarms the CQ";
  ASSERT_TRUE(p.stage(cqe(3)));
  EXPECT_FALSE(p.publish()) << "one event per arming";

  h->armed.store(2);  // solicited only: counts as armed
  ASSERT_TRUE(p.stage(cqe(4)));
  EXPECT_TRUE(p.publish());
  EXPECT_EQ(h->armed.load(), 0u);
  Cqe out[8];
  EXPECT_EQ(cq_poll(h, 8, out), 4);
}

TEST(CqRing, OrphanCompletionsFollowTheEnginesUntilTheRingIsFull) {
  Seg s(cq_layout(3).bytes);  // 3 completions
  init_cq(s.data(), 3);
  auto* h = s.as<CqHeader>();
  {
    CqProducer p(h);
    ASSERT_TRUE(p.stage(cqe(1)));
    p.publish();
  }  // the engine is gone: the driver produces from here on
  Cqe flushed = cqe(2);
  flushed.status = WcStatus::kWrFlushErr;
  EXPECT_TRUE(cq_push_orphan(h, flushed));
  flushed.wr_id = 3;
  EXPECT_TRUE(cq_push_orphan(h, flushed));
  flushed.wr_id = 4;
  EXPECT_FALSE(cq_push_orphan(h, flushed)) << "ring full";
  EXPECT_NE(h->overflow.load(), 0u);
  Cqe out[4];
  ASSERT_EQ(cq_poll(h, 4, out), 3);
  EXPECT_EQ(out[0].wr_id, 1u);
  EXPECT_EQ(out[0].status, WcStatus::kSuccess);
  EXPECT_EQ(out[1].wr_id, 2u);
  EXPECT_EQ(out[1].status, WcStatus::kWrFlushErr);
  EXPECT_EQ(out[2].wr_id, 3u);
  // Polled: room again.
  EXPECT_TRUE(cq_push_orphan(h, flushed));
  ASSERT_EQ(cq_poll(h, 4, out), 1);
  EXPECT_EQ(out[0].wr_id, 4u);
}

// An engine killed within a pass leaves completions staged and never published; the driver
// publishes them (as flushes) and flushes only the work none of them retires.
TEST(CqRing, TheDriverRecoversWhatADeadEngineStagedAndNothingOlder) {
  Seg s(cq_layout(7).bytes);  // 7 completions, 8 slots
  init_cq(s.data(), 7);
  auto* h = s.as<CqHeader>();
  EXPECT_EQ(cq_recover_staged(h), 0u) << "a ring never written holds nothing staged";
  CqProducer p(h);
  // A lap and a half: the slots ahead of head hold completions of the earlier lap.
  for (uint64_t i = 0; i < 12; ++i) {
    ASSERT_TRUE(p.stage(cqe(i)));
    p.publish();
    Cqe out;
    ASSERT_EQ(cq_poll(h, 1, &out), 1);
  }
  EXPECT_EQ(cq_recover_staged(h), 0u) << "the earlier lap's completions are not staged now";
  Cqe sent = cqe(100);
  sent.qp_num = 5;
  sent.queue = CqeQueue::kSend;
  sent.wqe = 41;
  ASSERT_TRUE(p.stage(sent));
  p.publish();
  Cqe failed = cqe(101);
  failed.status = WcStatus::kRemAccessErr;
  ASSERT_TRUE(p.stage(failed));
  Cqe recv = cqe(102);
  recv.opcode = WcOpcode::kRecv;
  recv.imm = 7;
  recv.wc_flags = kWcWithImm;
  ASSERT_TRUE(p.stage(recv));
  // The engine dies here: two staged, one published.
  EXPECT_EQ(cq_recover_staged(h), 2u);
  EXPECT_EQ(cq_recover_staged(h), 0u) << "once";
  Cqe out[4];
  ASSERT_EQ(cq_poll(h, 4, out), 3);
  EXPECT_EQ(out[0].wr_id, 100u);
  EXPECT_EQ(out[0].status, WcStatus::kSuccess) << "published before the engine died";
  EXPECT_EQ(out[1].wr_id, 101u);
  EXPECT_EQ(out[1].status, WcStatus::kRemAccessErr) << "an error announces no data";
  EXPECT_EQ(out[2].wr_id, 102u);
  EXPECT_EQ(out[2].status, WcStatus::kWrFlushErr) << "its data may not be in memory";
  EXPECT_EQ(out[2].opcode, WcOpcode::kRecv);
  EXPECT_EQ(out[2].byte_len, 0u);
  EXPECT_EQ(out[2].wc_flags, 0u);
}

TEST(CqRing, RecoveryStopsAtTheRingsCapacity) {
  Seg s(cq_layout(3).bytes);  // 3 completions, 4 slots
  init_cq(s.data(), 3);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(p.stage(cqe(i)));
  // A forged position one past the capacity is not taken.
  cq_ring(h)[3].seq = 4;
  EXPECT_EQ(cq_recover_staged(h), 3u);
}

TEST(CqRing, ACqMovedByResizeKeepsItsStagedCompletionsRecoverable) {
  Seg a(cq_layout(7).bytes), b(cq_layout(15).bytes);
  init_cq(a.data(), 7);
  init_cq(b.data(), 15);
  CqProducer p(a.as<CqHeader>());
  for (uint64_t i = 0; i < 5; ++i) {
    ASSERT_TRUE(p.stage(cqe(i)));
    if (i < 2) p.publish();
  }
  Cqe out;
  ASSERT_EQ(cq_poll(a.as<CqHeader>(), 1, &out), 1);
  ASSERT_TRUE(p.move_to(b.as<CqHeader>()));
  EXPECT_EQ(cq_recover_staged(b.as<CqHeader>()), 3u);
}

TEST(CqRing, FirstUnreportedSkipsTheEntriesRecoveredCompletionsRetire) {
  std::vector<Cqe> rec(4);
  rec[0].qp_num = 9, rec[0].queue = CqeQueue::kSend, rec[0].wqe = 11;   // staged, done moved
  rec[1].qp_num = 9, rec[1].queue = CqeQueue::kSend, rec[1].wqe = 12;   // staged, done not
  rec[2].qp_num = 9, rec[2].queue = CqeQueue::kRecv, rec[2].wqe = 30;   // the other queue
  rec[3].qp_num = 8, rec[3].queue = CqeQueue::kSend, rec[3].wqe = 15;   // another QP
  EXPECT_EQ(first_unreported(12, 20, 9, CqeQueue::kSend, rec), 13u);
  EXPECT_EQ(first_unreported(13, 20, 9, CqeQueue::kSend, rec), 13u);
  EXPECT_EQ(first_unreported(12, 12, 9, CqeQueue::kSend, rec), 12u) << "nothing posted past it";
  EXPECT_EQ(first_unreported(28, 40, 9, CqeQueue::kRecv, rec), 31u);
  EXPECT_EQ(first_unreported(14, 20, 7, CqeQueue::kSend, rec), 14u);
  // Counters wrap.
  rec[0].wqe = 0xffffffffu;
  EXPECT_EQ(first_unreported(0xfffffffeu, 3, 9, CqeQueue::kSend, rec), 0u);
}

TEST(CqRing, ProducerReadsTheGeometryOnceAndIgnoresAScribbledHeader) {
  Seg s(cq_layout(3).bytes);
  init_cq(s.data(), 3);
  auto* h = s.as<CqHeader>();
  CqProducer p(h);
  // A hostile driver enlarges the ring after the engine formatted it.
  h->entries = 1u << 20;
  h->capacity = (1u << 20) - 1;
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(p.stage(cqe(i)));
  EXPECT_FALSE(p.stage(cqe(3))) << "the engine's own capacity applies";
  EXPECT_EQ(p.capacity(), 3u);
}

TEST(CqRing, ValidCqRejectsWhatDoesNotFitOrIsNotACq) {
  const CqLayout l = cq_layout(64);
  Seg s(l.bytes);
  init_cq(s.data(), 64);
  auto* h = s.as<CqHeader>();
  const size_t need = l.ring_offset + size_t{l.entries} * sizeof(Cqe);
  EXPECT_TRUE(valid_cq(s.data(), l.bytes));
  EXPECT_TRUE(valid_cq(s.data(), need));
  EXPECT_FALSE(valid_cq(s.data(), need - 1));
  EXPECT_FALSE(valid_cq(s.data(), sizeof(CqHeader) - 1));
  EXPECT_FALSE(valid_cq(s.data(), 0));

  auto broken = [&](auto change) {
    init_cq(s.data(), 64);
    change(h);
    return !valid_cq(s.data(), l.bytes);
  };
  EXPECT_TRUE(broken([](CqHeader* x) { x->magic = kQpMagic; }));
  EXPECT_TRUE(broken([](CqHeader* x) { x->version = kAbiVersion + 1; }));
  EXPECT_TRUE(broken([](CqHeader* x) { x->entries = 96; }));  // not a power of two
  EXPECT_TRUE(broken([](CqHeader* x) { x->capacity = x->entries; }));
  EXPECT_TRUE(broken([](CqHeader* x) { x->ring_offset = 0; }));  // over the header
  EXPECT_TRUE(broken([&](CqHeader* x) { x->ring_offset = l.bytes; }));
  EXPECT_TRUE(broken([&](CqHeader* x) { x->ring_offset = l.bytes - sizeof(Cqe); }));
  EXPECT_TRUE(broken([](CqHeader* x) { x->ring_offset = 0xffffffc0; }));
  EXPECT_TRUE(broken([](CqHeader* x) {  // 2^31 entries: their bytes overflow 32 bits
    x->entries = 1u << 31;
    x->capacity = (1u << 31) - 1;
  }));
  EXPECT_FALSE(broken([](CqHeader*) {}));
}

// --- queue pair --------------------------------------------------------------------------------

QpCaps caps(uint32_t send_wr, uint32_t recv_wr, uint32_t send_sge, uint32_t recv_sge,
            uint32_t inline_len) {
  QpCaps c;
  c.max_send_wr = send_wr;
  c.max_recv_wr = recv_wr;
  c.max_send_sge = send_sge;
  c.max_recv_sge = recv_sge;
  c.max_inline = inline_len;
  return c;
}

TEST(QpRing, InitRecordsTheCapsAndStartsInReset) {
  const QpCaps c = caps(5, 3, 2, 4, 100);
  const QpLayout l = qp_layout(c);
  Seg s(l.bytes);
  init_qp(s.data(), 0x123, QpType::kUd, c);
  auto* h = s.as<QpHeader>();
  EXPECT_TRUE(valid_qp(s.data(), s.size()));
  EXPECT_EQ(h->qpn, 0x123u);
  EXPECT_EQ(h->type, QpType::kUd);
  EXPECT_EQ(h->max_send_wr, 5u);
  EXPECT_EQ(h->sq_entries, 8u);
  EXPECT_EQ(h->max_recv_wr, 3u);
  EXPECT_EQ(h->rq_entries, 4u);
  EXPECT_EQ(h->max_send_sge, 2u);
  EXPECT_EQ(h->max_recv_sge, 4u);
  EXPECT_EQ(h->max_inline, 100u);
  EXPECT_EQ(static_cast<QpState>(h->state.load()), QpState::kReset);
  EXPECT_EQ(h->sq_head.load(), 0u);
  EXPECT_EQ(h->sq_done.load(), 0u);
}

TEST(QpRing, SendRingRefusesPastMaxSendWrUntilTheEngineRetires) {
  const QpCaps c = caps(5, 1, 1, 1, 0);  // 5 of 8 entries usable
  Seg s(qp_layout(c).bytes);
  init_qp(s.data(), 7, QpType::kRc, c);
  auto* h = s.as<QpHeader>();
  uint32_t posted = 0;
  for (; posted < 5; ++posted) {
    uint8_t* slot = sq_reserve(h);
    ASSERT_NE(slot, nullptr) << posted;
    EXPECT_EQ(slot, sq_slot(h, posted));
    send_wqe(slot)->wr_id = posted;
    sq_post(h);
  }
  EXPECT_EQ(sq_reserve(h), nullptr) << "max_send_wr WQEs are outstanding";
  EXPECT_EQ(h->sq_head.load(), 5u);
  // The engine retires two: two more fit, not three.
  h->sq_done.store(2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_NE(sq_reserve(h), nullptr);
    sq_post(h);
    ++posted;
  }
  EXPECT_EQ(sq_reserve(h), nullptr);
  // Round and round the ring: the slot of index i is i mod entries, and the limit holds.
  for (int round = 0; round < 100; ++round) {
    h->sq_done.store(h->sq_done.peek() + 3);
    for (int i = 0; i < 3; ++i) {
      uint8_t* slot = sq_reserve(h);
      ASSERT_NE(slot, nullptr);
      EXPECT_EQ(slot, s.data() + h->sq_offset + size_t{posted % h->sq_entries} * h->sq_stride);
      sq_post(h);
      ++posted;
    }
    ASSERT_EQ(sq_reserve(h), nullptr) << round;
  }
  EXPECT_EQ(h->sq_head.load(), posted);
}

TEST(QpRing, ReceiveRingRefusesPastMaxRecvWrUntilTheEngineRetires) {
  const QpCaps c = caps(1, 3, 1, 2, 0);  // 3 of 4 entries usable
  Seg s(qp_layout(c).bytes);
  init_qp(s.data(), 7, QpType::kRc, c);
  auto* h = s.as<QpHeader>();
  for (uint32_t i = 0; i < 3; ++i) {
    uint8_t* slot = rq_reserve(h);
    ASSERT_NE(slot, nullptr);
    EXPECT_EQ(slot, rq_slot(h, i));
    recv_wqe(slot)->wr_id = 100 + i;
    recv_wqe(slot)->num_sge = 2;
    rq_post(h);
  }
  EXPECT_EQ(rq_reserve(h), nullptr);
  EXPECT_EQ(sq_reserve(h), sq_slot(h, 0)) << "the send ring is independent";
  h->rq_done.store(1);
  uint8_t* slot = rq_reserve(h);
  ASSERT_NE(slot, nullptr);
  EXPECT_EQ(slot, s.data() + h->rq_offset + 3 * h->rq_stride);
  rq_post(h);
  EXPECT_EQ(rq_reserve(h), nullptr);
  h->rq_done.store(2);
  slot = rq_reserve(h);
  EXPECT_EQ(slot, s.data() + h->rq_offset) << "index 4 wraps to the first slot";
  recv_wqe(slot)->wr_id = 104;
  rq_post(h);
  EXPECT_EQ(rq_reserve(h), nullptr);
  // What the driver wrote is where the engine reads it.
  EXPECT_EQ(recv_wqe(rq_slot(h, 1))->wr_id, 101u);
  EXPECT_EQ(recv_wqe(rq_slot(h, 2))->wr_id, 102u);
}

TEST(QpRing, SlotsDoNotOverlapAndLieInsideTheSegment) {
  for (const QpCaps& c : {caps(1, 1, 0, 0, 0), caps(5, 3, 1, 1, 0), caps(64, 64, 4, 4, 64),
                          caps(17, 9, kMaxSge, kMaxSge, kMaxInline), caps(100, 1, 3, 0, 13)}) {
    const QpLayout l = qp_layout(c);
    Seg s(l.bytes);
    init_qp(s.data(), 9, QpType::kRc, c);
    auto* h = s.as<QpHeader>();
    ASSERT_TRUE(valid_qp(s.data(), s.size()));
    EXPECT_EQ(l.bytes % kPage, 0u);
    EXPECT_GE(l.sq_offset, sizeof(QpHeader));
    EXPECT_EQ(l.sq_stride % 64, 0u);
    EXPECT_GE(l.sq_stride, sizeof(SendWqe) + sizeof(Sge) * c.max_send_sge + c.max_inline);
    EXPECT_GE(l.rq_stride, sizeof(RecvWqe) + sizeof(Sge) * c.max_recv_sge);
    EXPECT_GE(l.rq_offset, l.sq_offset + l.sq_entries * l.sq_stride);
    EXPECT_LE(l.rq_offset + l.rq_entries * l.rq_stride, l.bytes);
    // The inline payload ends inside its slot.
    EXPECT_LE(send_inline(sq_slot(h, 0), c.max_send_sge) + c.max_inline,
              sq_slot(h, 0) + l.sq_stride);
    // Fill every slot, whole, with its own byte; each must read back intact, the header too.
    uint8_t mark = 1;
    for (uint32_t i = 0; i < l.sq_entries; ++i) std::memset(sq_slot(h, i), mark++, l.sq_stride);
    for (uint32_t i = 0; i < l.rq_entries; ++i) std::memset(rq_slot(h, i), mark++, l.rq_stride);
    mark = 1;
    for (uint32_t i = 0; i < l.sq_entries; ++i, ++mark)
      for (uint32_t b = 0; b < l.sq_stride; ++b) ASSERT_EQ(sq_slot(h, i)[b], mark) << i;
    for (uint32_t i = 0; i < l.rq_entries; ++i, ++mark)
      for (uint32_t b = 0; b < l.rq_stride; ++b) ASSERT_EQ(rq_slot(h, i)[b], mark) << i;
    EXPECT_TRUE(valid_qp(s.data(), s.size())) << "a slot write reached the header";
    EXPECT_EQ(h->qpn, 9u);
  }
}

TEST(QpRing, ValidQpRejectsWhatDoesNotFitOrIsNotAQp) {
  const QpCaps c = caps(8, 8, 2, 2, 32);
  const QpLayout l = qp_layout(c);
  Seg s(l.bytes);
  auto* h = s.as<QpHeader>();
  init_qp(s.data(), 1, QpType::kRc, c);
  const size_t need = l.rq_offset + size_t{l.rq_entries} * l.rq_stride;
  EXPECT_TRUE(valid_qp(s.data(), need));
  EXPECT_FALSE(valid_qp(s.data(), need - 1));
  EXPECT_FALSE(valid_qp(s.data(), sizeof(QpHeader) - 1));

  auto broken = [&](auto change) {
    init_qp(s.data(), 1, QpType::kRc, c);
    change(h);
    return !valid_qp(s.data(), l.bytes);
  };
  EXPECT_TRUE(broken([](QpHeader* x) { x->magic = kCqMagic; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->version = 0; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->sq_entries = 12; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->rq_entries = 0; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->max_send_wr = x->sq_entries + 1; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->max_recv_wr = x->rq_entries + 1; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->max_send_sge = kMaxSge + 1; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->max_inline = kMaxInline + 1; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->sq_stride -= 64; }));  // too small for its SGEs
  EXPECT_TRUE(broken([](QpHeader* x) { x->rq_stride = sizeof(RecvWqe); }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->sq_offset = 0; }));  // over the header
  EXPECT_TRUE(broken([&](QpHeader* x) { x->sq_offset = l.bytes; }));
  EXPECT_TRUE(broken([&](QpHeader* x) { x->rq_offset = l.bytes - x->rq_stride; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->rq_offset = 0xffffffff; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->sq_entries = 1u << 31; }));
  EXPECT_TRUE(broken([](QpHeader* x) { x->rq_offset = 0; }));  // over the header
  EXPECT_TRUE(broken([](QpHeader* x) { x->rq_offset = x->sq_offset; }));  // on the send ring
  EXPECT_TRUE(broken([](QpHeader* x) { x->rq_offset = x->sq_offset + x->sq_stride; }));
  EXPECT_FALSE(broken([](QpHeader*) {}));
}

// --- shared receive queue --------------------------------------------------------------------

TEST(SrqRing, PostTakesEverySlotThenIsENOMEMUntilOneComesBack) {
  constexpr uint32_t kWr = 5;  // index rings of 8
  const SrqLayout l = srq_layout(kWr, 2);
  Seg s(l.bytes);
  init_srq(s.data(), kWr, 2);
  auto* h = s.as<SrqHeader>();
  ASSERT_TRUE(valid_srq(s.data(), s.size()));
  Sge sge[2] = {{0x1000, 64, 7}, {0x2000, 32, 7}};
  std::set<uint32_t> slots;
  for (uint32_t i = 0; i < kWr; ++i) {
    ASSERT_EQ(srq_post(h, 10 + i, sge, 2), 0) << i;
    const uint32_t slot = srq_posted_ring(h)[i];
    EXPECT_LT(slot, kWr);
    slots.insert(slot);
    EXPECT_EQ(recv_wqe(srq_slot(h, slot))->wr_id, 10 + i);
    EXPECT_EQ(recv_wqe(srq_slot(h, slot))->num_sge, 2u);
    EXPECT_EQ(recv_sges(srq_slot(h, slot))[1].addr, 0x2000u);
  }
  EXPECT_EQ(slots.size(), kWr) << "two receives share a slot";
  EXPECT_EQ(srq_post(h, 99, sge, 1), ENOMEM);
  EXPECT_EQ(h->posted_head.load(), kWr);

  // The engine completes the receive in slot 3 and hands the slot back.
  const uint32_t back = srq_posted_ring(h)[3];
  srq_free_ring(h)[h->free_head.peek() & (h->entries - 1)] = back;
  h->free_head.store(h->free_head.peek() + 1);
  ASSERT_EQ(srq_post(h, 50, sge, 1), 0);
  EXPECT_EQ(srq_posted_ring(h)[kWr & (h->entries - 1)], back);
  EXPECT_EQ(recv_wqe(srq_slot(h, back))->wr_id, 50u);
  EXPECT_EQ(srq_post(h, 51, sge, 1), ENOMEM);
}

TEST(SrqRing, ASlotNumberThatDoesNotExistIsEIO) {
  const SrqLayout l = srq_layout(2, 1);
  Seg s(l.bytes);
  init_srq(s.data(), 2, 1);
  auto* h = s.as<SrqHeader>();
  srq_free_ring(h)[0] = 2;  // the engine (or a scribbler) returns slot 2 of 0..1
  Sge sge{0x1000, 8, 1};
  EXPECT_EQ(srq_post(h, 1, &sge, 1), EIO);
  EXPECT_EQ(h->posted_head.load(), 0u) << "nothing was posted";
}

TEST(SrqRing, ValidSrqRejectsWhatDoesNotFitOrIsNotAnSrq) {
  const SrqLayout l = srq_layout(10, 3);
  Seg s(l.bytes);
  auto* h = s.as<SrqHeader>();
  init_srq(s.data(), 10, 3);
  EXPECT_TRUE(valid_srq(s.data(), l.bytes));
  EXPECT_FALSE(valid_srq(s.data(), l.free_offset + l.entries * 4 - 1));
  EXPECT_FALSE(valid_srq(s.data(), sizeof(SrqHeader) - 1));
  auto broken = [&](auto change) {
    init_srq(s.data(), 10, 3);
    change(h);
    return !valid_srq(s.data(), l.bytes);
  };
  EXPECT_TRUE(broken([](SrqHeader* x) { x->magic = kCqMagic; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->version = kAbiVersion + 1; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->entries = 12; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->max_wr = 0; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->max_wr = x->entries + 1; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->max_sge = kMaxSge + 1; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->stride = 16; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->slots_offset = 0; }));
  EXPECT_TRUE(broken([&](SrqHeader* x) { x->slots_offset = l.bytes - x->stride; }));
  EXPECT_TRUE(broken([&](SrqHeader* x) { x->posted_offset = l.bytes; }));
  EXPECT_TRUE(broken([&](SrqHeader* x) { x->free_offset = l.bytes - 4; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->posted_offset = 0; }));  // over the header
  EXPECT_TRUE(broken([](SrqHeader* x) { x->free_offset = 0; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->free_offset = x->posted_offset; }));
  EXPECT_TRUE(broken([](SrqHeader* x) { x->posted_offset = x->slots_offset; }));
  EXPECT_FALSE(broken([](SrqHeader*) {}));
}

// --- control protocol ----------------------------------------------------------------------

// A connected SOCK_SEQPACKET pair: [0] plays the driver, [1] the engine.
class SocketPair {
 public:
  SocketPair() {
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fd_) != 0) fd_[0] = fd_[1] = -1;
  }
  ~SocketPair() {
    for (int fd : fd_)
      if (fd >= 0) close(fd);
  }
  SocketPair(const SocketPair&) = delete;
  SocketPair& operator=(const SocketPair&) = delete;
  int operator[](int i) const { return fd_[i]; }
  void close_end(int i) {
    close(fd_[i]);
    fd_[i] = -1;
  }

 private:
  int fd_[2];
};

// Open descriptors of this process.
int open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Sends raw bytes and descriptors, bypassing send_message's own checks.
ssize_t send_raw(int sock, const void* bytes, size_t len, const std::vector<int>& fds) {
  iovec iov{const_cast<void*>(bytes), len};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()) + sizeof(cmsghdr));
  if (!fds.empty()) {
    mh.msg_control = control.data();
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return sendmsg(sock, &mh, MSG_NOSIGNAL);
}

void set_passcred(int sock) {
  int one = 1;
  ASSERT_EQ(setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)), 0);
}

TEST(Control, RoundTripCarriesHeaderBodyAndWorkingDescriptors) {
  SocketPair sp;
  ASSERT_GE(sp[0], 0);
  int pipefd[2];
  ASSERT_EQ(pipe2(pipefd, O_CLOEXEC), 0);
  const int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ASSERT_GE(efd, 0);

  Message m;
  m.header.op = Op::kCreateCq;
  m.header.seq = 77;
  CreateCqReq req;
  req.cqe = 300;
  req.has_channel = 1;
  req.handle = 0x1122334455667788;
  m.set(req);
  m.fds = {pipefd[1], efd};
  ASSERT_EQ(send_message(sp[0], m), 0);

  Message got;
  ASSERT_EQ(recv_message(sp[1], &got), 0);
  EXPECT_EQ(got.header.magic, kControlMagic);
  EXPECT_EQ(got.header.version, kControlVersion);
  EXPECT_EQ(got.header.op, Op::kCreateCq);
  EXPECT_EQ(got.header.seq, 77u);
  EXPECT_EQ(got.header.status, 0);
  auto body = got.as<CreateCqReq>();
  ASSERT_TRUE(body.has_value());
  EXPECT_EQ(body->cqe, 300u);
  EXPECT_EQ(body->has_channel, 1u);
  EXPECT_EQ(body->handle, 0x1122334455667788u);
  ASSERT_EQ(got.fds.size(), 2u);
  for (int fd : got.fds) {
    EXPECT_NE(fd, pipefd[1]);
    EXPECT_NE(fd, efd);
    EXPECT_TRUE(fcntl(fd, F_GETFD) & FD_CLOEXEC) << "received descriptors are close-on-exec";
  }
  // The pipe end works on this side: what is written through it comes out of the original.
  ASSERT_EQ(write(got.fds[0], "hi", 2), 2);
  char buf[4] = {};
  ASSERT_EQ(read(pipefd[0], buf, sizeof(buf)), 2);
  EXPECT_STREQ(buf, "hi");
  // So does the eventfd: a count added through the copy is read from the original.
  const uint64_t add = 5;
  ASSERT_EQ(write(got.fds[1], &add, sizeof(add)), static_cast<ssize_t>(sizeof(add)));
  uint64_t value = 0;
  ASSERT_EQ(read(efd, &value, sizeof(value)), static_cast<ssize_t>(sizeof(value)));
  EXPECT_EQ(value, 5u);
  close_fds(&got);
  EXPECT_TRUE(got.fds.empty());
  for (int fd : {pipefd[0], pipefd[1], efd}) close(fd);
}

TEST(Control, AnswersTravelBackWithStatusAndNoBody) {
  SocketPair sp;
  Message r;
  r.header.op = Op::kDestroyQp;
  r.header.seq = 3;
  r.header.status = EBUSY;
  ASSERT_EQ(send_message(sp[1], r), 0);
  Message got;
  ASSERT_EQ(recv_message(sp[0], &got), 0);
  EXPECT_EQ(got.header.status, EBUSY);
  EXPECT_EQ(got.header.seq, 3u);
  EXPECT_TRUE(got.body.empty());
  EXPECT_TRUE(got.fds.empty());
}

TEST(Control, CredentialsAreFilledWhenTheReceiverPassesThem) {
  SocketPair sp;
  Message m;
  m.header.op = Op::kAllocPd;
  Message got;
  ASSERT_EQ(send_message(sp[0], m), 0);
  ASSERT_EQ(recv_message(sp[1], &got), 0);
  EXPECT_EQ(got.pid, 0u) << "no SO_PASSCRED: no credentials";

  set_passcred(sp[1]);
  ASSERT_EQ(send_message(sp[0], m), 0);
  ASSERT_EQ(recv_message(sp[1], &got), 0);
  EXPECT_EQ(got.pid, static_cast<uint32_t>(getpid()));
  EXPECT_EQ(got.uid, static_cast<uint32_t>(getuid()));

  // With descriptors too: both control messages are read.
  int pipefd[2];
  ASSERT_EQ(pipe2(pipefd, O_CLOEXEC), 0);
  m.fds = {pipefd[0], pipefd[1], pipefd[0], pipefd[1]};  // kMaxFds
  ASSERT_EQ(send_message(sp[0], m), 0);
  ASSERT_EQ(recv_message(sp[1], &got), 0);
  EXPECT_EQ(got.pid, static_cast<uint32_t>(getpid()));
  EXPECT_EQ(got.fds.size(), kMaxFds);
  close_fds(&got);
  close(pipefd[0]);
  close(pipefd[1]);
}

TEST(Control, BadMagicOrVersionIsEBADMSGAndTheNextMessageStillArrives) {
  SocketPair sp;
  const int before = open_fds();
  int pipefd[2];
  ASSERT_EQ(pipe2(pipefd, O_CLOEXEC), 0);

  Header bad;
  bad.magic = 0x12345678;
  ASSERT_GT(send_raw(sp[0], &bad, sizeof(bad), {pipefd[1]}), 0);
  Header old;
  old.version = kControlVersion + 1;
  ASSERT_GT(send_raw(sp[0], &old, sizeof(old), {pipefd[1]}), 0);
  Message good;
  good.header.seq = 9;
  ASSERT_EQ(send_message(sp[0], good), 0);

  Message got;
  EXPECT_EQ(recv_message(sp[1], &got), EBADMSG);
  EXPECT_TRUE(got.fds.empty());
  EXPECT_EQ(recv_message(sp[1], &got), EBADMSG);
  ASSERT_EQ(recv_message(sp[1], &got), 0);
  EXPECT_EQ(got.header.seq, 9u);
  close(pipefd[0]);
  close(pipefd[1]);
  EXPECT_EQ(open_fds(), before) << "descriptors of rejected messages leaked";
}

TEST(Control, TruncatedOrOversizedMessagesAreEBADMSG) {
  SocketPair sp;
  Message got;
  const uint8_t shorty[sizeof(Header) - 1] = {};
  ASSERT_GT(send_raw(sp[0], shorty, sizeof(shorty), {}), 0);
  EXPECT_EQ(recv_message(sp[1], &got), EBADMSG);

  // A valid header in front of more than kMaxMessage bytes: cut off, so not a message.
  std::vector<uint8_t> big(kMaxMessage + 100);
  Header h;
  std::memcpy(big.data(), &h, sizeof(h));
  ASSERT_GT(send_raw(sp[0], big.data(), big.size(), {}), 0);
  EXPECT_EQ(recv_message(sp[1], &got), EBADMSG);

  // Exactly kMaxMessage is fine.
  Message m;
  m.body.assign(kMaxMessage - sizeof(Header), 0x5a);
  ASSERT_EQ(send_message(sp[0], m), 0);
  ASSERT_EQ(recv_message(sp[1], &got), 0);
  EXPECT_EQ(got.body.size(), kMaxMessage - sizeof(Header));
  EXPECT_EQ(got.body.back(), 0x5a);
}

TEST(Control, SendRefusesWhatTheReceiverWouldReject) {
  SocketPair sp;
  Message m;
  m.body.assign(kMaxMessage - sizeof(Header) + 1, 0);
  EXPECT_EQ(send_message(sp[0], m), EMSGSIZE);
  m.body.clear();
  m.fds.assign(kMaxFds + 1, 0);
  EXPECT_EQ(send_message(sp[0], m), EMSGSIZE);
}

TEST(Control, TooManyDescriptorsIsEBADMSGAndNoneLeak) {
  for (bool passcred : {false, true}) {
    for (size_t count : {kMaxFds + 1, size_t{12}, size_t{20}}) {
      SocketPair sp;
      if (passcred) set_passcred(sp[1]);
      int pipefd[2];
      ASSERT_EQ(pipe2(pipefd, O_CLOEXEC), 0);
      const int before = open_fds();
      Header h;
      h.seq = 1;
      ASSERT_GT(send_raw(sp[0], &h, sizeof(h), std::vector<int>(count, pipefd[1])), 0);
      Message got;
      EXPECT_EQ(recv_message(sp[1], &got), EBADMSG) << count << " fds, passcred " << passcred;
      EXPECT_TRUE(got.fds.empty());
      EXPECT_EQ(open_fds(), before) << count << " fds, passcred " << passcred;
      // Every copy of the write end is closed: once ours is too, the pipe reads end-of-file.
      close(pipefd[1]);
      char c;
      EXPECT_EQ(read(pipefd[0], &c, 1), 0);
      close(pipefd[0]);
    }
  }
}

TEST(Control, PeerClosedIsECONNRESET) {
  SocketPair sp;
  Message m;
  m.header.seq = 1;
  ASSERT_EQ(send_message(sp[0], m), 0);
  sp.close_end(0);
  Message got;
  ASSERT_EQ(recv_message(sp[1], &got), 0) << "what was sent before the close still arrives";
  EXPECT_EQ(recv_message(sp[1], &got), ECONNRESET);
  EXPECT_EQ(recv_message(sp[1], &got), ECONNRESET);
  EXPECT_EQ(send_message(sp[1], m), EPIPE) << "and no SIGPIPE";
}

TEST(Control, AsIsNulloptForABodyOfTheWrongSize) {
  Message m;
  EXPECT_FALSE(m.as<PdResp>().has_value()) << "empty body";
  m.set(IdReq{42, 0});
  ASSERT_TRUE(m.as<IdReq>().has_value());
  EXPECT_EQ(m.as<IdReq>()->id, 42u);
  EXPECT_TRUE(m.as<PdResp>().has_value()) << "same size, same bytes";
  EXPECT_FALSE(m.as<RegMrReq>().has_value());
  EXPECT_FALSE(m.as<HelloReq>().has_value());
  m.body.push_back(0);
  EXPECT_FALSE(m.as<IdReq>().has_value()) << "one byte too many";
  m.body.resize(sizeof(IdReq) - 1);
  EXPECT_FALSE(m.as<IdReq>().has_value()) << "one byte short";
}

TEST(Control, PutNameRejectsNamesThatDoNotFit) {
  char field[kNameLen];
  std::memset(field, 'x', sizeof(field));
  EXPECT_TRUE(put_name(field, "mr0"));
  EXPECT_EQ(get_name(field), "mr0");
  EXPECT_EQ(field[kNameLen - 1], 0) << "the rest of the field is cleared";

  const std::string longest(kNameLen - 1, 'a');
  EXPECT_TRUE(put_name(field, longest));
  EXPECT_EQ(get_name(field), longest);

  EXPECT_FALSE(put_name(field, std::string(kNameLen, 'b')));
  EXPECT_EQ(get_name(field), longest) << "a refused name leaves the field alone";
  EXPECT_FALSE(put_name(field, std::string(1000, 'c')));

  EXPECT_TRUE(put_name(field, ""));
  EXPECT_EQ(get_name(field), "");
  // A field from the other side without a terminator reads as at most kNameLen bytes.
  std::memset(field, 'z', sizeof(field));
  EXPECT_EQ(get_name(field), std::string(kNameLen, 'z'));
}

}  // namespace
}  // namespace metaroce::hostif
