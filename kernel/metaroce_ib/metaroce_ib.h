/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * metaroce_ib: MetaRoCE devices of the kernel's RDMA core (docs/design.md, "The kernel module").
 * The module owns what the kernel must own (device registration, uverbs objects, completion
 * channels, async events, pinned memory); every packet stays in the host engine metaroced,
 * which attaches to each device through /dev/metaroce (engine.c).
 */
#ifndef METAROCE_IB_H
#define METAROCE_IB_H

#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/netdevice.h>
#include <linux/pid.h>
#include <linux/wait.h>
#include <linux/xarray.h>
#include <rdma/ib_verbs.h>

#include "metaroce_ib_abi.h"

#define MRIB_VERSION "0.1.0" /* the project's version; also the firmware version reported */
#define MRIB_GID_TABLE_LEN 16 /* as kernel-free devices (nic::kGidTableLen) */
#define MRIB_MAX_MSG_SZ 0x80000000u
#define MRIB_FIRST_QPN 0x10u
#define MRIB_MAX_QPN 0xffffffu
#define MRIB_MAX_MR_INDEX ((1u << 24) - 1)

struct mrib_file;

/* Objects alive on a device, for `metaroce/objects` and the leak check at unload. */
enum mrib_count { MRIB_UCTX, MRIB_PD, MRIB_MR, MRIB_CQ, MRIB_SRQ, MRIB_QP, MRIB_NCOUNTS };

struct mrib_dev {
	struct ib_device ibdev;
	struct net_device *ndev;        /* held by the core (ib_device_set_netdev) */
	struct list_head list;          /* mrib_devices; mrib_lock */
	bool gone;                      /* dealloc_driver ran; mrib_lock */
	bool claimed;                   /* created for an engine, no ADDED notice; mrib_lock */
	struct mrib_file *engine;       /* the attached engine; mrib_lock */
	struct pid *engine_pid;         /* mrib_lock */
	struct mrib_caps caps;          /* mrib_lock */
	char link[MRIB_NAME_LEN];       /* mrib_lock */
	char run_dir[MRIB_RUN_DIR_LEN]; /* mrib_lock */
	struct xarray cqs, srqs, qps, mrs;
	u32 next_qpn, next_mr;          /* allocation cursors (xa_alloc_cyclic) */
	atomic_t mr_gen;
	atomic_t counts[MRIB_NCOUNTS];
};

struct mrib_ucontext {
	struct ib_ucontext ibuc;
};

struct mrib_pd {
	struct ib_pd ibpd;
};

struct mrib_cq {
	struct ib_cq ibcq;
	u32 id;
	struct pid *owner;
};

struct mrib_srq {
	struct ib_srq ibsrq;
	u32 id;
	struct pid *owner;
};

struct mrib_qp {
	struct ib_qp ibqp;
	struct pid *owner;
	spinlock_t lock;                /* attr */
	struct ib_qp_attr attr;         /* what modify_qp set; attr.qp_state is the state */
	struct ib_qp_cap cap;
	enum ib_sig_type sq_sig_type;
};

/*
 * A memory region: its pages stay pinned while the kernel's MR exists or the engine maps them
 * (each mapping holds a reference), so the engine never touches a page that was given back.
 */
struct mrib_mr {
	struct ib_mr ibmr;
	struct kref ref;
	struct mrib_dev *dev;           /* its struct device is held until the last put */
	u32 index;                      /* in dev->mrs; key = index << 8 | generation */
	bool dead;                      /* deregistered: no new mapping; xa_lock of dev->mrs */
	struct pid *owner;
	struct mm_struct *mm;           /* whose pinned_vm counts the pages (mmgrab'd) */
	u64 iova, length;
	int access;
	bool writable;
	unsigned long npages;
	struct page **pages;
};

static inline struct mrib_dev *to_mdev(struct ib_device *d)
{
	return container_of(d, struct mrib_dev, ibdev);
}
static inline struct mrib_cq *to_mcq(struct ib_cq *c)
{
	return container_of(c, struct mrib_cq, ibcq);
}
static inline struct mrib_qp *to_mqp(struct ib_qp *q)
{
	return container_of(q, struct mrib_qp, ibqp);
}
static inline struct mrib_srq *to_msrq(struct ib_srq *s)
{
	return container_of(s, struct mrib_srq, ibsrq);
}
static inline struct mrib_mr *to_mmr(struct ib_mr *m)
{
	return container_of(m, struct mrib_mr, ibmr);
}

/* Devices, engines and notices (main.c). */
extern struct mutex mrib_lock;
extern struct list_head mrib_devices;
extern atomic64_t mrib_pinned_pages;
int mrib_create_device(const char *name, struct net_device *ndev, bool claimed,
		       struct mrib_dev **out);
struct mrib_dev *mrib_find_device(const char *name);
void mrib_port_event(struct mrib_dev *dev, enum ib_event_type type);
extern const struct ib_device_ops mrib_dev_ops;

/* Verbs objects (verbs.c). */
void mrib_fill_default_caps(struct mrib_caps *caps);
int mrib_alloc_ucontext(struct ib_ucontext *uctx, struct ib_udata *udata);
void mrib_dealloc_ucontext(struct ib_ucontext *uctx);
void mrib_disassociate_ucontext(struct ib_ucontext *uctx);
int mrib_alloc_pd(struct ib_pd *pd, struct ib_udata *udata);
int mrib_dealloc_pd(struct ib_pd *pd, struct ib_udata *udata);
struct ib_mr *mrib_reg_user_mr(struct ib_pd *pd, u64 start, u64 length, u64 virt_addr,
			       int access, struct ib_udata *udata);
int mrib_dereg_mr(struct ib_mr *mr, struct ib_udata *udata);
struct ib_mr *mrib_get_dma_mr(struct ib_pd *pd, int access);
void mrib_mr_put(struct mrib_mr *mr);
int mrib_create_cq(struct ib_cq *cq, const struct ib_cq_init_attr *attr, struct ib_udata *udata);
int mrib_destroy_cq(struct ib_cq *cq, struct ib_udata *udata);
int mrib_req_notify_cq(struct ib_cq *cq, enum ib_cq_notify_flags flags);
int mrib_poll_cq(struct ib_cq *cq, int num_entries, struct ib_wc *wc);
int mrib_create_srq(struct ib_srq *srq, struct ib_srq_init_attr *attr, struct ib_udata *udata);
int mrib_destroy_srq(struct ib_srq *srq, struct ib_udata *udata);
int mrib_create_qp(struct ib_qp *qp, struct ib_qp_init_attr *attr, struct ib_udata *udata);
int mrib_modify_qp(struct ib_qp *qp, struct ib_qp_attr *attr, int mask, struct ib_udata *udata);
int mrib_query_qp(struct ib_qp *qp, struct ib_qp_attr *attr, int mask,
		  struct ib_qp_init_attr *init);
int mrib_destroy_qp(struct ib_qp *qp, struct ib_udata *udata);
int mrib_post_send(struct ib_qp *qp, const struct ib_send_wr *wr, const struct ib_send_wr **bad);
int mrib_post_recv(struct ib_qp *qp, const struct ib_recv_wr *wr, const struct ib_recv_wr **bad);

/* Events the engine raises on objects (verbs.c); 0 or a negative errno. */
int mrib_raise_event(struct mrib_dev *dev, const struct mrib_event *ev);
int mrib_check_object(struct mrib_dev *dev, struct mrib_check *chk);
int mrib_mr_map_info(struct mrib_dev *dev, struct mrib_mr_map *m);
/* The live region of `key` with a reference taken, or NULL. */
struct mrib_mr *mrib_mr_get(struct mrib_dev *dev, u32 key);

/* The engine's character device (engine.c). */
int mrib_engine_init(void);
void mrib_engine_exit(void);
void mrib_notify(u32 type, struct mrib_dev *dev);
void mrib_engine_gone(struct mrib_dev *dev);

#endif /* METAROCE_IB_H */
