// SPDX-License-Identifier: Apache-2.0
// PCI devices named in a DPDK device string: whether the string is a PCI address, and whether
// the device is there and bound to a driver DPDK can drive, read from sysfs before DPDK is asked
// (DPDK itself only says "cannot find device" or skips it silently).
#pragma once

#include <optional>
#include <string>

namespace metaroce::io {

// "0000:03:00.0" for a device name "0000:03:00.0" or "03:00.0" (domain 0); nullopt when the
// name is no PCI address (a vdev such as "net_memif0").
std::optional<std::string> pci_address(const std::string& device_name);

// "" when the device at `address` (as pci_address gives it) exists under `devices_dir`
// (normally /sys/bus/pci/devices) and is bound to a driver DPDK works with (vfio-pci,
// uio_pci_generic, igb_uio, or a bifurcated driver such as mlx5_core); otherwise what is wrong
// and what to do about it.
std::string check_pci_device(const std::string& devices_dir, const std::string& address);

}  // namespace metaroce::io
