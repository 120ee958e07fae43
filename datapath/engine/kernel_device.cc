// SPDX-License-Identifier: Apache-2.0
// /dev/metaroce from the engine's side: attach, map regions, check objects, raise events,
// notices of devices to serve.
#include "datapath/engine/kernel_device.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "datapath/hostif/queues.h"
#include "kernel/metaroce_ib/metaroce_ib_abi.h"

#ifndef METAROCE_VERSION
#define METAROCE_VERSION "0.0.0"
#endif

namespace metaroce::engine {
namespace {

template <size_t N>
void put(char (&dst)[N], const std::string& s) {
  std::strncpy(dst, s.c_str(), N - 1);
  dst[N - 1] = 0;
}

int call(int fd, unsigned long req, void* arg) {
  int r;
  do {
    r = ioctl(fd, req, arg);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? errno : 0;
}

}  // namespace

bool kernel_module_loaded() { return access(MRIB_DEV_NODE, F_OK) == 0; }

RegionMapping::~RegionMapping() { munmap(map_, bytes_); }

std::unique_ptr<KernelDevice> KernelDevice::attach(const std::string& name,
                                                   const std::string& netdev, bool create,
                                                   const std::string& run_dir,
                                                   uint32_t active_mtu, std::string* why) {
  mrib_attach a{};
  if (name.size() >= sizeof(a.name) || netdev.size() >= sizeof(a.netdev) ||
      run_dir.size() >= sizeof(a.run_dir)) {
    *why = "name, interface or run dir too long for the kernel device";
    return nullptr;
  }
  const int fd = open(MRIB_DEV_NODE, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *why = std::string("cannot open " MRIB_DEV_NODE ": ") + std::strerror(errno) +
           (errno == ENOENT ? " (load the metaroce_ib module)" : "");
    return nullptr;
  }
  put(a.name, name);
  put(a.netdev, netdev);
  put(a.link, name);
  put(a.run_dir, run_dir);
  a.flags = create ? MRIB_ATTACH_CREATE : 0;
  // What the host interface offers (datapath/hostif), which the module checks against what it
  // reports.
  mrib_caps& c = a.caps;
  c.max_mr_size = hostif::kMaxMrSize;
  c.max_qp = hostif::kMaxQps;
  c.max_qp_wr = hostif::kMaxQpWr;
  c.max_sge = hostif::kMaxSge;
  c.max_cq = hostif::kMaxCqs;
  c.max_cqe = hostif::kMaxCqe;
  c.max_mr = MRIB_CAP_MAX_MR;  // the NIC's key space (2^24) is larger
  c.max_pd = hostif::kMaxPds;
  c.max_srq = hostif::kMaxSrqs;
  c.max_srq_wr = hostif::kMaxSrqWr;
  c.max_qp_rd_atom = hostif::kMaxRdAtomic;
  c.max_ah = MRIB_CAP_MAX_AH;  // an address handle is an address in host memory
  c.active_mtu = active_mtu;
  c.vendor_id = MRIB_VENDOR_ID;
  c.vendor_part_id = MRIB_VENDOR_PART_ID;
  c.hw_ver = MRIB_HW_VER;
  put(c.fw_ver, METAROCE_VERSION);
  if (const int e = call(fd, MRIB_IOC_ATTACH, &a)) {
    close(fd);
    switch (e) {
      case EBUSY: *why = "another engine serves kernel device " + name; break;
      case EEXIST: *why = "interface " + netdev + " already carries a MetaRoCE kernel device"; break;
      case ENODEV: *why = "no kernel device " + name + (netdev.empty() ? "" : " and no interface " + netdev); break;
      case EINVAL: *why = "kernel device " + name + " is not over " + netdev + ", or the module and engine disagree"; break;
      default: *why = "cannot attach kernel device " + name + ": " + std::strerror(e);
    }
    return nullptr;
  }
  return std::unique_ptr<KernelDevice>(new KernelDevice(fd));
}

KernelDevice::~KernelDevice() { close(fd_); }

int KernelDevice::remove() { return call(fd_, MRIB_IOC_DELETE, nullptr); }

int KernelDevice::check(uint32_t kind, uint32_t id, pid_t pid, uint32_t* qp_type) const {
  mrib_check c{kind, id, static_cast<uint32_t>(pid), 0};
  const int e = call(fd_, MRIB_IOC_CHECK, &c);
  if (!e && qp_type) *qp_type = c.qp_type;
  return e;
}

int KernelDevice::raise(uint32_t kind, uint32_t id, pid_t pid, uint32_t event) const {
  mrib_event e{kind, id, static_cast<uint32_t>(pid), event};
  return call(fd_, MRIB_IOC_EVENT, &e);
}

std::unique_ptr<RegionMapping> KernelDevice::map_region(uint32_t key, pid_t pid,
                                                        RegionInfo* info) const {
  mrib_mr_map m{};
  m.key = key;
  m.pid = static_cast<uint32_t>(pid);
  if (const int e = call(fd_, MRIB_IOC_MR, &m)) {
    errno = e;
    return nullptr;
  }
  const size_t bytes = size_t{m.npages} * static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, bytes, PROT_READ | (m.writable ? PROT_WRITE : 0), MAP_SHARED, fd_,
                 static_cast<off_t>(m.mmap_offset));
  if (p == MAP_FAILED) return nullptr;
  info->iova = m.iova;
  info->length = m.length;
  info->access = m.access;
  info->writable = m.writable != 0;
  return std::make_unique<RegionMapping>(p, bytes, m.offset);
}

int open_kernel_listener() { return open(MRIB_DEV_NODE, O_RDONLY | O_NONBLOCK | O_CLOEXEC); }

std::optional<KernelNotice> read_kernel_notice(int fd) {
  mrib_notice n{};
  if (read(fd, &n, sizeof(n)) != static_cast<ssize_t>(sizeof(n))) return std::nullopt;
  KernelNotice k;
  k.added = n.type == MRIB_NOTICE_ADDED;
  k.name.assign(n.name, strnlen(n.name, sizeof(n.name)));
  k.netdev.assign(n.netdev, strnlen(n.netdev, sizeof(n.netdev)));
  return k;
}

std::optional<nic::LinkConfig> kernel_link_record(const std::string& name, const std::string& netdev,
                                                  std::string* why) {
  nic::LinkConfig c;
  c.name = name;
  c.devargs = nic::udp_plane(netdev);
  c.kernel = netdev;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || netdev != a->ifa_name) continue;
      c.ip = ntohl(reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
      const uint32_t mask =
          a->ifa_netmask ? ntohl(reinterpret_cast<sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr) : 0;
      c.prefix = static_cast<uint8_t>(__builtin_popcount(mask));
      break;
    }
    freeifaddrs(list);
  }
  if (c.ip == 0 || c.prefix == 0) {
    *why = "interface " + netdev + " has no IPv4 address";
    return std::nullopt;
  }
  std::ifstream mtu("/sys/class/net/" + netdev + "/mtu");
  if (!(mtu >> c.mtu)) {
    *why = "cannot read the MTU of " + netdev;
    return std::nullopt;
  }
  return c;
}

}  // namespace metaroce::engine
