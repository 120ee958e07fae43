// SPDX-License-Identifier: Apache-2.0
// Tag matching's decisions (datapath/nic/tag_matcher.h): tags added, deleted and matched in
// posting order, expected against unexpected messages, messages with no tag, the count that
// stops matching until the application catches up, and the TMH/RVH byte layouts.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <vector>

#include "datapath/nic/tag_matcher.h"

namespace metaroce::nic {
namespace {

using Verdict = TagMatcher::Verdict;

Tmh eager(uint64_t tag) { return Tmh{TmhOp::kEager, 0, tag}; }

uint32_t add(TagMatcher& m, uint64_t tag, uint64_t wr_id, uint64_t mask = ~uint64_t{0}) {
  uint32_t h = 0;
  EXPECT_EQ(m.add(tag, mask, wr_id, hostif::Sge{0x1000 + wr_id, 64, 7}, m.unexpected(), &h), 0);
  return h;
}

TEST(TagMatcherTest, MatchedMessageTakesItsTagsBufferAndTheTagLeavesTheList) {
  TagMatcher m(8);
  add(m, 1, 11);
  add(m, 2, 12);
  TagMatcher::Entry e;
  ASSERT_EQ(m.classify(eager(2), &e), Verdict::kMatched);
  EXPECT_EQ(e.recv_wr_id, 12u);
  EXPECT_EQ(e.sge.addr, 0x1000u + 12);
  EXPECT_EQ(m.posted(), 1u);
  // The same tag again finds nothing: a tag is consumed by one message.
  EXPECT_EQ(m.classify(eager(2), &e), Verdict::kUnexpected);
  EXPECT_EQ(m.unexpected(), 1u);
}

TEST(TagMatcherTest, EarliestPostedMatchingTagWinsUnderTheMask) {
  TagMatcher m(8);
  add(m, 0x10, 1, 0xf0);  // any tag 0x1?
  add(m, 0x15, 2);        // exactly 0x15
  TagMatcher::Entry e;
  ASSERT_EQ(m.classify(eager(0x15), &e), Verdict::kMatched);
  EXPECT_EQ(e.recv_wr_id, 1u);  // posted first, and its mask admits 0x15
  ASSERT_EQ(m.classify(eager(0x15), &e), Verdict::kMatched);
  EXPECT_EQ(e.recv_wr_id, 2u);
  // Bits outside a mask do not matter; bits inside do.
  add(m, 0xff00, 3, 0xff00);
  EXPECT_EQ(m.classify(eager(0xfe42), &e), Verdict::kUnexpected);
}

TEST(TagMatcherTest, DeleteRemovesOnlyALiveTagAndStaleHandlesAreRefused) {
  TagMatcher m(2);
  const uint32_t h1 = add(m, 1, 1);
  EXPECT_EQ(m.remove(h1), 0);
  EXPECT_EQ(m.remove(h1), EINVAL);  // deleted already
  // The slot is reused by the next add: the old handle still names nothing.
  const uint32_t h2 = add(m, 2, 2);
  EXPECT_NE(h1, h2);
  EXPECT_EQ(m.remove(h1), EINVAL);
  TagMatcher::Entry e;
  EXPECT_EQ(m.classify(eager(1), &e), Verdict::kUnexpected);  // a deleted tag never matches
  m.sync(m.unexpected());
  ASSERT_EQ(m.classify(eager(2), &e), Verdict::kMatched);
  EXPECT_EQ(m.remove(h2), EINVAL);  // consumed by its message
  EXPECT_EQ(m.remove(0xdead0001), EINVAL);
}

TEST(TagMatcherTest, AFullListRefusesAnotherTag) {
  TagMatcher m(2);
  add(m, 1, 1);
  add(m, 2, 2);
  uint32_t h = 0;
  EXPECT_EQ(m.add(3, ~0ull, 3, {}, 0, &h), ENOSPC);
  TagMatcher::Entry e;
  ASSERT_EQ(m.classify(eager(1), &e), Verdict::kMatched);
  EXPECT_EQ(m.add(3, ~0ull, 3, {}, 0, &h), 0);  // room again once one is consumed
}

TEST(TagMatcherTest, AfterAnUnexpectedMessageNothingMatchesUntilTheApplicationSyncs) {
  TagMatcher m(8);
  add(m, 1, 1);
  TagMatcher::Entry e;
  ASSERT_EQ(m.classify(eager(9), &e), Verdict::kUnexpected);
  EXPECT_FALSE(m.in_sync());
  // The application may have posted tag 1 for the message it has not seen yet: tag 1 is held
  // back, and the message goes to the unexpected queue too, in order behind the first.
  EXPECT_EQ(m.classify(eager(1), &e), Verdict::kUnexpected);
  EXPECT_EQ(m.unexpected(), 2u);
  m.sync(1);  // caught up with the first only
  EXPECT_FALSE(m.in_sync());
  m.sync(2);
  EXPECT_TRUE(m.in_sync());
  add(m, 5, 5);
  ASSERT_EQ(m.classify(eager(1), &e), Verdict::kMatched);
  EXPECT_EQ(e.recv_wr_id, 1u);
  // A TAG_ADD reports the count too: a stale one puts matching on hold again.
  uint32_t h = 0;
  ASSERT_EQ(m.add(6, ~0ull, 6, {}, 0, &h), 0);
  EXPECT_FALSE(m.in_sync());
  EXPECT_EQ(m.classify(eager(5), &e), Verdict::kUnexpected);
}

TEST(TagMatcherTest, WithoutAPlainReceiveOnlyAMatchIsDecidedAndNothingIsCounted) {
  TagMatcher m(4);
  add(m, 7, 1);
  TagMatcher::Entry e;
  EXPECT_EQ(m.classify(eager(8), &e, false), Verdict::kNoRoom);
  EXPECT_EQ(m.classify(Tmh{TmhOp::kNoTag, 0, 7}, &e, false), Verdict::kNoRoom);
  EXPECT_EQ(m.unexpected(), 0u);
  EXPECT_TRUE(m.in_sync());
  ASSERT_EQ(m.classify(eager(7), &e, false), Verdict::kMatched);  // needs no plain receive
  EXPECT_EQ(e.recv_wr_id, 1u);
}

TEST(TagMatcherTest, NoTagAndFinMessagesBypassMatchingAndAreNotCounted) {
  TagMatcher m(4);
  add(m, 7, 1);
  TagMatcher::Entry e;
  EXPECT_EQ(m.classify(Tmh{TmhOp::kNoTag, 0, 7}, &e), Verdict::kNoTag);
  EXPECT_EQ(m.classify(Tmh{TmhOp::kFin, 0, 7}, &e), Verdict::kNoTag);
  EXPECT_EQ(m.unexpected(), 0u);
  EXPECT_TRUE(m.in_sync());
  EXPECT_EQ(m.posted(), 1u);
  // A rendezvous request is matched like an eager one.
  ASSERT_EQ(m.classify(Tmh{TmhOp::kRndv, 0, 7}, &e), Verdict::kMatched);
  EXPECT_EQ(e.recv_wr_id, 1u);
}

TEST(TagMatcherTest, HeadersReadBigEndianAndUnknownOpcodesOrShortBuffersAreRefused) {
  std::vector<uint8_t> b(kTmhLen + kRvhLen, 0);
  write_tmh(Tmh{TmhOp::kRndv, 0x01020304, 0x1122334455667788}, b);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[4], 0x01);
  EXPECT_EQ(b[8], 0x11);
  EXPECT_EQ(b[15], 0x88);
  const uint8_t rvh[] = {0, 0, 0x7f, 0, 0, 0, 0x10, 0, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 4, 0};
  std::copy(std::begin(rvh), std::end(rvh), b.begin() + kTmhLen);
  auto h = parse_tmh(b);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->op, TmhOp::kRndv);
  EXPECT_EQ(h->app_ctx, 0x01020304u);
  EXPECT_EQ(h->tag, 0x1122334455667788u);
  auto r = parse_rvh(b);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->va, 0x7f0000001000u);
  EXPECT_EQ(r->rkey, 0xaabbccddu);
  EXPECT_EQ(r->len, 1024u);
  EXPECT_FALSE(parse_rvh(std::span(b).first(kTmhLen + kRvhLen - 1)));
  EXPECT_FALSE(parse_tmh(std::span(b).first(kTmhLen - 1)));
  b[0] = 4;  // no such TM opcode
  EXPECT_FALSE(parse_tmh(b));
}

}  // namespace
}  // namespace metaroce::nic
