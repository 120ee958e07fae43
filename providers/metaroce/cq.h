// SPDX-License-Identifier: Apache-2.0
// Completion queues: a verbs CQ in front of a NIC completion ring that poll_cq reads directly.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "datapath/nic/device.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Cq {
  abi::VerbsCq vcq;               // first: the application holds &vcq.cq
  nic::Cq* nic;
  std::atomic<uint32_t> users;    // QPs using it as send or receive CQ: destroy answers EBUSY
  std::atomic<bool> overflow_reported;
};
static_assert(std::is_standard_layout_v<Cq>);

inline Cq* to_cq(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }

// Converts one NIC completion into the verbs work completion the application reads.
void to_wc(const nic::Cqe& cqe, ibv_wc* wc) noexcept;

ibv_cq* create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel,
                  int comp_vector) noexcept;
int destroy_cq(ibv_cq* cq) noexcept;
int poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc) noexcept;
int req_notify_cq(ibv_cq* cq, int solicited_only) noexcept;

}  // namespace metaroce::provider
