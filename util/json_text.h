// SPDX-License-Identifier: Apache-2.0
// JSON as every `--json` of the command prints it: indented two spaces, fields in the order the
// code gives them, one value per line (so `grep '"mtu": 1500'` works as well as a parser). A
// string that is not UTF-8 would print U+FFFD rather than abort the command (none reaches here
// today: the command refuses such bytes before it records them).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace metaroce::util {

using OrderedJson = nlohmann::ordered_json;

inline std::string json_text(const OrderedJson& j) {
  return j.dump(2, ' ', false, OrderedJson::error_handler_t::replace) + "\n";
}

}  // namespace metaroce::util
