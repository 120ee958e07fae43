/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * The ABI of the metaroce_ib module (docs/spec/kernel.md), shared by the module, the provider
 * (providers/metaroce/kernel.cc) and the engine (datapath/engine/kernel_device.cc):
 *
 *  - driver data of the uverbs commands (udata) the provider exchanges with the module;
 *  - the engine's character device /dev/metaroce: attach a link to its kernel device, map the
 *    pinned pages of a memory region, raise completion and asynchronous events, and hear of
 *    devices that `rdma link add` created.
 *
 * Plain data of fixed width in the host's byte order; every structure's size is pinned below.
 */
#ifndef METAROCE_IB_ABI_H
#define METAROCE_IB_ABI_H

#include <linux/ioctl.h>
#include <linux/types.h>

/* Reported as the device's uverbs ABI version (class/infiniband_verbs/uverbsN/abi_version, and
 * RDMA_NLDEV_ATTR_CHARDEV_ABI): the provider matches it. Bumped on any change of this file that
 * is not an addition at the end of a structure. */
#define MRIB_UVERBS_ABI 1
#define MRIB_LINK_TYPE "metaroce"
#define MRIB_NAME_LEN 64
#define MRIB_NETDEV_LEN 16 /* IFNAMSIZ */
#define MRIB_RUN_DIR_LEN 108 /* sun_path: the engine's socket lives in it */
#define MRIB_DEV_NODE "/dev/metaroce"
/* The kernel device's sysfs folder holding the attributes below (engine_pid, run_dir, link):
 * the provider matches a device by its presence. */
#define MRIB_SYSFS_GROUP "metaroce"

/* --- uverbs driver data (provider <-> module) --------------------------------------------- */

/* GET_CONTEXT response: who serves the device now. engine_pid 0: no engine (the port is DOWN;
 * the context can query but create nothing). */
struct mrib_alloc_ucontext_resp {
	__u32 abi;           /* MRIB_UVERBS_ABI */
	__u32 engine_pid;    /* in the opener's pid namespace; 0 when it is not visible there */
	char link[MRIB_NAME_LEN];         /* the engine's name for the link */
	char run_dir[MRIB_RUN_DIR_LEN];   /* <run_dir>/engine.sock is its control socket */
	__u32 reserved;
};

/* CREATE_CQ / CREATE_SRQ response: the module's number for the object, which the provider hands
 * the engine so that it can raise the object's events. */
struct mrib_create_cq_resp {
	__u32 cq_id;
	__u32 reserved;
};
struct mrib_create_srq_resp {
	__u32 srq_id;
	__u32 reserved;
};

/* --- /dev/metaroce (engine <-> module) ----------------------------------------------------- */

/* What every MetaRoCE device offers (query_device): the limits of the engine's host interface,
 * version 1 (datapath/hostif; its unit test checks they agree). An engine whose caps fall short
 * of these cannot attach. */
#define MRIB_CAP_MAX_MR_SIZE (1ull << 31)
#define MRIB_CAP_MAX_QP 16384
#define MRIB_CAP_MAX_QP_WR 16384
#define MRIB_CAP_MAX_SGE 16
#define MRIB_CAP_MAX_CQ 16384
#define MRIB_CAP_MAX_CQE ((1u << 22) - 1)
#define MRIB_CAP_MAX_MR (1u << 20)
#define MRIB_CAP_MAX_PD 65536
#define MRIB_CAP_MAX_SRQ 16384
#define MRIB_CAP_MAX_SRQ_WR 16384
#define MRIB_CAP_MAX_QP_RD_ATOM 16
#define MRIB_CAP_MAX_AH (1u << 20)
#define MRIB_CAP_MAX_INLINE 1024
#define MRIB_VENDOR_ID 0x4d5243 /* "MRC": no IEEE OUI is registered for MetaRoCE */
#define MRIB_VENDOR_PART_ID 1
#define MRIB_HW_VER 1

/* What the engine that attaches offers; active_mtu and fw_ver are what the device reports while
 * it serves it. */
struct mrib_caps {
	__u64 max_mr_size;
	__u32 max_qp, max_qp_wr, max_sge, max_cq, max_cqe, max_mr, max_pd, max_srq, max_srq_wr;
	__u32 max_qp_rd_atom, max_ah;
	__u32 active_mtu;    /* bytes: the largest verbs MTU the link carries */
	__u32 vendor_id, vendor_part_id, hw_ver;
	__u32 reserved;
	char fw_ver[32];
};

/* MRIB_IOC_ATTACH: binds this open file to the kernel device `name`, which must have no engine;
 * with MRIB_ATTACH_CREATE a missing device is created over `netdev` first (what `rdma link add
 * NAME type metaroce netdev IF` does). Closing the file detaches: the port goes DOWN and every
 * context hears IB_EVENT_DEVICE_FATAL. One device per file; the file's other ioctls and mmap act
 * on that device. */
#define MRIB_ATTACH_CREATE 1u
struct mrib_attach {
	char name[MRIB_NAME_LEN];
	char netdev[MRIB_NETDEV_LEN];     /* required with MRIB_ATTACH_CREATE, else checked if set */
	char link[MRIB_NAME_LEN];         /* the engine's link name (the provider's Hello) */
	char run_dir[MRIB_RUN_DIR_LEN];
	__u32 flags;
	__u32 reserved[2];
	struct mrib_caps caps;
};

/* MRIB_IOC_MR: a memory region of the device as the engine needs it to map its pages. The key
 * names it; pid must be its registering process (in the engine's pid namespace). Pages are then
 * mapped with mmap(NULL, npages * page size, PROT_READ [| PROT_WRITE if writable], MAP_SHARED,
 * fd, mmap_offset): the region starts `offset` bytes into the mapping. */
struct mrib_mr_map {
	__u32 key;           /* in: lkey (== rkey) */
	__u32 pid;           /* in */
	__u64 iova;          /* out: the registered address */
	__u64 length;        /* out */
	__u64 mmap_offset;   /* out */
	__u32 npages;        /* out */
	__u32 offset;        /* out: of iova in its first page */
	__u32 access;        /* out: ib_access_flags */
	__u32 writable;      /* out: the pages were pinned for writing */
};

/* MRIB_IOC_CHECK: is object `id` of kind `kind` the one `pid` created on this device? 0, or
 * ENOENT (no such object) / EPERM (another process's). For a QP, `id` is its number and
 * `qp_type` comes back (IB_QPT_RC 2, IB_QPT_UC 3, IB_QPT_UD 4). */
enum mrib_kind {
	MRIB_KIND_CQ = 1,
	MRIB_KIND_QP = 2,
	MRIB_KIND_SRQ = 3,
};
struct mrib_check {
	__u32 kind;
	__u32 id;
	__u32 pid;
	__u32 qp_type;       /* out */
};

/* MRIB_IOC_EVENT: an event of one object, raised by the engine. MRIB_EVENT_COMPLETION calls the
 * CQ's completion handler (ibv_get_cq_event on its channel); any other value is an ib_event_type
 * delivered to the object's async handler (ibv_get_async_event): CQ_ERR for a CQ;
 * QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, COMM_EST, QP_LAST_WQE_REACHED for a QP (the first three
 * also move the kernel's QP state to ERR); SRQ_LIMIT_REACHED, SRQ_ERR for an SRQ. */
#define MRIB_EVENT_COMPLETION 0xffffffffu
struct mrib_event {
	__u32 kind;
	__u32 id;
	__u32 pid;
	__u32 event;
};

/* read() on a file with no device: one notice per device that appears without an engine (a
 * fresh `rdma link add`; every such device once when the file is opened) or goes away. */
enum mrib_notice_type {
	MRIB_NOTICE_ADDED = 1,
	MRIB_NOTICE_REMOVED = 2,
};
struct mrib_notice {
	__u32 type;
	__u32 ifindex;
	char name[MRIB_NAME_LEN];
	char netdev[MRIB_NETDEV_LEN];
};

#define MRIB_IOC_MAGIC 0xB7
#define MRIB_IOC_ATTACH _IOW(MRIB_IOC_MAGIC, 1, struct mrib_attach)
#define MRIB_IOC_DELETE _IO(MRIB_IOC_MAGIC, 2)      /* unregister the attached device */
#define MRIB_IOC_MR _IOWR(MRIB_IOC_MAGIC, 3, struct mrib_mr_map)
#define MRIB_IOC_CHECK _IOWR(MRIB_IOC_MAGIC, 4, struct mrib_check)
#define MRIB_IOC_EVENT _IOW(MRIB_IOC_MAGIC, 5, struct mrib_event)

#ifdef __cplusplus
static_assert(sizeof(struct mrib_alloc_ucontext_resp) == 184, "ABI");
static_assert(sizeof(struct mrib_caps) == 104, "ABI");
static_assert(sizeof(struct mrib_attach) == 368, "ABI");
static_assert(sizeof(struct mrib_mr_map) == 48, "ABI");
static_assert(sizeof(struct mrib_check) == 16, "ABI");
static_assert(sizeof(struct mrib_event) == 16, "ABI");
static_assert(sizeof(struct mrib_notice) == 88, "ABI");
#endif

#endif /* METAROCE_IB_ABI_H */
