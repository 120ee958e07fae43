#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# End-to-end check of the `metaroce` binary: links in a temporary run dir, discovered by the real
# libibverbs (ibv_devices). Usage: cli_test.sh PATH/TO/metaroce. Needs root (device nodes).
set -euo pipefail

M=${1:?usage: $0 PATH/TO/metaroce}
M=$(readlink -f "$M")
RUN=$(mktemp -d /tmp/metaroce-cli-it-XXXXXX)
export METAROCE_RUNDIR=$RUN
# `link add` starts the run dir's engine; it goes with the run dir.
trap '"$M" engine stop >/dev/null 2>&1 || true; rm -rf "$RUN"' EXIT
SYS=$RUN/sys

fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "ok: $*"; }
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root to create /dev/infiniband nodes"; exit 77; }

# expect STATUS CMD... : runs CMD, checks its exit status and, on failure, a single stderr line.
expect() {
  local want=$1; shift
  local got=0 err
  err=$("$@" 2>&1 >/dev/null) || got=$?
  [ "$got" = "$want" ] || fail "'$*' exited $got, expected $want (stderr: $err)"
  if [ "$want" != 0 ]; then
    [ "$(printf '%s\n' "$err" | wc -l)" = 1 ] || fail "'$*' printed more than one error line: $err"
    [[ $err == "metaroce: "* ]] || fail "'$*' error does not start with 'metaroce: ': $err"
  fi
}

expect 0 "$M" --version
expect 0 "$M" --help
expect 2 "$M" frobnicate
expect 2 "$M" link add mr0 --ip 10.0.0.1/24

# A bad engine option starts nothing and says why (metaroced's reason, on one line).
expect 1 "$M" engine start --datapath-threads 9
err=$("$M" engine start --datapath-threads 0 2>&1) && fail "engine start --datapath-threads 0 succeeded"
[[ $err == *"bad --datapath-threads '0': expected 1..8"* ]] ||
  fail "engine start --datapath-threads 0 gave no reason: $err"
for bad in -21 20 x ""; do
  err=$("$M" engine start --nice "$bad" 2>&1) && fail "engine start --nice '$bad' succeeded"
  [[ $err == *"bad --nice '$bad': expected -20..19"* ]] ||
    fail "engine start --nice '$bad' gave no reason: $err"
done
"$M" engine status >/dev/null 2>&1 && fail "an engine started with a bad option"

sock=metaroce-cli-$$
expect 0 "$M" link add mr0 --dpdk "net_memif0,role=server,socket=$sock" --ip 198.18.77.1/24
expect 0 "$M" link add mr1 --dpdk "net_memif1,role=client,socket=$sock" --ip 198.18.77.2/24 --mtu 4200 --paths 16
[ "$("$M" engine status --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["links"])')" = 2 ] ||
  fail "the engine does not serve both links"
# A device string the engine cannot open (the name is taken by mr0) fails the add, leaving no record.
expect 1 "$M" link add mr9 --dpdk "net_memif0,role=server,socket=$sock-9" --ip 198.18.77.9/24
[ ! -e "$SYS/class/infiniband/mr9" ] || fail "a link the engine could not open was left recorded"
pass "two links added"

uv=$(cat "$SYS/class/infiniband/mr0/metaroce.conf" | sed -n 's/^uverbs=//p')
[ -n "$uv" ] || fail "record of mr0 names no uverbs entry"
[ "$(cat "$SYS/class/infiniband_verbs/$uv/ibdev")" = mr0 ] || fail "$uv/ibdev is not mr0"
[ "$(cat "$SYS/class/infiniband_verbs/abi_version")" = 6 ] || fail "class abi_version is not 6"
[ "$(cat "$SYS/class/infiniband/mr0/ports/1/gids/0")" = 0000:0000:0000:0000:0000:ffff:c612:4d01 ] ||
  fail "GID 0 of mr0 is not ::ffff:198.18.77.1"
[ "$(cat "$SYS/class/infiniband/mr0/ports/1/gid_attrs/types/0")" = "RoCE v2" ] || fail "GID type"
[ -c "/dev/infiniband/$uv" ] || fail "/dev/infiniband/$uv is not a character device"
[ "$(stat -c '%t:%T %a' "/dev/infiniband/$uv")" = "1:7 666" ] || fail "/dev/infiniband/$uv is not 1:7 0666"
pass "sysfs tree and device node of mr0"

json=$("$M" link show --json)
n=$(printf '%s' "$json" | /usr/bin/python3 -c 'import json,sys; print(len(json.load(sys.stdin)))') ||
  fail "link show --json is not JSON: $json"
[ "$n" = 2 ] || fail "link show --json lists $n links, expected 2"
"$M" link show | grep -q '^mr1 .*198\.18\.77\.2/24.*4200' || fail "table does not show mr1"
pass "link show (table and JSON)"

before=$(cd "$SYS" && find . | sort | xargs -d '\n' md5sum 2>/dev/null || true)
expect 1 "$M" link add mr0 --dpdk net_memif1 --ip 198.18.77.9/24
expect 1 "$M" link add mr2 --dpdk net_memif1 --ip 198.18.77.1/24
expect 1 "$M" link add mr2 --dpdk net_memif1 --ip 198.18.77.9/24 --mtu 100000
expect 1 "$M" link add mr2 --dpdk 'net_memif1,role' --ip 198.18.77.9/24
expect 1 "$M" link add mr2 --dpdk net_nosuchdriver0 --ip 198.18.77.9/24
expect 1 "$M" link del nosuch
after=$(cd "$SYS" && find . | sort | xargs -d '\n' md5sum 2>/dev/null || true)
[ "$before" = "$after" ] || fail "a rejected command changed the run dir"
pass "bad input rejected, nothing changed"

# fabric run: a bad idle policy is refused, naming the option, before anything starts (no EAL,
# no state folder); a good one is what the fabric says it runs with.
expect_says() {
  local want=$1 text=$2; shift 2
  expect "$want" "$@"
  local err; err=$("$@" 2>&1 >/dev/null) || true
  [[ $err == *"$text"* ]] || fail "'$*' does not say '$text': $err"
}
fab=cli$$
expect_says 1 "bad --spin 'nap': expected adaptive or always" "$M" fabric run $fab --endpoints 2 --planes 1 --spin nap
expect_says 1 "bad --spin-us '-1'" "$M" fabric run $fab --endpoints 2 --planes 1 --spin-us -1
expect_says 1 "bad --spin-us '1000001'" "$M" fabric run $fab --endpoints 2 --planes 1 --spin-us 1000001
expect_says 1 "bad --max-nap-us '0'" "$M" fabric run $fab --endpoints 2 --planes 1 --max-nap-us 0
expect_says 1 "--spin-us applies to --spin adaptive only" \
  "$M" fabric run $fab --endpoints 2 --planes 1 --spin always --spin-us 50
expect_says 1 "--max-nap-us applies to --spin adaptive only" \
  "$M" fabric run $fab --endpoints 2 --planes 1 --spin always --max-nap-us 10
expect_says 2 "--spin needs a value" "$M" fabric run $fab --endpoints 2 --planes 1 --spin
[ ! -e "$RUN/fabric/$fab" ] || fail "a refused fabric run left its state folder"
pass "fabric run refuses bad idle policies"
got=0; out=$("$M" fabric run $fab --endpoints 2 --planes 1 --spin always --seconds 0.3 2>&1) || got=$?
if [[ $out == *"built without DPDK"* ]]; then
  pass "fabric run idle policies not started (built without DPDK)"
else
  [ "$got" = 0 ] && [[ $out == *"idle --spin always (never sleeps)"* ]] ||
    fail "fabric run --spin always: status $got, '$out'"
  out=$("$M" fabric run $fab --endpoints 2 --planes 1 --spin-us 20 --max-nap-us 200 --seconds 0.3 2>&1) ||
    fail "fabric run --spin-us 20 --max-nap-us 200: $out"
  [[ $out == *"idle --spin adaptive (polls 20 us, then naps up to 200 us)"* ]] ||
    fail "fabric run does not report its adaptive policy: $out"
  out=$("$M" fabric run $fab --endpoints 2 --planes 1 --seconds 0.3 2>&1) || fail "fabric run: $out"
  [[ $out == *"idle --spin adaptive (polls 100 us, then naps up to 1000 us)"* ]] ||
    fail "fabric run's default idle policy changed: $out"
  pass "fabric run starts with the idle policy it was given"
fi

if command -v setpriv >/dev/null; then
  got=0; err=$(setpriv --reuid=65534 --regid=65534 --clear-groups "$M" link add mr3 --dpdk net_memif3 \
    --ip 198.18.77.3/24 2>&1) || got=$?
  [ "$got" = 1 ] && [[ $err == *"permission denied"*"(run as root)"* ]] ||
    fail "non-root add: status $got, '$err'"
  pass "non-root add refused: $err"
fi

# libibverbs finds the devices from the generated tree (it needs a provider to list them; without
# one it warns by name).
warn=$(SYSFS_PATH=$SYS IBV_SHOW_WARNINGS=1 ibv_devices 2>&1 >/dev/null || true)
eval "$("$M" env)"
[ "$SYSFS_PATH" = "$SYS" ] || fail "metaroce env sets SYSFS_PATH=$SYSFS_PATH"
if [ -n "${RDMAV_DRIVERS:-}" ] && [ -e "$RDMAV_DRIVERS-rdmav34.so" ]; then
  ibv_devices | grep -qw mr0 || fail "ibv_devices with our provider does not list mr0"
  pass "ibv_devices lists mr0 through the MetaRoCE provider"
else
  [[ $warn == *"driver found for mr0"* ]] || fail "libibverbs did not discover mr0: $warn"
  pass "libibverbs discovers mr0 (no MetaRoCE provider built: '$warn')"
fi
unset RDMAV_DRIVERS
# A stock provider that matches by name proves the tree is complete enough to be listed.
if [ -e /etc/libibverbs.d/rxe.driver ]; then
  expect 0 "$M" link add rxe_probe --dpdk "net_memif4,role=server,socket=$sock-4" --ip 198.18.77.4/24
  SYSFS_PATH=$SYS ibv_devices | grep -qw rxe_probe || fail "ibv_devices does not list rxe_probe"
  pass "ibv_devices lists a generated device (stock librxe matched it by name)"
  expect 0 "$M" link del rxe_probe
fi

expect 0 "$M" link del mr0
expect 0 "$M" link del mr1
[ ! -e "$SYS/class/infiniband/mr0" ] && [ ! -e "$SYS/class/infiniband_verbs/$uv" ] ||
  fail "link del left parts of mr0"
[ "$("$M" link show --json | tr -d ' \n')" = "[]" ] || fail "links remain after del"
pass "link del"
echo "PASS: cli_test.sh"
