// SPDX-License-Identifier: Apache-2.0
// Queue pairs, XRC domains, RSS tables and flows, multicast (serve.h).
#include "datapath/engine/serve.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>

#include "kernel/metaroce_ib/metaroce_ib_abi.h"

namespace metaroce::engine {

using hostif::Message;
using hostif::Op;

namespace {

// The kernel's number (enum ib_qp_type) of a QP type: a kernel context's QP must be the same.
// 0: a type the module does not offer.
uint32_t kernel_qp_type(hostif::QpType t) {
  switch (t) {
    case hostif::QpType::kRc: return 2;  // IB_QPT_RC
    case hostif::QpType::kUc: return 3;  // IB_QPT_UC
    case hostif::QpType::kUd: return 4;  // IB_QPT_UD
    default: return 0;
  }
}

// Whether process pid may put raw frames on a port (CAP_NET_RAW in its effective set), as the
// kernel asks of raw packet QPs and flow rules.
bool has_net_raw(pid_t pid) {
  constexpr uint64_t kCapNetRaw = uint64_t{1} << 13;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/status", static_cast<int>(pid));
  FILE* f = std::fopen(path, "re");
  if (!f) return false;
  char line[256];
  unsigned long long eff = 0;
  bool found = false;
  while (std::fgets(line, sizeof(line), f))
    if (std::sscanf(line, "CapEff: %llx", &eff) == 1) {
      found = true;
      break;
    }
  std::fclose(f);
  return found && (eff & kCapNetRaw);
}

}  // namespace

int Server::create_qp(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateQpReq>();
  if (!b) return EINVAL;
  if (b->type == hostif::QpType::kRaw && !has_net_raw(s.peer_pid())) return EPERM;
  if (s.kernel()) {
    // The kernel's QP of this process, of the same type; its number names it in events.
    // Raw packet, XRC and WQ queues exist in the engine only (kernel_only_refused).
    const uint32_t want_type = kernel_qp_type(b->type);
    if (want_type == 0) return EOPNOTSUPP;
    uint32_t type = 0;
    if (!b->qpn || s.kernel()->check(MRIB_KIND_QP, b->qpn, s.peer_pid(), &type) != 0 ||
        type != want_type)
      return EINVAL;
    b->handle = b->qpn;
  } else if (b->qpn) {
    return EINVAL;  // QP numbers are the kernel's to choose
  }
  hostif::QpCaps caps = b->caps;
  if (caps.max_send_wr > nic::kMaxQpWr || caps.max_recv_wr > nic::kMaxQpWr ||
      caps.max_send_sge > nic::kMaxSge || caps.max_recv_sge > nic::kMaxSge ||
      caps.max_inline > nic::kMaxInline)
    return EINVAL;
  const bool target = b->type == hostif::QpType::kXrcTgt;
  if (target) caps = hostif::QpCaps{};  // no queues of its own: a ring for its state
  caps.max_send_wr = std::max(caps.max_send_wr, 1u);
  caps.max_recv_wr = std::max(caps.max_recv_wr, 1u);
  const hostif::QpLayout l = hostif::qp_layout(caps);
  Segment seg;
  if (const int e = new_ring(s, "metaroce-qp", l.bytes, &seg)) return e;
  hostif::init_qp(seg.base(), 0, b->type, caps);
  hostif::CreateQpResp c;
  int e = 0;
  auto* ring = static_cast<hostif::QpHeader*>(seg.base());
  if (target) {
    // An XRC target outlives this context while others hold it (verbs-mapping.md §17):
    // the QP keeps its segment, and the descriptor to hand to whoever opens it.
    if (seg.share(false) < 0) return ENOMEM;
    auto shared = std::make_shared<Segment>(std::move(seg));
    const int fd = dup(shared->fd());
    if (fd < 0) return EMFILE;
    on_datapath([&] { e = nic.create_qp(&s, *b, ring, &c.qpn, shared); });
    if (e) {
      close(fd);
      return e;
    }
    c.bytes = l.bytes;
    r.set(c);
    r.fds.push_back(fd);
    return 0;
  }
  on_datapath([&] { e = nic.create_qp(&s, *b, ring, &c.qpn); });
  if (e) return e;
  c.bytes = l.bytes;
  r.set(c);
  hand_over(s, r, 'q', c.qpn, std::move(seg));
  return 0;
}

int Server::modify_qp(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::ModifyQpReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.modify_qp(&s, *b); });
  return e;
}

int Server::destroy_qp(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.destroy_qp(&s, b->id); });
  if (!e) s.drop_segment('q', b->id);
  return e;
}

int Server::open_xrcd(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::OpenXrcdReq>();
  if (!b || (b->has_fd != 0) != (req.fds.size() == 1) || req.fds.size() > 1)
    return EINVAL;
  nic::Nic::XrcdKey key;
  if (b->has_fd) {
    // The file names the domain by its inode, as the kernel's XRC domains are named.
    struct stat st {};
    if (fstat(req.fds[0], &st) != 0) return EBADF;
    key.dev = st.st_dev;
    key.ino = st.st_ino;
  }
  hostif::XrcdResp x;
  int e = 0;
  on_datapath([&] {
    e = nic.open_xrcd(&s, b->has_fd ? &key : nullptr, b->oflags & O_CREAT,
                      b->oflags & O_EXCL, &x.xrcd);
  });
  if (!e) r.set(x);
  return e;
}

int Server::close_xrcd(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.close_xrcd(&s, b->id); });
  return e;
}

int Server::open_qp(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::OpenQpReq>();
  if (!b) return EINVAL;
  std::shared_ptr<void> keep;
  int e = 0;
  on_datapath([&] { e = nic.open_qp(&s, b->xrcd, b->qpn, b->handle, &keep); });
  if (e) return e;
  const auto seg = std::static_pointer_cast<Segment>(keep);  // what kCreateQp gave it
  const int fd = seg ? dup(seg->fd()) : -1;
  if (fd < 0) {
    on_datapath([&] { nic.close_qp(&s, b->qpn, b->handle); });
    return seg ? EMFILE : EPROTO;
  }
  hostif::CreateQpResp c;
  c.qpn = b->qpn;
  c.bytes = static_cast<uint32_t>(seg->size());
  r.set(c);
  r.fds.push_back(fd);
  return 0;
}

int Server::close_qp(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::OpenQpReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.close_qp(&s, b->qpn, b->handle); });
  return e;
}

int Server::create_ind_table(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IndTableReq>();
  if (!b) return EINVAL;
  hostif::IndTableResp t;
  int e = 0;
  on_datapath([&] { e = nic.create_ind_table(&s, *b, &t.table); });
  if (!e) r.set(t);
  return e;
}

int Server::destroy_ind_table(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.destroy_ind_table(&s, b->id); });
  return e;
}

int Server::create_rss_qp(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateRssQpReq>();
  if (!b) return EINVAL;
  if (!has_net_raw(s.peer_pid())) return EPERM;
  // No queues of its own (its table's WQs receive): a ring for its state.
  const hostif::QpCaps caps;
  const hostif::QpLayout l = hostif::qp_layout(caps);
  Segment seg;
  if (const int e = new_ring(s, "metaroce-qp", l.bytes, &seg)) return e;
  hostif::init_qp(seg.base(), 0, hostif::QpType::kRss, caps);
  hostif::CreateQpResp c;
  int e = 0;
  on_datapath([&] {
    e = nic.create_rss_qp(&s, *b, static_cast<hostif::QpHeader*>(seg.base()), &c.qpn);
  });
  if (e) return e;
  c.bytes = l.bytes;
  r.set(c);
  hand_over(s, r, 'q', c.qpn, std::move(seg));
  return 0;
}

int Server::create_flow(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateFlowReq>();
  if (!b) return EINVAL;
  if (!has_net_raw(s.peer_pid())) return EPERM;
  hostif::FlowResp f;
  int e = 0;
  on_datapath([&] { e = nic.create_flow(&s, *b, &f.flow); });
  if (!e) r.set(f);
  return e;
}

int Server::destroy_flow(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.destroy_flow(&s, b->id); });
  return e;
}

int Server::attach_mcast(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::McastReq>();
  if (!b) return EINVAL;
  // A kernel context's QPs are the module's, which has no multicast (max_mcast_grp 0).
  if (s.kernel()) return EOPNOTSUPP;
  const bool attach = req.header.op == Op::kAttachMcast;
  int e = 0;
  on_datapath([&] {
    e = attach ? nic.attach_mcast(&s, b->qpn, b->group) : nic.detach_mcast(&s, b->qpn, b->group);
  });
  return e;
}

}  // namespace metaroce::engine
