// SPDX-License-Identifier: Apache-2.0
// JSON as every `--json` of the command prints it: indented two spaces, fields in the order the
// code gives them, one value per line (so `grep '"mtu": 1500'` works as well as a parser). Bytes
// that are not UTF-8 (a devargs string, say) print as U+FFFD instead of failing the command.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace metaroce::util {

using OrderedJson = nlohmann::ordered_json;

inline std::string json_text(const OrderedJson& j) {
  return j.dump(2, ' ', false, OrderedJson::error_handler_t::replace) + "\n";
}

}  // namespace metaroce::util
