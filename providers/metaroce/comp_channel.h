// SPDX-License-Identifier: Apache-2.0
// Completion channels without a kernel: why libibverbs cannot create them for us, and the
// provider's replacement for ibv_create_comp_channel (docs/spec/verbs-mapping.md §2).
#pragma once

#include <infiniband/verbs.h>

namespace metaroce::provider {

// Makes ibv_create_comp_channel work for contexts of this provider, once per process. Returns
// false (and leaves libibverbs untouched) where that is impossible; channels then fail with
// ENOSPC as before.
bool install_comp_channel_hook() noexcept;

// The descriptor the provider writes completion events of channel into; -1 if unknown.
int comp_channel_event_fd(const ibv_comp_channel* channel) noexcept;

}  // namespace metaroce::provider
