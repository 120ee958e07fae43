// SPDX-License-Identifier: Apache-2.0
// Entry point of the `metaroce` command; all the work is in cli.cc so tests can run it in-process.
#include <string>
#include <vector>

#include "util/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return metaroce::util::run(args, metaroce::util::process_context());
}
