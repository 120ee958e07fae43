// SPDX-License-Identifier: Apache-2.0
// Queue pairs of every type: creation, the state machine (ibv_modify_qp), ibv_query_qp and the classic
// ibv_post_send / ibv_post_recv paths, which write WQEs straight into the shared rings.
#include "providers/metaroce/qp.h"

#include <infiniband/metaroce_dv.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <optional>

#include "datapath/nic/link_config.h"
#include "datapath/wire/mrh.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/convert.h"
#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/kernel.h"
#include "providers/metaroce/qp_transition.h"
#include "providers/metaroce/srq.h"
#include "providers/metaroce/xrcd.h"

namespace metaroce::provider {
namespace {

constexpr uint32_t kPsnMask = 0xffffff;  // PSNs and QP numbers are 24-bit on the verbs side
constexpr unsigned kQpAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                               IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
// Region-only flags an application may pass in qp_access_flags too (rdma-core's ODP tests
// pass ON_DEMAND): accepted and recorded, meaningless for a QP.
constexpr unsigned kQpAccessIgnored = IBV_ACCESS_MW_BIND | IBV_ACCESS_ON_DEMAND | kHintAccess;
constexpr unsigned kSendFlags =
    IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE;
constexpr int kCreateMask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_XRCD |
                            IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
constexpr int kRssMask = IBV_QP_INIT_ATTR_RX_HASH | IBV_QP_INIT_ATTR_IND_TABLE;

struct SpinGuard {
  explicit SpinGuard(pthread_spinlock_t* l) : l_(l) { pthread_spin_lock(l_); }
  ~SpinGuard() { pthread_spin_unlock(l_); }
  pthread_spinlock_t* l_;
};

void fail(int err) noexcept { errno = err; }

// Send operations of a UD QP: datagrams only.
constexpr uint64_t kUdSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
// UC: SENDs and RDMA WRITEs (verbs-mapping.md §15).
constexpr uint64_t kUcSendOps = kUdSendOps | IBV_QP_EX_WITH_RDMA_WRITE |
                                IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
// A raw packet QP (§18): frames, sent as SENDs.
constexpr uint64_t kRawSendOps = IBV_QP_EX_WITH_SEND;
// An XRC initiator (§17): RC's messages, no window operations.
constexpr uint64_t kXrcSendOps = kUcSendOps | IBV_QP_EX_WITH_RDMA_READ |
                                 IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
                                 IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
                                 IBV_QP_EX_WITH_ATOMIC_WRITE;

// Inline data a send WQE slot holds: at least what was asked, and as a NIC does (mlx5 fills
// its WQE basic blocks), the rest of the slot's last 64 bytes, and never less than
// kMinGrantedInline. Libraries size their short messages by what they are granted, not by
// what they asked: UCX asks for 64 bytes and caps its short puts and active messages there.
constexpr uint32_t kMinGrantedInline = 128;
uint32_t granted_inline(uint32_t sge, uint32_t want) noexcept {
  const uint32_t fixed = sizeof(hostif::SendWqe) + sizeof(hostif::Sge) * sge;
  const uint32_t slot = hostif::send_stride(sge, std::max(want, kMinGrantedInline));
  return std::min(slot - fixed, hostif::kMaxInline);
}

// Whether a message of `total` bytes is copied into its WQE at post time though the
// application did not ask for inline data (verbs-mapping.md §1, "Small messages"): SENDs and
// WRITEs that fit the QP's inline room, whose SGEs lie in regions of this context
// (LocalMrs::covers). The engine still checks the SGEs' keys and bounds, and sends the copy
// instead of reading the application's memory: one system call fewer per message. A raw
// packet QP's frame is gathered by the engine at post time anyway.
bool copies_at_post(const Qp& qp, hostif::WqeOp op, uint64_t total) noexcept {
  const bool message = op == hostif::WqeOp::kSend || op == hostif::WqeOp::kSendImm ||
                       op == hostif::WqeOp::kSendInv || op == hostif::WqeOp::kWrite ||
                       op == hostif::WqeOp::kWriteImm;
  return message && total > 0 && total <= qp.cap.max_inline_data && qp.type != IBV_QPT_RAW_PACKET &&
         state_of(qp.vqp.qp.context).copy_at_post;
}

// 0 or an errno for the requested caps; writes back what will be granted.
int grant_caps(const ibv_qp_cap& want, ibv_qp_cap* got) noexcept {
  if (want.max_send_wr > hostif::kMaxQpWr || want.max_recv_wr > hostif::kMaxQpWr ||
      want.max_send_sge > hostif::kMaxSge || want.max_recv_sge > hostif::kMaxSge ||
      want.max_inline_data > hostif::kMaxInline)
    return EINVAL;
  *got = want;
  // Rings of zero entries are not worth a special case.
  if (got->max_send_wr == 0) got->max_send_wr = 1;
  if (got->max_recv_wr == 0) got->max_recv_wr = 1;
  got->max_inline_data = granted_inline(want.max_send_sge, want.max_inline_data);
  return 0;
}

// The QP's state and public fields once the engine answered with its number and ring segment
// (no kernel command fills them, as ibv_cmd_create_qp would).
void init_qp(Qp* qp, ibv_context* context, void* qp_context, uint32_t qpn, void* seg,
             uint32_t bytes) noexcept {
  qp->ring = static_cast<hostif::QpHeader*>(seg);
  qp->ring_bytes = bytes;
  qp->ring_sge = qp->ring->max_send_sge;
  pthread_mutex_init(&qp->lock, nullptr);
  pthread_spin_init(&qp->sq_lock, PTHREAD_PROCESS_PRIVATE);
  pthread_spin_init(&qp->rq_lock, PTHREAD_PROCESS_PRIVATE);
  qp->attr.qp_state = IBV_QPS_RESET;
  qp->attr.cur_qp_state = IBV_QPS_RESET;
  qp->attr.port_num = kPortNum;
  ibv_qp& q = qp->vqp.qp;
  q.context = context;
  q.qp_context = qp_context;
  q.qp_type = qp->type;
  q.state = IBV_QPS_RESET;
  q.events_completed = 0;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  q.qp_num = qpn;
  // A kernel-backed QP's handle is the kernel's, which its create command set.
  if (!state_of(context).kernel) q.handle = qpn;
  if (qp->xrcd) {
    qp->vqp.comp_mask |= abi::kVerbsQpXrcd;
    qp->vqp.xrcd = &qp->xrcd->vxrcd;
    qp->xrcd->users.fetch_add(1, std::memory_order_relaxed);
  }
}

// What the QP type needs of ibv_qp_init_attr_ex: 0 or the errno the kernel answers.
int check_create(ibv_context* context, const ibv_qp_init_attr_ex* a) noexcept {
  const uint32_t flags = (a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) ? a->create_flags : 0;
  // Creation flags are not offered (RSS is made elsewhere), but for a UD QP of a kernel-free
  // device not taking its own multicast datagrams back (verbs-mapping.md §7).
  if ((a->comp_mask & ~kCreateMask) || (flags & ~IBV_QP_CREATE_BLOCK_SELF_MCAST_LB) ||
      (flags && state_of(context).kernel))
    return EOPNOTSUPP;
  if (flags && a->qp_type != IBV_QPT_UD) return EINVAL;
  switch (a->qp_type) {
    case IBV_QPT_XRC_RECV:
      // A target: its domain, nothing else (PD, CQs, SRQ and caps are not looked at).
      if (!(a->comp_mask & IBV_QP_INIT_ATTR_XRCD) || !a->xrcd || a->xrcd->context != context)
        return EINVAL;
      if ((a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) && a->send_ops_flags) return EINVAL;
      return 0;
    case IBV_QPT_XRC_SEND:
      // An initiator: a PD and a send CQ (no receive side).
      if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || !a->send_cq ||
          a->pd->context != context || a->send_cq->context != context)
        return EINVAL;
      return 0;
    case IBV_QPT_RC:
    case IBV_QPT_UD:
    case IBV_QPT_UC:
    case IBV_QPT_RAW_PACKET:
      break;
    default:
      return EOPNOTSUPP;
  }
  if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || !a->send_cq || !a->recv_cq ||
      a->pd->context != context || a->send_cq->context != context ||
      a->recv_cq->context != context)
    return EINVAL;
  if (a->srq && a->srq->context != context) return EINVAL;
  return 0;
}

// wq: the receive queue of an ibv_wq (the engine's kWq), from a raw packet attribute.
Qp* create_any_qp(ibv_context* context, ibv_qp_init_attr_ex* a, bool wq = false) noexcept {
  if (int err = check_create(context, a)) {
    fail(err);
    return nullptr;
  }
  const bool target = a->qp_type == IBV_QPT_XRC_RECV;
  const bool initiator = a->qp_type == IBV_QPT_XRC_SEND;
  const bool ex = a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  const uint64_t send_ops = a->qp_type == IBV_QPT_UD           ? kUdSendOps
                            : a->qp_type == IBV_QPT_UC         ? kUcSendOps
                            : a->qp_type == IBV_QPT_RAW_PACKET ? kRawSendOps
                            : initiator                        ? kXrcSendOps
                                                               : kSupportedSendOps;
  if (ex && !target && (a->send_ops_flags & ~send_ops)) {
    fail(EOPNOTSUPP);
    return nullptr;
  }
  ibv_qp_cap cap;
  ibv_qp_cap want = a->cap;
  ibv_srq* const srq = target || initiator ? nullptr : a->srq;
  if (srq || initiator) want.max_recv_wr = want.max_recv_sge = 0;  // no receive queue
  if (target) want = ibv_qp_cap{};  // no queues at all
  if (int err = grant_caps(want, &cap)) {
    fail(err);
    return nullptr;
  }
  if (srq || initiator) cap.max_recv_wr = 0;
  if (target) cap = ibv_qp_cap{};

  Pd* from = nullptr;
  auto* qp = alloc_resource<Qp>(target ? nullptr : a->pd, MRDV_RES_TYPE_QP, &from);
  if (!qp) {
    fail(ENOMEM);
    return nullptr;
  }
  qp->send_ops = ex && !target ? a->send_ops_flags : 0;
  qp->pd = target ? nullptr : to_pd(a->pd);
  qp->send_cq = target ? nullptr : to_cq(a->send_cq);
  qp->recv_cq = target || initiator ? nullptr : to_cq(a->recv_cq);
  qp->srq = srq ? to_srq(srq) : nullptr;
  qp->xrcd = target ? to_xrcd(a->xrcd) : nullptr;
  qp->type = a->qp_type;
  qp->cap = cap;
  qp->sq_sig_all = a->sq_sig_all != 0;

  hostif::CreateQpReq req;
  req.pd = qp->pd ? qp->pd->id : 0;
  req.send_cq = qp->send_cq ? qp->send_cq->id : 0;
  req.recv_cq = qp->recv_cq ? qp->recv_cq->id : 0;
  req.srq = qp->srq ? qp->srq->id : 0;
  req.xrcd = qp->xrcd ? qp->xrcd->id : 0;
  req.type = wq                             ? hostif::QpType::kWq
             : qp->type == IBV_QPT_UD         ? hostif::QpType::kUd
             : qp->type == IBV_QPT_UC         ? hostif::QpType::kUc
             : qp->type == IBV_QPT_XRC_SEND   ? hostif::QpType::kXrcIni
             : qp->type == IBV_QPT_RAW_PACKET ? hostif::QpType::kRaw
             : target                         ? hostif::QpType::kXrcTgt
                                              : hostif::QpType::kRc;
  req.sq_sig_all = qp->sq_sig_all;
  if ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) &&
      (a->create_flags & IBV_QP_CREATE_BLOCK_SELF_MCAST_LB))
    req.flags |= hostif::kQpBlockSelfMcast;
  req.caps.max_send_wr = cap.max_send_wr;
  req.caps.max_recv_wr = std::max<uint32_t>(cap.max_recv_wr, 1);
  req.caps.max_send_sge = cap.max_send_sge;
  req.caps.max_recv_sge = cap.max_recv_sge;
  req.caps.max_inline = cap.max_inline_data;
  req.handle = reinterpret_cast<uintptr_t>(&qp->vqp.qp);
  const bool kernel = state_of(context).kernel;
  if (kernel) {
    // The module offers RC, UC and UD queue pairs; XRC and raw packet QPs are the engine's alone.
    if (a->qp_type != IBV_QPT_RC && a->qp_type != IBV_QPT_UC && a->qp_type != IBV_QPT_UD) {
      free_resource(qp, from, MRDV_RES_TYPE_QP);
      fail(EOPNOTSUPP);
      return nullptr;
    }
    // The kernel numbers the QP; the engine takes that number.
    if (int e = kernel::create_qp(a->pd, &qp->vqp.qp, *a, cap)) {
      free_resource(qp, from, MRDV_RES_TYPE_QP);
      fail(e);
      return nullptr;
    }
    req.qpn = req.handle = qp->vqp.qp.qp_num;
  }
  hostif::CreateQpResp body;
  void* seg = nullptr;
  // A target is closed handle by handle (kCloseQp), never destroyed outright.
  const int err = create_mapped(context, hostif::Op::kCreateQp, req, {}, hostif::Op::kDestroyQp,
                                &hostif::CreateQpResp::qpn, hostif::valid_qp, &body, &seg);
  if (err) {
    if (kernel) kernel::destroy_qp(&qp->vqp.qp);
    free_resource(qp, from, MRDV_RES_TYPE_QP);
    fail(err);
    return nullptr;
  }
  qp->mem_from = from;
  init_qp(qp, context, a->qp_context, body.qpn, seg, body.bytes);
  ibv_qp& q = qp->vqp.qp;
  q.pd = qp->pd ? a->pd : nullptr;
  q.send_cq = qp->send_cq ? a->send_cq : nullptr;
  q.recv_cq = qp->recv_cq ? a->recv_cq : nullptr;
  q.srq = srq;
  if (ex && !target) {
    init_qp_ex(qp);
    qp->vqp.comp_mask |= abi::kVerbsQpEx;
  }
  if (qp->pd) qp->pd->users.fetch_add(1, std::memory_order_relaxed);
  if (qp->send_cq) qp->send_cq->users.fetch_add(1, std::memory_order_relaxed);
  if (qp->recv_cq) qp->recv_cq->users.fetch_add(1, std::memory_order_relaxed);
  if (qp->srq) qp->srq->users.fetch_add(1, std::memory_order_relaxed);
  track(context, qp);
  a->cap = cap;
  return qp;
}

// A raw packet QP that spreads the frames its flows steer over the WQs of an indirection table
// by a Toeplitz hash of their headers (verbs-mapping.md §18). It has no queues of its own: its
// caps are 0 whatever was asked, and it is never modified.
Qp* create_rss_qp(ibv_context* context, ibv_qp_init_attr_ex* a) noexcept {
  constexpr int kKnown = kRssMask | IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
  const ibv_rx_hash_conf& h = a->rx_hash_conf;
  if ((a->comp_mask & ~kKnown) ||
      ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && a->create_flags)) {
    fail(EOPNOTSUPP);
    return nullptr;
  }
  if ((a->comp_mask & kRssMask) != kRssMask || a->qp_type != IBV_QPT_RAW_PACKET ||
      !(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || a->pd->context != context ||
      !a->rwq_ind_tbl || a->rwq_ind_tbl->context != context || h.rx_hash_key_len == 0 ||
      h.rx_hash_key_len > hostif::kMaxRssKey || !h.rx_hash_key) {
    fail(EINVAL);
    return nullptr;
  }
  // Toeplitz over the IP addresses and TCP/UDP ports only: no IPsec SPI, no inner headers.
  if (h.rx_hash_function != IBV_RX_HASH_FUNC_TOEPLITZ ||
      (h.rx_hash_fields_mask & ~hostif::kRssFields)) {
    fail(EOPNOTSUPP);
    return nullptr;
  }
  auto* qp = new (std::nothrow) Qp{};
  if (!qp) {
    fail(ENOMEM);
    return nullptr;
  }
  qp->type = IBV_QPT_RAW_PACKET;
  qp->rss = true;
  qp->pd = to_pd(a->pd);
  hostif::CreateRssQpReq req;
  req.pd = qp->pd->id;
  req.table = static_cast<uint32_t>(a->rwq_ind_tbl->ind_tbl_handle);  // the engine's id
  req.function = hostif::kRssToeplitz;
  req.key_len = h.rx_hash_key_len;
  std::memcpy(req.key, h.rx_hash_key, h.rx_hash_key_len);
  req.fields = h.rx_hash_fields_mask;
  req.handle = reinterpret_cast<uintptr_t>(&qp->vqp.qp);
  hostif::CreateQpResp body;
  void* seg = nullptr;
  const int err = create_mapped(context, hostif::Op::kCreateRssQp, req, {}, hostif::Op::kDestroyQp,
                                &hostif::CreateQpResp::qpn, hostif::valid_qp, &body, &seg);
  if (err) {
    delete qp;
    fail(err);
    return nullptr;
  }
  init_qp(qp, context, a->qp_context, body.qpn, seg, body.bytes);
  qp->vqp.qp.pd = a->pd;
  qp->pd->users.fetch_add(1, std::memory_order_relaxed);
  track(context, qp);
  a->cap = qp->cap;
  return qp;
}

// Range checks of the attribute values a valid mask names; 0 or EINVAL.
int check_values(uint32_t active_mtu, const ibv_qp_attr& a, int mask, uint32_t* peer_ip) noexcept {
  if ((mask & IBV_QP_PORT) && a.port_num != kPortNum) return EINVAL;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return EINVAL;
  if ((mask & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~(kQpAccess | kQpAccessIgnored)))
    return EINVAL;
  if (mask & IBV_QP_AV) {
    // RoCE-style addressing: the GRH carries the peer; there are no LIDs on Ethernet.
    const ibv_ah_attr& ah = a.ah_attr;
    if (!ah.is_global || ah.port_num != kPortNum || ah.grh.sgid_index >= nic::kGidTableLen)
      return EINVAL;
    auto ip = nic::gid_to_ipv4(ah.grh.dgid.raw);
    if (!ip) return EINVAL;
    *peer_ip = *ip;
  }
  if (mask & IBV_QP_PATH_MTU) {
    uint32_t bytes = mtu_to_bytes(a.path_mtu);
    if (bytes == 0 || bytes > active_mtu) return EINVAL;
  }
  if ((mask & IBV_QP_DEST_QPN) && a.dest_qp_num > kPsnMask) return EINVAL;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > kMaxRdAtom) return EINVAL;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > kMaxRdAtom) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && a.timeout > 31) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return EINVAL;
  return 0;
}

// Records the values of a checked modify_qp in the QP and in the remote the engine will get.
void record(Qp* qp, const ibv_qp_attr& a, int mask, uint32_t peer_ip) noexcept {
  ibv_qp_attr& s = qp->attr;
  hostif::QpRemote& r = qp->remote;
  if (mask & IBV_QP_ACCESS_FLAGS) s.qp_access_flags = a.qp_access_flags;
  if (mask & IBV_QP_PKEY_INDEX) s.pkey_index = a.pkey_index;
  if (mask & IBV_QP_PORT) s.port_num = a.port_num;
  if (mask & IBV_QP_AV) {
    s.ah_attr = a.ah_attr;
    r.ip = peer_ip;
  }
  if (mask & IBV_QP_PATH_MTU) {
    s.path_mtu = a.path_mtu;
    r.path_mtu = mtu_to_bytes(a.path_mtu);
  }
  if (mask & IBV_QP_DEST_QPN) s.dest_qp_num = r.qpn = a.dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) s.rq_psn = r.rq_psn = a.rq_psn & kPsnMask;
  if (mask & IBV_QP_SQ_PSN) s.sq_psn = r.sq_psn = a.sq_psn & kPsnMask;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC)
    s.max_dest_rd_atomic = r.max_dest_rd_atomic = a.max_dest_rd_atomic;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) s.max_rd_atomic = r.max_rd_atomic = a.max_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) s.min_rnr_timer = r.min_rnr_timer = a.min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) s.timeout = r.timeout = a.timeout;
  if (mask & IBV_QP_RETRY_CNT) s.retry_cnt = r.retry_cnt = a.retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) s.rnr_retry = r.rnr_retry = a.rnr_retry;
  if (mask & IBV_QP_QKEY) s.qkey = r.qkey = a.qkey;
}

constexpr int kRemoteMask = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_SQ_PSN | IBV_QP_MIN_RNR_TIMER | IBV_QP_TIMEOUT |
                            IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_QKEY;

// Writes a classic work request into a send slot; 0 or EINVAL. Never allocates.
int build_send(const Qp& qp, const ibv_send_wr& wr, uint8_t* slot) noexcept {
  auto op = to_nic(wr.opcode);
  if (!op) return EINVAL;  // TSO: no such WQE in this NIC
  if (qp.type == IBV_QPT_UC && *op != hostif::WqeOp::kSend && *op != hostif::WqeOp::kSendImm &&
      *op != hostif::WqeOp::kWrite && *op != hostif::WqeOp::kWriteImm)
    return EINVAL;  // no READ, atomic or window operation on an unreliable connection
  if (qp.type == IBV_QPT_XRC_SEND &&
      (*op == hostif::WqeOp::kBindMw || *op == hostif::WqeOp::kLocalInv ||
       *op == hostif::WqeOp::kSendInv))
    return EINVAL;  // windows are bound to the QP an access arrives at: never an initiator
  if (qp.type == IBV_QPT_RAW_PACKET && *op != hostif::WqeOp::kSend)
    return EINVAL;  // a raw QP sends frames, as SENDs without immediate
  hostif::SendWqe* w = hostif::send_wqe(slot);
  std::memset(w, 0, sizeof(*w));
  // An XRC initiator names, per work request, the SRQ of the target's domain it is for.
  if (qp.type == IBV_QPT_XRC_SEND) w->xrc_srqn = wr.qp_type.xrc.remote_srqn;
  if (qp.type == IBV_QPT_UD) {
    if (*op != hostif::WqeOp::kSend && *op != hostif::WqeOp::kSendImm) return EINVAL;
    if (!wr.wr.ud.ah || wr.wr.ud.ah->context != qp.vqp.qp.context) return EINVAL;
    w->ud_ip = to_ah(wr.wr.ud.ah)->ip;
    w->ud_qpn = wr.wr.ud.remote_qpn & kPsnMask;
    // A Q_Key with its high bit set means "use the QP's own" (IB spec 10.2.5).
    w->rkey = (wr.wr.ud.remote_qkey & 0x80000000u) ? qp.attr.qkey : wr.wr.ud.remote_qkey;
  }
  if (wr.num_sge < 0 || static_cast<uint32_t>(wr.num_sge) > qp.cap.max_send_sge) return EINVAL;
  if (wr.send_flags & ~kSendFlags) return EINVAL;
  w->wr_id = wr.wr_id;
  w->op = *op;
  w->flags = static_cast<uint8_t>(
      (((wr.send_flags & IBV_SEND_SIGNALED) || qp.sq_sig_all) ? hostif::kSignaled : 0) |
      ((wr.send_flags & IBV_SEND_SOLICITED) ? hostif::kSolicited : 0) |
      ((wr.send_flags & IBV_SEND_FENCE) ? hostif::kFence : 0));
  w->imm = (*op == hostif::WqeOp::kSendImm || *op == hostif::WqeOp::kWriteImm) ? wr.imm_data : 0;
  if (*op == hostif::WqeOp::kBindMw || *op == hostif::WqeOp::kLocalInv ||
      *op == hostif::WqeOp::kSendInv) {
    if (qp.type != IBV_QPT_RC) return EINVAL;
  }
  if (*op == hostif::WqeOp::kBindMw) {
    // A type 2 window, bound by this QP to part of a region of its PD (ibv_post_send(3)).
    if (int err = check_bind(qp, wr.bind_mw.mw, wr.bind_mw.rkey, wr.bind_mw.bind_info)) return err;
    fill_bind(w, wr.bind_mw.mw->rkey, wr.bind_mw.rkey, wr.bind_mw.bind_info);
    return 0;
  }
  if (*op == hostif::WqeOp::kLocalInv) {
    w->rkey = wr.invalidate_rkey;
    return 0;
  }
  if (*op == hostif::WqeOp::kSendInv) w->rkey = wr.invalidate_rkey;
  // ATOMIC_WRITE: the 8 bytes are the SGEs' (or the inline data), read by the NIC as a WRITE's.
  const bool remote = *op == hostif::WqeOp::kWrite || *op == hostif::WqeOp::kWriteImm ||
                      *op == hostif::WqeOp::kRead || *op == hostif::WqeOp::kAtomicWrite;
  if (remote) {
    w->remote_addr = wr.wr.rdma.remote_addr;
    w->rkey = wr.wr.rdma.rkey;
  }
  if (hostif::is_atomic(*op)) {
    // 8 bytes land in the local buffer; the engine checks its length, the responder alignment.
    if (wr.send_flags & IBV_SEND_INLINE) return EINVAL;
    w->remote_addr = wr.wr.atomic.remote_addr;
    w->rkey = wr.wr.atomic.rkey;
    w->compare_add = wr.wr.atomic.compare_add;
    w->swap = *op == hostif::WqeOp::kCmpSwp ? wr.wr.atomic.swap : 0;
  }
  if (wr.send_flags & IBV_SEND_INLINE) {
    if (hostif::needs_response(*op)) return EINVAL;  // a READ's SGEs are where data lands
    uint64_t total = 0;
    for (int i = 0; i < wr.num_sge; ++i) total += wr.sg_list[i].length;
    if (total > qp.cap.max_inline_data) return EINVAL;
    uint8_t* data = hostif::send_inline(slot, qp.ring_sge);
    uint32_t off = 0;
    for (int i = 0; i < wr.num_sge; ++i) {
      std::memcpy(data + off,
                  reinterpret_cast<const void*>(static_cast<uintptr_t>(wr.sg_list[i].addr)),
                  wr.sg_list[i].length);
      off += wr.sg_list[i].length;
    }
    w->inline_len = off;
    return 0;
  }
  hostif::Sge* sge = hostif::send_sges(slot);
  for (int i = 0; i < wr.num_sge; ++i)
    sge[i] = {wr.sg_list[i].addr, wr.sg_list[i].length, wr.sg_list[i].lkey};
  w->num_sge = static_cast<uint16_t>(wr.num_sge);
  gather_at_post(qp, slot, wr.sg_list, wr.num_sge);
  return 0;
}

hostif::Cqe flushed(uint64_t wr_id, hostif::WcOpcode op, uint32_t qpn) {
  hostif::Cqe c{};
  c.wr_id = wr_id;
  c.status = hostif::WcStatus::kWrFlushErr;
  c.opcode = op;
  c.qp_num = qpn;
  return c;
}

hostif::WcOpcode flush_opcode(hostif::WqeOp op) {
  switch (op) {
    case hostif::WqeOp::kWrite:
    case hostif::WqeOp::kWriteImm: return hostif::WcOpcode::kRdmaWrite;
    case hostif::WqeOp::kRead: return hostif::WcOpcode::kRdmaRead;
    case hostif::WqeOp::kCmpSwp: return hostif::WcOpcode::kCompSwap;
    case hostif::WqeOp::kFetchAdd: return hostif::WcOpcode::kFetchAdd;
    case hostif::WqeOp::kBindMw: return hostif::WcOpcode::kBindMw;
    case hostif::WqeOp::kLocalInv: return hostif::WcOpcode::kLocalInv;
    case hostif::WqeOp::kAtomicWrite: return hostif::WcOpcode::kAtomicWrite;
    default: return hostif::WcOpcode::kSend;
  }
}

}  // namespace

void gather_at_post(const Qp& qp, uint8_t* slot, const ibv_sge* sg, int n) noexcept {
  hostif::SendWqe* w = hostif::send_wqe(slot);
  w->flags &= static_cast<uint8_t>(~hostif::kGathered);
  uint64_t total = 0;
  for (int i = 0; i < n; ++i) total += sg[i].length;
  if (!copies_at_post(qp, w->op, total) || !state_of(qp.vqp.qp.context).local_mrs.covers(sg, n))
    return;
  uint8_t* data = hostif::send_inline(slot, qp.ring_sge);
  for (int i = 0; i < n; ++i) {
    std::memcpy(data, reinterpret_cast<const void*>(static_cast<uintptr_t>(sg[i].addr)),
                sg[i].length);
    data += sg[i].length;
  }
  w->flags |= hostif::kGathered;
}

void fill_bind(hostif::SendWqe* w, uint32_t rkey, uint32_t new_rkey,
               const ibv_mw_bind_info& b) noexcept {
  w->op = hostif::WqeOp::kBindMw;
  w->rkey = rkey;
  w->imm = new_rkey;
  w->remote_addr = b.length ? b.addr : 0;
  w->compare_add = b.length;
  w->swap = (uint64_t{b.length && b.mr ? b.mr->lkey : 0u} << 32) | b.mw_access_flags;
}

int check_bind(const Qp& qp, const ibv_mw* mw, uint32_t new_rkey,
               const ibv_mw_bind_info& b) noexcept {
  if (qp.type != IBV_QPT_RC || !mw || mw->type != IBV_MW_TYPE_2 ||
      mw->context != qp.vqp.qp.context || (new_rkey >> 8) != (mw->rkey >> 8))
    return EINVAL;
  if (b.length && (!b.mr || b.mr->pd != mw->pd)) return EINVAL;
  if (b.mw_access_flags & ~kMwAccess) return EINVAL;
  return 0;
}

uint8_t* sq_slot_ahead(Qp* qp, uint32_t i) noexcept {
  hostif::QpHeader* h = qp->ring;
  const uint32_t at = h->sq_head.peek() + i;
  if (at - h->sq_done.load() >= h->max_send_wr) return nullptr;
  return hostif::sq_slot(h, at);
}

namespace {

// Completes the send WQEs from `from` to the ring's head as flushed, the provider acting as the
// engine. Callers hold sq_lock; idempotent (sq_done moves up to sq_head).
void flush_sq_locked(Qp* qp, uint32_t from) noexcept {
  const uint32_t qpn = qp->vqp.qp.qp_num;
  hostif::QpHeader* h = qp->ring;
  for (uint32_t i = from; i != h->sq_head.peek(); ++i) {
    const hostif::SendWqe* w = hostif::send_wqe(hostif::sq_slot(h, i));
    push_orphan(qp->send_cq, flushed(w->wr_id, flush_opcode(w->op), qpn));
  }
  h->sq_done.store(h->sq_head.peek());
  h->state.store(static_cast<uint32_t>(hostif::QpState::kErr));
}

}  // namespace

void sq_publish(Qp* qp, uint32_t n) noexcept {
  if (n == 0) return;
  qp->ring->sq_head.store(qp->ring->sq_head.peek() + n);
  ContextState& st = state_of(qp->vqp.qp.context);
  if (st.dead.load(std::memory_order_acquire)) {
    // No engine will take them (posting in the error state is allowed): flushed at once. If the
    // watcher flushes this QP later, there is nothing left for it to do.
    flush_sq_locked(qp, qp->ring->sq_done.load());
    notify_orphan(qp->send_cq);
    return;
  }
  ring_doorbell(st);
}

void flush_orphan(Qp* qp, std::span<const hostif::Cqe> recovered) noexcept {
  const uint32_t qpn = qp->vqp.qp.qp_num;
  hostif::QpHeader* h = qp->ring;
  if (qp->type == IBV_QPT_XRC_RECV) return;  // no queues: its SRQs flush their own receives
  {
    SpinGuard g(&qp->sq_lock);
    flush_sq_locked(qp, hostif::first_unreported(h->sq_done.load(), h->sq_head.peek(), qpn,
                                                 hostif::CqeQueue::kSend, recovered));
  }
  if (qp->srq || !qp->recv_cq) return;  // the SRQ flushes its own receives; an initiator has none
  SpinGuard g(&qp->rq_lock);
  const uint32_t from = hostif::first_unreported(h->rq_done.load(), h->rq_head.peek(), qpn,
                                                 hostif::CqeQueue::kRecv, recovered);
  for (uint32_t i = from; i != h->rq_head.peek(); ++i)
    push_orphan(qp->recv_cq, flushed(hostif::recv_wqe(hostif::rq_slot(h, i))->wr_id,
                                     hostif::WcOpcode::kRecv, qpn));
  h->rq_done.store(h->rq_head.peek());
}

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) noexcept {
  ibv_qp_init_attr_ex ex;
  std::memset(&ex, 0, sizeof(ex));
  ex.qp_context = attr->qp_context;
  ex.send_cq = attr->send_cq;
  ex.recv_cq = attr->recv_cq;
  ex.srq = attr->srq;
  ex.cap = attr->cap;
  ex.qp_type = attr->qp_type;
  ex.sq_sig_all = attr->sq_sig_all;
  ex.comp_mask = IBV_QP_INIT_ATTR_PD;
  ex.pd = pd;
  Qp* qp = create_any_qp(pd->context, &ex);
  if (!qp) return nullptr;
  attr->cap = ex.cap;
  return &qp->vqp.qp;
}

ibv_qp* create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr) noexcept {
  Qp* qp = (attr->comp_mask & kRssMask) ? create_rss_qp(context, attr)
                                         : create_any_qp(context, attr);
  return qp ? &qp->vqp.qp : nullptr;
}

Qp* create_wq_qp(ibv_context* context, ibv_pd* pd, ibv_cq* cq, uint32_t max_wr,
                 uint32_t max_sge, void* wq_handle) noexcept {
  ibv_qp_init_attr_ex a;
  std::memset(&a, 0, sizeof(a));
  a.qp_context = wq_handle;
  a.send_cq = cq;
  a.recv_cq = cq;
  a.cap.max_recv_wr = max_wr;
  a.cap.max_recv_sge = max_sge;
  a.qp_type = IBV_QPT_RAW_PACKET;
  a.comp_mask = IBV_QP_INIT_ATTR_PD;
  a.pd = pd;
  return create_any_qp(context, &a, true);
}

ibv_qp* open_qp(ibv_context* context, ibv_qp_open_attr* attr) noexcept {
  constexpr uint32_t kNeed = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  if (attr->comp_mask >= IBV_QP_OPEN_ATTR_RESERVED) {
    fail(EOPNOTSUPP);
    return nullptr;
  }
  // Only an XRC target of a domain of this context can be opened (ibv_open_qp(3)).
  if ((attr->comp_mask & kNeed) != kNeed || attr->qp_type != IBV_QPT_XRC_RECV || !attr->xrcd ||
      attr->xrcd->context != context) {
    fail(EINVAL);
    return nullptr;
  }
  auto* qp = new (std::nothrow) Qp{};
  if (!qp) {
    fail(ENOMEM);
    return nullptr;
  }
  qp->type = IBV_QPT_XRC_RECV;
  qp->xrcd = to_xrcd(attr->xrcd);
  hostif::OpenQpReq req;
  req.xrcd = qp->xrcd->id;
  req.qpn = attr->qp_num;
  req.handle = reinterpret_cast<uintptr_t>(&qp->vqp.qp);
  hostif::Message resp;
  int err = engine_call(context, hostif::Op::kOpenQp, req, &resp);
  auto body = resp.as<hostif::CreateQpResp>();
  void* seg = nullptr;
  if (!err && (!body || resp.fds.size() != 1 || body->qpn != attr->qp_num)) err = EPROTO;
  if (!err) {
    seg = map_segment(resp.fds[0], body->bytes);
    resp.fds.clear();
    if (!seg || !hostif::valid_qp(seg, body->bytes)) err = EPROTO;
  }
  hostif::close_fds(&resp);
  if (err) {
    if (seg) munmap(seg, body->bytes);
    if (err == EPROTO) engine_call(context, hostif::Op::kCloseQp, req, &resp);
    delete qp;
    fail(err);
    return nullptr;
  }
  init_qp(qp, context, (attr->comp_mask & IBV_QP_OPEN_ATTR_CONTEXT) ? attr->qp_context : nullptr,
          body->qpn, seg, body->bytes);
  // The state is shared with the other handles; the attributes they set are theirs.
  qp->attr.qp_state = qp->attr.cur_qp_state = to_verbs(qp_state(qp));
  qp->vqp.qp.state = qp->attr.qp_state;
  track(context, qp);
  return &qp->vqp.qp;
}

namespace {

int mcast(ibv_qp* qp, const ibv_gid* gid, hostif::Op op) noexcept {
  if (!qp || !gid || qp->qp_type != IBV_QPT_UD) return EINVAL;
  // Only IPv4 groups: the device has no IPv6 address, so an IPv6 (or IB-style ff1x::) MGID
  // names nothing it can send to or receive from.
  const std::optional<uint32_t> group = nic::gid_to_ipv4(gid->raw);
  if (!group || !wire::is_multicast_ipv4(*group)) return EINVAL;
  hostif::Message resp;
  const int err = engine_call(qp->context, op, hostif::McastReq{qp->qp_num, *group}, &resp);
  // The engine gone took every attachment with it: a detach then has nothing left to undo.
  if (err && engine_gone(err)) return op == hostif::Op::kDetachMcast ? 0 : err;
  return err;
}

}  // namespace

int attach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t) noexcept {
  return mcast(qp, gid, hostif::Op::kAttachMcast);
}

int detach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t) noexcept {
  return mcast(qp, gid, hostif::Op::kDetachMcast);
}

int destroy_qp(ibv_qp* ibqp) noexcept {
  Qp* qp = to_qp(ibqp);
  hostif::Message resp;
  // An XRC target is shared: this closes our handle, and the QP goes with its last one.
  const int err = qp->type == IBV_QPT_XRC_RECV
                      ? engine_call(ibqp->context, hostif::Op::kCloseQp,
                                    hostif::OpenQpReq{qp->xrcd->id, ibqp->qp_num,
                                                      reinterpret_cast<uintptr_t>(ibqp)},
                                    &resp)
                      : engine_call(ibqp->context, hostif::Op::kDestroyQp,
                                    hostif::IdReq{ibqp->qp_num}, &resp);
  if (err && !engine_gone(err)) return err;
  if (state_of(ibqp->context).kernel)
    if (int e = kernel::destroy_qp(ibqp)) return e;
  untrack(ibqp->context, qp);
  if (qp->pd) qp->pd->users.fetch_sub(1, std::memory_order_release);
  if (qp->send_cq) qp->send_cq->users.fetch_sub(1, std::memory_order_release);
  if (qp->recv_cq) qp->recv_cq->users.fetch_sub(1, std::memory_order_release);
  if (qp->srq) qp->srq->users.fetch_sub(1, std::memory_order_release);
  if (qp->xrcd) qp->xrcd->users.fetch_sub(1, std::memory_order_release);
  munmap(qp->ring, qp->ring_bytes);
  pthread_mutex_destroy(&qp->lock);
  pthread_spin_destroy(&qp->sq_lock);
  pthread_spin_destroy(&qp->rq_lock);
  pthread_cond_destroy(&ibqp->cond);
  pthread_mutex_destroy(&ibqp->mutex);
  free_resource(qp, qp->mem_from, MRDV_RES_TYPE_QP);
  return 0;
}

namespace {

// After the engine reset the QP: it emptied the rings (their retirement counters are 0 again),
// so do we. Callers hold qp->lock.
void forget_rings(Qp* qp) noexcept {
  SpinGuard s(&qp->sq_lock);
  SpinGuard r(&qp->rq_lock);
  qp->ring->sq_head.store(0);
  qp->ring->rq_head.store(0);
  // Its completions not yet polled go too, as a hardware NIC cleans its CQs of a QP that is
  // reset (rdma-core's tests restate failed QPs and poll on).
  Cq* const cqs[2] = {qp->send_cq, qp->recv_cq};
  for (int i = 0; i < 2; ++i) {
    if (!cqs[i] || (i == 1 && cqs[1] == cqs[0])) continue;
    SpinGuard c(&cqs[i]->poll_lock);
    hostif::cq_clean(cqs[i]->ring, qp->vqp.qp.qp_num);
  }
}

}  // namespace

int set_qp_state(Qp* qp, ibv_qp_state state) noexcept {
  const auto nic_state = to_nic(state);
  if (!nic_state) return EINVAL;
  hostif::ModifyQpReq req;
  req.qpn = qp->vqp.qp.qp_num;
  req.what = hostif::kModState;
  req.state = *nic_state;
  pthread_mutex_lock(&qp->lock);
  hostif::Message resp;
  const int err = engine_call(qp->vqp.qp.context, hostif::Op::kModifyQp, req, &resp);
  if (!err) {
    if (state == IBV_QPS_RESET) forget_rings(qp);
    qp->attr.qp_state = qp->attr.cur_qp_state = state;
  }
  pthread_mutex_unlock(&qp->lock);
  return err;
}

int modify_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int mask) noexcept {
  Qp* qp = to_qp(ibqp);
  // An RSS QP has no state of its own (its WQs have), as the kernel's ENOSYS says for one.
  if (qp->rss) return EOPNOTSUPP;
  const ContextState& st = state_of(ibqp->context);
  pthread_mutex_lock(&qp->lock);
  const ibv_qp_state cur = to_verbs(qp_state(qp));
  int err = 0;
  uint32_t peer_ip = 0;
  ibv_qp_state next = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
  if ((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != cur)
    err = EINVAL;
  else
    err = qp->type == IBV_QPT_UD         ? check_ud_modify(cur, mask, attr->qp_state)
          : qp->type == IBV_QPT_UC       ? check_uc_modify(cur, mask, attr->qp_state)
          : qp->type == IBV_QPT_XRC_SEND ? check_xrc_ini_modify(cur, mask, attr->qp_state)
          : qp->type == IBV_QPT_XRC_RECV ? check_xrc_tgt_modify(cur, mask, attr->qp_state)
          : qp->type == IBV_QPT_RAW_PACKET ? check_raw_modify(cur, mask, attr->qp_state)
                                         : check_rc_modify(cur, mask, attr->qp_state);
  if (!err && (mask & IBV_QP_RATE_LIMIT)) err = EOPNOTSUPP;  // no packet pacing offered
  if (!err && !to_nic(next)) err = EOPNOTSUPP;  // SQD: the NIC cannot drain a send queue yet
  if (!err) err = check_values(st.engine.active_mtu, *attr, mask, &peer_ip);
  if (!err) {
    const ibv_qp_attr saved = qp->attr;
    const hostif::QpRemote saved_remote = qp->remote;
    hostif::ModifyQpReq req;
    req.qpn = ibqp->qp_num;
    if (next == IBV_QPS_RESET) {
      // Reset forgets the connection: a QP may be reused for another peer.
      std::memset(&qp->attr, 0, sizeof(qp->attr));
      qp->attr.port_num = kPortNum;
      qp->remote = hostif::QpRemote{};
      req.what |= hostif::kModRemote;
    } else {
      record(qp, *attr, mask, peer_ip);
      if (mask & IBV_QP_ACCESS_FLAGS) req.what |= hostif::kModAccess;
      if (mask & kRemoteMask) req.what |= hostif::kModRemote;
    }
    req.access = qp->attr.qp_access_flags & kQpAccess;
    req.remote = qp->remote;
    if (mask & IBV_QP_STATE) {
      req.what |= hostif::kModState;
      req.state = *to_nic(next);
    }
    hostif::Message resp;
    // A kernel-backed QP changes state in the kernel too (which resolves the peer's address on
    // the interface, as for any RoCE device), then in the engine.
    if (st.kernel) err = kernel::modify_qp(ibqp, attr, mask);
    if (!err) err = engine_call(ibqp->context, hostif::Op::kModifyQp, req, &resp);
    if (err) {
      qp->attr = saved;
      qp->remote = saved_remote;
    } else {
      if (next == IBV_QPS_RESET) forget_rings(qp);
      qp->attr.qp_state = next;
      qp->attr.cur_qp_state = next;
    }
  }
  pthread_mutex_unlock(&qp->lock);
  return err;
}

// ECE: connection options two ends agree on out of band before RTR (NCCL exchanges them with
// the QP numbers). Our vendor id names the provider; no option is offered yet, so what a peer
// asks for is accepted as the empty set and set_ece answers it (its ece is IN/OUT). A peer of
// another vendor, or a comp_mask we do not know, is EINVAL.
constexpr uint32_t kEceOptions = 0;

int query_ece(ibv_qp* ibqp, ibv_ece* ece) noexcept {
  Qp* qp = to_qp(ibqp);
  pthread_mutex_lock(&qp->lock);
  ece->vendor_id = kVendorId;
  ece->options = qp->ece_options;
  ece->comp_mask = 0;
  pthread_mutex_unlock(&qp->lock);
  return 0;
}

int set_ece(ibv_qp* ibqp, ibv_ece* ece) noexcept {
  if (!ece || ece->comp_mask || ece->vendor_id != kVendorId) return EINVAL;
  Qp* qp = to_qp(ibqp);
  pthread_mutex_lock(&qp->lock);
  qp->ece_options = ece->options & kEceOptions;
  ece->options = qp->ece_options;
  pthread_mutex_unlock(&qp->lock);
  return 0;
}

int query_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int /*attr_mask*/,
             ibv_qp_init_attr* init_attr) noexcept {
  Qp* qp = to_qp(ibqp);
  pthread_mutex_lock(&qp->lock);
  *attr = qp->attr;
  // The engine may have moved the QP to ERR on its own (retries exhausted): it is the truth.
  attr->qp_state = attr->cur_qp_state = to_verbs(qp_state(qp));
  attr->cap = qp->cap;
  attr->sq_draining = 0;
  pthread_mutex_unlock(&qp->lock);
  std::memset(init_attr, 0, sizeof(*init_attr));
  init_attr->qp_context = ibqp->qp_context;
  init_attr->send_cq = ibqp->send_cq;
  init_attr->recv_cq = ibqp->recv_cq;
  init_attr->srq = ibqp->srq;
  init_attr->cap = qp->cap;
  init_attr->qp_type = ibqp->qp_type;
  init_attr->sq_sig_all = qp->sq_sig_all;
  return 0;
}

int post_send(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  Qp* qp = to_qp(ibqp);
  SpinGuard g(&qp->sq_lock);
  if (!sq_accepts(qp) || qp->type == IBV_QPT_XRC_RECV) {  // a target has no send queue
    *bad_wr = wr;
    return EINVAL;
  }
  uint32_t n = 0;
  int err = 0;
  for (; wr; wr = wr->next) {
    uint8_t* slot = sq_slot_ahead(qp, n);
    err = slot ? build_send(*qp, *wr, slot) : ENOMEM;
    if (err) {
      *bad_wr = wr;
      break;
    }
    ++n;
  }
  // The WRs before a bad one are posted, as verbs specifies.
  sq_publish(qp, n);
  return err;
}

// ibv_bind_mw (type 1): libibverbs checked the type and the region's PD. The bind is a WQE of
// the QP's send queue, in order with the rest; the window takes its next key now.
int bind_mw(ibv_qp* ibqp, ibv_mw* mw, ibv_mw_bind* bind) noexcept {
  Qp* qp = to_qp(ibqp);
  if (qp->type != IBV_QPT_RC || mw->context != ibqp->context ||
      (bind->bind_info.mw_access_flags & ~kMwAccess) ||
      (bind->send_flags & ~(IBV_SEND_SIGNALED | IBV_SEND_FENCE)))
    return EINVAL;
  SpinGuard g(&qp->sq_lock);
  if (!sq_accepts(qp)) return EINVAL;
  uint8_t* slot = sq_slot_ahead(qp, 0);
  if (!slot) return ENOMEM;
  hostif::SendWqe* w = hostif::send_wqe(slot);
  std::memset(w, 0, sizeof(*w));
  const uint32_t next = ibv_inc_rkey(mw->rkey);
  fill_bind(w, mw->rkey, next, bind->bind_info);
  w->wr_id = bind->wr_id;
  w->flags = static_cast<uint8_t>(
      (((bind->send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all) ? hostif::kSignaled : 0) |
      ((bind->send_flags & IBV_SEND_FENCE) ? hostif::kFence : 0));
  sq_publish(qp, 1);
  mw->rkey = next;
  return 0;
}

int post_recv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  Qp* qp = to_qp(ibqp);
  // With an SRQ: ibv_post_srq_recv; XRC QPs have no receive queue (their SRQs do).
  if (qp_state(qp) == hostif::QpState::kReset || qp->srq || qp->type == IBV_QPT_XRC_SEND ||
      qp->type == IBV_QPT_XRC_RECV) {
    *bad_wr = wr;
    return EINVAL;
  }
  ContextState& st = state_of(ibqp->context);
  SpinGuard g(&qp->rq_lock);
  hostif::QpHeader* h = qp->ring;
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge) {
      *bad_wr = wr;
      return EINVAL;
    }
    if (st.dead.load(std::memory_order_acquire)) {
      // Nobody will take it: it completes at once, flushed, as in the error state.
      push_orphan(qp->recv_cq, flushed(wr->wr_id, hostif::WcOpcode::kRecv, ibqp->qp_num));
      notify_orphan(qp->recv_cq);
      continue;
    }
    uint8_t* slot = hostif::rq_reserve(h);
    if (!slot) {
      *bad_wr = wr;
      return ENOMEM;
    }
    hostif::RecvWqe* w = hostif::recv_wqe(slot);
    w->wr_id = wr->wr_id;
    w->num_sge = static_cast<uint32_t>(wr->num_sge);
    hostif::Sge* sge = hostif::recv_sges(slot);
    for (int i = 0; i < wr->num_sge; ++i)
      sge[i] = {wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    hostif::rq_post(h);
  }
  // A receive needs no doorbell: the engine looks at the ring when a message wants one. In the
  // error state it completes at once (flushed), which the engine must be woken for.
  if (qp_state(qp) == hostif::QpState::kErr) ring_doorbell(st);
  return 0;
}

}  // namespace metaroce::provider
