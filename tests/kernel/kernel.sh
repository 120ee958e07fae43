#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The `kernel` suite: builds kernel/metaroce_ib against the guest kernel's headers (any compiler
# warning fails it), boots Debian 12's own kernel in qemu with the module, the engine and the
# provider of BUILD_DIR, and runs tests/kernel/guest/tests.sh there: load, `rdma link add` over a
# veth pair, ibv_devices, ibv_devinfo, ibv_rc_pingpong -e, ib_write_bw, pyverbs, removal and
# unload with nothing left behind and nothing in dmesg.
#   kernel.sh BUILD_DIR
# Exit 77 (skipped) only where the guest's tools are not installed (scripts/install-deps installs
# them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=$(cd "$1" && pwd)
kver=${KG_KERNEL_VERSION:-6.1.0-57-amd64}
kdir=/lib/modules/$kver/build
for need in qemu-system-x86_64 busybox cpio; do
  command -v "$need" >/dev/null || { echo "SKIP: $need is not installed"; exit 77; }
done
[ -d "$kdir" ] || { echo "SKIP: linux-headers-$kver is not installed"; exit 77; }

work=$build/kernel-guest
mkdir -p "$work"
# The module, built aside from the sources against the guest's headers.
rm -rf "$work/module" && cp -r "$src/kernel/metaroce_ib" "$work/module"
make -C "$work/module" KDIR="$kdir" > "$work/module.log" 2>&1 ||
  { cat "$work/module.log"; echo "FAIL: the module does not build"; exit 1; }
if grep -E 'warning:|error:' "$work/module.log"; then
  echo "FAIL: the module builds with warnings against $kver"; exit 1
fi
echo "module built against $kver without warnings"

"$here/build-initramfs.sh" "$build" "$work" "$work/module/metaroce_ib.ko" \
  "${KG_GUEST_SCRIPT:-$here/guest/tests.sh}" > "$work/initramfs.log" 2>&1 ||
  { cat "$work/initramfs.log"; echo "FAIL: cannot build the guest"; exit 1; }
"$here/run-guest.sh" "$work" "$work/guest.log" "${KG_TIMEOUT:-900}"
