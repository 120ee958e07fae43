// SPDX-License-Identifier: Apache-2.0
// Queues: completion queues and shared receive queues (serve.h).
#include "datapath/engine/serve.h"

#include <unistd.h>

#include <cerrno>

#include "kernel/metaroce_ib/metaroce_ib_abi.h"

namespace metaroce::engine {

using hostif::Message;

template <class Create>
int Server::new_srq(Session& s, Message& r, uint32_t max_wr, uint32_t max_sge, Create create) {
  const hostif::SrqLayout l = hostif::srq_layout(max_wr, max_sge);
  Segment seg;
  if (const int e = new_ring(s, "metaroce-srq", l.bytes, &seg)) return e;
  hostif::init_srq(seg.base(), max_wr, max_sge);
  hostif::CreateSrqResp c;
  int e = 0;
  on_datapath([&] { e = create(static_cast<hostif::SrqHeader*>(seg.base()), &c.id); });
  if (e) return e;
  c.bytes = l.bytes;
  r.set(c);
  hand_over(s, r, 's', c.id, std::move(seg));
  return 0;
}

int Server::create_cq(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateCqReq>();
  // A kernel context's channel is the kernel's (no descriptor travels); its handle is the
  // kernel CQ's id, which must be its own.
  const size_t fds = s.kernel() ? 0 : (b && b->has_channel ? 1 : 0);
  if (!b || b->cqe < 1 || b->cqe > nic::kMaxCqe || req.fds.size() != fds ||
      (s.kernel() &&
       s.kernel()->check(MRIB_KIND_CQ, static_cast<uint32_t>(b->handle), s.peer_pid()) != 0))
    return EINVAL;
  const hostif::CqLayout l = hostif::cq_layout(b->cqe);
  Segment seg;
  if (const int e = new_ring(s, "metaroce-cq", l.bytes, &seg)) return e;
  hostif::init_cq(seg.base(), b->cqe);
  hostif::CreateCqResp c;
  int e = 0;
  const bool channel = b->has_channel != 0;
  on_datapath([&] {
    e = nic.create_cq(&s, static_cast<hostif::CqHeader*>(seg.base()), b->handle, channel,
                      &c.id);
    if (!e && channel) s.set_channel(c.id, take_fd(req, 0));
  });
  if (e) return e;
  c.bytes = l.bytes;
  r.set(c);
  hand_over(s, r, 'c', c.id, std::move(seg));
  return 0;
}

int Server::resize_cq(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::ResizeCqReq>();
  if (!b || b->cqe < 1 || b->cqe > nic::kMaxCqe) return EINVAL;
  const hostif::CqLayout l = hostif::cq_layout(b->cqe);
  Segment seg;
  if (const int e = new_ring(s, "metaroce-cq", l.bytes, &seg)) return e;
  hostif::init_cq(seg.base(), b->cqe);
  int e = 0;
  auto* ring = static_cast<hostif::CqHeader*>(seg.base());
  on_datapath([&] { e = nic.resize_cq(&s, b->id, ring); });
  if (e) return e;
  hostif::CreateCqResp c;
  c.id = b->id;
  c.bytes = l.bytes;
  r.set(c);
  hand_over(s, r, 'c', b->id, std::move(seg));  // the old ring goes: nothing writes it now
  return 0;
}

int Server::destroy_cq(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] {
    e = nic.destroy_cq(&s, b->id);
    if (!e) s.drop_channel(b->id);
  });
  if (!e) s.drop_segment('c', b->id);
  return e;
}

int Server::create_srq(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateSrqReq>();
  if (!b || b->max_wr < 1 || b->max_wr > nic::kMaxSrqWr || b->max_sge < 1 ||
      b->max_sge > nic::kMaxSge ||
      (s.kernel() &&
       s.kernel()->check(MRIB_KIND_SRQ, static_cast<uint32_t>(b->handle), s.peer_pid()) != 0))
    return EINVAL;
  return new_srq(s, r, b->max_wr, b->max_sge, [&](hostif::SrqHeader* h, uint32_t* id) {
    return nic.create_srq(&s, b->pd, h, b->handle, id);
  });
}

int Server::create_xrc_srq(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateXrcSrqReq>();
  if (!b || b->max_wr < 1 || b->max_wr > nic::kMaxSrqWr || b->max_sge < 1 ||
      b->max_sge > nic::kMaxSge)
    return EINVAL;
  return new_srq(s, r, b->max_wr, b->max_sge, [&](hostif::SrqHeader* h, uint32_t* id) {
    return nic.create_xrc_srq(&s, b->pd, b->xrcd, b->cq, h, b->handle, id);
  });
}

int Server::create_tm_srq(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::CreateTmSrqReq>();
  if (!b || b->max_wr < 1 || b->max_wr > nic::kMaxSrqWr || b->max_sge < 1 ||
      b->max_sge > nic::kMaxSge || b->max_tags < 1 || b->max_tags > hostif::kMaxTmTags)
    return EINVAL;
  return new_srq(s, r, b->max_wr, b->max_sge, [&](hostif::SrqHeader* h, uint32_t* id) {
    return nic.create_tm_srq(&s, b->pd, b->cq, b->max_tags, h, b->handle, id);
  });
}

int Server::srq_tag_op(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::SrqTagOpReq>();
  if (!b) return EINVAL;
  hostif::SrqTagOpResp c;
  int e = 0;
  on_datapath([&] { e = nic.srq_tag_op(&s, *b, &c.handle); });
  if (e) return e;
  r.set(c);
  return 0;
}

int Server::destroy_srq(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.destroy_srq(&s, b->id); });
  if (!e) s.drop_segment('s', b->id);
  return e;
}

}  // namespace metaroce::engine
