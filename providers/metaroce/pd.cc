// SPDX-License-Identifier: Apache-2.0
// Protection domains and memory regions (ibv_alloc_pd, ibv_reg_mr and their inverses): requests
// to the engine, which reaches the registered memory itself.
#include "providers/metaroce/pd.h"

#include <algorithm>
#include <cerrno>
#include <new>

#include "providers/metaroce/context.h"
#include "providers/metaroce/convert.h"
#include "providers/metaroce/kernel.h"
#include "providers/metaroce/shared_pages.h"

namespace metaroce::provider {

ibv_pd* alloc_pd(ibv_context* context) noexcept {
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  const bool kernel = state_of(context).kernel;
  if (kernel) {
    if (int e = kernel::alloc_pd(context, &pd->pd)) {  // sets the kernel's handle
      delete pd;
      errno = e;
      return nullptr;
    }
  }
  hostif::Message resp;
  const int err = engine_call(context, hostif::Op::kAllocPd, nullptr, 0, {}, &resp);
  auto body = resp.as<hostif::PdResp>();
  hostif::close_fds(&resp);
  if (err || !body) {
    if (kernel) kernel::dealloc_pd(&pd->pd);
    delete pd;
    errno = err ? err : EPROTO;
    return nullptr;
  }
  pd->id = body->pd;
  pd->pd.context = context;
  if (!kernel) {
    pd->pd.handle = pd->id;
    track(context, pd);
  }
  return &pd->pd;
}

int dealloc_pd(ibv_pd* ibpd) noexcept {
  Pd* pd = to_pd(ibpd);
  if (pd->users.load(std::memory_order_acquire) != 0) return EBUSY;
  if (pd->imported_from) {  // releases the import; the PD is its allocator's to destroy (§21)
    unimport_pd(ibpd);
    return 0;
  }
  if (pd->parent_of) {  // a parent domain: the engine knows only the PD it extends
    pd->parent_of->users.fetch_sub(1, std::memory_order_release);
    if (pd->td) reinterpret_cast<Td*>(pd->td)->users.fetch_sub(1, std::memory_order_release);
    delete pd;
    return 0;
  }
  hostif::Message resp;
  const int err = engine_call(ibpd->context, hostif::Op::kDeallocPd, hostif::IdReq{pd->id}, &resp);
  if (err && !engine_gone(err)) return err;
  if (state_of(ibpd->context).kernel) {
    if (int e = kernel::dealloc_pd(ibpd)) return e;
  } else {
    untrack(ibpd->context, pd);
  }
  delete pd;
  return 0;
}

namespace {

// Moves the whole pages of a region into the memfd the engine maps and tells the engine where
// they are (docs/design.md, "Shared memory regions"); what does not move (share false: an
// on-demand region, one with an IOVA of its own) is held, so that no other region moves it while
// the engine reaches it by system call. Once the engine knows of a piece it keeps it until the
// region goes, so the pieces stay with the region even if a later request of it fails.
void share_pages(ibv_context* ctx, uint32_t pd, uint32_t lkey, uint64_t addr, uint64_t length,
                 bool share) {
  ContextState& st = state_of(ctx);
  SharedPages& store = SharedPages::process();
  SharedPages::Lease lease;
  try {
    lease = store.acquire(addr, length, share && st.share_mrs);
  } catch (...) {  // no memory for the bookkeeping: the region is served by system calls
    return;
  }
  hostif::MapPagesReq req;
  req.lkey = lkey;
  req.pd = pd;
  const int fd = store.fd();
  for (size_t i = 0; i < lease.pieces.size(); i += hostif::kMaxMapPieces) {
    req.count =
        static_cast<uint32_t>(std::min<size_t>(hostif::kMaxMapPieces, lease.pieces.size() - i));
    std::copy_n(lease.pieces.begin() + static_cast<ptrdiff_t>(i), req.count, req.pieces);
    hostif::Message resp;
    if (engine_call(ctx, hostif::Op::kMapPages, req, &resp, {fd})) break;
  }
  std::lock_guard lock(st.shared_mu);
  try {
    st.shared[lkey] = std::move(lease);
  } catch (...) {  // kept as they are (coherent either way) until the process exits
  }
}

// The region's pages, which the engine has forgotten, back to private memory.
void unshare_pages(ibv_context* ctx, uint32_t lkey) {
  ContextState& st = state_of(ctx);
  SharedPages::Lease lease;
  {
    std::lock_guard lock(st.shared_mu);
    auto it = st.shared.find(lkey);
    if (it == st.shared.end()) return;
    lease = std::move(it->second);
    st.shared.erase(it);
  }
  SharedPages::process().release(lease);
}

}  // namespace

ibv_mr* reg_mr(ibv_pd* ibpd, void* addr, size_t length, uint64_t hca_va, int access) noexcept {
  const auto flags = static_cast<unsigned>(access) & ~kHintAccess;
  // Implicit on-demand paging: the whole address space, as ibv_reg_mr(3) spells it.
  const bool implicit = !addr && length == SIZE_MAX && (flags & IBV_ACCESS_ON_DEMAND);
  if (!implicit && (!addr || length == 0 || length > hostif::kMaxMrSize ||
                    hca_va + length < hca_va)) {
    errno = EINVAL;
    return nullptr;
  }
  if (int err = check_mr_access(flags)) {
    errno = err;
    return nullptr;
  }
  if (flags & ~kSupportedAccess) {
    errno = EOPNOTSUPP;  // ZERO_BASED and what later headers add: not offered by this NIC
    return nullptr;
  }
  if (implicit && hca_va != 0) {
    errno = EINVAL;  // the whole address space is reached at its own addresses
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
  req.iova = hca_va;  // ibv_reg_mr passes addr; ibv_reg_mr_iova2 the address verbs will use
  const bool kernel = state_of(ibpd->context).kernel;
  // Pages the engine could not reach are refused now, as a NIC refuses pages it cannot pin
  // (EFAULT): a hole, PROT_NONE, read-only memory asked to be written, a device's memory (a
  // GPU pointer: docs/bundle.md). On-demand regions fault in later, as on a NIC; the module
  // pins a kernel context's itself.
  if (!kernel && !implicit && !(flags & IBV_ACCESS_ON_DEMAND)) {
    if (int e = SharedPages::reachable(reinterpret_cast<uintptr_t>(addr), length,
                                       flags & IBV_ACCESS_LOCAL_WRITE)) {
      delete mr;
      errno = e;
      return nullptr;
    }
  }
  if (kernel) {
    // The kernel pins the pages and chooses the keys; the engine maps those pages. The module
    // answers EOPNOTSUPP for an IOVA other than addr and for on-demand paging.
    if (int e = kernel::reg_mr(ibpd, addr, length, hca_va, access, mr)) {
      delete mr;
      errno = e;
      return nullptr;
    }
    req.key = mr->mr.lkey;
  }
  hostif::Message resp;
  const int err = engine_call(ibpd->context, hostif::Op::kRegMr, req, &resp);
  auto body = resp.as<hostif::RegMrResp>();
  if (err || !body) {
    if (kernel) kernel::dereg_mr(mr);
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
  if (!kernel) {
    mr->mr.handle = body->lkey;
    track(ibpd->context, mr);
  }
  if (!implicit && !(flags & IBV_ACCESS_ON_DEMAND) && hca_va == reinterpret_cast<uintptr_t>(addr))
    state_of(ibpd->context).local_mrs.add(mr->mr.lkey, hca_va, length);
  // On-demand regions stay the engine's to fault in page by page; a region with an IOVA of its
  // own is reached by system call (pieces are named by process address, checked as IOVAs); a
  // kernel context's are the pages the module pinned. Their pages are held.
  share_pages(ibpd->context, pd->id, mr->mr.lkey, reinterpret_cast<uintptr_t>(addr), length,
              !kernel && !implicit && !(flags & IBV_ACCESS_ON_DEMAND) &&
                  hca_va == reinterpret_cast<uintptr_t>(addr));
  return &mr->mr;
}

// libibverbs has checked the flags, that a new translation has an address and a length, and that
// access comes only with CHANGE_ACCESS; it updates pd, addr and length on success. Failure:
// errno and a non-zero return (libibverbs answers IBV_REREG_MR_ERR_CMD); the region is unchanged.
int rereg_mr(abi::VerbsMr* mr, int flags, ibv_pd* ibpd, void* addr, size_t length,
             int access) noexcept {
  hostif::ReregMrReq req;
  req.lkey = mr->mr.lkey;
  req.flags = static_cast<uint32_t>(flags);
  int err = 0;
  if ((flags & IBV_REREG_MR_CHANGE_PD) && (!ibpd || ibpd->context != mr->mr.context)) err = EINVAL;
  if (flags & IBV_REREG_MR_CHANGE_PD && !err) req.pd = to_pd(ibpd)->id;
  if ((flags & IBV_REREG_MR_CHANGE_ACCESS) && !err) {
    const auto a = static_cast<unsigned>(access) & ~kHintAccess;
    err = check_mr_access(a);
    if (!err && (a & ~kSupportedAccess)) err = EOPNOTSUPP;
    req.access = a;
  }
  if ((flags & IBV_REREG_MR_CHANGE_TRANSLATION) && !err) {
    if (length > hostif::kMaxMrSize) err = EINVAL;
    req.addr = reinterpret_cast<uintptr_t>(addr);
    req.length = length;
  }
  if (!err) {
    hostif::Message resp;
    err = engine_call(mr->mr.context, hostif::Op::kReregMr, req, &resp);
  }
  if (err) {
    errno = err;
    return err;
  }
  if (flags & IBV_REREG_MR_CHANGE_PD) {
    to_pd(mr->mr.pd)->users.fetch_sub(1, std::memory_order_release);
    to_pd(ibpd)->users.fetch_add(1, std::memory_order_relaxed);
  }
  // ibv_dereg_mr reads it (an on-demand region was never excluded from fork).
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) mr->access = access;
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {  // its new addresses are its own (no IOVA)
    LocalMrs& known = state_of(mr->mr.context).local_mrs;
    known.remove(mr->mr.lkey);
    // The engine forgot the old translation's shared pages; the new one's are shared anew.
    unshare_pages(mr->mr.context, mr->mr.lkey);
    const bool odp = mr->access & IBV_ACCESS_ON_DEMAND;
    if (!odp) known.add(mr->mr.lkey, reinterpret_cast<uintptr_t>(addr), length);
    const Pd* pd = to_pd((flags & IBV_REREG_MR_CHANGE_PD) ? ibpd : mr->mr.pd);
    share_pages(mr->mr.context, pd->id, mr->mr.lkey, reinterpret_cast<uintptr_t>(addr), length,
                !odp);
  }
  return 0;
}

ibv_mw* alloc_mw(ibv_pd* ibpd, ibv_mw_type type) noexcept {
  if (type != IBV_MW_TYPE_1 && type != IBV_MW_TYPE_2) {
    errno = EINVAL;
    return nullptr;
  }
  auto* mw = new (std::nothrow) ibv_mw{};
  if (!mw) {
    errno = ENOMEM;
    return nullptr;
  }
  Pd* pd = to_pd(ibpd);
  hostif::AllocMwReq req;
  req.pd = pd->id;
  req.type = type;
  hostif::Message resp;
  const int err = engine_call(ibpd->context, hostif::Op::kAllocMw, req, &resp);
  auto body = resp.as<hostif::AllocMwResp>();
  if (err || !body) {
    delete mw;
    errno = err ? err : EPROTO;
    return nullptr;
  }
  pd->users.fetch_add(1, std::memory_order_relaxed);
  mw->context = ibpd->context;
  mw->pd = ibpd;
  mw->rkey = body->rkey;
  mw->handle = body->rkey >> 8;
  mw->type = type;
  return mw;
}

// A bound window is invalidated with it (its rkey reaches nothing any more).
int dealloc_mw(ibv_mw* mw) noexcept {
  hostif::Message resp;
  const int err =
      engine_call(mw->context, hostif::Op::kDeallocMw, hostif::IdReq{mw->rkey}, &resp);
  if (err && !engine_gone(err)) return err;
  to_pd(mw->pd)->users.fetch_sub(1, std::memory_order_release);
  delete mw;
  return 0;
}

ibv_td* alloc_td(ibv_context* context, ibv_td_init_attr* attr) noexcept {
  if (!attr || attr->comp_mask) {
    errno = EINVAL;
    return nullptr;
  }
  auto* td = new (std::nothrow) Td{};
  if (!td) {
    errno = ENOMEM;
    return nullptr;
  }
  td->td.context = context;
  return &td->td;
}

int dealloc_td(ibv_td* ibtd) noexcept {
  auto* td = reinterpret_cast<Td*>(ibtd);
  if (td->users.load(std::memory_order_acquire) != 0) return EBUSY;
  delete td;
  return 0;
}

// A parent domain is its PD for every verb (the same engine PD), plus a thread domain and the
// allocators of the provider's memory for the QPs, CQs and SRQs made with it (the queues' rings
// are the engine's shared segments and never come from them).
ibv_pd* alloc_parent_domain(ibv_context* context, ibv_parent_domain_init_attr* attr) noexcept {
  constexpr uint32_t kKnown =
      IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
  const bool allocators = attr && (attr->comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS);
  if (!attr || !attr->pd || attr->pd->context != context || (attr->comp_mask & ~kKnown) ||
      (attr->td && attr->td->context != context) ||
      (allocators && (!attr->alloc || !attr->free))) {
    errno = EINVAL;
    return nullptr;
  }
  Pd* base = to_pd(attr->pd);
  if (base->parent_of) base = base->parent_of;  // a parent of a parent extends the same PD
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  pd->pd.context = context;
  pd->pd.handle = base->pd.handle;
  pd->id = base->id;
  pd->parent_of = base;
  pd->td = attr->td;
  if (allocators) {
    pd->alloc = attr->alloc;
    pd->free = attr->free;
  }
  if (attr->comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT) pd->pd_context = attr->pd_context;
  base->users.fetch_add(1, std::memory_order_relaxed);
  if (attr->td) reinterpret_cast<Td*>(attr->td)->users.fetch_add(1, std::memory_order_relaxed);
  return &pd->pd;
}

// Prefetch advice (ibv_advise_mr(3)): the NIC resolves pages through the kernel at each access
// and pins none, so there is nothing to fault in ahead of time; the advice is checked (each SGE
// must lie in a region of the PD: EFAULT otherwise) and accepted.
int advise_mr(ibv_pd* ibpd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
              uint32_t num_sge) noexcept {
  if (advice != IBV_ADVISE_MR_ADVICE_PREFETCH && advice != IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE &&
      advice != IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT)
    return EOPNOTSUPP;
  if ((flags & ~IBV_ADVISE_MR_FLAG_FLUSH) || !sg_list || num_sge == 0) return EINVAL;
  for (uint32_t i = 0; i < num_sge; ++i) {
    hostif::CheckMrReq req;
    req.pd = to_pd(ibpd)->id;
    req.lkey = sg_list[i].lkey;
    req.addr = sg_list[i].addr;
    req.length = sg_list[i].length;
    hostif::Message resp;
    if (int err = engine_call(ibpd->context, hostif::Op::kCheckMr, req, &resp)) return err;
  }
  return 0;
}

int dereg_mr(abi::VerbsMr* mr) noexcept {
  if (mr->mr_type == abi::kMrTypeImportedMr) {  // releases the import (§21)
    unimport_mr(&mr->mr);
    return 0;
  }
  hostif::Message resp;
  const int err =
      engine_call(mr->mr.context, hostif::Op::kDeregMr, hostif::IdReq{mr->mr.lkey}, &resp);
  if (err && !engine_gone(err)) return err;
  state_of(mr->mr.context).local_mrs.remove(mr->mr.lkey);
  unshare_pages(mr->mr.context, mr->mr.lkey);
  if (state_of(mr->mr.context).kernel) {
    if (int e = kernel::dereg_mr(mr)) return e;
  } else {
    untrack(mr->mr.context, mr);
  }
  to_pd(mr->mr.pd)->users.fetch_sub(1, std::memory_order_release);
  delete mr;
  return 0;
}

// An import names the object the context state already holds: no request to the engine, which
// sees one context (verbs-mapping.md §21). Handles are the engine's PD id and the MR's lkey.
ibv_pd* import_pd(ibv_context* context, uint32_t pd_handle) noexcept {
  ContextState& st = state_of(context);
  if (st.kernel) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  auto* pd = new (std::nothrow) Pd{};
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  std::lock_guard lock(st.objects_mu);
  const auto it = std::find_if(st.pds.begin(), st.pds.end(),
                               [&](const Pd* p) { return p->pd.handle == pd_handle; });
  if (it == st.pds.end()) {
    delete pd;
    errno = ENOENT;  // what the kernel answers for a handle its context does not hold
    return nullptr;
  }
  Pd* origin = *it;
  origin->users.fetch_add(1, std::memory_order_relaxed);
  pd->id = origin->id;
  pd->imported_from = origin;
  pd->pd.context = context;
  pd->pd.handle = pd_handle;
  return &pd->pd;
}

void unimport_pd(ibv_pd* ibpd) noexcept {
  if (!ibpd) return;
  Pd* pd = to_pd(ibpd);
  ContextState& st = state_of(ibpd->context);
  if (!pd->imported_from) {
    // As with the kernel: the application's handle goes, the PD stays until the context closes.
    untrack(ibpd->context, pd);
    std::lock_guard lock(st.objects_mu);
    st.released_pds.push_back(pd);
    return;
  }
  pd->imported_from->users.fetch_sub(1, std::memory_order_release);
  std::lock_guard lock(st.objects_mu);
  st.released_pds.push_back(pd);  // QPs in it may be destroyed after this (pyverbs does)
}

ibv_mr* import_mr(ibv_pd* ibpd, uint32_t mr_handle) noexcept {
  ContextState& st = state_of(ibpd->context);
  if (st.kernel) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  auto* mr = new (std::nothrow) abi::VerbsMr{};
  if (!mr) {
    errno = ENOMEM;
    return nullptr;
  }
  std::lock_guard lock(st.objects_mu);
  const auto it = std::find_if(st.mrs.begin(), st.mrs.end(),
                               [&](const abi::VerbsMr* m) { return m->mr.handle == mr_handle; });
  if (it == st.mrs.end() || to_pd((*it)->mr.pd)->id != to_pd(ibpd)->id) {
    delete mr;
    errno = it == st.mrs.end() ? ENOENT : EINVAL;  // or a region of another PD
    return nullptr;
  }
  const abi::VerbsMr& origin = **it;
  to_pd(ibpd)->users.fetch_add(1, std::memory_order_relaxed);
  mr->mr_type = abi::kMrTypeImportedMr;  // ibv_dereg_mr leaves its pages' fork setting alone
  mr->access = origin.access;
  mr->mr.context = ibpd->context;
  mr->mr.pd = ibpd;
  mr->mr.addr = origin.mr.addr;
  mr->mr.length = origin.mr.length;
  mr->mr.lkey = origin.mr.lkey;
  mr->mr.rkey = origin.mr.rkey;
  mr->mr.handle = mr_handle;
  return &mr->mr;
}

void unimport_mr(ibv_mr* ibmr) noexcept {
  if (!ibmr) return;
  auto* mr = reinterpret_cast<abi::VerbsMr*>(ibmr);
  if (mr->mr_type == abi::kMrTypeImportedMr) {
    to_pd(ibmr->pd)->users.fetch_sub(1, std::memory_order_release);
  } else {
    // As with the kernel: the struct goes, the region stays registered (and its PD in use)
    // until the context closes.
    untrack(ibmr->context, mr);
  }
  delete mr;
}

}  // namespace metaroce::provider
