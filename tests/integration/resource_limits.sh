#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Resource limits (docs/spec/verbs-mapping.md §20): a link made with --limit and --process-limit;
# ibv_query_device reports the process's share and a process gets exactly that, then ENOMEM, for
# PDs, MRs and windows, CQs, QPs, SRQs and ring memory; two processes share the device's limit;
# a process killed while holding its share gives it back; bad limits are refused.
source "$(dirname "$0")/lib.sh"
PROG="$BUILD/tests/integration/resource_limits"
[ -x "$PROG" ] || fail "$PROG is not built"

# Bad limits: refused with a reason, nothing recorded.
for bad in "--limit qp=0" "--limit foo=3" "--limit qp" "--limit qp=12,cq=x" \
           "--limit qp=8 --process-limit qp=9" "--process-limit ring-mib=0"; do
  # shellcheck disable=SC2086
  if out=$("$METAROCE" link add mrX --dpdk "net_memif9,role=server,socket=lim-$$" \
             --ip 198.18.9.1/24 $bad 2>&1); then
    fail "link add accepted '$bad'"
  fi
  [[ $out == metaroce:*limit* ]] || fail "link add '$bad' said: $out"
  [ ! -e "$METAROCE_RUNDIR/sys/class/infiniband/mrX" ] || fail "'$bad' left a record"
done
echo "ok: bad limits refused"

make_pair --limit qp=48,cq=48,srq=16,pd=16,mr=64,ring-mib=64 \
          --process-limit qp=32,cq=32,srq=8,pd=8,mr=40,ring-mib=16
"$METAROCE" link show --json | grep -q '"process_limits": "qp=32,cq=32,srq=8,pd=8,mr=40,ring-mib=16"' ||
  fail "link show does not give the process limits: $("$METAROCE" link show --json)"
info=$(ibv_devinfo -d mrA -v)
for want in "max_qp:[[:space:]]*32" "max_cq:[[:space:]]*32" "max_srq:[[:space:]]*8" \
            "max_pd:[[:space:]]*8" "max_mr:[[:space:]]*40"; do
  grep -Eq "$want" <<<"$info" || fail "ibv_devinfo -v does not report $want"
done
echo "ok: ibv_devinfo reports the process's share"

timeout 120 "$PROG" --dev mrA --test exhaust >"$LOGDIR/exhaust" 2>&1 ||
  { cat "$LOGDIR/exhaust"; fail "exhaust"; }
cat "$LOGDIR/exhaust"

# Two processes share the device's 48 QPs: one holds its 32, the other gets 16.
"$PROG" --dev mrA --test hold 32 >"$LOGDIR/hold" 2>&1 &
holder=$!
PIDS+=("$holder")
for _ in $(seq 300); do grep -q '^HELD' "$LOGDIR/hold" && break; sleep 0.1; done
grep -q '^HELD 32$' "$LOGDIR/hold" || fail "the holder did not get its 32 QPs: $(cat "$LOGDIR/hold")"
out=$(timeout 60 "$PROG" --dev mrA --test qps)
# The second process also holds a CQ; the device counts 48 QPs (each process's PD and CQ aside).
[ "$out" = "QPS 16 errno 12" ] ||
  fail "with 32 QPs held elsewhere, a process got: $out (expected QPS 16 errno ENOMEM)"
echo "ok: two processes share the device's limit"
kill -9 "$holder"
wait "$holder" 2>/dev/null || true
# Its share comes back once the engine has reclaimed it.
for _ in $(seq 100); do
  out=$(timeout 60 "$PROG" --dev mrA --test qps)
  [ "$out" = "QPS 32 errno 12" ] && break
  sleep 0.1
done
[ "$out" = "QPS 32 errno 12" ] || fail "after the holder was killed a process got: $out"
echo "ok: a killed process's share comes back"
# The engine still serves traffic.
timeout 60 ibv_rc_pingpong -d mrA -g 0 -p 18720 -n 100 >"$LOGDIR/srv" 2>&1 &
srv=$!
sleep 0.5
timeout 60 ibv_rc_pingpong -d mrB -g 0 -p 18720 -n 100 127.0.0.1 >"$LOGDIR/cli" 2>&1 ||
  { cat "$LOGDIR/cli" "$LOGDIR/srv"; fail "ibv_rc_pingpong after the limits"; }
wait "$srv" || { cat "$LOGDIR/srv"; fail "ibv_rc_pingpong server"; }
echo "PASS resource_limits"
