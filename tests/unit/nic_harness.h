// SPDX-License-Identifier: Apache-2.0
// A driver for the NIC core in unit tests: the rings a provider shares with the engine, here in
// the test's own memory, filled and drained with the same hostif functions the provider uses;
// an Owner that records its events; devices joined by an in-memory link, driven by hand on a
// virtual clock.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "datapath/hostif/queues.h"
#include "datapath/io/mem_link.h"
#include "datapath/nic/link_layer.h"
#include "datapath/nic/nic.h"

namespace metaroce::nic::test {

using hostif::Cqe;
using hostif::Sge;
using hostif::WqeOp;

// A ring segment as the engine would map it: zeroed, page-aligned.
struct Ring {
  explicit Ring(size_t bytes) : size(bytes), mem(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes))) {
    std::memset(mem, 0, bytes);
  }
  ~Ring() { std::free(mem); }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  size_t size;
  uint8_t* mem;
};

class TestOwner final : public Owner {
 public:
  explicit TestOwner(Memory* mem = nullptr) : mem_(mem ? mem : &direct_) {}
  Memory& memory() override { return *mem_; }
  void use(Memory* mem) { mem_ = mem ? mem : &direct_; }  // where its memory is reached from now
  void async_event(uint64_t handle, hostif::AsyncEvent ev) override { events.push_back({handle, ev}); }
  void cq_event(uint32_t cq_id, uint64_t) override { cq_events.push_back(cq_id); }
  uint32_t pid() const override { return 1; }
  size_t count(hostif::AsyncEvent ev, uint64_t handle = 0) const {
    size_t n = 0;
    for (auto& [h, e] : events) n += e == ev && (handle == 0 || h == handle);
    return n;
  }
  std::vector<std::pair<uint64_t, hostif::AsyncEvent>> events;
  std::vector<uint32_t> cq_events;

 private:
  DirectMemory direct_;
  Memory* mem_;
};

// A work request as a test writes it (the fields of ibv_send_wr the NIC sees).
struct SendWqe {
  uint64_t wr_id = 0;
  WqeOp op = WqeOp::kSend;
  bool signaled = false;
  uint32_t imm = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t compare_add = 0, swap = 0;
  uint32_t num_sge = 0;
  Sge sge[hostif::kMaxSge] = {};
  uint32_t inline_len = 0;
  uint8_t inline_data[hostif::kMaxInline] = {};
  uint32_t gathered_len = 0;  // kGathered: that many bytes of inline_data are the SGEs' copy
  uint32_t ud_ip = 0, ud_qpn = 0, ud_qkey = 0;
  uint32_t xrc_srqn = 0;  // XRC initiator: the target's SRQ
};

struct RecvWqe {
  uint64_t wr_id = 0;
  uint32_t num_sge = 0;
  Sge sge[hostif::kMaxSge] = {};
};

class TestCq {
 public:
  TestCq(Nic& nic, Owner* o, uint32_t cqe, bool channel = false)
      : nic_(nic), owner_(o), ring_(std::make_unique<Ring>(hostif::cq_layout(cqe).bytes)) {
    hostif::init_cq(ring_->mem, cqe);
    err = nic.create_cq(o, header(), reinterpret_cast<uintptr_t>(this), channel, &id);
  }
  ~TestCq() { nic_.destroy_cq(owner_, id); }
  hostif::CqHeader* header() { return reinterpret_cast<hostif::CqHeader*>(ring_->mem); }
  int poll(int n, Cqe* out) { return hostif::cq_poll(header(), n, out); }
  // ibv_resize_cq as the provider does it: a new ring, which replaces the old one on success.
  int resize(uint32_t cqe) {
    auto ring = std::make_unique<Ring>(hostif::cq_layout(cqe).bytes);
    hostif::init_cq(ring->mem, cqe);
    const int e = nic_.resize_cq(owner_, id, reinterpret_cast<hostif::CqHeader*>(ring->mem));
    if (!e) ring_ = std::move(ring);
    return e;
  }
  void arm() { header()->armed.store(1); }
  uint32_t id = 0;
  int err = 0;

 private:
  Nic& nic_;
  Owner* owner_;
  std::unique_ptr<Ring> ring_;
};

class TestSrq {
 public:
  TestSrq(Nic& nic, Owner* o, uint32_t pd, uint32_t max_wr, uint32_t max_sge)
      : nic_(nic), owner_(o), ring_(hostif::srq_layout(max_wr, max_sge).bytes) {
    hostif::init_srq(ring_.mem, max_wr, max_sge);
    err = nic.create_srq(o, pd, header(), reinterpret_cast<uintptr_t>(this), &id);
  }
  // An XRC SRQ of domain xrcd, completing into cq.
  TestSrq(Nic& nic, Owner* o, uint32_t pd, uint32_t xrcd, uint32_t cq, uint32_t max_wr,
          uint32_t max_sge)
      : nic_(nic), owner_(o), ring_(hostif::srq_layout(max_wr, max_sge).bytes) {
    hostif::init_srq(ring_.mem, max_wr, max_sge);
    err = nic.create_xrc_srq(o, pd, xrcd, cq, header(), reinterpret_cast<uintptr_t>(this), &id);
  }
  // A tag-matching SRQ of max_tags tags, completing into cq (verbs-mapping.md §19).
  struct Tm {
    uint32_t cq = 0, max_tags = 0;
  };
  TestSrq(Nic& nic, Owner* o, uint32_t pd, Tm tm, uint32_t max_wr, uint32_t max_sge)
      : nic_(nic), owner_(o), ring_(hostif::srq_layout(max_wr, max_sge).bytes) {
    hostif::init_srq(ring_.mem, max_wr, max_sge);
    err = nic.create_tm_srq(o, pd, tm.cq, tm.max_tags, header(), reinterpret_cast<uintptr_t>(this),
                            &id);
  }
  hostif::SrqHeader* header() { return reinterpret_cast<hostif::SrqHeader*>(ring_.mem); }
  int post_recv(const RecvWqe& r) { return hostif::srq_post(header(), r.wr_id, r.sge, r.num_sge); }
  void set_limit(uint32_t l) { header()->limit.store(l); }
  uint32_t limit() { return header()->limit.load(); }
  uint32_t posted() { return header()->posted_head.load() - header()->posted_tail.load(); }
  uint32_t id = 0;
  int err = 0;

 private:
  Nic& nic_;
  Owner* owner_;
  Ring ring_;
};

class TestQp {
 public:
  // want_qpn: the number a kernel device chose (0: the NIC's own).
  // flags: CreateQpReq::flags.
  TestQp(Nic& nic, Owner* o, uint32_t pd, TestCq& scq, TestCq& rcq, const hostif::QpCaps& caps,
         hostif::QpType type = hostif::QpType::kRc, TestSrq* srq = nullptr, uint32_t want_qpn = 0,
         uint32_t flags = 0)
      : nic_(nic), owner_(o), ring_(hostif::qp_layout(caps).bytes) {
    hostif::init_qp(ring_.mem, 0, type, caps);
    hostif::CreateQpReq req;
    req.pd = pd;
    req.send_cq = scq.id;
    req.recv_cq = rcq.id;
    req.srq = srq ? srq->id : 0;
    req.type = type;
    req.caps = caps;
    req.handle = reinterpret_cast<uintptr_t>(this);
    req.qpn = want_qpn;
    req.flags = flags;
    err = nic.create_qp(o, req, header(), &qpn_);
  }
  // An XRC initiator (send queue only) of pd, completing into scq.
  TestQp(Nic& nic, Owner* o, uint32_t pd, TestCq& scq, const hostif::QpCaps& caps)
      : nic_(nic), owner_(o), ring_(hostif::qp_layout(caps).bytes) {
    hostif::init_qp(ring_.mem, 0, hostif::QpType::kXrcIni, caps);
    hostif::CreateQpReq req;
    req.pd = pd;
    req.send_cq = scq.id;
    req.type = hostif::QpType::kXrcIni;
    req.caps = caps;
    req.handle = reinterpret_cast<uintptr_t>(this);
    err = nic.create_qp(o, req, header(), &qpn_);
  }
  // An XRC target of domain xrcd.
  TestQp(Nic& nic, Owner* o, uint32_t xrcd)
      : nic_(nic), owner_(o), ring_(hostif::qp_layout(hostif::QpCaps{}).bytes) {
    hostif::init_qp(ring_.mem, 0, hostif::QpType::kXrcTgt, hostif::QpCaps{});
    hostif::CreateQpReq req;
    req.type = hostif::QpType::kXrcTgt;
    req.xrcd = xrcd;
    req.handle = reinterpret_cast<uintptr_t>(this);
    err = nic.create_qp(o, req, header(), &qpn_);
  }
  hostif::QpHeader* header() { return reinterpret_cast<hostif::QpHeader*>(ring_.mem); }
  uint32_t qpn() const { return qpn_; }
  uint64_t handle() const { return reinterpret_cast<uintptr_t>(this); }
  hostif::QpState state() { return static_cast<hostif::QpState>(header()->state.load()); }
  int modify(uint32_t what, hostif::QpState s, unsigned access = 0, const hostif::QpRemote& r = {}) {
    hostif::ModifyQpReq m;
    m.qpn = qpn_;
    m.what = what;
    m.state = s;
    m.access = access;
    m.remote = r;
    int e = nic_.modify_qp(owner_, m);
    if (!e && (what & hostif::kModState) && s == hostif::QpState::kReset) {
      header()->sq_head.store(0);  // as the provider does once the reset is answered
      header()->rq_head.store(0);
    }
    return e;
  }
  void set_state(hostif::QpState s) { modify(hostif::kModState, s); }
  void set_access(unsigned a) { modify(hostif::kModAccess, state(), a); }
  void set_remote(const hostif::QpRemote& r) { modify(hostif::kModRemote, state(), 0, r); }
  int post_send(const SendWqe& w) {
    uint8_t* slot = hostif::sq_reserve(header());
    if (!slot) return ENOMEM;
    hostif::SendWqe* h = hostif::send_wqe(slot);
    std::memset(h, 0, sizeof(*h));
    h->wr_id = w.wr_id;
    h->op = w.op;
    h->flags = w.signaled ? hostif::kSignaled : 0;
    h->imm = w.imm;
    h->remote_addr = w.remote_addr;
    h->rkey = w.ud_qkey ? w.ud_qkey : w.rkey;
    h->compare_add = w.compare_add;
    h->swap = w.swap;
    h->num_sge = static_cast<uint16_t>(w.num_sge);
    h->inline_len = w.inline_len;
    h->ud_ip = w.ud_ip;
    h->ud_qpn = w.ud_qpn;
    h->xrc_srqn = w.xrc_srqn;
    std::memcpy(hostif::send_sges(slot), w.sge, sizeof(Sge) * w.num_sge);
    std::memcpy(hostif::send_inline(slot, header()->max_send_sge), w.inline_data,
                std::max(w.inline_len, w.gathered_len));
    if (w.gathered_len) h->flags |= hostif::kGathered;
    hostif::sq_post(header());
    return 0;
  }
  int post_recv(const RecvWqe& r) {
    uint8_t* slot = hostif::rq_reserve(header());
    if (!slot) return ENOMEM;
    hostif::recv_wqe(slot)->wr_id = r.wr_id;
    hostif::recv_wqe(slot)->num_sge = r.num_sge;
    std::memcpy(hostif::recv_sges(slot), r.sge, sizeof(Sge) * r.num_sge);
    hostif::rq_post(header());
    return 0;
  }
  int err = 0;

 private:
  Nic& nic_;
  Owner* owner_;
  Ring ring_;
  uint32_t qpn_ = 0;
};

inline LinkConfig test_link(const char* name, uint32_t ip, uint16_t planes = 1) {
  LinkConfig c;
  c.name = name;
  c.devargs = "mem";
  c.ip = ip;
  c.paths = 4;
  c.planes = planes;
  return c;
}

// A device of the test: its NIC, its link layer over in-memory ports.
struct Device {
  Device(const LinkConfig& link, std::vector<std::unique_ptr<io::Port>> ports, uint64_t seed,
         uint32_t mtu_payload = 1024) {
    NicConfig c = nic_config(link, seed);
    c.engine.mtu_payload = mtu_payload;
    nic = std::make_unique<Nic>(c);
    layer = std::make_unique<LinkLayer>(*nic, std::move(ports), /*goodbye=*/false);
  }
  bool progress(transport::Time now) { return layer->poll(now); }
  std::unique_ptr<Nic> nic;
  std::unique_ptr<LinkLayer> layer;
};

}  // namespace metaroce::nic::test
