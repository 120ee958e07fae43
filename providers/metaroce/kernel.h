// SPDX-License-Identifier: Apache-2.0
// The kernel half of a kernel-backed device (docs/design.md, "The kernel module"): where the
// metaroce_ib module registered the device, every verbs object also exists as a kernel object,
// made through libibverbs' own ibv_cmd_* on the uverbs descriptor, so that completion channels,
// async events, `rdma res` and pinned memory are the kernel's. The engine still moves every
// packet; it learns the kernel's numbers (QPN, keys, object ids) and raises events through the
// module (docs/spec/kernel.md). Each function is 0 or a positive errno.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>

#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider::kernel {

// True when ibdev_path is a device of the metaroce_ib module (its sysfs attribute group).
bool is_kernel_device(const char* ibdev_path) noexcept;

// Who serves the device, as the module said when the context opened.
struct EngineInfo {
  uint32_t pid = 0;     // 0: no engine serves it now
  std::string link;     // the engine's name of the link
  std::string run_dir;  // <run_dir>/engine.sock
};
// GET_CONTEXT on the context's uverbs descriptor (libibverbs asks the kernel for the async
// descriptor afterwards, since the provider leaves it -1).
int open_context(verbs_context* vctx, EngineInfo* out) noexcept;

int query_device(ibv_context* context, const ibv_query_device_ex_input* input,
                 ibv_device_attr_ex* attr, size_t attr_size) noexcept;
int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) noexcept;

int alloc_pd(ibv_context* context, ibv_pd* pd) noexcept;  // sets pd->handle
int dealloc_pd(ibv_pd* pd) noexcept;
// Pins the pages; fills the region's handle, lkey and rkey (the engine takes these keys).
int reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access,
           abi::VerbsMr* mr) noexcept;
int dereg_mr(abi::VerbsMr* mr) noexcept;
// *id: the module's number of the CQ, which the engine raises its events on.
int create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel, int comp_vector,
              ibv_cq* cq, uint32_t* id) noexcept;
int destroy_cq(ibv_cq* cq) noexcept;
// Has the kernel raise the completion event that arming found already due.
int raise_cq_event(ibv_cq* cq) noexcept;
int create_srq(ibv_pd* pd, ibv_srq* srq, ibv_srq_init_attr* attr, uint32_t* id) noexcept;
int destroy_srq(ibv_srq* srq) noexcept;
// Sets qp->handle and qp->qp_num (the kernel's QPN, which the engine then uses).
int create_qp(ibv_pd* pd, ibv_qp* qp, const ibv_qp_init_attr_ex& attr, const ibv_qp_cap& cap) noexcept;
int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) noexcept;
int destroy_qp(ibv_qp* qp) noexcept;

}  // namespace metaroce::provider::kernel
