// SPDX-License-Identifier: Apache-2.0
// The software NIC over an in-memory link with the real transport: two devices driven by hand
// (no progress thread), verbs semantics checked at the NIC interface the provider uses.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "datapath/io/mem_link.h"
#include "datapath/nic/mr_table.h"
#include "datapath/nic/soft_device.h"

namespace metaroce::nic {
namespace {

constexpr uint32_t kPd = 7;
constexpr unsigned kAllAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

LinkConfig link(const char* name, uint32_t ip) {
  LinkConfig c;
  c.name = name;
  c.devargs = "mem";
  c.ip = ip;
  c.paths = 4;
  return c;
}

struct Side {
  std::unique_ptr<SoftDevice> dev;
  Cq* cq = nullptr;
  Qp* qp = nullptr;
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 20);
  uint32_t key = 0;
};

class NicTest : public ::testing::Test {
 protected:
  void SetUp() override { build(io::MemLinkConfig{}); }

  void build(const io::MemLinkConfig& lc) {
    auto [pa, pb] = io::make_mem_link(lc);
    SoftDeviceOptions opt;
    opt.start_thread = false;
    opt.clock = [this] { return clock_; };
    opt.engine.mtu_payload = 1024;
    opt.engine.num_paths = 4;
    a_.dev = std::make_unique<SoftDevice>(link("a", 0xC6120001), std::move(pa), opt);
    opt.engine.seed = 2;
    b_.dev = std::make_unique<SoftDevice>(link("b", 0xC6120002), std::move(pb), opt);
    for (Side* s : {&a_, &b_}) {
      int err = 0;
      s->cq = s->dev->create_cq(256, &err);
      ASSERT_NE(s->cq, nullptr);
      QpInit init;
      init.pd = kPd;
      init.send_cq = init.recv_cq = s->cq;
      init.max_send_wr = init.max_recv_wr = sq_depth_;
      init.max_send_sge = init.max_recv_sge = 4;
      init.max_inline = 64;
      s->qp = s->dev->create_qp(init, &err);
      ASSERT_NE(s->qp, nullptr);
      uint32_t rkey;
      ASSERT_EQ(s->dev->reg_mr(kPd, reinterpret_cast<uint64_t>(s->buf.data()), s->buf.size(),
                               kAllAccess, &s->key, &rkey), 0);
    }
    connect(a_, b_, 0xC6120002);
    connect(b_, a_, 0xC6120001);
  }

  static void connect(Side& s, Side& peer, uint32_t peer_ip, uint8_t max_rd_atomic = 16) {
    s.qp->set_access(kAllAccess);
    s.qp->set_state(QpState::kInit);
    QpRemote r;
    r.ip = peer_ip;
    r.qpn = peer.qp->qpn();
    r.max_rd_atomic = max_rd_atomic;
    s.qp->set_remote(r);
    s.qp->set_state(QpState::kRtr);
    s.qp->set_state(QpState::kRts);
  }

  // Connects s's QP (in RESET) to QP peer_qpn at peer_ip.
  static void connect_to(Side& s, uint32_t peer_qpn, uint32_t peer_ip) {
    s.qp->set_access(kAllAccess);
    s.qp->set_state(QpState::kInit);
    QpRemote r;
    r.ip = peer_ip;
    r.qpn = peer_qpn;
    r.max_rd_atomic = 16;
    s.qp->set_remote(r);
    s.qp->set_state(QpState::kRtr);
    s.qp->set_state(QpState::kRts);
  }

  // Runs both devices until `want` completions arrived at `side` (or gives up).
  std::vector<Cqe> run_until(Side& side, size_t want, int max_rounds = 20000) {
    std::vector<Cqe> got;
    for (int i = 0; i < max_rounds && got.size() < want; ++i) {
      clock_ += std::chrono::microseconds(10);
      a_.dev->progress();
      b_.dev->progress();
      Cqe c[8];
      int n = side.cq->poll(8, c);
      got.insert(got.end(), c, c + n);
    }
    return got;
  }

  Sge sge(Side& s, size_t off, uint32_t len) {
    return Sge{reinterpret_cast<uint64_t>(s.buf.data() + off), len, s.key};
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
  EXPECT_EQ(c[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(c[0].wr_id, 42u);
  EXPECT_EQ(c[0].opcode, IBV_WC_RDMA_WRITE);
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
  EXPECT_EQ(rc[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(rc[0].byte_len, 6000u);
  EXPECT_EQ(rc[1].wr_id, 8u);
  EXPECT_EQ(rc[1].byte_len, 0u);
  EXPECT_TRUE(rc[1].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(ntohl(rc[1].imm), 99u);
  EXPECT_EQ(std::memcmp(b_.buf.data(), a_.buf.data(), 3000), 0);
  EXPECT_EQ(std::memcmp(b_.buf.data() + 10000, a_.buf.data() + 3000, 3000), 0);
}

TEST_F(NicTest, ResponderRecordsStaySmallAndGrowOnlyForASenderFarAhead) {
  // 300 messages in flight behind a SEND that waits for its receive (RNR): the responder must
  // hold records for all of them, so its window grows from 64; then everything completes in
  // order with the right bytes. An idle QP keeps 64 records (~2.3 KiB).
  sq_depth_ = 512;
  build(io::MemLinkConfig{});
  auto* rx = static_cast<QueuePair*>(b_.qp);
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
  EXPECT_EQ(rc[0].status, IBV_WC_SUCCESS);
  auto sc = run_until(a_, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].wr_id, 299u);
  EXPECT_EQ(sc[0].status, IBV_WC_SUCCESS);
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
  EXPECT_EQ(c[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(c[0].opcode, IBV_WC_RDMA_READ);
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
  EXPECT_EQ(c[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(c[1].wr_id, 2u);
  EXPECT_EQ(c[1].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(a_.qp->state(), QpState::kErr);
  EXPECT_EQ(b_.buf[0], 0) << "a rejected WRITE wrote memory";
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
  EXPECT_EQ(c[0].status, IBV_WC_REM_ACCESS_ERR);
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

TEST_F(NicTest, ModifyToErrorFlushesPostedReceives) {
  RecvWqe r;
  r.wr_id = 11;
  ASSERT_EQ(b_.qp->post_recv(r), 0);
  b_.qp->set_state(QpState::kErr);
  Cqe c[2];
  ASSERT_EQ(b_.cq->poll(2, c), 1);
  EXPECT_EQ(c[0].wr_id, 11u);
  EXPECT_EQ(c[0].status, IBV_WC_WR_FLUSH_ERR);
}

TEST_F(NicTest, TwoQpsOfOneDeviceTalkThroughLoopback) {
  QpInit init;
  init.pd = kPd;
  init.send_cq = init.recv_cq = a_.cq;
  init.max_send_wr = init.max_recv_wr = 16;
  init.max_send_sge = init.max_recv_sge = 1;
  int err = 0;
  Qp* q2 = a_.dev->create_qp(init, &err);
  ASSERT_NE(q2, nullptr);
  Side second;
  second.qp = q2;
  // Reconnect a_'s first QP to the new one, both at a_'s own address.
  a_.qp->set_state(QpState::kReset);
  Side& first = a_;
  for (auto [from, to] : {std::pair{first.qp, q2}, std::pair{q2, first.qp}}) {
    from->set_access(kAllAccess);
    from->set_state(QpState::kInit);
    QpRemote r;
    r.ip = 0xC6120001;
    r.qpn = to->qpn();
    from->set_remote(r);
    from->set_state(QpState::kRtr);
    from->set_state(QpState::kRts);
  }
  RecvWqe r;
  r.wr_id = 77;
  r.num_sge = 1;
  r.sge[0] = sge(a_, 500000, 8000);
  ASSERT_EQ(q2->post_recv(r), 0);
  for (size_t i = 0; i < 8000; ++i) a_.buf[i] = static_cast<uint8_t>(i * 3);
  SendWqe s;
  s.wr_id = 78;
  s.op = WqeOp::kSend;
  s.signaled = true;
  s.num_sge = 1;
  s.sge[0] = sge(a_, 0, 8000);
  run_until(a_, 1, 10);  // lets the ARP exchange of SetUp's connection settle
  const uint64_t wire_before = b_.dev->counters().rx_frames;
  ASSERT_EQ(first.qp->post_send(s), 0);
  auto c = run_until(a_, 2);
  ASSERT_EQ(c.size(), 2u);
  for (const Cqe& e : c) EXPECT_EQ(e.status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(a_.buf.data(), a_.buf.data() + 500000, 8000), 0);
  EXPECT_EQ(b_.dev->counters().rx_frames, wire_before) << "loopback traffic reached the wire";
}

TEST(NicPlanesTest, TwoPlaneLinkSpraysOverBothPortsAndDeliversByteExact) {
  auto [a0, b0] = io::make_mem_link({});
  auto [a1, b1] = io::make_mem_link({});
  io::Port* wire0 = b0.get();
  io::Port* wire1 = b1.get();
  transport::Time clock{std::chrono::seconds(1)};
  SoftDeviceOptions opt;
  opt.start_thread = false;
  opt.clock = [&] { return clock; };
  opt.engine.mtu_payload = 1024;
  opt.engine.num_paths = 4;
  std::vector<std::unique_ptr<io::Port>> pa, pb;
  pa.push_back(std::move(a0));
  pa.push_back(std::move(a1));
  pb.push_back(std::move(b0));
  pb.push_back(std::move(b1));
  SoftDevice a(link("a", 0xC6120001), std::move(pa), opt);
  opt.engine.seed = 9;
  SoftDevice b(link("b", 0xC6120002), std::move(pb), opt);
  ASSERT_EQ(a.planes(), 2u);
  std::vector<uint8_t> src(200000), dst(200000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  uint32_t ka, kb, r;
  ASSERT_EQ(a.reg_mr(kPd, reinterpret_cast<uint64_t>(src.data()), src.size(), kAllAccess, &ka, &r), 0);
  ASSERT_EQ(b.reg_mr(kPd, reinterpret_cast<uint64_t>(dst.data()), dst.size(), kAllAccess, &kb, &r), 0);
  int err = 0;
  Cq* ca = a.create_cq(16, &err);
  Cq* cb = b.create_cq(16, &err);
  QpInit init;
  init.pd = kPd;
  init.max_send_wr = init.max_recv_wr = 8;
  init.max_send_sge = init.max_recv_sge = 1;
  init.send_cq = init.recv_cq = ca;
  Qp* qa = a.create_qp(init, &err);
  init.send_cq = init.recv_cq = cb;
  Qp* qb = b.create_qp(init, &err);
  for (auto [q, peer, ip] : {std::tuple{qa, qb, 0xC6120002u}, std::tuple{qb, qa, 0xC6120001u}}) {
    q->set_access(kAllAccess);
    q->set_state(QpState::kInit);
    QpRemote rem;
    rem.ip = ip;
    rem.qpn = peer->qpn();
    q->set_remote(rem);
    q->set_state(QpState::kRtr);
    q->set_state(QpState::kRts);
  }
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = Sge{reinterpret_cast<uint64_t>(src.data()), 200000, ka};
  w.remote_addr = reinterpret_cast<uint64_t>(dst.data());
  w.rkey = kb;
  ASSERT_EQ(qa->post_send(w), 0);
  Cqe c;
  int got = 0;
  for (int i = 0; i < 20000 && got == 0; ++i) {
    clock += std::chrono::microseconds(10);
    a.progress();
    b.progress();
    got = ca->poll(1, &c);
  }
  ASSERT_EQ(got, 1);
  EXPECT_EQ(c.status, IBV_WC_SUCCESS);
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
  EXPECT_EQ(c[0].opcode, IBV_WC_FETCH_ADD);
  EXPECT_EQ(c[1].opcode, IBV_WC_COMP_SWAP);
  for (const Cqe& e : c) {
    EXPECT_EQ(e.status, IBV_WC_SUCCESS);
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
  EXPECT_EQ(c[0].status, IBV_WC_REM_INV_REQ_ERR);
  EXPECT_EQ(word(b_, 0), 0u);

  SetUp();  // fresh, connected pair
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kFetchAdd, 2, sge(a_, 0, 16),
                                        reinterpret_cast<uint64_t>(b_.buf.data()), b_.key, 1)),
            0);
  c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(NicTest, AtomicWithoutRemoteAtomicAccessIsRemoteAccessError) {
  b_.qp->set_access(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ASSERT_EQ(a_.qp->post_send(atomic_wqe(WqeOp::kFetchAdd, 1, sge(a_, 0, 8),
                                        reinterpret_cast<uint64_t>(b_.buf.data()), b_.key, 1)),
            0);
  auto c = run_until(a_, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(word(b_, 0), 0u);
}

TEST_F(NicTest, AtomicRequestSeenTwiceIsAnsweredButExecutedOnce) {
  word(b_, 0) = 10;
  uint8_t ops[kAtomicRequestLen] = {};
  ops[7] = 3;  // add 3, big-endian
  transport::Segment seg;
  seg.peer_ip = 0xC6120001;
  seg.op = transport::Op::kWrite;
  seg.dst_stream = b_.qp->qpn();
  seg.src_stream = a_.qp->qpn();
  seg.msn = 0;
  seg.rsn = kRsnAtomicFetchAdd;
  seg.total_length = kAtomicRequestLen;
  seg.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  seg.rkey = b_.key;
  seg.payload = {ops, sizeof(ops)};
  auto* qp = static_cast<QueuePair*>(b_.qp);
  std::lock_guard lock(b_.dev->lock());
  EXPECT_EQ(qp->deliver(seg), transport::Syndrome::kOk);
  EXPECT_EQ(word(b_, 0), 13u);
  EXPECT_EQ(qp->deliver(seg), transport::Syndrome::kOk);  // a retransmitted request
  EXPECT_EQ(word(b_, 0), 13u);
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
  a_.dev->progress();
  EXPECT_TRUE(a_.dev->engine_stats().tx_packets <= 1u);
  auto c = run_until(a_, 4);
  ASSERT_EQ(c.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(c[i].wr_id, i);
    EXPECT_EQ(c[i].status, IBV_WC_SUCCESS);
  }
}

TEST_F(NicTest, ArmedCqNotifiesOnceForTheNextCompletion) {
  int fired = 0;
  a_.cq->set_notifier([](void* arg) { ++*static_cast<int*>(arg); }, &fired);
  a_.cq->arm(false);
  EXPECT_EQ(fired, 0);  // nothing completed yet
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kWrite;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = sge(a_, 0, 64);
  w.remote_addr = reinterpret_cast<uint64_t>(b_.buf.data());
  w.rkey = b_.key;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  w.wr_id = 2;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  auto c = run_until(a_, 2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(fired, 1);  // armed once, one event
  // Arming while completions wait fires at once (else an event-driven program could hang).
  w.wr_id = 3;
  ASSERT_EQ(a_.qp->post_send(w), 0);
  for (int i = 0; i < 2000; ++i) {
    clock_ += std::chrono::microseconds(10);
    a_.dev->progress();
    b_.dev->progress();
  }
  EXPECT_EQ(fired, 1);
  a_.cq->arm(false);
  EXPECT_EQ(fired, 2);
}

// --- SRQ, UD, asynchronous events (docs/spec/verbs-mapping.md §6-§8) ---------------------

struct Events {
  std::vector<QpEvent> seen;
  static void record(void* arg, QpEvent ev) { static_cast<Events*>(arg)->seen.push_back(ev); }
  size_t count(QpEvent ev) const { return std::count(seen.begin(), seen.end(), ev); }
};

// A QP of `side`'s device with the given type, receive source and event sink, in RESET.
Qp* extra_qp(Side& side, QpType type, Srq* srq, Events* ev) {
  QpInit init;
  init.pd = kPd;
  init.send_cq = init.recv_cq = side.cq;
  init.max_send_wr = init.max_recv_wr = 64;
  init.max_send_sge = init.max_recv_sge = 4;
  init.type = type;
  init.srq = srq;
  init.event_fn = &Events::record;
  init.event_arg = ev;
  int err = 0;
  Qp* qp = side.dev->create_qp(init, &err);
  EXPECT_NE(qp, nullptr);
  return qp;
}

void bring_up(Qp* qp, uint32_t peer_ip, uint32_t peer_qpn, uint32_t qkey = 0,
              QpState until = QpState::kRts) {
  qp->set_access(kAllAccess);
  qp->set_state(QpState::kInit);
  QpRemote r;
  r.ip = peer_ip;
  r.qpn = peer_qpn;
  r.qkey = qkey;
  qp->set_remote(r);
  qp->set_state(QpState::kRtr);
  if (until == QpState::kRts) qp->set_state(QpState::kRts);
}

TEST_F(NicTest, SrqEntriesAreClaimedInRsnOrderWhenALaterMessageArrivesFirst) {
  int err = 0;
  Srq* srq = b_.dev->create_srq(kPd, 8, 1, &err);
  ASSERT_NE(srq, nullptr);
  Events ev;
  Qp* q = extra_qp(b_, QpType::kRc, srq, &ev);
  bring_up(q, 0xC6120001, 77);
  for (uint64_t id = 100; id < 103; ++id) {
    RecvWqe r;
    r.wr_id = id;
    r.num_sge = 1;
    r.sge[0] = sge(b_, (id - 100) * 1000, 1000);
    ASSERT_EQ(srq->post_recv(r), 0);
  }
  // Messages msn 1 (rsn 1) then msn 0 (rsn 0), as spraying may deliver them.
  const uint8_t one[4] = {1, 1, 1, 1}, zero[4] = {9, 9, 9, 9};
  transport::Segment seg;
  seg.peer_ip = 0xC6120001;
  seg.op = transport::Op::kSend;
  seg.dst_stream = q->qpn();
  seg.src_stream = 77;
  seg.msn = 1;
  seg.rsn = 1;
  seg.total_length = 4;
  seg.payload = one;
  auto* qp = static_cast<QueuePair*>(q);
  ASSERT_EQ(qp->deliver(seg), transport::Syndrome::kOk);
  EXPECT_EQ(static_cast<SharedReceiveQueue*>(srq)->posted(), 1u) << "rsn 1 claims rsn 0's entry too";
  seg.msn = 0;
  seg.rsn = 0;
  seg.payload = zero;
  ASSERT_EQ(qp->deliver(seg), transport::Syndrome::kOk);
  Cqe c[4];
  ASSERT_EQ(b_.cq->poll(4, c), 2);
  EXPECT_EQ(c[0].wr_id, 100u);  // msn 0 -> the first entry posted
  EXPECT_EQ(c[1].wr_id, 101u);
  EXPECT_EQ(b_.buf[0], 9);
  EXPECT_EQ(b_.buf[1000], 1);
  EXPECT_EQ(ev.count(QpEvent::kCommEst), 0u);  // the QP was already in RTS
  EXPECT_EQ(b_.dev->destroy_srq(srq), EBUSY);
  ASSERT_EQ(b_.dev->destroy_qp(q), 0);
  EXPECT_EQ(b_.dev->destroy_srq(srq), 0);
}

TEST_F(NicTest, SrqFeedsSendsOverTheWireAndRaisesTheLimitEventOnce) {
  int err = 0;
  Srq* srq = b_.dev->create_srq(kPd, 16, 2, &err);
  ASSERT_NE(srq, nullptr);
  Events ev;
  Qp* q = extra_qp(b_, QpType::kRc, srq, &ev);
  a_.qp->set_state(QpState::kReset);
  connect_to(a_, q->qpn(), 0xC6120002);
  bring_up(q, 0xC6120001, a_.qp->qpn(), 0, QpState::kRtr);  // RTR only: COMM_EST on arrival
  int limit_events = 0;
  srq->set_limit_notifier([](void* arg) { ++*static_cast<int*>(arg); }, &limit_events);
  for (uint64_t id = 0; id < 6; ++id) {
    RecvWqe r;
    r.wr_id = 200 + id;
    r.num_sge = 2;
    r.sge[0] = sge(b_, id * 10000, 1500);
    r.sge[1] = sge(b_, id * 10000 + 5000, 1500);
    ASSERT_EQ(srq->post_recv(r), 0);
  }
  srq->set_limit(4);
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
    EXPECT_EQ(rc[id].status, IBV_WC_SUCCESS);
    EXPECT_EQ(rc[id].wr_id, 200 + id);
    EXPECT_EQ(rc[id].byte_len, 2500u);
    EXPECT_EQ(std::memcmp(b_.buf.data() + id * 10000, a_.buf.data(), 1500), 0);
    EXPECT_EQ(std::memcmp(b_.buf.data() + id * 10000 + 5000, a_.buf.data() + 1500, 1000), 0);
  }
  EXPECT_EQ(limit_events, 1);  // 6 -> 3 entries crossed the limit of 4 once
  EXPECT_EQ(srq->limit(), 0u);  // and disarmed it
  EXPECT_EQ(ev.count(QpEvent::kCommEst), 1u);
  // ERR flushes nothing of the SRQ's unclaimed entries, and says the last WQE is reached.
  q->set_state(QpState::kErr);
  Cqe c[4];
  EXPECT_EQ(b_.cq->poll(4, c), 0);
  EXPECT_EQ(ev.count(QpEvent::kLastWqeReached), 1u);
  EXPECT_EQ(static_cast<SharedReceiveQueue*>(srq)->posted(), 2u);
}

TEST_F(NicTest, UdDatagramLandsBehindAGrhAndWrongQkeyIsDropped) {
  Events eva, evb;
  Qp* ua = extra_qp(a_, QpType::kUd, nullptr, &eva);
  Qp* ub = extra_qp(b_, QpType::kUd, nullptr, &evb);
  bring_up(ua, 0, 0, 0x1111);
  bring_up(ub, 0, 0, 0x2222);
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
  s.ud_ip = 0xC6120002;
  s.ud_qpn = ub->qpn();
  s.ud_qkey = 0x9999;  // wrong: dropped, yet the sender completes (unreliable service)
  s.wr_id = 1;
  ASSERT_EQ(ua->post_send(s), 0);
  s.ud_qkey = 0x2222;
  s.wr_id = 2;
  ASSERT_EQ(ua->post_send(s), 0);
  auto sc = run_until(a_, 2);
  ASSERT_EQ(sc.size(), 2u);
  for (const Cqe& e : sc) EXPECT_EQ(e.status, IBV_WC_SUCCESS);
  Cqe c[4];
  ASSERT_EQ(b_.cq->poll(4, c), 1);
  EXPECT_EQ(c[0].wr_id, 31u);
  EXPECT_EQ(c[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(c[0].byte_len, kGrhLen + 1000);
  EXPECT_EQ(c[0].src_qp, ua->qpn());
  EXPECT_EQ(c[0].wc_flags, unsigned{IBV_WC_GRH | IBV_WC_WITH_IMM});
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
  EXPECT_EQ(more[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(b_.cq->poll(4, c), 0);
  // Larger than the MTU: a local length error at the sender.
  s.wr_id = 4;
  s.sge[0] = sge(a_, 0, b_.dev->active_mtu() + 1);
  ASSERT_EQ(ua->post_send(s), 0);
  auto big = run_until(a_, 1);
  ASSERT_EQ(big.size(), 1u);
  EXPECT_EQ(big[0].status, IBV_WC_LOC_LEN_ERR);
  EXPECT_TRUE(evb.seen.empty());
}

TEST_F(NicTest, RetriesExhaustedPutTheQpInErrorAndRaiseQpFatal) {
  Events ev;
  Qp* q = extra_qp(a_, QpType::kRc, nullptr, &ev);
  bring_up(q, 0xC6120009, 0x123);  // nobody answers at .9
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
    a_.dev->progress();
    Cqe c[4];
    int n = a_.cq->poll(4, c);
    got.insert(got.end(), c, c + n);
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(q->state(), QpState::kErr);
  EXPECT_EQ(ev.count(QpEvent::kFatal), 1u);
}

TEST_F(NicTest, ResponderAccessViolationRaisesQpAccessErr) {
  Events ev;
  Qp* q = extra_qp(b_, QpType::kRc, nullptr, &ev);
  a_.qp->set_state(QpState::kReset);
  connect_to(a_, q->qpn(), 0xC6120002);
  bring_up(q, 0xC6120001, a_.qp->qpn());
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
  EXPECT_EQ(c[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(q->state(), QpState::kErr);
  EXPECT_EQ(ev.count(QpEvent::kAccessErr), 1u);
  EXPECT_EQ(ev.count(QpEvent::kFatal), 0u);
}

TEST_F(NicTest, SendToADestroyedQpRunsOutOfRetriesInsteadOfANak) {
  // As on RC hardware: no QP, no answer. The requester learns nothing until its retries run
  // out (a peer that merely finished and tore down must not fail a straggler at once).
  ASSERT_EQ(b_.dev->destroy_qp(b_.qp), 0);
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
  EXPECT_EQ(c[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_GT(b_.dev->engine_stats().drop_unreachable, 0u);
  EXPECT_EQ(b_.dev->engine_stats().naks_sent, 0u);
}

TEST(MrTableTest, ChecksKeyPdAccessAndBounds) {
  MrTable t;
  uint32_t k = t.add(1, 1000, 100, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(k, 0u);
  uint8_t* host;
  EXPECT_EQ(t.check(k, 1, IBV_ACCESS_REMOTE_WRITE, 1000, 100, &host), MrCheck::kOk);
  EXPECT_EQ(t.check(k, 1, IBV_ACCESS_REMOTE_WRITE, 1001, 100, &host), MrCheck::kOutOfBounds);
  EXPECT_EQ(t.check(k, 1, IBV_ACCESS_REMOTE_WRITE, 999, 1, &host), MrCheck::kOutOfBounds);
  EXPECT_EQ(t.check(k, 1, IBV_ACCESS_REMOTE_WRITE, 1050, UINT64_MAX, &host), MrCheck::kOutOfBounds);
  EXPECT_EQ(t.check(k, 2, IBV_ACCESS_REMOTE_WRITE, 1000, 1, &host), MrCheck::kBadPd);
  EXPECT_EQ(t.check(k, 1, IBV_ACCESS_REMOTE_READ, 1000, 1, &host), MrCheck::kNoAccess);
  EXPECT_EQ(t.check(k + 1, 1, 0, 1000, 1, &host), MrCheck::kBadKey);
  ASSERT_TRUE(t.remove(k));
  EXPECT_EQ(t.check(k, 1, 0, 1000, 1, &host), MrCheck::kBadKey);
  uint32_t k2 = t.add(1, 1000, 100, 0);
  EXPECT_NE(k2, k) << "a reused slot must not accept the old key";
  EXPECT_EQ(t.check(k, 1, 0, 1000, 1, &host), MrCheck::kBadKey);
}

}  // namespace
}  // namespace metaroce::nic
