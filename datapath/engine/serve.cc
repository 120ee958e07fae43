// SPDX-License-Identifier: Apache-2.0
// A driver context's object requests: the table of handlers (serve.h), the process's limits
// around them, and the answer.
#include "datapath/engine/serve.h"

#include <unistd.h>

#include <cerrno>
#include <utility>

namespace metaroce::engine {

using hostif::Message;
using hostif::Op;

Message reply_to(const Message& req, int status) {
  Message r;
  r.header = req.header;
  r.header.status = status;
  return r;
}

// A descriptor of the request, now the caller's (-1 when absent).
int take_fd(Message& m, size_t i) {
  if (i >= m.fds.size()) return -1;
  const int fd = m.fds[i];
  m.fds[i] = -1;
  return fd;
}

namespace {

// Objects only the engine numbers (XRC domains, their SRQs and QP handles, raw packet QPs' flows,
// RSS): not offered to a kernel context. The module has no such objects, and a number the
// engine chose could be one the kernel hands out next (docs/spec/kernel.md §1).
bool kernel_only_refused(hostif::Op op) {
  switch (op) {
    case hostif::Op::kCreateIndTable:
    case hostif::Op::kCreateRssQp:
    case hostif::Op::kCreateFlow:
    case hostif::Op::kOpenQp:
    case hostif::Op::kOpenXrcd:
    case hostif::Op::kCreateXrcSrq:
      return true;
    default:
      return false;
  }
}

// The object an operation makes (+1) or destroys (-1), for the per-process limits.
std::pair<int, int> counted(Op op) {
  switch (op) {
    case Op::kCreateQp: case Op::kCreateRssQp: return {Session::kQp, 1};
    case Op::kDestroyQp: return {Session::kQp, -1};
    case Op::kCreateCq: return {Session::kCq, 1};
    case Op::kDestroyCq: return {Session::kCq, -1};
    case Op::kCreateSrq: case Op::kCreateXrcSrq: case Op::kCreateTmSrq: return {Session::kSrq, 1};
    case Op::kDestroySrq: return {Session::kSrq, -1};
    case Op::kAllocPd: return {Session::kPd, 1};
    case Op::kDeallocPd: return {Session::kPd, -1};
    case Op::kRegMr: case Op::kAllocMw: return {Session::kMr, 1};
    case Op::kDeregMr: case Op::kDeallocMw: return {Session::kMr, -1};
    default: return {-1, 0};
  }
}

uint32_t limit_of(const nic::Limits& l, int kind) {
  switch (kind) {
    case Session::kQp: return l.qp;
    case Session::kCq: return l.cq;
    case Session::kSrq: return l.srq;
    case Session::kPd: return l.pd;
    default: return l.mr;
  }
}

// A ring memory limit in bytes: mib, or by default the given fraction of the host's memory.
size_t ring_cap(uint32_t mib, unsigned fraction) {
  if (mib) return size_t{mib} << 20;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) / fraction
                               : size_t{1} << 30;
}

}  // namespace

int HostEngine::room(const Session& s, int kind, size_t ring_bytes) const {
  const nic::LinkConfig& cfg = s.link()->nic->config();
  uint64_t held = 0, mine = 0, link = 0;
  for (const auto& [sock, x] : sessions_) {
    if (x->link() != s.link()) continue;
    link += x->ring_bytes();
    if (x->peer_pid() != s.peer_pid()) continue;
    mine += x->ring_bytes();
    if (kind >= 0) held += x->held[static_cast<size_t>(kind)];
  }
  if (kind >= 0 && held >= limit_of(cfg.process_limits, kind)) return ENOMEM;
  if (ring_bytes && (link + ring_bytes > ring_cap(cfg.limits.ring_mib, 4) ||
                     mine + ring_bytes > ring_cap(cfg.process_limits.ring_mib, 8)))
    return ENOMEM;
  return 0;
}

void HostEngine::serve(Session& s, Message& req, Message* resp) {
  Message r = reply_to(req, 0);
  const auto [kind, delta] = counted(req.header.op);
  int status = EOPNOTSUPP;
  const Server::Handler handler = Server::handler_for(req.header.op);
  if (handler && !(s.kernel() && kernel_only_refused(req.header.op))) {
    // Limits (verbs-mapping.md §20): the process's share here, the link's in the NIC.
    status = delta > 0 ? room(s, kind, 0) : 0;
    if (status == 0) {
      Server server(*this);
      status = (server.*handler)(s, req, r);
    }
  }
  r.header.status = status;
  *resp = std::move(r);
  if (status == 0 && delta) {
    uint32_t& n = s.held[static_cast<size_t>(kind)];
    n = delta > 0 ? n + 1 : (n ? n - 1 : 0);
  }
}

Server::Handler Server::handler_for(Op op) {
  switch (op) {
    // Memory.
    case Op::kAllocPd: return &Server::alloc_pd;
    case Op::kDeallocPd: return &Server::dealloc_pd;
    case Op::kRegMr: return &Server::reg_mr;
    case Op::kReregMr: return &Server::rereg_mr;
    case Op::kMapPages: return &Server::map_pages;
    case Op::kCheckMr: return &Server::check_mr;
    case Op::kDeregMr: return &Server::dereg_mr;
    case Op::kAllocMw: return &Server::alloc_mw;
    case Op::kDeallocMw: return &Server::dealloc_mw;
    // Queues.
    case Op::kCreateCq: return &Server::create_cq;
    case Op::kResizeCq: return &Server::resize_cq;
    case Op::kDestroyCq: return &Server::destroy_cq;
    case Op::kCreateSrq: return &Server::create_srq;
    case Op::kCreateXrcSrq: return &Server::create_xrc_srq;
    case Op::kCreateTmSrq: return &Server::create_tm_srq;
    case Op::kSrqTagOp: return &Server::srq_tag_op;
    case Op::kDestroySrq: return &Server::destroy_srq;
    // Queue pairs and what routes to them.
    case Op::kCreateQp: return &Server::create_qp;
    case Op::kModifyQp: return &Server::modify_qp;
    case Op::kDestroyQp: return &Server::destroy_qp;
    case Op::kOpenXrcd: return &Server::open_xrcd;
    case Op::kCloseXrcd: return &Server::close_xrcd;
    case Op::kOpenQp: return &Server::open_qp;
    case Op::kCloseQp: return &Server::close_qp;
    case Op::kCreateIndTable: return &Server::create_ind_table;
    case Op::kDestroyIndTable: return &Server::destroy_ind_table;
    case Op::kCreateRssQp: return &Server::create_rss_qp;
    case Op::kCreateFlow: return &Server::create_flow;
    case Op::kDestroyFlow: return &Server::destroy_flow;
    case Op::kAttachMcast: case Op::kDetachMcast: return &Server::attach_mcast;
    // Paths and the device.
    case Op::kSetQpPaths: return &Server::set_qp_paths;
    case Op::kQueryQpConn: return &Server::query_qp_conn;
    case Op::kQueryPaths: return &Server::query_paths;
    case Op::kRepath: return &Server::repath;
    case Op::kQueryDevice: return &Server::query_device;
    default: return nullptr;
  }
}

int Server::new_ring(const Session& s, const char* name, size_t bytes, Segment* seg) const {
  if (const int e = room(s, -1, bytes)) return e;
  *seg = Segment::create(name, bytes);
  return seg->ok() ? 0 : ENOMEM;
}

void Server::hand_over(Session& s, Message& r, char kind, uint32_t id, Segment seg) {
  r.fds.push_back(dup(seg.share(false)));
  seg.close_fd();
  s.keep_segment(kind, id, std::move(seg));
}

}  // namespace metaroce::engine
