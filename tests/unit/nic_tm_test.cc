// SPDX-License-Identifier: Apache-2.0
// Tag matching on the NIC core (docs/spec/verbs-mapping.md §19) between two devices on an
// in-memory link with the real transport: tag-list operations and their completions, expected
// eager messages landing without their header, unexpected and untagged ones taking plain
// receives whole, matching held back until the application reports its unexpected count,
// decisions in message order whatever the arrival order, and rendezvous (the receiver READs the
// data, then tells the sender with a FIN).
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "datapath/io/mem_link.h"
#include "datapath/nic/tag_matcher.h"
#include "tests/unit/nic_harness.h"

namespace metaroce::nic {
namespace {

using namespace metaroce::nic::test;
using hostif::TagOp;

constexpr unsigned kAllAccess = kLocalWrite | kRemoteWrite | kRemoteRead | kRemoteAtomic;
constexpr uint32_t kIpA = 0xC6120001, kIpB = 0xC6120002;
constexpr uint32_t kMatchData = hostif::kWcTmMatch | hostif::kWcTmDataValid;

hostif::QpCaps caps(uint32_t depth) {
  hostif::QpCaps c;
  c.max_send_wr = c.max_recv_wr = depth;
  c.max_send_sge = c.max_recv_sge = 2;
  c.max_inline = 64;
  return c;
}

void bring_up(TestQp& qp, uint32_t peer_ip, uint32_t peer_qpn) {
  qp.set_access(kAllAccess);
  qp.set_state(QpState::kInit);
  hostif::QpRemote r;
  r.ip = peer_ip;
  r.qpn = peer_qpn;
  r.max_rd_atomic = 16;
  r.rnr_retry = 7;
  qp.set_remote(r);
  qp.set_state(QpState::kRtr);
  qp.set_state(QpState::kRts);
}

struct Ctx {
  TestOwner owner;
  uint32_t pd = 0, key = 0, rkey = 0;
  std::unique_ptr<TestCq> cq;
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 16);
  void open(Nic& nic) {
    ASSERT_EQ(nic.alloc_pd(&owner, &pd), 0);
    cq = std::make_unique<TestCq>(nic, &owner, 256);
    ASSERT_EQ(cq->err, 0);
    ASSERT_EQ(nic.reg_mr(&owner, pd, reinterpret_cast<uint64_t>(buf.data()), buf.size(),
                         kAllAccess, &key, &rkey), 0);
  }
  Sge sge(size_t off, uint32_t len) {
    return Sge{reinterpret_cast<uint64_t>(buf.data() + off), len, key};
  }
};

class NicTmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io::MemLinkConfig lc;
    lc.queue_frames = 1024;
    auto [pa, pb] = io::make_mem_link(lc);
    std::vector<std::unique_ptr<io::Port>> va, vb;
    va.push_back(std::move(pa));
    vb.push_back(std::move(pb));
    a_ = std::make_unique<Device>(test_link("a", kIpA), std::move(va), 1);
    b_ = std::make_unique<Device>(test_link("b", kIpB), std::move(vb), 2);
    cli_.open(*a_->nic);
    srv_.open(*b_->nic);
    srq_ = std::make_unique<TestSrq>(*b_->nic, &srv_.owner, srv_.pd,
                                     TestSrq::Tm{srv_.cq->id, 8}, 16, 1);
    ASSERT_EQ(srq_->err, 0);
    tx_ = std::make_unique<TestQp>(*a_->nic, &cli_.owner, cli_.pd, *cli_.cq, *cli_.cq, caps(64));
    rx_ = std::make_unique<TestQp>(*b_->nic, &srv_.owner, srv_.pd, *srv_.cq, *srv_.cq, caps(4),
                                   hostif::QpType::kRc, srq_.get());
    ASSERT_EQ(tx_->err, 0);
    ASSERT_EQ(rx_->err, 0);
    bring_up(*tx_, kIpB, rx_->qpn());
    bring_up(*rx_, kIpA, tx_->qpn());
  }

  void step() {
    clock_ += std::chrono::microseconds(10);
    a_->progress(clock_);
    b_->progress(clock_);
  }
  std::vector<Cqe> run_until(TestCq& cq, size_t want, int max_rounds = 20000) {
    std::vector<Cqe> got;
    for (int i = 0; i < max_rounds && got.size() < want; ++i) {
      step();
      Cqe c[8];
      const int n = cq.poll(8, c);
      got.insert(got.end(), c, c + n);
    }
    return got;
  }
  // IBV_WR_TAG_ADD of a buffer at srv_.buf[off, off + len); returns the handle.
  uint32_t add_tag(uint64_t tag, uint64_t wr_id, size_t off, uint32_t len, bool signaled = false,
                   uint32_t unexpected = 0) {
    hostif::SrqTagOpReq r;
    r.srq = srq_->id;
    r.op = TagOp::kAdd;
    r.signaled = signaled;
    r.unexpected_cnt = unexpected;
    r.num_sge = 1;
    r.sge = srv_.sge(off, len);
    r.wr_id = wr_id;
    r.recv_wr_id = wr_id;
    r.tag = tag;
    r.mask = ~uint64_t{0};
    uint32_t h = 0;
    EXPECT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), 0);
    return h;
  }
  int tag_op(TagOp op, uint64_t wr_id, uint32_t handle_or_count, bool signaled = true) {
    hostif::SrqTagOpReq r;
    r.srq = srq_->id;
    r.op = op;
    r.signaled = signaled;
    r.wr_id = wr_id;
    r.handle = handle_or_count;
    r.unexpected_cnt = handle_or_count;
    uint32_t h = 0;
    return b_->nic->srq_tag_op(&srv_.owner, r, &h);
  }
  void post_plain(uint64_t wr_id, size_t off, uint32_t len) {
    RecvWqe r;
    r.wr_id = wr_id;
    r.num_sge = 1;
    r.sge[0] = srv_.sge(off, len);
    ASSERT_EQ(srq_->post_recv(r), 0);
  }
  // A tagged SEND of len bytes from cli_.buf[off]: its TMH is written at off, the rest is a
  // pattern of seed.
  void send_tagged(TmhOp op, uint64_t tag, size_t off, uint32_t len, uint8_t seed,
                   uint32_t app_ctx = 0) {
    for (uint32_t i = kTmhLen; i < len; ++i) cli_.buf[off + i] = static_cast<uint8_t>(seed + i * 3);
    write_tmh(Tmh{op, app_ctx, tag}, std::span(cli_.buf).subspan(off, kTmhLen));
    SendWqe w;
    w.wr_id = tag;
    w.op = WqeOp::kSend;
    w.signaled = true;
    w.num_sge = 1;
    w.sge[0] = cli_.sge(off, len);
    ASSERT_EQ(tx_->post_send(w), 0);
  }

  transport::Time clock_{std::chrono::seconds(1)};
  std::unique_ptr<Device> a_, b_;
  Ctx cli_, srv_;
  std::unique_ptr<TestSrq> srq_;
  std::unique_ptr<TestQp> tx_, rx_;
};

TEST_F(NicTmTest, ListOperationsCompleteInTheSrqsCqAndAConsumedTagCannotBeDeleted) {
  const uint32_t h1 = add_tag(1, 10, 0, 256, true);
  const uint32_t h2 = add_tag(2, 11, 256, 256, false);  // unsignaled: no completion
  EXPECT_EQ(tag_op(TagOp::kDel, 12, h1), 0);
  EXPECT_EQ(tag_op(TagOp::kDel, 13, h1, false), 0);  // gone: fails, and says so unsignaled too
  EXPECT_EQ(tag_op(TagOp::kSync, 14, 0), 0);
  Cqe c[8];
  ASSERT_EQ(srv_.cq->poll(8, c), 4);
  EXPECT_EQ(c[0].opcode, WcOpcode::kTmAdd);
  EXPECT_EQ(c[0].wr_id, 10u);
  EXPECT_EQ(c[0].wc_flags, 0u);
  EXPECT_EQ(c[1].opcode, WcOpcode::kTmDel);
  EXPECT_EQ(c[1].status, WcStatus::kSuccess);
  EXPECT_EQ(c[2].opcode, WcOpcode::kTmDel);
  EXPECT_EQ(c[2].wr_id, 13u);
  EXPECT_EQ(c[2].status, WcStatus::kTmErr);
  EXPECT_EQ(c[3].opcode, WcOpcode::kTmSync);
  // The tag that is left matches; deleting it afterwards fails.
  send_tagged(TmhOp::kEager, 2, 0, 100, 1);
  auto got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 11u);
  EXPECT_EQ(tag_op(TagOp::kDel, 15, h2), 0);
  ASSERT_EQ(srv_.cq->poll(8, c), 1);
  EXPECT_EQ(c[0].status, WcStatus::kTmErr);
}

TEST_F(NicTmTest, BadOperationsAreRefusedAtPostingAndChangeNothing) {
  hostif::SrqTagOpReq r;
  r.srq = srq_->id;
  r.num_sge = 1;
  r.sge = Sge{0x1000, 64, srv_.key};  // not inside the region
  uint32_t h = 0;
  EXPECT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), EINVAL);
  r.sge = srv_.sge(0, 64);
  r.num_sge = 2;
  EXPECT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), EINVAL);
  r.num_sge = 1;
  r.op = static_cast<TagOp>(9);
  EXPECT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), EINVAL);
  r.op = TagOp::kAdd;
  TestOwner stranger;
  EXPECT_EQ(b_->nic->srq_tag_op(&stranger, r, &h), EINVAL);  // not its SRQ
  TestSrq plain(*b_->nic, &srv_.owner, srv_.pd, 4, 1);
  r.srq = plain.id;
  EXPECT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), EINVAL);  // not a TM SRQ
  r.srq = srq_->id;
  for (int i = 0; i < 8; ++i) ASSERT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), 0);
  EXPECT_EQ(b_->nic->srq_tag_op(&srv_.owner, r, &h), ENOMEM);  // the list holds 8
  Cqe c[4];
  EXPECT_EQ(srv_.cq->poll(4, c), 0);  // unsignaled adds, refused ones: no completions
  // A TM SRQ needs a CQ of its owner and a list.
  TestSrq no_cq(*b_->nic, &srv_.owner, srv_.pd, TestSrq::Tm{999, 8}, 4, 1);
  EXPECT_EQ(no_cq.err, EINVAL);
  TestSrq no_list(*b_->nic, &srv_.owner, srv_.pd, TestSrq::Tm{srv_.cq->id, 0}, 4, 1);
  EXPECT_EQ(no_list.err, EINVAL);
}

TEST_F(NicTmTest, ExpectedEagerMessagesLandWithoutTheirHeaderInTheirTagsBuffer) {
  add_tag(7, 70, 0, 4096);
  add_tag(8, 80, 8192, 4096);
  post_plain(1, 32768, 4096);
  // Tag 8 first, over several packets; then tag 7, one packet.
  send_tagged(TmhOp::kEager, 8, 0, 3000, 5, 0xabcd);
  send_tagged(TmhOp::kEager, 7, 4096, 200, 9, 0x1234);
  auto sc = run_until(*cli_.cq, 2);
  ASSERT_EQ(sc.size(), 2u);
  auto got = run_until(*srv_.cq, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].wr_id, 80u);
  EXPECT_EQ(got[0].opcode, WcOpcode::kTmRecv);
  EXPECT_EQ(got[0].status, WcStatus::kSuccess);
  EXPECT_EQ(got[0].wc_flags, kMatchData);
  EXPECT_EQ(got[0].tag, 8u);
  EXPECT_EQ(got[0].imm, 0xabcdu);  // the TMH's context
  EXPECT_EQ(got[0].byte_len, 3000u - kTmhLen);
  EXPECT_EQ(got[1].wr_id, 70u);
  EXPECT_EQ(got[1].tag, 7u);
  EXPECT_EQ(got[1].byte_len, 200u - kTmhLen);
  EXPECT_EQ(std::memcmp(srv_.buf.data() + 8192, cli_.buf.data() + kTmhLen, 3000 - kTmhLen), 0);
  EXPECT_EQ(std::memcmp(srv_.buf.data(), cli_.buf.data() + 4096 + kTmhLen, 200 - kTmhLen), 0);
  EXPECT_EQ(srv_.buf[8192 + 3000 - kTmhLen], 0);  // nothing past the payload
  EXPECT_EQ(srq_->posted(), 1u);                  // the plain receive is untouched
}

TEST_F(NicTmTest, UnexpectedMessagesTakePlainReceivesWholeAndHoldMatchingUntilTheCountIsReported) {
  add_tag(5, 50, 0, 1024);
  post_plain(1, 16384, 1024);
  post_plain(2, 20480, 1024);
  post_plain(3, 24576, 1024);
  send_tagged(TmhOp::kEager, 9, 0, 300, 1);  // no such tag
  send_tagged(TmhOp::kEager, 5, 1024, 300, 2);  // tag 5 is posted, but the list is behind
  auto got = run_until(*srv_.cq, 2);
  ASSERT_EQ(got.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(got[i].opcode, WcOpcode::kTmRecv);
    EXPECT_EQ(got[i].wc_flags, 0u);
    EXPECT_EQ(got[i].byte_len, 300u);  // headers included
    EXPECT_EQ(got[i].wr_id, uint64_t(i + 1));
  }
  EXPECT_EQ(std::memcmp(srv_.buf.data() + 16384, cli_.buf.data(), 300), 0);
  EXPECT_EQ(std::memcmp(srv_.buf.data() + 20480, cli_.buf.data() + 1024, 300), 0);
  // A TAG_ADD now reports the stale count: its completion asks for a sync.
  add_tag(6, 60, 2048, 1024, true, 1);
  Cqe c[4];
  ASSERT_EQ(srv_.cq->poll(4, c), 1);
  EXPECT_EQ(c[0].wc_flags, hostif::kWcTmSyncReq);
  EXPECT_EQ(tag_op(TagOp::kSync, 99, 2), 0);
  ASSERT_EQ(srv_.cq->poll(4, c), 1);
  EXPECT_EQ(c[0].opcode, WcOpcode::kTmSync);
  EXPECT_EQ(c[0].wc_flags, 0u);
  send_tagged(TmhOp::kEager, 5, 2048, 300, 3);
  got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 50u);
  EXPECT_EQ(got[0].wc_flags, kMatchData);
  EXPECT_EQ(srq_->posted(), 1u);
}

TEST_F(NicTmTest, UntaggedMessagesTakePlainReceivesAndAreNotCountedAsUnexpected) {
  add_tag(5, 50, 0, 1024);
  post_plain(1, 16384, 1024);
  send_tagged(TmhOp::kNoTag, 5, 0, 64, 1);
  auto got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].opcode, WcOpcode::kTmNoTag);
  EXPECT_EQ(got[0].wr_id, 1u);
  EXPECT_EQ(got[0].wc_flags, 0u);
  EXPECT_EQ(got[0].byte_len, 64u);
  EXPECT_EQ(std::memcmp(srv_.buf.data() + 16384, cli_.buf.data(), 64), 0);
  // Not counted: tag 5 still matches without a sync.
  send_tagged(TmhOp::kEager, 5, 1024, 64, 2);
  got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 50u);
  EXPECT_EQ(got[0].wc_flags, kMatchData);
}

TEST_F(NicTmTest, AMessageWithNoPlainReceiveWaitsWithoutBeingCounted) {
  // Unexpected, and nothing posted for it: RNR until a plain receive comes.
  send_tagged(TmhOp::kEager, 3, 0, 64, 1);
  auto got = run_until(*srv_.cq, 1, 200);
  EXPECT_TRUE(got.empty());
  post_plain(1, 16384, 1024);
  got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 1u);
  EXPECT_EQ(got[0].opcode, WcOpcode::kTmRecv);
  // Exactly one unexpected message: a sync of 1 puts the list back in step.
  add_tag(4, 40, 0, 64, false, 1);
  send_tagged(TmhOp::kEager, 4, 64, 64, 2);
  got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 40u);
}

TEST_F(NicTmTest, MessagesAreDecidedInMessageOrderWhateverTheArrivalOrder) {
  // Two tags that both take tag 1: the earlier message must get the earlier tag, even when the
  // later message's packet arrives first (it is refused with RNR and comes back).
  add_tag(1, 100, 0, 64);
  add_tag(1, 200, 64, 64);
  QueuePair& qp = *b_->nic->find_qp(rx_->qpn());
  uint8_t bytes[2][32] = {};
  auto seg_of = [&](uint32_t msn, uint8_t fill) {
    write_tmh(Tmh{TmhOp::kEager, 0, 1}, std::span(bytes[msn], kTmhLen));
    std::memset(bytes[msn] + kTmhLen, fill, 16);
    transport::Segment seg;
    seg.peer_ip = kIpA;
    seg.op = transport::Op::kSend;
    seg.dst_stream = rx_->qpn();
    seg.src_stream = tx_->qpn();
    seg.msn = msn;
    seg.rsn = msn;
    seg.total_length = 32;
    seg.payload = {bytes[msn], 32};
    return seg;
  };
  EXPECT_EQ(qp.deliver(seg_of(1, 0xbb)), transport::Syndrome::kRnr);
  EXPECT_EQ(qp.deliver(seg_of(0, 0xaa)), transport::Syndrome::kOk);
  EXPECT_EQ(qp.deliver(seg_of(1, 0xbb)), transport::Syndrome::kOk);
  b_->nic->end_rx(clock_);
  Cqe c[4];
  ASSERT_EQ(srv_.cq->poll(4, c), 2);
  EXPECT_EQ(c[0].wr_id, 100u);
  EXPECT_EQ(c[1].wr_id, 200u);
  EXPECT_EQ(srv_.buf[0], 0xaa);
  EXPECT_EQ(srv_.buf[64], 0xbb);
}

// The rendezvous request: TMH (kRndv) and RVH naming len bytes at cli_.buf[data_off].
void write_rndv(Ctx& cli, size_t off, uint64_t tag, size_t data_off, uint32_t len, uint32_t rkey) {
  std::span<uint8_t> b(cli.buf.data() + off, kTmhLen + kRvhLen);
  write_tmh(Tmh{TmhOp::kRndv, 0, tag}, b);
  const uint64_t va = reinterpret_cast<uint64_t>(cli.buf.data() + data_off);
  for (int i = 0; i < 8; ++i) b[kTmhLen + i] = static_cast<uint8_t>(va >> (56 - 8 * i));
  for (int i = 0; i < 4; ++i) b[kTmhLen + 8 + i] = static_cast<uint8_t>(rkey >> (24 - 8 * i));
  for (int i = 0; i < 4; ++i) b[kTmhLen + 12 + i] = static_cast<uint8_t>(len >> (24 - 8 * i));
}

TEST_F(NicTmTest, RendezvousReadsTheSendersDataIntoTheTagThenSendsTheSenderAFin) {
  add_tag(0x77, 700, 4096, 8192);
  for (uint32_t i = 0; i < 5000; ++i) cli_.buf[16384 + i] = static_cast<uint8_t>(i * 13 + 7);
  write_rndv(cli_, 0, 0x77, 16384, 5000, cli_.rkey);
  RecvWqe fin_rx;  // the FIN takes one of the sender's receives
  fin_rx.wr_id = 9;
  fin_rx.num_sge = 1;
  fin_rx.sge[0] = cli_.sge(32768, 64);
  ASSERT_EQ(tx_->post_recv(fin_rx), 0);
  SendWqe w;
  w.wr_id = 1;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = cli_.sge(0, 64);
  ASSERT_EQ(tx_->post_send(w), 0);
  auto got = run_until(*srv_.cq, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].wr_id, 700u);
  EXPECT_EQ(got[0].opcode, WcOpcode::kTmRecv);
  EXPECT_EQ(got[0].wc_flags, hostif::kWcTmMatch);  // matched; the data is not there yet
  EXPECT_EQ(got[0].tag, 0x77u);
  EXPECT_EQ(got[1].wr_id, 700u);
  EXPECT_EQ(got[1].status, WcStatus::kSuccess);
  EXPECT_EQ(got[1].wc_flags, hostif::kWcTmDataValid);
  EXPECT_EQ(got[1].byte_len, 5000u);
  EXPECT_EQ(std::memcmp(srv_.buf.data() + 4096, cli_.buf.data() + 16384, 5000), 0);
  auto cc = run_until(*cli_.cq, 2);
  ASSERT_EQ(cc.size(), 2u);
  const Cqe& fin = cc[0].opcode == WcOpcode::kRecv ? cc[0] : cc[1];
  EXPECT_EQ(fin.opcode, WcOpcode::kRecv);
  EXPECT_EQ(fin.wr_id, 9u);
  EXPECT_EQ(fin.byte_len, kTmhLen);
  auto h = parse_tmh(std::span(cli_.buf).subspan(32768, kTmhLen));
  ASSERT_TRUE(h);
  EXPECT_EQ(h->op, TmhOp::kFin);
  EXPECT_EQ(h->tag, 0x77u);
  // The receiver's own READ, after the two messages it sent on its own, still finds its WQE.
  SendWqe rd;
  rd.wr_id = 2;
  rd.op = WqeOp::kRead;
  rd.signaled = true;
  rd.num_sge = 1;
  rd.sge[0] = srv_.sge(0, 128);
  rd.remote_addr = reinterpret_cast<uint64_t>(cli_.buf.data() + 16384 + 128);
  rd.rkey = cli_.rkey;
  ASSERT_EQ(rx_->post_send(rd), 0);
  got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 2u);
  EXPECT_EQ(got[0].opcode, WcOpcode::kRdmaRead);
  EXPECT_EQ(got[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(srv_.buf.data(), cli_.buf.data() + 16384 + 128, 128), 0);
}

TEST_F(NicTmTest, ARendezvousWhoseReadIsRefusedFailsItsTagAndTheQp) {
  add_tag(0x42, 420, 0, 8192);
  write_rndv(cli_, 0, 0x42, 16384, 1000, cli_.rkey ^ 0x5a5a00);  // a key that names nothing
  SendWqe w;
  w.wr_id = 1;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = cli_.sge(0, 64);
  ASSERT_EQ(tx_->post_send(w), 0);
  auto got = run_until(*srv_.cq, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].wc_flags, hostif::kWcTmMatch);
  EXPECT_EQ(got[1].wr_id, 420u);
  EXPECT_EQ(got[1].opcode, WcOpcode::kTmRecv);
  EXPECT_EQ(got[1].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(got[1].wc_flags, 0u);
  EXPECT_EQ(rx_->state(), QpState::kErr);
}

TEST_F(NicTmTest, ARendezvousWhoseSenderVanishesFailsItsTagAfterTheQpsTimeout) {
  hostif::QpRemote r = b_->nic->find_qp(rx_->qpn())->remote();
  r.timeout = 8;  // about 1 ms
  r.retry_cnt = 1;
  rx_->set_remote(r);
  add_tag(0x42, 420, 0, 8192);
  write_rndv(cli_, 0, 0x42, 16384, 1000, cli_.rkey);
  SendWqe w;
  w.wr_id = 1;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = cli_.sge(0, 64);
  ASSERT_EQ(tx_->post_send(w), 0);
  auto got = run_until(*srv_.cq, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wc_flags, hostif::kWcTmMatch);
  // The sender's QP goes before the READ reaches it: the READ is never answered.
  ASSERT_EQ(a_->nic->destroy_qp(&cli_.owner, tx_->qpn()), 0);
  got = run_until(*srv_.cq, 1, 100000);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 420u);
  EXPECT_EQ(got[0].opcode, WcOpcode::kTmRecv);
  EXPECT_EQ(got[0].status, WcStatus::kRetryExcErr);
  EXPECT_EQ(rx_->state(), QpState::kErr);
}

TEST_F(NicTmTest, ARendezvousLargerThanItsTagsBufferIsNotRead) {
  add_tag(0x42, 420, 0, 100);
  write_rndv(cli_, 0, 0x42, 16384, 1000, cli_.rkey);
  SendWqe w;
  w.wr_id = 1;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = cli_.sge(0, 64);
  ASSERT_EQ(tx_->post_send(w), 0);
  auto got = run_until(*srv_.cq, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].status, WcStatus::kLocLenErr);
  EXPECT_EQ(srv_.buf[0], 0);
  EXPECT_EQ(rx_->state(), QpState::kRts);  // the QP goes on
}

}  // namespace
}  // namespace metaroce::nic
