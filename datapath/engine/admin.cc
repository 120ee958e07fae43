// SPDX-License-Identifier: Apache-2.0
// An administrator's requests to the engine (`metaroce link open|close|plane`, `engine status`
// and `stop`, `stat`, `capture`): only root or the engine's own user may make them.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "datapath/engine/host_engine.h"
#include "datapath/engine/serve.h"

namespace metaroce::engine {

using hostif::Message;
using hostif::Op;

void HostEngine::admin(Session& s, const Message& req, Message* resp) {
  if (s.uid() != 0 && s.uid() != geteuid()) {
    *resp = reply_to(req, EPERM);
    return;
  }
  Message r = reply_to(req, 0);
  int status = 0;
  switch (req.header.op) {
    case Op::kLinkOpen:
    case Op::kLinkClose: status = admin_link(req, r); break;
    case Op::kShutdown:
      request_stop("shutdown requested by pid " + std::to_string(s.peer_pid()));
      break;
    case Op::kEngineInfo: status = engine_info(r); break;
    case Op::kLinkPlane: status = link_plane(req); break;
    case Op::kLinkCapture: status = link_capture(req, r); break;
    case Op::kSessionInfo: status = session_info(req, r); break;
    default: status = EOPNOTSUPP;
  }
  r.header.status = status;
  *resp = std::move(r);
}

int HostEngine::admin_link(const Message& req, Message& r) {
  auto body = req.as<hostif::LinkReq>();
  if (!body) return EINVAL;
  const std::string name = hostif::get_name(body->link);
  std::string why;
  const int e = req.header.op == Op::kLinkOpen ? open_link(name, &why) : close_link(name, true);
  if (e && !why.empty()) {
    hostif::TextResp t;
    std::snprintf(t.text, sizeof(t.text), "%s", why.c_str());
    r.set(t);
  }
  return e;
}

int HostEngine::engine_info(Message& r) {
  hostif::EngineInfoResp info;
  info.pid = static_cast<uint32_t>(getpid());
  info.links = static_cast<uint32_t>(links_.size());
  uint32_t contexts = 0;
  for (auto& [sock, x] : sessions_) contexts += x->link() != nullptr;
  info.sessions = contexts;
  info.cm_ids = static_cast<uint32_t>(cm_.id_count());
  on_datapath([&] {
    int fds[kMaxWaitFds];
    for (auto& dp : dps_)
      for (Link* l : dp->links) info.links_port_wake += l->layer->rx_wait_fds(fds, kMaxWaitFds) > 0;
  });
  info.datapath_threads = static_cast<uint32_t>(dps_.size());
  info.naps = naps_.load(std::memory_order_relaxed);
  info.naps_frame = naps_frame_.load(std::memory_order_relaxed);
  info.naps_doorbell = naps_doorbell_.load(std::memory_order_relaxed);
  info.datapath_nice = datapath_nice_.load(std::memory_order_relaxed);
  r.set(info);
  return 0;
}

int HostEngine::link_plane(const Message& req) {
  auto body = req.as<hostif::LinkPlaneReq>();
  if (!body) return EINVAL;
  auto it = links_.find(hostif::get_name(body->link));
  if (it == links_.end()) return ENODEV;
  bool ok = false;
  Link* l = it->second.get();
  on_datapath([&] { ok = l->layer->set_plane_admin(body->plane, body->up != 0); });
  return ok ? 0 : ERANGE;
}

int HostEngine::link_capture(const Message& req, Message& r) {
  auto body = req.as<hostif::CaptureReq>();
  if (!body || body->action > hostif::kCaptureQuery ||
      (body->action == hostif::kCaptureStart) != (req.fds.size() == 1))
    return EINVAL;
  auto it = links_.find(hostif::get_name(body->link));
  if (it == links_.end()) return ENODEV;
  nic::LinkLayer& layer = *it->second->layer;
  hostif::CaptureResp out;
  std::unique_ptr<nic::Capture> old;
  int status = 0;
  if (body->action == hostif::kCaptureStart) {
    const int fd = fcntl(req.fds[0], F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return errno;
    auto cap = std::make_unique<nic::Capture>(fd, body->snaplen, body->max_frames, body->planes);
    bool busy = false;
    on_datapath([&] {
      busy = layer.capture() != nullptr;
      if (!busy) layer.set_capture(std::move(cap));
    });
    if (busy) status = EBUSY;  // one capture per link at a time
  } else {
    on_datapath([&] {
      if (const nic::Capture* c = layer.capture()) {
        out.frames = c->stats().frames;
        out.done = c->stats().done;
        if (body->action == hostif::kCaptureStop) old = layer.set_capture(nullptr);
      }
    });
  }
  r.set(out);
  return status;  // `old`, flushed, closes its file here, off the datapath thread
}

int HostEngine::session_info(const Message& req, Message& r) {
  auto body = req.as<hostif::SessionInfoReq>();
  if (!body) return EINVAL;
  // Contexts only (administrators' connections are not devices), oldest socket first.
  std::vector<Session*> list;
  for (auto& [sock, x] : sessions_)
    if (x->link()) list.push_back(x.get());
  std::sort(list.begin(), list.end(), [](Session* a, Session* b) { return a->sock() < b->sock(); });
  if (body->index >= list.size()) return ENOENT;
  Session& x = *list[body->index];
  hostif::SessionInfoResp info;
  info.pid = static_cast<uint32_t>(x.peer_pid());
  // What the NIC holds for it, not a tally of requests: reclamation shows here.
  nic::Nic::ObjectCounts n;
  on_datapath([&] { n = x.link()->nic->owned_by(&x); });
  info.pds = n.pds;
  info.mrs = n.mrs;
  info.cqs = n.cqs;
  info.srqs = n.srqs;
  info.qps = n.qps;
  on_datapath([&] {
    const MappedMemory::Stats m = x.mapped()->stats();
    info.mrs_shared = m.shared_regions;
    info.shared_bytes = m.shared_bytes;
    info.direct_accesses = m.direct;
    info.fallback_accesses = m.fallback;
    info.memory_syscalls = x.process_memory().calls();
  });
  hostif::put_name(info.link, x.link()->cfg.name);
  r.set(info);
  return 0;
}

}  // namespace metaroce::engine
