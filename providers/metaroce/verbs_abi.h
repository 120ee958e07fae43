// SPDX-License-Identifier: Apache-2.0
// Our declaration of libibverbs' private provider ABI (IBVERBS_PRIVATE_34, rdma-core 44..56),
// which Debian does not ship as a header; every layout is pinned by static_asserts below.
#pragma once

#include <infiniband/verbs.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <ctime>

namespace metaroce::provider::abi {

inline constexpr int kSysfsNameMax = 64;   // IBV_SYSFS_NAME_MAX
inline constexpr int kSysfsPathMax = 256;  // IBV_SYSFS_PATH_MAX

// A doubly linked list node as libibverbs (ccan/list) embeds it; the provider never walks it.
struct ListNode {
  ListNode* next;
  ListNode* prev;
};

// Kinds of match-table entries; we match by a callback instead, so only the sentinel is used.
enum : uint8_t { kMatchSentinel = 0, kMatchPci = 1, kMatchModalias = 2, kMatchDriverId = 3 };

struct MatchEnt {
  void* driver_data;
  union {
    const char* modalias;
    uint64_t driver_id;
  } u;
  uint16_t vendor;
  uint16_t device;
  uint8_t kind;
};

// One device found under $SYSFS_PATH/class/infiniband_verbs (libibverbs' verbs_sysfs_dev).
struct SysfsDev {
  ListNode entry;
  void* provider_data;
  const MatchEnt* match;
  unsigned int flags;
  char sysfs_name[kSysfsNameMax];   // "uverbs0"
  dev_t sysfs_cdev;
  char ibdev_name[kSysfsNameMax];   // "mr0"
  char ibdev_path[kSysfsPathMax];   // "$SYSFS_PATH/class/infiniband/mr0"
  char modalias[512];
  uint64_t node_guid;
  uint32_t driver_id;
  ibv_node_type node_type;
  int ibdev_idx;
  uint32_t num_ports;
  uint32_t abi_ver;                 // uverbsN/abi_version, 0 when the file is absent
  timespec time_created;
};

struct VerbsDevice;

// The table a provider registers (libibverbs' verbs_device_ops).
struct DeviceOps {
  const char* name;
  uint32_t match_min_abi_version;
  uint32_t match_max_abi_version;
  const MatchEnt* match_table;
  const DeviceOps** static_providers;
  bool (*match_device)(SysfsDev* sysfs_dev);
  verbs_context* (*alloc_context)(ibv_device* device, int cmd_fd, void* private_data);
  verbs_context* (*import_context)(ibv_device* device, int cmd_fd);
  VerbsDevice* (*alloc_device)(SysfsDev* sysfs_dev);
  void (*uninit_device)(VerbsDevice* device);
};

// libibverbs' verbs_device; the provider allocates it and embeds it first in its own device.
struct VerbsDevice {
  ibv_device device;
  const DeviceOps* ops;
  int refcount;  // an atomic_int in C; owned by libibverbs, never touched here
  ListNode entry;
  SysfsDev* sysfs;
  uint64_t core_support;
};

enum MrType : int { kMrTypeMr = 0, kMrTypeNullMr = 1, kMrTypeImportedMr = 2, kMrTypeDmabufMr = 3 };

// libibverbs' verbs_mr: ibv_dereg_mr reads mr_type and access after the ibv_mr.
struct VerbsMr {
  ibv_mr mr;  // named ibv_mr in C, which would clash with the type name in C++
  MrType mr_type;
  int access;
};

enum : uint32_t { kVerbsQpXrcd = 1u << 0, kVerbsQpEx = 1u << 1 };

// libibverbs' verbs_xrcd: what ibv_open_xrcd returns; verbs_qp.xrcd points at it.
enum : uint32_t { kVerbsXrcdHandle = 1u << 0 };
struct VerbsXrcd {
  ibv_xrcd xrcd;
  uint32_t comp_mask;  // kVerbsXrcdHandle: handle is valid
  uint32_t handle;
};

struct VerbsQp {
  union {
    ibv_qp qp;
    ibv_qp_ex qp_ex;
  };
  uint32_t comp_mask;  // kVerbsQpEx makes ibv_qp_to_qp_ex() return &qp_ex
  void* xrcd;
};

struct VerbsCq {
  union {
    ibv_cq cq;
    ibv_cq_ex cq_ex;
  };
};

// Slots we leave to libibverbs' dummies (EOPNOTSUPP) are typed generically: only their position
// and size matter, and a null entry is never installed by verbs_set_ops.
using UnusedOp = void (*)();

// libibverbs' verbs_context_ops: 76 slots in alphabetical order; the order is the ABI.
struct ContextOps {
  int (*advise_mr)(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
                   uint32_t num_sge);
  UnusedOp alloc_dm;
  ibv_mw* (*alloc_mw)(ibv_pd* pd, ibv_mw_type type);
  UnusedOp alloc_null_mr;
  ibv_pd* (*alloc_parent_domain)(ibv_context* context, ibv_parent_domain_init_attr* attr);
  ibv_pd* (*alloc_pd)(ibv_context* context);
  ibv_td* (*alloc_td)(ibv_context* context, ibv_td_init_attr* attr);
  void (*async_event)(ibv_context* context, ibv_async_event* event);
  UnusedOp attach_counters_point_flow;
  int (*attach_mcast)(ibv_qp* qp, const ibv_gid* gid, uint16_t lid);
  int (*bind_mw)(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* mw_bind);
  int (*close_xrcd)(ibv_xrcd* xrcd);
  void (*cq_event)(ibv_cq* cq);
  ibv_ah* (*create_ah)(ibv_pd* pd, ibv_ah_attr* attr);
  UnusedOp create_counters;
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, ibv_comp_channel* channel,
                       int comp_vector);
  ibv_cq_ex* (*create_cq_ex)(ibv_context* context, ibv_cq_init_attr_ex* attr);
  ibv_flow* (*create_flow)(ibv_qp* qp, ibv_flow_attr* flow_attr);
  UnusedOp create_flow_action_esp;
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  ibv_qp* (*create_qp_ex)(ibv_context* context, ibv_qp_init_attr_ex* attr);
  ibv_rwq_ind_table* (*create_rwq_ind_table)(ibv_context* context,
                                             ibv_rwq_ind_table_init_attr* init_attr);
  ibv_srq* (*create_srq)(ibv_pd* pd, ibv_srq_init_attr* attr);
  ibv_srq* (*create_srq_ex)(ibv_context* context, ibv_srq_init_attr_ex* attr);
  ibv_wq* (*create_wq)(ibv_context* context, ibv_wq_init_attr* attr);
  int (*dealloc_mw)(ibv_mw* mw);
  int (*dealloc_pd)(ibv_pd* pd);
  int (*dealloc_td)(ibv_td* td);
  int (*dereg_mr)(VerbsMr* mr);
  int (*destroy_ah)(ibv_ah* ah);
  UnusedOp destroy_counters;
  int (*destroy_cq)(ibv_cq* cq);
  int (*destroy_flow)(ibv_flow* flow);
  UnusedOp destroy_flow_action;
  int (*destroy_qp)(ibv_qp* qp);
  int (*destroy_rwq_ind_table)(ibv_rwq_ind_table* table);
  int (*destroy_srq)(ibv_srq* srq);
  int (*destroy_wq)(ibv_wq* wq);
  int (*detach_mcast)(ibv_qp* qp, const ibv_gid* gid, uint16_t lid);
  void (*free_context)(ibv_context* context);
  UnusedOp free_dm;
  int (*get_srq_num)(ibv_srq* srq, uint32_t* srq_num);
  UnusedOp import_dm;
  ibv_mr* (*import_mr)(ibv_pd* pd, uint32_t mr_handle);
  ibv_pd* (*import_pd)(ibv_context* context, uint32_t pd_handle);
  UnusedOp modify_cq;
  UnusedOp modify_flow_action_esp;
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask);
  UnusedOp modify_qp_rate_limit;
  int (*modify_srq)(ibv_srq* srq, ibv_srq_attr* attr, int attr_mask);
  int (*modify_wq)(ibv_wq* wq, ibv_wq_attr* attr);
  ibv_qp* (*open_qp)(ibv_context* context, ibv_qp_open_attr* attr);
  ibv_xrcd* (*open_xrcd)(ibv_context* context, ibv_xrcd_init_attr* attr);
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
  int (*post_srq_ops)(ibv_srq* srq, ibv_ops_wr* op, ibv_ops_wr** bad_op);
  int (*post_srq_recv)(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  int (*query_device_ex)(ibv_context* context, const ibv_query_device_ex_input* input,
                         ibv_device_attr_ex* attr, size_t attr_size);
  int (*query_ece)(ibv_qp* qp, ibv_ece* ece);
  int (*query_port)(ibv_context* context, uint8_t port_num, ibv_port_attr* attr);
  int (*query_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init_attr);
  UnusedOp query_qp_data_in_order;
  UnusedOp query_rt_values;
  int (*query_srq)(ibv_srq* srq, ibv_srq_attr* attr);
  UnusedOp read_counters;
  UnusedOp reg_dm_mr;
  UnusedOp reg_dmabuf_mr;
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access);
  int (*req_notify_cq)(ibv_cq* cq, int solicited_only);
  int (*rereg_mr)(VerbsMr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access);
  int (*resize_cq)(ibv_cq* cq, int cqe);
  int (*set_ece)(ibv_qp* qp, ibv_ece* ece);
  UnusedOp unimport_dm;
  void (*unimport_mr)(ibv_mr* mr);
  void (*unimport_pd)(ibv_pd* pd);
};

// Log levels of __verbs_log (VERBS_LOG_LEVEL in the environment selects what is printed).
enum : uint32_t { kLogNone = 0, kLogErr = 1, kLogWarn = 2, kLogInfo = 3, kLogDebug = 4 };

// Sizes and offsets measured from rdma-core 44's own driver.h on x86-64 (research notes §1.3).
static_assert(sizeof(void*) == 8, "layouts below are those of LP64");
static_assert(sizeof(MatchEnt) == 24);
static_assert(sizeof(SysfsDev) == 992);
static_assert(offsetof(SysfsDev, sysfs_name) == 36);
static_assert(offsetof(SysfsDev, ibdev_name) == 112);
static_assert(offsetof(SysfsDev, ibdev_path) == 176);
static_assert(offsetof(SysfsDev, abi_ver) == 968);
static_assert(sizeof(DeviceOps) == 72);
static_assert(sizeof(VerbsDevice) == 712);
static_assert(offsetof(VerbsDevice, ops) == 664);
static_assert(offsetof(VerbsDevice, sysfs) == 696);
static_assert(sizeof(ContextOps) == 76 * sizeof(void*));
static_assert(sizeof(ContextOps) == 608);
static_assert(offsetof(ContextOps, alloc_pd) == 5 * 8);
static_assert(offsetof(ContextOps, create_qp_ex) == 20 * 8);
static_assert(offsetof(ContextOps, free_context) == 39 * 8);
static_assert(offsetof(ContextOps, poll_cq) == 53 * 8);
static_assert(offsetof(ContextOps, query_device_ex) == 58 * 8);
static_assert(offsetof(ContextOps, reg_mr) == 68 * 8);
static_assert(offsetof(ContextOps, unimport_pd) == 75 * 8);
static_assert(offsetof(ContextOps, create_ah) == 13 * 8);
static_assert(offsetof(ContextOps, create_srq) == 22 * 8);
static_assert(offsetof(ContextOps, destroy_ah) == 29 * 8);
static_assert(offsetof(ContextOps, destroy_srq) == 36 * 8);
static_assert(offsetof(ContextOps, modify_srq) == 49 * 8);
static_assert(offsetof(ContextOps, post_srq_recv) == 57 * 8);
static_assert(offsetof(ContextOps, query_srq) == 64 * 8);
static_assert(sizeof(VerbsMr) == 56);
static_assert(offsetof(VerbsMr, mr_type) == sizeof(ibv_mr));
static_assert(offsetof(VerbsQp, comp_mask) == sizeof(ibv_qp_ex));
static_assert(sizeof(VerbsXrcd) == 16 && offsetof(VerbsXrcd, handle) == 12);
static_assert(offsetof(ContextOps, close_xrcd) == 11 * 8);
static_assert(offsetof(ContextOps, create_srq_ex) == 23 * 8);
static_assert(offsetof(ContextOps, get_srq_num) == 41 * 8);
static_assert(offsetof(ContextOps, open_qp) == 51 * 8);
static_assert(offsetof(ContextOps, open_xrcd) == 52 * 8);
static_assert(offsetof(ContextOps, create_flow) == 17 * 8);
static_assert(offsetof(ContextOps, destroy_flow) == 32 * 8);
static_assert(offsetof(ContextOps, create_rwq_ind_table) == 21 * 8);
static_assert(offsetof(ContextOps, create_wq) == 24 * 8);
static_assert(offsetof(ContextOps, destroy_rwq_ind_table) == 35 * 8);
static_assert(offsetof(ContextOps, destroy_wq) == 37 * 8);
static_assert(offsetof(ContextOps, modify_wq) == 50 * 8);
static_assert(offsetof(ibv_qp_ex, qp_base) == 0);
static_assert(sizeof(verbs_context) == 648);
static_assert(offsetof(verbs_context, context) == 320);
static_assert(sizeof(ibv_device_attr_ex) == 400);

}  // namespace metaroce::provider::abi

// The four private entry points (plus the logger) the provider links, all @IBVERBS_PRIVATE_34.
extern "C" {
void verbs_register_driver_34(const metaroce::provider::abi::DeviceOps* ops);
void* _verbs_init_and_alloc_context(ibv_device* device, int cmd_fd, size_t alloc_size,
                                    verbs_context* context_offset, uint32_t driver_id);
void verbs_set_ops(verbs_context* vctx, const metaroce::provider::abi::ContextOps* ops);
void verbs_uninit_context(verbs_context* vctx);
// Fills the ibv_cq fields a kernel command would (context, channel reference, events).
void verbs_init_cq(ibv_cq* cq, ibv_context* context, ibv_comp_channel* channel, void* cq_context);
void __verbs_log(verbs_context* ctx, uint32_t level, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
}
