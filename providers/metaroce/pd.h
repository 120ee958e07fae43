// SPDX-License-Identifier: Apache-2.0
// Protection domains and memory regions: the provider's half (verbs checks, bookkeeping); the
// engine keeps the MR table that checks every key on the wire.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Pd {
  ibv_pd pd;                    // first: the application holds &pd
  uint32_t id;                  // the engine's PD handle
  std::atomic<uint32_t> users;  // MRs, QPs, SRQs and AHs in it: dealloc_pd answers EBUSY meanwhile
};
static_assert(std::is_standard_layout_v<Pd>);

inline Pd* to_pd(ibv_pd* p) { return reinterpret_cast<Pd*>(p); }

ibv_pd* alloc_pd(ibv_context* context) noexcept;
int dealloc_pd(ibv_pd* pd) noexcept;
ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access) noexcept;
int rereg_mr(abi::VerbsMr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
             int access) noexcept;
int dereg_mr(abi::VerbsMr* mr) noexcept;
// Memory windows (verbs-mapping.md §13); binds: qp.h.
ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type) noexcept;
int dealloc_mw(ibv_mw* mw) noexcept;
int advise_mr(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
              uint32_t num_sge) noexcept;

}  // namespace metaroce::provider
