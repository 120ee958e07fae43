// SPDX-License-Identifier: Apache-2.0
// Protection domains and memory regions (ibv_alloc_pd, ibv_reg_mr and their inverses).
#include "providers/metaroce/pd.h"

#include <cerrno>
#include <new>

#include "datapath/nic/device.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/convert.h"

namespace metaroce::provider {
namespace {

// PD handles name a domain inside the NIC, which every context of the process shares, so
// they must be unique per process rather than per context.
std::atomic<uint32_t> next_pd_id{1};

}  // namespace

ibv_pd* alloc_pd(ibv_context* context) noexcept {
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  pd->id = next_pd_id.fetch_add(1, std::memory_order_relaxed);
  pd->pd.context = context;
  pd->pd.handle = pd->id;
  return &pd->pd;
}

int dealloc_pd(ibv_pd* ibpd) noexcept {
  Pd* pd = to_pd(ibpd);
  if (pd->users.load(std::memory_order_acquire) != 0) return EBUSY;
  delete pd;
  return 0;
}

ibv_mr* reg_mr(ibv_pd* ibpd, void* addr, size_t length, uint64_t hca_va, int access) noexcept {
  const auto flags = static_cast<unsigned>(access);
  if (!addr || length == 0 || length > nic::kMaxMrSize) {
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
  uint32_t lkey = 0, rkey = 0;
  int err = nic_of(ibpd->context).reg_mr(pd->id, reinterpret_cast<uintptr_t>(addr), length, flags,
                                         &lkey, &rkey);
  if (err) {
    delete mr;
    errno = err;
    return nullptr;
  }
  pd->users.fetch_add(1, std::memory_order_relaxed);
  mr->mr_type = abi::kMrTypeMr;
  mr->access = access;
  mr->mr.context = ibpd->context;
  mr->mr.pd = ibpd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.lkey = lkey;
  mr->mr.rkey = rkey;
  mr->mr.handle = lkey;
  return &mr->mr;
}

int dereg_mr(abi::VerbsMr* mr) noexcept {
  int err = nic_of(mr->mr.context).dereg_mr(mr->mr.lkey);
  if (err) return err;
  to_pd(mr->mr.pd)->users.fetch_sub(1, std::memory_order_release);
  delete mr;
  return 0;
}

}  // namespace metaroce::provider
