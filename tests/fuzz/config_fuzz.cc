// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the link record (metaroce.conf, datapath/nic/link_config): arbitrary text
// through LinkConfig::parse, and what it accepts written back with to_text(), which must parse
// to the same record; the same for the limits (`--limit`) and address parsers it uses. The
// engine, the provider and `metaroce` all read records that a user may have edited by hand.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "datapath/nic/link_config.h"

namespace metaroce::nic {
namespace {

void check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "config_fuzz: %s\n", what);
  std::abort();
}

void one(const std::string& text) {
  std::string why;
  auto c = LinkConfig::parse(text, "fuzz", &why);
  if (!c) {
    check(!why.empty(), "a refused record without a reason");
  } else {
    check(!c->name.empty() && !c->devargs.empty() && c->ip != 0, "a record without its keys");
    check(c->paths >= 1 && c->paths <= 256 && c->planes >= 1 && c->planes <= kMaxPlanes,
          "paths or planes out of range");
    const std::string again = c->to_text();
    auto d = LinkConfig::parse(again, "fuzz", &why);
    check(d.has_value(), "a record's own text is refused");
    check(*d == *c, "a record's own text reads back as another record");
    check(d->to_text() == again, "writing a record is not stable");
  }
  // Each line alone, as `--limit` and the address fields would see it.
  Limits base;
  base.qp = 7;
  if (auto l = parse_limits(text, base, &why)) {
    auto m = parse_limits(format_limits(*l), Limits{}, &why);
    check(m.has_value() && *m == *l, "limits written back read as others");
  } else {
    check(!why.empty(), "refused limits without a reason");
  }
  if (auto ip = parse_ipv4(text)) check(parse_ipv4(format_ipv4(*ip)) == ip, "an address round trip");
  if (auto iface = parse_udp_plane(text)) check(udp_plane(*iface) == text, "a UDP plane round trip");
}

}  // namespace
}  // namespace metaroce::nic

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metaroce::nic::one(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
