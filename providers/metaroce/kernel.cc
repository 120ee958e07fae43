// SPDX-License-Identifier: Apache-2.0
// Kernel objects of a kernel-backed device through libibverbs' command library (ibv_cmd_*,
// IBVERBS_PRIVATE_34). Its command and response buffers are the uverbs write ABI (a header, the
// core structure of <rdma/ib_user_verbs.h>, then driver data): libibverbs fills the core part,
// the module's driver data follow (kernel/metaroce_ib/metaroce_ib_abi.h).
#include "providers/metaroce/kernel.h"

#include <rdma/ib_user_verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "kernel/metaroce_ib/metaroce_ib_abi.h"
#include "datapath/nic/link_config.h"

#ifndef METAROCE_VERSION
#define METAROCE_VERSION "0.0.0"
#endif

namespace metaroce::provider::kernel {
namespace {

// A command of the write ABI (header and core structure); only libibverbs fills it.
template <size_t Core>
struct alignas(8) Cmd {
  uint8_t bytes[Core] = {};
  static constexpr size_t size() { return Core; }
};
// A response: the core structure libibverbs reads, then the module's driver data.
template <size_t Core, typename Driver>
struct alignas(8) Resp {
  uint8_t core[Core] = {};
  Driver driver{};
  static constexpr size_t size() { return Core + sizeof(Driver); }
};
struct NoDriver {};
template <size_t Core>
struct alignas(8) Resp<Core, NoDriver> {
  uint8_t core[Core] = {};
  static constexpr size_t size() { return Core; }
};

constexpr size_t kHdr = sizeof(ib_uverbs_cmd_hdr);
template <typename Core>
constexpr size_t cmd_size = kHdr + sizeof(Core);

}  // namespace
}  // namespace metaroce::provider::kernel

// libibverbs' command library (IBVERBS_PRIVATE_34). The buffers are typed void* here: their
// layout is the uverbs ABI, which the Cmd and Resp sizes above follow.
extern "C" {
int ibv_cmd_get_context(verbs_context* context, void* cmd, size_t cmd_size, void* resp,
                        size_t resp_size);
int ibv_cmd_query_device_any(ibv_context* context, const ibv_query_device_ex_input* input,
                             ibv_device_attr_ex* attr, size_t attr_size, void* resp,
                             size_t* resp_size);
int ibv_cmd_query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* port_attr,
                       void* cmd, size_t cmd_size);
int ibv_cmd_alloc_pd(ibv_context* context, ibv_pd* pd, void* cmd, size_t cmd_size, void* resp,
                     size_t resp_size);
int ibv_cmd_dealloc_pd(ibv_pd* pd);
int ibv_cmd_reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access,
                   metaroce::provider::abi::VerbsMr* vmr, void* cmd, size_t cmd_size, void* resp,
                   size_t resp_size);
int ibv_cmd_dereg_mr(metaroce::provider::abi::VerbsMr* vmr);
int ibv_cmd_create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel, int comp_vector,
                      ibv_cq* cq, void* cmd, size_t cmd_size, void* resp, size_t resp_size);
int ibv_cmd_req_notify_cq(ibv_cq* cq, int solicited_only);
int ibv_cmd_destroy_cq(ibv_cq* cq);
int ibv_cmd_create_srq(ibv_pd* pd, ibv_srq* srq, ibv_srq_init_attr* attr, void* cmd,
                       size_t cmd_size, void* resp, size_t resp_size);
int ibv_cmd_destroy_srq(ibv_srq* srq);
int ibv_cmd_create_qp(ibv_pd* pd, ibv_qp* qp, ibv_qp_init_attr* attr, void* cmd, size_t cmd_size,
                      void* resp, size_t resp_size);
int ibv_cmd_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, void* cmd, size_t cmd_size);
int ibv_cmd_destroy_qp(ibv_qp* qp);
}

namespace metaroce::provider::kernel {

static_assert(MRIB_UVERBS_ABI == nic::kUverbsAbi,
              "the provider matches kernel and kernel-free devices by one ABI version");

bool is_kernel_device(const char* ibdev_path) noexcept {
  char path[abi::kSysfsPathMax + 32];
  const int n = snprintf(path, sizeof(path), "%s/" MRIB_SYSFS_GROUP "/run_dir", ibdev_path);
  return n > 0 && static_cast<size_t>(n) < sizeof(path) && access(path, R_OK) == 0;
}

int open_context(verbs_context* vctx, EngineInfo* out) noexcept {
  Cmd<cmd_size<ib_uverbs_get_context>> cmd;
  Resp<sizeof(ib_uverbs_get_context_resp), mrib_alloc_ucontext_resp> resp;
  if (int e = ibv_cmd_get_context(vctx, &cmd, cmd.size(), &resp, resp.size())) return e;
  const mrib_alloc_ucontext_resp& d = resp.driver;
  if (d.abi != MRIB_UVERBS_ABI) return EPROTONOSUPPORT;
  out->pid = d.engine_pid;
  out->link.assign(d.link, strnlen(d.link, sizeof(d.link)));
  out->run_dir.assign(d.run_dir, strnlen(d.run_dir, sizeof(d.run_dir)));
  return 0;
}

int query_device(ibv_context* context, const ibv_query_device_ex_input* input,
                 ibv_device_attr_ex* attr, size_t attr_size) noexcept {
  ib_uverbs_ex_query_device_resp resp;
  size_t resp_size = sizeof(resp);
  if (int e = ibv_cmd_query_device_any(context, input, attr, attr_size, &resp, &resp_size))
    return e;
  // The kernel reports firmware as a number; the device's is the project's version string.
  std::strncpy(attr->orig_attr.fw_ver, METAROCE_VERSION, sizeof(attr->orig_attr.fw_ver) - 1);
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) noexcept {
  Cmd<cmd_size<ib_uverbs_query_port>> cmd;
  return ibv_cmd_query_port(context, port_num, attr, &cmd, cmd.size());
}

int alloc_pd(ibv_context* context, ibv_pd* pd) noexcept {
  Cmd<cmd_size<ib_uverbs_alloc_pd>> cmd;
  Resp<sizeof(ib_uverbs_alloc_pd_resp), NoDriver> resp;
  return ibv_cmd_alloc_pd(context, pd, &cmd, cmd.size(), &resp, resp.size());
}

int dealloc_pd(ibv_pd* pd) noexcept { return ibv_cmd_dealloc_pd(pd); }

int reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access,
           abi::VerbsMr* mr) noexcept {
  Cmd<cmd_size<ib_uverbs_reg_mr>> cmd;
  Resp<sizeof(ib_uverbs_reg_mr_resp), NoDriver> resp;
  return ibv_cmd_reg_mr(pd, addr, length, hca_va, access, mr, &cmd,
                        cmd.size(), &resp, resp.size());
}

int dereg_mr(abi::VerbsMr* mr) noexcept { return ibv_cmd_dereg_mr(mr); }

int create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel, int comp_vector,
              ibv_cq* cq, uint32_t* id) noexcept {
  Cmd<cmd_size<ib_uverbs_create_cq>> cmd;
  Resp<sizeof(ib_uverbs_create_cq_resp), mrib_create_cq_resp> resp;
  if (int e = ibv_cmd_create_cq(context, cqe, channel, comp_vector, cq, &cmd, cmd.size(), &resp,
                                resp.size()))
    return e;
  *id = resp.driver.cq_id;
  return 0;
}

int destroy_cq(ibv_cq* cq) noexcept { return ibv_cmd_destroy_cq(cq); }

int raise_cq_event(ibv_cq* cq) noexcept { return ibv_cmd_req_notify_cq(cq, 0); }

int create_srq(ibv_pd* pd, ibv_srq* srq, ibv_srq_init_attr* attr, uint32_t* id) noexcept {
  Cmd<cmd_size<ib_uverbs_create_srq>> cmd;
  Resp<sizeof(ib_uverbs_create_srq_resp), mrib_create_srq_resp> resp;
  ibv_srq_init_attr a = *attr;  // the kernel's answer must not change what the caller sees
  if (int e = ibv_cmd_create_srq(pd, srq, &a, &cmd, cmd.size(), &resp, resp.size())) return e;
  *id = resp.driver.srq_id;
  return 0;
}

int destroy_srq(ibv_srq* srq) noexcept { return ibv_cmd_destroy_srq(srq); }

int create_qp(ibv_pd* pd, ibv_qp* qp, const ibv_qp_init_attr_ex& attr, const ibv_qp_cap& cap) noexcept {
  Cmd<cmd_size<ib_uverbs_create_qp>> cmd;
  Resp<sizeof(ib_uverbs_create_qp_resp), NoDriver> resp;
  ibv_qp_init_attr a{};
  a.qp_context = attr.qp_context;
  a.send_cq = attr.send_cq;
  a.recv_cq = attr.recv_cq;
  a.srq = attr.srq;
  a.cap = cap;
  a.qp_type = attr.qp_type;
  a.sq_sig_all = attr.sq_sig_all;
  return ibv_cmd_create_qp(pd, qp, &a, &cmd, cmd.size(), &resp, resp.size());
}

int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) noexcept {
  Cmd<cmd_size<ib_uverbs_modify_qp>> cmd;
  return ibv_cmd_modify_qp(qp, attr, attr_mask, &cmd, cmd.size());
}

int destroy_qp(ibv_qp* qp) noexcept { return ibv_cmd_destroy_qp(qp); }

}  // namespace metaroce::provider::kernel
