// SPDX-License-Identifier: Apache-2.0
// The NIC core over an in-memory link with the real transport: two devices driven by hand on a
// virtual clock, through the same shared rings a provider uses (nic_harness.h); verbs semantics
// checked at the queue interface, and what the engine adds: batched memory access, completions
// after data, memory that fails, owners kept apart and reclaimed.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <span>
#include <vector>

#include "datapath/io/mem_link.h"
#include "datapath/nic/mr_table.h"
#include "datapath/wire/bytes.h"
#include "datapath/wire/frame.h"
#include "tests/unit/nic_harness.h"

namespace metaroce::nic {
namespace {

using namespace metaroce::nic::test;
using hostif::AsyncEvent;
using wire::load_be32;
using wire::store_be16;
using wire::store_be32;

constexpr unsigned kAllAccess = kLocalWrite | kRemoteWrite | kRemoteRead | kRemoteAtomic | kMwBind;
constexpr uint32_t kIpA = 0xC6120001, kIpB = 0xC6120002;

struct Side {
  std::unique_ptr<Device> dev;
  TestOwner owner;
  uint32_t pd = 0;
  std::unique_ptr<TestCq> cq;
  std::unique_ptr<TestQp> qp;
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 20);
  uint32_t key = 0;
  explicit Side(Memory* mem = nullptr) : owner(mem) {}
};

// Links of a few hundred frames: what two NICs with 4 paths of 64 packets need, and little
// memory for the many devices the tests make (meson's MALLOC_PERTURB_ touches all of it).
io::MemLinkConfig test_link_config() {
  io::MemLinkConfig c;
  c.queue_frames = 1024;
  return c;
}

hostif::QpCaps caps(uint32_t depth, uint32_t sge = 4, uint32_t inline_len = 64) {
  hostif::QpCaps c;
  c.max_send_wr = c.max_recv_wr = depth;
  c.max_send_sge = c.max_recv_sge = sge;
  c.max_inline = inline_len;
  return c;
}

// RESET -> INIT -> RTR (-> RTS) towards peer_qpn at peer_ip.
void bring_up(TestQp& qp, uint32_t peer_ip, uint32_t peer_qpn, uint32_t qkey = 0,
              QpState until = QpState::kRts, uint8_t max_rd_atomic = 16) {
  qp.set_access(kAllAccess);
  qp.set_state(QpState::kInit);
  hostif::QpRemote r;
  r.ip = peer_ip;
  r.qpn = peer_qpn;
  r.qkey = qkey;
  r.max_rd_atomic = max_rd_atomic;
  qp.set_remote(r);
  qp.set_state(QpState::kRtr);
  if (until == QpState::kRts) qp.set_state(QpState::kRts);
}

class NicTest : public ::testing::Test {
 protected:
  void SetUp() override { build(test_link_config()); }

  void build(const io::MemLinkConfig& lc) {
    for (Side* s : {&a_, &b_}) {
      s->qp.reset();
      s->cq.reset();
    }
    auto [pa, pb] = io::make_mem_link(lc);
    std::vector<std::unique_ptr<io::Port>> va, vb;
    va.push_back(std::move(pa));
    vb.push_back(std::move(pb));
    a_.dev = std::make_unique<Device>(test_link("a", kIpA), std::move(va), 1);
    b_.dev = std::make_unique<Device>(test_link("b", kIpB), std::move(vb), 2);
    for (Side* s : {&a_, &b_}) {
      Nic& nic = *s->dev->nic;
      ASSERT_EQ(nic.alloc_pd(&s->owner, &s->pd), 0);
      s->cq = std::make_unique<TestCq>(nic, &s->owner, 256);
      ASSERT_EQ(s->cq->err, 0);
      s->qp = std::make_unique<TestQp>(nic, &s->owner, s->pd, *s->cq, *s->cq, caps(sq_depth_));
      ASSERT_EQ(s->qp->err, 0);
      uint32_t rkey;
      ASSERT_EQ(nic.reg_mr(&s->owner, s->pd, reinterpret_cast<uint64_t>(s->buf.data()),
                           s->buf.size(), kAllAccess, &s->key, &rkey), 0);
    }
    connect(a_, b_, kIpB);
    connect(b_, a_, kIpA);
  }

  static void connect(Side& s, Side& peer, uint32_t peer_ip, uint8_t max_rd_atomic = 16) {
    bring_up(*s.qp, peer_ip, peer.qp->qpn(), 0, QpState::kRts, max_rd_atomic);
  }

  // Connects s's QP (in RESET) to QP peer_qpn at peer_ip.
  static void connect_to(Side& s, uint32_t peer_qpn, uint32_t peer_ip) {
    bring_up(*s.qp, peer_ip, peer_qpn);
  }

  void step() {
    clock_ += std::chrono::microseconds(10);
    a_.dev->progress(clock_);
    b_.dev->progress(clock_);
  }

  // Runs both devices until `want` completions arrived at `side` (or gives up).
  std::vector<Cqe> run_until(Side& side, size_t want, int max_rounds = 20000) {
    return run_until(*side.cq, want, max_rounds);
  }
  std::vector<Cqe> run_until(TestCq& cq, size_t want, int max_rounds = 20000) {
    std::vector<Cqe> got;
    for (int i = 0; i < max_rounds && got.size() < want; ++i) {
      step();
      Cqe c[8];
      int n = cq.poll(8, c);
      got.insert(got.end(), c, c + n);
    }
    return got;
  }

  Sge sge(Side& s, size_t off, uint32_t len) {
    return Sge{reinterpret_cast<uint64_t>(s.buf.data() + off), len, s.key};
  }
  // A signaled WQE of one SGE (and, for RDMA, its remote address and key).
  static SendWqe wqe(uint64_t wr_id, WqeOp op, const Sge& g, uint64_t raddr = 0,
                     uint32_t rkey = 0) {
    SendWqe w;
    w.wr_id = wr_id;
    w.op = op;
    w.signaled = true;
    w.num_sge = 1;
    w.sge[0] = g;
    w.remote_addr = raddr;
    w.rkey = rkey;
    return w;
  }
  Nic& nic(Side& s) { return *s.dev->nic; }
  // A whole message from a_'s QP to b_'s, as b_'s transport hands it to the NIC; RDMA ones
  // address b_'s buffer at byte `at`.
  transport::Segment a_to_b(transport::Op op, uint32_t msn, std::span<const uint8_t> payload,
                            size_t at = 0) {
    transport::Segment s;
    s.peer_ip = kIpA;
    s.op = op;
    s.dst_stream = b_.qp->qpn();
    s.src_stream = a_.qp->qpn();
    s.msn = msn;
    s.total_length = static_cast<uint32_t>(payload.size());
    s.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + at);
    s.rkey = b_.key;
    s.payload = payload;
    return s;
  }
  QueuePair& core_qp(Side& s, const TestQp& q) { return *nic(s).find_qp(q.qpn()); }
  // From now on s's NIC reaches s's memory through m: its buffer registered again (a region
  // keeps the memory it was registered with), s.key the new key.
  void reach_by(Side& s, Memory* m) {
    s.owner.use(m);
    ASSERT_EQ(nic(s).dereg_mr(&s.owner, s.key), 0);
    uint32_t rkey;
    ASSERT_EQ(nic(s).reg_mr(&s.owner, s.pd, reinterpret_cast<uint64_t>(s.buf.data()),
                           s.buf.size(), kAllAccess, &s.key, &rkey), 0);
    ASSERT_EQ(rkey, s.key);
  }

  transport::Time clock_{std::chrono::seconds(1)};
  uint32_t sq_depth_ = 64;
  Side a_, b_;
};

TEST_F(NicTest, WriteLandsByteExactAndCompletesSignaled) {
  for (size_t i = 0; i < 100000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 13);
  SendWqe w;
  w.wr_id = 42;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 100000);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + 500);
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(c[0].wr_id, 42u);
  EXPECT_EQ(c[0].opcode, WcOpcode::kRdmaWrite);
  EXPECT_EQ(std::memcmp(a_.buf.data(), b_.buf.data() + 500, 100000), 0);
  EXPECT_EQ(b_.buf[499], 0);
  EXPECT_EQ(b_.buf[100500], 0);
}

TEST_F(NicTest, SendScattersIntoPostedReceiveAndCompletesInOrder) {
  RecvWqe r;
  r.wr_id = 7;
  r.num_sge = 2;
  r.sge[0] = sge(b_, 0, 3000);
  r.sge[1] = sge(b_, 10000, 5000);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  RecvWqe r2;
  r2.wr_id = 8;
  ASSERT_EQ(b_.qp->post_recv(r2), 0);
  for (size_t i = 0; i < 6000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 7 + 1);
  SendWqe s;
  s.wr_id = 1;
  s.op = WqeOp::kSend;
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 6000);
  ASSERT_EQ(a_.qp->post_send(s), 0);
  SendWqe s2;
  s2.wr_id = 2;
  s2.op = WqeOp::kSendImm;
  s2.imm = htonl(99);
  s2.signaled = true;
  ASSERT_EQ(a_.qp->post_send(s2), 0);
  auto rc = run_until(b_, 2);
  ASSERT_EQ(rc.size(), 2u);
  EXPECT_EQ(rc[0].wr_id, 7u);
  EXPECT_EQ(rc[0].opcode, WcOpcode::kRecv);
  EXPECT_EQ(rc[0].byte_len, 6000u);
  EXPECT_EQ(rc[1].wr_id, 8u);
  EXPECT_EQ(rc[1].byte_len, 0u);
  EXPECT_TRUE(rc[1].wc_flags & hostif::kWcWithImm);
  EXPECT_EQ(ntohl(rc[1].imm), 99u);
  EXPECT_EQ(std::memcmp(b_.buf.data(), a_.buf.data(), 3000), 0);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 10000, a_.buf.data() + 3000, 3000), 0);
}

TEST_F(NicTest, ResponderRecordsStaySmallAndGrowOnlyForASenderFarAhead) {
  // 300 messages in flight behind a SEND that waits for its receive (RNR): the responder must
  // hold records for all of them, so its window grows from 64; then everything completes in
  // order with the right bytes. An idle QP keeps 64 records (~2.3 KiB).
  sq_depth_ = 512;
  build(test_link_config());
  QueuePair* rx = &core_qp(b_, *b_.qp);
  EXPECT_EQ(rx->responder_window(), QueuePair::kRecvWindowInitial);
  SendWqe first;
  first.wr_id = 1000;
  first.op = WqeOp::kSend;
  first.num_sge = 1;
  first.sge[0] = sge(a_, 0, 8);
  ASSERT_EQ(a_.qp->post_send(first), 0);
  for (uint32_t i = 0; i < 300; ++i) {
    a_.buf[4096 + i] = static_cast<uint8_t>(i * 13 + 5);
    SendWqe w;
    w.wr_id = i;
    w.op = WqeOp::kWrite;
    w.signaled = i == 299;
    w.num_sge = 1;
    w.sge[0] = sge(a_, 4096 + i, 1);
    w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data()) + 8192 + i;
    w.rkey = b_.key;
    ASSERT_EQ(a_.qp->post_send(w), 0);
  }
  run_until(b_, 1, 300);  // the writes land; nothing completes behind the waiting SEND
  EXPECT_GT(rx->responder_window(), 300u);
  EXPECT_LE(rx->responder_window(), 512u);
  RecvWqe r;
  r.wr_id = 77;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 8);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  auto rc = run_until(b_, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].wr_id, 77u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
  auto sc = run_until(a_, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].wr_id, 299u);
  EXPECT_EQ(sc[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 8192, a_.buf.data() + 4096, 300), 0);
}

TEST_F(NicTest, ReadFetchesRemoteBytes) {
  for (size_t i = 0; i < 70000; ++i) b_.buf[200000 + i] = static_cast<uint8_t>(i ^ 0x5a);
  SendWqe w;
  w.wr_id = 5;
  w.op = WqeOp::kRead;
  w.signaled = true;
  w.num_sge = 2;
  w.sge[0] = sge(a_, 0, 1000);
  w.sge[1] = sge(a_, 4096, 69000);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + 200000);
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(c[0].opcode, WcOpcode::kRdmaRead);
  EXPECT_EQ(c[0].byte_len, 70000u);
  EXPECT_EQ(std::memcmp(a_.buf.data(), b_.buf.data() + 200000, 1000), 0);
  EXPECT_EQ(std::memcmp(a_.buf.data() + 4096, b_.buf.data() + 201000, 69000), 0);
}

TEST_F(NicTest, WrongRkeyIsRemoteAccessErrorAndFlushesTheRest) {
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 64);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key + 0x100;
  std::memset(a_.buf.data(), 0xab, 64);
  ASSERT_EQ(a_.qp->post_send(w), 0);
  w.wr_id = 2;
  w.rkey = b_.key;
  w.signaled = false;  // flushed completions are reported even for unsignaled WRs
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].wr_id, 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(c[1].wr_id, 2u);
  EXPECT_EQ(c[1].status, WcStatus::kWrFlushErr);
  EXPECT_EQ(a_.qp->state(), QpState::kErr);
  EXPECT_EQ(b_.buf[0], 0) << "a rejected WRITE wrote memory";
}

// UCX flushes an RC endpoint with an empty inline WRITE whose rkey and address are 0; a
// zero-length WRITE or READ names no memory, so its key is not checked (IBA C9-88).
TEST_F(NicTest, ZeroLengthWriteAndReadCheckNoKey) {
  RecvWqe r;
  r.wr_id = 50;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 64);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  SendWqe w;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.wr_id = 1;  // rkey and remote address 0, nothing inline, no SGE: UCX's flush
  ASSERT_EQ(a_.qp->post_send(w), 0);
  w.wr_id = 2;
  w.op = WqeOp::kRead;
  w.rkey = b_.key + 0x300;  // no such key
  w.remote_addr = 12345;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  w.wr_id = 3;
  w.op = WqeOp::kWriteImm;  // consumes b's receive, with no data
  w.imm = htonl(77);
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 3);
  ASSERT_EQ(c.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(c[i].wr_id, i + 1u);
    EXPECT_EQ(c[i].status, WcStatus::kSuccess) << "wr " << i + 1;
  }
  auto rc = run_until(b_, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
  EXPECT_EQ(rc[0].byte_len, 0u);
  EXPECT_EQ(b_.qp->state(), QpState::kRts) << "the responder's QP stays usable";
  // A zero-length WRITE still needs the QP's own remote write right.
  b_.qp->set_access(kLocalWrite);
  w.wr_id = 4;
  w.op = WqeOp::kWrite;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
}

// A message the driver copied into its WQE at post time (kGathered) is sent from that copy,
// not read from the application's memory; its SGEs' keys are still checked.
TEST_F(NicTest, AGatheredWqeSendsItsCopyAndStillChecksItsKeys) {
  RecvWqe r;
  r.wr_id = 60;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 64);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  std::memset(a_.buf.data(), 0x11, 16);  // what the memory holds
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kSend;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 16);
  std::memset(w.inline_data, 0x22, 16);  // what the driver copied
  w.gathered_len = 16;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  auto rc = run_until(b_, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].byte_len, 16u);
  EXPECT_EQ(b_.buf[0], 0x22) << "the copy was sent, not the memory";
  EXPECT_EQ(b_.buf[15], 0x22);
  // A WRITE whose SGE names no region of the PD fails as any would.
  w.wr_id = 2;
  w.op = WqeOp::kWrite;
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + 4096);
  w.rkey = b_.key;
  w.sge[0].lkey = a_.key + 0x500;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kLocProtErr);
  EXPECT_EQ(b_.buf[4096], 0) << "nothing of a refused WQE was sent";
}

TEST_F(NicTest, OutOfBoundsWriteWritesNothing) {
  SendWqe w;
  w.wr_id = 3;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 4000);
  std::memset(a_.buf.data(), 0xcd, 4000);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + b_.buf.size() - 1500);
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  // Packet by packet, the in-bounds first part may land; nothing may land past the MR.
  EXPECT_EQ(b_.buf[b_.buf.size() - 1], 0);
}

TEST_F(NicTest, SendBeforeReceiveIsPostedWaitsThenLands) {
  SendWqe s;
  s.wr_id = 9;
  s.op = WqeOp::kSend;
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 2000);
  std::memset(a_.buf.data(), 0x77, 2000);
  ASSERT_EQ(a_.qp->post_send(s), 0);
  auto none = run_until(b_, 1, 200);
  EXPECT_TRUE(none.empty());
  RecvWqe r;
  r.wr_id = 10;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 4096);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  // The sender retries on its retransmission timer (virtual time passes in run_until).
  auto got = run_until(b_, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].byte_len, 2000u);
  EXPECT_EQ(b_.buf[1999], 0x77);
}

// Sets the verbs retry attributes of s's QP (as a modify_qp RTR/RTS would), towards its peer.
void set_retry(Side& s, uint32_t peer_ip, uint32_t peer_qpn, uint8_t timeout, uint8_t retry_cnt,
               uint8_t rnr_retry, uint8_t min_rnr_timer) {
  hostif::QpRemote r;
  r.ip = peer_ip;
  r.qpn = peer_qpn;
  r.max_rd_atomic = 16;
  r.timeout = timeout;
  r.retry_cnt = retry_cnt;
  r.rnr_retry = rnr_retry;
  r.min_rnr_timer = min_rnr_timer;
  s.qp->set_remote(r);
}

TEST_F(NicTest, TheRequestersRnrRetryBoundsRefusalsOfItsSends) {
  // rnr_retry 0: the first RNR NAK ends the SEND with RNR_RETRY_EXC_ERR (the engine's own
  // limit is 7, for ever: a QP value ignored would leave it waiting).
  set_retry(a_, kIpB, b_.qp->qpn(), 14, 7, 0, 12);
  ASSERT_EQ(a_.qp->post_send(wqe(5, WqeOp::kSend, sge(a_, 0, 100))), 0);
  auto got = run_until(a_, 1, 2000);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].wr_id, 5u);
  EXPECT_EQ(got[0].status, WcStatus::kRnrRetryExcErr);
  EXPECT_EQ(a_.qp->state(), QpState::kErr);
}

TEST_F(NicTest, TheRespondersMinRnrTimerSetsTheSendersBackOff) {
  // The receive is posted 1 ms after the SEND was refused. A responder whose min_rnr_timer is
  // 1 (10 us) has it land well within 1 ms more; one whose timer is 24 (40.96 ms) keeps the
  // sender away for 40 ms (the engine's own back-off is 1 ms).
  for (uint8_t timer : {uint8_t{1}, uint8_t{24}}) {
    build(test_link_config());
    set_retry(b_, kIpA, a_.qp->qpn(), 14, 7, 7, timer);
    SendWqe s = wqe(0, WqeOp::kSend, sge(a_, 0, 100));
    s.signaled = false;
    ASSERT_EQ(a_.qp->post_send(s), 0);
    EXPECT_TRUE(run_until(b_, 1, 100).empty());  // 1 ms: refused, backing off
    RecvWqe r;
    r.wr_id = 11;
    r.num_sge = 1;
    r.sge[0] = sge(b_, 0, 4096);
    ASSERT_EQ(b_.qp->post_recv(r), 0);
    const transport::Time posted = clock_;
    auto got = run_until(b_, 1, 10000);
    ASSERT_EQ(got.size(), 1u) << int{timer};
    if (timer == 1) EXPECT_LT(clock_ - posted, std::chrono::microseconds(500));
    else EXPECT_GT(clock_ - posted, std::chrono::milliseconds(30));
  }
}

TEST_F(NicTest, TheQpsTimeoutAndRetryCountBoundAWriteToAVanishedPeer) {
  // The peer has no such QP: WRITEs are never acknowledged. timeout 8 (1 ms) with retry_cnt 0
  // fails the WRITE within a few ms; retry_cnt 7 only after 8 ms of silence; timeout 16
  // (268 ms) keeps it waiting past 100 ms. (The engine's own limit is 7 RTOs.)
  struct Case {
    uint8_t timeout, retry_cnt;
    std::chrono::milliseconds not_before, by;  // by 0: no completion within 100 ms
  };
  for (const Case& k : {Case{8, 0, std::chrono::milliseconds(1), std::chrono::milliseconds(4)},
                        Case{8, 7, std::chrono::milliseconds(8), std::chrono::milliseconds(40)},
                        Case{16, 1, std::chrono::milliseconds(0), std::chrono::milliseconds(0)}}) {
    build(test_link_config());
    set_retry(a_, kIpB, 0xabcde, k.timeout, k.retry_cnt, 7, 12);
    ASSERT_EQ(a_.qp->post_send(wqe(3, WqeOp::kWrite, sge(a_, 0, 64),
                                   reinterpret_cast<uint64_t>(b_.buf.data()), b_.key)),
              0);
    const transport::Time start = clock_;
    auto got = run_until(a_, 1, 10000);  // 100 ms at most
    if (k.by.count() == 0) {
      EXPECT_TRUE(got.empty()) << int{k.timeout};
      continue;
    }
    ASSERT_EQ(got.size(), 1u) << int{k.retry_cnt};
    EXPECT_EQ(got[0].status, WcStatus::kRetryExcErr);
    EXPECT_GE(clock_ - start, k.not_before) << int{k.retry_cnt};
    EXPECT_LT(clock_ - start, k.by) << int{k.retry_cnt};
  }
}

TEST_F(NicTest, ModifyToErrorFlushesPostedReceives) {
  RecvWqe r;
  r.wr_id = 11;
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  b_.qp->set_state(QpState::kErr);
  Cqe c[2];
  ASSERT_EQ(b_.cq->poll(2, c), 1);
  EXPECT_EQ(c[0].wr_id, 11u);
  EXPECT_EQ(c[0].status, WcStatus::kWrFlushErr);
}

TEST_F(NicTest, TwoQpsOfOneDeviceTalkThroughLoopback) {
  TestQp q2(nic(a_), &a_.owner, a_.pd, *a_.cq, *a_.cq, caps(16, 1));
  ASSERT_EQ(q2.err, 0);
  // Reconnect a_'s first QP to the new one, both at a_'s own address.
  a_.qp->set_state(QpState::kReset);
  bring_up(*a_.qp, kIpA, q2.qpn());
  bring_up(q2, kIpA, a_.qp->qpn());
  RecvWqe r;
  r.wr_id = 77;
  r.num_sge = 1;
  r.sge[0] = sge(a_, 500000, 8000);
  ASSERT_EQ(q2.post_recv(r), 0);
  for (size_t i = 0; i < 8000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 3);
  SendWqe s;
  s.wr_id = 78;
  s.op = WqeOp::kSend;
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 8000);
  run_until(a_, 1, 10);  // lets the ARP exchange of SetUp's connection settle
  const uint64_t wire_before = b_.dev->layer->counters().rx_frames;
  ASSERT_EQ(a_.qp->post_send(s), 0);
  auto c = run_until(a_, 2);
  ASSERT_EQ(c.size(), 2u);
  for (const Cqe& e : c) EXPECT_EQ(e.status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(a_.buf.data(), a_.buf.data() + 500000, 8000), 0);
  EXPECT_EQ(b_.dev->layer->counters().rx_frames, wire_before) << "loopback traffic reached the wire";
  // Looped back packets never reach a port, so their payloads were copied in (not attached).
  EXPECT_GE(nic(a_).counters().tx_payload_copied, 8000u);
}


// The NIC remembers QPs by the low bits of their numbers (Nic::qp_of): a QP whose number shares
// a slot with a destroyed one is found, and the destroyed one is not.
TEST_F(NicTest, AQpIsFoundByItsOwnNumberWhenAnotherSharingItsLookupSlotIsGone) {
  Nic& n = nic(b_);
  const uint32_t old_qpn = b_.qp->qpn();
  ASSERT_EQ(n.find_qp(old_qpn)->qpn(), old_qpn);  // now remembered
  TestQp other(n, &b_.owner, b_.pd, *b_.cq, *b_.cq, caps(16, 1), hostif::QpType::kRc, nullptr,
               old_qpn + 1024);
  ASSERT_EQ(other.err, 0);
  EXPECT_EQ(n.find_qp(other.qpn())->qpn(), other.qpn());
  EXPECT_EQ(n.find_qp(old_qpn)->qpn(), old_qpn);
  ASSERT_EQ(n.destroy_qp(&b_.owner, old_qpn), 0);
  EXPECT_EQ(n.find_qp(old_qpn), nullptr);
  // Traffic to and from the survivor: its WRITE lands and its completion (found by its QPN
  // when the ACK comes back) arrives.
  a_.qp->set_state(QpState::kReset);
  bring_up(*a_.qp, kIpB, other.qpn());
  bring_up(other, kIpA, a_.qp->qpn());
  for (size_t i = 0; i < 3000; ++i) b_.buf[i] = static_cast<uint8_t>(i * 7);
  ASSERT_EQ(other.post_send(wqe(5, WqeOp::kWrite, sge(b_, 0, 3000),
                                reinterpret_cast<uint64_t>(a_.buf.data() + 100), a_.key)),
            0);
  auto c = run_until(b_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(c[0].qp_num, other.qpn());
  EXPECT_EQ(std::memcmp(a_.buf.data() + 100, b_.buf.data(), 3000), 0);
}
// Memory the NIC reaches only by copying (as through process_vm_readv): no view.
class CopyOnlyMemory final : public Memory {
 public:
  size_t read(std::span<const Access> a) override { return direct_.read(a); }
  size_t write(std::span<const Access> a) override { return direct_.write(a); }

 private:
  DirectMemory direct_;
};

// A WRITE of three SGEs at odd offsets and lengths, so that packets (1 KiB of payload) begin and
// end inside SGEs; then a READ of it back, which b_ answers with payloads.
TEST_F(NicTest, PayloadsSeenInPlaceLeaveAsTailsTheLinkCopiesAndEveryByteArrives) {
  for (size_t i = 0; i < 200000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 31 + 7);
  SendWqe w = wqe(1, WqeOp::kWrite, sge(a_, 3, 701), reinterpret_cast<uint64_t>(b_.buf.data() + 9),
                  b_.key);
  w.num_sge = 3;
  w.sge[1] = sge(a_, 50001, 1500);
  w.sge[2] = sge(a_, 100013, 2299);
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 9, a_.buf.data() + 3, 701), 0);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 710, a_.buf.data() + 50001, 1500), 0);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 2210, a_.buf.data() + 100013, 2299), 0);
  // Every packet's last piece went as a tail; the earlier pieces of a packet that spans SGEs
  // were copied into it. Nothing was lost on this link, so nothing was sent twice.
  const NicCounters& n = nic(a_).counters();
  EXPECT_EQ(n.tx_payload_attached + n.tx_payload_copied, 4500u);
  EXPECT_GT(n.tx_payload_attached, n.tx_payload_copied);
  EXPECT_GT(n.tx_payload_copied, 0u);
  // A READ's answer goes the same way.
  ASSERT_EQ(a_.qp->post_send(wqe(2, WqeOp::kRead, sge(a_, 300000, 4500),
                                 reinterpret_cast<uint64_t>(b_.buf.data() + 9), b_.key)),
            0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(a_.buf.data() + 300000, b_.buf.data() + 9, 4500), 0);
  EXPECT_EQ(nic(b_).counters().tx_payload_attached, 4500u);
}

TEST_F(NicTest, MemoryOnlyReachableByCopyIsCopiedIntoThePacketAndOutOfIt) {
  CopyOnlyMemory copy_only;
  reach_by(a_, &copy_only);
  reach_by(b_, &copy_only);
  for (size_t i = 0; i < 70000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 5 + 3);
  ASSERT_EQ(a_.qp->post_send(wqe(1, WqeOp::kWrite, sge(a_, 1, 70000),
                                 reinterpret_cast<uint64_t>(b_.buf.data() + 2), b_.key)),
            0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 2, a_.buf.data() + 1, 70000), 0);
  EXPECT_EQ(nic(a_).counters().tx_payload_copied, 70000u);
  EXPECT_EQ(nic(a_).counters().tx_payload_attached, 0u);
}

// Memory seen in place above `split`, reached only by copy below it; each copied write checks
// that no byte at or above `split` was written before it.
class SplitMemory final : public Memory {
 public:
  explicit SplitMemory(const uint8_t* split) : split_(reinterpret_cast<uintptr_t>(split)) {}
  size_t read(std::span<const Access> a) override { return direct_.read(a); }
  size_t write(std::span<const Access> a) override {
    for (const Access& x : a) {
      (x.addr < split_ ? copied_below : copied_above) += x.len;
      if (x.addr < split_) later_landed_first |= *reinterpret_cast<const uint8_t*>(split_) != 0;
    }
    return direct_.write(a);
  }
  uint8_t* view(uint64_t addr, uint32_t len, bool write) override {
    return addr >= split_ ? direct_.view(addr, len, write) : nullptr;
  }
  bool later_landed_first = false;
  uint32_t copied_below = 0, copied_above = 0;  // bytes written through write()

 private:
  const uintptr_t split_;
  DirectMemory direct_;
};

TEST_F(NicTest, WritesLandInOrderWhenOnlyTheLaterOneIsSeenInPlace) {
  SplitMemory split(b_.buf.data() + 4096);
  reach_by(b_, &split);
  std::memset(a_.buf.data(), 0x5A, 64);
  // Two one-packet WRITEs that b_ receives in one pass: the first to memory it reaches by copy
  // (queued), the second to memory it sees in place, which must not be written ahead of it.
  ASSERT_EQ(a_.qp->post_send(wqe(1, WqeOp::kWrite, sge(a_, 0, 64),
                                 reinterpret_cast<uint64_t>(b_.buf.data() + 100), b_.key)),
            0);
  ASSERT_EQ(a_.qp->post_send(wqe(2, WqeOp::kWrite, sge(a_, 0, 8),
                                 reinterpret_cast<uint64_t>(b_.buf.data() + 4096), b_.key)),
            0);
  auto c = run_until(a_, 2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(b_.buf[100], 0x5A);
  EXPECT_EQ(b_.buf[4096], 0x5A);
  EXPECT_EQ(split.copied_below, 64u);
  EXPECT_EQ(split.copied_above, 8u);  // queued behind the first, though it could be seen in place
  EXPECT_FALSE(split.later_landed_first);
}

TEST(NicPlanesTest, TwoPlaneLinkSpraysOverBothPortsAndDeliversByteExact) {
  auto [a0, b0] = io::make_mem_link(test_link_config());
  auto [a1, b1] = io::make_mem_link(test_link_config());
  io::Port* wire0 = b0.get();
  io::Port* wire1 = b1.get();
  transport::Time clock{std::chrono::seconds(1)};
  std::vector<std::unique_ptr<io::Port>> pa, pb;
  pa.push_back(std::move(a0));
  pa.push_back(std::move(a1));
  pb.push_back(std::move(b0));
  pb.push_back(std::move(b1));
  Device a(test_link("a", kIpA, 2), std::move(pa), 1);
  Device b(test_link("b", kIpB, 2), std::move(pb), 9);
  ASSERT_EQ(a.layer->planes(), 2u);
  TestOwner oa, ob;
  uint32_t pda, pdb;
  ASSERT_EQ(a.nic->alloc_pd(&oa, &pda), 0);
  ASSERT_EQ(b.nic->alloc_pd(&ob, &pdb), 0);
  std::vector<uint8_t> src(200000), dst(200000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  uint32_t ka, kb, r;
  ASSERT_EQ(a.nic->reg_mr(&oa, pda, reinterpret_cast<uint64_t>(src.data()), src.size(), kAllAccess, &ka, &r), 0);
  ASSERT_EQ(b.nic->reg_mr(&ob, pdb, reinterpret_cast<uint64_t>(dst.data()), dst.size(), kAllAccess, &kb, &r), 0);
  TestCq ca(*a.nic, &oa, 16), cb(*b.nic, &ob, 16);
  TestQp qa(*a.nic, &oa, pda, ca, ca, caps(8, 1));
  TestQp qb(*b.nic, &ob, pdb, cb, cb, caps(8, 1));
  bring_up(qa, kIpB, qb.qpn());
  bring_up(qb, kIpA, qa.qpn());
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = Sge{reinterpret_cast<uint64_t>(src.data()), 200000, ka};
  w.remote_addr = reinterpret_cast<uint64_t>(dst.data());
  w.rkey = kb;
  ASSERT_EQ(qa.post_send(w), 0);
  Cqe c;
  int got = 0;
  for (int i = 0; i < 20000 && got == 0; ++i) {
    clock += std::chrono::microseconds(10);
    a.progress(clock);
    b.progress(clock);
    got = ca.poll(1, &c);
  }
  ASSERT_EQ(got, 1);
  EXPECT_EQ(c.status, WcStatus::kSuccess);
  EXPECT_EQ(src, dst);
  // Both planes carried a fair part of the ~200 data packets.
  EXPECT_GT(wire0->stats().rx_frames, 50u);
  EXPECT_GT(wire1->stats().rx_frames, 50u);
}

uint64_t& word(Side& s, size_t off) { return *reinterpret_cast<uint64_t*>(s.buf.data() + off); }

SendWqe atomic_wqe(WqeOp op, uint64_t wr_id, Sge local, uint64_t remote, uint32_t rkey,
                   uint64_t compare_add, uint64_t swap = 0) {
  SendWqe w;
  w.wr_id = wr_id;
  w.op = op;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = local;
  w.remote_addr = remote;
  w.rkey = rkey;
  w.compare_add = compare_add;
  w.swap = swap;
  return w;
}

TEST_F(NicTest, FetchAddAndCmpSwapReturnTheOriginalAndUpdateTheTarget) {
  word(b_, 64) = 1000;
  word(b_, 128) = 0x1111;
  const auto remote = [&](size_t off) { return reinterpret_cast<uint64_t>(b_.buf.data() + off); };
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kFetchAdd, 1, sge(a_, 0, 8), remote(64), b_.key, 5)), 0);
  // Compare matches: swapped. Compare misses: untouched; both return what was there.
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kCmpSwp, 2, sge(a_, 8, 8), remote(128), b_.key,
                                        0x1111, 0x2222)), 0);
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kCmpSwp, 3, sge(a_, 16, 8), remote(128), b_.key,
                                        0x1111, 0x3333)), 0);
  auto c = run_until(a_, 3);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].opcode, WcOpcode::kFetchAdd);
  EXPECT_EQ(c[1].opcode, WcOpcode::kCompSwap);
  for (const Cqe& e : c) {
    EXPECT_EQ(e.status, WcStatus::kSuccess);
    EXPECT_EQ(e.byte_len, 8u);
  }
  EXPECT_EQ(word(a_, 0), 1000u);
  EXPECT_EQ(word(b_, 64), 1005u);
  EXPECT_EQ(word(a_, 8), 0x1111u);
  EXPECT_EQ(word(a_, 16), 0x2222u);
  EXPECT_EQ(word(b_, 128), 0x2222u);
}

TEST_F(NicTest, MisalignedAtomicIsInvalidRequestAndLongLocalBufferIsLengthError) {
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kFetchAdd, 1, sge(a_, 0, 8),
                                        reinterpret_cast<uint64_t>(b_.buf.data() + 4), b_.key, 1)),
            0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemInvReqErr);
  EXPECT_EQ(word(b_, 0), 0u);

  SetUp();  // fresh, connected pair
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kFetchAdd, 2, sge(a_, 0, 16),
                                        reinterpret_cast<uint64_t>(b_.buf.data()), b_.key, 1)),
            0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kLocLenErr);
}

TEST_F(NicTest, AtomicWithoutRemoteAtomicAccessIsRemoteAccessError) {
  b_.qp->set_access(kLocalWrite | kRemoteWrite);
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kFetchAdd, 1, sge(a_, 0, 8),
                                        reinterpret_cast<uint64_t>(b_.buf.data()), b_.key, 1)),
            0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(word(b_, 0), 0u);
}

TEST_F(NicTest, AtomicRequestSeenTwiceIsAnsweredButExecutedOnce) {
  word(b_, 0) = 10;
  uint8_t ops[kAtomicRequestLen] = {};
  ops[7] = 3;  // add 3, big-endian
  const transport::Segment seg = a_to_b(transport::Op::kAtomicFetchAdd, 0, ops);
  QueuePair& qp = core_qp(b_, *b_.qp);
  EXPECT_EQ(qp.deliver(seg), transport::Syndrome::kOk);
  nic(b_).end_rx(clock_);
  EXPECT_EQ(word(b_, 0), 13u);
  EXPECT_EQ(qp.deliver(seg), transport::Syndrome::kOk);  // a retransmitted request
  nic(b_).end_rx(clock_);
  EXPECT_EQ(word(b_, 0), 13u);
}

// ATOMIC_WRITE (verbs-mapping.md §3): 8 bytes stored whole, as the WQE holds them (the
// extended verb) or from an SGE of 8 (ibv_post_send); acknowledged as a WRITE.
TEST_F(NicTest, AtomicWriteStoresTheEightBytesAsGiven) {
  const uint8_t value[8] = {0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08};
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kAtomicWrite;
  w.signaled = true;
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + 64);
  w.rkey = b_.key;
  std::memcpy(&w.compare_add, value, 8);
  ASSERT_EQ(a_.qp->post_send(w), 0);
  for (int i = 0; i < 8; ++i) a_.buf[256 + i] = static_cast<uint8_t>(0xa0 + i);
  ASSERT_EQ(a_.qp->post_send(wqe(2, WqeOp::kAtomicWrite, sge(a_, 256, 8),
                                 reinterpret_cast<uint64_t>(b_.buf.data() + 128), b_.key)),
            0);
  auto c = run_until(a_, 2);
  ASSERT_EQ(c.size(), 2u);
  for (const Cqe& e : c) {
    EXPECT_EQ(e.status, WcStatus::kSuccess);
    EXPECT_EQ(e.opcode, WcOpcode::kAtomicWrite);
  }
  EXPECT_EQ(std::memcmp(b_.buf.data() + 64, value, 8), 0);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 128, a_.buf.data() + 256, 8), 0);
  EXPECT_EQ(word(b_, 56), 0u);
  EXPECT_EQ(word(b_, 72), 0u);
}

TEST_F(NicTest, AtomicWriteRefusesWrongLengthMisalignedTargetAndMissingWriteAccess) {
  // Local: not 8 bytes.
  ASSERT_EQ(a_.qp->post_send(wqe(1, WqeOp::kAtomicWrite, sge(a_, 0, 4),
                                 reinterpret_cast<uint64_t>(b_.buf.data()), b_.key)),
            0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kLocLenErr);
  // Remote: a target not 8-byte aligned is an invalid request.
  SetUp();
  a_.buf[0] = 0x55;
  ASSERT_EQ(a_.qp->post_send(wqe(2, WqeOp::kAtomicWrite, sge(a_, 0, 8),
                                 reinterpret_cast<uint64_t>(b_.buf.data() + 4), b_.key)),
            0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemInvReqErr);
  EXPECT_EQ(word(b_, 0), 0u);
  EXPECT_EQ(word(b_, 8), 0u);
  // Remote atomic access is not write access: the QP must allow remote writes.
  SetUp();
  b_.qp->set_access(kLocalWrite | kRemoteAtomic);
  ASSERT_EQ(a_.qp->post_send(wqe(3, WqeOp::kAtomicWrite, sge(a_, 0, 8),
                                 reinterpret_cast<uint64_t>(b_.buf.data()), b_.key)),
            0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(word(b_, 0), 0u);
}

// The flag pattern: data WRITE, then ATOMIC_WRITE of a flag. Data lands out of order, but the
// flag is stored only once every earlier message of the stream is in place, and a copy of it
// seen again stores nothing.
TEST_F(NicTest, AtomicWriteWaitsForEveryEarlierMessageAndIsStoredOnce) {
  QueuePair& qp = core_qp(b_, *b_.qp);
  std::vector<uint8_t> data(64, 0x5a);
  uint8_t flag[8] = {1, 0, 0, 0, 0, 0, 0, 0};
  const transport::Segment w = a_to_b(transport::Op::kWrite, 0, data, 4096);
  const transport::Segment f = a_to_b(transport::Op::kAtomicWrite, 1, flag);
  EXPECT_EQ(qp.deliver(f), transport::Syndrome::kOk);  // the flag overtook the data
  nic(b_).end_rx(clock_);
  EXPECT_EQ(word(b_, 0), 0u) << "the flag was stored before the data it follows";
  EXPECT_EQ(qp.deliver(f), transport::Syndrome::kOk);  // a copy while it waits
  nic(b_).end_rx(clock_);
  EXPECT_EQ(word(b_, 0), 0u);
  EXPECT_EQ(qp.deliver(w), transport::Syndrome::kOk);
  nic(b_).end_rx(clock_);
  EXPECT_EQ(word(b_, 0), 1u);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 4096, data.data(), data.size()), 0);
  word(b_, 0) = 7;  // the application moves on; a late copy must not undo it
  EXPECT_EQ(qp.deliver(f), transport::Syndrome::kOk);
  nic(b_).end_rx(clock_);
  EXPECT_EQ(word(b_, 0), 7u);
}

TEST_F(NicTest, MaxRdAtomicBoundsOutstandingReads) {
  connect(a_, b_, 0xC6120002, /*max_rd_atomic=*/1);
  for (uint64_t i = 0; i < 4; ++i) {
    SendWqe w;
    w.wr_id = i;
    w.op = WqeOp::kRead;
    w.signaled = true;
    w.num_sge = 1;
    w.sge[0] = sge(a_, i * 4096, 4096);
    w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data() + 65536);
    w.rkey = b_.key;
    ASSERT_EQ(a_.qp->post_send(w), 0);
  }
  // One pass of the requester submits only the first READ: the others wait for its answer.
  a_.dev->progress(clock_);
  EXPECT_TRUE(a_.dev->nic->engine().stats().tx_packets <= 1u);
  auto c = run_until(a_, 4);
  ASSERT_EQ(c.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(c[i].wr_id, i);
    EXPECT_EQ(c[i].status, WcStatus::kSuccess);
  }
}

TEST_F(NicTest, ArmedCqNotifiesOnceForTheNextCompletion) {
  TestCq cq(nic(a_), &a_.owner, 16, /*channel=*/true);
  TestQp qp(nic(a_), &a_.owner, a_.pd, cq, cq, caps(16));
  b_.qp->set_state(QpState::kReset);
  bring_up(*b_.qp, kIpA, qp.qpn());
  bring_up(qp, kIpB, b_.qp->qpn());
  cq.arm();
  EXPECT_TRUE(a_.owner.cq_events.empty());  // nothing completed yet
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 64);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(qp.post_send(w), 0);
  w.wr_id = 2;
  ASSERT_EQ(qp.post_send(w), 0);
  auto c = run_until(cq, 2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(a_.owner.cq_events, std::vector<uint32_t>{cq.id});  // armed once, one event
  // Unarmed: completions raise nothing (the driver fires itself when it arms with completions
  // waiting, hostif::CqHeader::armed).
  w.wr_id = 3;
  ASSERT_EQ(qp.post_send(w), 0);
  EXPECT_EQ(run_until(cq, 1).size(), 1u);
  EXPECT_EQ(a_.owner.cq_events.size(), 1u);
}

// --- SRQ, UD, asynchronous events (docs/spec/verbs-mapping.md §6-§8) ---------------------

// A QP of `side`'s device with the given type and receive source, in RESET.
std::unique_ptr<TestQp> extra_qp(Side& side, QpType type, TestSrq* srq) {
  auto qp = std::make_unique<TestQp>(*side.dev->nic, &side.owner, side.pd, *side.cq, *side.cq,
                                     caps(64), type, srq);
  EXPECT_EQ(qp->err, 0);
  return qp;
}

TEST_F(NicTest, SrqEntriesAreClaimedInRsnOrderWhenALaterMessageArrivesFirst) {
  TestSrq srq(nic(b_), &b_.owner, b_.pd, 8, 1);
  ASSERT_EQ(srq.err, 0);
  auto q = extra_qp(b_, QpType::kRc, &srq);
  bring_up(*q, kIpA, 77);
  for (uint64_t id = 100; id < 103; ++id) {
    RecvWqe r;
    r.wr_id = id;
    r.num_sge = 1;
    r.sge[0] = sge(b_, (id - 100) * 1000, 1000);
    ASSERT_EQ(srq.post_recv(r), 0);
  }
  // Messages msn 1 (rsn 1) then msn 0 (rsn 0), as spraying may deliver them.
  const uint8_t one[4] = {1, 1, 1, 1}, zero[4] = {9, 9, 9, 9};
  transport::Segment seg;
  seg.peer_ip = kIpA;
  seg.op = transport::Op::kSend;
  seg.dst_stream = q->qpn();
  seg.src_stream = 77;
  seg.msn = 1;
  seg.rsn = 1;
  seg.total_length = 4;
  seg.payload = one;
  QueuePair& qp = core_qp(b_, *q);
  ASSERT_EQ(qp.deliver(seg), transport::Syndrome::kOk);
  EXPECT_EQ(srq.posted(), 1u) << "rsn 1 claims rsn 0's entry too";
  seg.msn = 0;
  seg.rsn = 0;
  seg.payload = zero;
  ASSERT_EQ(qp.deliver(seg), transport::Syndrome::kOk);
  nic(b_).end_rx(clock_);
  Cqe c[4];
  ASSERT_EQ(b_.cq->poll(4, c), 2);
  EXPECT_EQ(c[0].wr_id, 100u);  // msn 0 -> the first entry posted
  EXPECT_EQ(c[1].wr_id, 101u);
  EXPECT_EQ(b_.buf[0], 9);
  EXPECT_EQ(b_.buf[1000], 1);
  EXPECT_EQ(b_.owner.count(AsyncEvent::kCommEst), 0u);  // the QP was already in RTS
  EXPECT_EQ(nic(b_).destroy_srq(&b_.owner, srq.id), EBUSY);
  ASSERT_EQ(nic(b_).destroy_qp(&b_.owner, q->qpn()), 0);
  EXPECT_EQ(nic(b_).destroy_srq(&b_.owner, srq.id), 0);
}

// An engine killed within a pass, after it freed a receive and before it published the
// completion: the completion is staged, names the entry, and the driver owes nothing more.
TEST_F(NicTest, AReceiveIsFreedOnlyOnceItsCompletionIsStagedNamingIt) {
  RecvWqe r;
  r.wr_id = 41;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 100);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  TestSrq srq(nic(b_), &b_.owner, b_.pd, 4, 1);
  ASSERT_EQ(srq.err, 0);
  auto q = extra_qp(b_, QpType::kRc, &srq);
  bring_up(*q, kIpA, 77);
  r.wr_id = 42;
  ASSERT_EQ(srq.post_recv(r), 0);
  const uint8_t data[4] = {1, 2, 3, 4};
  transport::Segment seg = a_to_b(transport::Op::kSend, 0, data);
  ASSERT_EQ(core_qp(b_, *b_.qp).deliver(seg), transport::Syndrome::kOk);
  seg.dst_stream = q->qpn();
  seg.src_stream = 77;
  ASSERT_EQ(core_qp(b_, *q).deliver(seg), transport::Syndrome::kOk);
  // Both entries are free again, and nothing is visible yet: the engine dies here.
  hostif::CqHeader* h = b_.cq->header();
  ASSERT_EQ(h->head.load(), 0u);
  EXPECT_EQ(b_.qp->header()->rq_done.load(), 1u);
  EXPECT_EQ(srq.header()->free_head.load() - srq.header()->free_tail.load(), 4u);
  ASSERT_EQ(hostif::cq_recover_staged(h), 2u);
  Cqe c[4];
  ASSERT_EQ(b_.cq->poll(4, c), 2);
  EXPECT_EQ(c[0].wr_id, 41u);
  EXPECT_EQ(c[0].status, WcStatus::kWrFlushErr) << "its data may not have reached memory";
  EXPECT_EQ(c[0].queue, hostif::CqeQueue::kRecv);
  EXPECT_EQ(c[0].wqe, 0u);
  EXPECT_EQ(c[1].wr_id, 42u);
  EXPECT_EQ(c[1].queue, hostif::CqeQueue::kSrq);
  EXPECT_EQ(c[1].srq, srq.id);
  EXPECT_EQ(hostif::first_unreported(1, 1, b_.qp->qpn(), hostif::CqeQueue::kRecv, {c, 2}), 1u)
      << "nothing left to flush";
  ASSERT_EQ(nic(b_).destroy_qp(&b_.owner, q->qpn()), 0);
}

TEST_F(NicTest, SrqFeedsSendsOverTheWireAndRaisesTheLimitEventOnce) {
  TestSrq srq(nic(b_), &b_.owner, b_.pd, 16, 2);
  ASSERT_EQ(srq.err, 0);
  auto q = extra_qp(b_, QpType::kRc, &srq);
  a_.qp->set_state(QpState::kReset);
  connect_to(a_, q->qpn(), kIpB);
  bring_up(*q, kIpA, a_.qp->qpn(), 0, QpState::kRtr);  // RTR only: COMM_EST on arrival
  for (uint64_t id = 0; id < 6; ++id) {
    RecvWqe r;
    r.wr_id = 200 + id;
    r.num_sge = 2;
    r.sge[0] = sge(b_, id * 10000, 1500);
    r.sge[1] = sge(b_, id * 10000 + 5000, 1500);
    ASSERT_EQ(srq.post_recv(r), 0);
  }
  srq.set_limit(4);
  for (size_t i = 0; i < 3000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 11 + 3);
  for (uint64_t id = 0; id < 4; ++id) {
    SendWqe s;
    s.wr_id = id;
    s.op = WqeOp::kSend;
    s.num_sge = 1;
    s.sge[0] = sge(a_, 0, 2500);  // crosses both SGEs of the receive and several packets
    ASSERT_EQ(a_.qp->post_send(s), 0);
  }
  auto rc = run_until(b_, 4);
  ASSERT_EQ(rc.size(), 4u);
  for (uint64_t id = 0; id < 4; ++id) {
    EXPECT_EQ(rc[id].status, WcStatus::kSuccess);
    EXPECT_EQ(rc[id].wr_id, 200 + id);
    EXPECT_EQ(rc[id].byte_len, 2500u);
    EXPECT_EQ(std::memcmp(b_.buf.data() + id * 10000, a_.buf.data(), 1500), 0);
    EXPECT_EQ(std::memcmp(b_.buf.data() + id * 10000 + 5000, a_.buf.data() + 1500, 1000), 0);
  }
  const uint64_t srq_handle = reinterpret_cast<uintptr_t>(&srq);
  EXPECT_EQ(b_.owner.count(AsyncEvent::kSrqLimitReached, srq_handle), 1u);  // 6 -> 3 crossed 4
  EXPECT_EQ(srq.limit(), 0u);  // and disarmed it
  EXPECT_EQ(b_.owner.count(AsyncEvent::kCommEst, q->handle()), 1u);
  // ERR flushes nothing of the SRQ's unclaimed entries, and says the last WQE is reached.
  q->set_state(QpState::kErr);
  Cqe c[4];
  EXPECT_EQ(b_.cq->poll(4, c), 0);
  EXPECT_EQ(b_.owner.count(AsyncEvent::kQpLastWqeReached, q->handle()), 1u);
  EXPECT_EQ(srq.posted(), 2u);
}

TEST_F(NicTest, UdDatagramLandsBehindAGrhAndWrongQkeyIsDropped) {
  auto ua = extra_qp(a_, QpType::kUd, nullptr);
  auto ub = extra_qp(b_, QpType::kUd, nullptr);
  bring_up(*ua, 0, 0, 0x1111);
  bring_up(*ub, 0, 0, 0x2222);
  RecvWqe r;
  r.wr_id = 31;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 2000);
  ASSERT_EQ(ub->post_recv(r), 0);
  for (size_t i = 0; i < 1000; ++i) a_.buf[i] = static_cast<uint8_t>(i + 5);
  SendWqe s;
  s.op = WqeOp::kSendImm;
  s.imm = htonl(0xabc);
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 1000);
  s.ud_ip = kIpB;
  s.ud_qpn = ub->qpn();
  s.ud_qkey = 0x9999;  // wrong: dropped, yet the sender completes (unreliable service)
  s.wr_id = 1;
  ASSERT_EQ(ua->post_send(s), 0);
  s.ud_qkey = 0x2222;
  s.wr_id = 2;
  ASSERT_EQ(ua->post_send(s), 0);
  auto sc = run_until(a_, 2);
  ASSERT_EQ(sc.size(), 2u);
  for (const Cqe& e : sc) EXPECT_EQ(e.status, WcStatus::kSuccess);
  Cqe c[4];
  ASSERT_EQ(b_.cq->poll(4, c), 1);
  EXPECT_EQ(c[0].wr_id, 31u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(c[0].byte_len, kGrhLen + 1000);
  EXPECT_EQ(c[0].src_qp, ua->qpn());
  EXPECT_EQ(c[0].wc_flags, hostif::kWcGrh | hostif::kWcWithImm);
  EXPECT_EQ(ntohl(c[0].imm), 0xabcu);
  EXPECT_EQ(std::memcmp(b_.buf.data() + kGrhLen, a_.buf.data(), 1000), 0);
  // The GRH holds the datagram's IPv4 header at byte 20: version/IHL, protocol, addresses.
  EXPECT_EQ(b_.buf[20], 0x45);
  EXPECT_EQ(b_.buf[29], 17);
  const uint8_t src[4] = {198, 18, 0, 1}, dst[4] = {198, 18, 0, 2};
  EXPECT_EQ(std::memcmp(b_.buf.data() + 32, src, 4), 0);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 36, dst, 4), 0);
  // No receive posted: dropped silently, not RNR (the sender still completes at once).
  s.wr_id = 3;
  ASSERT_EQ(ua->post_send(s), 0);
  auto more = run_until(a_, 1);
  ASSERT_EQ(more.size(), 1u);
  EXPECT_EQ(more[0].status, WcStatus::kSuccess);
  EXPECT_EQ(b_.cq->poll(4, c), 0);
  // Larger than the MTU: a local length error at the sender.
  s.wr_id = 4;
  s.sge[0] = sge(a_, 0, nic(b_).active_mtu() + 1);
  ASSERT_EQ(ua->post_send(s), 0);
  auto big = run_until(a_, 1);
  ASSERT_EQ(big.size(), 1u);
  EXPECT_EQ(big[0].status, WcStatus::kLocLenErr);
  EXPECT_EQ(b_.owner.events.size(), 0u);
}

TEST_F(NicTest, UdMulticastReachesEveryAttachedQpOnBothDevicesAndNoOther) {
  constexpr uint32_t kGroup = 0xE6120001;  // 230.18.0.1
  auto sender = extra_qp(a_, QpType::kUd, nullptr);
  auto local = extra_qp(a_, QpType::kUd, nullptr);  // a member on the sender's own device
  auto m1 = extra_qp(b_, QpType::kUd, nullptr);
  auto m2 = extra_qp(b_, QpType::kUd, nullptr);
  auto outsider = extra_qp(b_, QpType::kUd, nullptr);  // not attached
  auto other_qkey = extra_qp(b_, QpType::kUd, nullptr);
  for (TestQp* q : {sender.get(), local.get(), m1.get(), m2.get(), outsider.get()})
    bring_up(*q, 0, 0, 0x01234567);
  bring_up(*other_qkey, 0, 0, 0x5555);
  // Attach: UD QPs of the caller, multicast addresses; twice is once.
  EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, b_.qp->qpn(), kGroup), EINVAL);  // an RC QP
  EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, m1->qpn(), kIpA), EINVAL);       // not a group
  EXPECT_EQ(nic(b_).attach_mcast(&a_.owner, m1->qpn(), kGroup), EINVAL);     // not a_'s QP
  EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, 0xabcde, kGroup), EINVAL);       // no such QP
  EXPECT_EQ(nic(b_).detach_mcast(&b_.owner, m1->qpn(), kGroup), EINVAL);     // not attached
  for (TestQp* q : {m1.get(), m2.get(), other_qkey.get()})
    ASSERT_EQ(nic(b_).attach_mcast(&b_.owner, q->qpn(), kGroup), 0);
  ASSERT_EQ(nic(b_).attach_mcast(&b_.owner, m1->qpn(), kGroup), 0);
  ASSERT_EQ(nic(a_).attach_mcast(&a_.owner, local->qpn(), kGroup), 0);
  EXPECT_EQ(nic(b_).mcast_groups(), 1u);
  std::vector<TestQp*> receivers = {local.get(), m1.get(), m2.get(), outsider.get(), other_qkey.get()};
  auto post_receives = [&](uint64_t base) {
    for (size_t i = 0; i < receivers.size(); ++i) {
      Side& side = i == 0 ? a_ : b_;
      RecvWqe r;
      r.wr_id = base + i;
      r.num_sge = 1;
      r.sge[0] = sge(side, 20000 + i * 2000, 2000);
      ASSERT_EQ(receivers[i]->post_recv(r), 0);
    }
  };
  post_receives(100);
  for (size_t i = 0; i < 700; ++i) a_.buf[i] = static_cast<uint8_t>(i * 7 + 1);
  SendWqe s;
  s.op = WqeOp::kSendImm;
  s.imm = htonl(0x77);
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 700);
  s.ud_ip = kGroup;
  s.ud_qpn = 0xffffff;
  s.ud_qkey = 0x01234567;
  s.wr_id = 9;
  ASSERT_EQ(sender->post_send(s), 0);
  auto sc = run_until(a_, 2);  // the sender's completion and its own device's member's
  ASSERT_EQ(sc.size(), 2u);
  for (int i = 0; i < 200; ++i) step();
  Cqe c[8];
  const int nb = b_.cq->poll(8, c);
  ASSERT_EQ(nb, 2);  // m1 and m2: once each (m1 attached twice), not the others
  for (const Cqe& e : sc) {
    EXPECT_EQ(e.status, WcStatus::kSuccess);
    if (e.qp_num == local->qpn()) {
      EXPECT_EQ(e.byte_len, kGrhLen + 700);
      EXPECT_EQ(std::memcmp(a_.buf.data() + 20000 + kGrhLen, a_.buf.data(), 700), 0);
    } else {
      EXPECT_EQ(e.wr_id, 9u);
    }
  }
  for (int i = 0; i < nb; ++i) {
    EXPECT_EQ(c[i].status, WcStatus::kSuccess);
    EXPECT_TRUE(c[i].qp_num == m1->qpn() || c[i].qp_num == m2->qpn());
    EXPECT_EQ(c[i].src_qp, sender->qpn());
    EXPECT_EQ(c[i].wc_flags, hostif::kWcGrh | hostif::kWcWithImm);
    EXPECT_EQ(ntohl(c[i].imm), 0x77u);
    EXPECT_EQ(c[i].byte_len, kGrhLen + 700);
    const size_t at = 20000 + (c[i].wr_id - 100) * 2000;
    EXPECT_EQ(std::memcmp(b_.buf.data() + at + kGrhLen, a_.buf.data(), 700), 0);
    // The GRH's IPv4 header names the sender and the group it was sent to.
    const uint8_t src[4] = {198, 18, 0, 1}, dst[4] = {230, 18, 0, 1};
    EXPECT_EQ(std::memcmp(b_.buf.data() + at + 32, src, 4), 0);
    EXPECT_EQ(std::memcmp(b_.buf.data() + at + 36, dst, 4), 0);
  }
  EXPECT_EQ(nic(b_).counters().mcast_rx, 1u);
  EXPECT_EQ(nic(b_).counters().mcast_rx_delivered, 2u);
  EXPECT_EQ(nic(a_).counters().mcast_tx, 1u);
  // m2 leaves: the next datagram reaches m1 only; the one after that, with m1's QP destroyed
  // (which leaves its groups), nobody but other_qkey's (which drops it for its Q_Key).
  ASSERT_EQ(nic(b_).detach_mcast(&b_.owner, m2->qpn(), kGroup), 0);
  EXPECT_EQ(nic(b_).detach_mcast(&b_.owner, m2->qpn(), kGroup), EINVAL);
  RecvWqe r;
  r.wr_id = 300;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 40000, 2000);
  ASSERT_EQ(m1->post_recv(r), 0);
  r.wr_id = 301;
  r.sge[0] = sge(b_, 42000, 2000);
  ASSERT_EQ(m2->post_recv(r), 0);
  s.wr_id = 10;
  ASSERT_EQ(sender->post_send(s), 0);
  ASSERT_EQ(run_until(a_, 1).size(), 1u);
  for (int i = 0; i < 200; ++i) step();
  ASSERT_EQ(b_.cq->poll(8, c), 1);
  EXPECT_EQ(c[0].wr_id, 300u);
  ASSERT_EQ(nic(b_).destroy_qp(&b_.owner, m1->qpn()), 0);
  m1.reset();
  EXPECT_EQ(nic(b_).mcast_groups(), 1u);  // other_qkey is still in it
  ASSERT_EQ(nic(b_).detach_mcast(&b_.owner, other_qkey->qpn(), kGroup), 0);
  EXPECT_EQ(nic(b_).mcast_groups(), 0u);
  // A group nobody here joined: not taken (raw flows may want the frame); a malformed one to a
  // group with members: dropped and counted.
  ASSERT_EQ(nic(b_).attach_mcast(&b_.owner, m2->qpn(), kGroup), 0);
  const uint8_t junk[90] = {1, 10};
  EXPECT_FALSE(nic(b_).on_datagram(kIpA, 0xE6120002, junk));
  EXPECT_EQ(nic(b_).counters().mcast_rx_no_member, 1u);
  EXPECT_TRUE(nic(b_).on_datagram(kIpA, kGroup, junk));
  EXPECT_EQ(nic(b_).counters().mcast_rx_malformed, 1u);
  nic(b_).end_rx(clock_);
  EXPECT_EQ(b_.cq->poll(8, c), 0);
  EXPECT_EQ(b_.owner.events.size(), 0u);
}

TEST_F(NicTest, BlockSelfMulticastLoopbackKeepsOnlyTheSendersOwnDatagramsFromIt) {
  constexpr uint32_t kGroup = 0xE6120009;
  auto make = [&](uint32_t flags, QpType type = QpType::kUd) {
    return std::make_unique<TestQp>(nic(a_), &a_.owner, a_.pd, *a_.cq, *a_.cq, caps(8),
                                    type, nullptr, 0, flags);
  };
  EXPECT_EQ(make(hostif::kQpBlockSelfMcast, QpType::kRc)->err, EINVAL) << "UD QPs only";
  EXPECT_EQ(make(2)->err, EINVAL) << "unknown flags";
  auto blocked = make(hostif::kQpBlockSelfMcast), open = make(0), other = make(0);
  std::vector<TestQp*> all = {blocked.get(), open.get(), other.get()};
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(all[i]->err, 0);
    bring_up(*all[i], 0, 0, 0x77);
    ASSERT_EQ(nic(a_).attach_mcast(&a_.owner, all[i]->qpn(), kGroup), 0);
    for (uint64_t k = 0; k < 2; ++k) {
      RecvWqe r;
      r.wr_id = 1000 + i * 10 + k;
      r.num_sge = 1;
      r.sge[0] = sge(a_, 30000 + (i * 2 + k) * 1000, 1000);
      ASSERT_EQ(all[i]->post_recv(r), 0);
    }
  }
  auto send_from = [&](TestQp& q, uint64_t id) {
    SendWqe s;
    s.signaled = true;
    s.num_sge = 1;
    s.sge[0] = sge(a_, 0, 100);
    s.ud_ip = kGroup;
    s.ud_qpn = 0xffffff;
    s.ud_qkey = 0x77;
    s.wr_id = id;
    ASSERT_EQ(q.post_send(s), 0);
  };
  // blocked's datagram: open and other take it, blocked does not. open's: all three.
  send_from(*blocked, 1);
  auto c1 = run_until(a_, 3);
  send_from(*open, 2);
  auto c2 = run_until(a_, 4);
  for (int i = 0; i < 100; ++i) step();
  Cqe extra[4];
  EXPECT_EQ(a_.cq->poll(4, extra), 0);
  auto receivers = [](const std::vector<Cqe>& cs) {
    std::vector<uint32_t> q;
    for (const Cqe& c : cs)
      if (c.opcode == WcOpcode::kRecv) q.push_back(c.qp_num);
    std::sort(q.begin(), q.end());
    return q;
  };
  std::vector<uint32_t> want1 = {open->qpn(), other->qpn()}, want2 = {blocked->qpn(), open->qpn(), other->qpn()};
  std::sort(want1.begin(), want1.end());
  std::sort(want2.begin(), want2.end());
  EXPECT_EQ(receivers(c1), want1);
  EXPECT_EQ(receivers(c2), want2);
}

// A sender faster than its port: datagrams to a group wait in the device for room on the link
// and each WQE completes when its frame left, none lost while the far end drains; a far end that
// stops draining for more than 100 ms loses the rest, so that no WQE waits forever.
TEST_F(NicTest, GroupDatagramsWaitForRoomOnThePortAndCompleteAsTheyLeave) {
  io::MemLinkConfig lc;
  lc.queue_frames = 16;
  build(lc);
  constexpr uint32_t kGroup = 0xE6120005;
  constexpr int kN = 60;
  auto sender = extra_qp(a_, QpType::kUd, nullptr);
  auto member = extra_qp(b_, QpType::kUd, nullptr);
  bring_up(*sender, 0, 0, 0x11);
  bring_up(*member, 0, 0, 0x11);
  ASSERT_EQ(nic(b_).attach_mcast(&b_.owner, member->qpn(), kGroup), 0);
  for (int i = 0; i < kN; ++i) a_.buf[i * 100] = static_cast<uint8_t>(i + 1);
  auto post_all = [&](uint64_t base) {
    for (int i = 0; i < kN; ++i) {
      RecvWqe r;
      r.wr_id = base + i;
      r.num_sge = 1;
      r.sge[0] = sge(b_, 100000 + i * 200, 200);
      ASSERT_EQ(member->post_recv(r), 0);
    }
    for (int i = 0; i < kN; ++i) {
      SendWqe s;
      s.signaled = true;
      s.num_sge = 1;
      s.sge[0] = sge(a_, i * 100, 100);
      s.ud_ip = kGroup;
      s.ud_qpn = 0xffffff;
      s.ud_qkey = 0x11;
      s.wr_id = base + i;
      ASSERT_EQ(sender->post_send(s), 0);
    }
  };
  auto progress_a_only = [&](int passes, std::chrono::microseconds each) {
    std::vector<Cqe> got;
    for (int i = 0; i < passes; ++i) {
      clock_ += each;
      a_.dev->progress(clock_);
      Cqe c[8];
      const int n = a_.cq->poll(8, c);
      got.insert(got.end(), c, c + n);
    }
    return got;
  };
  const auto& link_a = a_.dev->layer->counters();
  post_all(1000);
  // The far device does not poll: the link holds 16 frames (an ARP request may be one of them),
  // and as many WQEs complete, in order.
  auto first = progress_a_only(50, std::chrono::microseconds(10));
  ASSERT_GE(first.size(), 15u);
  ASSERT_LE(first.size(), 16u);
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i].wr_id, 1000 + i);
    EXPECT_EQ(first[i].status, WcStatus::kSuccess);
  }
  EXPECT_EQ(link_a.tx_mcast_dropped, 0u);
  // Both poll: the rest leave as the far end takes what arrived; every datagram arrives once.
  std::vector<Cqe> sends = first, recvs;
  for (int i = 0; i < 20000 && (sends.size() < kN || recvs.size() < kN); ++i) {
    step();
    Cqe c[8];
    int n = a_.cq->poll(8, c);
    sends.insert(sends.end(), c, c + n);
    n = b_.cq->poll(8, c);
    recvs.insert(recvs.end(), c, c + n);
  }
  ASSERT_EQ(sends.size(), size_t{kN});
  ASSERT_EQ(recvs.size(), size_t{kN});
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(sends[i].wr_id, 1000u + i);
    EXPECT_EQ(recvs[i].status, WcStatus::kSuccess);
    EXPECT_EQ(recvs[i].byte_len, kGrhLen + 100);
    EXPECT_EQ(b_.buf[100000 + (recvs[i].wr_id - 1000) * 200 + kGrhLen], i + 1);
  }
  EXPECT_EQ(link_a.tx_mcast_dropped, 0u);
  EXPECT_EQ(nic(b_).counters().mcast_rx_delivered, uint64_t{kN});
  // The far device stops polling for good: what the link holds leaves, the rest are lost once
  // the port had no room for 100 ms, and every WQE completes.
  post_all(2000);
  auto stuck = progress_a_only(300, std::chrono::milliseconds(1));
  EXPECT_EQ(stuck.size(), size_t{kN});
  for (const Cqe& c : stuck) EXPECT_EQ(c.status, WcStatus::kSuccess);
  auto late = run_until(b_, kN, 2000);
  EXPECT_GE(late.size(), 15u);
  EXPECT_LE(late.size(), 16u);
  EXPECT_EQ(link_a.tx_mcast_dropped, kN - late.size());
}

TEST_F(NicTest, MulticastGroupsAndMembersAreBoundedAsQueryDeviceSays) {
  auto q = extra_qp(b_, QpType::kUd, nullptr);
  for (uint32_t g = 0; g < hostif::kMaxMcastGroups; ++g)
    ASSERT_EQ(nic(b_).attach_mcast(&b_.owner, q->qpn(), 0xE7000000 + g), 0) << g;
  EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, q->qpn(), 0xE8000000), ENOMEM);
  EXPECT_EQ(nic(b_).mcast_groups(), hostif::kMaxMcastGroups);
  EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, q->qpn(), 0xE7000000), 0) << "already attached";
  ASSERT_EQ(nic(b_).destroy_qp(&b_.owner, q->qpn()), 0);
  EXPECT_EQ(nic(b_).mcast_groups(), 0u) << "a destroyed QP leaves every group";
  std::vector<std::unique_ptr<TestQp>> qps;
  for (uint32_t i = 0; i <= hostif::kMaxMcastQpAttach; ++i) {
    qps.push_back(std::make_unique<TestQp>(nic(b_), &b_.owner, b_.pd, *b_.cq, *b_.cq, caps(2, 1, 0),
                                           QpType::kUd));
    ASSERT_EQ(qps.back()->err, 0);
    EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, qps.back()->qpn(), 0xE7000001),
              i < hostif::kMaxMcastQpAttach ? 0 : ENOMEM) << i;
  }
  for (auto& x : qps) ASSERT_EQ(nic(b_).destroy_qp(&b_.owner, x->qpn()), 0);
  EXPECT_EQ(nic(b_).mcast_groups(), 0u);
  // A link whose plane 0 is a UDP socket carries no Ethernet frames: the kernel owns its groups.
  auto u = extra_qp(b_, QpType::kUd, nullptr);
  nic(b_).set_raw_ethernet(false);
  EXPECT_EQ(nic(b_).attach_mcast(&b_.owner, u->qpn(), 0xE7000001), EOPNOTSUPP);
}

// IGMP (wire.md §8): the device reports a group when its first QP joins, leaves it when the last
// goes (detached or destroyed), answers general and group queries, and drops a malformed query.
// The far end of the link is a bare port: the test reads and writes its frames.
struct IgmpSeen {
  io::MacAddr dst_mac{};
  uint32_t dst_ip = 0;
  uint8_t type = 0;
  uint32_t group = 0;
};

std::vector<IgmpSeen> igmp_frames(Device& dev, io::Port& peer, transport::Time now) {
  for (int i = 0; i < 4; ++i) dev.progress(now);
  std::vector<IgmpSeen> out;
  std::array<io::RxFrame, 64> rx;
  const uint32_t n = peer.rx_burst(rx);
  for (uint32_t i = 0; i < n; ++i) {
    std::span<const uint8_t> f(rx[i].data, rx[i].len);
    const wire::FrameInfo p = wire::parse_frame(f, 4793);
    if (p.ip_proto != wire::kIpProtoIgmp) continue;
    EXPECT_EQ(p.kind, wire::FrameKind::kOther);  // parsed whole: IPv4 checksum and lengths good
    const uint8_t* ip = rx[i].data + wire::kEthHeaderLen;
    EXPECT_EQ(ip[0], 0x46) << "IPv4 with one option word";
    EXPECT_EQ(ip[8], 1) << "TTL 1";
    EXPECT_EQ(load_be32(ip + 20), 0x94040000u) << "Router Alert";
    EXPECT_EQ(p.src_ip, kIpA);
    wire::IgmpMessage m;
    EXPECT_TRUE(wire::parse_igmp(p.ip_payload, m)) << "IGMP checksum";
    EXPECT_EQ(p.ip_payload.size(), 8u);
    out.push_back({p.dst_mac, p.dst_ip, static_cast<uint8_t>(m.type), m.group});
  }
  peer.release({rx.data(), n});
  return out;
}

void send_query(io::Port& peer, uint32_t group, bool corrupt = false) {
  io::TxFrame t;
  ASSERT_TRUE(peer.alloc_tx(t, wire::kIgmpFrameLen));
  const uint32_t dst = group ? group : wire::kAllSystemsGroup;
  ASSERT_EQ(wire::build_igmp({t.data, t.capacity}, io::MacAddr{2, 0, 0, 0, 0, 9}, 0xC6120009,
                             wire::IgmpType::kV2Report, dst),
            wire::kIgmpFrameLen);
  uint8_t* g = t.data + wire::kEthHeaderLen + 24;
  g[0] = static_cast<uint8_t>(wire::IgmpType::kQuery);
  g[1] = 100;  // 10 s
  store_be32(g + 4, group);
  store_be16(g + 2, 0);
  store_be16(g + 2, static_cast<uint16_t>(~wire::ones_complement_sum({g, 8})));
  if (corrupt) g[3] ^= 0x40;
  t.len = wire::kIgmpFrameLen;
  peer.tx_burst({&t, 1});
}

TEST(NicIgmp, JoinsLeavesAndQueriesAreToldToTheNetwork) {
  constexpr uint32_t kG1 = 0xE6120001, kG2 = 0xE6120002, kG3 = 0xE6120003;  // 230.18.0.x
  constexpr uint8_t kReport = 0x16, kLeave = 0x17;
  auto [pa, peer] = io::make_mem_link(test_link_config());
  std::vector<std::unique_ptr<io::Port>> ports;
  ports.push_back(std::move(pa));
  Device dev(test_link("a", kIpA), std::move(ports), 1);
  Nic& nic = *dev.nic;
  TestOwner owner;
  uint32_t pd = 0;
  ASSERT_EQ(nic.alloc_pd(&owner, &pd), 0);
  TestCq cq(nic, &owner, 64);
  auto q1 = std::make_unique<TestQp>(nic, &owner, pd, cq, cq, caps(4, 1, 0), QpType::kUd);
  auto q2 = std::make_unique<TestQp>(nic, &owner, pd, cq, cq, caps(4, 1, 0), QpType::kUd);
  ASSERT_EQ(q1->err, 0);
  ASSERT_EQ(q2->err, 0);
  transport::Time t{};
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty());
  // The first member reports the group, to the group's own addresses; more members do not.
  ASSERT_EQ(nic.attach_mcast(&owner, q1->qpn(), kG1), 0);
  auto f = igmp_frames(dev, *peer, t);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].type, kReport);
  EXPECT_EQ(f[0].group, kG1);
  EXPECT_EQ(f[0].dst_ip, kG1);
  EXPECT_EQ(f[0].dst_mac, wire::multicast_mac(kG1));
  ASSERT_EQ(nic.attach_mcast(&owner, q2->qpn(), kG1), 0);
  ASSERT_EQ(nic.attach_mcast(&owner, q1->qpn(), kG1), 0);  // again: one attachment
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty());
  ASSERT_EQ(nic.attach_mcast(&owner, q2->qpn(), kG2), 0);
  f = igmp_frames(dev, *peer, t);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].group, kG2);
  // A general query: every group is reported. A group's query: only a group with members.
  send_query(*peer, 0);
  f = igmp_frames(dev, *peer, t);
  ASSERT_EQ(f.size(), 2u);
  std::vector<uint32_t> groups = {f[0].group, f[1].group};
  std::sort(groups.begin(), groups.end());
  EXPECT_EQ(groups, (std::vector<uint32_t>{kG1, kG2}));
  EXPECT_EQ(f[0].type, kReport);
  EXPECT_EQ(f[1].type, kReport);
  send_query(*peer, kG3);
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty());
  send_query(*peer, kG2);
  f = igmp_frames(dev, *peer, t);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].group, kG2);
  send_query(*peer, 0, /*corrupt=*/true);
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty());
  EXPECT_EQ(dev.layer->counters().igmp_queries, 3u);
  EXPECT_EQ(dev.layer->counters().igmp_rx_malformed, 1u);
  // A plane set up again reports every group (a switch forgets a port's groups when its link
  // goes down).
  ASSERT_TRUE(dev.layer->set_plane_admin(0, false));
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty());
  ASSERT_TRUE(dev.layer->set_plane_admin(0, true));
  EXPECT_EQ(igmp_frames(dev, *peer, t).size(), 2u);
  // The last member's detach leaves the group (to 224.0.0.2); a destroyed QP leaves its own.
  ASSERT_EQ(nic.detach_mcast(&owner, q1->qpn(), kG1), 0);
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty());
  ASSERT_EQ(nic.detach_mcast(&owner, q2->qpn(), kG1), 0);
  f = igmp_frames(dev, *peer, t);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].type, kLeave);
  EXPECT_EQ(f[0].group, kG1);
  EXPECT_EQ(f[0].dst_ip, wire::kAllRoutersGroup);
  EXPECT_EQ(f[0].dst_mac, wire::multicast_mac(wire::kAllRoutersGroup));
  ASSERT_EQ(nic.destroy_qp(&owner, q2->qpn()), 0);
  f = igmp_frames(dev, *peer, t);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].type, kLeave);
  EXPECT_EQ(f[0].group, kG2);
  send_query(*peer, 0);
  EXPECT_TRUE(igmp_frames(dev, *peer, t).empty()) << "no group left to report";
  EXPECT_EQ(dev.layer->counters().igmp_reports, 7u);
  EXPECT_EQ(dev.layer->counters().igmp_leaves, 2u);
}

TEST_F(NicTest, RetriesExhaustedPutTheQpInErrorAndRaiseQpFatal) {
  auto q = extra_qp(a_, QpType::kRc, nullptr);
  bring_up(*q, 0xC6120009, 0x123);  // nobody answers at .9
  SendWqe w;
  w.wr_id = 5;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 64);
  w.remote_addr = 0x1000;
  w.rkey = 1;
  ASSERT_EQ(q->post_send(w), 0);
  std::vector<Cqe> got;
  for (int i = 0; i < 20000 && got.empty(); ++i) {
    clock_ += std::chrono::milliseconds(1);
    a_.dev->progress(clock_);
    Cqe c[4];
    int n = a_.cq->poll(4, c);
    got.insert(got.end(), c, c + n);
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, WcStatus::kRetryExcErr);
  EXPECT_EQ(q->state(), QpState::kErr);
  EXPECT_EQ(a_.owner.count(AsyncEvent::kQpFatal, q->handle()), 1u);
}

TEST_F(NicTest, ResponderAccessViolationRaisesQpAccessErr) {
  auto q = extra_qp(b_, QpType::kRc, nullptr);
  a_.qp->set_state(QpState::kReset);
  connect_to(a_, q->qpn(), kIpB);
  bring_up(*q, kIpA, a_.qp->qpn());
  SendWqe w;
  w.wr_id = 6;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 64);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key + 0x100;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(q->state(), QpState::kErr);
  EXPECT_EQ(b_.owner.count(AsyncEvent::kQpAccessErr, q->handle()), 1u);
  EXPECT_EQ(b_.owner.count(AsyncEvent::kQpFatal), 0u);
}

TEST_F(NicTest, SendToADestroyedQpRunsOutOfRetriesInsteadOfANak) {
  // As on RC hardware: no QP, no answer. The requester learns nothing until its retries run
  // out (a peer that merely finished and tore down must not fail a straggler at once).
  ASSERT_EQ(nic(b_).destroy_qp(&b_.owner, b_.qp->qpn()), 0);
  SendWqe s;
  s.wr_id = 31;
  s.op = WqeOp::kSend;
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 100);
  ASSERT_EQ(a_.qp->post_send(s), 0);
  auto c = run_until(a_, 1, 200000);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].wr_id, 31u);
  EXPECT_EQ(c[0].status, WcStatus::kRetryExcErr);
  EXPECT_GT(nic(b_).engine().stats().drop_unreachable, 0u);
  EXPECT_EQ(nic(b_).engine().stats().naks_sent, 0u);
}

// --- application memory (docs/design.md, "Application memory") ---------------------------

// Memory that counts the calls the NIC makes, fails every access that touches [bad, bad+len),
// and records what the CQ showed when data was written.
class ProbeMemory final : public Memory {
 public:
  size_t read(std::span<const Access> a) override {
    ++reads;
    return run(a, false);
  }
  bool probes_pass = false;  // one-byte reads (the READ probe) succeed even in the bad range
  size_t write(std::span<const Access> a) override {
    ++writes;
    if (watch) heads_at_write.push_back(watch->head.load());
    return run(a, true);
  }
  uint64_t bad = 0, bad_len = 0;
  int reads = 0, writes = 0;
  hostif::CqHeader* watch = nullptr;
  std::vector<uint32_t> heads_at_write;

 private:
  size_t run(std::span<const Access> a, bool write) {
    for (size_t i = 0; i < a.size(); ++i) {
      const Access& x = a[i];
      const bool probe = !write && x.len == 1 && probes_pass;
      if (!probe && x.addr < bad + bad_len && x.addr + x.len > bad) return i;
      if (write) std::memcpy(reinterpret_cast<void*>(x.addr), x.local, x.len);
      else std::memcpy(x.local, reinterpret_cast<const void*>(x.addr), x.len);
    }
    return a.size();
  }
};

class NicMemoryTest : public NicTest {
 protected:
  void SetUp() override {
    a_.owner = TestOwner(&mem_a_);
    b_.owner = TestOwner(&mem_b_);
    NicTest::SetUp();
  }
  ProbeMemory mem_a_, mem_b_;
};

TEST_F(NicMemoryTest, WritesOfAPassGoInOneCallPerAddressSpace) {
  // 64 KiB in 64 packets of 1 KiB: every packet a burst delivers is written by one call.
  for (size_t i = 0; i < 65536; ++i) a_.buf[i] = static_cast<uint8_t>(i * 5);
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 65536);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(a_.buf.data(), b_.buf.data(), 65536), 0);
  const uint64_t packets = nic(b_).engine().stats().rx_packets;
  EXPECT_GE(packets, 64u);
  EXPECT_LE(mem_b_.writes * 8, static_cast<int>(packets)) << "writes are not batched";
  EXPECT_LE(mem_a_.reads * 8, static_cast<int>(packets)) << "reads are not batched";
}

TEST_F(NicMemoryTest, AReceiveCompletesOnlyAfterItsDataIsWritten) {
  mem_b_.watch = b_.cq->header();
  RecvWqe r;
  r.wr_id = 3;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 4096);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  std::memset(a_.buf.data(), 0x42, 512);
  SendWqe s;
  s.wr_id = 4;
  s.op = WqeOp::kSend;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 512);
  ASSERT_EQ(a_.qp->post_send(s), 0);
  auto c = run_until(b_, 1);
  ASSERT_EQ(c.size(), 1u);
  ASSERT_FALSE(mem_b_.heads_at_write.empty());
  // When the only write of the message happened, the completion was not visible yet.
  EXPECT_EQ(mem_b_.heads_at_write.back(), 0u);
  EXPECT_EQ(b_.cq->header()->head.load(), 1u);
}

TEST_F(NicMemoryTest, WriteIntoMemoryThatIsGoneIsARemoteAccessErrorAndNoCrash) {
  mem_b_.bad = reinterpret_cast<uint64_t>(b_.buf.data()) + 8192;
  mem_b_.bad_len = 4096;
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 16384);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(b_.qp->state(), QpState::kErr);
  EXPECT_EQ(b_.owner.count(AsyncEvent::kQpAccessErr, b_.qp->handle()), 1u);
  EXPECT_GT(nic(b_).counters().memory_faults, 0u);
}

TEST_F(NicMemoryTest, ReadFromMemoryThatIsGoneIsARemoteAccessError) {
  // A page of the region is gone before the READ arrives: the probe finds it.
  mem_b_.bad = (reinterpret_cast<uint64_t>(b_.buf.data()) + 4096 * 3) & ~uint64_t{4095};
  mem_b_.bad_len = 4096;
  SendWqe w;
  w.wr_id = 2;
  w.op = WqeOp::kRead;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 20000);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(b_.qp->state(), QpState::kErr);
}

TEST_F(NicMemoryTest, SendFromABufferThatIsGoneFailsLocally) {
  mem_a_.bad = reinterpret_cast<uint64_t>(a_.buf.data());
  mem_a_.bad_len = 64;
  RecvWqe r;
  r.wr_id = 9;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 4096);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  SendWqe s;
  s.wr_id = 5;
  s.op = WqeOp::kSend;
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 100);
  ASSERT_EQ(a_.qp->post_send(s), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kLocProtErr);
  EXPECT_EQ(a_.qp->state(), QpState::kErr);
  Cqe none[2];
  EXPECT_EQ(b_.cq->poll(2, none), 0) << "garbage reached the peer";
}

// --- owners ----------------------------------------------------------------------------------

TEST_F(NicTest, AnOwnerReachesOnlyItsOwnObjects) {
  TestOwner other;
  uint32_t pd;
  ASSERT_EQ(nic(a_).alloc_pd(&other, &pd), 0);
  EXPECT_EQ(nic(a_).destroy_qp(&other, a_.qp->qpn()), EINVAL);
  EXPECT_EQ(nic(a_).destroy_cq(&other, a_.cq->id), EINVAL);
  EXPECT_EQ(nic(a_).dereg_mr(&other, a_.key), EINVAL);
  EXPECT_EQ(nic(a_).dealloc_pd(&other, a_.pd), EINVAL);
  hostif::ModifyQpReq m;
  m.qpn = a_.qp->qpn();
  m.what = hostif::kModState;
  m.state = QpState::kErr;
  EXPECT_EQ(nic(a_).modify_qp(&other, m), EINVAL);
  uint32_t lkey, rkey;
  EXPECT_EQ(nic(a_).reg_mr(&other, a_.pd, 4096, 4096, kLocalWrite, &lkey, &rkey), EINVAL);
  // A QP of another owner's PD, or with another owner's CQ, cannot be made.
  TestCq cq(nic(a_), &other, 8);
  TestQp theirs(nic(a_), &other, a_.pd, cq, cq, caps(4));
  EXPECT_EQ(theirs.err, EINVAL);
  TestQp mixed(nic(a_), &other, pd, *a_.cq, cq, caps(4));
  EXPECT_EQ(mixed.err, EINVAL);
  EXPECT_EQ(a_.qp->state(), QpState::kRts);
}

TEST_F(NicTest, ReleaseReclaimsEverythingOfAnOwnerAndItsPeerGetsAnErrorCompletion) {
  ASSERT_TRUE(nic(b_).owns_anything(&b_.owner));
  nic(b_).release(&b_.owner);
  EXPECT_FALSE(nic(b_).owns_anything(&b_.owner));
  EXPECT_EQ(nic(b_).qp_count(), 0u);
  EXPECT_EQ(nic(b_).mrs().size(), 0u);
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 64);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1, 200000);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRetryExcErr);
}

TEST_F(NicMemoryTest, AReadWhoseAnswerCannotBeReadFailsWithinTheQpTimeout) {
  // The region's memory goes away after the READ was probed: the responder abandons the answer
  // (its QP fails), and the requester's READ fails instead of waiting forever.
  mem_b_.bad = reinterpret_cast<uint64_t>(b_.buf.data()) + 100;
  mem_b_.bad_len = 1;
  mem_b_.probes_pass = true;
  hostif::QpRemote r;
  r.ip = kIpB;
  r.qpn = b_.qp->qpn();
  r.timeout = 10;  // 4.096 us * 2^10 = 4.2 ms, x (retry_cnt 1 + 1)
  r.retry_cnt = 1;
  r.max_rd_atomic = 16;
  a_.qp->set_remote(r);
  SendWqe w;
  w.wr_id = 7;
  w.op = WqeOp::kRead;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 4096);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  const transport::Time start = clock_;
  auto got = run_until(a_, 1, 5000);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, WcStatus::kRetryExcErr);
  EXPECT_LE(clock_ - start, std::chrono::milliseconds(20));
  EXPECT_EQ(b_.qp->state(), QpState::kErr);
}

TEST_F(NicTest, APeerReclaimedMidStreamEndsTheStreamWithRetryExc) {
  // The receiver's process dies while WRITEs are in flight (its engine reclaims its QP): the
  // writer gets IBV_WC_RETRY_EXC_ERR within its QP's timeout, not a hang, even though the
  // connection to that device stays alive for its other streams.
  sq_depth_ = 256;
  build(test_link_config());
  hostif::QpRemote r;
  r.ip = kIpB;
  r.qpn = b_.qp->qpn();
  r.timeout = 10;  // 4.2 ms x 8
  r.retry_cnt = 7;
  r.max_rd_atomic = 16;
  a_.qp->set_remote(r);
  SendWqe w;
  w.op = WqeOp::kWrite;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 65536);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  for (int i = 0; i < 200; ++i) {
    w.wr_id = static_cast<uint64_t>(i);
    w.signaled = i % 8 == 7;
    ASSERT_EQ(a_.qp->post_send(w), 0);
  }
  for (int i = 0; i < 20; ++i) step();
  nic(b_).release(&b_.owner);
  const transport::Time killed = clock_;
  std::vector<Cqe> got;
  for (int i = 0; i < 100000; ++i) {
    step();
    Cqe c[8];
    const int n = a_.cq->poll(8, c);
    got.insert(got.end(), c, c + n);
    bool err = false;
    for (const Cqe& e : got) err |= e.status != WcStatus::kSuccess;
    if (err) break;
  }
  bool retry_exc = false;
  for (const Cqe& e : got) retry_exc |= e.status == WcStatus::kRetryExcErr;
  ASSERT_TRUE(retry_exc) << "no error completion within " << (clock_ - killed).count() / 1000000 << " ms";
  EXPECT_LE(clock_ - killed, std::chrono::milliseconds(100));
}

TEST_F(NicTest, AnIdleQpHoldsLittleEngineMemory) {
  // Per-QP engine state beyond the shared rings (docs/spec/congestion.md §7): a 64-deep RC QP.
  const size_t bytes = core_qp(a_, *a_.qp).state_bytes();
  std::printf("engine memory of an idle 64-deep RC QP: %zu bytes\n", bytes);
  EXPECT_LT(bytes, 8192u);
}

TEST_F(NicTest, ARegionRegisteredAtAnIovaIsReachedAtThatIovaLocallyAndRemotely) {
  // b's second region: bytes at b.buf + 8192 known to verbs as IOVA 0x10000000 (ibv_reg_mr_iova2).
  constexpr uint64_t kIova = 0x10000000;
  uint32_t lkey = 0, rkey = 0;
  ASSERT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, reinterpret_cast<uint64_t>(b_.buf.data()) + 8192,
                           4096, kIova, kAllAccess, &lkey, &rkey), 0);
  for (int i = 0; i < 64; ++i) a_.buf[i] = static_cast<uint8_t>(i + 1);
  SendWqe w = wqe(1, WqeOp::kWrite, sge(a_, 0, 64), kIova + 100, rkey);
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 8192 + 100, a_.buf.data(), 64), 0);
  // The region's own address is not its verbs address: out of bounds there.
  w.wr_id = 2;
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data()) + 8192;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemAccessErr);
  // Locally too: b sends from IOVA addresses of its region.
  build(test_link_config());
  ASSERT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, reinterpret_cast<uint64_t>(b_.buf.data()) + 8192,
                           4096, kIova, kAllAccess, &lkey, &rkey), 0);
  std::memset(b_.buf.data() + 8192 + 300, 0x5a, 32);
  RecvWqe r;
  r.wr_id = 3;
  r.num_sge = 1;
  r.sge[0] = sge(a_, 4096, 32);
  ASSERT_EQ(a_.qp->post_recv(r), 0);
  ASSERT_EQ(b_.qp->post_send(wqe(4, WqeOp::kSend, Sge{kIova + 300, 32, lkey})), 0);
  auto rc = run_until(a_, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
  EXPECT_EQ(a_.buf[4096], 0x5a);
  EXPECT_EQ(a_.buf[4096 + 31], 0x5a);
}

TEST_F(NicTest, ReregChangesAccessPdAndTranslationInPlaceAndARefusalChangesNothing) {
  Nic& n = nic(b_);
  const uint64_t base = reinterpret_cast<uint64_t>(b_.buf.data());
  uint32_t other_pd = 0;
  ASSERT_EQ(n.alloc_pd(&b_.owner, &other_pd), 0);
  auto write_to = [&](uint64_t addr) {
    EXPECT_EQ(a_.qp->post_send(wqe(addr, WqeOp::kWrite, sge(a_, 0, 8), addr, b_.key)), 0);
    auto c = run_until(a_, 1);
    return c.size() == 1 ? c[0].status : WcStatus::kGeneralErr;
  };
  // Access: no remote write any more.
  ASSERT_EQ(n.rereg_mr(&b_.owner, b_.key, kReregAccess, 0, 0, 0, kLocalWrite), 0);
  EXPECT_EQ(write_to(base), WcStatus::kRemAccessErr);
  build(test_link_config());
  // PD: the region leaves the QP's PD; a dealloc of the new PD is refused while it holds it.
  ASSERT_EQ(nic(b_).alloc_pd(&b_.owner, &other_pd), 0);
  ASSERT_EQ(nic(b_).rereg_mr(&b_.owner, b_.key, kReregPd, other_pd, 0, 0, 0), 0);
  EXPECT_EQ(nic(b_).dealloc_pd(&b_.owner, other_pd), EBUSY);
  EXPECT_EQ(write_to(base), WcStatus::kRemAccessErr);
  build(test_link_config());
  // Translation: the region now covers [base + 65536, + 4096) at that address.
  ASSERT_EQ(nic(b_).rereg_mr(&b_.owner, b_.key, kReregTranslation, 0, base + 65536, 4096, 0), 0);
  EXPECT_EQ(write_to(base + 65536 + 8), WcStatus::kSuccess);
  EXPECT_EQ(write_to(base), WcStatus::kRemAccessErr);
  // Refusals: unknown flags, no flag, a PD of nobody, a range too long: nothing changes.
  build(test_link_config());
  Nic& m = nic(b_);
  EXPECT_EQ(m.rereg_mr(&b_.owner, b_.key, 8, 0, 0, 0, 0), EINVAL);
  EXPECT_EQ(m.rereg_mr(&b_.owner, b_.key, 0, 0, 0, 0, 0), EINVAL);
  EXPECT_EQ(m.rereg_mr(&b_.owner, b_.key, kReregPd | kReregAccess, 999, 0, 0, kLocalWrite), EINVAL);
  EXPECT_EQ(m.rereg_mr(&b_.owner, b_.key, kReregTranslation, 0, base, uint64_t{1} << 40, 0), EINVAL);
  EXPECT_EQ(m.rereg_mr(&a_.owner, b_.key, kReregAccess, 0, 0, 0, kLocalWrite), EINVAL);
  EXPECT_EQ(write_to(base), WcStatus::kSuccess);
}

TEST_F(NicTest, AnImplicitOnDemandRegionCoversTheWholeAddressSpace) {
  uint32_t lkey = 0, rkey = 0;
  // Only with ON_DEMAND, at address 0, for everything.
  EXPECT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, 0, UINT64_MAX, kAllAccess, &lkey, &rkey), EINVAL);
  EXPECT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, 4096, UINT64_MAX, kAllAccess | kOnDemand, &lkey, &rkey),
            EINVAL);
  ASSERT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, 0, UINT64_MAX, kAllAccess | kOnDemand, &lkey, &rkey), 0);
  std::vector<uint8_t> elsewhere(256, 0);  // memory registered nowhere else
  for (int i = 0; i < 8; ++i) a_.buf[i] = static_cast<uint8_t>(0xa0 + i);
  ASSERT_EQ(a_.qp->post_send(wqe(1, WqeOp::kWrite, sge(a_, 0, 8),
                                 reinterpret_cast<uint64_t>(elsewhere.data()) + 16, rkey)),
            0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(elsewhere.data() + 16, a_.buf.data(), 8), 0);
  EXPECT_EQ(nic(b_).check_mr(&b_.owner, lkey, b_.pd, reinterpret_cast<uint64_t>(elsewhere.data()), 256), 0);
  EXPECT_EQ(nic(b_).check_mr(&b_.owner, lkey + 1, b_.pd, 0, 1), EFAULT);
}

TEST_F(NicTest, AResizedCqKeepsItsCompletionsAndRefusesToShrinkBelowWhatItHoldsOrIsOwed) {
  // Three signaled WRITEs complete into a's CQ; a fourth is posted and not yet carried out.
  auto write = [&](uint64_t wr_id) {
    ASSERT_EQ(a_.qp->post_send(wqe(wr_id, WqeOp::kWrite, sge(a_, 0, 8),
                                   reinterpret_cast<uint64_t>(b_.buf.data()), b_.key)),
              0);
  };
  for (uint64_t i = 1; i <= 3; ++i) write(i);
  for (int i = 0; i < 2000 && a_.cq->header()->head.load() < 3; ++i) step();
  ASSERT_EQ(a_.cq->header()->head.load(), 3u);
  write(4);
  EXPECT_EQ(a_.cq->resize(3), EINVAL) << "3 held + 1 owed do not fit in 3";
  EXPECT_EQ(a_.cq->resize(0), EINVAL);
  ASSERT_EQ(a_.cq->resize(4), 0);
  EXPECT_GE(a_.cq->header()->capacity, 4u);
  auto c = run_until(a_, 4);
  ASSERT_EQ(c.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_EQ(c[i].wr_id, i + 1);
  EXPECT_EQ(a_.cq->resize(1), 0) << "empty and owed nothing: any size";
  write(5);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].wr_id, 5u);
}

TEST_F(NicTest, ThePortGoesDownWhenItsPlaneIsTakenOutOfServiceOrLosesItsPeerAndComesBack) {
  Nic& n = nic(a_);
  for (int i = 0; i < 5; ++i) step();
  EXPECT_TRUE(n.port_active());
  EXPECT_FALSE(n.take_port_change());
  // The operator takes the only plane out of service: down, said once.
  ASSERT_TRUE(a_.dev->layer->set_plane_admin(0, false));
  for (int i = 0; i < 5; ++i) step();
  EXPECT_FALSE(n.port_active());
  EXPECT_TRUE(n.take_port_change());
  EXPECT_FALSE(n.take_port_change());
  ASSERT_TRUE(a_.dev->layer->set_plane_admin(0, true));
  for (int i = 0; i < 5; ++i) step();
  EXPECT_TRUE(n.port_active());
  EXPECT_TRUE(n.take_port_change());
  // The peer goes away: the carrier of a link that was up drops (checked every 10 ms).
  b_.qp.reset();
  b_.cq.reset();
  b_.dev.reset();
  for (int i = 0; i < 3000 && n.port_active(); ++i) {
    clock_ += std::chrono::microseconds(10);
    a_.dev->progress(clock_);
  }
  EXPECT_FALSE(n.port_active());
  EXPECT_TRUE(n.take_port_change());
}

TEST_F(NicTest, UnreliableConnectionsCarrySendsAndWritesButNoReads) {
  TestCq cqa(nic(a_), &a_.owner, 64), cqb(nic(b_), &b_.owner, 64);
  TestQp ua(nic(a_), &a_.owner, a_.pd, cqa, cqa, caps(16), QpType::kUc);
  TestQp ub(nic(b_), &b_.owner, b_.pd, cqb, cqb, caps(16), QpType::kUc);
  ASSERT_EQ(ua.err, 0);
  ASSERT_EQ(ub.err, 0);
  bring_up(ua, kIpB, ub.qpn());
  bring_up(ub, kIpA, ua.qpn());
  RecvWqe r;
  r.wr_id = 1;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 0, 64);
  ASSERT_EQ(ub.post_recv(r), 0);
  std::memset(a_.buf.data(), 0x3c, 64);
  ASSERT_EQ(ua.post_send(wqe(2, WqeOp::kSend, sge(a_, 0, 64))), 0);
  SendWqe s = wqe(3, WqeOp::kWrite, sge(a_, 0, 64),
                  reinterpret_cast<uint64_t>(b_.buf.data()) + 4096, b_.key);
  ASSERT_EQ(ua.post_send(s), 0);
  auto rc = run_until(cqb, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
  EXPECT_EQ(rc[0].byte_len, 64u);
  auto sc = run_until(cqa, 2);
  ASSERT_EQ(sc.size(), 2u);
  EXPECT_EQ(sc[1].status, WcStatus::kSuccess);
  EXPECT_EQ(b_.buf[4096 + 63], 0x3c);
  EXPECT_EQ(b_.buf[63], 0x3c);
  // A READ has no place on an unreliable connection: the WQE fails, and the QP with it.
  s.wr_id = 4;
  s.op = WqeOp::kRead;
  ASSERT_EQ(ua.post_send(s), 0);
  sc = run_until(cqa, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kLocQpOpErr);
}

// A bind WQE of window `rkey` onto [addr, addr + len) of the side's region (hostif::SendWqe).
SendWqe bind_wqe(uint64_t wr_id, uint32_t rkey, uint32_t new_rkey, uint32_t lkey, uint64_t addr,
                 uint64_t len, unsigned access) {
  SendWqe w;
  w.wr_id = wr_id;
  w.op = WqeOp::kBindMw;
  w.signaled = true;
  w.rkey = rkey;
  w.imm = new_rkey;
  w.remote_addr = addr;
  w.compare_add = len;
  w.swap = (uint64_t{lkey} << 32) | access;
  return w;
}

class NicWindowTest : public NicTest {
 protected:
  // a writes 8 bytes to b at addr through rkey; the completion's status.
  WcStatus write_to(uint64_t addr, uint32_t rkey, uint64_t wr_id = 100) {
    EXPECT_EQ(a_.qp->post_send(wqe(wr_id, WqeOp::kWrite, sge(a_, 0, 8), addr, rkey)), 0);
    auto c = run_until(a_, 1);
    return c.size() == 1 ? c[0].status : WcStatus::kGeneralErr;
  }
  // b's QP carries out w (a bind or an invalidation); its completion.
  Cqe on_b(const SendWqe& w) {
    EXPECT_EQ(b_.qp->post_send(w), 0);
    auto c = run_until(b_, 1);
    return c.size() == 1 ? c[0] : Cqe{};
  }
  uint64_t base() { return reinterpret_cast<uint64_t>(b_.buf.data()); }
  static constexpr unsigned kWinAccess = kRemoteWrite | kRemoteRead;
};

TEST_F(NicWindowTest, AType1WindowReachesOnlyWhatItIsBoundToAndAnEmptyBindClosesIt) {
  uint32_t mw = 0;
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 1, &mw), 0);
  EXPECT_EQ(write_to(base(), mw), WcStatus::kRemAccessErr) << "an unbound window reaches nothing";
  build(test_link_config());
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 1, &mw), 0);
  // b's region allows windows (kAllAccess has kMwBind).
  const uint32_t k1 = (mw & ~0xffu) | ((mw + 1) & 0xff);
  Cqe c = on_b(bind_wqe(1, mw, k1, b_.key, base() + 4096, 4096, kWinAccess));
  EXPECT_EQ(c.status, WcStatus::kSuccess);
  EXPECT_EQ(c.opcode, WcOpcode::kBindMw);
  EXPECT_EQ(write_to(base() + 4096 + 8, k1), WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 4096 + 8, a_.buf.data(), 8), 0);
  // The region's region is not the window's: outside it, and through the old key, no access.
  build(test_link_config());
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 1, &mw), 0);
  const uint32_t k2 = (mw & ~0xffu) | ((mw + 7) & 0xff);
  ASSERT_EQ(on_b(bind_wqe(1, mw, k2, b_.key, base() + 4096, 4096, kWinAccess)).status,
            WcStatus::kSuccess);
  EXPECT_EQ(nic(b_).dereg_mr(&b_.owner, b_.key), EBUSY) << "a window is bound to it";
  EXPECT_EQ(write_to(base(), k2), WcStatus::kRemAccessErr);
  build(test_link_config());
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 1, &mw), 0);
  ASSERT_EQ(on_b(bind_wqe(1, mw, mw + 1, b_.key, base(), 4096, kWinAccess)).status, WcStatus::kSuccess);
  ASSERT_EQ(on_b(bind_wqe(2, mw + 1, mw + 2, 0, 0, 0, 0)).status, WcStatus::kSuccess);  // empty
  EXPECT_EQ(write_to(base(), mw + 2), WcStatus::kRemAccessErr);
  EXPECT_EQ(nic(b_).dereg_mr(&b_.owner, b_.key), 0) << "nothing is bound to it any more";
}

TEST_F(NicWindowTest, AType2WindowServesOnlyItsQpAndIsInvalidatedLocallyRemotelyOrByDealloc) {
  uint32_t mw = 0;
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 2, &mw), 0);
  const uint32_t k = mw + 1;
  ASSERT_EQ(on_b(bind_wqe(1, mw, k, b_.key, base(), 65536, kWinAccess)).status, WcStatus::kSuccess);
  // Bound to b's QP: a's QP (connected to it) reaches it.
  EXPECT_EQ(write_to(base() + 16, k), WcStatus::kSuccess);
  // A second bind of a bound type 2 window fails the bind, and the QP.
  Cqe c = on_b(bind_wqe(2, k, k + 1, b_.key, base(), 64, kWinAccess));
  EXPECT_EQ(c.status, WcStatus::kMwBindErr);
  EXPECT_EQ(b_.qp->state(), QpState::kErr);

  // Local invalidation.
  build(test_link_config());
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 2, &mw), 0);
  ASSERT_EQ(on_b(bind_wqe(1, mw, mw + 1, b_.key, base(), 65536, kWinAccess)).status, WcStatus::kSuccess);
  SendWqe inv;
  inv.wr_id = 3;
  inv.op = WqeOp::kLocalInv;
  inv.signaled = true;
  inv.rkey = mw + 1;
  c = on_b(inv);
  EXPECT_EQ(c.status, WcStatus::kSuccess);
  EXPECT_EQ(c.opcode, WcOpcode::kLocalInv);
  EXPECT_EQ(write_to(base(), mw + 1), WcStatus::kRemAccessErr);

  // Remote invalidation: a's SEND_WITH_INV names the window; b's receive says so.
  build(test_link_config());
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 2, &mw), 0);
  ASSERT_EQ(on_b(bind_wqe(1, mw, mw + 1, b_.key, base(), 65536, kWinAccess)).status, WcStatus::kSuccess);
  RecvWqe r;
  r.wr_id = 4;
  r.num_sge = 1;
  r.sge[0] = sge(b_, 8192, 64);
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  ASSERT_EQ(a_.qp->post_send(wqe(5, WqeOp::kSendInv, sge(a_, 0, 32), 0, mw + 1)), 0);
  auto rc = run_until(b_, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
  EXPECT_TRUE(rc[0].wc_flags & hostif::kWcWithInv);
  EXPECT_EQ(rc[0].imm, mw + 1);
  auto sc = run_until(a_, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kSuccess);
  EXPECT_EQ(write_to(base(), mw + 1), WcStatus::kRemAccessErr);

  // Dealloc.
  build(test_link_config());
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 2, &mw), 0);
  ASSERT_EQ(on_b(bind_wqe(1, mw, mw + 1, b_.key, base(), 65536, kWinAccess)).status, WcStatus::kSuccess);
  EXPECT_EQ(nic(b_).dealloc_mw(&b_.owner, mw + 1), 0);
  EXPECT_EQ(write_to(base(), mw + 1), WcStatus::kRemAccessErr);
  EXPECT_EQ(nic(b_).dereg_mr(&b_.owner, b_.key), 0);
}

TEST_F(NicWindowTest, BindsThatCannotBeAreRefusedWithMwBindErr) {
  uint32_t mw = 0, lkey = 0, rkey = 0;
  // A region without MW_BIND; a range outside the region; a key of another window.
  ASSERT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, base(), 4096, kLocalWrite | kRemoteWrite, &lkey, &rkey), 0);
  struct Case { uint32_t lkey; uint64_t addr, len; int key_shift; };
  for (const Case& k : {Case{lkey, base(), 64, 0}, Case{b_.key, base() + (1 << 20) - 8, 64, 0},
                        Case{b_.key, base(), 64, 0x100}}) {
    build(test_link_config());
    ASSERT_EQ(nic(b_).reg_mr(&b_.owner, b_.pd, base(), 4096, kLocalWrite | kRemoteWrite, &lkey, &rkey), 0);
    ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 1, &mw), 0);
    const uint32_t use = k.lkey == b_.key ? b_.key : lkey;
    Cqe c = on_b(bind_wqe(1, mw, mw + 1 + k.key_shift, use, k.addr, k.len, kWinAccess));
    EXPECT_EQ(c.status, WcStatus::kMwBindErr) << k.addr;
    EXPECT_EQ(c.wr_id, 1u);
  }
  // Allocation: types 1 and 2 only, in one of the owner's PDs.
  EXPECT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 3, &mw), EINVAL);
  EXPECT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd + 100, 1, &mw), EINVAL);
  EXPECT_EQ(nic(b_).alloc_mw(&a_.owner, b_.pd, 1, &mw), EINVAL);
  // A window's key is not an lkey, and not a region to dereg; a region is no window.
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 1, &mw), 0);
  EXPECT_EQ(nic(b_).dereg_mr(&b_.owner, mw), EINVAL);
  EXPECT_EQ(nic(b_).dealloc_mw(&b_.owner, b_.key), EINVAL);
  EXPECT_EQ(nic(b_).check_mr(&b_.owner, mw, b_.pd, base(), 1), EFAULT);
  EXPECT_EQ(nic(b_).dealloc_pd(&b_.owner, b_.pd), EBUSY);
}

TEST_F(NicWindowTest, AProcessThatGoesAwayTakesItsWindowsAndNothingReachesThroughThemAfter) {
  // b binds a type 2 window and dies (its engine reclaims it): a's WRITE through the window
  // fails instead of landing in memory that is no longer b's, and b's objects are all gone.
  uint32_t mw = 0;
  ASSERT_EQ(nic(b_).alloc_mw(&b_.owner, b_.pd, 2, &mw), 0);
  ASSERT_EQ(on_b(bind_wqe(1, mw, mw + 1, b_.key, base(), 65536, kWinAccess)).status,
            WcStatus::kSuccess);
  EXPECT_EQ(nic(b_).owned_by(&b_.owner).mrs, 2u) << "the region and the window";
  b_.qp.reset();
  nic(b_).release(&b_.owner);
  EXPECT_FALSE(nic(b_).owned_by(&b_.owner).any());
  std::memset(b_.buf.data(), 0, 64);
  std::memset(a_.buf.data(), 0x77, 8);
  // No success: an error, or nothing yet (its QP's timeout is longer than the 200 ms run).
  EXPECT_NE(write_to(base(), mw + 1), WcStatus::kSuccess);
  EXPECT_EQ(b_.buf[0], 0) << "nothing landed";
}

TEST_F(NicWindowTest, ReadsAfterABindAreAnsweredIntoTheirOwnBuffers) {
  // A bind takes a send-queue slot but sends no message: the READ answers behind it must still
  // find their WQEs (the peer numbers messages without the bind).
  uint32_t mw = 0;
  ASSERT_EQ(nic(a_).alloc_mw(&a_.owner, a_.pd, 1, &mw), 0);
  for (int i = 0; i < 64; ++i) b_.buf[65536 + i] = static_cast<uint8_t>(0x40 + i);
  auto read = [&](uint64_t wr_id, size_t local, uint64_t remote_off) {
    return a_.qp->post_send(
        wqe(wr_id, WqeOp::kRead, sge(a_, local, 32), base() + 65536 + remote_off, b_.key));
  };
  ASSERT_EQ(read(1, 1000, 0), 0);
  ASSERT_EQ(a_.qp->post_send(bind_wqe(2, mw, mw + 1, a_.key, reinterpret_cast<uint64_t>(a_.buf.data()),
                                      64, kWinAccess)), 0);
  ASSERT_EQ(read(3, 2000, 32), 0);
  auto c = run_until(a_, 3);
  ASSERT_EQ(c.size(), 3u);
  for (const Cqe& e : c) EXPECT_EQ(e.status, WcStatus::kSuccess) << e.wr_id;
  EXPECT_EQ(c[1].opcode, WcOpcode::kBindMw);
  EXPECT_EQ(std::memcmp(a_.buf.data() + 1000, b_.buf.data() + 65536, 32), 0);
  EXPECT_EQ(std::memcmp(a_.buf.data() + 2000, b_.buf.data() + 65536 + 32, 32), 0);
}

// A kernel-backed device's objects carry the numbers the module chose: the NIC takes exactly
// those, refuses one already taken, and traffic names them.
TEST_F(NicTest, NumbersAKernelChoseAreTakenAsGivenAndCarryTraffic) {
  Nic& n = nic(b_);
  uint32_t lkey = 0, rkey = 0;
  const uint64_t addr = reinterpret_cast<uint64_t>(b_.buf.data());
  const uint32_t want = (77u << 8) | 5;
  ASSERT_EQ(n.reg_mr(&b_.owner, b_.pd, addr, 4096, addr, kAllAccess, &lkey, &rkey, want), 0);
  EXPECT_EQ(lkey, want);
  EXPECT_EQ(rkey, want);
  EXPECT_EQ(n.reg_mr(&b_.owner, b_.pd, addr, 4096, addr, kAllAccess, &lkey, &rkey,
                     (77u << 8) | 6), EBUSY) << "index 77 is taken, whatever the generation";

  TestQp q(n, &b_.owner, b_.pd, *b_.cq, *b_.cq, caps(8), hostif::QpType::kRc, nullptr, 0x123456);
  ASSERT_EQ(q.err, 0);
  EXPECT_EQ(q.qpn(), 0x123456u);
  TestQp dup(n, &b_.owner, b_.pd, *b_.cq, *b_.cq, caps(8), hostif::QpType::kRc, nullptr, 0x123456);
  EXPECT_EQ(dup.err, EBUSY);
  TestQp reserved(n, &b_.owner, b_.pd, *b_.cq, *b_.cq, caps(8), hostif::QpType::kRc, nullptr, 1);
  EXPECT_EQ(reserved.err, EINVAL) << "QPs 0 and 1 are never a connected QP's";
  TestQp wide(n, &b_.owner, b_.pd, *b_.cq, *b_.cq, caps(8), hostif::QpType::kRc, nullptr,
              1u << 24);
  EXPECT_EQ(wide.err, EINVAL) << "QP numbers have 24 bits";

  // a_'s QP reconnected to the chosen number; a WRITE through the chosen key lands.
  a_.qp->set_state(QpState::kReset);
  connect_to(a_, q.qpn(), kIpB);
  bring_up(q, kIpA, a_.qp->qpn());
  for (size_t i = 0; i < 256; ++i) a_.buf[i] = static_cast<uint8_t>(i ^ 0x5a);
  ASSERT_EQ(a_.qp->post_send(wqe(9, WqeOp::kWrite, sge(a_, 0, 256), addr + 100, want)), 0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, WcStatus::kSuccess);
  EXPECT_EQ(std::memcmp(a_.buf.data(), b_.buf.data() + 100, 256), 0);
}

TEST(MrTableTest, AWantedKeyTakesItsIndexAndLeavesTheSkippedOnesToOthers) {
  MrTable t;
  DirectMemory mem;
  EXPECT_EQ(t.add(1, 0, 0, 100, 0, &mem, nullptr, 0x07), 0u) << "index 0 names no region";
  ASSERT_EQ(t.add(1, 0, 0, 100, 0, &mem, nullptr, (5u << 8) | 9), (5u << 8) | 9);
  EXPECT_NE(t.find((5u << 8) | 9), nullptr);
  EXPECT_EQ(t.add(1, 0, 0, 100, 0, &mem, nullptr, (5u << 8) | 10), 0u) << "index 5 is taken";
  // Indices 1-4, skipped on the way to 5, go to regions numbered by the table; then 6.
  std::vector<uint32_t> idx;
  for (int i = 0; i < 5; ++i) idx.push_back(t.add(1, 0, 0, 100, 0, &mem, nullptr) >> 8);
  std::sort(idx.begin(), idx.end());
  EXPECT_EQ(idx, (std::vector<uint32_t>{1, 2, 3, 4, 6}));
  // Freed, the index can be wanted again (the kernel's next generation of it).
  ASSERT_TRUE(t.remove((5u << 8) | 9));
  EXPECT_EQ(t.add(1, 0, 0, 100, 0, &mem, nullptr, (5u << 8) | 10), (5u << 8) | 10);
  EXPECT_EQ(t.find((5u << 8) | 9), nullptr);
}

TEST(MrTableTest, ChecksKeyPdAccessAndBounds) {
  MrTable t;
  DirectMemory mem;
  uint32_t k = t.add(1, 1000, 1000, 100, kRemoteWrite | kLocalWrite, &mem, nullptr);
  ASSERT_NE(k, 0u);
  const MemoryRegion* mr;
  EXPECT_EQ(t.check(k, 1, kRemoteWrite, 1000, 100, &mr), MrCheck::kOk);
  EXPECT_EQ(mr->mem, &mem);
  EXPECT_EQ(t.check(k, 1, kRemoteWrite, 1001, 100, &mr), MrCheck::kOutOfBounds);
  EXPECT_EQ(t.check(k, 1, kRemoteWrite, 999, 1, &mr), MrCheck::kOutOfBounds);
  EXPECT_EQ(t.check(k, 1, kRemoteWrite, 1050, UINT64_MAX, &mr), MrCheck::kOutOfBounds);
  EXPECT_EQ(t.check(k, 2, kRemoteWrite, 1000, 1, &mr), MrCheck::kBadPd);
  EXPECT_EQ(t.check(k, 1, kRemoteRead, 1000, 1, &mr), MrCheck::kNoAccess);
  EXPECT_EQ(t.check(k + 1, 1, 0, 1000, 1, &mr), MrCheck::kBadKey);
  ASSERT_TRUE(t.remove(k));
  EXPECT_EQ(t.check(k, 1, 0, 1000, 1, &mr), MrCheck::kBadKey);
  uint32_t k2 = t.add(1, 1000, 1000, 100, 0, &mem, nullptr);
  EXPECT_NE(k2, k) << "a reused slot must not accept the old key";
  EXPECT_EQ(t.check(k, 1, 0, 1000, 1, &mr), MrCheck::kBadKey);
}

}  // namespace
}  // namespace metaroce::nic
