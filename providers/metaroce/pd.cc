// SPDX-License-Identifier: Apache-2.0
// Protection domains and memory regions (ibv_alloc_pd, ibv_reg_mr and their inverses): requests
// to the engine, which reaches the registered memory itself.
#include "providers/metaroce/pd.h"

#include <cerrno>
#include <new>

#include "providers/metaroce/context.h"
#include "providers/metaroce/convert.h"

namespace metaroce::provider {

ibv_pd* alloc_pd(ibv_context* context) noexcept {
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  hostif::Message resp;
  const int err = engine_call(context, hostif::Op::kAllocPd, nullptr, 0, {}, &resp);
  auto body = resp.as<hostif::PdResp>();
  hostif::close_fds(&resp);
  if (err || !body) {
    delete pd;
    errno = err ? err : EPROTO;
    return nullptr;
  }
  pd->id = body->pd;
  pd->pd.context = context;
  pd->pd.handle = pd->id;
  return &pd->pd;
}

int dealloc_pd(ibv_pd* ibpd) noexcept {
  Pd* pd = to_pd(ibpd);
  if (pd->users.load(std::memory_order_acquire) != 0) return EBUSY;
  hostif::Message resp;
  const int err = engine_call(ibpd->context, hostif::Op::kDeallocPd, hostif::IdReq{pd->id}, &resp);
  if (err && !engine_gone(err)) return err;
  delete pd;
  return 0;
}

ibv_mr* reg_mr(ibv_pd* ibpd, void* addr, size_t length, uint64_t hca_va, int access) noexcept {
  const auto flags = static_cast<unsigned>(access);
  if (!addr || length == 0 || length > hostif::kMaxMrSize) {
    errno = EINVAL;
    return nullptr;
  }
  if (int err = check_mr_access(flags)) {
    errno = err;
    return nullptr;
  }
  if (flags & ~kSupportedAccess) {
    errno = EOPNOTSUPP;  // ON_DEMAND, ZERO_BASED, HUGETLB, ...: not offered by this NIC
    return nullptr;
  }
  // The wire carries virtual addresses of the MR's owner; a distinct IOVA is not modelled.
  if (hca_va != reinterpret_cast<uintptr_t>(addr)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  auto* mr = new (std::nothrow) abi::VerbsMr{};
  if (!mr) {
    errno = ENOMEM;
    return nullptr;
  }
  Pd* pd = to_pd(ibpd);
  hostif::RegMrReq req;
  req.pd = pd->id;
  req.access = flags;
  req.addr = reinterpret_cast<uintptr_t>(addr);
  req.length = length;
  hostif::Message resp;
  const int err = engine_call(ibpd->context, hostif::Op::kRegMr, req, &resp);
  auto body = resp.as<hostif::RegMrResp>();
  if (err || !body) {
    delete mr;
    errno = err ? err : EPROTO;
    return nullptr;
  }
  pd->users.fetch_add(1, std::memory_order_relaxed);
  mr->mr_type = abi::kMrTypeMr;
  mr->access = access;
  mr->mr.context = ibpd->context;
  mr->mr.pd = ibpd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.lkey = body->lkey;
  mr->mr.rkey = body->rkey;
  mr->mr.handle = body->lkey;
  return &mr->mr;
}

int dereg_mr(abi::VerbsMr* mr) noexcept {
  hostif::Message resp;
  const int err =
      engine_call(mr->mr.context, hostif::Op::kDeregMr, hostif::IdReq{mr->mr.lkey}, &resp);
  if (err && !engine_gone(err)) return err;
  to_pd(mr->mr.pd)->users.fetch_sub(1, std::memory_order_release);
  delete mr;
  return 0;
}

}  // namespace metaroce::provider
