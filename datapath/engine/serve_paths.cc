// SPDX-License-Identifier: Apache-2.0
// A QP's paths (metaroce_dv.h) and the device's state (serve.h).
#include "datapath/engine/serve.h"

#include <cerrno>
#include <memory>

#include "datapath/wire/mrh.h"

namespace metaroce::engine {

using hostif::Message;

int Server::set_qp_paths(Session& s, Message& req, Message& /*r*/) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::SetQpPathsReq>();
  if (!b) return EINVAL;
  int e = 0;
  on_datapath([&] { e = nic.set_qp_paths(&s, *b); });
  return e;
}

int Server::query_qp_conn(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::IdReq>();
  if (!b) return EINVAL;
  hostif::QpConnResp c;
  int e = 0;
  on_datapath([&] { e = nic.query_qp_conn(&s, b->id, &c); });
  if (!e) r.set(c);
  return e;
}

int Server::query_paths(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::QueryPathsReq>();
  if (!b) return EINVAL;
  auto page = std::make_unique<hostif::QueryPathsResp>();
  int e = 0;
  on_datapath([&] { e = nic.query_paths(&s, b->qpn, b->first, page.get()); });
  if (!e) r.set(*page);
  return e;
}

int Server::repath(Session& s, Message& req, Message& r) {
  nic::Nic& nic = *s.link()->nic;
  auto b = req.as<hostif::RepathReq>();
  if (!b) return EINVAL;
  uint16_t port = 0;
  int e = 0;
  on_datapath([&] { e = nic.repath(&s, b->qpn, b->path, &port); });
  if (!e) r.set(hostif::RepathResp{port, 0});
  return e;
}

int Server::query_device(Session& s, Message& req, Message& r) {
  if (!req.body.empty()) return EINVAL;
  hostif::QueryDeviceResp d;
  d.wire_version = wire::kMrhVersion;
  d.max_streams = nic::kMaxQps;
  on_datapath([&] {
    d.planes_up = s.link()->layer->planes_up();
    d.port_active = s.link()->nic->port_active() ? 1 : 0;
  });
  r.set(d);
  return 0;
}

}  // namespace metaroce::engine
