// SPDX-License-Identifier: Apache-2.0
// ibv_create_srq / modify / query / destroy, ibv_post_srq_recv, and UD address handles.
#include "providers/metaroce/srq.h"

#include <cerrno>
#include <new>

#include "datapath/nic/link_config.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/device_attr.h"

namespace metaroce::provider {
namespace {

// Called by the NIC's progress thread when a QP takes an entry below the armed limit.
void limit_reached(void* arg) {
  Srq* srq = static_cast<Srq*>(arg);
  post_async_event(srq->srq.context, reinterpret_cast<uintptr_t>(&srq->srq),
                   IBV_EVENT_SRQ_LIMIT_REACHED);
}

}  // namespace

ibv_srq* create_srq(ibv_pd* ibpd, ibv_srq_init_attr* attr) noexcept {
  ibv_srq_attr& a = attr->attr;
  if (a.max_wr < 1 || a.max_wr > nic::kMaxSrqWr || a.max_sge < 1 || a.max_sge > nic::kMaxSge) {
    errno = EINVAL;
    return nullptr;
  }
  auto* srq = new (std::nothrow) Srq{};
  if (!srq) {
    errno = ENOMEM;
    return nullptr;
  }
  Pd* pd = to_pd(ibpd);
  int err = 0;
  srq->nic = nic_of(ibpd->context).create_srq(pd->id, a.max_wr, a.max_sge, &err);
  if (!srq->nic) {
    delete srq;
    errno = err ? err : ENOMEM;
    return nullptr;
  }
  srq->pd = pd;
  srq->max_wr = a.max_wr;
  srq->max_sge = a.max_sge;
  // libibverbs fills these too after we return; a provider that is called directly has them.
  ibv_srq& s = srq->srq;
  s.context = ibpd->context;
  s.srq_context = attr->srq_context;
  s.pd = ibpd;
  s.handle = 0;
  s.events_completed = 0;
  pthread_mutex_init(&s.mutex, nullptr);
  pthread_cond_init(&s.cond, nullptr);
  srq->nic->set_limit_notifier(limit_reached, srq);
  // srq_limit is ignored at creation (verbs): the limit is armed only by ibv_modify_srq.
  a.srq_limit = 0;
  pd->users.fetch_add(1, std::memory_order_relaxed);
  return &srq->srq;
}

int modify_srq(ibv_srq* ibsrq, ibv_srq_attr* attr, int mask) noexcept {
  Srq* srq = to_srq(ibsrq);
  if (mask & ~(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT)) return EINVAL;
  // Resizing is not offered (no IBV_DEVICE_SRQ_RESIZE), as the kernel answers for such devices.
  if (mask & IBV_SRQ_MAX_WR) return EINVAL;
  if (mask & IBV_SRQ_LIMIT) {
    if (attr->srq_limit > srq->max_wr) return EINVAL;
    srq->nic->set_limit(attr->srq_limit);
  }
  return 0;
}

int query_srq(ibv_srq* ibsrq, ibv_srq_attr* attr) noexcept {
  Srq* srq = to_srq(ibsrq);
  attr->max_wr = srq->max_wr;
  attr->max_sge = srq->max_sge;
  attr->srq_limit = srq->nic->limit();
  return 0;
}

int destroy_srq(ibv_srq* ibsrq) noexcept {
  Srq* srq = to_srq(ibsrq);
  if (srq->users.load(std::memory_order_acquire) != 0) return EBUSY;
  if (int err = nic_of(ibsrq->context).destroy_srq(srq->nic)) return err;
  srq->pd->users.fetch_sub(1, std::memory_order_release);
  pthread_cond_destroy(&ibsrq->cond);
  pthread_mutex_destroy(&ibsrq->mutex);
  delete srq;
  return 0;
}

int post_srq_recv(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  Srq* srq = to_srq(ibsrq);
  nic::RecvWqe wqe;
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > srq->max_sge) {
      *bad_wr = wr;
      return EINVAL;
    }
    wqe.wr_id = wr->wr_id;
    wqe.num_sge = static_cast<uint32_t>(wr->num_sge);
    for (int i = 0; i < wr->num_sge; ++i)
      wqe.sge[i] = {wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey};
    if (int err = srq->nic->post_recv(wqe)) {
      *bad_wr = wr;
      return err;
    }
  }
  return 0;
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
