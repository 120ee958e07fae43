// SPDX-License-Identifier: Apache-2.0
// The provider's device (one per sysfs link) and context (one per ibv_open_device), and the
// device-level verbs: discovery, query_device_ex, query_port, async events.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "datapath/nic/device.h"
#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Device {
  abi::VerbsDevice vdev;  // first: libibverbs hands us &vdev.device
};

// What a context owns besides the verbs structure (kept apart so Context stays a C layout).
struct ContextState {
  std::shared_ptr<nic::Device> nic;
  int async_write_fd = -1;  // the pipe whose read end is context.async_fd
};

struct Context {
  verbs_context vctx;  // first: libibverbs allocates and initialises it
  ContextState* state;
};
static_assert(std::is_standard_layout_v<Context>);

inline Context* to_context(ibv_context* c) {
  // ibv_context is the last member of verbs_context, which is the first member of Context.
  return reinterpret_cast<Context*>(reinterpret_cast<char*>(c) - offsetof(verbs_context, context));
}
inline nic::Device& nic_of(ibv_context* c) { return *to_context(c)->state->nic; }

// True for a context this provider opened.
bool is_ours(const ibv_context* context) noexcept;

// Writes one async event record (struct ib_uverbs_async_event_desc) for ibv_get_async_event.
// Never blocks: if the application does not read its events, later ones are dropped.
void post_async_event(ibv_context* context, uint64_t element, ibv_event_type type) noexcept;

// Logs one line through libibverbs' logger (printed when VERBS_LOG_LEVEL >= level).
#define METAROCE_LOG(ctx, level, fmt, ...)                                              \
  __verbs_log((ctx), (level), "metaroce: %s: " fmt "\n", (ctx)->context.device->name \
              __VA_OPT__(, ) __VA_ARGS__)

// Device-level verbs.
int query_device_ex(ibv_context* context, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t attr_size) noexcept;
int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) noexcept;

}  // namespace metaroce::provider
