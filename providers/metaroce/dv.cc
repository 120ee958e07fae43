// SPDX-License-Identifier: Apache-2.0
// The direct verbs of <infiniband/metaroce_dv.h>: argument checks as the header and the manual
// pages state them, then one engine request each (docs/spec/verbs-mapping.md §11).
#include <infiniband/metaroce_dv.h>

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "datapath/hostif/control.h"
#include "datapath/wire/mrh.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/qp.h"

namespace metaroce::provider {
namespace {

constexpr uint32_t kKnownFlags = MRDV_QP_ISOLATED | MRDV_QP_NO_RATE_HINTS;
static_assert(uint32_t{MRDV_QP_ISOLATED} == uint32_t{hostif::kQpIsolated});
static_assert(uint32_t{MRDV_QP_NO_RATE_HINTS} == uint32_t{hostif::kQpNoRateHints});
static_assert(MRDV_MAX_PLANES == nic::kMaxPlanes);
static_assert(MRDV_WIRE_VERSION == wire::kMrhVersion);
static_assert(sizeof(mrdv_path_stats) == sizeof(hostif::PathEntry));

// A structure of `inlen` bytes whose first `known` this library understands: shorter is
// refused, and a longer one (from a newer header) only when its tail is zero.
bool ext_ok(const void* p, uint32_t inlen, size_t known) {
  if (inlen < known) return false;
  const auto* b = static_cast<const uint8_t*>(p);
  return std::all_of(b + known, b + inlen, [](uint8_t x) { return x == 0; });
}

uint32_t device_planes_mask(ibv_context* context) {
  const uint16_t planes = state_of(context).engine.planes;
  return planes >= 32 ? UINT32_MAX : (1u << planes) - 1;
}

// num_paths 0 and plane_mask 0 mean "not given" here (checked for range by the callers).
int check_settings(ibv_context* context, bool has_paths, uint16_t paths, bool has_mask,
                   uint32_t mask) {
  if (has_paths && (paths < 1 || paths > wire::kMaxPathCount)) return EINVAL;
  if (has_mask && (mask == 0 || (mask & ~device_planes_mask(context)))) return EINVAL;
  return 0;
}

bool is_rc_ours(ibv_qp* qp) { return qp && is_ours(qp->context) && qp->qp_type == IBV_QPT_RC; }

int set_paths(ibv_qp* ibqp, const hostif::SetQpPathsReq& want) {
  hostif::SetQpPathsReq req = want;
  req.qpn = ibqp->qp_num;
  hostif::Message resp;
  return engine_call(ibqp->context, hostif::Op::kSetQpPaths, req, &resp);
}

}  // namespace
}  // namespace metaroce::provider

using namespace metaroce;
using namespace metaroce::provider;

extern "C" {

__attribute__((visibility("default"))) bool mrdv_is_supported(ibv_device* device) {
  return device && is_ours(device);
}

__attribute__((visibility("default"))) int mrdv_query_device(ibv_context* context,
                                                             mrdv_device_attr* attr,
                                                             uint32_t inlen) {
  if (!context || !attr) return EINVAL;
  if (!is_ours(context)) return EOPNOTSUPP;
  if (inlen < offsetof(mrdv_device_attr, udp_dport) || attr->comp_mask) return EINVAL;
  const ContextState& st = state_of(context);
  hostif::Message resp;
  const int err = engine_call(context, hostif::Op::kQueryDevice, nullptr, 0, {}, &resp);
  if (err) return err;
  auto dev = resp.as<hostif::QueryDeviceResp>();
  if (!dev) return EPROTO;
  mrdv_device_attr a{};
  a.wire_version = dev->wire_version;
  a.sack_bits = wire::kSackBits;
  a.planes = st.engine.planes;
  a.max_planes = MRDV_MAX_PLANES;
  a.default_paths = st.engine.paths;
  a.max_paths = wire::kMaxPathCount;
  a.planes_up = dev->planes_up;
  a.max_streams = dev->max_streams;
  a.device_caps = MRDV_CAP_PLANE_MASK | MRDV_CAP_LIVE_PATHS | MRDV_CAP_ISOLATED_CONN |
                  MRDV_CAP_REPATH | (st.link.rx_capacity_mbps ? MRDV_CAP_RATE_HINTS : 0);
  a.udp_dport = st.link.udp_port;
  a.rx_capacity_mbps = st.link.rx_capacity_mbps;
  std::memset(attr, 0, inlen);
  std::memcpy(attr, &a, std::min<size_t>(inlen, sizeof(a)));
  return 0;
}

__attribute__((visibility("default"))) ibv_qp* mrdv_create_qp(ibv_context* context,
                                                              ibv_qp_init_attr_ex* qp_attr,
                                                              mrdv_qp_init_attr* mr_attr,
                                                              uint32_t inlen) {
  if (!context || !qp_attr || !mr_attr) {
    errno = EINVAL;
    return nullptr;
  }
  if (!is_ours(context) || qp_attr->qp_type != IBV_QPT_RC) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  const uint64_t known = MRDV_QP_INIT_PATHS | MRDV_QP_INIT_PLANE_MASK | MRDV_QP_INIT_FLAGS;
  if (!ext_ok(mr_attr, inlen, sizeof(mrdv_qp_init_attr)) || (mr_attr->comp_mask & ~known)) {
    errno = EINVAL;
    return nullptr;
  }
  hostif::SetQpPathsReq want;
  const bool has_paths = mr_attr->comp_mask & MRDV_QP_INIT_PATHS;
  const bool has_mask = mr_attr->comp_mask & MRDV_QP_INIT_PLANE_MASK;
  if (has_paths) want.num_paths = mr_attr->num_paths;
  if (has_mask) want.plane_mask = mr_attr->plane_mask;
  if (mr_attr->comp_mask & MRDV_QP_INIT_FLAGS) {
    if (mr_attr->flags & ~kKnownFlags) {
      errno = EINVAL;
      return nullptr;
    }
    want.flags = mr_attr->flags;
  }
  if (int e = check_settings(context, has_paths, want.num_paths, has_mask, want.plane_mask)) {
    errno = e;
    return nullptr;
  }
  ibv_qp* qp = create_qp_ex(context, qp_attr);
  if (!qp) return nullptr;
  if (int e = set_paths(qp, want)) {
    destroy_qp(qp);
    errno = e;
    return nullptr;
  }
  to_qp(qp)->dv = want;
  return qp;
}

__attribute__((visibility("default"))) int mrdv_modify_qp(ibv_qp* ibqp, const mrdv_qp_attr* attr,
                                                          uint32_t inlen) {
  if (!ibqp || !attr) return EINVAL;
  if (!is_rc_ours(ibqp)) return EOPNOTSUPP;
  const uint64_t known = MRDV_QP_ATTR_PATHS | MRDV_QP_ATTR_PLANE_MASK;
  if (!ext_ok(attr, inlen, sizeof(mrdv_qp_attr)) || (attr->comp_mask & ~known)) return EINVAL;
  const bool has_paths = attr->comp_mask & MRDV_QP_ATTR_PATHS;
  const bool has_mask = attr->comp_mask & MRDV_QP_ATTR_PLANE_MASK;
  if (int e = check_settings(ibqp->context, has_paths, attr->num_paths, has_mask, attr->plane_mask))
    return e;
  Qp* qp = to_qp(ibqp);
  pthread_mutex_lock(&qp->lock);
  hostif::SetQpPathsReq want = qp->dv;
  if (has_paths) want.num_paths = attr->num_paths;
  if (has_mask) want.plane_mask = attr->plane_mask;
  const int err = set_paths(ibqp, want);
  if (!err) qp->dv = want;
  pthread_mutex_unlock(&qp->lock);
  return err;
}

__attribute__((visibility("default"))) int mrdv_query_qp_conn(ibv_qp* ibqp, mrdv_qp_conn* conn,
                                                              uint32_t inlen) {
  if (!ibqp || !conn) return EINVAL;
  if (!is_rc_ours(ibqp)) return EOPNOTSUPP;
  if (inlen < sizeof(mrdv_qp_conn) || conn->comp_mask) return EINVAL;
  hostif::Message resp;
  const int err = engine_call(ibqp->context, hostif::Op::kQueryQpConn,
                              hostif::IdReq{ibqp->qp_num}, &resp);
  if (err) return err;
  auto r = resp.as<hostif::QpConnResp>();
  if (!r) return EPROTO;
  std::memset(conn, 0, inlen);
  conn->conn_id = r->conn_id;
  conn->lane = r->lane;
  conn->peer_ipv4 = htonl(r->peer_ip);
  conn->num_paths = r->num_paths;
  conn->paths_active = r->paths_active;
  conn->plane_mask = r->plane_mask;
  conn->flags = r->flags;
  conn->streams = r->streams;
  conn->rate_hint_mbps = r->rate_hint_mbps;
  return 0;
}

__attribute__((visibility("default"))) int mrdv_query_paths(ibv_qp* ibqp,
                                                            mrdv_path_stats* entries,
                                                            uint32_t max_entries,
                                                            uint32_t entry_len,
                                                            uint32_t* num_paths) {
  if (!ibqp || !num_paths || (max_entries && !entries) ||
      entry_len < sizeof(mrdv_path_stats))
    return EINVAL;
  if (!is_rc_ours(ibqp)) return EOPNOTSUPP;
  uint32_t first = 0;
  do {
    hostif::Message resp;
    const int err = engine_call(ibqp->context, hostif::Op::kQueryPaths,
                                hostif::QueryPathsReq{ibqp->qp_num, first}, &resp);
    if (err) return err;
    auto page = resp.as<hostif::QueryPathsResp>();
    if (!page || page->count > hostif::kPathsPerPage) return EPROTO;
    *num_paths = page->total;
    for (uint32_t i = 0; i < page->count && first + i < max_entries; ++i) {
      auto* out = reinterpret_cast<uint8_t*>(entries) + size_t{first + i} * entry_len;
      std::memset(out, 0, entry_len);
      std::memcpy(out, &page->entries[i], sizeof(hostif::PathEntry));
    }
    if (page->count == 0) break;
    first += page->count;
  } while (first < max_entries && first < *num_paths);
  return 0;
}

__attribute__((visibility("default"))) int mrdv_repath(ibv_qp* ibqp, uint16_t path_id,
                                                       uint16_t* udp_sport) {
  if (!ibqp) return EINVAL;
  if (!is_rc_ours(ibqp)) return EOPNOTSUPP;
  hostif::Message resp;
  const int err = engine_call(ibqp->context, hostif::Op::kRepath,
                              hostif::RepathReq{ibqp->qp_num, path_id}, &resp);
  if (err) return err;
  auto r = resp.as<hostif::RepathResp>();
  if (!r) return EPROTO;
  if (udp_sport) *udp_sport = static_cast<uint16_t>(r->udp_sport);
  return 0;
}

}  // extern "C"
