// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Devices: `rdma link add NAME type metaroce netdev IF` (rdma netlink link ops) and engines that
 * attach with MRIB_ATTACH_CREATE create them; the netdev's removal, `rdma link delete`, the
 * engine's MRIB_IOC_DELETE and unloading remove them. Device and port attributes, the RoCE v2
 * GID table (the core fills it from the netdev's addresses), and the module's life.
 */
#include <linux/module.h>
#include <linux/netdevice.h>
#include <linux/etherdevice.h>
#include <net/addrconf.h>
#include <rdma/ib_addr.h>
#include <rdma/ib_cache.h>
#include <rdma/rdma_netlink.h>

#include "metaroce_ib.h"

MODULE_DESCRIPTION("MetaRoCE RDMA devices (the datapath runs in the host engine, metaroced)");
MODULE_LICENSE("Dual BSD/GPL");
MODULE_VERSION(MRIB_VERSION);
MODULE_ALIAS_RDMA_LINK(MRIB_LINK_TYPE);

DEFINE_MUTEX(mrib_lock);
LIST_HEAD(mrib_devices);
atomic64_t mrib_pinned_pages = ATOMIC64_INIT(0);
/* Serialises creation, which must not hold mrib_lock: registration calls back into the
 * driver and takes the RTNL (lock order: RTNL, then mrib_lock). */
static DEFINE_MUTEX(mrib_create_lock);
static atomic_t mrib_live_devices = ATOMIC_INIT(0);
static DECLARE_WAIT_QUEUE_HEAD(mrib_devices_gone);

static const char *const mrib_count_names[MRIB_NCOUNTS] = {
	[MRIB_UCTX] = "contexts", [MRIB_PD] = "pds", [MRIB_MR] = "mrs",
	[MRIB_CQ] = "cqs", [MRIB_SRQ] = "srqs", [MRIB_QP] = "qps",
};

/* --- sysfs: /sys/class/infiniband/<dev>/metaroce/ ------------------------------------------ */

static struct mrib_dev *attr_dev(struct device *device)
{
	return rdma_device_to_drv_device(device, struct mrib_dev, ibdev);
}

static ssize_t engine_pid_show(struct device *device, struct device_attribute *attr, char *buf)
{
	struct mrib_dev *dev = attr_dev(device);
	pid_t nr;

	mutex_lock(&mrib_lock);
	nr = dev->engine_pid ? pid_vnr(dev->engine_pid) : 0;
	mutex_unlock(&mrib_lock);
	return sysfs_emit(buf, "%d\n", nr);
}
static DEVICE_ATTR_RO(engine_pid);

static ssize_t run_dir_show(struct device *device, struct device_attribute *attr, char *buf)
{
	struct mrib_dev *dev = attr_dev(device);
	ssize_t n;

	mutex_lock(&mrib_lock);
	n = sysfs_emit(buf, "%s\n", dev->engine ? dev->run_dir : "");
	mutex_unlock(&mrib_lock);
	return n;
}
static DEVICE_ATTR_RO(run_dir);

static ssize_t link_show(struct device *device, struct device_attribute *attr, char *buf)
{
	struct mrib_dev *dev = attr_dev(device);
	ssize_t n;

	mutex_lock(&mrib_lock);
	n = sysfs_emit(buf, "%s\n", dev->engine ? dev->link : "");
	mutex_unlock(&mrib_lock);
	return n;
}
static DEVICE_ATTR_RO(link);

static ssize_t netdev_show(struct device *device, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%s\n", netdev_name(attr_dev(device)->ndev));
}
static DEVICE_ATTR_RO(netdev);

static ssize_t objects_show(struct device *device, struct device_attribute *attr, char *buf)
{
	struct mrib_dev *dev = attr_dev(device);
	ssize_t n = 0;
	int i;

	for (i = 0; i < MRIB_NCOUNTS; i++)
		n += sysfs_emit_at(buf, n, "%s%s %d", i ? " " : "", mrib_count_names[i],
				   atomic_read(&dev->counts[i]));
	n += sysfs_emit_at(buf, n, "\n");
	return n;
}
static DEVICE_ATTR_RO(objects);

static struct attribute *mrib_attrs[] = {
	&dev_attr_engine_pid.attr, &dev_attr_run_dir.attr, &dev_attr_link.attr,
	&dev_attr_netdev.attr, &dev_attr_objects.attr, NULL,
};
static const struct attribute_group mrib_attr_group = {
	.name = MRIB_SYSFS_GROUP,
	.attrs = mrib_attrs,
};

/* --- device and port attributes -------------------------------------------------------------- */

static int mrib_query_device(struct ib_device *ibdev, struct ib_device_attr *a,
			     struct ib_udata *udata)
{
	struct mrib_dev *dev = to_mdev(ibdev);
	struct mrib_caps c;

	mutex_lock(&mrib_lock);
	c = dev->caps;
	mutex_unlock(&mrib_lock);

	memset(a, 0, sizeof(*a));
	a->sys_image_guid = ibdev->node_guid;
	a->max_mr_size = c.max_mr_size;
	a->page_size_cap = ~(u64)(PAGE_SIZE - 1);
	a->vendor_id = c.vendor_id;
	a->vendor_part_id = c.vendor_part_id;
	a->hw_ver = c.hw_ver;
	a->max_qp = c.max_qp;
	a->max_qp_wr = c.max_qp_wr;
	a->device_cap_flags = IB_DEVICE_RC_RNR_NAK_GEN | IB_DEVICE_SYS_IMAGE_GUID;
	a->kernel_cap_flags = IBK_ALLOW_USER_UNREG;
	a->max_send_sge = c.max_sge;
	a->max_recv_sge = c.max_sge;
	a->max_sge_rd = c.max_sge;
	a->max_cq = c.max_cq;
	a->max_cqe = c.max_cqe;
	a->max_mr = c.max_mr;
	a->max_pd = c.max_pd;
	a->max_qp_rd_atom = c.max_qp_rd_atom;
	a->max_qp_init_rd_atom = c.max_qp_rd_atom;
	a->max_res_rd_atom = c.max_qp_rd_atom * c.max_qp;
	/* Responder atomics are atomic among themselves (the engine runs them one at a time). */
	a->atomic_cap = IB_ATOMIC_HCA;
	a->max_ah = c.max_ah;
	a->max_srq = c.max_srq;
	a->max_srq_wr = c.max_srq_wr;
	a->max_srq_sge = c.max_sge;
	a->max_pkeys = 1;
	a->local_ca_ack_delay = 15;  /* 4.096 us * 2^15: software timers */
	return 0;
}

static void mrib_get_dev_fw_str(struct ib_device *ibdev, char *str)
{
	struct mrib_dev *dev = to_mdev(ibdev);

	mutex_lock(&mrib_lock);
	snprintf(str, IB_FW_VERSION_NAME_MAX, "%s", dev->caps.fw_ver);
	mutex_unlock(&mrib_lock);
}

/* ACTIVE while an engine serves the device and its netdev is up. */
static bool mrib_port_active(struct mrib_dev *dev)
{
	return dev->engine && !dev->gone && netif_running(dev->ndev) &&
	       netif_oper_up(dev->ndev);
}

static int mrib_query_port(struct ib_device *ibdev, u32 port, struct ib_port_attr *attr)
{
	struct mrib_dev *dev = to_mdev(ibdev);
	bool active;
	u32 mtu;

	mutex_lock(&mrib_lock);
	active = mrib_port_active(dev);
	mtu = dev->engine ? dev->caps.active_mtu : 0;
	mutex_unlock(&mrib_lock);

	/* The core zeroed attr. */
	attr->state = active ? IB_PORT_ACTIVE : IB_PORT_DOWN;
	attr->phys_state = active ? IB_PORT_PHYS_STATE_LINK_UP : IB_PORT_PHYS_STATE_DISABLED;
	attr->max_mtu = IB_MTU_4096;
	attr->active_mtu = mtu ? ib_mtu_int_to_enum(mtu) : iboe_get_mtu(dev->ndev->mtu);
	attr->gid_tbl_len = MRIB_GID_TABLE_LEN;
	attr->ip_gids = 1;  /* reported as IB_UVERBS_PCF_IP_BASED_GIDS */
	attr->max_msg_sz = MRIB_MAX_MSG_SZ;
	attr->pkey_tbl_len = 1;
	attr->max_vl_num = 1;
	/* Takes the RTNL: nothing of ours is held here. */
	return ib_get_eth_speed(ibdev, port, &attr->active_speed, &attr->active_width);
}

static int mrib_query_pkey(struct ib_device *ibdev, u32 port, u16 index, u16 *pkey)
{
	if (index != 0)
		return -EINVAL;
	*pkey = 0xffff;  /* the default partition, full membership */
	return 0;
}

static enum rdma_link_layer mrib_get_link_layer(struct ib_device *ibdev, u32 port)
{
	return IB_LINK_LAYER_ETHERNET;
}

static int mrib_get_port_immutable(struct ib_device *ibdev, u32 port,
				   struct ib_port_immutable *im)
{
	im->pkey_tbl_len = 1;
	im->gid_tbl_len = MRIB_GID_TABLE_LEN;
	/* RoCE v2 addressing only: no MADs (there is no kernel datapath to carry them), so neither
	 * ib_mad nor ib_cm opens the port. */
	im->core_cap_flags = RDMA_CORE_CAP_PROT_ROCE_UDP_ENCAP | RDMA_CORE_CAP_ETH_AH;
	im->max_mad_size = 0;
	return 0;
}

void mrib_port_event(struct mrib_dev *dev, enum ib_event_type type)
{
	struct ib_event ev = {
		.device = &dev->ibdev,
		.element.port_num = 1,
		.event = type,
	};

	ib_dispatch_event(&ev);
}

/* --- device life ------------------------------------------------------------------------------ */

static void mrib_dealloc_driver(struct ib_device *ibdev)
{
	struct mrib_dev *dev = to_mdev(ibdev);

	mrib_engine_gone(dev);  /* the engine's file hangs up */
	mutex_lock(&mrib_lock);
	dev->gone = true;
	list_del_init(&dev->list);
	mrib_notify(MRIB_NOTICE_REMOVED, dev);
	mutex_unlock(&mrib_lock);
	/* uverbs destroyed every object before: only regions an engine still maps remain, and
	 * each holds the device until it is released. */
	WARN_ON(!xa_empty(&dev->cqs) || !xa_empty(&dev->qps) || !xa_empty(&dev->srqs));
	if (atomic_dec_and_test(&mrib_live_devices))
		wake_up(&mrib_devices_gone);
}

const struct ib_device_ops mrib_dev_ops = {
	.owner = THIS_MODULE,
	.driver_id = RDMA_DRIVER_UNKNOWN,
	.uverbs_abi_ver = MRIB_UVERBS_ABI,
	.device_group = &mrib_attr_group,

	.alloc_pd = mrib_alloc_pd,
	.alloc_ucontext = mrib_alloc_ucontext,
	.create_cq = mrib_create_cq,
	.create_qp = mrib_create_qp,
	.create_srq = mrib_create_srq,
	.dealloc_driver = mrib_dealloc_driver,
	.dealloc_pd = mrib_dealloc_pd,
	.dealloc_ucontext = mrib_dealloc_ucontext,
	.dereg_mr = mrib_dereg_mr,
	.destroy_cq = mrib_destroy_cq,
	.destroy_qp = mrib_destroy_qp,
	.destroy_srq = mrib_destroy_srq,
	.disassociate_ucontext = mrib_disassociate_ucontext,
	.get_dev_fw_str = mrib_get_dev_fw_str,
	.get_dma_mr = mrib_get_dma_mr,
	.get_link_layer = mrib_get_link_layer,
	.get_port_immutable = mrib_get_port_immutable,
	.modify_qp = mrib_modify_qp,
	.poll_cq = mrib_poll_cq,
	.post_recv = mrib_post_recv,
	.post_send = mrib_post_send,
	.query_device = mrib_query_device,
	.query_pkey = mrib_query_pkey,
	.query_port = mrib_query_port,
	.query_qp = mrib_query_qp,
	.reg_user_mr = mrib_reg_user_mr,
	.req_notify_cq = mrib_req_notify_cq,

	INIT_RDMA_OBJ_SIZE(ib_cq, mrib_cq, ibcq),
	INIT_RDMA_OBJ_SIZE(ib_pd, mrib_pd, ibpd),
	INIT_RDMA_OBJ_SIZE(ib_qp, mrib_qp, ibqp),
	INIT_RDMA_OBJ_SIZE(ib_srq, mrib_srq, ibsrq),
	INIT_RDMA_OBJ_SIZE(ib_ucontext, mrib_ucontext, ibuc),
};

/* mrib_lock held. */
static struct mrib_dev *mrib_find_by_netdev(struct net_device *ndev)
{
	struct mrib_dev *dev;

	list_for_each_entry(dev, &mrib_devices, list)
		if (dev->ndev == ndev)
			return dev;
	return NULL;
}

/* mrib_lock held. */
struct mrib_dev *mrib_find_device(const char *name)
{
	struct mrib_dev *dev;

	list_for_each_entry(dev, &mrib_devices, list)
		if (!strcmp(dev_name(&dev->ibdev.dev), name))
			return dev;
	return NULL;
}

int mrib_create_device(const char *name, struct net_device *ndev, bool claimed,
		       struct mrib_dev **out)
{
	struct mrib_dev *dev;
	bool used;
	int err, i;

	if (ndev->type != ARPHRD_ETHER || ndev->addr_len != ETH_ALEN)
		return -EINVAL;  /* RoCE v2 over Ethernet interfaces only */
	mutex_lock(&mrib_create_lock);
	mutex_lock(&mrib_lock);
	used = mrib_find_by_netdev(ndev) != NULL;
	mutex_unlock(&mrib_lock);
	if (used) {
		err = -EEXIST;
		goto out;
	}

	dev = ib_alloc_device(mrib_dev, ibdev);
	if (!dev) {
		err = -ENOMEM;
		goto out;
	}
	INIT_LIST_HEAD(&dev->list);
	dev->ndev = ndev;
	dev->claimed = claimed;
	mrib_fill_default_caps(&dev->caps);
	xa_init_flags(&dev->cqs, XA_FLAGS_ALLOC1);
	xa_init_flags(&dev->srqs, XA_FLAGS_ALLOC1);
	xa_init_flags(&dev->qps, XA_FLAGS_ALLOC);
	xa_init_flags(&dev->mrs, XA_FLAGS_ALLOC1);
	dev->next_qpn = MRIB_FIRST_QPN;
	atomic_set(&dev->mr_gen, 0);
	for (i = 0; i < MRIB_NCOUNTS; i++)
		atomic_set(&dev->counts[i], 0);

	dev->ibdev.node_type = RDMA_NODE_IB_CA;
	dev->ibdev.phys_port_cnt = 1;
	dev->ibdev.num_comp_vectors = 1;
	dev->ibdev.local_dma_lkey = 0;
	addrconf_addr_eui48((unsigned char *)&dev->ibdev.node_guid, ndev->dev_addr);
	strscpy(dev->ibdev.node_desc, "MetaRoCE", sizeof(dev->ibdev.node_desc));
	/* Arming is in memory the provider shares with the engine; the provider asks the kernel
	 * only for a completion event that arming found already due (verbs.c). */
	dev->ibdev.uverbs_cmd_mask |= BIT_ULL(IB_USER_VERBS_CMD_REQ_NOTIFY_CQ);
	ib_set_device_ops(&dev->ibdev, &mrib_dev_ops);

	err = ib_device_set_netdev(&dev->ibdev, ndev, 1);
	if (err)
		goto dealloc;
	atomic_inc(&mrib_live_devices);
	mutex_lock(&mrib_lock);
	list_add_tail(&dev->list, &mrib_devices);
	mutex_unlock(&mrib_lock);
	err = ib_register_device(&dev->ibdev, name, NULL);
	if (err) {
		mutex_lock(&mrib_lock);
		list_del(&dev->list);
		mutex_unlock(&mrib_lock);
		if (atomic_dec_and_test(&mrib_live_devices))
			wake_up(&mrib_devices_gone);
		goto dealloc;
	}
	mutex_lock(&mrib_lock);
	if (!claimed)
		mrib_notify(MRIB_NOTICE_ADDED, dev);
	mutex_unlock(&mrib_lock);
	if (out)
		*out = dev;
	err = 0;
	goto out;

dealloc:
	ib_dealloc_device(&dev->ibdev);
out:
	mutex_unlock(&mrib_create_lock);
	return err;
}

static int mrib_newlink(const char *name, struct net_device *ndev)
{
	return mrib_create_device(name, ndev, false, NULL);
}

static struct rdma_link_ops mrib_link_ops = {
	.type = MRIB_LINK_TYPE,
	.newlink = mrib_newlink,
};

/* RTNL held. */
static int mrib_netdev_event(struct notifier_block *nb, unsigned long event, void *arg)
{
	struct net_device *ndev = netdev_notifier_info_to_dev(arg);
	struct mrib_dev *dev;
	bool attached;

	mutex_lock(&mrib_lock);
	dev = mrib_find_by_netdev(ndev);
	attached = dev && dev->engine;
	if (dev && event == NETDEV_UNREGISTER)
		ib_unregister_device_queued(&dev->ibdev);
	else if (attached)
		get_device(&dev->ibdev.dev);  /* a parallel `rdma link delete` may free it */
	mutex_unlock(&mrib_lock);
	if (!attached || event == NETDEV_UNREGISTER)
		return NOTIFY_DONE;
	switch (event) {
	case NETDEV_UP:
	case NETDEV_CHANGE:
		if (netif_running(ndev) && netif_oper_up(ndev))
			mrib_port_event(dev, IB_EVENT_PORT_ACTIVE);
		else
			mrib_port_event(dev, IB_EVENT_PORT_ERR);
		break;
	case NETDEV_DOWN:
		mrib_port_event(dev, IB_EVENT_PORT_ERR);
		break;
	}
	put_device(&dev->ibdev.dev);
	return NOTIFY_DONE;
}

static struct notifier_block mrib_netdev_nb = {
	.notifier_call = mrib_netdev_event,
};

/* Unregisters every device, whatever else is removing them at the same time. */
static void mrib_remove_all(void)
{
	struct mrib_dev *dev;

	for (;;) {
		mutex_lock(&mrib_lock);
		dev = list_first_entry_or_null(&mrib_devices, struct mrib_dev, list);
		if (dev) {
			/* Keeps the memory: a queued unregistration may free it meanwhile. */
			get_device(&dev->ibdev.dev);
			list_del_init(&dev->list);
		}
		mutex_unlock(&mrib_lock);
		if (!dev)
			break;
		ib_unregister_device(&dev->ibdev);
		put_device(&dev->ibdev.dev);
	}
	wait_event(mrib_devices_gone, atomic_read(&mrib_live_devices) == 0);
}

static int __init mrib_init(void)
{
	int err;

	err = mrib_engine_init();
	if (err)
		return err;
	err = register_netdevice_notifier(&mrib_netdev_nb);
	if (err) {
		mrib_engine_exit();
		return err;
	}
	rdma_link_register(&mrib_link_ops);
	return 0;
}

static void __exit mrib_exit(void)
{
	rdma_link_unregister(&mrib_link_ops);
	unregister_netdevice_notifier(&mrib_netdev_nb);
	mrib_remove_all();
	mrib_engine_exit();
	if (atomic64_read(&mrib_pinned_pages))
		pr_warn("%lld pinned pages not released at unload\n",
			(long long)atomic64_read(&mrib_pinned_pages));
}

module_init(mrib_init);
module_exit(mrib_exit);
