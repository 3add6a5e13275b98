// A crash or a hang in perf_tests says where it happened.
//
// The GPU tests run on a machine lent for minutes; a test that dies of SIGSEGV
// (an AOTInductor runner under capture, say) or hangs (a lock in a warning
// handler) must leave its location in the log of that one run. c10's
// FatalSignalHandler prints the stack of every thread on SIGSEGV, SIGBUS,
// SIGILL, SIGFPE, SIGABRT and SIGINT, then lets the signal take its course
// (the exit status stays "killed by signal N"). scripts/gpu-check.sh sends a
// hung test SIGINT before killing it, and puts the crashing thread's frames in
// its summary. Not in sanitizer builds: the sanitizers report crashes
// themselves. PERF_TEST_NO_STACK_TRACES=1 turns it off (e.g. under a debugger).
#include <c10/util/signal_handler.h>
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <string>

namespace {

#if defined(C10_SUPPORTS_FATAL_SIGNAL_HANDLERS)
const bool kStackTraces = [] {
  const char* off = std::getenv("PERF_TEST_NO_STACK_TRACES");
  const bool on = off == nullptr || std::string(off).empty() || std::string(off) == "0";
  if (on) c10::FatalSignalHandler::getInstance().setPrintStackTracesOnFatalSignal(true);
  return on;
}();

[[noreturn]] __attribute__((noinline)) void crash_in_a_test() {
  std::raise(SIGSEGV);
  std::abort();
}
#endif

}  // namespace

TEST(TestBinary, ACrashPrintsTheStackOfEveryThread) {
#if defined(C10_SUPPORTS_FATAL_SIGNAL_HANDLERS)
  if (!kStackTraces) GTEST_SKIP() << "skipped: PERF_TEST_NO_STACK_TRACES is set";
  // A child process of this binary (GoogleTest's death test, re-executed so
  // that LibTorch's threads are not forked) crashes; it must still die of the
  // signal, after c10's handler has printed the crashing thread's stack.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(crash_in_a_test(), testing::KilledBySignal(SIGSEGV),
              "SIGSEGV\\(11\\), PID: [0-9]+, Thread [0-9]+: .*fatalSignalHandler");
#else
  GTEST_SKIP() << "skipped: c10 has no fatal signal handlers on this platform";
#endif
}
