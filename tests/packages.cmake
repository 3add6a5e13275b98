# The test suite's reference Python (PERF_PYTHON), the environment of its tests (perf_test_env) and the packages
# it exports before the tests run (perf_packages). Included by the top-level CMakeLists.txt before
# add_subdirectory(tests), so that these custom commands are the top-level directory's: CMake writes a directory's
# custom commands after its targets and the top-level directory's first, and Ninja (1.11) starts the ready jobs in
# the order they are written. Here the export (about 4 minutes on 2 cores when fresh, one process) starts with the
# first compile; written in tests/ it started after the tests' compiles, alone on one core for the last ~150 s of
# a fresh 2-core CI's 784-s build (9104542; ~140 s before that while perf_tests waited on it).

# The Python interpreter of the venv that provided LibTorch: numerical reference.
if(NOT PERF_PYTHON)
  get_filename_component(_torch_root "${Torch_DIR}/../../.." ABSOLUTE)  # .../site-packages/torch
  get_filename_component(_venv "${_torch_root}/../../../.." ABSOLUTE)
  if(EXISTS "${_venv}/bin/python")
    set(PERF_PYTHON "${_venv}/bin/python")
  else()
    find_program(PERF_PYTHON NAMES python3 python REQUIRED)
  endif()
endif()
set(PERF_PYTHON "${PERF_PYTHON}" CACHE FILEPATH "Python with torch, the numerical reference for tests")
message(STATUS "perf tests: reference Python ${PERF_PYTHON}")

# How OpenMP's idle threads wait in every test and in the build's package
# exports (OMP_WAIT_POLICY; empty: as the environment says). ctest runs one
# test per core, and each test's LibTorch (and the Python it starts) has one
# intra-op thread per core: with libgomp's default, spinning at every barrier,
# a thread spins on while the one it waits for has no core. Two runs of
# examples/compiled_train at once on 2 cores took 103 s against 1.8 s passive
# (1.9 s and 1.5 s alone); the plain build's tests 336 s against 273 s
# (docs/ci-time.md). The thread counts, so the numbers, are the same either way.
set(PERF_TEST_OMP_WAIT_POLICY PASSIVE CACHE STRING "OMP_WAIT_POLICY of every test: PASSIVE, ACTIVE or empty (the environment's)")
if(NOT PERF_TEST_OMP_WAIT_POLICY MATCHES "^(|PASSIVE|ACTIVE)$")
  message(FATAL_ERROR "PERF_TEST_OMP_WAIT_POLICY must be PASSIVE, ACTIVE or empty (the environment's), got "
                      "'${PERF_TEST_OMP_WAIT_POLICY}'")
endif()
set(perf_test_env "")
if(PERF_TEST_OMP_WAIT_POLICY)
  set(perf_test_env "OMP_WAIT_POLICY=${PERF_TEST_OMP_WAIT_POLICY}")
endif()

# perf::CompiledModel's packages: exported by the reference Python before the
# tests run (about 4 minutes on 2 cores the first time; cached under ~/.cache/perf across builds).
if(NOT PERF_SANITIZE STREQUAL "thread")
  set(perf_packages ${CMAKE_CURRENT_BINARY_DIR}/tests/packages)
  add_custom_command(OUTPUT ${perf_packages}/stamp
    COMMAND ${CMAKE_COMMAND} -E env ${perf_test_env}
            ${PERF_PYTHON} -X faulthandler ${CMAKE_CURRENT_LIST_DIR}/compiled/make_packages.py --out ${perf_packages}
    DEPENDS ${CMAKE_CURRENT_LIST_DIR}/compiled/make_packages.py ${CMAKE_CURRENT_LIST_DIR}/compiled/models.py
            ${PROJECT_SOURCE_DIR}/tools/export_compiled.py ${PROJECT_SOURCE_DIR}/examples/compiled_train.py
    COMMENT "Exporting the CompiledModel test packages (tests/compiled/make_packages.py)"
    VERBATIM)
  # In ALL, and not a dependency of perf_tests: with Ninja that would hold back perf_tests' compiles until the
  # export ends. ctest runs after the whole build, so the packages are there when the tests read them.
  add_custom_target(perf_test_packages ALL DEPENDS ${perf_packages}/stamp)
  # The GPU tests' CUDA packages, exported here on a machine with a GPU (beside
  # the compilation, not inside the tests' time); elsewhere only a stamp saying
  # why not, and the tests export them themselves.
  if(PERF_CUDA_ENABLED)
    add_custom_command(OUTPUT ${perf_packages}/cuda/stamp
      COMMAND ${CMAKE_COMMAND} -E env ${perf_test_env}
              ${PERF_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/compiled/make_cuda_packages.py --out ${perf_packages}/cuda
      DEPENDS ${CMAKE_CURRENT_LIST_DIR}/compiled/make_cuda_packages.py
              ${CMAKE_CURRENT_LIST_DIR}/compiled/models.py ${PROJECT_SOURCE_DIR}/tools/export_compiled.py
              ${PROJECT_SOURCE_DIR}/examples/compiled_train.py
      COMMENT "Exporting the CUDA test packages where a GPU is present (tests/compiled/make_cuda_packages.py)"
      VERBATIM)
    add_custom_target(perf_test_cuda_packages ALL DEPENDS ${perf_packages}/cuda/stamp)
  endif()
endif()
