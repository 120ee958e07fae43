// SPDX-License-Identifier: Apache-2.0
// libmetaroce-preload.so: completion channels for kernel-less contexts, by symbol interposition
// (docs/design.md, "Completion channels without a kernel"). `metaroce env` and `metaroce exec`
// put it in LD_PRELOAD. It defines libibverbs' ibv_create_comp_channel and
// ibv_destroy_comp_channel (version IBVERBS_1.0, so that programs linked against libibverbs bind
// here first) and hands a context to its own provider when that provider offers channel
// functions, to libibverbs otherwise. It links nothing but libc, so the many programs
// that never touch verbs pay only its loading; nothing in any loaded library is modified.
#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <cerrno>

namespace {

using CreateFn = ibv_comp_channel* (*)(ibv_context*);
using DestroyFn = int (*)(ibv_comp_channel*);

constexpr const char* kVersion = "IBVERBS_1.0";

// The provider's own channel function `name`, found in the module its poll_cq lives in; null for
// providers that have none (every kernel provider).
void* provider_function(const ibv_context* context, const char* name) {
  if (!context || !context->ops.poll_cq) return nullptr;
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(context->ops.poll_cq), &info) || !info.dli_fname)
    return nullptr;
  void* module = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  if (!module) return nullptr;
  void* fn = dlsym(module, name);
  dlclose(module);  // balanced: NOLOAD took a reference on a module libibverbs keeps loaded
  return fn;
}

template <typename Fn>
Fn libibverbs_function(const char* name, const char* version = kVersion) {
  return reinterpret_cast<Fn>(dlvsym(RTLD_NEXT, name, version));
}

using ImportFn = ibv_context* (*)(int cmd_fd, int* ours);
// The MetaRoCE provider's ibv_import_device, registered by the provider as libibverbs loads it.
ImportFn g_import = nullptr;

}  // namespace

extern "C" {

// Providers check this to tell a user that channels need the preload (metaroce exec).
__attribute__((visibility("default"))) int metaroce_preload_active() { return 1; }

// Called by the provider's constructor.
__attribute__((visibility("default"))) void metaroce_preload_set_import(ImportFn fn) {
  __atomic_store_n(&g_import, fn, __ATOMIC_RELEASE);
}

__attribute__((visibility("default"))) ibv_context* ibv_import_device(int cmd_fd) {
  using ListFn = ibv_device** (*)(int*);
  using FreeFn = void (*)(ibv_device**);
  using NextFn = ibv_context* (*)(int);
  if (!__atomic_load_n(&g_import, __ATOMIC_ACQUIRE)) {
    // The providers load with the first device list; ours registers then.
    auto list = libibverbs_function<ListFn>("ibv_get_device_list", "IBVERBS_1.1");
    auto free_list = libibverbs_function<FreeFn>("ibv_free_device_list", "IBVERBS_1.1");
    if (list && free_list)
      if (ibv_device** devices = list(nullptr)) free_list(devices);
  }
  if (ImportFn own = __atomic_load_n(&g_import, __ATOMIC_ACQUIRE)) {
    int ours = 0;
    ibv_context* context = own(cmd_fd, &ours);
    if (ours) return context;
  }
  const NextFn next = libibverbs_function<NextFn>("ibv_import_device", "IBVERBS_1.10");
  if (!next) {
    errno = ENOSYS;
    return nullptr;
  }
  return next(cmd_fd);
}

__attribute__((visibility("default"))) ibv_comp_channel* ibv_create_comp_channel(
    ibv_context* context) {
  if (auto own = reinterpret_cast<CreateFn>(
          provider_function(context, "metaroce_create_comp_channel")))
    return own(context);
  // Looked up per call (channels are made rarely): no static guard, so no C++ runtime needed.
  const CreateFn next = libibverbs_function<CreateFn>("ibv_create_comp_channel");
  if (!next) {
    errno = ENOSYS;
    return nullptr;
  }
  return next(context);
}

__attribute__((visibility("default"))) int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  if (!channel) return EINVAL;
  if (auto own = reinterpret_cast<DestroyFn>(
          provider_function(channel->context, "metaroce_destroy_comp_channel")))
    return own(channel);
  const DestroyFn next = libibverbs_function<DestroyFn>("ibv_destroy_comp_channel");
  return next ? next(channel) : ENOSYS;
}

}  // extern "C"
