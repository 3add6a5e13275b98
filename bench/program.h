// How perf's benchmark programs end on an error: "<program>: <message>" and exit status 1, not an uncaught
// exception's abort with LibTorch's backtrace above the message.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>

namespace perf_bench {

/// Runs a program's body and returns its exit status. A LibTorch error prints its message alone: the backtrace
/// says where in LibTorch, not what went wrong, and the message is what a script reading stderr's last line wants.
/// TORCH_SHOW_CPP_STACKTRACES=1 (PyTorch's switch for the same thing) prints the backtrace too.
inline int run_program(const char* program, int (*body)(int, char**), int argc, char** argv) {
  try {
    return body(argc, argv);
  } catch (const c10::Error& e) {
    const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    bool backtrace = show != nullptr && std::strcmp(show, "1") == 0;
    std::cerr << program << ": " << (backtrace ? e.what() : e.what_without_backtrace()) << std::endl;
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace perf_bench
