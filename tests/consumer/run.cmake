# Installs perf (MODE=install), or builds tests/consumer against perf, either
# installed (MODE=find_package, PREFIX: where MODE=install put it) or as a
# subdirectory (optionally with another compiler and standard: CXX_COMPILER,
# CXX_STANDARD), then runs it: header-only and against perf::perf_static, or
# header-only alone with STATIC=OFF, or perf::perf_static alone with
# HEADER_ONLY=OFF.
# Invoked by ctest with -P.
file(REMOVE_RECURSE "${WORK_DIR}")
set(common -G "${GENERATOR}" -DTorch_DIR=${Torch_DIR} -DPERF_WITH_CUDA=${PERF_WITH_CUDA})
if(LAUNCHER)
  list(APPEND common -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
if(LINKER_FLAGS)  # the build's own (CMAKE_EXE_LINKER_FLAGS)
  list(APPEND common "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}")
endif()
if(CXX_COMPILER)  # another compiler than perf's own build (clang++)
  list(APPEND common -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(CXX_STANDARD)  # the program's standard, newer than perf's floor (C++17)
  list(APPEND common -DPERF_CONSUMER_CXX_STANDARD=${CXX_STANDARD})
endif()
if(NOT DEFINED STATIC)
  set(STATIC ON)
endif()
if(NOT DEFINED HEADER_ONLY)
  set(HEADER_ONLY ON)
endif()
set(programs -DPERF_CONSUMER_HEADER_ONLY=${HEADER_ONLY} -DPERF_CONSUMER_STATIC=${STATIC})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

if(MODE STREQUAL "install")  # perf configured, built (perf::perf_static) and installed into WORK_DIR/prefix
  run(${CMAKE_COMMAND} -S ${PERF_SOURCE_DIR} -B ${WORK_DIR}/perf-build ${common}
      -DPERF_BUILD_TESTS=OFF -DPERF_BUILD_EXAMPLES=OFF -DPERF_BUILD_BENCH=OFF -DPERF_INSTALL=ON
      -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/perf-build)  # perf::perf_static
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/perf-build)
  foreach(f include/perf/perf.h include/perf/setup.h include/perf/impl/setup-inl.h
            lib/libperf_static.a
            lib/cmake/perf/perfConfig.cmake
            lib/cmake/perf/perfConfigVersion.cmake)
    if(NOT EXISTS ${WORK_DIR}/prefix/${f})
      message(FATAL_ERROR "install is missing ${f}")
    endif()
  endforeach()
  return()
elseif(MODE STREQUAL "find_package")  # against the install of MODE=install at PREFIX
  if(NOT EXISTS ${PREFIX}/lib/cmake/perf/perfConfig.cmake)
    message(FATAL_ERROR "no perf installed at PREFIX=${PREFIX} (the consumer_install test installs it)")
  endif()
  run(${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${WORK_DIR}/build ${common}
      -DCMAKE_PREFIX_PATH=${PREFIX} ${programs})
else()
  run(${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${WORK_DIR}/build ${common}
      -DPERF_CONSUMER_MODE=add_subdirectory -DPERF_SOURCE_DIR=${PERF_SOURCE_DIR} ${programs})
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
if(HEADER_ONLY)
  run(${WORK_DIR}/build/consumer ${EXPECT_CUDA} header-only)
elseif(EXISTS ${WORK_DIR}/build/consumer)
  message(FATAL_ERROR "HEADER_ONLY=OFF built the header-only consumer all the same")
endif()
if(STATIC)
  run(${WORK_DIR}/build/consumer_static ${EXPECT_CUDA} static)
elseif(EXISTS ${WORK_DIR}/build/consumer_static OR EXISTS ${WORK_DIR}/build/perf/libperf_static.a)
  message(FATAL_ERROR "STATIC=OFF built perf::perf_static or consumer_static all the same")
endif()
