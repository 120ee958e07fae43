// SPDX-License-Identifier: Apache-2.0
// RC and UD queue pairs: creation, the state machine (ibv_modify_qp), ibv_query_qp and the classic
// ibv_post_send / ibv_post_recv paths.
#include "providers/metaroce/qp.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "datapath/nic/link_config.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/convert.h"
#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/qp_transition.h"
#include "providers/metaroce/srq.h"

namespace metaroce::provider {
namespace {

constexpr uint32_t kPsnMask = 0xffffff;  // PSNs and QP numbers are 24-bit on the verbs side
constexpr unsigned kQpAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                               IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
constexpr unsigned kSendFlags =
    IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE;
constexpr int kCreateMask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS |
                            IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;

void fail(int err) noexcept { errno = err; }

// The NIC's events, as the records ibv_get_async_event returns (element: the QP).
void qp_event(void* arg, nic::QpEvent ev) {
  Qp* qp = static_cast<Qp*>(arg);
  ibv_event_type type = IBV_EVENT_QP_FATAL;
  switch (ev) {
    case nic::QpEvent::kCommEst: type = IBV_EVENT_COMM_EST; break;
    case nic::QpEvent::kFatal: type = IBV_EVENT_QP_FATAL; break;
    case nic::QpEvent::kAccessErr: type = IBV_EVENT_QP_ACCESS_ERR; break;
    case nic::QpEvent::kReqErr: type = IBV_EVENT_QP_REQ_ERR; break;
    case nic::QpEvent::kLastWqeReached: type = IBV_EVENT_QP_LAST_WQE_REACHED; break;
  }
  post_async_event(qp->vqp.qp.context, reinterpret_cast<uintptr_t>(&qp->vqp.qp), type);
}

// Send operations of a UD QP: datagrams only.
constexpr uint64_t kUdSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;

// 0 or an errno for the requested caps; writes back what will be granted.
int grant_caps(const ibv_qp_cap& want, ibv_qp_cap* got) noexcept {
  if (want.max_send_wr > nic::kMaxQpWr || want.max_recv_wr > nic::kMaxQpWr ||
      want.max_send_sge > nic::kMaxSge || want.max_recv_sge > nic::kMaxSge ||
      want.max_inline_data > nic::kMaxInline)
    return EINVAL;
  *got = want;
  // Rings of zero entries are not worth a special case in the NIC.
  if (got->max_send_wr == 0) got->max_send_wr = 1;
  if (got->max_recv_wr == 0) got->max_recv_wr = 1;
  return 0;
}

Qp* create_any_qp(ibv_context* context, ibv_qp_init_attr_ex* a) noexcept {
  if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || !a->send_cq || !a->recv_cq ||
      a->pd->context != context || a->send_cq->context != context ||
      a->recv_cq->context != context) {
    fail(EINVAL);
    return nullptr;
  }
  if ((a->comp_mask & ~kCreateMask) ||
      ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && a->create_flags) ||
      (a->qp_type != IBV_QPT_RC && a->qp_type != IBV_QPT_UD)) {
    fail(EOPNOTSUPP);  // UC, XRC, raw packet, RSS and creation flags are not offered
    return nullptr;
  }
  if (a->srq && a->srq->context != context) {
    fail(EINVAL);
    return nullptr;
  }
  const bool ex = a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  const uint64_t send_ops = a->qp_type == IBV_QPT_UD ? kUdSendOps : kSupportedSendOps;
  if (ex && (a->send_ops_flags & ~send_ops)) {
    fail(EOPNOTSUPP);
    return nullptr;
  }
  ibv_qp_cap cap;
  ibv_qp_cap want = a->cap;
  if (a->srq) want.max_recv_wr = want.max_recv_sge = 0;  // ignored with an SRQ (verbs)
  if (int err = grant_caps(want, &cap)) {
    fail(err);
    return nullptr;
  }
  if (a->srq) cap.max_recv_wr = 0;

  auto* qp = new (std::nothrow) Qp{};
  if (!qp) {
    fail(ENOMEM);
    return nullptr;
  }
  if (ex) {
    qp->pending = new (std::nothrow) nic::SendWqe[cap.max_send_wr];
    if (!qp->pending) {
      delete qp;
      fail(ENOMEM);
      return nullptr;
    }
    qp->pending_cap = cap.max_send_wr;
    qp->send_ops = a->send_ops_flags;
  }
  qp->pd = to_pd(a->pd);
  qp->send_cq = to_cq(a->send_cq);
  qp->recv_cq = to_cq(a->recv_cq);
  qp->srq = a->srq ? to_srq(a->srq) : nullptr;
  qp->type = a->qp_type;
  qp->cap = cap;
  qp->sq_sig_all = a->sq_sig_all != 0;

  nic::QpInit init;
  init.pd = qp->pd->id;
  init.send_cq = qp->send_cq->nic;
  init.recv_cq = qp->recv_cq->nic;
  init.max_send_wr = cap.max_send_wr;
  init.max_recv_wr = std::max<uint32_t>(cap.max_recv_wr, 1);
  init.max_send_sge = cap.max_send_sge;
  init.max_recv_sge = cap.max_recv_sge;
  init.max_inline = cap.max_inline_data;
  init.sq_sig_all = qp->sq_sig_all;
  init.type = qp->type == IBV_QPT_UD ? nic::QpType::kUd : nic::QpType::kRc;
  init.srq = qp->srq ? qp->srq->nic : nullptr;
  init.event_fn = qp_event;
  init.event_arg = qp;
  int err = 0;
  qp->nic = nic_of(context).create_qp(init, &err);
  if (!qp->nic) {
    delete[] qp->pending;
    delete qp;
    fail(err ? err : ENOMEM);
    return nullptr;
  }

  pthread_mutex_init(&qp->lock, nullptr);
  pthread_spin_init(&qp->wr_lock, PTHREAD_PROCESS_PRIVATE);
  qp->attr.qp_state = IBV_QPS_RESET;
  qp->attr.cur_qp_state = IBV_QPS_RESET;
  qp->attr.port_num = kPortNum;

  // No kernel command fills the public QP for us (ibv_cmd_create_qp would): do it here.
  ibv_qp& q = qp->vqp.qp;
  q.context = context;
  q.qp_context = a->qp_context;
  q.pd = a->pd;
  q.send_cq = a->send_cq;
  q.recv_cq = a->recv_cq;
  q.srq = a->srq;
  q.qp_type = a->qp_type;
  q.state = IBV_QPS_RESET;
  q.events_completed = 0;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  q.qp_num = qp->nic->qpn();
  q.handle = q.qp_num;
  if (ex) {
    init_qp_ex(qp);
    qp->vqp.comp_mask |= abi::kVerbsQpEx;
  }

  qp->pd->users.fetch_add(1, std::memory_order_relaxed);
  qp->send_cq->users.fetch_add(1, std::memory_order_relaxed);
  qp->recv_cq->users.fetch_add(1, std::memory_order_relaxed);
  if (qp->srq) qp->srq->users.fetch_add(1, std::memory_order_relaxed);
  a->cap = cap;
  return qp;
}

// Range checks of the attribute values a valid mask names; 0 or EINVAL.
int check_values(nic::Device& nic, const ibv_qp_attr& a, int mask, uint32_t* peer_ip) noexcept {
  if ((mask & IBV_QP_PORT) && a.port_num != kPortNum) return EINVAL;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return EINVAL;
  if ((mask & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~kQpAccess)) return EINVAL;
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
    if (bytes == 0 || bytes > nic.active_mtu()) return EINVAL;
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

// Records the values of a checked modify_qp in the QP and in the remote the NIC will get.
void record(Qp* qp, const ibv_qp_attr& a, int mask, uint32_t peer_ip) noexcept {
  ibv_qp_attr& s = qp->attr;
  nic::QpRemote& r = qp->remote;
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

// Fills wqe from a classic work request; 0 or EINVAL. Never allocates.
int build_send(const Qp& qp, const ibv_send_wr& wr, nic::SendWqe* wqe) noexcept {
  auto op = to_nic(wr.opcode);
  if (!op) return EINVAL;  // MW binds, invalidations, TSO: no such WQE in this NIC
  if (qp.type == IBV_QPT_UD) {
    if (*op != nic::WqeOp::kSend && *op != nic::WqeOp::kSendImm) return EINVAL;
    if (!wr.wr.ud.ah || wr.wr.ud.ah->context != qp.vqp.qp.context) return EINVAL;
    wqe->ud_ip = to_ah(wr.wr.ud.ah)->ip;
    wqe->ud_qpn = wr.wr.ud.remote_qpn & kPsnMask;
    // A Q_Key with its high bit set means "use the QP's own" (IB spec 10.2.5).
    wqe->ud_qkey = (wr.wr.ud.remote_qkey & 0x80000000u) ? qp.attr.qkey : wr.wr.ud.remote_qkey;
  }
  if (wr.num_sge < 0 || static_cast<uint32_t>(wr.num_sge) > qp.cap.max_send_sge) return EINVAL;
  if (wr.send_flags & ~kSendFlags) return EINVAL;
  wqe->wr_id = wr.wr_id;
  wqe->op = *op;
  wqe->signaled = (wr.send_flags & IBV_SEND_SIGNALED) || qp.sq_sig_all;
  wqe->solicited = wr.send_flags & IBV_SEND_SOLICITED;
  wqe->fence = wr.send_flags & IBV_SEND_FENCE;
  wqe->imm = (*op == nic::WqeOp::kSendImm || *op == nic::WqeOp::kWriteImm) ? wr.imm_data : 0;
  const bool remote = *op == nic::WqeOp::kWrite || *op == nic::WqeOp::kWriteImm ||
                      *op == nic::WqeOp::kRead;
  wqe->remote_addr = remote ? wr.wr.rdma.remote_addr : 0;
  wqe->rkey = remote ? wr.wr.rdma.rkey : 0;
  wqe->compare_add = wqe->swap = 0;
  wqe->inline_len = 0;
  wqe->num_sge = 0;
  if (nic::is_atomic(*op)) {
    // 8 bytes land in the local buffer; the NIC checks its length, the responder alignment.
    if (wr.send_flags & IBV_SEND_INLINE) return EINVAL;
    wqe->remote_addr = wr.wr.atomic.remote_addr;
    wqe->rkey = wr.wr.atomic.rkey;
    wqe->compare_add = wr.wr.atomic.compare_add;
    wqe->swap = *op == nic::WqeOp::kCmpSwp ? wr.wr.atomic.swap : 0;
  }
  if (wr.send_flags & IBV_SEND_INLINE) {
    if (nic::needs_response(*op)) return EINVAL;  // a READ's SGEs are where data lands
    uint64_t total = 0;
    for (int i = 0; i < wr.num_sge; ++i) total += wr.sg_list[i].length;
    if (total > qp.cap.max_inline_data) return EINVAL;
    uint32_t off = 0;
    for (int i = 0; i < wr.num_sge; ++i) {
      std::memcpy(wqe->inline_data + off,
                  reinterpret_cast<const void*>(static_cast<uintptr_t>(wr.sg_list[i].addr)),
                  wr.sg_list[i].length);
      off += wr.sg_list[i].length;
    }
    wqe->inline_len = off;
    return 0;
  }
  for (int i = 0; i < wr.num_sge; ++i)
    wqe->sge[i] = {wr.sg_list[i].addr, wr.sg_list[i].length, wr.sg_list[i].lkey};
  wqe->num_sge = static_cast<uint32_t>(wr.num_sge);
  return 0;
}

}  // namespace

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
  Qp* qp = create_any_qp(context, attr);
  return qp ? &qp->vqp.qp : nullptr;
}

int destroy_qp(ibv_qp* ibqp) noexcept {
  Qp* qp = to_qp(ibqp);
  int err = nic_of(ibqp->context).destroy_qp(qp->nic);
  if (err) return err;
  qp->pd->users.fetch_sub(1, std::memory_order_release);
  qp->send_cq->users.fetch_sub(1, std::memory_order_release);
  qp->recv_cq->users.fetch_sub(1, std::memory_order_release);
  if (qp->srq) qp->srq->users.fetch_sub(1, std::memory_order_release);
  pthread_mutex_destroy(&qp->lock);
  pthread_spin_destroy(&qp->wr_lock);
  pthread_cond_destroy(&ibqp->cond);
  pthread_mutex_destroy(&ibqp->mutex);
  delete[] qp->pending;
  delete qp;
  return 0;
}

int modify_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int mask) noexcept {
  Qp* qp = to_qp(ibqp);
  nic::Device& nic = nic_of(ibqp->context);
  pthread_mutex_lock(&qp->lock);
  const ibv_qp_state cur = to_verbs(qp->nic->state());
  int err = 0;
  uint32_t peer_ip = 0;
  ibv_qp_state next = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
  if ((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != cur)
    err = EINVAL;
  else
    err = qp->type == IBV_QPT_UD ? check_ud_modify(cur, mask, attr->qp_state)
                                 : check_rc_modify(cur, mask, attr->qp_state);
  if (!err && !to_nic(next)) err = EOPNOTSUPP;  // SQD: the NIC cannot drain a send queue yet
  if (!err) err = check_values(nic, *attr, mask, &peer_ip);
  if (!err) {
    if (next == IBV_QPS_RESET) {
      // Reset forgets the connection: a QP may be reused for another peer.
      std::memset(&qp->attr, 0, sizeof(qp->attr));
      qp->attr.port_num = kPortNum;
      qp->remote = nic::QpRemote{};
    } else {
      record(qp, *attr, mask, peer_ip);
      if (mask & IBV_QP_ACCESS_FLAGS) qp->nic->set_access(attr->qp_access_flags);
      if (mask & kRemoteMask) qp->nic->set_remote(qp->remote);
    }
    if (mask & IBV_QP_STATE) qp->nic->set_state(*to_nic(next));
    qp->attr.qp_state = next;
    qp->attr.cur_qp_state = next;
  }
  pthread_mutex_unlock(&qp->lock);
  return err;
}

int query_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int /*attr_mask*/,
             ibv_qp_init_attr* init_attr) noexcept {
  Qp* qp = to_qp(ibqp);
  pthread_mutex_lock(&qp->lock);
  *attr = qp->attr;
  // The NIC may have moved the QP to ERR on its own (retries exhausted): it is the truth.
  attr->qp_state = attr->cur_qp_state = to_verbs(qp->nic->state());
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
  if (qp->nic->state() != nic::QpState::kRts) {
    *bad_wr = wr;
    return EINVAL;
  }
  nic::SendWqe wqe;
  for (; wr; wr = wr->next) {
    int err = build_send(*qp, *wr, &wqe);
    if (!err) err = qp->nic->post_send(wqe);
    if (err) {
      *bad_wr = wr;
      return err;
    }
  }
  return 0;
}

int post_recv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  Qp* qp = to_qp(ibqp);
  if (qp->nic->state() == nic::QpState::kReset || qp->srq) {  // with an SRQ: ibv_post_srq_recv
    *bad_wr = wr;
    return EINVAL;
  }
  nic::RecvWqe wqe;
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge) {
      *bad_wr = wr;
      return EINVAL;
    }
    wqe.wr_id = wr->wr_id;
    wqe.num_sge = static_cast<uint32_t>(wr->num_sge);
    for (int i = 0; i < wr->num_sge; ++i)
      wqe.sge[i] = {wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    if (int err = qp->nic->post_recv(wqe)) {
      *bad_wr = wr;
      return err;
    }
  }
  return 0;
}

}  // namespace metaroce::provider
