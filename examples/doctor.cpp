// perf doctor: what LibTorch, CUDA and perf see on this machine.
//   ./doctor            prints versions, devices and every flag perf manages
//   ./doctor --setup    also applies perf::setup() and prints its report
#include <perf/perf.h>

#include <CLI/CLI.hpp>
#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"perf doctor: versions, devices and current LibTorch performance flags"};
  bool apply = false;
  app.add_flag("--setup", apply, "apply perf::setup() and print its report");
  CLI11_PARSE(app, argc, argv);

  std::cout << perf::environment();
  if (apply) std::cout << "\n" << perf::setup();
  return 0;
}
