// SPDX-License-Identifier: Apache-2.0
// XRC domains (verbs-mapping.md §17): ibv_open_xrcd / ibv_close_xrcd. A domain named by a file is
// the engine's, shared by every context of the device that opens the same file; SRQs and target
// QPs are made in it (srq.cc, qp.cc).
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Xrcd {
  abi::VerbsXrcd vxrcd;         // first: the application holds &vxrcd.xrcd
  uint32_t id;                  // the engine's
  std::atomic<uint32_t> users;  // SRQs and target QPs made or opened with it: close is EBUSY
};
static_assert(std::is_standard_layout_v<Xrcd>);

inline Xrcd* to_xrcd(ibv_xrcd* x) { return reinterpret_cast<Xrcd*>(x); }

ibv_xrcd* open_xrcd(ibv_context* context, ibv_xrcd_init_attr* attr) noexcept;
int close_xrcd(ibv_xrcd* xrcd) noexcept;

}  // namespace metaroce::provider
