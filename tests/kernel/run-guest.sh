#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Boots WORK_DIR/vmlinuz with WORK_DIR/initramfs.cpio (build-initramfs.sh) under qemu and prints
# the guest's console; exits 0 only when the guest script finished and every RESULT line says
# PASS. No network device: every packet stays inside the guest.
#   run-guest.sh WORK_DIR LOG [TIMEOUT_S]
# TCG by default: this host's /dev/kvm cannot run an unmodified kernel (shared/tools/kernel-guest).
# SMP (2), MEM (2048 MiB) and KG_APPEND (extra kernel arguments, read by the guest script) apply.
# The TSC is declared reliable: under TCG the kernel otherwise falls back to the emulated HPET,
# and every clock_gettime becomes a trapped device read (ib_write_bw 64 KiB over MetaRoCE moved
# 4.3 MB/s that way against 19.3 with the TSC, in one guest each; rxe reads clocks too).
set -uo pipefail
work=$1
log=$2
limit=${3:-900}
qemu=(qemu-system-x86_64 -accel tcg,thread=multi,tb-size=512 -cpu max -smp "${SMP:-2}"
      -m "${MEM:-2048}" -machine q35 -nographic -no-reboot -nic none -monitor none
      -serial stdio -kernel "$work/vmlinuz" -initrd "$work/initramfs.cpio"
      -append "console=ttyS0 panic=-1 quiet loglevel=3 tsc=reliable clocksource=tsc ${KG_APPEND:-}")
timeout "$limit" "${qemu[@]}" < /dev/null 2>&1 | tr -d '\r' | tee "$log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "run-guest: qemu exited $rc (124: the guest ran past ${limit}s)"; exit 1; }
grep -q '^=== guest.sh exited' "$log" || { echo "run-guest: the guest script did not finish"; exit 1; }
grep -q '^RESULT ' "$log" || { echo "run-guest: no results"; exit 1; }
if grep -E '^RESULT [^ ]+ FAIL' "$log"; then exit 1; fi
exit 0
