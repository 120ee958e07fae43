// SPDX-License-Identifier: Apache-2.0
// Protection domains and memory regions: the provider's half (verbs checks, bookkeeping); the
// engine keeps the MR table that checks every key on the wire.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <new>
#include <cstdint>
#include <type_traits>

#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Pd {
  ibv_pd pd;                    // first: the application holds &pd
  uint32_t id;                  // the engine's PD handle
  std::atomic<uint32_t> users;  // MRs, QPs, SRQs and AHs in it: dealloc_pd answers EBUSY meanwhile
  // A parent domain (ibv_alloc_parent_domain): the PD it extends (same engine id), its thread
  // domain, and the allocators the provider's memory for its QPs, CQs and SRQs comes from.
  Pd* parent_of;
  ibv_td* td;
  void* (*alloc)(ibv_pd* pd, void* pd_context, size_t size, size_t alignment, uint64_t type);
  void (*free)(ibv_pd* pd, void* pd_context, void* ptr, uint64_t type);
  void* pd_context;
  // An imported PD (ibv_import_pd, verbs-mapping.md §21): the PD it names, which cannot be
  // deallocated while the import holds it. Released imports stay allocated until the context
  // state closes: the QPs and SRQs created in one may be destroyed after ibv_unimport_pd.
  Pd* imported_from;
};
static_assert(std::is_standard_layout_v<Pd>);

inline Pd* to_pd(ibv_pd* p) { return reinterpret_cast<Pd*>(p); }

// A thread domain: accepted and counted; the provider's queues take their locks regardless.
struct Td {
  ibv_td td;
  std::atomic<uint32_t> users;  // parent domains using it
};

// The provider's memory for a resource of a parent domain with allocators (resource_type:
// MRDV_RES_TYPE_*), or the heap; *from is the parent domain to give it back to (nullptr: heap).
template <typename T>
T* alloc_resource(ibv_pd* pd, uint64_t type, Pd** from) noexcept {
  *from = nullptr;
  Pd* p = pd ? to_pd(pd) : nullptr;
  if (p && p->alloc) {
    void* m = p->alloc(pd, p->pd_context, sizeof(T), alignof(T), type);
    if (!m) return nullptr;
    if (m != IBV_ALLOCATOR_USE_DEFAULT) {
      *from = p;
      return new (m) T{};
    }
  }
  return new (std::nothrow) T{};
}
template <typename T>
void free_resource(T* t, Pd* from, uint64_t type) noexcept {
  if (!from) {
    delete t;
    return;
  }
  t->~T();
  from->free(&from->pd, from->pd_context, t, type);
}

ibv_pd* alloc_pd(ibv_context* context) noexcept;
int dealloc_pd(ibv_pd* pd) noexcept;
ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access) noexcept;
int rereg_mr(abi::VerbsMr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
             int access) noexcept;
int dereg_mr(abi::VerbsMr* mr) noexcept;
// Memory windows (verbs-mapping.md §13); binds: qp.h.
ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type) noexcept;
int dealloc_mw(ibv_mw* mw) noexcept;
ibv_td* alloc_td(ibv_context* context, ibv_td_init_attr* attr) noexcept;
int dealloc_td(ibv_td* td) noexcept;
ibv_pd* alloc_parent_domain(ibv_context* context, ibv_parent_domain_init_attr* attr) noexcept;
// ibv_import_pd / ibv_import_mr and their inverses (verbs-mapping.md §21).
ibv_pd* import_pd(ibv_context* context, uint32_t pd_handle) noexcept;
void unimport_pd(ibv_pd* pd) noexcept;
ibv_mr* import_mr(ibv_pd* pd, uint32_t mr_handle) noexcept;
void unimport_mr(ibv_mr* mr) noexcept;
int advise_mr(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
              uint32_t num_sge) noexcept;

}  // namespace metaroce::provider
