#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The relocatable bundle (scripts/bundle, docs/bundle.md) on a host that has none of what it
# carries: built from the build folder, unpacked into a fresh folder and run in a private mount
# namespace where every file of the host's rdma-core, perftest and DPDK packages, every host
# library the bundle carries, the repository and the build folder are hidden behind empty bind
# mounts. There: two memif devices, ib_write_bw and ibv_rc_pingpong -c between them, every
# library a verbs program and the engine load is the bundle's (or glibc/libstdc++), and
# bench/gpu/run --cpu --quick (a ring all-reduce over verbs clean, through a fabric with a core
# link black-holed mid-run and with 1 % loss; bench/run's latency table). After `engine stop`
# nothing of the bundle runs and nothing is left outside the bundle and its run dir.
# Usage: bundle.sh BUILD_DIR. Needs root (mount namespace); skipped (77) otherwise.
set -euo pipefail

BUILD=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "bundle: needs root for a mount namespace: skipped"; exit 77; }
work=$(mktemp -d /tmp/metaroce-bundle-test.XXXXXX)
cleanup() {
  local rc=$?
  set +e
  if [ "$rc" -ne 0 ]; then
    for f in "$work"/logs/*; do [ -f "$f" ] && { echo "== $f"; tail -n 30 "$f"; }; done
    [ -f "$work/run/engine.log" ] && { echo "== engine log"; tail -n 30 "$work/run/engine.log"; }
  fi
  pkill -KILL -f -- "$work/unpacked/" 2>/dev/null
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
fail() { echo "FAIL bundle: $*" >&2; exit 1; }
mkdir -p "$work/logs" "$work/unpacked"

# A sanitizer's runtime must not follow the programs into the namespace: the bundle is the
# build's programs stripped, and the sanitized suite does not run this test.
unset LD_PRELOAD
"$REPO/scripts/bundle" "$BUILD" "$work/metaroce.tar.gz" >"$work/logs/bundle" 2>&1 ||
  fail "scripts/bundle: $(tail -n 5 "$work/logs/bundle")"
tar -C "$work/unpacked" -xzf "$work/metaroce.tar.gz"
b=$(echo "$work"/unpacked/metaroce-*)
[ -x "$b/bin/metaroce" ] && [ -f "$b/share/metaroce/bundle" ] || fail "the tarball has no bin/metaroce"

# What the namespace hides: the files of the packages a bundle replaces, and the host's copies
# of the libraries it carries (their resolved paths; a bind mount over a link covers its target),
# except those the test's own tools need (python3 needs libz, say): that the bundle's programs
# load none of those is checked from what they map.
sys_path=/usr/sbin:/usr/bin:/sbin:/bin  # the namespace's PATH after the bundle's bin/
keep=$(for t in python3 bash ss pgrep find sort sed grep awk xargs readlink comm du cmp diff \
         env timeout tar mount sleep gnuplot; do PATH=$sys_path command -v "$t"; done |
       cat - <(ls /usr/lib/python3*/lib-dynload/*.so 2>/dev/null) |
       while read -r p; do ldd "$p" 2>/dev/null | awk '$2 == "=>" {print $3}'; done |
       xargs -r readlink -f | sort -u)
dpdk_packages=$(dpkg-query -W -f '${Package}\n' 'librte-*' 'dpdk*' 2>/dev/null || true)
packages=(libibverbs1 librdmacm1 libibumad3 ibverbs-providers ibverbs-utils perftest rdmacm-utils
          libnl-3-200 libnl-route-3-200 $dpdk_packages)
{
  for p in "${packages[@]}"; do dpkg -L "$p" 2>/dev/null || true; done
  cat "$b/share/metaroce/manifest"
} | while read -r f; do
  [ -e "$f" ] || continue
  r=$(readlink -f "$f")
  [ -f "$r" ] && echo "$r"
done | sort -u | comm -23 - <(echo "$keep") >"$work/hide.list"
[ "$(wc -l <"$work/hide.list")" -gt 50 ] || fail "only $(wc -l <"$work/hide.list") files to hide: the packages are not installed?"

cat >"$work/inner.sh" <<'EOF'
set -euo pipefail
work=$1 b=$2 repo=$3 build=$4 sys_path=$5
fail() { echo "FAIL bundle: $*" >&2; exit 1; }
while read -r f; do mount --bind /dev/null "$f"; done <"$work/hide.list"
mount -t tmpfs none "$repo"
case $build in "$repo"/*) ;; *) mount -t tmpfs none "$build" ;; esac
[ -d /etc/libibverbs.d ] && mount -t tmpfs none /etc/libibverbs.d
export METAROCE_RUNDIR=$work/run PATH="$b/bin:$sys_path"
cd "$work"
logs=$work/logs
# What exists where a program could leave something (the DPDK runtime folder is under /run,
# hugepage and memif files under /dev/shm and /dev/hugepages): everything there, and the
# entries of /tmp itself (its subfolders are other programs' business, a CI checkout's too).
watched=()
for d in /var/tmp /run /dev/shm /dev/hugepages; do [ -d "$d" ] && watched+=("$d"); done
# (/dev/infiniband may only appear with the first `link add`: listed whether or not it exists.)
entries() {
  { find "${watched[@]}" -xdev 2>/dev/null || true; find /dev/infiniband 2>/dev/null || true
    find /tmp -mindepth 1 -maxdepth 1 -not -path "$work"; } | sort
}
entries >"$work/entries.before"

metaroce link add mr0 --ip 198.18.44.1/24 --dpdk "net_memif0,role=server,socket=mr-bundle-$$"
metaroce link add mr1 --ip 198.18.44.2/24 --dpdk "net_memif1,role=client,socket=mr-bundle-$$"

# Every library a verbs program loads is the bundle's, or the host's glibc and C++ runtime.
LD_DEBUG=libs metaroce exec -- ibv_devinfo -d mr0 >"$logs/devinfo" 2>&1 || fail "ibv_devinfo failed"
grep -q 'transport:.*InfiniBand\|hca_id:.*mr0' "$logs/devinfo" || fail "ibv_devinfo did not list mr0"
# (The log holds both `metaroce exec` and ibv_devinfo: every library either of them loaded.)
loaded=$(sed -n 's/.*calling init: //p' "$logs/devinfo" | xargs -r readlink -f | sort -u)
grep -q "^$b/lib/libmetaroce.so.1$" <<<"$loaded" || fail "the provider was not loaded from the bundle: $loaded"
grep -q "^$b/lib/libibverbs.so.1$" <<<"$loaded" || fail "libibverbs was not the bundle's: $loaded"
foreign=$(grep -v "^$b/" <<<"$loaded" | grep -vE '/(ld-linux-x86-64|libc|libm|libstdc\+\+|libgcc_s)\.so\.[0-9.]+$' || true)
[ -z "$foreign" ] || fail "host libraries loaded: $foreign"
engine=$(pgrep -f "^$b/bin/metaroced" | head -n 1)
[ -n "$engine" ] || fail "no engine from the bundle runs"
grep -q "$b/lib/private/librte_eal" "/proc/$engine/maps" || fail "the engine's DPDK is not the bundle's"
grep -q "$b/lib/private/librte_net_memif" "/proc/$engine/maps" || fail "the engine has not the bundle's memif driver"

# ib_write_bw, then ibv_rc_pingpong with every buffer checked.
port=$((19000 + $$ % 500))
timeout 60 metaroce exec -- ib_write_bw -d mr0 -x 0 -p $port -s 65536 -D 2 >"$logs/bw.server" 2>&1 &
server=$!
for _ in $(seq 100); do ss -ltn | grep -q ":$port " && break; sleep 0.1; done
timeout 60 metaroce exec -- ib_write_bw -d mr1 -x 0 -p $port -s 65536 -D 2 127.0.0.1 >"$logs/bw.client" 2>&1 ||
  fail "ib_write_bw client failed"
wait "$server" || fail "ib_write_bw server failed"
grep -qE '^ *65536 +[0-9]+' "$logs/bw.client" || fail "ib_write_bw printed no result"
port=$((port + 1))
timeout 60 metaroce exec -- ibv_rc_pingpong -g 0 -d mr0 -p $port -c -n 500 >"$logs/pp.server" 2>&1 &
server=$!
for _ in $(seq 100); do ss -ltn | grep -q ":$port " && break; sleep 0.1; done
timeout 60 metaroce exec -- ibv_rc_pingpong -g 0 -d mr1 -p $port -c -n 500 127.0.0.1 >"$logs/pp.client" 2>&1 ||
  fail "ibv_rc_pingpong -c client failed"
wait "$server" || fail "ibv_rc_pingpong -c server failed"
grep -q '500 iters' "$logs/pp.client" || fail "ibv_rc_pingpong did not complete its iterations"
metaroce link del mr0
metaroce link del mr1
metaroce engine stop

# The GPU machine's script, its CPU part (its own devices, engine and bench/run run).
"$b/share/metaroce/bench/gpu/run" --cpu --quick --out "$work/gpu" >"$logs/gpu-run" 2>&1 ||
  fail "bench/gpu/run --cpu --quick: $(tail -n 12 "$logs/gpu-run")"
[ "$(ls "$work/gpu")" = "$(printf 'collectives.png\ndetails.tar.gz\nresults.json')" ] ||
  fail "gpu/run left $(ls "$work/gpu" | tr '\n' ' ')instead of its three files"
python3 - "$work/gpu/results.json" <<'PY' || fail "gpu/run's results: $(cat "$logs/gpu-run")"
import json, sys
r = json.load(open(sys.argv[1]))
cases = r["collectives"]
assert set(cases) == {"ring_memif", "ring_fabric_blackhole", "ring_fabric_loss1"}, cases.keys()
assert all(len(rows) >= 3 for rows in cases.values()), cases
assert r["wrong_elements"] == 0 and not r["failed"], r
assert any(row["figure"].startswith("ib_send_lat") for row in r["bench"]["latency"]), r["bench"]
assert r["memory_probe"][0]["process_vm_readv"]["content_matches"], r["memory_probe"]
PY
# The GPU-only parts cannot run here: parsed, so that they are at least valid Python.
for f in "$b"/share/metaroce/bench/gpu/*.py; do
  python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$f" || fail "$f does not parse"
done

# Nothing of the bundle runs; nothing left outside the bundle and the run dir.
sleep 0.5
left=$(pgrep -af -- "$b/" || true)
[ -z "$left" ] || fail "still running after engine stop: $left"
new=$(entries | comm -13 "$work/entries.before" -)
[ -z "$new" ] || fail "left outside the bundle and its run dir: $new"
echo "bundle: ok ($(du -sh "$b" | cut -f1) unpacked)"
EOF
unshare -m --propagation private bash ${BUNDLE_TRACE:+-x} "$work/inner.sh" "$work" "$b" "$REPO" "$BUILD" "$sys_path" ||
  fail "inside the namespace (above)"
echo "bundle: $(stat -c %s "$work/metaroce.tar.gz") bytes packed, $(wc -l <"$work/hide.list") host files hidden"
