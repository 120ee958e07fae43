#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# libfabric's verbs provider over MetaRoCE (Debian's libfabric1 1.17, fi_pingpong from
# libfabric-bin): FI_EP_MSG endpoints (RC through the RDMA CM) and FI_EP_RDM (verbs with
# ofi_rxm), each of its 46 message sizes from 0 B to 6 MiB, data checked (-c). libfabric finds
# a device's IP address on a kernel interface (FI_VERBS_IFACE) and binds 127.0.0.1 to choose a
# device for its listener, so it runs in addr_ns.sh's namespace and through the CM's loopback
# rule (cm.md §1); the server's listener is on the first link, mrA, where the client's route to
# 198.18.0.1 goes too.
source "$(dirname "$0")/../integration/lib.sh"
command -v fi_pingpong >/dev/null || { echo "SKIP: fi_pingpong (libfabric-bin) is not installed"; exit 77; }
make_pair
source "$(dirname "$0")/addr_ns.sh"
export FI_VERBS_IFACE=va
run_in_ns fi_info -p verbs -t FI_EP_MSG >"$LOGDIR/fi_info" 2>&1 ||
  { cat "$LOGDIR/fi_info"; fail "fi_info finds no verbs MSG endpoint"; }
# Without an address it binds 127.0.0.1, the first link: mrA.
grep -q "domain: mrA\$" "$LOGDIR/fi_info" || fail "fi_info does not list mrA for FI_EP_MSG"
port=47600
for ep in msg rdm; do
  port=$((port + 1))
  run_in_ns timeout 120 fi_pingpong -p verbs -e $ep -B $port -I 50 -S all -c \
    >"$LOGDIR/$ep.server" 2>&1 &
  spid=$!
  PIDS+=("$spid")
  ns_wait_listen $port
  crc=0 src=0
  run_in_ns timeout 120 fi_pingpong -p verbs -e $ep -P $port -I 50 -S all -c 198.18.0.1 \
    >"$LOGDIR/$ep.client" 2>&1 || crc=$?
  wait "$spid" || src=$?
  [ "$crc" -eq 0 ] && [ "$src" -eq 0 ] ||
    { tail -n 15 "$LOGDIR/$ep.server" "$LOGDIR/$ep.client"
      fail "fi_pingpong -e $ep: server exit $src, client exit $crc"; }
  grep -E '^[0-9.]+[kmg]? +50 +=50 ' "$LOGDIR/$ep.client" | cut -d' ' -f1 >"$LOGDIR/$ep.sizes" || true
  [ "$(wc -l <"$LOGDIR/$ep.sizes")" -eq 46 ] ||
    { cat "$LOGDIR/$ep.client"; fail "fi_pingpong -e $ep: $(wc -l <"$LOGDIR/$ep.sizes") sizes of 46"; }
  echo "fi_pingpong -e $ep: $(head -n 1 "$LOGDIR/$ep.sizes") to $(tail -n 1 "$LOGDIR/$ep.sizes")" \
    "bytes, 46 sizes, every byte checked"
done
