#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds what tests/kernel/run-guest.sh boots: Debian 12's own kernel (linux-image-6.1.0-57-amd64,
# unpacked, never installed on the host) and an initramfs holding busybox, the kernel's RDMA stack
# (ib_core, ib_uverbs, rdma_rxe, veth), metaroce_ib.ko, the MetaRoCE engine, command and provider
# of a build tree, rdma-core's tools, perftest, and python3 with pyverbs and rdma-core's tests.
# Adapted from the team's harness (shared/tools/kernel-guest).
#
#   build-initramfs.sh BUILD_DIR WORK_DIR MODULE.ko GUEST_SCRIPT
# Leaves WORK_DIR/vmlinuz and WORK_DIR/initramfs.cpio.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
module=$(realpath "$3")
script=$(realpath "$4")
kpkg=${KG_KERNEL_PACKAGE:-linux-image-6.1.0-57-amd64}
cd "$work"

# The guest kernel: downloaded once per work dir (Debian's registry), unpacked with dpkg -x.
if [ ! -d kpkg/lib/modules ]; then
  rm -rf debs kpkg && mkdir -p debs kpkg
  # apt's sandbox user cannot write a root-owned folder: download into one it may.
  chmod 0777 debs
  (cd debs && apt-get download -q "$kpkg" >/dev/null)
  dpkg -x debs/"$kpkg"_*.deb kpkg
fi
K=$(ls kpkg/lib/modules | head -1)
cp -f kpkg/boot/vmlinuz-"$K" vmlinuz
[ -f kpkg/lib/modules/"$K"/modules.dep ] || depmod -b kpkg "$K"

R=$work/rootfs
rm -rf "$R"
mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib,usr/lib64,usr/local/bin,usr/local/sbin,etc/libibverbs.d,proc,sys,dev,tmp,run,root}
ln -s usr/bin "$R/bin"; ln -s usr/sbin "$R/sbin"; ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"

# busybox and its applets; real tools go to /usr/local/bin, first in PATH.
cp /bin/busybox "$R/usr/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$R/usr/bin/$a" ] || ln -s busybox "$R/usr/bin/$a"; done
ln -s ../bin/busybox "$R/usr/sbin/modprobe"  # request_module() runs /sbin/modprobe

# Kernel modules in load order; rxe needs the crc32 shash (its ICRC).
: > "$R/etc/guest-modules.list"
for m in veth crc32_generic crc32_pclmul rdma_rxe ib_uverbs rdma_ucm; do
  modprobe -d kpkg -S "$K" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r p; do
  rel=${p#"$work/kpkg/lib/modules/$K/"}
  mkdir -p "$R/lib/modules/$K/$(dirname "$rel")"
  cp "$p" "$R/lib/modules/$K/$rel"
  echo "$rel" >> "$R/etc/guest-modules.list"
done
cp kpkg/lib/modules/"$K"/modules.{order,builtin,builtin.modinfo} "$R/lib/modules/$K/"
# metaroce_ib: loaded and unloaded by the guest script itself (both are under test).
mkdir -p "$R/lib/modules/$K/extra"
cp "$module" "$R/lib/modules/$K/extra/"
depmod -b "$R" "$K"

# Programs and every library they load; KG_EXTRA_BINS adds more (chrt, taskset, ... for
# experiments in the guest).
BINS="ib_write_bw ib_write_lat ib_send_bw ib_read_bw ibv_devices ibv_devinfo ibv_rc_pingpong
      ibv_uc_pingpong ibv_ud_pingpong ibv_srq_pingpong rdma ip python3 ${KG_EXTRA_BINS:-}"
LIBS="/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so"
for b in $BINS; do
  # Debian's own programs, whatever this shell's PATH prefers (pyenv shims, /usr/local).
  p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$b")
  cp -L "$p" "$R/usr/local/bin/$b"
  LIBS="$LIBS $p"
done
cp "$build/util/metaroce" "$R/usr/local/bin/"
cp "$build/datapath/engine/metaroced" "$R/usr/local/sbin/"
lib=/usr/lib/x86_64-linux-gnu
mkdir -p "$R$lib"
cp -L "$build/providers/metaroce/libmetaroce.so.1" "$R$lib/"
mkdir -p "$R$lib/libibverbs"
ln -s ../libmetaroce.so.1 "$R$lib/libibverbs/libmetaroce-rdmav34.so"
cp /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so "$R$lib/libibverbs/"
echo "driver rxe" > "$R/etc/libibverbs.d/rxe.driver"
echo "driver metaroce" > "$R/etc/libibverbs.d/metaroce.driver"
LIBS="$LIBS $build/util/metaroce $build/datapath/engine/metaroced $build/providers/metaroce/libmetaroce.so.1"

# python3: the standard library without its tests and GUI, pyverbs, rdma-core's tests.
py=/usr/lib/python3.11
mkdir -p "$R$py" "$R/usr/lib/python3/dist-packages"
tar -C "$py" --exclude=./test --exclude=./idlelib --exclude=./tkinter --exclude=./turtledemo \
  --exclude=./ensurepip --exclude=./lib2to3 --exclude='./config-*' --exclude=./pydoc_data \
  -cf - . | tar -C "$R$py" -xf -
cp -a /usr/lib/python3/dist-packages/pyverbs "$R/usr/lib/python3/dist-packages/"
for so in "$R$py"/lib-dynload/*.so "$R"/usr/lib/python3/dist-packages/pyverbs/*.so \
          "$R"/usr/lib/python3/dist-packages/pyverbs/providers/*/*.so; do
  if [ -f "$so" ]; then LIBS="$LIBS $so"; fi
done
mkdir -p "$R/opt/rdma-tests"
cp -r /usr/share/doc/rdma-core/tests "$R/opt/rdma-tests/"
gunzip -f "$R"/opt/rdma-tests/tests/*.gz
/usr/bin/python3 -m compileall -q "$R/opt/rdma-tests/tests" >/dev/null || true

for f in $LIBS; do
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3} /^\t\/lib/{print $1}'  || true
done | sort -u | while read -r l; do
  if [ -e "$R$l" ]; then continue; fi
  mkdir -p "$R$(dirname "$l")"
  cp -L "$l" "$R$l"
done
mkdir -p "$R/etc/rdma"; cp -a /etc/rdma/. "$R/etc/rdma/" 2>/dev/null || true
ldconfig -r "$R" 2>/dev/null || true
echo "root:x:0:0:root:/root:/bin/sh" > "$R/etc/passwd"; echo "root:x:0:" > "$R/etc/group"
printf '127.0.0.1 localhost\n' > "$R/etc/hosts"

cp "$here/guest/init" "$R/init"; chmod +x "$R/init"
cp "$here/guest/lib.sh" "$R/lib.sh"
cp "$script" "$R/guest.sh"
# Uncompressed: the kernel unpacks it at once, where zstd would cost seconds of emulated CPU.
(cd "$R" && find . -print0 | cpio --null -o -H newc --quiet) > initramfs.cpio
