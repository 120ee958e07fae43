// SPDX-License-Identifier: Apache-2.0
// PCI addresses and their drivers, from sysfs.
#include "datapath/io/pci.h"

#include <unistd.h>

#include <array>
#include <cctype>
#include <climits>
#include <cstdio>

namespace metaroce::io {
namespace {

bool hex_field(const std::string& s, size_t from, size_t len, unsigned max, unsigned* out) {
  if (from + len > s.size()) return false;
  unsigned v = 0;
  for (size_t i = from; i < from + len; ++i) {
    if (!std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
    v = v * 16 + static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(s[i]))
                                           ? s[i] - '0'
                                           : std::tolower(static_cast<unsigned char>(s[i])) - 'a' + 10);
  }
  if (v > max) return false;
  *out = v;
  return true;
}

// Drivers under which DPDK's PCI bus maps a device (vfio, uio), and the kernel drivers of NICs
// whose DPDK drivers work beside them (bifurcated: mlx4, mlx5).
constexpr std::array<const char*, 5> kDpdkDrivers = {"vfio-pci", "uio_pci_generic", "igb_uio",
                                                     "mlx5_core", "mlx4_core"};

}  // namespace

std::optional<std::string> pci_address(const std::string& name) {
  // DDDD:BB:DD.F or BB:DD.F
  std::string s = name;
  if (s.size() == 7) s = "0000:" + s;
  unsigned domain, bus, dev, fn;
  if (s.size() != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.' ||
      !hex_field(s, 0, 4, 0xffff, &domain) || !hex_field(s, 5, 2, 0xff, &bus) ||
      !hex_field(s, 8, 2, 0x1f, &dev) || !hex_field(s, 11, 1, 7, &fn))
    return std::nullopt;
  char out[16];
  std::snprintf(out, sizeof(out), "%04x:%02x:%02x.%x", domain, bus, dev, fn);
  return std::string(out);
}

std::string check_pci_device(const std::string& devices_dir, const std::string& address) {
  const std::string dir = devices_dir + "/" + address;
  if (access(dir.c_str(), F_OK) != 0)
    return "no PCI device " + address + " on this host (lspci lists those there are)";
  char target[PATH_MAX];
  const ssize_t n = readlink((dir + "/driver").c_str(), target, sizeof(target) - 1);
  const std::string bind_hint = ": bind it to vfio-pci (dpdk-devbind.py --bind=vfio-pci " +
                                address + ") for DPDK to drive it";
  if (n <= 0) return "PCI device " + address + " is bound to no driver" + bind_hint;
  target[n] = '\0';
  std::string driver = target;
  driver = driver.substr(driver.rfind('/') + 1);
  for (const char* d : kDpdkDrivers)
    if (driver == d) return {};
  return "PCI device " + address + " is bound to the kernel driver " + driver +
         ", which DPDK cannot drive" + bind_hint;
}

}  // namespace metaroce::io
