// SPDX-License-Identifier: Apache-2.0
// The NIC core of one link: object tables, the transport host callbacks, batched access to
// application memory, and the order of a pass (placement, then completions).
#include "datapath/nic/nic.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "datapath/wire/frame.h"
#include "datapath/wire/mrh.h"
#include "datapath/transport/path_stats.h"

namespace metaroce::nic {

using transport::Syndrome;
using transport::Time;

namespace {

constexpr uint64_t kReadRespTag = uint64_t{1} << 63;
constexpr uint64_t kCmTag = uint64_t{1} << 61;  // cm_send's messages (bits 62, 63 clear)
constexpr uint32_t kEnginePathWindow = 64;       // packets: the transport's per-path maximum
constexpr uint32_t kEngineConnWindowMax = 4096;  // packets: 16 MiB in flight at 4 KiB
constexpr uint32_t kScratchBlock = 16384;
constexpr uint64_t kPage = 4096;
// What a data packet adds to its payload inside the link MTU (an IP packet size), an XRC
// request's extension included (every message is cut alike, wire.md §4.1).
constexpr uint32_t kFrameOverhead =
    wire::kIpv4HeaderLen + wire::kUdpHeaderLen + wire::kDataHeadersLen + wire::kXrcExtLen;
// Room the engine may ask for beyond the payload: the largest of a data and an ACK/NAK packet.
constexpr uint32_t kTransportHeaderRoom =
    std::max<uint32_t>(wire::kDataHeadersLen,
                       wire::kAckHeadersLen + wire::kMaxNakRecords * wire::kNakRecordLen);

}  // namespace

uint32_t verbs_mtu_for(uint32_t link_mtu) {
  uint32_t room = link_mtu > kFrameOverhead ? link_mtu - kFrameOverhead : 0;
  for (uint32_t m = 4096; m >= 256; m /= 2)
    if (m <= room) return m;
  return 256;
}

uint32_t max_transport_packet(uint32_t link_mtu) {
  return verbs_mtu_for(link_mtu) + kTransportHeaderRoom;
}

NicConfig nic_config(const LinkConfig& link, uint64_t seed) {
  NicConfig c;
  c.link = link;
  transport::EngineConfig& e = c.engine;
  e.local_ip = link.ip;
  e.num_paths = link.paths;
  e.num_planes = static_cast<uint8_t>(std::max<uint16_t>(link.planes, 1));
  e.mtu_payload = verbs_mtu_for(link.mtu);
  e.max_packet = max_transport_packet(link.mtu);
  // Windows start full (congestion.md §2.1: the initial window is one BDP, no slow start). A
  // software NIC's RTT is scheduling-bound, tens of microseconds to milliseconds on these
  // 2-core machines, so one BDP at tens of Gbit/s is thousands of packets: every path's full
  // window. ECN marks and the receiver's hints bring them down where the fabric needs it.
  e.path_window_init = kEnginePathWindow;
  e.conn_window_max = std::min<uint32_t>(uint32_t{link.paths} * kEnginePathWindow, kEngineConnWindowMax);
  e.conn_window_init = e.conn_window_max;
  e.rx_capacity_mbps = link.rx_capacity_mbps;
  e.seed = seed;
  e.secret_ids = true;
  return c;
}

Nic::Nic(const NicConfig& cfg)
    : cfg_(cfg), active_mtu_(verbs_mtu_for(cfg.link.mtu)),
      engine_(transport::Engine::create(cfg.engine, *this)),
      next_qpn_(0x100 + static_cast<uint32_t>(cfg.engine.seed % 0x1000)) {}

Nic::~Nic() = default;

// --- objects ---------------------------------------------------------------------------------

bool Nic::pd_of(Owner* o, uint32_t pd) const {
  auto it = pds_.find(pd);
  return it != pds_.end() && it->second == o;
}

CompletionQueue* Nic::cq_of(Owner* o, uint32_t id) {
  auto it = cqs_.find(id);
  return it != cqs_.end() && it->second->owner() == o ? it->second.get() : nullptr;
}

SharedReceiveQueue* Nic::srq_of(Owner* o, uint32_t id) {
  auto it = srqs_.find(id);
  return it != srqs_.end() && it->second->owner() == o ? it->second.get() : nullptr;
}

QueuePair* Nic::qp_of(uint32_t qpn) {
  QueuePair*& slot = qp_cache_[qpn % qp_cache_.size()];
  if (slot && slot->qpn() == qpn) return slot;
  auto it = qps_.find(qpn);
  if (it == qps_.end()) return nullptr;
  slot = it->second.get();
  return slot;
}

const QueuePair* Nic::find_qp(uint32_t qpn) const {
  auto it = qps_.find(qpn);
  return it == qps_.end() ? nullptr : it->second.get();
}

int Nic::alloc_pd(Owner* o, uint32_t* pd) {
  if (pds_.size() >= cfg_.link.limits.pd) return ENOMEM;
  while (next_pd_ == 0 || pds_.count(next_pd_)) ++next_pd_;
  *pd = next_pd_++;
  pds_[*pd] = o;
  return 0;
}

int Nic::dealloc_pd(Owner* o, uint32_t pd) {
  if (!pd_of(o, pd)) return EINVAL;
  for (const auto& [qpn, qp] : qps_)
    if (qp->init().pd == pd) return EBUSY;
  for (const auto& [id, srq] : srqs_)
    if (srq->pd() == pd) return EBUSY;
  for (uint32_t key : mrs_.keys_of(o))
    if (mrs_.find(key)->pd == pd) return EBUSY;
  pds_.erase(pd);
  return 0;
}

namespace {

// The region registration verbs allow: within kMaxMrSize and not wrapping, or the whole address
// space for implicit on-demand paging (verbs-mapping.md §12).
bool mr_range_ok(uint64_t addr, uint64_t length, uint64_t iova, unsigned access) {
  if (addr == 0 && length == UINT64_MAX && iova == 0 && (access & kOnDemand)) return true;
  return length != 0 && length <= kMaxMrSize && addr + length >= addr && iova + length >= iova;
}

}  // namespace

int Nic::reg_mr(Owner* o, uint32_t pd, uint64_t addr, uint64_t length, uint64_t iova,
                unsigned int access, uint32_t* lkey, uint32_t* rkey, uint32_t want) {
  if (!pd_of(o, pd) || (access & ~kMrAccessKnown) || !mr_range_ok(addr, length, iova, access))
    return EINVAL;
  if (mrs_.size() >= cfg_.link.limits.mr) return ENOMEM;
  const uint32_t key = mrs_.add(pd, iova, addr, length, access, &o->memory(), o, want);
  if (key == 0) return want ? EBUSY : ENOMEM;
  *lkey = *rkey = key;
  return 0;
}

int Nic::rereg_mr(Owner* o, uint32_t lkey, unsigned flags, uint32_t pd, uint64_t addr,
                  uint64_t length, unsigned int access) {
  MemoryRegion* r = mrs_.find_mutable(lkey, o);
  if (!r || r->mw_type || flags == 0 || (flags & ~(kReregTranslation | kReregPd | kReregAccess)))
    return EINVAL;
  if (r->windows) return EBUSY;  // windows are bound to what it is now
  if ((flags & kReregPd) && !pd_of(o, pd)) return EINVAL;
  if ((flags & kReregAccess) && (access & ~kMrAccessKnown)) return EINVAL;
  const unsigned new_access = (flags & kReregAccess) ? access : r->access;
  if ((flags & kReregTranslation) && !mr_range_ok(addr, length, addr, new_access)) return EINVAL;
  // Checked whole before anything changes: a refused rereg leaves the region as it was.
  if (flags & kReregPd) r->pd = pd;
  if (flags & kReregAccess) r->access = access;
  if (flags & kReregTranslation) {
    r->addr = r->va = addr;
    r->length = length;
  }
  return 0;
}

int Nic::check_mr(Owner* o, uint32_t lkey, uint32_t pd, uint64_t addr, uint64_t length) const {
  if (!mrs_.find(lkey, o)) return EFAULT;
  return mrs_.check(lkey, pd, 0, addr, length, nullptr) == MrCheck::kOk ? 0 : EFAULT;
}

int Nic::alloc_mw(Owner* o, uint32_t pd, uint8_t type, uint32_t* rkey) {
  if (!pd_of(o, pd)) return EINVAL;
  if (mrs_.size() >= cfg_.link.limits.mr) return ENOMEM;
  return mrs_.add_window(pd, type, o, rkey);
}

int Nic::dealloc_mw(Owner* o, uint32_t rkey) {
  const MemoryRegion* w = mrs_.window_at(rkey, o);
  if (!w) return EINVAL;
  mrs_.remove(w->key);  // a bound window is invalidated with it
  return 0;
}

int Nic::dereg_mr(Owner* o, uint32_t lkey) {
  const MemoryRegion* r = mrs_.find(lkey, o);
  if (!r || r->mw_type) return EINVAL;
  if (r->windows) return EBUSY;  // ibv_dereg_mr(3): windows are still bound to it
  mrs_.remove(lkey);
  return 0;
}

int Nic::create_cq(Owner* o, hostif::CqHeader* ring, uint64_t handle, bool channel, uint32_t* id) {
  if (cqs_.size() >= cfg_.link.limits.cq) return ENOMEM;
  while (next_cq_ == 0 || cqs_.count(next_cq_)) ++next_cq_;
  *id = next_cq_++;
  cqs_[*id] = std::make_unique<CompletionQueue>(*id, o, ring, handle, channel);
  return 0;
}

int Nic::destroy_cq(Owner* o, uint32_t id) {
  CompletionQueue* cq = cq_of(o, id);
  if (!cq) return EINVAL;
  if (cq->users > 0) return EBUSY;
  std::erase(dirty_cqs_, cq);
  cqs_.erase(id);
  return 0;
}

int Nic::resize_cq(Owner* o, uint32_t id, hostif::CqHeader* ring) {
  CompletionQueue* cq = cq_of(o, id);
  if (!cq) return EINVAL;
  // What it holds, and what the send queues feeding it are owed: sends already posted complete
  // into it whatever the size (receives are not counted: an application keeps many posted).
  uint32_t owed = 0;
  for (const QueuePair* qp : qp_list_)
    if (qp->init().send_cq == cq) owed += qp->sends_outstanding();
  return cq->move_to(ring, owed) ? 0 : EINVAL;
}

uint32_t Nic::alloc_srq_id() {
  // Numbers go round the 24-bit space before one is used again, so that an initiator still
  // naming a destroyed SRQ is refused rather than reaching its successor.
  while ((next_srq_ & wire::kXrcSrqnMask) == 0 || srqs_.count(next_srq_ & wire::kXrcSrqnMask))
    ++next_srq_;
  return next_srq_++ & wire::kXrcSrqnMask;
}

int Nic::create_srq(Owner* o, uint32_t pd, hostif::SrqHeader* ring, uint64_t handle,
                    uint32_t* id) {
  if (!pd_of(o, pd)) return EINVAL;
  if (srqs_.size() >= cfg_.link.limits.srq) return ENOMEM;
  *id = alloc_srq_id();
  srqs_[*id] = std::make_unique<SharedReceiveQueue>(*id, o, pd, ring, handle);
  return 0;
}

int Nic::create_tm_srq(Owner* o, uint32_t pd, uint32_t cq_id, uint32_t max_tags,
                       hostif::SrqHeader* ring, uint64_t handle, uint32_t* id) {
  CompletionQueue* cq = cq_of(o, cq_id);
  if (!pd_of(o, pd) || !cq || max_tags < 1 || max_tags > TagMatcher::kMaxTags) return EINVAL;
  if (srqs_.size() >= cfg_.link.limits.srq) return ENOMEM;
  *id = alloc_srq_id();
  srqs_[*id] = std::make_unique<SharedReceiveQueue>(*id, o, pd, ring, handle, 0, cq, max_tags);
  cq->users++;
  return 0;
}

int Nic::srq_tag_op(Owner* o, const hostif::SrqTagOpReq& req, uint32_t* handle) {
  SharedReceiveQueue* srq = srq_of(o, req.srq);
  if (!srq || !srq->tags()) return EINVAL;
  TagMatcher& tm = *srq->tags();
  hostif::Cqe c{};
  c.wr_id = req.wr_id;
  switch (req.op) {
    case hostif::TagOp::kAdd: {
      if (req.num_sge > 1) return EINVAL;
      const hostif::Sge sge = req.num_sge ? req.sge : hostif::Sge{};
      if (sge.length &&
          mrs_.check(sge.lkey, srq->pd(), kLocalWrite, sge.addr, sge.length, nullptr) != MrCheck::kOk)
        return EINVAL;
      if (tm.add(req.tag, req.mask, req.recv_wr_id, sge, req.unexpected_cnt, handle) != 0)
        return ENOMEM;
      c.opcode = WcOpcode::kTmAdd;
      // Behind on unexpected messages: nothing matches until it reports the count (§19).
      if (!tm.in_sync()) c.wc_flags = hostif::kWcTmSyncReq;
      break;
    }
    case hostif::TagOp::kDel:
      c.opcode = WcOpcode::kTmDel;
      if (tm.remove(req.handle) != 0) c.status = WcStatus::kTmErr;  // matched or gone already
      break;
    case hostif::TagOp::kSync:
      c.opcode = WcOpcode::kTmSync;
      tm.sync(req.unexpected_cnt);
      break;
    default:
      return EINVAL;
  }
  if (req.signaled || c.status != WcStatus::kSuccess) {
    srq->cq()->stage(c);
    note_dirty(srq->cq());
    publish_completions();
  }
  return 0;
}

int Nic::destroy_srq(Owner* o, uint32_t id) {
  SharedReceiveQueue* srq = srq_of(o, id);
  if (!srq) return EINVAL;
  if (srq->users > 0) return EBUSY;
  if (srq->xrcd()) {
    // Target QPs of the domain forget what they claimed of it; a later request naming it is
    // refused as one for an SRQ the domain does not have.
    for (QueuePair* qp : qp_list_)
      if (qp->init().type == QpType::kXrcTgt) qp->forget_srq(srq);
    srq->cq()->users--;
  } else if (srq->tags()) {
    srq->cq()->users--;
  }
  srqs_.erase(id);
  return 0;
}

// --- XRC ---------------------------------------------------------------------------------------

bool Nic::xrcd_open_by(Owner* o, uint32_t xrcd) const {
  auto it = xrcds_.find(xrcd);
  return it != xrcds_.end() && it->second.opens.count(o);
}

bool Nic::xrcd_busy(const Owner* o, uint32_t xrcd) const {
  for (const auto& [id, srq] : srqs_)
    if (srq->owner() == o && srq->xrcd() == xrcd) return true;
  for (const QueuePair* qp : qp_list_)
    if (qp->init().type == QpType::kXrcTgt && qp->init().xrcd == xrcd && qp->handles_of(o))
      return true;
  return false;
}

int Nic::open_xrcd(Owner* o, const XrcdKey* key, bool create, bool exclusive, uint32_t* xrcd) {
  if (key) {
    for (auto& [id, x] : xrcds_) {
      if (!x.named || !(x.key == *key)) continue;
      if (exclusive) return EINVAL;
      ++x.opens[o];
      *xrcd = id;
      return 0;
    }
    if (!create) return EAGAIN;  // no domain of that file yet, and not asked to make one
  }
  if (xrcds_.size() >= cfg_.link.limits.pd) return ENOMEM;
  while (next_xrcd_ == 0 || xrcds_.count(next_xrcd_)) ++next_xrcd_;
  *xrcd = next_xrcd_++;
  Xrcd& x = xrcds_[*xrcd];
  x.named = key != nullptr;
  if (key) x.key = *key;
  x.opens[o] = 1;
  return 0;
}

int Nic::close_xrcd(Owner* o, uint32_t xrcd) {
  auto it = xrcds_.find(xrcd);
  if (it == xrcds_.end()) return EINVAL;
  auto open = it->second.opens.find(o);
  if (open == it->second.opens.end()) return EINVAL;
  if (open->second == 1 && xrcd_busy(o, xrcd)) return EBUSY;
  if (--open->second == 0) it->second.opens.erase(open);
  if (it->second.opens.empty()) xrcds_.erase(it);  // nothing can be left in it (xrcd_busy)
  return 0;
}

int Nic::create_xrc_srq(Owner* o, uint32_t pd, uint32_t xrcd, uint32_t cq_id,
                        hostif::SrqHeader* ring, uint64_t handle, uint32_t* id) {
  CompletionQueue* cq = cq_of(o, cq_id);
  if (!pd_of(o, pd) || !xrcd_open_by(o, xrcd) || !cq) return EINVAL;
  if (srqs_.size() >= cfg_.link.limits.srq) return ENOMEM;
  *id = alloc_srq_id();
  srqs_[*id] = std::make_unique<SharedReceiveQueue>(*id, o, pd, ring, handle, xrcd, cq);
  cq->users++;
  return 0;
}

SharedReceiveQueue* Nic::xrc_srq(uint32_t srqn, uint32_t xrcd) {
  auto it = srqs_.find(srqn);
  if (it == srqs_.end() || xrcd == 0 || it->second->xrcd() != xrcd) return nullptr;
  return it->second.get();
}

int Nic::open_qp(Owner* o, uint32_t xrcd, uint32_t qpn, uint64_t handle,
                 std::shared_ptr<void>* keep) {
  QueuePair* qp = qp_of(qpn);
  if (!xrcd_open_by(o, xrcd) || !qp || qp->init().type != QpType::kXrcTgt ||
      qp->init().xrcd != xrcd)
    return EINVAL;
  qp->add_handle(o, handle);
  *keep = qp->init().keep;
  return 0;
}

int Nic::close_qp(Owner* o, uint32_t qpn, uint64_t handle) {
  QueuePair* qp = qp_of(qpn);
  if (!qp || qp->init().type != QpType::kXrcTgt || !qp->held_by(o)) return EINVAL;
  if (qp->drop_handle(o, handle)) destroy_qp_now(qp);
  return 0;
}

int Nic::create_qp(Owner* o, const hostif::CreateQpReq& req, hostif::QpHeader* ring,
                   uint32_t* qpn, std::shared_ptr<void> keep) {
  QpInit init;
  init.owner = o;
  init.pd = req.pd;
  init.send_cq = cq_of(o, req.send_cq);
  init.recv_cq = cq_of(o, req.recv_cq);
  init.srq = req.srq ? srq_of(o, req.srq) : nullptr;
  init.type = req.type;
  init.sq_sig_all = req.sq_sig_all != 0;
  init.handle = req.handle;
  if ((req.flags & ~hostif::kQpBlockSelfMcast) || (req.flags && req.type != QpType::kUd))
    return EINVAL;
  init.block_self_mcast = req.flags & hostif::kQpBlockSelfMcast;
  switch (req.type) {
    case QpType::kRaw:
    case QpType::kWq:
      if (!raw_ethernet_) return EOPNOTSUPP;  // a UDP-socket link carries no Ethernet frames
      [[fallthrough]];
    case QpType::kRc:
    case QpType::kUd:
    case QpType::kUc:
      if (!pd_of(o, req.pd) || !init.send_cq || !init.recv_cq || (req.srq && !init.srq))
        return EINVAL;
      // Tag matching is an RC service (verbs-mapping.md §19).
      if (init.srq && init.srq->tags() && req.type != QpType::kRc) return EINVAL;
      break;
    case QpType::kXrcIni:
      // A send queue alone: no receive CQ, no SRQ.
      if (!pd_of(o, req.pd) || !init.send_cq || req.recv_cq || req.srq) return EINVAL;
      init.recv_cq = nullptr;
      break;
    case QpType::kXrcTgt:
      // No queues, PD or CQs: its domain's SRQs give them, message by message.
      if (!xrcd_open_by(o, req.xrcd)) return EINVAL;
      init.pd = 0;
      init.send_cq = init.recv_cq = nullptr;
      init.srq = nullptr;
      init.xrcd = req.xrcd;
      init.keep = std::move(keep);
      break;
    default:
      return EINVAL;
  }
  if (qps_.size() >= cfg_.link.limits.qp) return ENOMEM;
  uint32_t n = req.qpn;
  if (n) {
    if (n < 2 || n > 0xffffff) return EINVAL;
    if (qps_.count(n)) return EBUSY;
  } else {
    do {
      n = next_qpn_++ & 0xffffff;
    } while (n < 2 || qps_.count(n));
  }
  ring->qpn = n;
  auto qp = std::make_unique<QueuePair>(*this, n, init, ring);
  if (init.send_cq) init.send_cq->users++;
  if (init.recv_cq) init.recv_cq->users++;
  if (init.srq) init.srq->users++;
  qp_list_.push_back(qp.get());
  qps_.emplace(n, std::move(qp));
  *qpn = n;
  return 0;
}

int Nic::modify_qp(Owner* o, const hostif::ModifyQpReq& req) {
  QueuePair* qp = qp_of(req.qpn);
  if (!qp || !qp->held_by(o)) return EINVAL;
  if ((req.what & hostif::kModState) && static_cast<uint32_t>(req.state) > static_cast<uint32_t>(QpState::kErr))
    return EINVAL;
  if (req.what & hostif::kModAccess) qp->set_access(req.access);
  if (req.what & hostif::kModRemote) {
    const hostif::QpRemote& r = req.remote;
    if (r.timeout > 31 || r.retry_cnt > 7 || r.rnr_retry > 7 || r.min_rnr_timer > 31) return EINVAL;
    if (qp->lane() >= kIsolatedLane && qp->remote().ip != req.remote.ip)
      engine_->close_lane(qp->remote().ip, qp->lane());
    qp->set_remote(req.remote);
    apply_lane(qp);
  }
  if (req.what & hostif::kModState) qp->set_state(req.state);
  publish_completions();  // a move to ERR flushes at once
  return 0;
}

// --- direct verbs --------------------------------------------------------------------------

uint32_t Nic::lane_for(const QueuePair& qp) const {
  const hostif::SetQpPathsReq& p = qp.paths();
  if (p.flags & hostif::kQpIsolated) return kIsolatedLane | qp.qpn();
  const uint32_t every = every_plane();
  const uint16_t n = p.num_paths ? p.num_paths : cfg_.engine.num_paths;
  const uint32_t mask = p.plane_mask ? p.plane_mask : every;
  const bool hints = !(p.flags & hostif::kQpNoRateHints);
  if (n == cfg_.engine.num_paths && mask == every && hints) return 0;
  // One shared lane per distinct setting: its name is the setting (16 plane bits, the path
  // count less one, the hints bit).
  return kSharedLane | (hints ? 0 : 1u << 29) | (uint32_t{n - 1u} << 16) | mask;
}

void Nic::apply_lane(QueuePair* qp) {
  const uint32_t old = qp->lane();
  const uint32_t lane = lane_for(*qp);
  const uint32_t ip = qp->remote().ip;
  if (old >= kIsolatedLane && old != lane && ip) engine_->close_lane(ip, old);
  qp->set_lane(lane);
  if (!lane || !ip) return;
  const hostif::SetQpPathsReq& p = qp->paths();
  transport::LaneProfile prof;
  prof.num_paths = p.num_paths;
  prof.plane_mask = p.plane_mask;
  prof.rate_hints = !(p.flags & hostif::kQpNoRateHints);
  engine_->set_lane(now_, ip, lane, prof);
}

int Nic::set_qp_paths(Owner* o, const hostif::SetQpPathsReq& req) {
  QueuePair* qp = qp_of(req.qpn);
  if (!qp || qp->init().owner != o || qp->init().type != QpType::kRc) return EINVAL;
  if (req.num_paths > wire::kMaxPathCount || (req.plane_mask & ~every_plane()) ||
      (req.flags & ~uint32_t{hostif::kQpIsolated | hostif::kQpNoRateHints}))
    return EINVAL;
  qp->set_paths(req);
  apply_lane(qp);
  return 0;
}

int Nic::query_qp_conn(Owner* o, uint32_t qpn, hostif::QpConnResp* out) const {
  const QueuePair* qp = find_qp(qpn);
  if (!qp || qp->init().owner != o || qp->init().type != QpType::kRc) return EINVAL;
  *out = hostif::QpConnResp{};
  const hostif::SetQpPathsReq& p = qp->paths();
  out->lane = qp->lane();
  out->peer_ip = qp->remote().ip;
  out->flags = p.flags;
  out->num_paths = p.num_paths ? p.num_paths : cfg_.engine.num_paths;
  out->plane_mask = p.plane_mask ? p.plane_mask : every_plane();
  if (!out->peer_ip) return 0;
  for (const QueuePair* q : qp_list_) {
    if (q->init().type == QpType::kRc && q->remote().ip == out->peer_ip && q->lane() == out->lane)
      ++out->streams;
  }
  const transport::ConnStats cs = transport::conn_stats(*engine_, out->peer_ip, out->lane);
  if (cs.exists) {
    out->conn_id = cs.conn_id;
    out->paths_active = static_cast<uint16_t>(cs.paths_active);
    out->rate_hint_mbps = cs.rate_hint_mbps;
  } else {
    out->paths_active = out->num_paths;  // made by its first message
  }
  return 0;
}

int Nic::query_paths(Owner* o, uint32_t qpn, uint32_t first, hostif::QueryPathsResp* out) const {
  const QueuePair* qp = find_qp(qpn);
  if (!qp || qp->init().owner != o || qp->init().type != QpType::kRc) return EINVAL;
  if (!qp->remote().ip) return ENOTCONN;
  out->total = out->count = 0;
  const auto paths = transport::path_stats(*engine_, qp->remote().ip, qp->lane());
  const transport::ConnStats cs = transport::conn_stats(*engine_, qp->remote().ip, qp->lane());
  out->total = static_cast<uint32_t>(paths.size());
  for (size_t i = first; i < paths.size() && out->count < hostif::kPathsPerPage; ++i) {
    const transport::PathStats& ps = paths[i];
    hostif::PathEntry& e = out->entries[out->count++];
    e = hostif::PathEntry{};
    e.path_id = ps.path_id;
    e.udp_sport = ps.udp_src_port;
    e.plane = ps.plane;
    e.state = ps.plane_down ? 3 : static_cast<uint8_t>(ps.state);
    e.cwnd_pkts = ps.window;
    e.inflight_pkts = ps.in_flight;
    e.inflight_bytes = ps.in_flight_bytes;
    e.srtt_ns = ps.srtt_ns;
    e.min_rtt_ns = ps.min_rtt_ns;
    e.tx_pkts = ps.tx_packets;
    e.tx_bytes = ps.tx_bytes;
    e.retx_pkts = ps.retransmits;
    e.ecn_marks = ps.ecn_ce_echoed;
    e.sack_gaps = ps.sack_gaps;
    e.timeouts = ps.timeouts;
    e.rate_hint_mbps = cs.rate_hint_mbps;
  }
  return 0;
}

int Nic::repath(Owner* o, uint32_t qpn, uint32_t path, uint16_t* udp_sport) {
  QueuePair* qp = qp_of(qpn);
  if (!qp || qp->init().owner != o || qp->init().type != QpType::kRc) return EINVAL;
  if (!qp->remote().ip) return ENOTCONN;
  if (path > UINT16_MAX) return EINVAL;
  const uint16_t port = engine_->repath(qp->remote().ip, qp->lane(), static_cast<uint16_t>(path));
  if (!port) return EINVAL;
  *udp_sport = port;
  return 0;
}

void Nic::set_plane_up(Time now, uint8_t plane, bool up) {
  now_ = now;
  engine_->set_plane_up(now, plane, up);
}

void Nic::forget_stream(uint32_t qpn) {
  engine_->drop_stream(qpn);
  // The transport drops their messages without callbacks; their answers are gone with them.
  std::erase_if(reads_pending_, [qpn](const auto& r) { return r.second.qpn == qpn; });
}

void Nic::destroy_qp_now(QueuePair* qp) {
  forget_stream(qp->qpn());
  if (qp->init().type == QpType::kUd) leave_groups(qp->qpn());
  if (qp->lane() >= kIsolatedLane) engine_->close_lane(qp->remote().ip, qp->lane());
  if (CompletionQueue* cq = qp->init().send_cq) cq->users--;
  if (CompletionQueue* cq = qp->init().recv_cq) cq->users--;
  if (SharedReceiveQueue* srq = qp->init().srq) srq->users--;
  std::erase(qp_list_, qp);
  if (QueuePair*& slot = qp_cache_[qp->qpn() % qp_cache_.size()]; slot == qp) slot = nullptr;
  qps_.erase(qp->qpn());
}

int Nic::destroy_qp(Owner* o, uint32_t qpn) {
  QueuePair* qp = qp_of(qpn);
  // An XRC target is shared: each handle goes with close_qp.
  if (!qp || qp->init().type == QpType::kXrcTgt || qp->init().owner != o) return EINVAL;
  if (flows_.count_of(qpn)) return EBUSY;  // its flows first, as the kernel asks
  if (qp->init().type == QpType::kWq && wq_in_table(qpn)) return EBUSY;
  if (auto it = rss_.find(qpn); it != rss_.end()) {
    ind_tables_[it->second.table].users--;
    rss_.erase(it);
  }
  // Its staged completions stay: the CQ outlives it, and they describe finished work.
  destroy_qp_now(qp);
  return 0;
}

int Nic::create_flow(Owner* o, const hostif::CreateFlowReq& req, uint32_t* id) {
  if (!raw_ethernet_) return EOPNOTSUPP;
  QueuePair* qp = qp_of(req.qpn);
  if (!qp || (qp->init().type != QpType::kRaw && qp->init().type != QpType::kRss) ||
      qp->init().owner != o)
    return EINVAL;
  if (static_cast<uint32_t>(req.type) > static_cast<uint32_t>(hostif::FlowType::kSniffer) ||
      (req.flags & ~uint32_t{hostif::kFlowDontTrap}) || !rule_valid(req.rule))
    return EINVAL;
  // Only a rule of specifications can let a frame on to lower priorities (ibv_create_flow(3)).
  if ((req.flags & hostif::kFlowDontTrap) && req.type != hostif::FlowType::kNormal) return EINVAL;
  FlowTable::Flow f;
  f.qpn = req.qpn;
  f.type = req.type;
  f.priority = req.priority;
  f.dont_trap = req.flags & hostif::kFlowDontTrap;
  f.rule = req.rule;
  if (const int e = flows_.add(f, id)) return e;
  flow_owner_[*id] = o;
  return 0;
}

int Nic::destroy_flow(Owner* o, uint32_t id) {
  auto it = flow_owner_.find(id);
  if (it == flow_owner_.end() || it->second != o) return EINVAL;
  flows_.remove(id);
  flow_owner_.erase(it);
  return 0;
}

bool Nic::wq_in_table(uint32_t wqn) const {
  for (const auto& [id, t] : ind_tables_)
    if (std::find(t.wqns.begin(), t.wqns.end(), wqn) != t.wqns.end()) return true;
  return false;
}

int Nic::create_ind_table(Owner* o, const hostif::IndTableReq& req, uint32_t* id) {
  if (req.log_size > hostif::kMaxIndTableLog) return EINVAL;
  IndTable t;
  t.owner = o;
  const uint32_t n = 1u << req.log_size;
  for (uint32_t i = 0; i < n; ++i) {
    const QueuePair* wq = find_qp(req.wqn[i]);
    if (!wq || wq->init().type != QpType::kWq || wq->init().owner != o) return EINVAL;
    t.wqns.push_back(req.wqn[i]);
  }
  if (ind_tables_.size() >= cfg_.link.limits.qp) return ENOMEM;
  while (next_ind_table_ == 0 || ind_tables_.count(next_ind_table_)) ++next_ind_table_;
  *id = next_ind_table_++;
  ind_tables_[*id] = std::move(t);
  return 0;
}

int Nic::destroy_ind_table(Owner* o, uint32_t id) {
  auto it = ind_tables_.find(id);
  if (it == ind_tables_.end() || it->second.owner != o) return EINVAL;
  if (it->second.users) return EBUSY;
  ind_tables_.erase(it);
  return 0;
}

int Nic::create_rss_qp(Owner* o, const hostif::CreateRssQpReq& req, hostif::QpHeader* ring,
                       uint32_t* qpn) {
  if (!raw_ethernet_) return EOPNOTSUPP;
  auto t = ind_tables_.find(req.table);
  if (!pd_of(o, req.pd) || t == ind_tables_.end() || t->second.owner != o) return EINVAL;
  if (req.function != hostif::kRssToeplitz || req.key_len == 0 ||
      req.key_len > hostif::kMaxRssKey || (req.fields & ~hostif::kRssFields))
    return EINVAL;
  QpInit init;
  init.owner = o;
  init.pd = req.pd;
  init.type = QpType::kRss;
  init.handle = req.handle;
  if (qps_.size() >= cfg_.link.limits.qp) return ENOMEM;
  uint32_t n;
  do {
    n = next_qpn_++ & 0xffffff;
  } while (n < 2 || qps_.count(n));
  ring->qpn = n;
  Rss rss;
  rss.table = req.table;
  rss.key.assign(req.key, req.key + req.key_len);
  rss.fields = req.fields;
  auto qp = std::make_unique<QueuePair>(*this, n, init, ring);
  qp_list_.push_back(qp.get());
  qps_.emplace(n, std::move(qp));
  rss_[n] = std::move(rss);
  t->second.users++;
  *qpn = n;
  return 0;
}

QueuePair* Nic::rss_target(const Rss& rss, const FrameHeaders& h) {
  auto t = ind_tables_.find(rss.table);
  if (t == ind_tables_.end() || t->second.wqns.empty()) return nullptr;
  uint8_t in[36];
  const size_t n = rss_input(h, rss.fields, in);
  const uint32_t hash = toeplitz(rss.key, {in, n});
  // The table's size is a power of two: the hash's low bits pick the entry, as NICs do.
  return qp_of(t->second.wqns[hash & (t->second.wqns.size() - 1)]);
}

void Nic::release(Owner* o) {
  for (auto it = flow_owner_.begin(); it != flow_owner_.end();) {
    if (it->second != o) {
      ++it;
      continue;
    }
    flows_.remove(it->first);
    it = flow_owner_.erase(it);
  }
  for (auto it = rss_.begin(); it != rss_.end();) {
    const QueuePair* qp = find_qp(it->first);
    it = qp && qp->init().owner == o ? rss_.erase(it) : std::next(it);
  }
  std::erase_if(ind_tables_, [o](const auto& e) { return e.second.owner == o; });
  std::vector<QueuePair*> mine;
  for (QueuePair* qp : qp_list_) {
    // An XRC target lives on while another context holds it.
    if (qp->init().type == QpType::kXrcTgt ? qp->held_by(o) && qp->drop_owner(o)
                                           : qp->init().owner == o)
      mine.push_back(qp);
  }
  for (QueuePair* qp : mine) destroy_qp_now(qp);
  for (auto it = srqs_.begin(); it != srqs_.end();) {
    SharedReceiveQueue* srq = it->second.get();
    if (srq->owner() != o) {
      ++it;
      continue;
    }
    if (srq->xrcd()) {
      for (QueuePair* qp : qp_list_)
        if (qp->init().type == QpType::kXrcTgt) qp->forget_srq(srq);
    }
    it = srqs_.erase(it);
  }
  for (auto it = xrcds_.begin(); it != xrcds_.end();) {
    it->second.opens.erase(o);
    it = it->second.opens.empty() ? xrcds_.erase(it) : std::next(it);
  }
  for (auto it = cqs_.begin(); it != cqs_.end();) {
    if (it->second->owner() == o) {
      std::erase(dirty_cqs_, it->second.get());
      it = cqs_.erase(it);
    } else {
      ++it;
    }
  }
  for (uint32_t key : mrs_.keys_of(o)) mrs_.remove(key);
  std::erase_if(pds_, [o](const auto& p) { return p.second == o; });
  // Answers to its READs that were still to be sent read memory that is no longer its.
  for (auto& [cookie, rr] : reads_pending_)
    if (rr.mem == &o->memory()) rr.failed = true;
}

Nic::ObjectCounts Nic::owned_by(const Owner* o) const {
  ObjectCounts n;
  for (const auto& [pd, owner] : pds_) n.pds += owner == o;
  n.mrs = static_cast<uint32_t>(mrs_.keys_of(o).size());
  for (const auto& [id, cq] : cqs_) n.cqs += cq->owner() == o;
  for (const auto& [id, srq] : srqs_) n.srqs += srq->owner() == o;
  for (const QueuePair* qp : qp_list_)
    n.qps += qp->init().type == QpType::kXrcTgt ? qp->handles_of(o) : qp->init().owner == o;
  for (const auto& [id, x] : xrcds_) {
    auto it = x.opens.find(o);
    if (it != x.opens.end()) n.xrcds += it->second;
  }
  for (const auto& [id, owner] : flow_owner_) n.flows += owner == o;
  for (const auto& [id, t] : ind_tables_) n.ind_tables += t.owner == o;
  return n;
}

// --- memory ----------------------------------------------------------------------------------

uint32_t Nic::add_origin(uint64_t cookie, const transport::Segment* seg) {
  Origin o;
  o.cookie = cookie;
  if (seg) {
    o.rx = seg->ref;
    o.has_rx = true;
  }
  origins_.push_back(o);
  return static_cast<uint32_t>(origins_.size() - 1);
}

void Nic::queue_write(Memory* m, uint64_t addr, std::span<const uint8_t> data, uint32_t qpn,
                      uint32_t msn) {
  const auto len = static_cast<uint32_t>(data.size());
  // Memory seen in place is written now, unless a write queued earlier in this pass has not
  // landed yet: writes land in the order they were made, as a NIC's do.
  if (writes_.empty() && len != 0) {
    if (uint8_t* dst = m->view(addr, len, true)) {
      const Access a{reinterpret_cast<uintptr_t>(dst), const_cast<uint8_t*>(data.data()), len};
      in_place_.write({&a, 1});  // a small write in ascending 8-byte stores, as AccessBatch's
      return;
    }
  }
  const uint32_t origin = add_origin(cookie(qpn, msn), current_);
  writes_.add_write(m, addr, data.data(), len, origin);
}

void Nic::queue_read(Memory* m, uint64_t addr, std::span<uint8_t> out, uint32_t qpn, uint32_t msn) {
  read_payload(m, addr, out, cookie(qpn, msn));
}

void Nic::read_payload(Memory* m, uint64_t addr, std::span<uint8_t> out, uint64_t c) {
  const auto len = static_cast<uint32_t>(out.size());
  if (tx_sink_ && len != 0) {
    if (const uint8_t* src = m->view(addr, len, false); src && tx_sink_->attach_tail(out, src)) {
      counters_.tx_payload_attached += len;
      return;
    }
  }
  counters_.tx_payload_copied += len;
  reads_.add(m, {addr, out.data(), len}, add_origin(c, nullptr));
}

uint8_t* Nic::raw_tx_buffer(uint32_t qpn, uint32_t msn, uint32_t len) {
  try {
    RawFrame f;
    f.qpn = qpn;
    f.msn = msn;
    f.bytes.resize(len);
    raw_pending_.push_back(std::move(f));
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  return raw_pending_.back().bytes.data();
}

// The frames whose reads this pass did are complete: each one whose WQE did not fail (its
// memory could not be read) goes to the link layer. The WQE completes when the frame leaves
// (raw_frames_left): a sender faster than its port waits for room in the send queue, as on a
// NIC, instead of losing what the port had no room for (the queue's depth bounds the frames).
void Nic::finish_raw_sends() {
  for (RawFrame& f : raw_pending_) {
    QueuePair* qp = qp_of(f.qpn);
    if (!qp || !qp->raw_ready(f.msn)) continue;
    ++(f.group ? counters_.mcast_tx : counters_.raw_tx);
    raw_out_.push_back(std::move(f));
  }
  raw_pending_.clear();
}

void Nic::raw_frames_left(std::span<const std::pair<uint32_t, uint32_t>> qpn_msn) {
  // A QP destroyed meanwhile is not asked: its frames, gathered already, still leave.
  for (const auto& [qpn, msn] : qpn_msn)
    if (QueuePair* qp = qp_of(qpn)) qp->raw_sent(msn);
  publish_completions();
}

// --- multicast (verbs-mapping.md §7) ----------------------------------------------------------

int Nic::attach_mcast(Owner* o, uint32_t qpn, uint32_t group) {
  QueuePair* qp = qp_of(qpn);
  if (!qp || qp->init().owner != o || qp->init().type != QpType::kUd ||
      !wire::is_multicast_ipv4(group))
    return EINVAL;
  if (!raw_ethernet_) return EOPNOTSUPP;  // a UDP-socket link: the kernel owns its groups
  auto it = groups_.find(group);
  if (it == groups_.end() && groups_.size() >= hostif::kMaxMcastGroups) return ENOMEM;
  try {
    std::vector<uint32_t>& members = groups_[group];
    if (std::find(members.begin(), members.end(), qpn) != members.end()) return 0;
    if (members.size() >= hostif::kMaxMcastQpAttach) return ENOMEM;
    members.push_back(qpn);
    if (members.size() == 1) group_changes_.emplace_back(group, true);
  } catch (const std::bad_alloc&) {
    if (auto g = groups_.find(group); g != groups_.end() && g->second.empty()) groups_.erase(g);
    return ENOMEM;
  }
  return 0;
}

int Nic::detach_mcast(Owner* o, uint32_t qpn, uint32_t group) {
  QueuePair* qp = qp_of(qpn);
  if (!qp || qp->init().owner != o || qp->init().type != QpType::kUd) return EINVAL;
  auto it = groups_.find(group);
  if (it == groups_.end()) return EINVAL;
  auto m = std::find(it->second.begin(), it->second.end(), qpn);
  if (m == it->second.end()) return EINVAL;
  it->second.erase(m);
  if (it->second.empty()) {
    groups_.erase(it);
    group_changes_.emplace_back(group, false);
  }
  return 0;
}

void Nic::leave_groups(uint32_t qpn) {
  for (auto it = groups_.begin(); it != groups_.end();) {
    std::erase(it->second, qpn);
    if (!it->second.empty()) {
      ++it;
      continue;
    }
    group_changes_.emplace_back(it->first, false);
    it = groups_.erase(it);
  }
}

bool Nic::on_datagram(uint32_t src_ip, uint32_t group, std::span<const uint8_t> udp_payload) {
  auto it = groups_.find(group);
  if (it == groups_.end()) {
    ++counters_.mcast_rx_no_member;
    return false;
  }
  wire::Datagram d;
  if (wire::decode_datagram(udp_payload, d) != wire::DecodeError::kNone) {
    ++counters_.mcast_rx_malformed;  // dropped and counted, as any malformed packet
    return true;
  }
  ++counters_.mcast_rx;
  transport::Segment seg;
  seg.peer_ip = src_ip;
  seg.op = d.with_imm ? transport::Op::kSendImm : transport::Op::kSend;
  seg.dst_stream = wire::kMulticastQpn;
  seg.src_stream = d.src_qpn;
  seg.msn = d.msn;
  seg.total_length = static_cast<uint32_t>(d.payload.size());
  seg.rkey = d.qkey;
  seg.imm = d.imm;
  seg.payload = d.payload;
  // A copy: a QP that leaves the group while taking the datagram does not disturb the walk.
  group_scratch_.assign(it->second.begin(), it->second.end());
  const bool ours = src_ip == cfg_.link.ip;  // looped back from this device's own QPs
  for (uint32_t qpn : group_scratch_) {
    QueuePair* qp = qp_of(qpn);
    if (!qp || (ours && qpn == d.src_qpn && qp->init().block_self_mcast)) continue;
    if (qp->deliver_group_datagram(seg, group)) ++counters_.mcast_rx_delivered;
  }
  return true;
}

uint8_t* Nic::datagram_tx_buffer(uint32_t qpn, uint32_t msn, uint32_t group, uint32_t len) {
  uint8_t* p = raw_tx_buffer(qpn, msn, len);
  if (!p) return nullptr;
  RawFrame& f = raw_pending_.back();
  f.group = group;
  // Spread groups and senders over a fabric's ECMP, as a connection's paths are (wire.md §8).
  f.src_port = static_cast<uint16_t>(0xc000 | ((qpn * 2654435761u) >> 18));
  return p;
}

bool Nic::on_raw_frame(std::span<const uint8_t> frame) {
  if (flows_.size() == 0) return false;
  const auto h = parse_headers(frame);
  if (!h) return false;
  steer_scratch_.clear();
  flows_.steer(*h, &steer_scratch_);
  for (uint32_t qpn : steer_scratch_) {
    QueuePair* qp = qp_of(qpn);
    if (!qp) continue;
    if (auto rss = rss_.find(qpn); rss != rss_.end()) qp = rss_target(rss->second, *h);
    if (qp) qp->deliver_raw(frame);
  }
  if (!steer_scratch_.empty()) ++counters_.raw_rx;
  return !steer_scratch_.empty();
}

uint8_t* Nic::scratch(uint32_t n) {
  if (scratch_blocks_.empty() || scratch_used_ + n > kScratchBlock) {
    scratch_blocks_.push_back(std::make_unique<uint8_t[]>(std::max(n, kScratchBlock)));
    scratch_used_ = 0;
  }
  uint8_t* p = scratch_blocks_.back().get() + scratch_used_;
  scratch_used_ += n;
  return p;
}

void Nic::record_failure(uint32_t origin, const Memory* m) {
  if (m->alive()) failed_.push_back(origin);
}

void Nic::flush_writes() {
  writes_.flush(false, [this](uint32_t origin, uint8_t*, Memory* m) { record_failure(origin, m); });
}

void Nic::queue_read_response(const transport::MessageDesc& msg, Memory* mem, uint64_t addr,
                              const transport::Segment* request) {
  transport::MessageDesc m = msg;
  m.cookie = kReadRespTag | next_read_id_++;
  reads_pending_[m.cookie] = ReadResponse{mem, addr, m.length, m.src_stream, false};
  pending_reads_.push_back(m);
  if (mem && request && m.length) {
    const uint32_t origin = add_origin(m.cookie, request);
    for (uint64_t page = addr & ~(kPage - 1); page < addr + m.length; page += kPage)
      probes_.add(mem, {std::max(page, addr), &probe_byte_, 1}, origin);
  }
}

void Nic::access_failed(const Origin& o) {
  ++counters_.memory_faults;
  if (o.has_rx) engine_->reject(o.rx, Syndrome::kRemoteAccess);
  if (o.cookie & kReadRespTag) {
    read_failed(o.cookie);
    return;
  }
  if (QueuePair* qp = qp_of(static_cast<uint32_t>(o.cookie >> 32)))
    qp->placement_failed(static_cast<uint32_t>(o.cookie));
}

// A READ's answer cannot be read from the region: it is not sent, and its QP fails as on a
// remote access error (the requester learns from the NAK of its request, or from the missing
// answer if the request was already acknowledged).
void Nic::read_failed(uint64_t cookie) {
  auto it = reads_pending_.find(cookie);
  if (it == reads_pending_.end()) return;
  it->second.failed = true;
}

void Nic::note_dirty(CompletionQueue* cq) {
  if (std::find(dirty_cqs_.begin(), dirty_cqs_.end(), cq) == dirty_cqs_.end())
    dirty_cqs_.push_back(cq);
}

void Nic::publish_completions() {
  for (CompletionQueue* cq : dirty_cqs_) {
    if (cq->publish()) cq->owner()->cq_event(cq->id(), cq->handle());
    if (cq->take_overflow_report())
      cq->owner()->async_event(cq->handle(), hostif::AsyncEvent::kCqErr);
  }
  dirty_cqs_.clear();
}

void Nic::want_resolve(uint32_t ip) {
  if (ip == 0 || ip == cfg_.link.ip) return;
  if (std::find(resolve_.begin(), resolve_.end(), ip) == resolve_.end()) resolve_.push_back(ip);
}

std::vector<uint32_t> Nic::take_resolve_requests() {
  std::vector<uint32_t> out;
  out.swap(resolve_);
  return out;
}

// --- connection management --------------------------------------------------------------------

bool Nic::cm_message(uint64_t c) const { return (c >> 61) == 1; }

void Nic::cm_send(uint32_t peer_ip, std::span<const uint8_t> bytes, uint64_t token) {
  if (bytes.empty() || bytes.size() > kCmMaxMessage || bytes.size() > active_mtu_) {
    cm_events_.push_back({CmEvent::kFailed, peer_ip, token, {}});
    return;
  }
  const uint64_t c = kCmTag | (cm_next_++ & ((uint64_t{1} << 61) - 1));
  cm_out_[c] = CmOut{{bytes.begin(), bytes.end()}, peer_ip, token};
  transport::MessageDesc m;
  m.peer_ip = peer_ip;
  m.dst_stream = kCmStream;
  m.src_stream = kCmStream;
  m.msn = cm_msn_[peer_ip]++;
  m.op = transport::Op::kSend;
  m.length = static_cast<uint32_t>(bytes.size());
  m.cookie = c;
  want_resolve(peer_ip);
  engine_->submit(m);
}

void Nic::cm_done(uint64_t c, bool delivered) {
  auto it = cm_out_.find(c);
  if (it == cm_out_.end()) return;
  cm_events_.push_back({delivered ? CmEvent::kDelivered : CmEvent::kFailed, it->second.peer_ip,
                        it->second.token, {}});
  cm_out_.erase(it);
}

// --- transport::Host ---------------------------------------------------------------------------

void Nic::gather(uint64_t c, uint32_t offset, std::span<uint8_t> out) {
  if (cm_message(c)) {
    auto it = cm_out_.find(c);
    if (it == cm_out_.end() || offset + out.size() > it->second.bytes.size())
      std::memset(out.data(), 0, out.size());
    else
      std::memcpy(out.data(), it->second.bytes.data() + offset, out.size());
    return;
  }
  if ((c & kQpOwnTag) && !(c & kReadRespTag)) {
    if (QueuePair* qp = qp_of(static_cast<uint32_t>(c >> 32) & 0xffffff))
      qp->own_gather(static_cast<uint32_t>(c), offset, out);
    else
      std::memset(out.data(), 0, out.size());
    return;
  }
  if (c & kReadRespTag) {
    auto it = reads_pending_.find(c);
    if (it == reads_pending_.end() || it->second.failed) {
      std::memset(out.data(), 0, out.size());
      failed_reads_.push_back(out.data());  // not sent: the message is being abandoned
      return;
    }
    const ReadResponse& rr = it->second;
    if (!rr.mem) {
      if (out.empty()) return;  // a zero-length READ names no memory at all
      std::memcpy(out.data(), reinterpret_cast<const uint8_t*>(rr.addr) + offset, out.size());
      return;
    }
    read_payload(rr.mem, rr.addr + offset, out, c);
    return;
  }
  if (QueuePair* qp = qp_of(static_cast<uint32_t>(c >> 32)))
    qp->gather(static_cast<uint32_t>(c), offset, out);
  else
    std::memset(out.data(), 0, out.size());
}

Syndrome Nic::deliver(const transport::Segment& seg) {
  if (seg.dst_stream == kCmStream) {
    // One packet each (cm_send); a copy seen twice is given twice, the CM is idempotent.
    if (seg.src_stream != kCmStream || seg.op != transport::Op::kSend || seg.offset != 0 ||
        seg.payload.size() != seg.total_length || seg.payload.empty()) {
      counters_.cm_dropped++;
      return Syndrome::kOk;
    }
    try {
      cm_events_.push_back({CmEvent::kMessage, seg.peer_ip, 0,
                            {seg.payload.begin(), seg.payload.end()}});
    } catch (const std::bad_alloc&) {
      return Syndrome::kRnr;  // comes again
    }
    return Syndrome::kOk;
  }
  QueuePair* qp = qp_of(seg.dst_stream);
  // No such QP (destroyed, or never made): drop as a NIC does, without answering; a peer whose
  // QP still sends to it runs out of retries (IBV_WC_RETRY_EXC_ERR), as on RC hardware.
  if (!qp) return Syndrome::kUnreachable;
  current_ = &seg;
  const Syndrome s = qp->deliver(seg);
  current_ = nullptr;
  if (s == Syndrome::kRnr) counters_.rnr++;
  else if (s != Syndrome::kOk && s != Syndrome::kUnreachable) counters_.naks_access++;
  return s;
}

// The refusing QP's min_rnr_timer (verbs: the responder's), which its RNR NAK carries.
int Nic::rnr_timer(uint32_t qpn) {
  const QueuePair* qp = qp_of(qpn);
  return qp ? qp->remote().min_rnr_timer : -1;
}

void Nic::message_acked(uint64_t c) {
  if (cm_message(c)) return cm_done(c, true);
  if ((c & kQpOwnTag) && !(c & kReadRespTag)) {
    if (QueuePair* qp = qp_of(static_cast<uint32_t>(c >> 32) & 0xffffff))
      qp->own_acked(static_cast<uint32_t>(c));
    return;
  }
  if (c & kReadRespTag) {
    reads_pending_.erase(c);
    return;
  }
  if (QueuePair* qp = qp_of(static_cast<uint32_t>(c >> 32)))
    qp->on_message_acked(static_cast<uint32_t>(c));
}

void Nic::message_failed(uint64_t c, Syndrome why) {
  if (cm_message(c)) return cm_done(c, false);
  if ((c & kQpOwnTag) && !(c & kReadRespTag)) {
    if (QueuePair* qp = qp_of(static_cast<uint32_t>(c >> 32) & 0xffffff))
      qp->own_failed(static_cast<uint32_t>(c), why);
    return;
  }
  if (c & kReadRespTag) {
    reads_pending_.erase(c);
    return;
  }
  if (QueuePair* qp = qp_of(static_cast<uint32_t>(c >> 32)))
    qp->on_message_failed(static_cast<uint32_t>(c), why);
}

// --- the pass ----------------------------------------------------------------------------------

void Nic::on_packet(Time now, uint32_t src_ip, uint16_t src_port, bool ecn_ce,
                    std::span<const uint8_t> udp_payload, uint8_t plane) {
  now_ = now;
  ++counters_.rx_packets;
  engine_->on_packet(now, src_ip, src_port, ecn_ce, udp_payload, plane);
}

void Nic::end_rx(Time now) {
  now_ = now;
  // Data first, then what announces it: placement, the READ probes, then the completions.
  flush_writes();
  probes_.flush(true, [this](uint32_t origin, uint8_t*, Memory* m) { record_failure(origin, m); });
  for (uint32_t o : failed_) access_failed(origins_[o]);
  failed_.clear();
  for (const transport::MessageDesc& m : pending_reads_) {
    auto it = reads_pending_.find(m.cookie);
    if (it == reads_pending_.end()) continue;
    if (it->second.failed) {
      reads_pending_.erase(it);
      if (QueuePair* qp = qp_of(m.src_stream)) qp->placement_failed(m.msn);
      continue;
    }
    engine_->submit(m);
  }
  pending_reads_.clear();
  publish_completions();
  origins_.clear();
  if (scratch_blocks_.size() > 1) scratch_blocks_.erase(scratch_blocks_.begin(), scratch_blocks_.end() - 1);
  scratch_used_ = 0;
}

bool Nic::poll_tx(Time now, FrameSink& sink, bool timers) {
  now_ = now;
  bool work = false;
  for (size_t i = 0; i < qp_list_.size(); ++i) {
    QueuePair* qp = qp_list_[i];
    work |= qp->drain();
    qp->check_responses(now);
  }
  if (timers && engine_->next_deadline() <= now) engine_->on_timer(now);
  tx_sink_ = &sink;
  if (engine_->poll_tx(now, sink) > 0) work = true;
  tx_sink_ = nullptr;
  // Payloads are read into the buffers before they leave; a buffer whose read failed does not.
  reads_.flush(true, [this](uint32_t origin, uint8_t* local, Memory* m) {
    failed_reads_.push_back(local);  // whatever the reason, this buffer holds no payload
    record_failure(origin, m);
  });
  sink.flush(failed_reads_);
  failed_reads_.clear();
  for (uint32_t o : failed_) {
    const Origin& org = origins_[o];
    ++counters_.memory_faults;
    if (org.cookie & kReadRespTag) {
      // The region's memory went away after the READ was probed: the answer is abandoned with
      // its QP (the requester's READ times out).
      auto it = reads_pending_.find(org.cookie);
      if (it != reads_pending_.end() && !it->second.failed) {
        it->second.failed = true;
        if (QueuePair* qp = qp_of(it->second.qpn)) qp->placement_failed(0);
      }
      continue;
    }
    if (QueuePair* qp = qp_of(static_cast<uint32_t>(org.cookie >> 32)))
      qp->gather_failed(static_cast<uint32_t>(org.cookie));
  }
  failed_.clear();
  origins_.clear();
  if (!raw_pending_.empty()) {
    finish_raw_sends();
    work = true;
  }
  publish_completions();
  return work;
}

bool Nic::has_new_work() const {
  for (const QueuePair* qp : qp_list_)
    if (qp->has_new_work()) return true;
  return false;
}

Time Nic::next_deadline() const { return engine_->next_deadline(); }

}  // namespace metaroce::nic
