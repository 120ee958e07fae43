// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * The verbs objects of a MetaRoCE device as kernel handles: user contexts, protection domains,
 * memory regions (pages pinned, mapped by the engine through engine.c), completion queues,
 * shared receive queues and queue pairs. Their rings and their traffic live in the engine; the
 * kernel objects carry what only a kernel can give (uverbs handles, completion channels, async
 * events, pinned memory, `rdma res`). Kernel consumers (ULPs) are not offered a datapath: their
 * create calls and the post/poll entry points answer EOPNOTSUPP.
 */
#include <linux/mm.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <rdma/ib_user_verbs.h>

#include "metaroce_ib.h"

void mrib_fill_default_caps(struct mrib_caps *c)
{
	memset(c, 0, sizeof(*c));
	c->max_mr_size = MRIB_CAP_MAX_MR_SIZE;
	c->max_qp = MRIB_CAP_MAX_QP;
	c->max_qp_wr = MRIB_CAP_MAX_QP_WR;
	c->max_sge = MRIB_CAP_MAX_SGE;
	c->max_cq = MRIB_CAP_MAX_CQ;
	c->max_cqe = MRIB_CAP_MAX_CQE;
	c->max_mr = MRIB_CAP_MAX_MR;
	c->max_pd = MRIB_CAP_MAX_PD;
	c->max_srq = MRIB_CAP_MAX_SRQ;
	c->max_srq_wr = MRIB_CAP_MAX_SRQ_WR;
	c->max_qp_rd_atom = MRIB_CAP_MAX_QP_RD_ATOM;
	c->max_ah = MRIB_CAP_MAX_AH;
	c->vendor_id = MRIB_VENDOR_ID;
	c->vendor_part_id = MRIB_VENDOR_PART_ID;
	c->hw_ver = MRIB_HW_VER;
	strscpy(c->fw_ver, MRIB_VERSION, sizeof(c->fw_ver));
}

static struct mrib_dev *dev_of(struct ib_device *ibdev)
{
	return to_mdev(ibdev);
}

/* The calling process, as the owner of what it creates (compared in the engine's namespace). */
static struct pid *caller(void)
{
	return get_pid(task_tgid(current));
}

/* --- user contexts and protection domains ---------------------------------------------------- */

int mrib_alloc_ucontext(struct ib_ucontext *uctx, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(uctx->device);
	struct mrib_alloc_ucontext_resp resp = { .abi = MRIB_UVERBS_ABI };
	int err;

	mutex_lock(&mrib_lock);
	if (dev->engine) {
		resp.engine_pid = pid_vnr(dev->engine_pid);
		strscpy(resp.link, dev->link, sizeof(resp.link));
		strscpy(resp.run_dir, dev->run_dir, sizeof(resp.run_dir));
	}
	mutex_unlock(&mrib_lock);
	if (udata->outlen) {
		err = ib_copy_to_udata(udata, &resp, min(udata->outlen, sizeof(resp)));
		if (err)
			return err;
	}
	atomic_inc(&dev->counts[MRIB_UCTX]);
	return 0;
}

void mrib_dealloc_ucontext(struct ib_ucontext *uctx)
{
	atomic_dec(&dev_of(uctx->device)->counts[MRIB_UCTX]);
}

/* Nothing of a context is mapped through uverbs: having this lets the device go away (rdma link
 * delete, the netdev's removal, unloading) while programs still hold it open; the core then
 * destroys their objects and they hear IB_EVENT_DEVICE_FATAL. */
void mrib_disassociate_ucontext(struct ib_ucontext *uctx)
{
}

int mrib_alloc_pd(struct ib_pd *pd, struct ib_udata *udata)
{
	if (!udata)
		return -EOPNOTSUPP;
	atomic_inc(&dev_of(pd->device)->counts[MRIB_PD]);
	return 0;
}

int mrib_dealloc_pd(struct ib_pd *pd, struct ib_udata *udata)
{
	atomic_dec(&dev_of(pd->device)->counts[MRIB_PD]);
	return 0;
}

/* --- memory regions ---------------------------------------------------------------------------- */

#define MRIB_ACCESS_OFFERED (IB_ACCESS_LOCAL_WRITE | IB_ACCESS_REMOTE_WRITE | \
			     IB_ACCESS_REMOTE_READ | IB_ACCESS_REMOTE_ATOMIC | IB_ACCESS_MW_BIND)

static void mrib_unpin(struct mrib_mr *mr, unsigned long pinned)
{
	if (pinned)
		unpin_user_pages_dirty_lock(mr->pages, pinned, mr->writable);
	atomic64_sub(mr->npages, &mr->mm->pinned_vm);
	atomic64_sub(pinned, &mrib_pinned_pages);
}

struct ib_mr *mrib_reg_user_mr(struct ib_pd *pd, u64 start, u64 length, u64 virt_addr,
			       int access, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(pd->device);
	unsigned long first, npages, pinned = 0, limit;
	unsigned int gup;
	struct mrib_mr *mr;
	u32 index;
	int err;

	if (!udata)
		return ERR_PTR(-EOPNOTSUPP);
	/* The wire carries the owner's virtual addresses: no separate IOVA, no on-demand paging. */
	if (virt_addr != start || (access & ~MRIB_ACCESS_OFFERED & ~IB_ACCESS_OPTIONAL))
		return ERR_PTR(-EOPNOTSUPP);
	if (!length || length > MRIB_CAP_MAX_MR_SIZE || start + length < start)
		return ERR_PTR(-EINVAL);

	first = start >> PAGE_SHIFT;
	npages = ((start + length - 1) >> PAGE_SHIFT) - first + 1;
	mr = kzalloc(sizeof(*mr), GFP_KERNEL);
	if (!mr)
		return ERR_PTR(-ENOMEM);
	mr->pages = kvcalloc(npages, sizeof(*mr->pages), GFP_KERNEL);
	if (!mr->pages) {
		kfree(mr);
		return ERR_PTR(-ENOMEM);
	}
	kref_init(&mr->ref);
	mr->dev = dev;
	mr->iova = start;
	mr->length = length;
	mr->access = access;
	mr->npages = npages;
	/* Remote write and atomic imply local write (the core checks): one test covers them. */
	mr->writable = access & IB_ACCESS_LOCAL_WRITE;

	/* Counted against RLIMIT_MEMLOCK as the core's own regions are. */
	mr->mm = current->mm;
	mmgrab(mr->mm);
	limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	if (atomic64_add_return(npages, &mr->mm->pinned_vm) > limit && !capable(CAP_IPC_LOCK)) {
		err = -ENOMEM;
		goto unaccount;
	}
	gup = FOLL_LONGTERM | (mr->writable ? FOLL_WRITE : 0);
	while (pinned < npages) {
		unsigned long n = min_t(unsigned long, npages - pinned, PAGE_SIZE / sizeof(void *));
		int got = pin_user_pages_fast((first + pinned) << PAGE_SHIFT, n, gup,
					      mr->pages + pinned);

		if (got <= 0) {
			err = got ? got : -EFAULT;
			goto unpin;
		}
		pinned += got;
		atomic64_add(got, &mrib_pinned_pages);
		if (fatal_signal_pending(current)) {
			err = -EINTR;
			goto unpin;
		}
	}

	err = xa_alloc_cyclic(&dev->mrs, &index, mr, XA_LIMIT(1, MRIB_MAX_MR_INDEX), &dev->next_mr,
			      GFP_KERNEL);
	if (err < 0)
		goto unpin;
	mr->index = index;
	/* lkey == rkey; a generation per registration, so a stale key of a freed region does not
	 * name its successor. */
	mr->ibmr.lkey = mr->ibmr.rkey = (index << 8) | (atomic_inc_return(&dev->mr_gen) & 0xff);
	mr->owner = caller();
	get_device(&dev->ibdev.dev);
	atomic_inc(&dev->counts[MRIB_MR]);
	return &mr->ibmr;

unpin:
	mrib_unpin(mr, pinned);
	goto free;
unaccount:
	atomic64_sub(npages, &mr->mm->pinned_vm);
free:
	mmdrop(mr->mm);
	kvfree(mr->pages);
	kfree(mr);
	return ERR_PTR(err);
}

static void mrib_mr_release(struct kref *ref)
{
	struct mrib_mr *mr = container_of(ref, struct mrib_mr, ref);
	struct mrib_dev *dev = mr->dev;

	xa_erase(&dev->mrs, mr->index);
	mrib_unpin(mr, mr->npages);
	mmdrop(mr->mm);
	put_pid(mr->owner);
	kvfree(mr->pages);
	kfree(mr);
	atomic_dec(&dev->counts[MRIB_MR]);
	put_device(&dev->ibdev.dev);
}

void mrib_mr_put(struct mrib_mr *mr)
{
	kref_put(&mr->ref, mrib_mr_release);
}

int mrib_dereg_mr(struct ib_mr *ibmr, struct ib_udata *udata)
{
	struct mrib_mr *mr = to_mmr(ibmr);

	xa_lock(&mr->dev->mrs);
	mr->dead = true;
	xa_unlock(&mr->dev->mrs);
	mrib_mr_put(mr);  /* the pages stay until the engine unmaps them too */
	return 0;
}

struct ib_mr *mrib_get_dma_mr(struct ib_pd *pd, int access)
{
	return ERR_PTR(-EOPNOTSUPP);  /* kernel consumers: there is no kernel datapath */
}

struct mrib_mr *mrib_mr_get(struct mrib_dev *dev, u32 key)
{
	struct mrib_mr *mr;

	xa_lock(&dev->mrs);
	mr = xa_load(&dev->mrs, key >> 8);
	if (mr && (mr->dead || mr->ibmr.lkey != key || !kref_get_unless_zero(&mr->ref)))
		mr = NULL;
	xa_unlock(&dev->mrs);
	return mr;
}

int mrib_mr_map_info(struct mrib_dev *dev, struct mrib_mr_map *m)
{
	struct mrib_mr *mr = mrib_mr_get(dev, m->key);
	int err = 0;

	if (!mr)
		return -ENOENT;
	if (pid_vnr(mr->owner) != m->pid) {
		err = -EPERM;
		goto out;
	}
	m->iova = mr->iova;
	m->length = mr->length;
	m->mmap_offset = (u64)mr->ibmr.lkey << PAGE_SHIFT;
	m->npages = mr->npages;
	m->offset = mr->iova & ~PAGE_MASK;
	m->access = mr->access;
	m->writable = mr->writable;
out:
	mrib_mr_put(mr);
	return err;
}

/* --- completion queues ------------------------------------------------------------------------- */

int mrib_create_cq(struct ib_cq *ibcq, const struct ib_cq_init_attr *attr, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(ibcq->device);
	struct mrib_cq *cq = to_mcq(ibcq);
	struct mrib_create_cq_resp resp = {};
	int err;

	if (!udata)
		return -EOPNOTSUPP;
	if (attr->flags)
		return -EOPNOTSUPP;
	if (attr->cqe < 1 || attr->cqe > MRIB_CAP_MAX_CQE || attr->comp_vector)
		return -EINVAL;
	ibcq->cqe = attr->cqe;
	cq->owner = caller();
	err = xa_alloc(&dev->cqs, &cq->id, cq, xa_limit_32b, GFP_KERNEL);
	if (err)
		goto fail;
	resp.cq_id = cq->id;
	err = ib_copy_to_udata(udata, &resp, min(udata->outlen, sizeof(resp)));
	if (err) {
		xa_erase(&dev->cqs, cq->id);
		goto fail;
	}
	atomic_inc(&dev->counts[MRIB_CQ]);
	return 0;
fail:
	put_pid(cq->owner);
	return err;
}

int mrib_destroy_cq(struct ib_cq *ibcq, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(ibcq->device);
	struct mrib_cq *cq = to_mcq(ibcq);

	/* Once erased, the engine can raise nothing more on it (events run under the xa lock). */
	xa_erase(&dev->cqs, cq->id);
	put_pid(cq->owner);
	atomic_dec(&dev->counts[MRIB_CQ]);
	return 0;
}

/*
 * A user CQ is armed in the memory its provider shares with the engine, which raises the event
 * of the next completion (MRIB_IOC_EVENT). The provider calls REQ_NOTIFY_CQ only when arming
 * found a completion already there: the event is due now (docs/spec/kernel.md §3).
 */
int mrib_req_notify_cq(struct ib_cq *ibcq, enum ib_cq_notify_flags flags)
{
	if (!ibcq->uobject)
		return -EOPNOTSUPP;
	if (ibcq->comp_handler)
		ibcq->comp_handler(ibcq, ibcq->cq_context);
	return 0;
}

int mrib_poll_cq(struct ib_cq *ibcq, int num_entries, struct ib_wc *wc)
{
	return -EOPNOTSUPP;  /* completions are in the ring the provider reads */
}

/* --- shared receive queues ------------------------------------------------------------------- */

int mrib_create_srq(struct ib_srq *ibsrq, struct ib_srq_init_attr *init, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(ibsrq->device);
	struct mrib_srq *srq = to_msrq(ibsrq);
	struct mrib_create_srq_resp resp = {};
	int err;

	if (!udata)
		return -EOPNOTSUPP;
	if (init->srq_type != IB_SRQT_BASIC)
		return -EOPNOTSUPP;
	if (init->attr.max_wr < 1 || init->attr.max_wr > MRIB_CAP_MAX_SRQ_WR ||
	    init->attr.max_sge < 1 || init->attr.max_sge > MRIB_CAP_MAX_SGE)
		return -EINVAL;
	srq->owner = caller();
	err = xa_alloc(&dev->srqs, &srq->id, srq, xa_limit_32b, GFP_KERNEL);
	if (err)
		goto fail;
	resp.srq_id = srq->id;
	err = ib_copy_to_udata(udata, &resp, min(udata->outlen, sizeof(resp)));
	if (err) {
		xa_erase(&dev->srqs, srq->id);
		goto fail;
	}
	atomic_inc(&dev->counts[MRIB_SRQ]);
	return 0;
fail:
	put_pid(srq->owner);
	return err;
}

int mrib_destroy_srq(struct ib_srq *ibsrq, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(ibsrq->device);
	struct mrib_srq *srq = to_msrq(ibsrq);

	xa_erase(&dev->srqs, srq->id);
	put_pid(srq->owner);
	atomic_dec(&dev->counts[MRIB_SRQ]);
	return 0;
}

/* --- queue pairs --------------------------------------------------------------------------- */

int mrib_create_qp(struct ib_qp *ibqp, struct ib_qp_init_attr *init, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(ibqp->device);
	struct mrib_qp *qp = to_mqp(ibqp);
	u32 qpn;
	int err;

	if (!udata)
		return -EOPNOTSUPP;
	if ((init->qp_type != IB_QPT_RC && init->qp_type != IB_QPT_UC &&
	     init->qp_type != IB_QPT_UD) || init->create_flags)
		return -EOPNOTSUPP;
	if (init->cap.max_send_wr > MRIB_CAP_MAX_QP_WR || init->cap.max_recv_wr > MRIB_CAP_MAX_QP_WR ||
	    init->cap.max_send_sge > MRIB_CAP_MAX_SGE || init->cap.max_recv_sge > MRIB_CAP_MAX_SGE ||
	    init->cap.max_inline_data > MRIB_CAP_MAX_INLINE)
		return -EINVAL;
	spin_lock_init(&qp->lock);
	qp->cap = init->cap;
	qp->sq_sig_type = init->sq_sig_type;
	qp->attr.qp_state = IB_QPS_RESET;
	qp->attr.port_num = 1;
	qp->owner = caller();
	err = xa_alloc_cyclic(&dev->qps, &qpn, qp, XA_LIMIT(MRIB_FIRST_QPN, MRIB_MAX_QPN),
			      &dev->next_qpn, GFP_KERNEL);
	if (err < 0) {
		put_pid(qp->owner);
		return err;
	}
	ibqp->qp_num = qpn;
	atomic_inc(&dev->counts[MRIB_QP]);
	return 0;
}

int mrib_modify_qp(struct ib_qp *ibqp, struct ib_qp_attr *attr, int mask, struct ib_udata *udata)
{
	struct mrib_qp *qp = to_mqp(ibqp);
	enum ib_qp_state cur, next;
	int err = 0;

	if (mask & ~IB_QP_ATTR_STANDARD_BITS)
		return -EOPNOTSUPP;
	if ((mask & IB_QP_PORT) && attr->port_num != 1)
		return -EINVAL;
	if ((mask & IB_QP_PKEY_INDEX) && attr->pkey_index != 0)
		return -EINVAL;
	if ((mask & IB_QP_PATH_MTU) && (attr->path_mtu < IB_MTU_256 || attr->path_mtu > IB_MTU_4096))
		return -EINVAL;
	if ((mask & IB_QP_MAX_QP_RD_ATOMIC) && attr->max_rd_atomic > MRIB_CAP_MAX_QP_RD_ATOM)
		return -EINVAL;
	if ((mask & IB_QP_MAX_DEST_RD_ATOMIC) && attr->max_dest_rd_atomic > MRIB_CAP_MAX_QP_RD_ATOM)
		return -EINVAL;

	spin_lock(&qp->lock);
	cur = (mask & IB_QP_CUR_STATE) ? attr->cur_qp_state : qp->attr.qp_state;
	next = (mask & IB_QP_STATE) ? attr->qp_state : cur;
	if (!ib_modify_qp_is_ok(cur, next, ibqp->qp_type, mask)) {
		err = -EINVAL;
		goto out;
	}
	if (mask & IB_QP_ACCESS_FLAGS)
		qp->attr.qp_access_flags = attr->qp_access_flags;
	if (mask & IB_QP_QKEY)
		qp->attr.qkey = attr->qkey;
	if (mask & IB_QP_PATH_MTU)
		qp->attr.path_mtu = attr->path_mtu;
	if (mask & IB_QP_TIMEOUT)
		qp->attr.timeout = attr->timeout;
	if (mask & IB_QP_RETRY_CNT)
		qp->attr.retry_cnt = attr->retry_cnt;
	if (mask & IB_QP_RNR_RETRY)
		qp->attr.rnr_retry = attr->rnr_retry;
	if (mask & IB_QP_RQ_PSN)
		qp->attr.rq_psn = attr->rq_psn;
	if (mask & IB_QP_SQ_PSN)
		qp->attr.sq_psn = attr->sq_psn;
	if (mask & IB_QP_MIN_RNR_TIMER)
		qp->attr.min_rnr_timer = attr->min_rnr_timer;
	if (mask & IB_QP_MAX_QP_RD_ATOMIC)
		qp->attr.max_rd_atomic = attr->max_rd_atomic;
	if (mask & IB_QP_MAX_DEST_RD_ATOMIC)
		qp->attr.max_dest_rd_atomic = attr->max_dest_rd_atomic;
	if (mask & IB_QP_DEST_QPN)
		qp->attr.dest_qp_num = attr->dest_qp_num;
	qp->attr.cur_qp_state = next;
	qp->attr.qp_state = next;
out:
	spin_unlock(&qp->lock);
	return err;
}

int mrib_query_qp(struct ib_qp *ibqp, struct ib_qp_attr *attr, int mask,
		  struct ib_qp_init_attr *init)
{
	struct mrib_qp *qp = to_mqp(ibqp);

	memset(attr, 0, sizeof(*attr));
	memset(init, 0, sizeof(*init));
	spin_lock(&qp->lock);
	attr->qp_state = qp->attr.qp_state;
	attr->cur_qp_state = qp->attr.qp_state;
	attr->path_mtu = qp->attr.path_mtu;
	attr->qkey = qp->attr.qkey;
	attr->rq_psn = qp->attr.rq_psn;
	attr->sq_psn = qp->attr.sq_psn;
	attr->dest_qp_num = qp->attr.dest_qp_num;
	attr->qp_access_flags = qp->attr.qp_access_flags;
	attr->max_rd_atomic = qp->attr.max_rd_atomic;
	attr->max_dest_rd_atomic = qp->attr.max_dest_rd_atomic;
	attr->min_rnr_timer = qp->attr.min_rnr_timer;
	attr->timeout = qp->attr.timeout;
	attr->retry_cnt = qp->attr.retry_cnt;
	attr->rnr_retry = qp->attr.rnr_retry;
	spin_unlock(&qp->lock);
	attr->port_num = 1;
	attr->cap = qp->cap;
	init->send_cq = ibqp->send_cq;
	init->recv_cq = ibqp->recv_cq;
	init->srq = ibqp->srq;
	init->cap = qp->cap;
	init->qp_type = ibqp->qp_type;
	init->sq_sig_type = qp->sq_sig_type;
	return 0;
}

int mrib_destroy_qp(struct ib_qp *ibqp, struct ib_udata *udata)
{
	struct mrib_dev *dev = dev_of(ibqp->device);
	struct mrib_qp *qp = to_mqp(ibqp);

	xa_erase(&dev->qps, ibqp->qp_num);
	put_pid(qp->owner);
	atomic_dec(&dev->counts[MRIB_QP]);
	return 0;
}

int mrib_post_send(struct ib_qp *qp, const struct ib_send_wr *wr, const struct ib_send_wr **bad)
{
	*bad = wr;  /* work requests are posted to the engine's rings by the provider */
	return -EOPNOTSUPP;
}

int mrib_post_recv(struct ib_qp *qp, const struct ib_recv_wr *wr, const struct ib_recv_wr **bad)
{
	*bad = wr;
	return -EOPNOTSUPP;
}

/* --- objects named by the engine --------------------------------------------------------------- */

static struct xarray *objects_of(struct mrib_dev *dev, u32 kind)
{
	switch (kind) {
	case MRIB_KIND_CQ:
		return &dev->cqs;
	case MRIB_KIND_QP:
		return &dev->qps;
	case MRIB_KIND_SRQ:
		return &dev->srqs;
	}
	return NULL;
}

static struct pid *owner_of(u32 kind, void *obj)
{
	switch (kind) {
	case MRIB_KIND_CQ:
		return ((struct mrib_cq *)obj)->owner;
	case MRIB_KIND_QP:
		return ((struct mrib_qp *)obj)->owner;
	default:
		return ((struct mrib_srq *)obj)->owner;
	}
}

int mrib_check_object(struct mrib_dev *dev, struct mrib_check *chk)
{
	struct xarray *xa = objects_of(dev, chk->kind);
	void *obj;
	int err = 0;

	if (!xa)
		return -EINVAL;
	xa_lock(xa);
	obj = xa_load(xa, chk->id);
	if (!obj)
		err = -ENOENT;
	else if (pid_vnr(owner_of(chk->kind, obj)) != chk->pid)
		err = -EPERM;
	else if (chk->kind == MRIB_KIND_QP)
		chk->qp_type = ((struct mrib_qp *)obj)->ibqp.qp_type;
	xa_unlock(xa);
	return err;
}

static bool qp_event_ok(u32 e)
{
	return e == IB_EVENT_QP_FATAL || e == IB_EVENT_QP_REQ_ERR || e == IB_EVENT_QP_ACCESS_ERR ||
	       e == IB_EVENT_COMM_EST || e == IB_EVENT_QP_LAST_WQE_REACHED;
}

/* Raised under the object table's lock: a destroy (which erases first) waits for it, so no
 * handler runs on an object being freed. The handlers are the core's and only queue the event. */
int mrib_raise_event(struct mrib_dev *dev, const struct mrib_event *e)
{
	struct xarray *xa = objects_of(dev, e->kind);
	struct ib_event ev = { .device = &dev->ibdev, .event = e->event };
	void *obj;
	int err = 0;

	if (!xa)
		return -EINVAL;
	switch (e->kind) {
	case MRIB_KIND_CQ:
		if (e->event != MRIB_EVENT_COMPLETION && e->event != IB_EVENT_CQ_ERR)
			return -EINVAL;
		break;
	case MRIB_KIND_QP:
		if (!qp_event_ok(e->event))
			return -EINVAL;
		break;
	case MRIB_KIND_SRQ:
		if (e->event != IB_EVENT_SRQ_LIMIT_REACHED && e->event != IB_EVENT_SRQ_ERR)
			return -EINVAL;
		break;
	}
	xa_lock(xa);
	obj = xa_load(xa, e->id);
	if (!obj) {
		err = -ENOENT;
	} else if (pid_vnr(owner_of(e->kind, obj)) != e->pid) {
		err = -EPERM;
	} else if (e->kind == MRIB_KIND_CQ) {
		struct ib_cq *cq = &((struct mrib_cq *)obj)->ibcq;

		if (e->event == MRIB_EVENT_COMPLETION) {
			if (cq->comp_handler)
				cq->comp_handler(cq, cq->cq_context);
		} else if (cq->event_handler) {
			ev.element.cq = cq;
			cq->event_handler(&ev, cq->cq_context);
		}
	} else if (e->kind == MRIB_KIND_QP) {
		struct mrib_qp *qp = obj;

		if (e->event == IB_EVENT_QP_FATAL || e->event == IB_EVENT_QP_REQ_ERR ||
		    e->event == IB_EVENT_QP_ACCESS_ERR) {
			spin_lock(&qp->lock);
			qp->attr.qp_state = IB_QPS_ERR;
			spin_unlock(&qp->lock);
		}
		if (qp->ibqp.event_handler) {
			ev.element.qp = &qp->ibqp;
			qp->ibqp.event_handler(&ev, qp->ibqp.qp_context);
		}
	} else {
		struct ib_srq *srq = &((struct mrib_srq *)obj)->ibsrq;

		if (srq->event_handler) {
			ev.element.srq = srq;
			srq->event_handler(&ev, srq->srq_context);
		}
	}
	xa_unlock(xa);
	return err;
}
