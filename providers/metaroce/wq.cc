// SPDX-License-Identifier: Apache-2.0
// ibv_create_wq, ibv_modify_wq, ibv_destroy_wq, ibv_post_wq_recv and the indirection tables of
// RSS QPs: a WQ's receives are a kWq QP's ring, posted as any QP's are.
#include "providers/metaroce/wq.h"

#include <cerrno>
#include <cstring>
#include <new>

#include "providers/metaroce/context.h"

namespace metaroce::provider {
namespace {

ibv_qp_state to_qp_state(ibv_wq_state s) {
  // RDY receives and sends nothing: the engine's RTR.
  return s == IBV_WQS_RESET ? IBV_QPS_RESET : s == IBV_WQS_RDY ? IBV_QPS_RTR : IBV_QPS_ERR;
}

}  // namespace

ibv_wq* create_wq(ibv_context* context, ibv_wq_init_attr* attr) noexcept {
  // Creation flags (VLAN stripping, FCS scatter, padding, delay drop) are not offered.
  if ((attr->comp_mask & ~uint32_t{IBV_WQ_INIT_ATTR_FLAGS}) ||
      ((attr->comp_mask & IBV_WQ_INIT_ATTR_FLAGS) && attr->create_flags)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (attr->wq_type != IBV_WQT_RQ || !attr->pd || !attr->cq || attr->pd->context != context ||
      attr->cq->context != context || attr->max_wr > hostif::kMaxQpWr ||
      attr->max_sge > hostif::kMaxSge) {
    errno = EINVAL;
    return nullptr;
  }
  auto* w = new (std::nothrow) Wq{};
  if (!w) {
    errno = ENOMEM;
    return nullptr;
  }
  w->rq = create_wq_qp(context, attr->pd, attr->cq, attr->max_wr, attr->max_sge, &w->wq);
  if (!w->rq) {
    delete w;
    return nullptr;  // errno set
  }
  ibv_wq& q = w->wq;
  q.context = context;
  q.pd = attr->pd;
  q.cq = attr->cq;
  q.wq_num = w->rq->vqp.qp.qp_num;
  q.handle = q.wq_num;
  q.state = IBV_WQS_RESET;
  q.wq_type = IBV_WQT_RQ;
  q.post_recv = post_wq_recv;
  attr->max_wr = w->rq->cap.max_recv_wr;
  attr->max_sge = w->rq->cap.max_recv_sge;
  return &w->wq;
}

int modify_wq(ibv_wq* ibwq, ibv_wq_attr* attr) noexcept {
  constexpr uint32_t kKnown = IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE | IBV_WQ_ATTR_FLAGS;
  if (attr->attr_mask & ~kKnown) return EINVAL;
  if ((attr->attr_mask & IBV_WQ_ATTR_FLAGS) && (attr->flags_mask & attr->flags))
    return EOPNOTSUPP;  // none of the flags is offered; clearing them is a no-op
  Wq* w = to_wq(ibwq);
  const ibv_wq_state cur = ibwq->state;
  if ((attr->attr_mask & IBV_WQ_ATTR_CURR_STATE) && attr->curr_wq_state != cur) return EINVAL;
  if (!(attr->attr_mask & IBV_WQ_ATTR_STATE)) return 0;
  if (int err = check_wq_transition(cur, attr->wq_state)) return err;
  if (int err = set_qp_state(w->rq, to_qp_state(attr->wq_state))) return err;
  ibwq->state = attr->wq_state;
  return 0;
}

int destroy_wq(ibv_wq* ibwq) noexcept {
  Wq* w = to_wq(ibwq);
  // EBUSY while an indirection table holds it (the engine's answer).
  if (int err = destroy_qp(&w->rq->vqp.qp)) return err;
  delete w;
  return 0;
}

int post_wq_recv(ibv_wq* ibwq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  return post_recv(&to_wq(ibwq)->rq->vqp.qp, wr, bad_wr);
}

ibv_rwq_ind_table* create_rwq_ind_table(ibv_context* context,
                                        ibv_rwq_ind_table_init_attr* attr) noexcept {
  if (attr->comp_mask) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (attr->log_ind_tbl_size > hostif::kMaxIndTableLog || !attr->ind_tbl) {
    errno = EINVAL;
    return nullptr;
  }
  hostif::IndTableReq req;
  req.log_size = attr->log_ind_tbl_size;
  for (uint32_t i = 0; i < (1u << attr->log_ind_tbl_size); ++i) {
    const ibv_wq* wq = attr->ind_tbl[i];
    if (!wq || wq->context != context) {
      errno = EINVAL;
      return nullptr;
    }
    req.wqn[i] = wq->wq_num;
  }
  auto* t = new (std::nothrow) RwqIndTable{};
  if (!t) {
    errno = ENOMEM;
    return nullptr;
  }
  hostif::Message resp;
  int err = engine_call(context, hostif::Op::kCreateIndTable, req, &resp);
  auto body = resp.as<hostif::IndTableResp>();
  if (!err && !body) err = EPROTO;
  if (err) {
    delete t;
    errno = err;
    return nullptr;
  }
  t->id = body->table;
  t->table.context = context;
  t->table.ind_tbl_handle = static_cast<int>(t->id);
  t->table.ind_tbl_num = static_cast<int>(t->id);
  return &t->table;
}

int destroy_rwq_ind_table(ibv_rwq_ind_table* ibt) noexcept {
  auto* t = reinterpret_cast<RwqIndTable*>(ibt);
  hostif::Message resp;
  // EBUSY while an RSS QP uses it (the engine's answer).
  const int err =
      engine_call(ibt->context, hostif::Op::kDestroyIndTable, hostif::IdReq{t->id}, &resp);
  if (err && !engine_gone(err)) return err;
  delete t;
  return 0;
}

}  // namespace metaroce::provider
