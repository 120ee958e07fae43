// SPDX-License-Identifier: Apache-2.0
// Memory: protection domains, memory regions and windows (serve.h).
#include "datapath/engine/serve.h"

#include <algorithm>
#include <cerrno>
#include <memory>

namespace metaroce::engine {

using hostif::Message;

int Server::alloc_pd(Session& s, Message& /*req*/, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  hostif::PdResp p;
  int e = 0;
  on_datapath([&] { e = nic.alloc_pd(&s, &p.pd); });
  if (!e) r.set(p);
  return e;
}

int Server::dealloc_pd(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.dealloc_pd(&s, b->id); });
  return e;
}

int Server::reg_mr(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::RegMrReq>();
  if (!b) return EINVAL;
  if (b->access & ~nic::kMrAccessKnown) return EINVAL;
  hostif::RegMrResp m;
  int e = 0;
  if (s.kernel()) {
    e = reg_kernel_mr(s, *b, &m);
  } else if (b->key) {
    e = EINVAL;  // keys are the kernel's to choose
  } else {
    on_datapath([&] {
      e = nic.reg_mr(&s, b->pd, b->addr, b->length, b->iova, b->access, &m.lkey, &m.rkey);
    });
  }
  if (!e) r.set(m);
  return e;
}

int Server::rereg_mr(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::ReregMrReq>();
  if (!b) return EINVAL;
  // A kernel context's region is the module's pinned pages: the module has no rereg.
  if (s.kernel()) return EOPNOTSUPP;
  int e = 0;
  on_datapath([&] {
    e = nic.rereg_mr(&s, b->lkey, b->flags, b->pd, b->addr, b->length, b->access);
    // Its shared pages were the old translation's (the provider shares the new one's).
    if (!e && (b->flags & nic::kReregTranslation)) s.mapped()->remove(b->lkey);
  });
  return e;
}

int Server::map_pages(Session& s, Message& req, Message& /*r*/) {
  auto b = req.as<hostif::MapPagesReq>();
  if (!b || s.kernel() || req.fds.size() != 1 || b->count == 0 ||
      b->count > hostif::kMaxMapPieces)
    return EINVAL;
  return map_pieces(s, *b, req.fds[0]);
}

int Server::check_mr(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CheckMrReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.check_mr(&s, b->lkey, b->pd, b->addr, b->length); });
  return e;
}

int Server::dereg_mr(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  std::unique_ptr<RegionMapping> unmap;  // a kernel context's pages, unmapped off the datapath
  on_datapath([&] {
    e = nic.dereg_mr(&s, b->id);
    if (!e && s.mapped()) unmap = s.mapped()->remove(b->id);
  });
  return e;
}

int Server::alloc_mw(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::AllocMwReq>();
  if (!b || (b->type != 1 && b->type != 2)) return EINVAL;
  // Keys of a kernel context are the module's, which offers no windows (max_mw 0).
  if (s.kernel()) return EOPNOTSUPP;
  hostif::AllocMwResp m;
  int e = 0;
  on_datapath([&] { e = nic.alloc_mw(&s, b->pd, static_cast<uint8_t>(b->type), &m.rkey); });
  if (!e) r.set(m);
  return e;
}

int Server::dealloc_mw(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.dealloc_mw(&s, b->id); });
  return e;
}

int Server::map_pieces(Session& s, const hostif::MapPagesReq& b, int fd) {
  uint64_t need = 0;
  for (uint32_t i = 0; i < b.count; ++i) {
    const hostif::SharedPiece& p = b.pieces[i];
    if (p.len == 0 || (p.va | p.off | p.len) % 4096 || p.va + p.len < p.va ||
        p.off + p.len < p.off)
      return EINVAL;
    need = std::max(need, p.off + p.len);
  }
  nic::Nic& nic = *s.link()->nic;
  int e = 0;
  on_datapath([&] {
    // Each piece must lie in the region, which must be the context's, in that PD.
    for (uint32_t i = 0; i < b.count && !e; ++i)
      e = nic.check_mr(&s, b.lkey, b.pd, b.pieces[i].va, b.pieces[i].len);
    if (!e) e = s.mapped()->map_shared(fd, need);
    for (uint32_t i = 0; i < b.count && !e; ++i) s.mapped()->add_piece(b.lkey, b.pieces[i]);
  });
  return e;
}

int Server::reg_kernel_mr(Session& s, const hostif::RegMrReq& b, hostif::RegMrResp* m) {
  if (b.key == 0) return EINVAL;
  RegionInfo info;
  auto map = s.kernel()->map_region(b.key, s.peer_pid(), &info);
  // Not a region of this process (ENOENT, EPERM) is the same answer as a bad key.
  if (!map) return errno == ENOENT || errno == EPERM ? EINVAL : errno;
  // The module registers the owner's addresses as they are (no IOVA of its own, no on-demand
  // paging): the request must say the same.
  if (b.iova != b.addr || info.iova != b.addr || info.length != b.length ||
      (info.access & nic::kMrAccessKnown) != b.access)
    return EINVAL;
  nic::Nic& nic = *s.link()->nic;
  int e = 0;
  on_datapath([&] {
    e = nic.reg_mr(&s, b.pd, b.addr, b.length, b.addr, b.access, &m->lkey, &m->rkey, b.key);
    if (!e) s.mapped()->add(b.key, info.iova, info.length, info.writable, std::move(map));
  });
  return e;  // a region the NIC refused is unmapped here
}

}  // namespace metaroce::engine
