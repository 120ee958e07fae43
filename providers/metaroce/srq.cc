// SPDX-License-Identifier: Apache-2.0
// ibv_create_srq / modify / query / destroy, ibv_post_srq_recv (into the shared SRQ ring), and UD
// address handles.
#include "providers/metaroce/srq.h"

#include <infiniband/metaroce_dv.h>

#include <sys/mman.h>

#include <cerrno>
#include <new>

#include "datapath/nic/link_config.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/cq.h"
#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/kernel.h"
#include "providers/metaroce/qp.h"
#include "providers/metaroce/xrcd.h"

namespace metaroce::provider {

namespace {

// A basic SRQ (xrcd null, max_tags 0), one of an XRC domain completing into cq, or a
// tag-matching one of max_tags tags completing into cq.
ibv_srq* make_srq(ibv_pd* ibpd, void* srq_context, ibv_srq_attr& a, Xrcd* xrcd, Cq* cq,
                  uint32_t max_tags = 0) noexcept {
  if (a.max_wr < 1 || a.max_wr > hostif::kMaxSrqWr || a.max_sge < 1 || a.max_sge > hostif::kMaxSge) {
    errno = EINVAL;
    return nullptr;
  }
  Pd* from = nullptr;
  auto* srq = alloc_resource<Srq>(ibpd, MRDV_RES_TYPE_SRQ, &from);
  if (!srq) {
    errno = ENOMEM;
    return nullptr;
  }
  srq->mem_from = from;
  Pd* pd = to_pd(ibpd);
  const uint64_t handle = reinterpret_cast<uintptr_t>(&srq->srq);
  uint64_t engine_handle = handle;
  const bool kernel = state_of(ibpd->context).kernel;
  if (kernel) {
    // XRC domains are the engine's alone: a kernel device offers none.
    if (xrcd) {
      free_resource(srq, from, MRDV_RES_TYPE_SRQ);
      errno = EOPNOTSUPP;
      return nullptr;
    }
    ibv_srq_init_attr ia{};
    ia.srq_context = srq_context;
    ia.attr = a;
    uint32_t id = 0;
    if (int e = kernel::create_srq(ibpd, &srq->srq, &ia, &id)) {
      free_resource(srq, from, MRDV_RES_TYPE_SRQ);
      errno = e;
      return nullptr;
    }
    engine_handle = id;  // its events are raised on the kernel's SRQ of that id
  }
  hostif::CreateSrqResp body;
  void* seg = nullptr;
  int err;
  if (xrcd) {
    hostif::CreateXrcSrqReq req;
    req.pd = pd->id;
    req.max_wr = a.max_wr;
    req.max_sge = a.max_sge;
    req.xrcd = xrcd->id;
    req.cq = cq->id;
    req.handle = handle;
    err = create_mapped(ibpd->context, hostif::Op::kCreateXrcSrq, req, {},
                        hostif::Op::kDestroySrq, &hostif::CreateSrqResp::id, hostif::valid_srq,
                        &body, &seg);
  } else if (max_tags) {
    hostif::CreateTmSrqReq req;
    req.pd = pd->id;
    req.max_wr = a.max_wr;
    req.max_sge = a.max_sge;
    req.max_tags = max_tags;
    req.cq = cq->id;
    req.handle = handle;
    err = create_mapped(ibpd->context, hostif::Op::kCreateTmSrq, req, {}, hostif::Op::kDestroySrq,
                        &hostif::CreateSrqResp::id, hostif::valid_srq, &body, &seg);
  } else {
    hostif::CreateSrqReq req;
    req.pd = pd->id;
    req.max_wr = a.max_wr;
    req.max_sge = a.max_sge;
    req.handle = engine_handle;
    err = create_mapped(ibpd->context, hostif::Op::kCreateSrq, req, {}, hostif::Op::kDestroySrq,
                        &hostif::CreateSrqResp::id, hostif::valid_srq, &body, &seg);
  }
  if (err) {
    if (kernel) kernel::destroy_srq(&srq->srq);
    free_resource(srq, from, MRDV_RES_TYPE_SRQ);
    errno = err;
    return nullptr;
  }
  srq->ring = static_cast<hostif::SrqHeader*>(seg);
  srq->ring_bytes = body.bytes;
  srq->id = body.id;
  srq->pd = pd;
  srq->max_wr = a.max_wr;
  srq->max_sge = a.max_sge;
  srq->type = xrcd ? IBV_SRQT_XRC : max_tags ? IBV_SRQT_TM : IBV_SRQT_BASIC;
  srq->xrcd = xrcd;
  srq->cq = cq;
  pthread_spin_init(&srq->post_lock, PTHREAD_PROCESS_PRIVATE);
  // libibverbs fills these too after we return; a provider that is called directly has them.
  ibv_srq& s = srq->srq;
  s.context = ibpd->context;
  s.srq_context = srq_context;
  s.pd = ibpd;
  if (!kernel) s.handle = srq->id;
  s.events_completed = 0;
  pthread_mutex_init(&s.mutex, nullptr);
  pthread_cond_init(&s.cond, nullptr);
  // srq_limit is ignored at creation (verbs): the limit is armed only by ibv_modify_srq.
  a.srq_limit = 0;
  pd->users.fetch_add(1, std::memory_order_relaxed);
  if (xrcd) xrcd->users.fetch_add(1, std::memory_order_relaxed);
  if (cq) cq->users.fetch_add(1, std::memory_order_relaxed);
  track(ibpd->context, srq);
  return &srq->srq;
}

}  // namespace

ibv_srq* create_srq(ibv_pd* ibpd, ibv_srq_init_attr* attr) noexcept {
  return make_srq(ibpd, attr->srq_context, attr->attr, nullptr, nullptr);
}

ibv_srq* create_srq_ex(ibv_context* context, ibv_srq_init_attr_ex* attr) noexcept {
  constexpr uint32_t kKnown = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD |
                              IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ |
                              IBV_SRQ_INIT_ATTR_TM;
  if (attr->comp_mask & ~kKnown) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  // Every SRQ has a PD (the kernel's rule), of this context.
  if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) || !attr->pd || attr->pd->context != context) {
    errno = EINVAL;
    return nullptr;
  }
  const ibv_srq_type type =
      (attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) ? attr->srq_type : IBV_SRQT_BASIC;
  switch (type) {
    case IBV_SRQT_BASIC:
      return make_srq(attr->pd, attr->srq_context, attr->attr, nullptr, nullptr);
    case IBV_SRQT_XRC: {
      // An XRC SRQ names its domain and the CQ its receives complete into.
      const uint32_t need = IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
      if ((attr->comp_mask & need) != need || !attr->xrcd || !attr->cq ||
          attr->xrcd->context != context || attr->cq->context != context) {
        errno = EINVAL;
        return nullptr;
      }
      return make_srq(attr->pd, attr->srq_context, attr->attr, to_xrcd(attr->xrcd),
                      to_cq(attr->cq));
    }
    case IBV_SRQT_TM: {
      // A TM SRQ completes into its own CQ and holds up to max_num_tags tags (§19).
      const uint32_t need = IBV_SRQ_INIT_ATTR_CQ | IBV_SRQ_INIT_ATTR_TM;
      if ((attr->comp_mask & need) != need || !attr->cq || attr->cq->context != context ||
          (attr->comp_mask & IBV_SRQ_INIT_ATTR_XRCD) || attr->tm_cap.max_num_tags < 1 ||
          attr->tm_cap.max_num_tags > hostif::kMaxTmTags || attr->tm_cap.max_ops < 1 ||
          attr->tm_cap.max_ops > hostif::kMaxTmOps) {
        errno = EINVAL;
        return nullptr;
      }
      return make_srq(attr->pd, attr->srq_context, attr->attr, nullptr, to_cq(attr->cq),
                      attr->tm_cap.max_num_tags);
    }
  }
  errno = EINVAL;
  return nullptr;
}

int get_srq_num(ibv_srq* ibsrq, uint32_t* srq_num) noexcept {
  *srq_num = to_srq(ibsrq)->id;
  return 0;
}

int modify_srq(ibv_srq* ibsrq, ibv_srq_attr* attr, int mask) noexcept {
  Srq* srq = to_srq(ibsrq);
  if (mask & ~(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT)) return EINVAL;
  // Resizing is not offered (no IBV_DEVICE_SRQ_RESIZE), as the kernel answers for such devices.
  if (mask & IBV_SRQ_MAX_WR) return EINVAL;
  if (mask & IBV_SRQ_LIMIT) {
    if (attr->srq_limit > srq->max_wr) return EINVAL;
    // Armed in the shared ring; the engine disarms it when the event fires.
    srq->ring->limit.store(attr->srq_limit);
  }
  return 0;
}

int query_srq(ibv_srq* ibsrq, ibv_srq_attr* attr) noexcept {
  Srq* srq = to_srq(ibsrq);
  attr->max_wr = srq->max_wr;
  attr->max_sge = srq->max_sge;
  attr->srq_limit = srq->ring->limit.load();
  return 0;
}

int destroy_srq(ibv_srq* ibsrq) noexcept {
  Srq* srq = to_srq(ibsrq);
  if (srq->users.load(std::memory_order_acquire) != 0) return EBUSY;
  hostif::Message resp;
  const int err = engine_call(ibsrq->context, hostif::Op::kDestroySrq, hostif::IdReq{srq->id}, &resp);
  if (err && !engine_gone(err)) return err;
  if (state_of(ibsrq->context).kernel)
    if (int e = kernel::destroy_srq(ibsrq)) return e;
  untrack(ibsrq->context, srq);
  srq->pd->users.fetch_sub(1, std::memory_order_release);
  if (srq->xrcd) srq->xrcd->users.fetch_sub(1, std::memory_order_release);
  if (srq->cq) srq->cq->users.fetch_sub(1, std::memory_order_release);
  munmap(srq->ring, srq->ring_bytes);
  pthread_spin_destroy(&srq->post_lock);
  pthread_cond_destroy(&ibsrq->cond);
  pthread_mutex_destroy(&ibsrq->mutex);
  free_resource(srq, srq->mem_from, MRDV_RES_TYPE_SRQ);
  return 0;
}

int post_srq_recv(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  Srq* srq = to_srq(ibsrq);
  hostif::Sge sge[hostif::kMaxSge];
  pthread_spin_lock(&srq->post_lock);
  int err = 0;
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > srq->max_sge) {
      err = EINVAL;
      break;
    }
    for (int i = 0; i < wr->num_sge; ++i)
      sge[i] = {wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    err = hostif::srq_post(srq->ring, wr->wr_id, sge, static_cast<uint32_t>(wr->num_sge));
    if (err) break;
  }
  pthread_spin_unlock(&srq->post_lock);
  if (err) *bad_wr = wr;
  return err;
}

int post_srq_ops(ibv_srq* ibsrq, ibv_ops_wr* wr, ibv_ops_wr** bad_wr) noexcept {
  Srq* srq = to_srq(ibsrq);
  int err = 0;
  if (srq->type != IBV_SRQT_TM) {
    *bad_wr = wr;
    return EINVAL;  // list operations exist only on a tag-matching SRQ
  }
  // Each operation is carried out by the engine before the next is sent: the list is the NIC's,
  // so its answer (a tag's handle) is final when this returns.
  for (; wr; wr = wr->next) {
    hostif::SrqTagOpReq req;
    req.srq = srq->id;
    req.wr_id = wr->wr_id;
    req.signaled = (wr->flags & IBV_OPS_SIGNALED) ? 1 : 0;
    req.unexpected_cnt = wr->tm.unexpected_cnt;
    switch (wr->opcode) {
      case IBV_WR_TAG_ADD:
        req.op = hostif::TagOp::kAdd;
        if (wr->tm.add.num_sge < 0 || wr->tm.add.num_sge > 1 ||
            (wr->tm.add.num_sge == 1 && !wr->tm.add.sg_list)) {
          err = EINVAL;
          break;
        }
        req.num_sge = static_cast<uint32_t>(wr->tm.add.num_sge);
        if (req.num_sge)
          req.sge = {wr->tm.add.sg_list[0].addr, wr->tm.add.sg_list[0].length,
                     wr->tm.add.sg_list[0].lkey};
        req.recv_wr_id = wr->tm.add.recv_wr_id;
        req.tag = wr->tm.add.tag;
        req.mask = wr->tm.add.mask;
        break;
      case IBV_WR_TAG_DEL:
        req.op = hostif::TagOp::kDel;
        req.handle = wr->tm.handle;
        break;
      case IBV_WR_TAG_SYNC:
        req.op = hostif::TagOp::kSync;
        break;
      default:
        err = EINVAL;
        break;
    }
    if (err) break;
    hostif::Message resp;
    err = engine_call(ibsrq->context, hostif::Op::kSrqTagOp, req, &resp);
    if (err) break;
    auto body = resp.as<hostif::SrqTagOpResp>();
    if (!body) {
      err = EPROTO;
      break;
    }
    if (wr->opcode == IBV_WR_TAG_ADD) wr->tm.handle = body->handle;
  }
  if (err) *bad_wr = wr;
  return err;
}

void flush_orphan(Srq* srq, const std::vector<Qp*>& qps,
                  std::span<const hostif::Cqe> recovered) noexcept {
  Cq* cq = srq->cq;  // an XRC or TM SRQ's own
  for (Qp* qp : qps)
    if (!cq && qp->srq == srq) cq = qp->recv_cq;
  hostif::SrqHeader* h = srq->ring;
  pthread_spin_lock(&srq->post_lock);
  // Every slot not in the free ring is a receive posted and not completed.
  std::vector<bool> free_slot;
  try {
    free_slot.assign(h->max_wr, false);
  } catch (...) {
    pthread_spin_unlock(&srq->post_lock);
    return;
  }
  const uint32_t* ring = hostif::srq_free_ring(h);
  for (uint32_t i = h->free_tail.peek(); i != h->free_head.load(); ++i) {
    const uint32_t s = ring[i & (h->entries - 1)];
    if (s < h->max_wr) free_slot[s] = true;
  }
  // Completed, the engine killed before it gave the slot back.
  for (const hostif::Cqe& c : recovered)
    if (c.queue == hostif::CqeQueue::kSrq && c.srq == srq->id && c.wqe < h->max_wr)
      free_slot[c.wqe] = true;
  for (uint32_t s = 0; s < h->max_wr && cq; ++s) {
    if (free_slot[s]) continue;
    hostif::Cqe c{};
    c.wr_id = hostif::recv_wqe(hostif::srq_slot(h, s))->wr_id;
    c.status = hostif::WcStatus::kWrFlushErr;
    c.opcode = hostif::WcOpcode::kRecv;
    push_orphan(cq, c);
  }
  pthread_spin_unlock(&srq->post_lock);
}

ibv_ah* create_ah(ibv_pd* ibpd, ibv_ah_attr* attr) noexcept {
  // RoCE-style addressing: the GRH names the peer; there are no LIDs on Ethernet.
  if (!attr->is_global || attr->port_num != kPortNum ||
      attr->grh.sgid_index >= nic::kGidTableLen) {
    errno = EINVAL;
    return nullptr;
  }
  auto ip = nic::gid_to_ipv4(attr->grh.dgid.raw);
  if (!ip) {
    errno = EINVAL;  // only IPv4-mapped GIDs name a peer of this NIC
    return nullptr;
  }
  auto* ah = new (std::nothrow) Ah{};
  if (!ah) {
    errno = ENOMEM;
    return nullptr;
  }
  ah->ip = *ip;
  ah->ah.context = ibpd->context;
  ah->ah.pd = ibpd;
  ah->ah.handle = *ip;
  to_pd(ibpd)->users.fetch_add(1, std::memory_order_relaxed);
  return &ah->ah;
}

int destroy_ah(ibv_ah* ibah) noexcept {
  Ah* ah = to_ah(ibah);
  to_pd(ibah->pd)->users.fetch_sub(1, std::memory_order_release);
  delete ah;
  return 0;
}

}  // namespace metaroce::provider
