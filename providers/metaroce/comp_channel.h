// SPDX-License-Identifier: Apache-2.0
// Completion channels without a kernel: the provider's ibv_create_comp_channel, which
// libmetaroce-preload.so calls for our contexts (comp_channel.cc, docs/spec/verbs-mapping.md §2).
#pragma once

#include <infiniband/verbs.h>

namespace metaroce::provider {

// True when libmetaroce-preload.so is loaded, i.e. ibv_create_comp_channel reaches us; without
// it libibverbs' own fails with ENOSPC for our contexts.
bool comp_channel_preload_active() noexcept;

// The descriptor the provider writes completion events of channel into; -1 if unknown.
int comp_channel_event_fd(const ibv_comp_channel* channel) noexcept;

}  // namespace metaroce::provider
