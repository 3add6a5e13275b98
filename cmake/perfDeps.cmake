# Test/example/benchmark dependencies (never needed by perf::perf itself):
# installed CMake packages, or offline copies in PERF_DEPS_DIR made by
# scripts/gpu-deps.sh (GPU machines without internet or a package manager).

# CLI11::CLI11 (header-only).
function(perf_find_cli11)
  if(TARGET CLI11::CLI11)
    return()
  endif()
  find_package(CLI11 CONFIG QUIET)
  if(CLI11_FOUND)
    return()
  endif()
  if(PERF_DEPS_DIR AND EXISTS "${PERF_DEPS_DIR}/CLI11/CLI/CLI.hpp")
    add_library(CLI11::CLI11 INTERFACE IMPORTED GLOBAL)
    set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${PERF_DEPS_DIR}/CLI11")
    return()
  endif()
  message(FATAL_ERROR "perf examples and benchmarks need CLI11: install libcli11-dev, set PERF_DEPS_DIR "
                      "(scripts/gpu-deps.sh), or configure with -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF")
endfunction()

# benchmark::benchmark (Google Benchmark), where there is one: bench_setup alone needs it. Found at the top
# level, like CLI11, so that perf_programs (PERF_PROGRAMS_UNITY) sees the target too.
function(perf_find_benchmark)
  if(PERF_DEPS_DIR)
    list(APPEND CMAKE_PREFIX_PATH "${PERF_DEPS_DIR}/benchmark-prefix")
  endif()
  find_package(benchmark CONFIG QUIET)
endfunction()
