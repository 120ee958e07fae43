// SPDX-License-Identifier: Apache-2.0
// Completion channels without a kernel (docs/spec/verbs-mapping.md §2).
//
// libibverbs 44 creates a channel by writing IB_USER_VERBS_CMD_CREATE_COMP_CHANNEL to the
// context's command descriptor and taking the new descriptor from the response, which only a
// kernel (ib_uverbs) writes back into the caller's memory before write() returns. No provider
// op is consulted and nothing in user space can answer a write() synchronously, so with our
// kernel-less device node (/dev/full) the call fails with ENOSPC. Everything else about
// channels is user space: ibv_get_cq_event reads 8-byte records (the CQ's address) from
// channel->fd, and ibv_destroy_comp_channel only closes it. So the provider exports the two
// functions below, and libmetaroce-preload.so (in LD_PRELOAD under `metaroce exec`/`env`)
// interposes libibverbs' ibv_create/destroy_comp_channel and calls them for contexts of ours:
// a socket pair, the application reads one end, the CQ writes event records into the other.
#include "providers/metaroce/comp_channel.h"

#include <dlfcn.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "providers/metaroce/context.h"

namespace metaroce::provider {
namespace {

// What we allocate for a channel: libibverbs frees it with free(), which the layout allows.
struct Channel {
  ibv_comp_channel ch;  // first
  int event_fd;         // the end the CQs write into
  uint32_t magic;
};
constexpr uint32_t kChannelMagic = 0x4d524343;  // "MRCC"

}  // namespace

// Called by libmetaroce-preload.so for contexts of this provider only (it finds them through
// the module their ops live in); anything else is refused.
extern "C" __attribute__((visibility("default"))) ibv_comp_channel* metaroce_create_comp_channel(
    ibv_context* context) {
  if (!context || !is_ours(context)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* c = static_cast<Channel*>(std::malloc(sizeof(Channel)));
  if (!c) {
    errno = ENOMEM;
    return nullptr;
  }
  int fds[2];
  // A stream socket keeps 8-byte records whole for ibv_get_cq_event's read(); writes from
  // the progress thread never block (MSG_DONTWAIT) nor raise SIGPIPE (MSG_NOSIGNAL).
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::free(c);
    return nullptr;
  }
  shutdown(fds[0], SHUT_WR);
  c->ch.context = context;
  c->ch.fd = fds[0];
  c->ch.refcnt = 0;
  c->event_fd = fds[1];
  c->magic = kChannelMagic;
  return &c->ch;
}

extern "C" __attribute__((visibility("default"))) int metaroce_destroy_comp_channel(
    ibv_comp_channel* channel) {
  ibv_context* context = channel->context;
  pthread_mutex_lock(&context->mutex);
  if (channel->refcnt) {
    pthread_mutex_unlock(&context->mutex);
    return EBUSY;  // CQs still use it, as libibverbs answers
  }
  if (is_ours(context)) {
    auto* c = reinterpret_cast<Channel*>(channel);
    if (c->magic == kChannelMagic) {
      close(c->event_fd);
      c->magic = 0;
    }
  }
  close(channel->fd);
  std::free(channel);
  pthread_mutex_unlock(&context->mutex);
  return 0;
}

bool comp_channel_preload_active() noexcept {
  return dlsym(RTLD_DEFAULT, "metaroce_preload_active") != nullptr;
}

int comp_channel_event_fd(const ibv_comp_channel* channel) noexcept {
  if (!channel || !is_ours(channel->context)) return -1;
  const auto* c = reinterpret_cast<const Channel*>(channel);
  return c->magic == kChannelMagic ? c->event_fd : -1;
}

}  // namespace metaroce::provider
