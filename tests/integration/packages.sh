#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian and RPM packages, end to end: build the .debs from a copy of the source, lintian
# (no errors), install them on this machine, create links with the installed command, run the
# unmodified ibv_devices and ibv_rc_pingpong through `metaroce exec`, purge, and check that no
# packaged file, link, run dir or /dev node is left; then rpmbuild and compare the RPM layout.
# Usage: packages.sh BUILD_DIR. Needs root and a throwaway machine (it installs packages).
# METAROCE_PKG_SOURCE=head builds from `git archive HEAD`; the default copies the working tree
# (tracked and untracked, not ignored), which on a clean clone is the same thing.
if [ "$(id -u)" -ne 0 ]; then echo "SKIP packages: needs root (installs packages)"; exit 77; fi
# Purging removes every /dev/infiniband node that is char 1:7, including those of links that
# other run dirs (a developer's tests) still use. Where possible the test therefore runs with a
# private /dev/infiniband (a tmpfs in its own mount namespace); the package scripts behave the same.
if [ -z "${METAROCE_PKG_NS:-}" ] && unshare -m --propagation private true 2>/dev/null; then
  exec unshare -m --propagation private env METAROCE_PKG_NS=1 bash -c \
    'mkdir -p /dev/infiniband && mount -t tmpfs -o mode=755 tmpfs /dev/infiniband && exec "$0" "$@"' \
    "$0" "$@"
fi
[ -n "${METAROCE_PKG_NS:-}" ] && echo "packages: private /dev/infiniband (mount namespace)"
source "$(dirname "$0")/lib.sh"
SRC=$(cd "$(dirname "$0")/../.." && pwd)
PKGS=(metaroce-provider metaroce-tools)
MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
WORK=$(mktemp -d /tmp/metaroce-packages.XXXXXX)
# The installed command, with nothing from the caller's environment that would point it (or the
# programs it runs) at a build tree or another run dir.
M=(env -u METAROCE_RUNDIR -u SYSFS_PATH -u RDMAV_DRIVERS /usr/bin/metaroce)

installed() { dpkg-query -W -f='${Status}\n' "$1" 2>/dev/null | grep -q ' installed$'; }
step() { echo "== $(date +%T) $*"; }

pkg_cleanup() {
  if installed metaroce-tools || installed metaroce-provider; then
    echo "cleanup: purging ${PKGS[*]}"
    [ -x /usr/bin/metaroce ] && "${M[@]}" link flush >/dev/null 2>&1
    apt-get purge -y -q "${PKGS[@]}" >"$LOGDIR/purge-cleanup" 2>&1 || dpkg -P "${PKGS[@]}" || true
  fi
  rm -rf "$WORK"
}
trap 'rc=$?; set +e; pkg_cleanup; (exit $rc); cleanup' EXIT

for tool in dpkg-buildpackage dh lintian rpmbuild fakeroot ibv_devices ibv_rc_pingpong; do
  command -v "$tool" >/dev/null || fail "$tool is missing (scripts/install-deps installs it)"
done
for p in "${PKGS[@]}"; do installed "$p" && fail "$p is already installed; this test needs a machine without it"; done
[ -z "$(ls -A /run/metaroce/sys/class/infiniband 2>/dev/null)" ] ||
  fail "/run/metaroce already holds links; this test needs a machine without any"

# --- build ------------------------------------------------------------------------------------
# One snapshot of the source for both builds: dpkg-buildpackage works in a copy of it (and writes
# beside that copy), rpmbuild archives the snapshot itself.
step "copying the source"
mkdir -p "$WORK/pristine"
if [ "${METAROCE_PKG_SOURCE:-worktree}" = head ]; then
  git -C "$SRC" archive HEAD | tar -x -C "$WORK/pristine"
else
  (cd "$SRC" && git ls-files -z -co --exclude-standard | xargs -0 -r sh -c \
     'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh | tar --null -T - -cf -) |
    tar -x -C "$WORK/pristine"
fi
[ -f "$WORK/pristine/debian/control" ] || fail "the copied source has no debian/"
cp -a "$WORK/pristine" "$WORK/src"

step "dpkg-buildpackage"
(cd "$WORK/src" && DEB_BUILD_OPTIONS="nocheck parallel=${JOBS:-2}" timeout 1200 \
   dpkg-buildpackage -b -us -uc) >"$LOGDIR/dpkg-buildpackage" 2>&1 ||
  { tail -n 40 "$LOGDIR/dpkg-buildpackage"; fail "dpkg-buildpackage failed"; }
debs=()
for p in "${PKGS[@]}"; do
  f=$(ls "$WORK"/"${p}"_*.deb 2>/dev/null | head -n 1)
  [ -n "$f" ] || fail "no $p .deb was built"
  debs+=("$f")
done

step "lintian"
lint_rc=0
lintian --fail-on error --no-tag-display-limit "${debs[@]}" >"$LOGDIR/lintian" 2>&1 || lint_rc=$?
if grep -q '^W: ' "$LOGDIR/lintian"; then echo "lintian warnings:"; grep '^W: ' "$LOGDIR/lintian"; fi
[ "$lint_rc" -eq 0 ] || { cat "$LOGDIR/lintian"; fail "lintian reports errors"; }

provider_deps=$(dpkg-deb -f "${debs[0]}" Depends)
echo "metaroce-provider Depends: $provider_deps"
[[ $provider_deps == *"libibverbs1 (<< 57~)"* && $provider_deps == *"libibverbs1 (>= 44)"* ]] ||
  fail "metaroce-provider does not pin libibverbs1 to the verified private-ABI range"

# --- RPM -------------------------------------------------------------------------------------
step "rpmbuild"
JOBS=${JOBS:-2} timeout 1200 "$WORK/pristine/rpm/build-rpm.sh" "$WORK/rpms" "$WORK/pristine" \
  >"$LOGDIR/rpmbuild" 2>&1 || { tail -n 40 "$LOGDIR/rpmbuild"; fail "rpmbuild failed"; }

# --- install and use -------------------------------------------------------------------------
step "apt-get install"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${debs[@]}" \
  >"$LOGDIR/install" 2>&1 || { tail -n 30 "$LOGDIR/install"; fail "installing the .debs failed"; }
for p in "${PKGS[@]}"; do installed "$p" || fail "$p is not installed after apt-get install"; done
dpkg -L "${PKGS[@]}" | sort -u >"$WORK/files"
for f in /usr/lib/"$MULTIARCH"/libibverbs/libmetaroce-rdmav34.so /etc/libibverbs.d/metaroce.driver \
         /usr/lib/"$MULTIARCH"/metaroce/libmetaroce-preload.so \
         /usr/bin/metaroce /usr/sbin/metaroced /lib/systemd/system/metaroce.service \
         /lib/systemd/system/metaroced.service /etc/metaroce/links.conf \
         /etc/profile.d/metaroce.sh /usr/share/man/man8/metaroce.8.gz \
         /usr/share/man/man8/metaroced.8.gz \
         /usr/share/man/man5/metaroce-links.conf.5.gz; do
  grep -qxF "$f" "$WORK/files" || fail "$f is not in the packages"
  [ -e "$f" ] || fail "$f is not installed"
done
grep -qx 'driver metaroce' /etc/libibverbs.d/metaroce.driver || fail "metaroce.driver does not name the provider"

step "links from /etc/metaroce/links.conf, as metaroce.service makes them"
sock="metaroce-packages-$$"
cat >/etc/metaroce/links.conf <<CONF
# written by tests/integration/packages.sh
mrA --dpdk net_memif0,role=server,socket=$sock --ip 198.18.0.1/24
mrB --dpdk net_memif1,role=client,socket=$sock --ip 198.18.0.2/24
CONF
if [ -d /run/systemd/system ]; then
  systemctl restart metaroce.service || fail "metaroce.service did not start"
else
  # Without systemd, `link apply` starts the installed engine itself.
  "${M[@]}" link apply || fail "metaroce link apply failed"
fi
"${M[@]}" link show
"${M[@]}" engine status || fail "no engine serves the links"
# The installed engine, not one that a test running beside this one started from the build tree.
pgrep -f '^/usr/sbin/metaroced ' >/dev/null || fail "the installed metaroced does not run"
[ "$("${M[@]}" link show --json | grep -c '"name"')" -eq 2 ] || fail "the two links are not there"

step "ibv_devices and ibv_rc_pingpong through metaroce exec"
devices=$("${M[@]}" exec -- ibv_devices) || fail "metaroce exec -- ibv_devices failed"
echo "$devices"
grep -qw mrA <<<"$devices" && grep -qw mrB <<<"$devices" || fail "ibv_devices does not list mrA and mrB"
set +e
"${M[@]}" exec -- metaroce-no-such-program 2>"$LOGDIR/exec-missing"
missing_rc=$?
set -e
[ "$missing_rc" -eq 127 ] && grep -q 'command not found' "$LOGDIR/exec-missing" ||
  fail "metaroce exec of a missing program: exit $missing_rc, $(cat "$LOGDIR/exec-missing")"
port=18710
# run_pair splits its commands at "--", so here exec gets the program without one.
# -e: completion channels, through the installed libmetaroce-preload.so that exec preloads.
run_pair pkg_pingpong $port 60 -- "${M[@]}" exec ibv_rc_pingpong -g 0 -d mrA -p $port -n 100 -e \
  -- "${M[@]}" exec ibv_rc_pingpong -g 0 -d mrB -p $port -n 100 -e 127.0.0.1
grep -q '819200 bytes in' "$LOGDIR/pkg_pingpong.client" || fail "client did not report 100 x 4096-byte round trips"

# --- purge -----------------------------------------------------------------------------------
step "apt-get purge"
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "${PKGS[@]}" >"$LOGDIR/purge" 2>&1 ||
  { tail -n 30 "$LOGDIR/purge"; fail "purging the packages failed"; }
for p in "${PKGS[@]}"; do dpkg-query -W "$p" >/dev/null 2>&1 && fail "$p is still known to dpkg"; done
left=()
while read -r f; do
  [ -d "$f" ] && continue  # directories are shared (/usr/bin, /etc/libibverbs.d, ...)
  [ -e "$f" ] || [ -L "$f" ] && left+=("$f")
done <"$WORK/files"
[ "${#left[@]}" -eq 0 ] || fail "files left after purge: ${left[*]}"
[ ! -e /etc/metaroce ] || fail "/etc/metaroce is left after purge"
[ ! -e /run/metaroce ] || fail "/run/metaroce is left after purge"
[ ! -e /etc/systemd/system/multi-user.target.wants/metaroce.service ] || fail "the unit is still enabled"
for node in /dev/infiniband/uverbs*; do
  [ -c "$node" ] && [ "$(stat -c '%t:%T' "$node")" = 1:7 ] && fail "our device node $node is left"
done
SYSFS_PATH=/run/metaroce/sys ibv_devices 2>/dev/null | grep -qw 'mr[AB]' && fail "a link is still visible"
pgrep -f '^/usr/sbin/metaroced ' >/dev/null && fail "the installed metaroced still runs after purge"
echo "deb: installed, used and purged without leftovers"

# --- RPM layout --------------------------------------------------------------------------------
step "rpm -qlp"
# The same files in the same places, modulo each distribution's libdir and unit dir.
normalize() {
  sed -e "s,^/usr/lib/$MULTIARCH/,LIBDIR/,; s,^/usr/lib64/,LIBDIR/,; s,^/lib/systemd/system/,UNITDIR/," \
      -e 's,^/usr/lib/systemd/system/,UNITDIR/,; s,\.gz$,,' |
    grep -v -e '^/usr/share/doc/' -e '^/usr/lib/\.build-id/' | sort -u
}
for p in "${PKGS[@]}"; do
  rpmfile=$(ls "$WORK"/rpms/"$p"-[0-9]*.rpm | head -n 1)
  [ -n "$rpmfile" ] || fail "no $p RPM was built"
  rpm -qp --qf '[%{FILEMODES:perms} %{FILENAMES}\n]' "$rpmfile" | awk '$1 !~ /^d/ {print $2}' |
    normalize >"$WORK/$p.rpm.list"
  deb=$(ls "$WORK"/"${p}"_*.deb)
  dpkg-deb -c "$deb" | awk '{print $6}' | sed 's,^\.,,' | grep -v '/$' | normalize >"$WORK/$p.deb.list"
  diff -u "$WORK/$p.deb.list" "$WORK/$p.rpm.list" || fail "$p: RPM and .deb layouts differ"
done
provider_rpm=$(ls "$WORK"/rpms/metaroce-provider-[0-9]*.rpm | head -n 1)
rpm -qp --requires "$provider_rpm" | grep -qF 'libibverbs.so.1(IBVERBS_PRIVATE_34)(64bit)' ||
  fail "the provider RPM does not require libibverbs' private ABI 34"
echo "rpm: same layout as the .debs"
echo "PASS packages"
