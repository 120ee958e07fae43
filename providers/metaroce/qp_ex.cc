// SPDX-License-Identifier: Apache-2.0
// The ibv_qp_ex work-request builder (ibv_wr_start ... ibv_wr_complete), which perftest uses by
// default: WRs are written into the send ring past its head and published by wr_complete.
#include <cerrno>
#include <cstring>

#include "providers/metaroce/context.h"
#include "providers/metaroce/convert.h"
#include "providers/metaroce/qp.h"
#include "providers/metaroce/srq.h"

namespace metaroce::provider {
namespace {

// The first error of a batch wins; wr_complete returns it and posts nothing.
void set_error(Qp* qp, int err) noexcept {
  if (!qp->wr_error) qp->wr_error = err;
}

// The slot of the WR the last opcode call opened, or nullptr (and an error) when there is none.
uint8_t* current(Qp* qp) noexcept {
  if (qp->wr_error) return nullptr;
  if (qp->pending_n == 0) {
    set_error(qp, EINVAL);
    return nullptr;
  }
  return sq_slot_ahead(qp, qp->pending_n - 1);
}

hostif::SendWqe* open_wr(ibv_qp_ex* qpx, hostif::WqeOp op, uint64_t needed_flag) noexcept {
  Qp* qp = to_qp(qpx);
  if (qp->wr_error) return nullptr;
  if (!(qp->send_ops & needed_flag)) {
    set_error(qp, EINVAL);  // not announced in send_ops_flags at creation
    return nullptr;
  }
  uint8_t* slot = sq_slot_ahead(qp, qp->pending_n);
  if (!slot) {
    set_error(qp, ENOMEM);  // more WRs than the send queue has room for
    return nullptr;
  }
  ++qp->pending_n;
  hostif::SendWqe* w = hostif::send_wqe(slot);
  std::memset(w, 0, sizeof(*w));
  w->wr_id = qpx->wr_id;
  w->op = op;
  w->flags = static_cast<uint8_t>(
      (((qpx->wr_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all) ? hostif::kSignaled : 0) |
      ((qpx->wr_flags & IBV_SEND_SOLICITED) ? hostif::kSolicited : 0) |
      ((qpx->wr_flags & IBV_SEND_FENCE) ? hostif::kFence : 0));
  return w;
}

void wr_start(ibv_qp_ex* qpx) {
  Qp* qp = to_qp(qpx);
  pthread_spin_lock(&qp->sq_lock);
  qp->pending_n = 0;
  qp->wr_error = 0;
}

int wr_complete(ibv_qp_ex* qpx) {
  Qp* qp = to_qp(qpx);
  int err = qp->wr_error;
  if (!err && !sq_accepts(qp)) err = EINVAL;
  // A datagram without wr_set_ud_addr has nowhere to go.
  for (uint32_t i = 0; !err && qp->type == IBV_QPT_UD && i < qp->pending_n; ++i)
    if (hostif::send_wqe(sq_slot_ahead(qp, i))->ud_ip == 0) err = EINVAL;
  if (!err) sq_publish(qp, qp->pending_n);
  qp->pending_n = 0;
  qp->wr_error = 0;
  pthread_spin_unlock(&qp->sq_lock);
  return err;
}

void wr_abort(ibv_qp_ex* qpx) {
  Qp* qp = to_qp(qpx);
  qp->pending_n = 0;
  qp->wr_error = 0;
  pthread_spin_unlock(&qp->sq_lock);
}

void wr_send(ibv_qp_ex* qpx) { open_wr(qpx, hostif::WqeOp::kSend, IBV_QP_EX_WITH_SEND); }

void wr_send_imm(ibv_qp_ex* qpx, __be32 imm) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kSendImm, IBV_QP_EX_WITH_SEND_WITH_IMM)) w->imm = imm;
}

void wr_rdma_write(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kWrite, IBV_QP_EX_WITH_RDMA_WRITE)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
  }
}

void wr_rdma_write_imm(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, __be32 imm) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kWriteImm, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    w->imm = imm;
  }
}

void wr_rdma_read(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kRead, IBV_QP_EX_WITH_RDMA_READ)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
  }
}

void wr_atomic_cmp_swp(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, uint64_t compare,
                       uint64_t swap) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kCmpSwp, IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    w->compare_add = compare;
    w->swap = swap;
  }
}

void wr_atomic_fetch_add(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, uint64_t add) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kFetchAdd, IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    w->compare_add = add;
  }
}

void wr_set_sge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t length) {
  Qp* qp = to_qp(qpx);
  uint8_t* slot = current(qp);
  if (!slot) return;
  if (qp->cap.max_send_sge < 1) return set_error(qp, EINVAL);
  hostif::send_sges(slot)[0] = {addr, length, lkey};
  hostif::send_wqe(slot)->num_sge = 1;
  hostif::send_wqe(slot)->inline_len = 0;
  const ibv_sge one{addr, length, lkey};
  gather_at_post(*qp, slot, &one, 1);
}

void wr_set_sge_list(ibv_qp_ex* qpx, size_t num_sge, const ibv_sge* list) {
  Qp* qp = to_qp(qpx);
  uint8_t* slot = current(qp);
  if (!slot) return;
  if (num_sge > qp->cap.max_send_sge) return set_error(qp, EINVAL);
  hostif::Sge* sge = hostif::send_sges(slot);
  for (size_t i = 0; i < num_sge; ++i) sge[i] = {list[i].addr, list[i].length, list[i].lkey};
  hostif::send_wqe(slot)->num_sge = static_cast<uint16_t>(num_sge);
  hostif::send_wqe(slot)->inline_len = 0;
  gather_at_post(*qp, slot, list, static_cast<int>(num_sge));
}

void wr_set_inline_data_list(ibv_qp_ex* qpx, size_t num_buf, const ibv_data_buf* bufs) {
  Qp* qp = to_qp(qpx);
  uint8_t* slot = current(qp);
  if (!slot) return;
  hostif::SendWqe* w = hostif::send_wqe(slot);
  if (hostif::needs_response(w->op)) return set_error(qp, EINVAL);
  size_t total = 0;
  for (size_t i = 0; i < num_buf; ++i) total += bufs[i].length;
  if (total > qp->cap.max_inline_data) return set_error(qp, EINVAL);
  uint8_t* data = hostif::send_inline(slot, qp->ring_sge);
  size_t off = 0;
  for (size_t i = 0; i < num_buf; ++i) {
    std::memcpy(data + off, bufs[i].addr, bufs[i].length);
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
  uint8_t* slot = current(qp);
  if (!slot) return;
  if (qp->type != IBV_QPT_UD || !ah) return set_error(qp, EINVAL);
  hostif::SendWqe* w = hostif::send_wqe(slot);
  w->ud_ip = to_ah(ah)->ip;
  w->ud_qpn = remote_qpn & 0xffffff;
  // A Q_Key with its high bit set means "use the QP's own" (IB spec 10.2.5).
  w->rkey = (remote_qkey & 0x80000000u) ? qp->attr.qkey : remote_qkey;
}

// Operations the NIC does not carry. create_qp_ex already refuses them in send_ops_flags; if
// called anyway, the batch fails at wr_complete rather than crashing on a null pointer.
void unsupported(ibv_qp_ex* qpx) { set_error(to_qp(qpx), EINVAL); }
void wr_bind_mw(ibv_qp_ex* qpx, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info* info) {
  Qp* qp = to_qp(qpx);
  if (!info || check_bind(*qp, mw, rkey, *info)) {
    set_error(qp, EINVAL);
    return;
  }
  if (auto* w = open_wr(qpx, hostif::WqeOp::kBindMw, IBV_QP_EX_WITH_BIND_MW))
    fill_bind(w, mw->rkey, rkey, *info);
}

void wr_local_inv(ibv_qp_ex* qpx, uint32_t invalidate_rkey) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kLocalInv, IBV_QP_EX_WITH_LOCAL_INV))
    w->rkey = invalidate_rkey;
}

void wr_send_inv(ibv_qp_ex* qpx, uint32_t invalidate_rkey) {
  if (auto* w = open_wr(qpx, hostif::WqeOp::kSendInv, IBV_QP_EX_WITH_SEND_WITH_INV))
    w->rkey = invalidate_rkey;
}
void wr_send_tso(ibv_qp_ex* q, void*, uint16_t, uint16_t) { unsupported(q); }
// XRC initiator: the SRQ of the target's domain the current WR is for (verbs-mapping.md §17).
void wr_set_xrc_srqn(ibv_qp_ex* qpx, uint32_t remote_srqn) {
  Qp* qp = to_qp(qpx);
  uint8_t* slot = current(qp);
  if (!slot) return;
  if (qp->type != IBV_QPT_XRC_SEND) return set_error(qp, EINVAL);
  hostif::send_wqe(slot)->xrc_srqn = remote_srqn;
}
// The 8 bytes travel in the WQE, copied now as memory holds them: the caller's buffer may be
// reused once this returns (ibv_wr_post(3)).
void wr_atomic_write(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, const void* atomic_wire) {
  if (!atomic_wire) return set_error(to_qp(qpx), EINVAL);
  if (auto* w = open_wr(qpx, hostif::WqeOp::kAtomicWrite, IBV_QP_EX_WITH_ATOMIC_WRITE)) {
    w->rkey = rkey;
    w->remote_addr = remote_addr;
    std::memcpy(&w->compare_add, atomic_wire, sizeof(w->compare_add));
  }
}

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
