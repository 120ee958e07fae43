// SPDX-License-Identifier: Apache-2.0
// Provider registration, device discovery from the sysfs tree `metaroce link add` writes, the
// context lifecycle and its connection to the host engine, the device-level verbs
// (query_device_ex, query_port), and the flush of every queue when the engine goes away.
#include "providers/metaroce/context.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "providers/metaroce/comp_channel.h"
#include "providers/metaroce/cq.h"
#include "providers/metaroce/flow.h"
#include "providers/metaroce/kernel.h"
#include "providers/metaroce/pd.h"
#include "providers/metaroce/qp.h"
#include "providers/metaroce/srq.h"
#include "providers/metaroce/wq.h"
#include "providers/metaroce/xrcd.h"

namespace metaroce::provider {
namespace {

std::string config_path(const char* ibdev_path) {
  return std::string(ibdev_path) + "/" + nic::kConfigFile;
}

// A link that `metaroce link add` recorded in a sysfs tree (kernel-free).
bool has_record(const char* ibdev_path) {
  char path[abi::kSysfsPathMax + 32];
  int n = snprintf(path, sizeof(path), "%s/%s", ibdev_path, nic::kConfigFile);
  return n > 0 && static_cast<size_t>(n) < sizeof(path) && access(path, R_OK) == 0;
}

// Name-independent: a recorded link, or a device of the metaroce_ib module, whatever its name.
// Which of the two it is decides, at run time, whether the device is kernel-backed.
bool match_device(abi::SysfsDev* sysfs) {
  return has_record(sysfs->ibdev_path) || kernel::is_kernel_device(sysfs->ibdev_path);
}

abi::VerbsDevice* alloc_device(abi::SysfsDev* sysfs) {
  auto* dev = new (std::nothrow) Device{};
  if (!dev) return nullptr;
  dev->kernel = !has_record(sysfs->ibdev_path);
  return &dev->vdev;
}

void uninit_device(abi::VerbsDevice* vdev) { delete reinterpret_cast<Device*>(vdev); }

// Kernel-free contexts, for ibv_import_device to find by descriptor (verbs-mapping.md §21); its
// lock also guards ContextState::refs, first and first_closed.
std::mutex g_contexts_mu;
std::vector<Context*> g_contexts;
// Set by metaroce_import_device around the ibv_open_device it makes: alloc_context then joins
// this state instead of opening a connection of its own.
thread_local ContextState* t_import_into = nullptr;

void close_state(ContextState* st) {
  if (st->watcher.joinable()) {
    const char c = 1;
    [[maybe_unused]] ssize_t n = write(st->watcher_stop[1], &c, 1);
    st->watcher.join();
  }
  for (int fd : {st->watcher_stop[0], st->watcher_stop[1], st->sock, st->doorbell_fd,
                 st->async_write_fd})
    if (fd >= 0) close(fd);
  if (st->status) munmap(const_cast<hostif::StatusPage*>(st->status), st->engine.status_bytes);
  for (Pd* pd : st->released_pds) delete pd;
  delete st;
}

void release_context(Context* ctx) {
  if (ctx->import_async_fd >= 0) close(ctx->import_async_fd);
  verbs_uninit_context(&ctx->vctx);
  free(ctx);
}

// Drops one context's hold on st; the last one closes it, and the first context if its close
// was put off. Returns false when ctx is st's first context and others still hold st: it must
// stay (the engine's events and the watcher name it) until they close.
bool unref_state(ContextState* st, Context* ctx) {
  Context* put_off = nullptr;
  bool last;
  {
    std::lock_guard lock(g_contexts_mu);
    last = --st->refs == 0;
    if (ctx && ctx == st->first && !last) {
      st->first_closed = true;
      return false;
    }
    if (ctx) std::erase(g_contexts, ctx);
    if (last && st->first_closed && st->first != ctx) {
      put_off = st->first;
      std::erase(g_contexts, put_off);
    }
  }
  if (ctx && ctx->import_async_fd >= 0) {
    std::lock_guard lock(st->objects_mu);
    std::erase(st->import_async_fds, ctx->import_async_fd);
  }
  if (last) {
    // Closing the socket tells the engine to reclaim whatever the application left behind;
    // closing the async write end wakes a thread blocked in ibv_get_async_event.
    close_state(st);
    if (put_off) release_context(put_off);
  }
  return true;
}

void free_context(ibv_context* ibctx) {
  Context* ctx = to_context(ibctx);
  if (unref_state(ctx->state, ctx)) release_context(ctx);
}

const abi::ContextOps kContextOps = [] {
  abi::ContextOps ops{};
  ops.advise_mr = advise_mr;
  ops.alloc_mw = alloc_mw;
  ops.alloc_parent_domain = alloc_parent_domain;
  ops.alloc_pd = alloc_pd;
  ops.alloc_td = alloc_td;
  ops.attach_mcast = attach_mcast;
  ops.bind_mw = bind_mw;
  ops.close_xrcd = close_xrcd;
  ops.create_ah = create_ah;
  ops.create_cq = create_cq;
  ops.create_cq_ex = create_cq_ex;
  ops.create_flow = create_flow;
  ops.create_qp = create_qp;
  ops.create_qp_ex = create_qp_ex;
  ops.create_rwq_ind_table = create_rwq_ind_table;
  ops.create_srq = create_srq;
  ops.create_srq_ex = create_srq_ex;
  ops.create_wq = create_wq;
  ops.dealloc_mw = dealloc_mw;
  ops.dealloc_pd = dealloc_pd;
  ops.dealloc_td = dealloc_td;
  ops.dereg_mr = dereg_mr;
  ops.destroy_ah = destroy_ah;
  ops.destroy_cq = destroy_cq;
  ops.destroy_flow = destroy_flow;
  ops.destroy_qp = destroy_qp;
  ops.destroy_rwq_ind_table = destroy_rwq_ind_table;
  ops.destroy_srq = destroy_srq;
  ops.destroy_wq = destroy_wq;
  ops.detach_mcast = detach_mcast;
  ops.free_context = free_context;
  ops.get_srq_num = get_srq_num;
  ops.import_mr = import_mr;
  ops.import_pd = import_pd;
  ops.modify_qp = modify_qp;
  ops.modify_srq = modify_srq;
  ops.modify_wq = modify_wq;
  ops.open_qp = open_qp;
  ops.open_xrcd = open_xrcd;
  ops.poll_cq = poll_cq;
  ops.post_recv = post_recv;
  ops.post_send = post_send;
  ops.post_srq_recv = post_srq_recv;
  ops.post_srq_ops = post_srq_ops;
  ops.query_device_ex = query_device_ex;
  ops.query_ece = query_ece;
  ops.query_port = query_port;
  ops.query_qp = query_qp;
  ops.query_srq = query_srq;
  ops.reg_mr = reg_mr;
  ops.req_notify_cq = req_notify_cq;
  ops.rereg_mr = rereg_mr;
  ops.resize_cq = resize_cq;
  ops.set_ece = set_ece;
  ops.unimport_mr = unimport_mr;
  ops.unimport_pd = unimport_pd;
  return ops;
}();

// Failing after _verbs_init_and_alloc_context: undo it and report err through errno.
verbs_context* abandon(Context* ctx, int err) {
  if (ctx->state) close_state(ctx->state);
  ctx->state = nullptr;
  verbs_uninit_context(&ctx->vctx);
  free(ctx);
  errno = err;
  return nullptr;
}

// The run dir of a link record <run dir>/sys/class/infiniband/<name>/metaroce.conf.
std::string run_dir_of(const nic::LinkConfig& link, const char* ibdev_path) {
  if (!link.run_dir.empty()) return link.run_dir;
  std::string p = ibdev_path;  // <run dir>/sys/class/infiniband/<name>
  for (int i = 0; i < 4 && !p.empty(); ++i) p = p.substr(0, p.rfind('/'));
  return p;
}

// Connects to the engine and says hello; 0 or an errno (logged with the reason).
int connect_engine(Context* ctx, const ibv_device* ibdev) {
  ContextState& st = *ctx->state;
  const std::string sock_path = run_dir_of(st.link, ibdev->ibdev_path) + "/" + hostif::kEngineSocket;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sock_path.size() >= sizeof(addr.sun_path)) return ENAMETOOLONG;
  std::memcpy(addr.sun_path, sock_path.c_str(), sock_path.size() + 1);
  st.sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (st.sock < 0) return errno;
  // Our credentials go with every message, whenever the engine gets to accept us.
  int one = 1;
  setsockopt(st.sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
  if (connect(st.sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int e = errno;
    METAROCE_LOG(&ctx->vctx, abi::kLogErr,
                 "no MetaRoCE engine serves this device (%s: %s; start one with "
                 "`metaroce engine start`)",
                 sock_path.c_str(), std::strerror(e));
    return ENODEV;
  }
  hostif::HelloReq hello;
  if (!hostif::put_name(hello.link, st.link.name)) return ENAMETOOLONG;
  hostif::Message resp;
  int e;
  if (st.kernel) {
    // Events go through the kernel (the module), not through a pipe of ours.
    hello.flags = hostif::kHelloKernel;
    e = engine_call(&ctx->vctx.context, hostif::Op::kHello, hello, &resp);
  } else {
    e = engine_call(&ctx->vctx.context, hostif::Op::kHello, hello, &resp, {st.async_write_fd});
  }
  auto body = resp.as<hostif::HelloResp>();
  if (e || !body || resp.fds.size() != 2) {
    hostif::close_fds(&resp);
    METAROCE_LOG(&ctx->vctx, abi::kLogErr, "the engine refused the device: %s",
                 std::strerror(e ? e : EPROTO));
    return e ? e : EPROTO;
  }
  if (body->datapath >= hostif::kMaxDatapathThreads) {  // names no flag of the status page
    hostif::close_fds(&resp);
    return EPROTO;
  }
  st.engine = *body;
  st.doorbell_fd = resp.fds[0];
  void* status = mmap(nullptr, body->status_bytes, PROT_READ, MAP_SHARED, resp.fds[1], 0);
  close(resp.fds[1]);
  if (status == MAP_FAILED) return errno;
  st.status = static_cast<const hostif::StatusPage*>(status);
  if (st.status->magic != hostif::kStatusMagic) return EPROTO;
  return 0;
}

// The engine is gone (it died, restarted, or removed the link): everything outstanding
// completes as flushed, the application hears IBV_EVENT_DEVICE_FATAL, and nothing waits for an
// engine that will not answer.
void engine_lost(ibv_context* context) {
  ContextState& st = state_of(context);
  if (st.dead.exchange(true)) return;
  {
    std::lock_guard lock(st.objects_mu);
    // What the engine staged and never published first: the work it retires is not owed again.
    std::vector<hostif::Cqe> recovered;
    for (Cq* cq : st.cqs) recover_staged(cq, &recovered);
    for (Qp* qp : st.qps) flush_orphan(qp, recovered);
    for (Srq* srq : st.srqs) flush_orphan(srq, st.qps, recovered);
    for (Cq* cq : st.cqs) notify_orphan(cq);
  }
  // A kernel-backed context hears it from the module, which saw the engine's file close.
  if (!st.kernel) {
    post_async_event(context, reinterpret_cast<uintptr_t>(context), IBV_EVENT_DEVICE_FATAL);
    std::lock_guard lock(st.objects_mu);
    for (int fd : st.import_async_fds) {
      const hostif::AsyncEventDesc desc{0, IBV_EVENT_DEVICE_FATAL, 0};
      [[maybe_unused]] ssize_t n = write(fd, &desc, sizeof(desc));
    }
  }
}

void watch_engine(ibv_context* context) {
  ContextState& st = state_of(context);
  pollfd fds[2] = {{st.sock, POLLRDHUP, 0}, {st.watcher_stop[0], POLLIN, 0}};
  for (;;) {
    const int n = poll(fds, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (fds[1].revents) return;  // the context closes
    if (fds[0].revents & (POLLHUP | POLLRDHUP | POLLERR)) {
      engine_lost(context);
      return;
    }
  }
}

// Starts the thread that notices the engine going away; 0 or an errno.
int start_watcher(ContextState& st, ibv_context* context) {
  if (pipe2(st.watcher_stop, O_CLOEXEC) != 0) return errno;
  try {
    st.watcher = std::thread(watch_engine, context);
  } catch (...) {
    return EAGAIN;
  }
  return 0;
}

// The kernel-backed half of alloc_context: the kernel's context first (its async descriptor
// is the kernel's), then the engine the module names, if one serves the device now.
verbs_context* alloc_kernel_context(Context* ctx, ibv_device* ibdev) {
  ContextState& st = *ctx->state;
  st.kernel = true;
  kernel::EngineInfo info;
  if (int e = kernel::open_context(&ctx->vctx, &info)) return abandon(ctx, e);
  ctx->vctx.context.num_comp_vectors = 1;
  verbs_set_ops(&ctx->vctx, &kContextOps);
  if (info.pid == 0) {
    // The device exists but nothing serves it: it can be queried (its port is DOWN), and
    // everything else answers ENODEV, as with an engine that went away.
    METAROCE_LOG(&ctx->vctx, abi::kLogInfo, "no MetaRoCE engine serves this device now");
    st.dead.store(true);
    return &ctx->vctx;
  }
  try {
    std::string why;
    const std::string path =
        info.run_dir + "/sys/class/infiniband/" + info.link + "/" + nic::kConfigFile;
    auto cfg = nic::LinkConfig::load(path, &why);
    if (!cfg) {
      METAROCE_LOG(&ctx->vctx, abi::kLogErr, "cannot read %s: %s", path.c_str(), why.c_str());
      return abandon(ctx, ENODEV);
    }
    st.link = *cfg;
    st.link.run_dir = info.run_dir;
  } catch (...) {
    return abandon(ctx, ENOMEM);
  }
  if (int e = connect_engine(ctx, ibdev)) return abandon(ctx, e);
  if (int e = start_watcher(st, &ctx->vctx.context)) return abandon(ctx, e);
  return &ctx->vctx;
}

// An imported context (metaroce_import_device): st's connection, objects and engine, and an
// async descriptor of its own that hears IBV_EVENT_DEVICE_FATAL (the objects' events go to the
// first context's, as the kernel sends them to the context's first async file). The caller
// holds a reference on st for it.
verbs_context* alloc_imported_context(Context* ctx, ContextState* st) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    const int e = errno;
    verbs_uninit_context(&ctx->vctx);
    free(ctx);
    errno = e;
    return nullptr;
  }
  fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  try {
    std::scoped_lock lock(g_contexts_mu, st->objects_mu);
    g_contexts.reserve(g_contexts.size() + 1);  // both or neither
    st->import_async_fds.push_back(fds[1]);
    g_contexts.push_back(ctx);
  } catch (...) {
    close(fds[0]);
    close(fds[1]);
    verbs_uninit_context(&ctx->vctx);
    free(ctx);
    errno = ENOMEM;
    return nullptr;
  }
  ctx->state = st;
  ctx->import_async_fd = fds[1];
  ctx->vctx.context.async_fd = fds[0];
  ctx->vctx.context.num_comp_vectors = 1;
  verbs_set_ops(&ctx->vctx, &kContextOps);
  return &ctx->vctx;
}

verbs_context* alloc_context(ibv_device* ibdev, int cmd_fd, void* /*private_data*/) {
  // Expands what rdma-core's verbs_init_and_alloc_context macro would: the library callocs
  // sizeof(Context) and initialises the verbs_context found at the given offset (0 here).
  auto* ctx = static_cast<Context*>(_verbs_init_and_alloc_context(
      ibdev, cmd_fd, sizeof(Context),
      reinterpret_cast<verbs_context*>(offsetof(Context, vctx)), 0 /* RDMA_DRIVER_UNKNOWN */));
  if (!ctx) return nullptr;
  ctx->import_async_fd = -1;
  if (t_import_into) return alloc_imported_context(ctx, t_import_into);
  ctx->state = new (std::nothrow) ContextState{};
  if (!ctx->state) return abandon(ctx, ENOMEM);
  ContextState& st = *ctx->state;
  st.first = ctx;
  // Read once per context, as mlx5 reads its MLX5_* settings (verbs-mapping.md §1).
  const char* copy = std::getenv("METAROCE_COPY_AT_POST");
  st.copy_at_post = !copy || std::strcmp(copy, "0") != 0;
  const char* share = std::getenv("METAROCE_SHARED_MR");
  st.share_mrs = !share || std::strcmp(share, "0") != 0;
  if (reinterpret_cast<Device*>(ibdev)->kernel) return alloc_kernel_context(ctx, ibdev);

  int err = 0;
  try {
    std::string why;
    const std::string path = config_path(ibdev->ibdev_path);
    auto cfg = nic::LinkConfig::load(path, &why);
    if (!cfg) {
      METAROCE_LOG(&ctx->vctx, abi::kLogErr, "cannot read %s: %s", path.c_str(), why.c_str());
      return abandon(ctx, ENODEV);
    }
    st.link = *cfg;
  } catch (...) {  // nothing may unwind into libibverbs' C frames
    return abandon(ctx, ENOMEM);
  }

  // libibverbs would ask the kernel for an async fd if we left -1; a pipe stands in for it. The
  // engine writes events into its write end (the watcher too, when the engine is gone).
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return abandon(ctx, errno);
  fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  st.async_write_fd = fds[1];
  ctx->vctx.context.async_fd = fds[0];
  if ((err = connect_engine(ctx, ibdev)) != 0) {
    close(fds[0]);
    return abandon(ctx, err);
  }
  if (int e = start_watcher(st, &ctx->vctx.context)) {
    close(fds[0]);
    return abandon(ctx, e);
  }
  ctx->vctx.context.num_comp_vectors = 1;
  // What a kernel would report: the optional access range (relaxed ordering) reaches reg_mr,
  // which accepts it (libibverbs strips it otherwise).
  reinterpret_cast<abi::VerbsDevice*>(ibdev)->core_support |=
      IB_UVERBS_CORE_SUPPORT_OPTIONAL_MR_ACCESS;
  verbs_set_ops(&ctx->vctx, &kContextOps);
  if (!comp_channel_preload_active())
    METAROCE_LOG(&ctx->vctx, abi::kLogInfo,
                 "completion channels need libmetaroce-preload.so (metaroce exec, metaroce env)");
  try {
    std::lock_guard lock(g_contexts_mu);
    g_contexts.push_back(ctx);
  } catch (...) {  // not importable; nothing else depends on the registry
  }
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

// ibv_import_device for a descriptor of one of this process's kernel-free contexts (the
// preload's ibv_import_device calls it; libibverbs' own would issue a kernel command on it):
// a new context on the same device that shares the first one's connection to the engine, so
// that the engine sees one context and the handles of its PDs and MRs import. *ours is 0 when
// cmd_fd is no such descriptor (the preload then asks libibverbs).
ibv_context* import_device(int cmd_fd, int* ours) noexcept {
  *ours = 0;
  ContextState* st = nullptr;
  ibv_device* device = nullptr;
  {
    std::lock_guard lock(g_contexts_mu);
    const pid_t self = getpid();
    for (Context* c : g_contexts) {
      // The same open file (a dup of the context's descriptor, or the descriptor itself).
      if (syscall(SYS_kcmp, self, self, KCMP_FILE, c->vctx.context.cmd_fd, cmd_fd) == 0) {
        st = c->state;
        device = c->vctx.context.device;
        ++st->refs;  // for the new context; dropped below if it is not made
        break;
      }
    }
  }
  if (!st) return nullptr;
  *ours = 1;
  if (st->dead.load(std::memory_order_acquire)) {
    unref_state(st, nullptr);
    errno = ENODEV;
    return nullptr;
  }
  t_import_into = st;
  ibv_context* ctx = ibv_open_device(device);
  const int e = errno;
  t_import_into = nullptr;
  if (!ctx) {
    unref_state(st, nullptr);
    errno = e;
  }
  return ctx;
}

// libibverbs dlopens us and expects the constructor to register the driver (no symbol lookup);
// the preload, when loaded, learns where our ibv_import_device is.
__attribute__((constructor)) void register_driver() {
  verbs_register_driver_34(&kDeviceOps);
  using SetImport = void (*)(ibv_context* (*)(int, int*));
  if (auto set = reinterpret_cast<SetImport>(dlsym(RTLD_DEFAULT, "metaroce_preload_set_import")))
    set(import_device);
}

}  // namespace

bool is_ours(const ibv_device* device) noexcept {
  const auto* vdev = reinterpret_cast<const abi::VerbsDevice*>(device);
  return vdev && vdev->ops == &kDeviceOps;
}

bool is_ours(const ibv_context* context) noexcept { return context && is_ours(context->device); }

void post_async_event(ibv_context* context, uint64_t element, ibv_event_type type) noexcept {
  const int fd = to_context(context)->state->async_write_fd;
  if (fd < 0) return;  // kernel-backed: the module raises events
  const hostif::AsyncEventDesc desc{element, static_cast<uint32_t>(type), 0};
  ssize_t n = write(fd, &desc, sizeof(desc));
  (void)n;  // a full pipe drops the event: the application is not reading them
}

int engine_call(ibv_context* context, hostif::Op op, const void* body, size_t len,
                std::initializer_list<int> fds, hostif::Message* resp) noexcept {
  ContextState& st = state_of(context);
  if (st.dead.load(std::memory_order_acquire)) return ENODEV;
  hostif::Message req;
  req.header.op = op;
  try {
    req.body.assign(static_cast<const uint8_t*>(body), static_cast<const uint8_t*>(body) + len);
    req.fds.assign(fds.begin(), fds.end());
  } catch (...) {
    return ENOMEM;
  }
  std::lock_guard lock(st.call_mu);
  req.header.seq = ++st.seq;
  int e = hostif::send_message(st.sock, req);
  if (e) return engine_gone(e) || e == ENOTCONN ? ENODEV : e;
  e = hostif::recv_message(st.sock, resp);
  if (e) return e == ECONNRESET || e == ENOTCONN ? ENODEV : e;
  if (resp->header.seq != req.header.seq || resp->header.op != op) {
    hostif::close_fds(resp);
    return EPROTO;
  }
  return resp->header.status;
}

void* map_segment(int fd, size_t bytes) noexcept {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  // A forked child must not share the rings (it is not this context; verbs forbids it to use
  // the parent's objects).
  madvise(p, bytes, MADV_DONTFORK);
  return p;
}

void track(ibv_context* c, Cq* cq) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  state_of(c).cqs.push_back(cq);
}
void track(ibv_context* c, Qp* qp) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  state_of(c).qps.push_back(qp);
}
void track(ibv_context* c, Srq* srq) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  state_of(c).srqs.push_back(srq);
}
void untrack(ibv_context* c, Cq* cq) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  std::erase(state_of(c).cqs, cq);
}
void untrack(ibv_context* c, Qp* qp) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  std::erase(state_of(c).qps, qp);
}
void untrack(ibv_context* c, Srq* srq) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  std::erase(state_of(c).srqs, srq);
}
void track(ibv_context* c, Pd* pd) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  try {
    state_of(c).pds.push_back(pd);
  } catch (...) {  // the PD works; only ibv_import_pd will not find it
  }
}
void track(ibv_context* c, abi::VerbsMr* mr) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  try {
    state_of(c).mrs.push_back(mr);
  } catch (...) {  // as above
  }
}
void untrack(ibv_context* c, Pd* pd) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  std::erase(state_of(c).pds, pd);
}
void untrack(ibv_context* c, abi::VerbsMr* mr) noexcept {
  std::lock_guard lock(state_of(c).objects_mu);
  std::erase(state_of(c).mrs, mr);
}

int query_device_ex(ibv_context* context, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t attr_size) noexcept {
  if (input && input->comp_mask) return EINVAL;
  if (attr_size < sizeof(ibv_device_attr)) return EINVAL;
  if (state_of(context).kernel) return kernel::query_device(context, input, attr, attr_size);
  const ibv_device_attr_ex full = device_attr(state_of(context).link);
  // Callers built against older headers pass a shorter struct: fill only what they have.
  std::memcpy(attr, &full, std::min(attr_size, sizeof(full)));
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) noexcept {
  if (port_num != kPortNum) return EINVAL;
  const ContextState& st = state_of(context);
  if (st.kernel) return kernel::query_port(context, port_num, attr);
  // ACTIVE while the engine serves the link and the link's port is up (verbs-mapping.md §8);
  // DOWN once the engine is gone.
  bool active = !st.dead.load(std::memory_order_acquire);
  if (active) {
    hostif::Message resp;
    const int err = engine_call(context, hostif::Op::kQueryDevice, nullptr, 0, {}, &resp);
    auto body = resp.as<hostif::QueryDeviceResp>();
    hostif::close_fds(&resp);
    active = !err && body && body->port_active;
  }
  *attr = port_attr(active, st.engine.active_mtu);
  return 0;
}

}  // namespace metaroce::provider
