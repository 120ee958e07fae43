// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * /dev/metaroce: how the host engine meets its kernel devices (docs/spec/kernel.md §2). A file
 * either listens for devices that appear without an engine (read: struct mrib_notice) or, once
 * MRIB_IOC_ATTACH bound it, serves one device: it maps that device's memory regions (mmap), checks
 * the objects providers name, raises their events, and hangs up when the device goes. Closing
 * it detaches the engine: the port goes DOWN and every context hears IB_EVENT_DEVICE_FATAL.
 */
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/nsproxy.h>
#include <linux/poll.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <net/net_namespace.h>

#include "metaroce_ib.h"

#define MRIB_MAX_NOTICES 256

struct mrib_file {
	struct list_head list;          /* mrib_files; mrib_lock */
	struct mrib_dev *dev;           /* set once by ATTACH; its struct device is held */
	bool hup;                       /* the device went away; mrib_lock */
	wait_queue_head_t wait;
	struct list_head notices;       /* unattached files only; mrib_lock */
	unsigned int nnotices;
};

struct mrib_notice_item {
	struct list_head list;
	struct mrib_notice n;
};

static LIST_HEAD(mrib_files);

/* mrib_lock held. */
static void queue_notice(struct mrib_file *f, u32 type, struct mrib_dev *dev)
{
	struct mrib_notice_item *it;

	if (f->nnotices >= MRIB_MAX_NOTICES)
		return;  /* a listener that does not read misses devices; it can reopen */
	it = kzalloc(sizeof(*it), GFP_KERNEL);
	if (!it)
		return;
	it->n.type = type;
	it->n.ifindex = dev->ndev->ifindex;
	strscpy(it->n.name, dev_name(&dev->ibdev.dev), sizeof(it->n.name));
	strscpy(it->n.netdev, netdev_name(dev->ndev), sizeof(it->n.netdev));
	list_add_tail(&it->list, &f->notices);
	f->nnotices++;
	wake_up_interruptible(&f->wait);
}

/* mrib_lock held. */
void mrib_notify(u32 type, struct mrib_dev *dev)
{
	struct mrib_file *f;

	list_for_each_entry(f, &mrib_files, list)
		if (!f->dev)
			queue_notice(f, type, dev);
}

void mrib_engine_gone(struct mrib_dev *dev)
{
	struct mrib_file *f;

	mutex_lock(&mrib_lock);
	f = dev->engine;
	if (f) {
		f->hup = true;
		dev->engine = NULL;
		put_pid(dev->engine_pid);
		dev->engine_pid = NULL;
		wake_up_interruptible(&f->wait);
	}
	mutex_unlock(&mrib_lock);
}

static int mrib_open(struct inode *inode, struct file *filp)
{
	struct mrib_file *f = kzalloc(sizeof(*f), GFP_KERNEL);
	struct mrib_dev *dev;

	if (!f)
		return -ENOMEM;
	init_waitqueue_head(&f->wait);
	INIT_LIST_HEAD(&f->notices);
	mutex_lock(&mrib_lock);
	list_add_tail(&f->list, &mrib_files);
	/* Every device already waiting for an engine, as if it had just appeared. */
	list_for_each_entry(dev, &mrib_devices, list)
		if (!dev->engine && !dev->gone && !dev->claimed)
			queue_notice(f, MRIB_NOTICE_ADDED, dev);
	mutex_unlock(&mrib_lock);
	filp->private_data = f;
	return 0;
}

static int mrib_release(struct inode *inode, struct file *filp)
{
	struct mrib_file *f = filp->private_data;
	struct mrib_notice_item *it, *tmp;
	struct mrib_dev *dev = f->dev;
	bool detached = false;

	mutex_lock(&mrib_lock);
	list_del(&f->list);
	if (dev && dev->engine == f) {
		dev->engine = NULL;
		put_pid(dev->engine_pid);
		dev->engine_pid = NULL;
		detached = !dev->gone;
		if (detached)
			mrib_notify(MRIB_NOTICE_ADDED, dev);  /* another engine may serve it */
	}
	mutex_unlock(&mrib_lock);
	if (detached) {
		/* What the engine held for every context is gone with it. */
		mrib_port_event(dev, IB_EVENT_PORT_ERR);
		mrib_port_event(dev, IB_EVENT_DEVICE_FATAL);
	}
	if (dev)
		put_device(&dev->ibdev.dev);
	list_for_each_entry_safe(it, tmp, &f->notices, list)
		kfree(it);
	kfree(f);
	return 0;
}

static ssize_t mrib_read(struct file *filp, char __user *buf, size_t len, loff_t *pos)
{
	struct mrib_file *f = filp->private_data;
	struct mrib_notice_item *it;
	int err;

	if (f->dev)
		return -EINVAL;  /* an attached file has no notices */
	if (len < sizeof(it->n))
		return -EINVAL;
	for (;;) {
		mutex_lock(&mrib_lock);
		it = list_first_entry_or_null(&f->notices, struct mrib_notice_item, list);
		if (it) {
			list_del(&it->list);
			f->nnotices--;
		}
		mutex_unlock(&mrib_lock);
		if (it)
			break;
		if (filp->f_flags & O_NONBLOCK)
			return -EAGAIN;
		err = wait_event_interruptible(f->wait, !list_empty_careful(&f->notices));
		if (err)
			return err;
	}
	err = copy_to_user(buf, &it->n, sizeof(it->n)) ? -EFAULT : sizeof(it->n);
	kfree(it);
	return err;
}

static __poll_t mrib_poll(struct file *filp, poll_table *wait)
{
	struct mrib_file *f = filp->private_data;
	__poll_t mask = 0;

	poll_wait(filp, &f->wait, wait);
	mutex_lock(&mrib_lock);
	if (f->hup)
		mask |= EPOLLHUP;
	if (!list_empty(&f->notices))
		mask |= EPOLLIN | EPOLLRDNORM;
	mutex_unlock(&mrib_lock);
	return mask;
}

/* The engine's caps must cover what the device reports (query_device reads the module's). */
static bool caps_cover(const struct mrib_caps *e)
{
	struct mrib_caps d;

	mrib_fill_default_caps(&d);
	return e->max_mr_size >= d.max_mr_size && e->max_qp >= d.max_qp &&
	       e->max_qp_wr >= d.max_qp_wr && e->max_sge >= d.max_sge && e->max_cq >= d.max_cq &&
	       e->max_cqe >= d.max_cqe && e->max_mr >= d.max_mr && e->max_pd >= d.max_pd &&
	       e->max_srq >= d.max_srq && e->max_srq_wr >= d.max_srq_wr &&
	       e->max_qp_rd_atom >= d.max_qp_rd_atom && e->max_ah >= d.max_ah &&
	       e->active_mtu >= 256 && e->active_mtu <= 4096 && is_power_of_2(e->active_mtu);
}

static long mrib_attach(struct mrib_file *f, void __user *arg)
{
	struct mrib_attach a;
	struct mrib_dev *dev;
	bool active;
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	a.name[sizeof(a.name) - 1] = 0;
	a.netdev[sizeof(a.netdev) - 1] = 0;
	a.link[sizeof(a.link) - 1] = 0;
	a.run_dir[sizeof(a.run_dir) - 1] = 0;
	a.caps.fw_ver[sizeof(a.caps.fw_ver) - 1] = 0;
	if (!a.name[0] || (a.flags & ~MRIB_ATTACH_CREATE) || !caps_cover(&a.caps))
		return -EINVAL;
	if (READ_ONCE(f->dev))
		return -EBUSY;  /* one device per file */

	if (a.flags & MRIB_ATTACH_CREATE) {
		mutex_lock(&mrib_lock);
		dev = mrib_find_device(a.name);
		mutex_unlock(&mrib_lock);
		if (!dev) {
			struct net_device *ndev;

			if (!a.netdev[0])
				return -EINVAL;
			ndev = dev_get_by_name(current->nsproxy->net_ns, a.netdev);
			if (!ndev)
				return -ENODEV;
			err = mrib_create_device(a.name, ndev, true, NULL);
			dev_put(ndev);
			if (err)
				return err;
		}
	}

	mutex_lock(&mrib_lock);
	dev = mrib_find_device(a.name);
	if (!dev || dev->gone)
		err = -ENODEV;
	else if (dev->engine || f->dev)
		err = -EBUSY;
	else if (a.netdev[0] && strcmp(a.netdev, netdev_name(dev->ndev)))
		err = -EINVAL;  /* that name is a device over another interface */
	if (err) {
		mutex_unlock(&mrib_lock);
		return err;
	}
	dev->engine = f;
	dev->engine_pid = get_pid(task_tgid(current));
	dev->claimed = false;
	strscpy(dev->link, a.link, sizeof(dev->link));
	strscpy(dev->run_dir, a.run_dir, sizeof(dev->run_dir));
	dev->caps.active_mtu = a.caps.active_mtu;
	if (a.caps.fw_ver[0])
		strscpy(dev->caps.fw_ver, a.caps.fw_ver, sizeof(dev->caps.fw_ver));
	get_device(&dev->ibdev.dev);
	WRITE_ONCE(f->dev, dev);
	active = netif_running(dev->ndev) && netif_oper_up(dev->ndev);
	/* An attached file hears no more notices. */
	while (!list_empty(&f->notices)) {
		struct mrib_notice_item *it =
			list_first_entry(&f->notices, struct mrib_notice_item, list);

		list_del(&it->list);
		kfree(it);
	}
	f->nnotices = 0;
	mutex_unlock(&mrib_lock);
	if (active)
		mrib_port_event(dev, IB_EVENT_PORT_ACTIVE);
	return 0;
}

static long mrib_ioctl(struct file *filp, unsigned int cmd, unsigned long arg)
{
	struct mrib_file *f = filp->private_data;
	void __user *uarg = (void __user *)arg;
	struct mrib_dev *dev;
	long err;

	if (cmd == MRIB_IOC_ATTACH)
		return mrib_attach(f, uarg);
	dev = READ_ONCE(f->dev);
	if (!dev)
		return -ENOTCONN;
	switch (cmd) {
	case MRIB_IOC_DELETE:
		/* Synchronous: contexts are disassociated, then dealloc_driver hangs this file up. */
		ib_unregister_device(&dev->ibdev);
		return 0;
	case MRIB_IOC_MR: {
		struct mrib_mr_map m;

		if (copy_from_user(&m, uarg, sizeof(m)))
			return -EFAULT;
		err = mrib_mr_map_info(dev, &m);
		if (!err && copy_to_user(uarg, &m, sizeof(m)))
			err = -EFAULT;
		return err;
	}
	case MRIB_IOC_CHECK: {
		struct mrib_check c;

		if (copy_from_user(&c, uarg, sizeof(c)))
			return -EFAULT;
		err = mrib_check_object(dev, &c);
		if (!err && copy_to_user(uarg, &c, sizeof(c)))
			err = -EFAULT;
		return err;
	}
	case MRIB_IOC_EVENT: {
		struct mrib_event e;

		if (copy_from_user(&e, uarg, sizeof(e)))
			return -EFAULT;
		return mrib_raise_event(dev, &e);
	}
	}
	return -ENOTTY;
}

/* --- the engine's view of a memory region's pages ------------------------------------------ */

static void mrib_vma_open(struct vm_area_struct *vma)
{
	struct mrib_mr *mr = vma->vm_private_data;

	kref_get(&mr->ref);  /* a split or moved mapping */
}

static void mrib_vma_close(struct vm_area_struct *vma)
{
	mrib_mr_put(vma->vm_private_data);
}

static const struct vm_operations_struct mrib_vm_ops = {
	.open = mrib_vma_open,
	.close = mrib_vma_close,
};

/*
 * Maps the pinned pages of the region whose key is the page offset. The mapping holds the pages
 * pinned until it goes, whatever the application does meanwhile (deregisters, unmaps, exits):
 * the engine never writes into a page that was given back. Pages pinned read-only map only for
 * reading.
 */
static int mrib_mmap(struct file *filp, struct vm_area_struct *vma)
{
	struct mrib_file *f = filp->private_data;
	struct mrib_dev *dev = READ_ONCE(f->dev);
	unsigned long len = vma->vm_end - vma->vm_start, i = 0;
	struct mrib_mr *mr;
	int err = 0;

	if (!dev)
		return -ENOTCONN;
	if (vma->vm_pgoff > U32_MAX || !(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	mr = mrib_mr_get(dev, vma->vm_pgoff);
	if (!mr)
		return -ENOENT;
	if (len != mr->npages << PAGE_SHIFT) {
		err = -EINVAL;
		goto fail;
	}
	if (!mr->writable) {
		if (vma->vm_flags & VM_WRITE) {
			err = -EACCES;
			goto fail;
		}
		vma->vm_flags &= ~VM_MAYWRITE;
	}
	vma->vm_flags |= VM_DONTCOPY | VM_DONTEXPAND | VM_DONTDUMP;
	while (i < mr->npages) {
		unsigned long pfn = page_to_pfn(mr->pages[i]), run = 1;

		while (i + run < mr->npages && page_to_pfn(mr->pages[i + run]) == pfn + run)
			run++;
		err = remap_pfn_range(vma, vma->vm_start + (i << PAGE_SHIFT), pfn,
				      run << PAGE_SHIFT, vma->vm_page_prot);
		if (err)
			goto fail;
		i += run;
	}
	vma->vm_private_data = mr;
	vma->vm_ops = &mrib_vm_ops;
	return 0;
fail:
	mrib_mr_put(mr);
	return err;
}

static const struct file_operations mrib_fops = {
	.owner = THIS_MODULE,
	.open = mrib_open,
	.release = mrib_release,
	.read = mrib_read,
	.poll = mrib_poll,
	.unlocked_ioctl = mrib_ioctl,
	.mmap = mrib_mmap,
	.llseek = noop_llseek,
};

static struct miscdevice mrib_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "metaroce",
	.fops = &mrib_fops,
	.mode = 0600,
};

int mrib_engine_init(void)
{
	return misc_register(&mrib_misc);
}

void mrib_engine_exit(void)
{
	misc_deregister(&mrib_misc);
}
