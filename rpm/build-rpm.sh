#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the MetaRoCE RPMs from a git archive of SRC (default: this checkout) into OUT.
# Usage: rpm/build-rpm.sh [OUT_DIR] [SRC_DIR] [--worktree]
#   --worktree: archive the working tree (tracked + untracked, not ignored) instead of HEAD.
#   A SRC_DIR that is no git checkout (an exported copy) is archived as it is.
# On Debian the RPM build requirements are not visible to rpm, hence --nodeps; debuginfo
# extraction needs Red Hat's find-debuginfo, so it is switched off outside RPM distributions.
set -euo pipefail

out=${1:-$PWD/rpmbuild-out}
src=${2:-$(cd "$(dirname "$0")/.." && pwd)}
mode=${3:-}
spec="$src/rpm/metaroce.spec"
version=$(sed -n 's/^Version:[[:space:]]*//p' "$spec")
top=$(mktemp -d /tmp/metaroce-rpmbuild.XXXXXX)
trap 'rm -rf "$top"' EXIT
mkdir -p "$top"/{SOURCES,SPECS,BUILD,RPMS,SRPMS,BUILDROOT} "$out"

prefix="metaroce-$version/"
if ! git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  tar -C "$src" --transform "s,^\./,$prefix," -czf "$top/SOURCES/metaroce-$version.tar.gz" .
elif [ "$mode" = "--worktree" ]; then
  (cd "$src" && git ls-files -z -co --exclude-standard |
     tar --null -T - --transform "s,^,$prefix," -czf "$top/SOURCES/metaroce-$version.tar.gz")
else
  git -C "$src" archive --format=tar.gz --prefix="$prefix" -o "$top/SOURCES/metaroce-$version.tar.gz" HEAD
fi
cp "$spec" "$top/SPECS/"

extra=()
if [ ! -x /usr/lib/rpm/find-debuginfo.sh ] && ! command -v find-debuginfo >/dev/null; then
  extra+=(--define 'debug_package %{nil}')
fi
rpmbuild -bb --nodeps \
  --define "_topdir $top" \
  --define "_smp_mflags -j${JOBS:-2}" \
  "${extra[@]}" \
  "$top/SPECS/metaroce.spec"
find "$top/RPMS" -name '*.rpm' -exec cp {} "$out/" \;
ls "$out"/*.rpm
