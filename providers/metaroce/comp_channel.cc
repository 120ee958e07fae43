// SPDX-License-Identifier: Apache-2.0
// Completion channels without a kernel (docs/spec/verbs-mapping.md §2).
//
// libibverbs 44 creates a channel by writing IB_USER_VERBS_CMD_CREATE_COMP_CHANNEL to the
// context's command descriptor and taking the new descriptor from the response, which only a
// kernel (ib_uverbs) writes back into the caller's memory before write() returns. No provider
// op is consulted and nothing in user space can answer a write() synchronously, so with our
// kernel-less device node (/dev/full) the call fails with ENOSPC. Everything else about
// channels is user space: ibv_get_cq_event reads 8-byte records (the CQ's address) from
// channel->fd, and ibv_destroy_comp_channel only closes it. So, when a context of ours is
// opened, the provider redirects libibverbs' two channel constructors/destructors to the
// functions below, which make a socket pair: the application reads one end, the CQ writes
// event records into the other. Channels of other providers' contexts keep the kernel path.
#include "providers/metaroce/comp_channel.h"

#include <dlfcn.h>
#include <rdma/ib_user_verbs.h>
#include <sys/mman.h>
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

// The kernel's way, for contexts of other providers (a process may use several).
ibv_comp_channel* kernel_create(ibv_context* context) {
  struct {
    ib_uverbs_cmd_hdr hdr;
    ib_uverbs_create_comp_channel cmd;
  } req{};
  ib_uverbs_create_comp_channel_resp resp{};
  auto* ch = static_cast<ibv_comp_channel*>(std::malloc(sizeof(ibv_comp_channel)));
  if (!ch) return nullptr;
  req.hdr.command = IB_USER_VERBS_CMD_CREATE_COMP_CHANNEL;
  req.hdr.in_words = sizeof(req) / 4;
  req.hdr.out_words = sizeof(resp) / 4;
  req.cmd.response = reinterpret_cast<uintptr_t>(&resp);
  if (write(context->cmd_fd, &req, sizeof(req)) != static_cast<ssize_t>(sizeof(req))) {
    std::free(ch);
    return nullptr;
  }
  ch->context = context;
  ch->fd = static_cast<int>(resp.fd);
  ch->refcnt = 0;
  return ch;
}

extern "C" ibv_comp_channel* metaroce_create_comp_channel(ibv_context* context) {
  if (!is_ours(context)) return kernel_create(context);
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

extern "C" int metaroce_destroy_comp_channel(ibv_comp_channel* channel) {
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

// Overwrites the entry of `from` with an absolute jump to `to` (x86-64: movabs rax; jmp rax).
bool redirect(void* from, void* to) {
#if defined(__x86_64__)
  // Only libibverbs' own code is patched, never a PLT stub of the application.
  Dl_info info;
  if (!dladdr(from, &info) || !info.dli_fname || !std::strstr(info.dli_fname, "libibverbs"))
    return false;
  uint8_t code[12] = {0x48, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xe0};
  const auto target = reinterpret_cast<uintptr_t>(to);
  std::memcpy(code + 2, &target, sizeof(target));
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto at = reinterpret_cast<uintptr_t>(from);
  const uintptr_t start = at & ~(page - 1);
  const uintptr_t end = (at + sizeof(code) + page - 1) & ~(page - 1);
  if (mprotect(reinterpret_cast<void*>(start), end - start, PROT_READ | PROT_WRITE | PROT_EXEC))
    return false;
  std::memcpy(from, code, sizeof(code));
  mprotect(reinterpret_cast<void*>(start), end - start, PROT_READ | PROT_EXEC);
  return true;
#else
  (void)from;
  (void)to;
  return false;
#endif
}

}  // namespace

bool install_comp_channel_hook() noexcept {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) return;
    void* create = dlvsym(lib, "ibv_create_comp_channel", "IBVERBS_1.0");
    void* destroy = dlvsym(lib, "ibv_destroy_comp_channel", "IBVERBS_1.0");
    // Both or neither: our destroy must free what our create allocated.
    if (create && destroy &&
        redirect(destroy, reinterpret_cast<void*>(&metaroce_destroy_comp_channel)))
      ok = redirect(create, reinterpret_cast<void*>(&metaroce_create_comp_channel));
    dlclose(lib);
  });
  return ok;
}

int comp_channel_event_fd(const ibv_comp_channel* channel) noexcept {
  if (!channel || !is_ours(channel->context)) return -1;
  const auto* c = reinterpret_cast<const Channel*>(channel);
  return c->magic == kChannelMagic ? c->event_fd : -1;
}

}  // namespace metaroce::provider
