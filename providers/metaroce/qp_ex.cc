// SPDX-License-Identifier: Apache-2.0
// The ibv_qp_ex work-request builder (ibv_wr_start ... ibv_wr_complete), which perftest uses by
// default: WRs are staged in the QP and handed to the NIC only by wr_complete.
#include <cerrno>
#include <cstring>

#include "providers/metaroce/convert.h"
#include "providers/metaroce/qp.h"
#include "providers/metaroce/srq.h"

namespace metaroce::provider {
namespace {

// The first error of a batch wins; wr_complete returns it and posts nothing.
void set_error(Qp* qp, int err) noexcept {
  if (!qp->wr_error) qp->wr_error = err;
}

// The WR the last opcode call opened, or nullptr (and an error) when there is none.
nic::SendWqe* current(Qp* qp) noexcept {
  if (qp->wr_error) return nullptr;
  if (qp->pending_n == 0) {
    set_error(qp, EINVAL);
    return nullptr;
  }
  return &qp->pending[qp->pending_n - 1];
}

nic::SendWqe* open_wr(ibv_qp_ex* qpx, nic::WqeOp op, uint64_t needed_flag) noexcept {
  Qp* qp = to_qp(qpx);
  if (qp->wr_error) return nullptr;
  if (!(qp->send_ops & needed_flag)) {
    set_error(qp, EINVAL);  // not announced in send_ops_flags at creation
    return nullptr;
  }
  if (qp->pending_n == qp->pending_cap) {
    set_error(qp, ENOMEM);  // more WRs than the send queue can ever hold
    return nullptr;
  }
  nic::SendWqe* w = &qp->pending[qp->pending_n++];
  w->wr_id = qpx->wr_id;
  w->op = op;
  w->signaled = (qpx->wr_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
  w->solicited = qpx->wr_flags & IBV_SEND_SOLICITED;
  w->fence = qpx->wr_flags & IBV_SEND_FENCE;
  w->imm = 0;
  w->remote_addr = 0;
  w->rkey = 0;
  w->num_sge = 0;
  w->inline_len = 0;
  w->ud_ip = w->ud_qpn = w->ud_qkey = 0;
  return w;
}

void wr_start(ibv_qp_ex* qpx) {
  Qp* qp = to_qp(qpx);
  pthread_spin_lock(&qp->wr_lock);
  qp->pending_n = 0;
  qp->wr_error = 0;
}

int wr_complete(ibv_qp_ex* qpx) {
  Qp* qp = to_qp(qpx);
  int err = qp->wr_error;
  if (!err && qp->nic->state() != nic::QpState::kRts) err = EINVAL;
  // A datagram without wr_set_ud_addr has nowhere to go.
  for (uint32_t i = 0; !err && qp->type == IBV_QPT_UD && i < qp->pending_n; ++i)
    if (qp->pending[i].ud_ip == 0) err = EINVAL;
  // A full ring part-way leaves the earlier WRs posted, as a doorbell batch on hardware would.
  for (uint32_t i = 0; !err && i < qp->pending_n; ++i) err = qp->nic->post_send(qp->pending[i]);
  qp->pending_n = 0;
  qp->wr_error = 0;
  pthread_spin_unlock(&qp->wr_lock);
  return err;
}

void wr_abort(ibv_qp_ex* qpx) {
  Qp* qp = to_qp(qpx);
  qp->pending_n = 0;
  qp->wr_error = 0;
  pthread_spin_unlock(&qp->wr_lock);
}

void wr_send(ibv_qp_ex* qpx) { open_wr(qpx, nic::WqeOp::kSend, IBV_QP_EX_WITH_SEND); }

void wr_send_imm(ibv_qp_ex* qpx, __be32 imm) {
  if (auto* w = open_wr(qpx, nic::WqeOp::kSendImm, IBV_QP_EX_WITH_SEND_WITH_IMM)) w->imm = imm;
}

void wr_rdma_write(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) {
  if (auto* w = open_wr(qpx, nic::WqeOp::kWrite, IBV_QP_EX_WITH_RDMA_WRITE)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
  }
}

void wr_rdma_write_imm(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, __be32 imm) {
  if (auto* w = open_wr(qpx, nic::WqeOp::kWriteImm, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    w->imm = imm;
  }
}

void wr_rdma_read(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) {
  if (auto* w = open_wr(qpx, nic::WqeOp::kRead, IBV_QP_EX_WITH_RDMA_READ)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
  }
}

void wr_atomic_cmp_swp(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, uint64_t compare,
                       uint64_t swap) {
  if (auto* w = open_wr(qpx, nic::WqeOp::kCmpSwp, IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    w->compare_add = compare;
    w->swap = swap;
  }
}

void wr_atomic_fetch_add(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, uint64_t add) {
  if (auto* w = open_wr(qpx, nic::WqeOp::kFetchAdd, IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    w->compare_add = add;
    w->swap = 0;
  }
}

void wr_set_sge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t length) {
  Qp* qp = to_qp(qpx);
  nic::SendWqe* w = current(qp);
  if (!w) return;
  if (qp->cap.max_send_sge < 1) return set_error(qp, EINVAL);
  w->sge[0] = {addr, length, lkey};
  w->num_sge = 1;
  w->inline_len = 0;
}

void wr_set_sge_list(ibv_qp_ex* qpx, size_t num_sge, const ibv_sge* list) {
  Qp* qp = to_qp(qpx);
  nic::SendWqe* w = current(qp);
  if (!w) return;
  if (num_sge > qp->cap.max_send_sge) return set_error(qp, EINVAL);
  for (size_t i = 0; i < num_sge; ++i) w->sge[i] = {list[i].addr, list[i].length, list[i].lkey};
  w->num_sge = static_cast<uint32_t>(num_sge);
  w->inline_len = 0;
}

void wr_set_inline_data_list(ibv_qp_ex* qpx, size_t num_buf, const ibv_data_buf* bufs) {
  Qp* qp = to_qp(qpx);
  nic::SendWqe* w = current(qp);
  if (!w) return;
  if (nic::needs_response(w->op)) return set_error(qp, EINVAL);
  size_t total = 0;
  for (size_t i = 0; i < num_buf; ++i) total += bufs[i].length;
  if (total > qp->cap.max_inline_data) return set_error(qp, EINVAL);
  size_t off = 0;
  for (size_t i = 0; i < num_buf; ++i) {
    std::memcpy(w->inline_data + off, bufs[i].addr, bufs[i].length);
    off += bufs[i].length;
  }
  w->inline_len = static_cast<uint32_t>(off);
  w->num_sge = 0;
}

void wr_set_inline_data(ibv_qp_ex* qpx, void* addr, size_t length) {
  ibv_data_buf one{addr, length};
  wr_set_inline_data_list(qpx, 1, &one);
}

void wr_set_ud_addr(ibv_qp_ex* qpx, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  Qp* qp = to_qp(qpx);
  nic::SendWqe* w = current(qp);
  if (!w) return;
  if (qp->type != IBV_QPT_UD || !ah) return set_error(qp, EINVAL);
  w->ud_ip = to_ah(ah)->ip;
  w->ud_qpn = remote_qpn & 0xffffff;
  // A Q_Key with its high bit set means "use the QP's own" (IB spec 10.2.5).
  w->ud_qkey = (remote_qkey & 0x80000000u) ? qp->attr.qkey : remote_qkey;
}

// Operations the NIC does not carry. create_qp_ex already refuses them in send_ops_flags; if
// called anyway, the batch fails at wr_complete rather than crashing on a null pointer.
void unsupported(ibv_qp_ex* qpx) { set_error(to_qp(qpx), EINVAL); }
void wr_bind_mw(ibv_qp_ex* q, ibv_mw*, uint32_t, const ibv_mw_bind_info*) { unsupported(q); }
void wr_local_inv(ibv_qp_ex* q, uint32_t) { unsupported(q); }
void wr_send_inv(ibv_qp_ex* q, uint32_t) { unsupported(q); }
void wr_send_tso(ibv_qp_ex* q, void*, uint16_t, uint16_t) { unsupported(q); }
void wr_set_xrc_srqn(ibv_qp_ex* q, uint32_t) { unsupported(q); }
void wr_atomic_write(ibv_qp_ex* q, uint32_t, uint64_t, const void*) { unsupported(q); }

}  // namespace

void init_qp_ex(Qp* qp) noexcept {
  ibv_qp_ex& x = qp->vqp.qp_ex;
  x.wr_start = wr_start;
  x.wr_complete = wr_complete;
  x.wr_abort = wr_abort;
  x.wr_send = wr_send;
  x.wr_send_imm = wr_send_imm;
  x.wr_rdma_write = wr_rdma_write;
  x.wr_rdma_write_imm = wr_rdma_write_imm;
  x.wr_rdma_read = wr_rdma_read;
  x.wr_set_sge = wr_set_sge;
  x.wr_set_sge_list = wr_set_sge_list;
  x.wr_set_inline_data = wr_set_inline_data;
  x.wr_set_inline_data_list = wr_set_inline_data_list;
  x.wr_atomic_cmp_swp = wr_atomic_cmp_swp;
  x.wr_atomic_fetch_add = wr_atomic_fetch_add;
  x.wr_bind_mw = wr_bind_mw;
  x.wr_local_inv = wr_local_inv;
  x.wr_send_inv = wr_send_inv;
  x.wr_send_tso = wr_send_tso;
  x.wr_set_ud_addr = wr_set_ud_addr;
  x.wr_set_xrc_srqn = wr_set_xrc_srqn;
  x.wr_atomic_write = wr_atomic_write;
}

}  // namespace metaroce::provider
