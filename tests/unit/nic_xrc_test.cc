// SPDX-License-Identifier: Apache-2.0
// XRC on the NIC core (docs/spec/verbs-mapping.md §17): domains shared by file, SRQs of a domain
// with their own CQ and PD, initiator and target QPs over the real transport between two
// devices on an in-memory link; receive numbering per (initiator, SRQ); what a target that
// outlives its creator, an SRQ that goes away and a context that exits leave behind.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "datapath/io/mem_link.h"
#include "tests/unit/nic_harness.h"

namespace metaroce::nic {
namespace {

using namespace metaroce::nic::test;
using hostif::AsyncEvent;

constexpr unsigned kAllAccess = kLocalWrite | kRemoteWrite | kRemoteRead | kRemoteAtomic;
constexpr uint32_t kIpA = 0xC6120001, kIpB = 0xC6120002;
const Nic::XrcdKey kFile{0x801, 4242};  // a file's (st_dev, st_ino)

hostif::QpCaps caps(uint32_t depth) {
  hostif::QpCaps c;
  c.max_send_wr = c.max_recv_wr = depth;
  c.max_send_sge = c.max_recv_sge = 2;
  c.max_inline = 64;
  return c;
}

void bring_up(TestQp& qp, uint32_t peer_ip, uint32_t peer_qpn, QpState until = QpState::kRts) {
  qp.set_access(kAllAccess);
  qp.set_state(QpState::kInit);
  hostif::QpRemote r;
  r.ip = peer_ip;
  r.qpn = peer_qpn;
  r.max_rd_atomic = 16;
  qp.set_remote(r);
  qp.set_state(QpState::kRtr);
  if (until == QpState::kRts) qp.set_state(QpState::kRts);
}

// One context of a device: its PD, CQ, memory and a region over it.
struct Ctx {
  TestOwner owner;
  uint32_t pd = 0, key = 0;
  std::unique_ptr<TestCq> cq;
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 16);
  void open(Nic& nic) {
    ASSERT_EQ(nic.alloc_pd(&owner, &pd), 0);
    cq = std::make_unique<TestCq>(nic, &owner, 256);
    ASSERT_EQ(cq->err, 0);
    uint32_t rkey;
    ASSERT_EQ(nic.reg_mr(&owner, pd, reinterpret_cast<uint64_t>(buf.data()), buf.size(),
                         kAllAccess, &key, &rkey), 0);
  }
  Sge sge(size_t off, uint32_t len) {
    return Sge{reinterpret_cast<uint64_t>(buf.data() + off), len, key};
  }
  uint64_t addr(size_t off) { return reinterpret_cast<uint64_t>(buf.data() + off); }
};

class NicXrcTest : public ::testing::Test {
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
    ini_ctx_.open(*a_->nic);
    tgt_ctx_.open(*b_->nic);
    ini_ = std::make_unique<TestQp>(*a_->nic, &ini_ctx_.owner, ini_ctx_.pd, *ini_ctx_.cq, caps(64));
    ASSERT_EQ(ini_->err, 0);
    ASSERT_EQ(b_->nic->open_xrcd(&tgt_ctx_.owner, &kFile, true, false, &xrcd_), 0);
    tgt_ = std::make_unique<TestQp>(*b_->nic, &tgt_ctx_.owner, xrcd_);
    ASSERT_EQ(tgt_->err, 0);
    bring_up(*ini_, kIpB, tgt_->qpn());
    bring_up(*tgt_, kIpA, ini_->qpn());
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
  void post_recvs(TestSrq& srq, Ctx& ctx, uint64_t first_id, int n, size_t off, uint32_t len) {
    for (int i = 0; i < n; ++i) {
      RecvWqe r;
      r.wr_id = first_id + i;
      r.num_sge = 1;
      r.sge[0] = ctx.sge(off + i * len, len);
      ASSERT_EQ(srq.post_recv(r), 0);
    }
  }
  SendWqe send_to(uint32_t srqn, uint64_t wr_id, size_t off, uint32_t len,
                  WqeOp op = WqeOp::kSend) {
    SendWqe w;
    w.wr_id = wr_id;
    w.op = op;
    w.signaled = true;
    w.num_sge = 1;
    w.sge[0] = ini_ctx_.sge(off, len);
    w.xrc_srqn = srqn;
    return w;
  }
  QueuePair& core(Device& d, const TestQp& q) { return *d.nic->find_qp(q.qpn()); }
  // Streams msgs messages to srq (8 slots of slot bytes, posted again as they complete), at
  // most window sends outstanding; every one must arrive in order.
  void run_stream(TestSrq& s, TestCq& rcq, uint32_t slot, uint32_t msgs, uint32_t window);

  transport::Time clock_{std::chrono::seconds(1)};
  std::unique_ptr<Device> a_, b_;
  Ctx ini_ctx_, tgt_ctx_;
  uint32_t xrcd_ = 0;
  std::unique_ptr<TestQp> ini_, tgt_;
};

TEST_F(NicXrcTest, SendsLandInTheSrqTheyNameAndCompleteIntoThatSrqsCq) {
  TestCq cq1(*b_->nic, &tgt_ctx_.owner, 64), cq2(*b_->nic, &tgt_ctx_.owner, 64);
  TestSrq s1(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, cq1.id, 16, 1);
  TestSrq s2(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, cq2.id, 16, 1);
  ASSERT_EQ(s1.err, 0);
  ASSERT_EQ(s2.err, 0);
  ASSERT_NE(s1.id, s2.id);
  post_recvs(s1, tgt_ctx_, 100, 3, 0, 3000);
  post_recvs(s2, tgt_ctx_, 200, 3, 10000, 3000);
  for (size_t i = 0; i < 4 * 2500; ++i) ini_ctx_.buf[i] = static_cast<uint8_t>(i * 7 + 1);
  // Alternating SRQs, each message over several packets: receive numbers count per SRQ, so
  // each message takes exactly one entry of the SRQ it names.
  const uint32_t target[4] = {s1.id, s2.id, s1.id, s2.id};
  for (uint32_t i = 0; i < 4; ++i)
    ASSERT_EQ(ini_->post_send(send_to(target[i], i, i * 2500, 2500)), 0);
  auto sc = run_until(*ini_ctx_.cq, 4);
  ASSERT_EQ(sc.size(), 4u);
  for (const Cqe& c : sc) EXPECT_EQ(c.status, WcStatus::kSuccess);
  Cqe c1[4], c2[4];
  ASSERT_EQ(cq1.poll(4, c1), 2);
  ASSERT_EQ(cq2.poll(4, c2), 2);
  EXPECT_EQ(tgt_ctx_.cq->poll(4, c1 + 2), 0);  // nothing in the context's other CQ
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(c1[k].wr_id, 100u + k);
    EXPECT_EQ(c2[k].wr_id, 200u + k);
    for (const Cqe* c : {&c1[k], &c2[k]}) {
      EXPECT_EQ(c->status, WcStatus::kSuccess);
      EXPECT_EQ(c->byte_len, 2500u);
      EXPECT_EQ(c->qp_num, tgt_->qpn());
      EXPECT_EQ(c->src_qp, ini_->qpn());
    }
    // Message 2k went to s1's k-th receive, message 2k+1 to s2's.
    EXPECT_EQ(std::memcmp(tgt_ctx_.buf.data() + k * 3000, ini_ctx_.buf.data() + 2 * k * 2500, 2500), 0);
    EXPECT_EQ(std::memcmp(tgt_ctx_.buf.data() + 10000 + k * 3000,
                          ini_ctx_.buf.data() + (2 * k + 1) * 2500, 2500), 0);
  }
  EXPECT_EQ(s1.posted(), 1u);
  EXPECT_EQ(s2.posted(), 1u);
}

TEST_F(NicXrcTest, ATargetClaimsPerSrqInReceiveOrderWhateverTheArrivalOrder) {
  TestSrq s1(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, tgt_ctx_.cq->id, 8, 1);
  TestSrq s2(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, tgt_ctx_.cq->id, 8, 1);
  post_recvs(s1, tgt_ctx_, 100, 3, 0, 100);
  post_recvs(s2, tgt_ctx_, 200, 3, 1000, 100);
  // msn: 0 -> s1 (rsn 0), 1 -> s2 (rsn 0), 2 -> s1 (rsn 1), 3 -> s2 (rsn 1); they arrive
  // 3, 1, 2, 0, as spraying may deliver them.
  struct M {
    uint32_t msn, srqn, rsn;
    uint8_t fill;
  };
  const M order[] = {{3, s2.id, 1, 0x33}, {1, s2.id, 0, 0x11}, {2, s1.id, 1, 0x22},
                     {0, s1.id, 0, 0x00}};
  QueuePair& qp = core(*b_, *tgt_);
  uint8_t bytes[4][8];  // a packet's bytes stay until the end of the pass (end_rx)
  int k = 0;
  for (const M& m : order) {
    uint8_t* payload = bytes[k++];
    std::memset(payload, m.fill, 8);
    transport::Segment seg;
    seg.peer_ip = kIpA;
    seg.op = transport::Op::kSend;
    seg.dst_stream = tgt_->qpn();
    seg.src_stream = ini_->qpn();
    seg.msn = m.msn;
    seg.rsn = m.rsn;
    seg.xrc = true;
    seg.xrc_srqn = m.srqn;
    seg.total_length = 8;
    seg.payload = {payload, 8};
    ASSERT_EQ(qp.deliver(seg), transport::Syndrome::kOk) << "msn " << m.msn;
    if (m.msn == 3) {
      EXPECT_EQ(s2.posted(), 1u) << "rsn 1 of s2 claims its rsn 0 too";
      EXPECT_EQ(s1.posted(), 3u) << "and nothing of s1";
    }
  }
  b_->nic->end_rx(clock_);
  Cqe c[8];
  ASSERT_EQ(tgt_ctx_.cq->poll(8, c), 4);
  const uint64_t want[] = {100, 200, 101, 201};  // message order, each SRQ in its own order
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c[i].wr_id, want[i]) << i;
  EXPECT_EQ(tgt_ctx_.buf[0], 0x00);
  EXPECT_EQ(tgt_ctx_.buf[100], 0x22);
  EXPECT_EQ(tgt_ctx_.buf[1000], 0x11);
  EXPECT_EQ(tgt_ctx_.buf[1100], 0x33);
  EXPECT_EQ(s1.posted(), 1u);
  EXPECT_EQ(s2.posted(), 1u);
}

TEST_F(NicXrcTest, RdmaAndAtomicsAtATargetAreCheckedAgainstTheNamedSrqsPd) {
  TestSrq s1(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, tgt_ctx_.cq->id, 8, 1);
  // A second PD of the same context, with an SRQ of the domain in it and no region.
  uint32_t pd2 = 0;
  ASSERT_EQ(b_->nic->alloc_pd(&tgt_ctx_.owner, &pd2), 0);
  TestSrq s_other(*b_->nic, &tgt_ctx_.owner, pd2, xrcd_, tgt_ctx_.cq->id, 8, 1);
  ASSERT_EQ(s_other.err, 0);
  std::memset(ini_ctx_.buf.data(), 0x5a, 64);
  SendWqe w = send_to(s1.id, 1, 0, 64, WqeOp::kWrite);
  w.remote_addr = tgt_ctx_.addr(4096);
  w.rkey = tgt_ctx_.key;
  ASSERT_EQ(ini_->post_send(w), 0);
  // READ back what the write put there.
  SendWqe r = send_to(s1.id, 2, 1024, 64, WqeOp::kRead);
  r.remote_addr = tgt_ctx_.addr(4096);
  r.rkey = tgt_ctx_.key;
  ASSERT_EQ(ini_->post_send(r), 0);
  // Fetch-and-add on 8 aligned bytes.
  uint64_t v = 40;
  std::memcpy(tgt_ctx_.buf.data() + 8192, &v, 8);
  SendWqe f = send_to(s1.id, 3, 2048, 8, WqeOp::kFetchAdd);
  f.remote_addr = tgt_ctx_.addr(8192);
  f.rkey = tgt_ctx_.key;
  f.compare_add = 2;
  ASSERT_EQ(ini_->post_send(f), 0);
  auto sc = run_until(*ini_ctx_.cq, 3);
  ASSERT_EQ(sc.size(), 3u);
  for (const Cqe& c : sc) EXPECT_EQ(c.status, WcStatus::kSuccess) << c.wr_id;
  EXPECT_EQ(tgt_ctx_.buf[4096], 0x5a);
  EXPECT_EQ(tgt_ctx_.buf[4096 + 63], 0x5a);
  EXPECT_EQ(ini_ctx_.buf[1024], 0x5a);
  std::memcpy(&v, tgt_ctx_.buf.data() + 8192, 8);
  EXPECT_EQ(v, 42u);
  std::memcpy(&v, ini_ctx_.buf.data() + 2048, 8);
  EXPECT_EQ(v, 40u);
  // The same key, named through an SRQ of the other PD: a remote access error, and the target
  // (an RC responder in every other respect) enters ERR.
  SendWqe bad = send_to(s_other.id, 4, 0, 64, WqeOp::kWrite);
  bad.remote_addr = tgt_ctx_.addr(4096);
  bad.rkey = tgt_ctx_.key;
  ASSERT_EQ(ini_->post_send(bad), 0);
  sc = run_until(*ini_ctx_.cq, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kRemAccessErr);
  EXPECT_EQ(tgt_->state(), QpState::kErr);
  EXPECT_EQ(tgt_ctx_.owner.count(AsyncEvent::kQpAccessErr, tgt_->handle()), 1u);
}

TEST_F(NicXrcTest, ARequestNamingNoSrqOfTheTargetsDomainIsAnInvalidRequest) {
  // An SRQ of another domain of the same device.
  uint32_t other = 0;
  ASSERT_EQ(b_->nic->open_xrcd(&tgt_ctx_.owner, nullptr, true, false, &other), 0);
  ASSERT_NE(other, xrcd_);
  TestSrq foreign(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, other, tgt_ctx_.cq->id, 8, 1);
  ASSERT_EQ(foreign.err, 0);
  post_recvs(foreign, tgt_ctx_, 1, 2, 0, 100);
  ASSERT_EQ(ini_->post_send(send_to(foreign.id, 7, 0, 10)), 0);
  auto sc = run_until(*ini_ctx_.cq, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kRemInvReqErr);
  EXPECT_EQ(foreign.posted(), 2u);  // nothing taken
  EXPECT_EQ(tgt_->state(), QpState::kErr);
  EXPECT_EQ(tgt_ctx_.owner.count(AsyncEvent::kQpReqErr, tgt_->handle()), 1u);
  EXPECT_EQ(ini_->state(), QpState::kErr);
}

TEST_F(NicXrcTest, AnXrcRequestAtAnRcQpAndAPlainOneAtATargetAreRefused) {
  TestSrq s1(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, tgt_ctx_.cq->id, 8, 1);
  post_recvs(s1, tgt_ctx_, 1, 2, 0, 100);
  uint8_t payload[4] = {1, 2, 3, 4};
  transport::Segment seg;
  seg.peer_ip = kIpA;
  seg.op = transport::Op::kSend;
  seg.dst_stream = tgt_->qpn();
  seg.src_stream = ini_->qpn();
  seg.total_length = sizeof(payload);
  seg.payload = payload;
  EXPECT_EQ(core(*b_, *tgt_).deliver(seg), transport::Syndrome::kRemoteInvalid);  // no SRQ named
  EXPECT_EQ(s1.posted(), 2u);
  // An RC QP given an SRQ number.
  auto rc = std::make_unique<TestQp>(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, *tgt_ctx_.cq,
                                     *tgt_ctx_.cq, caps(8));
  ASSERT_EQ(rc->err, 0);
  bring_up(*rc, kIpA, 99);
  RecvWqe r;
  r.wr_id = 5;
  r.num_sge = 1;
  r.sge[0] = tgt_ctx_.sge(0, 100);
  ASSERT_EQ(rc->post_recv(r), 0);
  seg.dst_stream = rc->qpn();
  seg.src_stream = 99;
  seg.xrc = true;
  seg.xrc_srqn = s1.id;
  EXPECT_EQ(core(*b_, *rc).deliver(seg), transport::Syndrome::kRemoteInvalid);
  EXPECT_EQ(rc->state(), QpState::kErr);
}

TEST_F(NicXrcTest, DomainsAreSharedByFileAndAnsweredAsTheKernelAnswers) {
  TestOwner other;
  uint32_t id = 0;
  // The same file: the same domain; O_EXCL refuses it; without O_CREAT an unknown file is EAGAIN.
  ASSERT_EQ(b_->nic->open_xrcd(&other, &kFile, false, false, &id), 0);
  EXPECT_EQ(id, xrcd_);
  EXPECT_EQ(b_->nic->open_xrcd(&other, &kFile, true, true, &id), EINVAL);
  const Nic::XrcdKey unknown{0x801, 7};
  EXPECT_EQ(b_->nic->open_xrcd(&other, &unknown, false, false, &id), EAGAIN);
  ASSERT_EQ(b_->nic->open_xrcd(&other, &unknown, true, true, &id), 0);
  EXPECT_NE(id, xrcd_);
  EXPECT_EQ(b_->nic->close_xrcd(&other, id), 0);
  EXPECT_EQ(b_->nic->close_xrcd(&other, id), EINVAL);  // gone with its last open
  // Without a file, a domain of its own each time.
  uint32_t p1 = 0, p2 = 0;
  ASSERT_EQ(b_->nic->open_xrcd(&other, nullptr, false, false, &p1), 0);
  ASSERT_EQ(b_->nic->open_xrcd(&other, nullptr, false, false, &p2), 0);
  EXPECT_NE(p1, p2);
  // A context that did not open a domain names nothing in it.
  TestOwner stranger;
  uint32_t pd = 0;
  ASSERT_EQ(b_->nic->alloc_pd(&stranger, &pd), 0);
  TestCq cq(*b_->nic, &stranger, 8);
  TestSrq s(*b_->nic, &stranger, pd, xrcd_, cq.id, 8, 1);
  EXPECT_EQ(s.err, EINVAL);
  TestQp t(*b_->nic, &stranger, xrcd_);
  EXPECT_EQ(t.err, EINVAL);
  std::shared_ptr<void> keep;
  EXPECT_EQ(b_->nic->open_qp(&stranger, xrcd_, tgt_->qpn(), 1, &keep), EINVAL);
  // A target is not destroyed as other QPs are, only closed handle by handle, by a holder.
  EXPECT_EQ(b_->nic->destroy_qp(&tgt_ctx_.owner, tgt_->qpn()), EINVAL);
  EXPECT_EQ(b_->nic->close_qp(&stranger, tgt_->qpn(), 1), EINVAL);
  // The domain's last open of a context that has a target handle or an SRQ in it is busy.
  EXPECT_EQ(b_->nic->close_xrcd(&tgt_ctx_.owner, xrcd_), EBUSY);
  // An initiator has no receive side; one that asks for a receive CQ is refused.
  hostif::CreateQpReq req;
  req.type = QpType::kXrcIni;
  req.pd = ini_ctx_.pd;
  req.send_cq = req.recv_cq = ini_ctx_.cq->id;
  Ring ring(hostif::qp_layout(caps(8)).bytes);
  hostif::init_qp(ring.mem, 0, QpType::kXrcIni, caps(8));
  uint32_t qpn = 0;
  EXPECT_EQ(a_->nic->create_qp(&ini_ctx_.owner, req, reinterpret_cast<hostif::QpHeader*>(ring.mem), &qpn), EINVAL);
}

TEST_F(NicXrcTest, ATargetOutlivesItsCreatorWhileAnotherContextHoldsItAndGoesWithTheLast) {
  // A second context of device b opens the domain by its file and the target by number, and
  // has its own SRQ there.
  Ctx second;
  second.open(*b_->nic);
  uint32_t x = 0;
  ASSERT_EQ(b_->nic->open_xrcd(&second.owner, &kFile, false, false, &x), 0);
  ASSERT_EQ(x, xrcd_);
  std::shared_ptr<void> keep;
  ASSERT_EQ(b_->nic->open_qp(&second.owner, xrcd_, tgt_->qpn(), 0x5ec0, &keep), 0);
  TestSrq s(*b_->nic, &second.owner, second.pd, xrcd_, second.cq->id, 8, 1);
  ASSERT_EQ(s.err, 0);
  post_recvs(s, second, 300, 4, 0, 100);
  ASSERT_EQ(ini_->post_send(send_to(s.id, 1, 0, 16)), 0);
  ASSERT_EQ(run_until(*second.cq, 1).size(), 1u);
  // The creator exits: its handle goes, the target stays and still serves the other context.
  b_->nic->release(&tgt_ctx_.owner);
  ASSERT_NE(b_->nic->find_qp(tgt_->qpn()), nullptr);
  EXPECT_FALSE(b_->nic->owns_anything(&tgt_ctx_.owner));
  ASSERT_EQ(ini_->post_send(send_to(s.id, 2, 0, 16)), 0);
  auto rc = run_until(*second.cq, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].wr_id, 301u);
  EXPECT_EQ(rc[0].qp_num, tgt_->qpn());
  // Its events now go to the remaining handle only: a request for an SRQ the domain lacks.
  ASSERT_EQ(ini_->post_send(send_to(0xabcde, 3, 0, 16)), 0);
  auto sc = run_until(*ini_ctx_.cq, 3);
  ASSERT_EQ(sc.size(), 3u);
  EXPECT_EQ(sc[2].status, WcStatus::kRemInvReqErr);
  EXPECT_EQ(second.owner.count(AsyncEvent::kQpReqErr, 0x5ec0), 1u);
  EXPECT_EQ(tgt_ctx_.owner.count(AsyncEvent::kQpReqErr), 0u);
  // The last handle closes: the target is gone with it.
  EXPECT_EQ(b_->nic->close_xrcd(&second.owner, xrcd_), EBUSY);
  EXPECT_EQ(b_->nic->close_qp(&second.owner, tgt_->qpn(), 0x5ec0), 0);
  EXPECT_EQ(b_->nic->find_qp(tgt_->qpn()), nullptr);
  EXPECT_EQ(b_->nic->close_qp(&second.owner, tgt_->qpn(), 0x5ec0), EINVAL);
  EXPECT_EQ(b_->nic->close_xrcd(&second.owner, xrcd_), EBUSY);  // its SRQ is still in it
  EXPECT_EQ(b_->nic->destroy_srq(&second.owner, s.id), 0);
  EXPECT_EQ(b_->nic->close_xrcd(&second.owner, xrcd_), 0);
  EXPECT_EQ(b_->nic->owned_by(&second.owner).xrcds, 0u);
  // The domain went with its last open: the file names none now.
  EXPECT_EQ(b_->nic->open_xrcd(&second.owner, &kFile, false, false, &x), EAGAIN);
}

TEST_F(NicXrcTest, AnSrqThatGoesAwayIsRefusedAfterAndItsContextsExitLeavesNothing) {
  Ctx second;
  second.open(*b_->nic);
  uint32_t x = 0;
  ASSERT_EQ(b_->nic->open_xrcd(&second.owner, &kFile, false, false, &x), 0);
  TestSrq s(*b_->nic, &second.owner, second.pd, xrcd_, second.cq->id, 8, 1);
  ASSERT_EQ(s.err, 0);
  post_recvs(s, second, 1, 4, 0, 100);
  ASSERT_EQ(ini_->post_send(send_to(s.id, 1, 0, 16)), 0);
  ASSERT_EQ(run_until(*second.cq, 1).size(), 1u);
  // Its CQ cannot go first; the context's PD neither.
  EXPECT_EQ(b_->nic->destroy_cq(&second.owner, second.cq->id), EBUSY);
  // The process holding the SRQ is killed: everything of it goes, the target stays (its
  // creator holds it), and a request for the SRQ is now for one the domain does not have.
  b_->nic->release(&second.owner);
  EXPECT_FALSE(b_->nic->owns_anything(&second.owner));
  ASSERT_NE(b_->nic->find_qp(tgt_->qpn()), nullptr);
  ASSERT_EQ(ini_->post_send(send_to(s.id, 2, 0, 16)), 0);
  auto sc = run_until(*ini_ctx_.cq, 2);
  ASSERT_EQ(sc.size(), 2u);
  EXPECT_EQ(sc[1].status, WcStatus::kRemInvReqErr);
  // The domain is still the creator's.
  EXPECT_EQ(b_->nic->owned_by(&tgt_ctx_.owner).xrcds, 1u);
}

TEST_F(NicXrcTest, AnInitiatorCarriesNoWindowOperations) {
  SendWqe w;
  w.wr_id = 9;
  w.op = WqeOp::kLocalInv;
  w.signaled = true;
  w.rkey = 0x100;
  ASSERT_EQ(ini_->post_send(w), 0);
  auto sc = run_until(*ini_ctx_.cq, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kLocQpOpErr);
  EXPECT_EQ(ini_->state(), QpState::kErr);
}

}  // namespace
}  // namespace metaroce::nic

namespace metaroce::nic {
namespace {

// A stream much longer than the SRQ is deep: receives run out again and again (RNR, back-off),
// and the receiver posts each one again as it completes. Every message arrives, in order.
TEST_F(NicXrcTest, AStreamLongerThanTheSrqCompletesAsReceivesArePostedAgain) {
  TestCq rcq(*b_->nic, &tgt_ctx_.owner, 64);
  TestSrq s(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, rcq.id, 8, 1);
  ASSERT_EQ(s.err, 0);
  constexpr uint32_t kSlot = 4096, kMsgs = 600;
  for (int i = 0; i < 8; ++i) post_recvs(s, tgt_ctx_, i, 1, i * kSlot, kSlot);
  run_stream(s, rcq, kSlot, kMsgs, 48);
  EXPECT_GT(b_->nic->counters().rnr, 0u);
}

TEST_F(NicXrcTest, AStreamWithinTheSrqsDepthIsNeverRefused) {
  TestCq rcq(*b_->nic, &tgt_ctx_.owner, 64);
  TestSrq s(*b_->nic, &tgt_ctx_.owner, tgt_ctx_.pd, xrcd_, rcq.id, 8, 1);
  ASSERT_EQ(s.err, 0);
  constexpr uint32_t kSlot = 4096, kMsgs = 600;
  for (int i = 0; i < 8; ++i) post_recvs(s, tgt_ctx_, i, 1, i * kSlot, kSlot);
  run_stream(s, rcq, kSlot, kMsgs, 8);
  EXPECT_EQ(b_->nic->counters().rnr, 0u);
}

void NicXrcTest::run_stream(TestSrq& s, TestCq& rcq, uint32_t kSlot, uint32_t kMsgs,
                            uint32_t window) {
  uint32_t sent = 0, sends_done = 0, received = 0;
  uint64_t next_recv = 8;
  for (int round = 0; round < 200000 && (received < kMsgs || sends_done < kMsgs); ++round) {
    while (sent < kMsgs && sent - sends_done < window) {
      const uint32_t len = 1 + (sent * 2749u) % kSlot;
      ASSERT_EQ(ini_->post_send(send_to(s.id, sent, (sent % 8) * kSlot, len)), 0);
      ++sent;
    }
    step();
    Cqe c[16];
    int n = ini_ctx_.cq->poll(16, c);
    for (int i = 0; i < n; ++i) ASSERT_EQ(c[i].status, WcStatus::kSuccess) << c[i].wr_id;
    sends_done += n;
    n = rcq.poll(16, c);
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(c[i].status, WcStatus::kSuccess);
      ASSERT_EQ(c[i].wr_id, received) << "receives complete in posting order";
      ASSERT_EQ(c[i].byte_len, 1 + (received * 2749u) % kSlot);
      ++received;
      post_recvs(s, tgt_ctx_, next_recv, 1, (next_recv % 8) * kSlot, kSlot);
      ++next_recv;
    }
  }
  EXPECT_EQ(received, kMsgs);
  EXPECT_EQ(sends_done, kMsgs);
}

}  // namespace
}  // namespace metaroce::nic
