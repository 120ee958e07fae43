# SPDX-License-Identifier: Apache-2.0
# Helpers of the guest scripts (sourced): results, the veth pair, GIDs, ports.
# Debian's busybox runs its own applets before PATH: the real iproute2 by full path.
ip() { /usr/local/bin/ip "$@"; }
K=$(uname -r)
failures=0

# result NAME STATUS [DETAIL]: one line the host collects (RESULT NAME PASS|FAIL ...).
result() {
  echo "RESULT $1 $2 ${3:-}"
  [ "$2" = PASS ] || failures=$((failures + 1))
}
# check NAME CMD...: runs CMD (output to /tmp/NAME.log, shown on failure) and records it.
check() {
  local check_name=$1 rc; shift
  if "$@" > "/tmp/$check_name.log" 2>&1; then
    result "$check_name" PASS
  else
    rc=$?
    sed 's/^/  | /' "/tmp/$check_name.log" | tail -40
    result "$check_name" FAIL "exit $rc"
  fi
}

# Two interfaces joined by a veth pair, 198.18.0.1 and 198.18.0.2. Both ends live in this one
# kernel, so locally generated traffic between the two addresses is forced through the pair
# (policy routing below the local table, static neighbours), as two hosts would exchange it.
setup_veth() {
  ip link set lo up
  ip link add veth0 type veth peer name veth1
  for d in veth0 veth1; do ip link set "$d" mtu "${MTU:-1500}"; done
  ip addr add 198.18.0.1/24 dev veth0
  ip addr add 198.18.0.2/24 dev veth1
  for k in all default veth0 veth1; do
    echo 1 > /proc/sys/net/ipv4/conf/$k/accept_local
    echo 0 > /proc/sys/net/ipv4/conf/$k/rp_filter
  done
  ip link set veth0 up
  ip link set veth1 up
  ip rule add pref 1000 lookup local
  ip rule del pref 0
  ip route add 198.18.0.1/32 dev veth1 src 198.18.0.2 table 101
  ip route add 198.18.0.2/32 dev veth0 src 198.18.0.1 table 102
  ip rule add pref 101 iif lo to 198.18.0.1 lookup 101
  ip rule add pref 102 iif lo to 198.18.0.2 lookup 102
  ip neigh replace 198.18.0.1 lladdr "$(cat /sys/class/net/veth0/address)" dev veth1 nud permanent
  ip neigh replace 198.18.0.2 lladdr "$(cat /sys/class/net/veth1/address)" dev veth0 nud permanent
}

# rxe_beside: two MetaRoCE devices (mr0, mr1) and two rxe devices (rxe0, rxe1) over the veth
# pair, all ports ACTIVE (the benchmark guests; the engine must already run).
rxe_beside() {
  rdma link add mr0 type metaroce netdev veth0
  rdma link add mr1 type metaroce netdev veth1
  rdma link add rxe0 type rxe netdev veth0
  rdma link add rxe1 type rxe netdev veth1
  for d in mr0 mr1 rxe0 rxe1; do wait_port "$d" ACTIVE; done
}

# gid_index DEV IPV4: the index of the device's RoCE v2 GID of that address.
gid_index() {
  hex=$(echo "$2" | awk -F. '{printf "%02x%02x:%02x%02x", $1,$2,$3,$4}')
  for g in /sys/class/infiniband/$1/ports/1/gids/*; do
    if [ "$(cat "$g" 2>/dev/null)" = "0000:0000:0000:0000:0000:ffff:$hex" ]; then
      i=${g##*/}
      case "$(cat /sys/class/infiniband/$1/ports/1/gid_attrs/types/$i 2>/dev/null)" in
        *v2*|*V2*) echo "$i"; return 0 ;;
      esac
    fi
  done
  return 1
}

# wait_port DEV STATE [SECONDS]: until ports/1/state says STATE (e.g. ACTIVE, DOWN).
wait_port() {
  n=0
  while [ "$n" -lt "$((${3:-30} * 10))" ]; do
    case "$(cat /sys/class/infiniband/$1/ports/1/state 2>/dev/null)" in *"$2"*) return 0 ;; esac
    sleep 0.1; n=$((n + 1))
  done
  echo "$1: port state $(cat /sys/class/infiniband/$1/ports/1/state 2>/dev/null), not $2"
  return 1
}

# dmesg_clean: nothing the kernel logged is a warning, an oops or an error of ours.
# The two lines every unsigned out-of-tree module brings (the taint notices) are not findings.
dmesg_clean() {
  if dmesg | grep -vE 'loading out-of-tree module taints kernel|module verification failed: signature' |
       grep -E 'WARNING|BUG|Oops|Call Trace|refcount|leak|metaroce.*(error|fail)|not released'; then
    return 1
  fi
  return 0
}
