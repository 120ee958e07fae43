// SPDX-License-Identifier: Apache-2.0
// ibv_create_flow / ibv_destroy_flow: the specifications are walked here, the rule lives in the
// engine, which steers the link's frames by it.
#include "providers/metaroce/flow.h"

#include <cerrno>
#include <cstring>
#include <new>

#include "providers/metaroce/context.h"
#include "providers/metaroce/flow_spec.h"

namespace metaroce::provider {

ibv_flow* create_flow(ibv_qp* qp, ibv_flow_attr* attr) noexcept {
  // Steering to UD QPs (multicast) is not offered; raw packet QPs only.
  if (qp->qp_type != IBV_QPT_RAW_PACKET) {
    errno = qp->qp_type == IBV_QPT_UD ? EOPNOTSUPP : EINVAL;
    return nullptr;
  }
  hostif::CreateFlowReq req;
  if (int err = parse_flow(*attr, &req)) {
    errno = err;
    return nullptr;
  }
  req.qpn = qp->qp_num;
  auto* f = new (std::nothrow) Flow{};
  if (!f) {
    errno = ENOMEM;
    return nullptr;
  }
  hostif::Message resp;
  int err = engine_call(qp->context, hostif::Op::kCreateFlow, req, &resp);
  auto body = resp.as<hostif::FlowResp>();
  if (!err && !body) err = EPROTO;
  if (err) {
    delete f;
    errno = err;
    return nullptr;
  }
  f->id = body->flow;
  f->flow.context = qp->context;
  f->flow.handle = f->id;
  return &f->flow;
}

int destroy_flow(ibv_flow* ibf) noexcept {
  Flow* f = reinterpret_cast<Flow*>(ibf);
  hostif::Message resp;
  const int err = engine_call(ibf->context, hostif::Op::kDestroyFlow, hostif::IdReq{f->id}, &resp);
  if (err && !engine_gone(err)) return err;
  delete f;
  return 0;
}

}  // namespace metaroce::provider
