// SPDX-License-Identifier: Apache-2.0
// The provider's device (one per sysfs link) and context (one per ibv_open_device): the
// connection to the host's engine that serves the link, the device-level verbs, async events,
// and what happens when the engine goes away (IBV_EVENT_DEVICE_FATAL, every queue flushed).
#pragma once

#include <sys/mman.h>

#include <infiniband/verbs.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"
#include "datapath/nic/link_config.h"
#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/local_mrs.h"
#include "providers/metaroce/shared_pages.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Cq;
struct Pd;
struct Qp;
struct Srq;
struct Context;

struct Device {
  abi::VerbsDevice vdev;  // first: libibverbs hands us &vdev.device
  bool kernel;            // registered by the metaroce_ib module (kernel.h), else a sysfs-tree link
};

// What a context owns besides the verbs structure (kept apart so Context stays a C layout).
struct ContextState {
  bool kernel = false;            // a kernel-backed device: its objects are kernel objects too
  nic::LinkConfig link;           // the link record (addresses, GIDs)
  hostif::HelloResp engine;       // what the engine said of the device
  int sock = -1;                  // control connection to the engine (SOCK_SEQPACKET)
  std::mutex call_mu;             // one request at a time on it
  uint32_t seq = 0;
  int doorbell_fd = -1;           // eventfd: wakes a sleeping engine
  const hostif::StatusPage* status = nullptr;  // read-only
  int async_write_fd = -1;        // the pipe whose read end is context.async_fd (kernel-free)
  std::atomic<bool> dead{false};  // the engine went away: queues flushed, nothing reaches it
  std::thread watcher;            // waits for the engine to go away
  int watcher_stop[2] = {-1, -1};
  std::mutex objects_mu;          // the lists below (the watcher flushes them)
  std::vector<Cq*> cqs;
  std::vector<Qp*> qps;
  std::vector<Srq*> srqs;
  // What ibv_import_pd / ibv_import_mr look up by handle (kernel-free; allocated, not imported).
  std::vector<Pd*> pds;
  std::vector<abi::VerbsMr*> mrs;
  LocalMrs local_mrs;             // regions post_send may copy small messages from (any kind)
  bool copy_at_post = true;       // METAROCE_COPY_AT_POST=0: never (qp.cc, copies_at_post)
  bool share_mrs = true;          // METAROCE_SHARED_MR=0: never (pd.cc, share_pages)
  std::mutex shared_mu;           // `shared`
  std::unordered_map<uint32_t, SharedPages::Lease> shared;  // by lkey (pd.cc, share_pages)
  std::vector<Pd*> released_pds;  // ibv_unimport_pd'd; freed with the state
  // ibv_import_device (verbs-mapping.md §21): every context sharing this state, the one that
  // opened it first. The state and that first context live until the last of them closes.
  int refs = 1;                   // under the import registry's lock (context.cc)
  Context* first = nullptr;
  bool first_closed = false;      // ibv_close_device of `first` came while imports lived
  std::vector<int> import_async_fds;  // the imports' own async pipes (IBV_EVENT_DEVICE_FATAL)
};

struct Context {
  verbs_context vctx;  // first: libibverbs allocates and initialises it
  ContextState* state;
  int import_async_fd;  // an imported context's own async pipe (write end); -1 otherwise
};
static_assert(std::is_standard_layout_v<Context>);

inline Context* to_context(ibv_context* c) {
  // ibv_context is the last member of verbs_context, which is the first member of Context.
  return reinterpret_cast<Context*>(reinterpret_cast<char*>(c) - offsetof(verbs_context, context));
}
inline ContextState& state_of(ibv_context* c) { return *to_context(c)->state; }

// True for a context this provider opened.
bool is_ours(const ibv_context* context) noexcept;
bool is_ours(const ibv_device* device) noexcept;

// Registers a PD or MR for import by handle; unregisters it (both kernel-free only).
void track(ibv_context* context, Pd* pd) noexcept;
void track(ibv_context* context, abi::VerbsMr* mr) noexcept;
void untrack(ibv_context* context, Pd* pd) noexcept;
void untrack(ibv_context* context, abi::VerbsMr* mr) noexcept;

// Writes one async event record (struct ib_uverbs_async_event_desc) for ibv_get_async_event.
// Never blocks: if the application does not read its events, later ones are dropped.
void post_async_event(ibv_context* context, uint64_t element, ibv_event_type type) noexcept;

// One request to the engine and its answer: 0 or a positive errno (the engine's, or ENODEV
// when it is gone). fds are sent along; the answer's descriptors are the caller's.
int engine_call(ibv_context* context, hostif::Op op, const void* body, size_t len,
                std::initializer_list<int> fds, hostif::Message* resp) noexcept;
template <typename T>
int engine_call(ibv_context* context, hostif::Op op, const T& body, hostif::Message* resp,
                std::initializer_list<int> fds = {}) noexcept {
  return engine_call(context, op, &body, sizeof(T), fds, resp);
}
// True when err says the engine is gone: a destroy then succeeds (there is nothing left to
// undo in it).
inline bool engine_gone(int err) { return err == ENODEV || err == ECONNRESET || err == EPIPE; }

// After posting: wakes the engine if it sleeps (no system call while it is awake).
inline void ring_doorbell(ContextState& st) noexcept;

// Maps a segment the engine sent (size `bytes`), then closes fd; nullptr on failure.
void* map_segment(int fd, size_t bytes) noexcept;

// Creates an engine object whose rings come back as a segment (CQ, QP, SRQ): sends `create`
// with req (and fds), maps the answer's one descriptor and checks it with `valid`. If the answer
// is not what the protocol promises, the object the engine made is destroyed again (`destroy`,
// naming it by the answer's `id` field). 0 with *out and *seg set, or a positive errno.
template <typename Req, typename Resp>
int create_mapped(ibv_context* context, hostif::Op create, const Req& req,
                  std::initializer_list<int> fds, hostif::Op destroy, uint32_t Resp::*id,
                  bool (*valid)(const void*, size_t), Resp* out, void** seg) noexcept {
  hostif::Message resp;
  int err = engine_call(context, create, req, &resp, fds);
  auto body = resp.template as<Resp>();
  *seg = nullptr;
  if (!err && (!body || resp.fds.size() != 1)) err = EPROTO;
  if (!err) {
    *seg = map_segment(resp.fds[0], body->bytes);
    resp.fds.clear();
    if (!*seg || !valid(*seg, body->bytes)) err = EPROTO;
  }
  hostif::close_fds(&resp);
  if (err) {
    if (*seg) munmap(*seg, body->bytes);
    *seg = nullptr;
    if (body && err == EPROTO) engine_call(context, destroy, hostif::IdReq{(*body).*id}, &resp);
    return err;
  }
  *out = *body;
  return 0;
}

// Registers objects so that a dead engine's queues can be flushed.
void track(ibv_context* context, Cq* cq) noexcept;
void track(ibv_context* context, Qp* qp) noexcept;
void track(ibv_context* context, Srq* srq) noexcept;
void untrack(ibv_context* context, Cq* cq) noexcept;
void untrack(ibv_context* context, Qp* qp) noexcept;
void untrack(ibv_context* context, Srq* srq) noexcept;

// Logs one line through libibverbs' logger (printed when VERBS_LOG_LEVEL >= level).
#define METAROCE_LOG(ctx, level, fmt, ...)                                              \
  __verbs_log((ctx), (level), "metaroce: %s: " fmt "\n", (ctx)->context.device->name \
              __VA_OPT__(, ) __VA_ARGS__)

// Device-level verbs.
int query_device_ex(ibv_context* context, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t attr_size) noexcept;
int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) noexcept;

inline void ring_doorbell(ContextState& st) noexcept {
  // Pairs with the engine's fence between announcing sleep and its last look at the rings.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (st.status->sleeping[st.engine.datapath].peek()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(st.doorbell_fd, &one, sizeof(one));
  }
}

}  // namespace metaroce::provider
