// SPDX-License-Identifier: Apache-2.0
// ibv_open_xrcd and ibv_close_xrcd: the file travels to the engine, which names the domain by its
// inode; the answers are the kernel's (ibv_open_xrcd(3)).
#include "providers/metaroce/xrcd.h"

#include <cerrno>
#include <new>

#include "providers/metaroce/context.h"

namespace metaroce::provider {

ibv_xrcd* open_xrcd(ibv_context* context, ibv_xrcd_init_attr* attr) noexcept {
  constexpr uint32_t kKnown = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
  if (!attr || (attr->comp_mask & ~kKnown)) {
    errno = attr ? EOPNOTSUPP : EINVAL;
    return nullptr;
  }
  if ((attr->comp_mask & kKnown) != kKnown) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->fd < -1) {
    errno = EBADF;
    return nullptr;
  }
  auto* x = new (std::nothrow) Xrcd{};
  if (!x) {
    errno = ENOMEM;
    return nullptr;
  }
  hostif::OpenXrcdReq req;
  req.oflags = static_cast<uint32_t>(attr->oflags);
  req.has_fd = attr->fd >= 0;
  hostif::Message resp;
  // A descriptor that is not open cannot travel: EBADF, as the kernel answers.
  int err = attr->fd >= 0 ? engine_call(context, hostif::Op::kOpenXrcd, req, &resp, {attr->fd})
                          : engine_call(context, hostif::Op::kOpenXrcd, req, &resp);
  auto body = resp.as<hostif::XrcdResp>();
  hostif::close_fds(&resp);
  if (!err && !body) err = EPROTO;
  if (err) {
    delete x;
    errno = err;
    return nullptr;
  }
  x->id = body->xrcd;
  x->vxrcd.xrcd.context = context;
  x->vxrcd.comp_mask = abi::kVerbsXrcdHandle;
  x->vxrcd.handle = x->id;
  return &x->vxrcd.xrcd;
}

int close_xrcd(ibv_xrcd* ibx) noexcept {
  Xrcd* x = to_xrcd(ibx);
  // ibv_close_xrcd(3): not while an SRQ or QP made with this handle lives.
  if (x->users.load(std::memory_order_acquire) != 0) return EBUSY;
  hostif::Message resp;
  const int err = engine_call(ibx->context, hostif::Op::kCloseXrcd, hostif::IdReq{x->id}, &resp);
  if (err && !engine_gone(err)) return err;
  delete x;
  return 0;
}

}  // namespace metaroce::provider
