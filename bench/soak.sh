#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The fault soak (issue 15): RC (WRITE, READ, SEND), SRQ and UD traffic with every byte checked
# (bench/soak_traffic.cc), between two hosts — two engines, each with its own run dir and device
# — through a 2-plane fabric emulator with random loss, duplication and reordering on every core
# link, while a fault loop flaps core links, whole fabric planes and a device's planes, and a
# traffic process (each in turn) is killed with SIGKILL mid-transfer and restarted.
#
#   bench/soak.sh BUILD_DIR [--seconds S] [--loss P] [--duplicate P] [--reorder P]
#                 [--kill-every S] [--victims NAME,...] [--fault-every S] [--no-flaps]
#                 [--seed N] [--keep DIR]
#
# S defaults to 600. At the end every traffic process must have finished by itself (a hang is
# bounded and fails), nothing must have been corrupted, every fault must have struck (frames
# lost, duplicated, reordered and black-holed, each kill seen by the victim's peer), and both
# engines must hold what they held before the soak: no context (session), PD, MR, CQ, SRQ or QP,
# the same open descriptors and threads, no QP in their telemetry. Prints a summary (bytes
# checked per kind, faults, counters; JSON in DIR/summary.json with --keep) and exits 1 on any
# failure. --victims, --no-flaps and zero fault rates are for chasing a failure: the verdict
# then fails on the faults that never struck. The `soak` test of the integration suite runs
# it for 60 s (2 kills: the RC client, the SRQ server; ~10 flaps).
set -euo pipefail

BUILD=$(cd "${1:?usage: $0 BUILD_DIR [--seconds S] ...}" && pwd)
shift
DURATION=600 LOSS=0.01 DUP=0.01 REORDER=0.02 KILL_EVERY=30 FAULT_EVERY=4 SEED=$$ KEEP=""
# Each traffic process in turn (--victims narrows it down, to chase a failure).
VICTIMS=(rc-client srq-server ud-client rc-server srq-client ud-server)
FLAPS=1
while [ $# -gt 0 ]; do
  case $1 in
    --no-flaps) FLAPS=0; shift; continue ;;
    --victims) IFS=, read -r -a VICTIMS <<<"$2" ;;
    --seconds) DURATION=$2 ;;
    --loss) LOSS=$2 ;;
    --duplicate) DUP=$2 ;;
    --reorder) REORDER=$2 ;;
    --kill-every) KILL_EVERY=$2 ;;
    --fault-every) FAULT_EVERY=$2 ;;
    --seed) SEED=$2 ;;
    --keep) KEEP=$2 ;;
    *) echo "soak: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2 || { echo "soak: $1 needs a value" >&2; exit 2; }
done
[[ $DURATION =~ ^[0-9]+$ && $DURATION -ge 20 ]] || { echo "soak: --seconds must be >= 20" >&2; exit 2; }

M="$BUILD/util/metaroce"
TRAFFIC="$BUILD/bench/soak_traffic"
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
[ -x "$TRAFFIC" ] && [ -x "$BUILD/datapath/fabric/fabric_probe" ] ||
  { echo "SKIP: built without DPDK or libibverbs (no soak_traffic or fabric)"; exit 77; }

ROOT=$(mktemp -d /tmp/metaroce-soak.XXXXXX)
RA="$ROOT/hostA" RB="$ROOT/hostB" LOG="$ROOT/logs"
mkdir -p "$RA" "$RB/fabric" "$LOG"
FAB="soak$$"
PORT0=19410
FABRIC_PID="" FAULT_PID="" ENGINE_PIDS=""
declare -A PID=() RUNS=()
FAILED=0

fail() { echo "FAIL soak: $*" >&2; FAILED=1; }
on() { local host=$1; shift; METAROCE_RUNDIR="$host" "$M" "$@"; }

cleanup() {
  local rc=$?
  set +e
  [ -n "$FAULT_PID" ] && kill "$FAULT_PID" 2>/dev/null && wait "$FAULT_PID" 2>/dev/null
  for p in "${PID[@]}"; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  if [ "$rc" -ne 0 ]; then
    echo "--- soak logs ($LOG) ---"
    for f in "$LOG"/*.log; do
      [ -f "$f" ] && { echo "== $f"; grep -m 10 '^FAIL' "$f"; tail -n 3 "$f"; }
    done
    for h in "$RA" "$RB"; do
      [ -f "$h/engine.log" ] && { echo "== engine log of $h"; tail -n 25 "$h/engine.log"; }
    done
  fi
  on "$RA" link del sA >/dev/null 2>&1
  on "$RB" link del sB >/dev/null 2>&1
  on "$RA" engine stop >/dev/null 2>&1
  on "$RB" engine stop >/dev/null 2>&1
  # An engine the CLI could not stop goes with its run dir (only ours: its command line names it).
  for p in $ENGINE_PIDS; do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$ROOT/" && kill -KILL "$p"
  done
  if [ -n "$FABRIC_PID" ]; then
    on "$RA" fabric stop "$FAB" >/dev/null 2>&1 || kill "$FABRIC_PID" 2>/dev/null
    wait "$FABRIC_PID" 2>/dev/null
  fi
  if [ -n "$KEEP" ]; then
    mkdir -p "$KEEP" && cp -r "$LOG"/. "$KEEP"/
    cp "$RA/engine.log" "$KEEP/engine-A.log" 2>/dev/null
    cp "$RB/engine.log" "$KEEP/engine-B.log" 2>/dev/null
  fi
  rm -rf "$ROOT"
  exit "$rc"
}
trap cleanup EXIT

# --- two hosts on one fabric ---------------------------------------------------------------------
METAROCE_RUNDIR="$RA" timeout -s INT $((DURATION + 600)) "$M" fabric run "$FAB" --endpoints 2 --planes 2 \
  --links-per-plane 4 --loss "$LOSS" --duplicate "$DUP" --reorder "$REORDER" \
  --reorder-delay 200 --seed "$SEED" >"$LOG/fabric.log" 2>&1 &
FABRIC_PID=$!   # its state lives in host A's run dir
for _ in $(seq 150); do
  [ -S "$RA/fabric/$FAB/control" ] && [ -f "$RA/fabric/$FAB/pid" ] && break
  kill -0 "$FABRIC_PID" 2>/dev/null || { cat "$LOG/fabric.log"; exit 1; }
  sleep 0.1
done
# Host B finds the same fabric (its memif sockets are abstract names) through its own run dir.
ln -s "$RA/fabric/$FAB" "$RB/fabric/$FAB"
on "$RA" link add sA --fabric "$FAB:0" --ip 198.18.0.1/24 >/dev/null
on "$RB" link add sB --fabric "$FAB:1" --ip 198.18.0.2/24 >/dev/null

# resources HOST DEV: one JSON object of what the engine of HOST holds.
resources() {
  local host=$1 dev=$2 epid
  epid=$(on "$host" engine status --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
  {
    on "$host" engine status --json
    echo "@@"
    on "$host" stat "$dev" --json
    echo "@@"
    echo "$epid $(ls /proc/"$epid"/fd | wc -l) $(ls /proc/"$epid"/task | wc -l) $(wc -l <"/proc/$epid/maps") $(awk '/VmRSS/ {print $2}' /proc/"$epid"/status)"
  } | "$PY" -c '
import json, sys
status, stat, proc = sys.stdin.read().split("@@")
status, stat = json.loads(status), json.loads(stat)
counters = stat["counters"]
pid, fds, threads, maps, rss = map(int, proc.split())
objs = {k: sum(c[k] for c in status["contexts"]) for k in ("pds", "mrs", "cqs", "srqs", "qps")}
print(json.dumps({"engine_pid": pid, "contexts": len(status["contexts"]), **objs,
                  "telemetry_qps": counters.get("qps", 0), "telemetry_contexts": counters.get("contexts", 0),
                  "connections": len(stat["connections"]),
                  "fds": fds, "threads": threads, "maps": maps, "rss_kib": rss,
                  "counters": counters}))'
}
BASE_A=$(resources "$RA" sA)
BASE_B=$(resources "$RB" sB)
ENGINE_PIDS=$(for b in "$BASE_A" "$BASE_B"; do "$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["engine_pid"])' "$b"; done)
echo "soak: ${DURATION} s, seed $SEED (--seed $SEED repeats the fabric's draws), logs in $LOG"
echo "before: host A $(echo "$BASE_A" | cut -c1-200)"
echo "before: host B $(echo "$BASE_B" | cut -c1-200)"

# --- traffic ----------------------------------------------------------------------------------
UNTIL=$(( $(date +%s) + DURATION ))
# name host dev role kind port: where each traffic process runs. Servers of rc and ud on A,
# of srq on B, so that both directions carry data.
PROCS=(
  "rc-server $RA sA server rc 0"  "rc-client $RB sB client rc 0"
  "srq-server $RB sB server srq 1" "srq-client $RA sA client srq 1"
  "ud-server $RA sA server ud 2"  "ud-client $RB sB client ud 2"
)
start() {
  local name=$1 spec host dev role kind off
  for spec in "${PROCS[@]}"; do
    read -r n host dev role kind off <<<"$spec"
    [ "$n" = "$name" ] || continue
    RUNS[$name]=$(( ${RUNS[$name]:-0} + 1 ))
    local args=(--kind "$kind" --dev "$dev" --port $((PORT0 + off)))
    if [ "$role" = server ]; then args+=(--server); else args+=(--connect 127.0.0.1 --until "$UNTIL"); fi
    METAROCE_RUNDIR="$host" "$M" exec -- "$TRAFFIC" "${args[@]}" \
      >"$LOG/$name.${RUNS[$name]}.log" 2>&1 &
    PID[$name]=$!
    return 0
  done
}
for port in $PORT0 $((PORT0 + 1)) $((PORT0 + 2)); do
  ! ss -ltnH "sport = :$port" | grep -q . || { echo "soak: TCP port $port is taken" >&2; exit 1; }
done
for spec in "${PROCS[@]}"; do read -r n _ <<<"$spec"; [[ $n == *-server ]] && start "$n"; done
for port in $PORT0 $((PORT0 + 1)) $((PORT0 + 2)); do
  for _ in $(seq 100); do ss -ltnH "sport = :$port" | grep -q . && break; sleep 0.1; done
done
for spec in "${PROCS[@]}"; do read -r n _ <<<"$spec"; [[ $n == *-client ]] && start "$n"; done

# --- faults: link flaps, fabric plane flaps, device plane flaps, one at a time -----------------
fault_loop() {
  local i=0 p c
  while [ "$(date +%s)" -lt $((UNTIL - 5)) ]; do
    printf '%4d s: ' $(( $(date +%s) - UNTIL + DURATION ))
    p=$((RANDOM % 2))
    case $((i % 3)) in
      0) c=$((RANDOM % 4))
         on "$RA" fabric set "$FAB" --plane $p --link core$c down >/dev/null
         echo "link-flap p$p.core$c"; sleep 1.5
         on "$RA" fabric set "$FAB" --plane $p --link core$c up >/dev/null ;;
      1) on "$RA" fabric set "$FAB" --plane $p down >/dev/null
         echo "plane-flap fabric plane $p"; sleep 1.5
         on "$RA" fabric set "$FAB" --plane $p up >/dev/null ;;
      2) if [ $((i / 3 % 2)) = 0 ]; then h=$RA d=sA; else h=$RB d=sB; fi
         on "$h" link set $d --plane $p down >/dev/null
         echo "plane-flap device $d plane $p"; sleep 1.5
         on "$h" link set $d --plane $p up >/dev/null ;;
    esac
    i=$((i + 1))
    sleep "$FAULT_EVERY"
  done
}
if [ "$FLAPS" = 1 ]; then
  fault_loop >"$LOG/faults.log" 2>&1 &
  FAULT_PID=$!
else
  : >"$LOG/faults.log"
fi

# --- kills: each traffic process in turn, SIGKILL mid-run, restarted at once -------------------
KILLS=0
next_kill=$(( $(date +%s) + KILL_EVERY / 2 )) next_sample=$(( $(date +%s) + 30 ))
while [ "$(date +%s)" -lt "$UNTIL" ]; do
  for n in "${!PID[@]}"; do
    kill -0 "${PID[$n]}" 2>/dev/null && continue
    wait "${PID[$n]}" && rc=0 || rc=$?
    fail "$n exited ($rc) before the end: $(tail -n 5 "$LOG/$n.${RUNS[$n]}.log")"
    exit 1
  done
  if [ "$(date +%s)" -ge "$next_kill" ] && [ "$(date +%s)" -lt $((UNTIL - 10)) ]; then
    v=${VICTIMS[$((KILLS % ${#VICTIMS[@]}))]}
    kill -KILL "${PID[$v]}"
    wait "${PID[$v]}" 2>/dev/null || true
    KILLS=$((KILLS + 1))
    echo "kill $KILLS: $v (pid ${PID[$v]}) at $(( $(date +%s) - UNTIL + DURATION )) s" >>"$LOG/kills.log"
    start "$v"
    next_kill=$(( $(date +%s) + KILL_EVERY ))
  fi
  if [ "$(date +%s)" -ge "$next_sample" ]; then  # the engines' memory over the run, for the record
    echo "$(( $(date +%s) - UNTIL + DURATION )) $(resources "$RA" sA) $(resources "$RB" sB)" >>"$LOG/resources.log"
    next_sample=$(( $(date +%s) + 30 ))
  fi
  sleep 1
done
[ -n "$FAULT_PID" ] && { wait "$FAULT_PID" 2>/dev/null || true; }
FAULT_PID=""

# --- the end: every process finishes by itself (bounded), then the engines hold nothing --------
for n in rc-client srq-client ud-client rc-server srq-server ud-server; do
  for _ in $(seq 1200); do kill -0 "${PID[$n]}" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "${PID[$n]}" 2>/dev/null; then
    fail "$n (pid ${PID[$n]}) hangs 120 s after the end"
    kill -KILL "${PID[$n]}" 2>/dev/null || true
  fi
  wait "${PID[$n]}" && rc=0 || rc=$?
  [ "$rc" = 0 ] || fail "$n exited with $rc: $(grep -m5 FAIL "$LOG/$n.${RUNS[$n]}.log" || tail -n 3 "$LOG/$n.${RUNS[$n]}.log")"
  unset "PID[$n]"
done
# A process's objects are released when the engine sees it exit (its pidfd), and the telemetry
# is refreshed every 100 ms: wait (30 s at most) for the counts to come back; the verdict below
# reports any that did not.
COUNTED='("contexts", "pds", "mrs", "cqs", "srqs", "qps", "telemetry_qps", "telemetry_contexts", "connections", "fds", "threads")'
settle=$(( $(date +%s) + 30 ))
while :; do
  AFTER_A=$(resources "$RA" sA)
  AFTER_B=$(resources "$RB" sB)
  "$PY" -c '
import json, sys
b, a = [json.loads(x) for x in sys.argv[2:4]], [json.loads(x) for x in sys.argv[4:6]]
sys.exit(0 if all(a[i][k] == b[i][k] for i in (0, 1) for k in '"$COUNTED"') else 1)' \
    - "$BASE_A" "$BASE_B" "$AFTER_A" "$AFTER_B" && break
  [ "$(date +%s)" -lt "$settle" ] || break
  sleep 0.3
done

# --- the verdict -------------------------------------------------------------------------------
on "$RA" fabric stat "$FAB" --json >"$LOG/fabric.json"
"$PY" - "$LOG" "$BASE_A" "$BASE_B" "$AFTER_A" "$AFTER_B" "$KILLS" "$DURATION" "$FAILED" <<'EOF'
import glob, json, os, re, sys
log, base_a, base_b, after_a, after_b, kills, duration, failed = sys.argv[1:]
base = {"A": json.loads(base_a), "B": json.loads(base_b)}
after = {"A": json.loads(after_a), "B": json.loads(after_b)}
kills, failed = int(kills), int(failed)
problems = []

# Traffic: the last line of each run of each process (a killed one's last progress line).
tot, per = {}, {}
for f in sorted(glob.glob(os.path.join(log, "*-*.*.log"))):
    last = None
    for line in open(f, errors="replace"):
        m = re.match(r"^(progress|result) (\{.*\})$", line.strip())
        if m:
            last = (m[1], json.loads(m[2]))
        if line.startswith("FAIL"):
            problems.append(os.path.basename(f) + ": " + line.strip())
    if last is None:
        continue
    kind, rec = last
    for k, v in rec.items():
        if isinstance(v, int) and k != "pid":
            tot[k] = tot.get(k, 0) + v
    name = os.path.basename(f).split(".")[0]
    per.setdefault(name, []).append(kind)
for name in ("rc-server", "rc-client", "srq-server", "srq-client", "ud-server", "ud-client"):
    if per.get(name, [None])[-1] != "result":
        problems.append(f"{name}: its last run printed no result")
checked = {"rc_write": tot.get("bytes_write", 0), "rc_read": tot.get("bytes_read", 0),
           "rc_send": tot.get("bytes_send", 0), "srq_send": tot.get("bytes_srq", 0),
           "ud": tot.get("bytes_ud", 0)}
for k, v in checked.items():
    if v == 0:
        problems.append(f"no {k} bytes were checked")
if tot.get("failures", 0):
    problems.append(f"{tot['failures']} failed checks in the traffic")

# Faults: each kind struck.
fab = json.load(open(os.path.join(log, "fabric.json")))
links = fab["links"]
faults = {k: sum(l[k] for l in links) for k in ("drop_loss", "duplicated", "reordered", "drop_down")}
flaps = {"link": 0, "fabric_plane": 0, "device_plane": 0}
for line in open(os.path.join(log, "faults.log")):
    line = line.split(": ", 1)[-1]
    if line.startswith("link-flap"): flaps["link"] += 1
    elif line.startswith("plane-flap fabric"): flaps["fabric_plane"] += 1
    elif line.startswith("plane-flap device"): flaps["device_plane"] += 1
    elif line.strip(): problems.append("fault loop: " + line.strip())
for k, v in list(faults.items()) + list(flaps.items()):
    if v == 0:
        problems.append(f"fault {k} never struck")
if kills == 0:
    problems.append("no process was killed")
if tot.get("sessions_lost", 0) < kills:
    problems.append(f"{kills} kills but only {tot.get('sessions_lost', 0)} sessions cut at the peers")

# Resources: back to the counts before the soak.
for h in ("A", "B"):
    b, a = base[h], after[h]
    if a["engine_pid"] != b["engine_pid"]:
        problems.append(f"host {h}: the engine was replaced ({b['engine_pid']} -> {a['engine_pid']})")
    for k in ("contexts", "pds", "mrs", "cqs", "srqs", "qps", "telemetry_qps", "telemetry_contexts",
              "connections", "fds", "threads"):
        if a[k] != b[k]:
            problems.append(f"host {h}: {k} {b[k]} before the soak, {a[k]} after")

engine = {h: {k: after[h]["counters"].get(k, 0) - base[h]["counters"].get(k, 0)
              for k in ("rx_packets", "retransmits", "duplicates", "timeouts", "paths_failed",
                        "paths_recovered", "failover_resends", "engine_stalls", "drop_unknown_conn",
                        "rx_drop_malformed")}
          for h in ("A", "B")}
summary = {"seconds": int(duration), "bytes_checked": checked,
           "bytes_checked_total": sum(checked.values()), "messages_checked": tot.get("msgs", 0),
           "ud_lost": tot.get("ud_lost", 0), "credits_waited": tot.get("credits_waited", 0),
           "sessions": tot.get("sessions", 0),
           "sessions_cut": tot.get("sessions_lost", 0), "kills": kills,
           "fabric_faults": faults, "flaps": flaps, "engine_counters": engine,
           "resources_before": {h: {k: v for k, v in base[h].items() if k != "counters"} for h in base},
           "resources_after": {h: {k: v for k, v in after[h].items() if k != "counters"} for h in after},
           "problems": problems}
json.dump(summary, open(os.path.join(log, "summary.json"), "w"), indent=1)
mib = lambda b: f"{b / 2**20:.1f} MiB"
print(f"soak: {duration} s, {tot.get('sessions', 0)} sessions, {tot.get('msgs', 0)} messages checked")
print("  bytes checked: " + ", ".join(f"{k} {mib(v)}" for k, v in checked.items()) +
      f" (total {mib(sum(checked.values()))})")
print(f"  UD datagrams lost: {tot.get('ud_lost', 0)}; credits that waited for send-queue room: "
      f"{tot.get('credits_waited', 0)}")
print("  fabric: " + ", ".join(f"{k} {v}" for k, v in faults.items()))
print("  flaps: " + ", ".join(f"{k} {v}" for k, v in flaps.items()) +
      f"; kills {kills}, sessions cut {tot.get('sessions_lost', 0)}")
for h in ("A", "B"):
    print(f"  engine {h}: " + ", ".join(f"{k} {v}" for k, v in engine[h].items()))
    print(f"  resources {h} before/after: " + ", ".join(
        f"{k} {base[h][k]}/{after[h][k]}" for k in ("contexts", "pds", "mrs", "cqs", "srqs", "qps",
                                                   "fds", "threads", "maps", "rss_kib")))
samples = [l.split(" ", 1) for l in open(os.path.join(log, "resources.log"))] \
    if os.path.exists(os.path.join(log, "resources.log")) else []
if samples:
    dec = json.JSONDecoder()
    rss = []
    for t, rest in samples:
        a, end = dec.raw_decode(rest)
        b, _ = dec.raw_decode(rest[end:].lstrip())
        rss.append(f"{t} s: {a['rss_kib'] // 1024}/{b['rss_kib'] // 1024}")
    print("  engine RSS A/B in MiB over the run: " + ", ".join(rss))
for p in problems:
    print("FAIL soak: " + p)
sys.exit(1 if problems or failed else 0)
EOF
echo "PASS soak"
