// SPDX-License-Identifier: Apache-2.0
// The software NIC over an in-memory link with the real transport: two devices driven by hand
// (no progress thread), verbs semantics checked at the NIC interface the provider uses.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "datapath/io/mem_link.h"
#include "datapath/nic/mr_table.h"
#include "datapath/nic/soft_device.h"

namespace metaroce::nic {
namespace {

constexpr uint32_t kPd = 7;
constexpr unsigned kAllAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

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
      init.max_send_wr = init.max_recv_wr = 64;
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

  static void connect(Side& s, Side& peer, uint32_t peer_ip) {
    s.qp->set_access(kAllAccess);
    s.qp->set_state(QpState::kInit);
    QpRemote r;
    r.ip = peer_ip;
    r.qpn = peer.qp->qpn();
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
