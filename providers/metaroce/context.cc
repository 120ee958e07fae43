// SPDX-License-Identifier: Apache-2.0
// Provider registration, device discovery from the sysfs tree `metaroce link add` writes, the
// context lifecycle, and the device-level verbs (query_device_ex, query_port).
#include "providers/metaroce/context.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "providers/metaroce/comp_channel.h"
#include "providers/metaroce/cq.h"
#include "providers/metaroce/pd.h"
#include "providers/metaroce/qp.h"
#include "providers/metaroce/srq.h"

namespace metaroce::provider {
namespace {

std::string config_path(const char* ibdev_path) {
  return std::string(ibdev_path) + "/" + nic::kConfigFile;
}

// Name-independent: any link that `metaroce link add` recorded is ours, whatever its name.
bool match_device(abi::SysfsDev* sysfs) {
  char path[abi::kSysfsPathMax + 32];
  int n = snprintf(path, sizeof(path), "%s/%s", sysfs->ibdev_path, nic::kConfigFile);
  return n > 0 && static_cast<size_t>(n) < sizeof(path) && access(path, R_OK) == 0;
}

abi::VerbsDevice* alloc_device(abi::SysfsDev* /*sysfs*/) {
  auto* dev = new (std::nothrow) Device{};
  return dev ? &dev->vdev : nullptr;
}

void uninit_device(abi::VerbsDevice* vdev) { delete reinterpret_cast<Device*>(vdev); }

void free_context(ibv_context* ibctx) {
  Context* ctx = to_context(ibctx);
  // Closing the write end first wakes a thread blocked in ibv_get_async_event.
  if (ctx->state->async_write_fd >= 0) close(ctx->state->async_write_fd);
  delete ctx->state;
  verbs_uninit_context(&ctx->vctx);
  free(ctx);
}

const abi::ContextOps kContextOps = [] {
  abi::ContextOps ops{};
  ops.alloc_pd = alloc_pd;
  ops.create_ah = create_ah;
  ops.create_cq = create_cq;
  ops.create_cq_ex = create_cq_ex;
  ops.create_qp = create_qp;
  ops.create_qp_ex = create_qp_ex;
  ops.create_srq = create_srq;
  ops.dealloc_pd = dealloc_pd;
  ops.dereg_mr = dereg_mr;
  ops.destroy_ah = destroy_ah;
  ops.destroy_cq = destroy_cq;
  ops.destroy_qp = destroy_qp;
  ops.destroy_srq = destroy_srq;
  ops.free_context = free_context;
  ops.modify_qp = modify_qp;
  ops.modify_srq = modify_srq;
  ops.poll_cq = poll_cq;
  ops.post_recv = post_recv;
  ops.post_send = post_send;
  ops.post_srq_recv = post_srq_recv;
  ops.query_device_ex = query_device_ex;
  ops.query_port = query_port;
  ops.query_qp = query_qp;
  ops.query_srq = query_srq;
  ops.reg_mr = reg_mr;
  ops.req_notify_cq = req_notify_cq;
  return ops;
}();

// Failing after _verbs_init_and_alloc_context: undo it and report err through errno.
verbs_context* abandon(Context* ctx, int err) {
  delete ctx->state;
  ctx->state = nullptr;
  verbs_uninit_context(&ctx->vctx);
  free(ctx);
  errno = err;
  return nullptr;
}

// Loads the link record and opens the shared NIC; may throw (strings), the caller catches.
int open_nic(Context* ctx, const ibv_device* ibdev) {
  std::string why;
  const std::string path = config_path(ibdev->ibdev_path);
  auto cfg = nic::LinkConfig::load(path, &why);
  if (!cfg) {
    METAROCE_LOG(&ctx->vctx, abi::kLogErr, "cannot read %s: %s", path.c_str(), why.c_str());
    return ENODEV;
  }
  int err = 0;
  ctx->state->nic = nic::Device::open(*cfg, &err, &why);
  if (!ctx->state->nic) {
    if (!err) err = ENODEV;
    METAROCE_LOG(&ctx->vctx, abi::kLogErr, "cannot open the NIC: %s (%s)", why.c_str(),
                 std::strerror(err));
  }
  return ctx->state->nic ? 0 : err;
}

verbs_context* alloc_context(ibv_device* ibdev, int cmd_fd, void* /*private_data*/) {
  // Expands what rdma-core's verbs_init_and_alloc_context macro would: the library callocs
  // sizeof(Context) and initialises the verbs_context found at the given offset (0 here).
  auto* ctx = static_cast<Context*>(_verbs_init_and_alloc_context(
      ibdev, cmd_fd, sizeof(Context),
      reinterpret_cast<verbs_context*>(offsetof(Context, vctx)), 0 /* RDMA_DRIVER_UNKNOWN */));
  if (!ctx) return nullptr;
  ctx->state = new (std::nothrow) ContextState{};
  if (!ctx->state) return abandon(ctx, ENOMEM);

  int err = 0;
  try {
    err = open_nic(ctx, ibdev);
  } catch (...) {  // nothing may unwind into libibverbs' C frames
    METAROCE_LOG(&ctx->vctx, abi::kLogErr, "cannot open the NIC: out of memory");
    err = ENOMEM;
  }
  if (err) return abandon(ctx, err);

  // libibverbs would ask the kernel for an async fd if we left -1; a pipe stands in for it.
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return abandon(ctx, errno);
  fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  ctx->state->async_write_fd = fds[1];
  ctx->vctx.context.async_fd = fds[0];
  ctx->vctx.context.num_comp_vectors = 1;
  verbs_set_ops(&ctx->vctx, &kContextOps);
  if (!comp_channel_preload_active())
    METAROCE_LOG(&ctx->vctx, abi::kLogInfo,
                 "completion channels need libmetaroce-preload.so (metaroce exec, metaroce env)");
  return &ctx->vctx;
}

// Matching is done by match_device; the table only terminates an empty list.
const abi::MatchEnt kMatchTable[] = {{}};

const abi::DeviceOps kDeviceOps = {
    .name = "metaroce",
    .match_min_abi_version = nic::kUverbsAbi,
    .match_max_abi_version = nic::kUverbsAbi,
    .match_table = kMatchTable,
    .static_providers = nullptr,
    .match_device = match_device,
    .alloc_context = alloc_context,
    .import_context = nullptr,
    .alloc_device = alloc_device,
    .uninit_device = uninit_device,
};

// libibverbs dlopens us and expects the constructor to register the driver (no symbol lookup).
__attribute__((constructor)) void register_driver() { verbs_register_driver_34(&kDeviceOps); }

}  // namespace

bool is_ours(const ibv_context* context) noexcept {
  const auto* vdev = reinterpret_cast<const abi::VerbsDevice*>(context->device);
  return vdev && vdev->ops == &kDeviceOps;
}

void post_async_event(ibv_context* context, uint64_t element, ibv_event_type type) noexcept {
  // struct ib_uverbs_async_event_desc, which ibv_get_async_event reads from async_fd.
  struct {
    uint64_t element;
    uint32_t event_type;
    uint32_t reserved;
  } desc{element, static_cast<uint32_t>(type), 0};
  static_assert(sizeof(desc) == 16);
  ssize_t n = write(to_context(context)->state->async_write_fd, &desc, sizeof(desc));
  (void)n;  // a full pipe drops the event: the application is not reading them
}

int query_device_ex(ibv_context* context, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t attr_size) noexcept {
  if (input && input->comp_mask) return EINVAL;
  if (attr_size < sizeof(ibv_device_attr)) return EINVAL;
  const ibv_device_attr_ex full = device_attr(nic_of(context).config());
  // Callers built against older headers pass a shorter struct: fill only what they have.
  std::memcpy(attr, &full, std::min(attr_size, sizeof(full)));
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) noexcept {
  if (port_num != kPortNum) return EINVAL;
  nic::Device& nic = nic_of(context);
  *attr = port_attr(nic.port_active(), nic.active_mtu());
  return 0;
}

}  // namespace metaroce::provider
