# Attaches LibTorch to perf's INTERFACE target and decides PERF_WITH_CUDA.
# Used by perf's own CMakeLists.txt and by the installed perfConfig.cmake, so
# a consumer always gets the flags of the LibTorch it builds against.
#
#   perf_attach_torch(<target> <BUILD_INTERFACE|PLAIN>)
#
# Expects find_package(Torch) to have run. PERF_WITH_CUDA (ON by default) can
# be set OFF to compile perf's CUDA code out even with a CUDA LibTorch.
# perf's LibTorch floor: the oldest version its test suite runs against
# (scripts/test-matrix.sh). perf uses APIs older versions lack, e.g.
# at::cpu::get_cpu_capabilities, the per-backend Float32Precision enums, the
# accelerator-generic allocator config.
set(PERF_MIN_TORCH_VERSION 2.11)

function(perf_check_torch_version version)
  if(version AND version VERSION_LESS PERF_MIN_TORCH_VERSION)
    message(FATAL_ERROR "perf needs LibTorch >= ${PERF_MIN_TORCH_VERSION}, found ${version}"
                        "${ARGN}. Point CMake at a newer LibTorch (Torch_DIR or CMAKE_PREFIX_PATH, e.g. "
                        "python -c 'import torch; print(torch.utils.cmake_prefix_path)' from a torch>=${PERF_MIN_TORCH_VERSION} "
                        "install); README: \"Supported LibTorch versions\".")
  endif()
endfunction()

function(perf_attach_torch target mode)
  perf_check_torch_version("${Torch_VERSION}" " (Torch_DIR=${Torch_DIR})")
  if(NOT DEFINED PERF_WITH_CUDA)
    set(PERF_WITH_CUDA ON)
  endif()
  if(PERF_WITH_CUDA AND (C10_CUDA_LIBRARY OR TORCH_CUDA_LIBRARIES))
    set(cuda 1)
  else()
    set(cuda 0)
  endif()
  # LibTorch 2.14's headers need C++20 (ATen/ATen.h: "#error C++20 or later compatible compiler is required")
  # but its CMake target does not ask for it (2.15's does).
  set(std cxx_std_17)
  if(Torch_VERSION AND Torch_VERSION VERSION_GREATER_EQUAL 2.14)
    set(std cxx_std_20)
  endif()
  if(mode STREQUAL "BUILD_INTERFACE")
    target_link_libraries(${target} INTERFACE "$<BUILD_INTERFACE:${TORCH_LIBRARIES}>")
    target_compile_definitions(${target} INTERFACE "$<BUILD_INTERFACE:PERF_WITH_CUDA=${cuda}>")
    target_compile_features(${target} INTERFACE "$<BUILD_INTERFACE:${std}>")
  else()
    target_link_libraries(${target} INTERFACE ${TORCH_LIBRARIES})
    target_compile_definitions(${target} INTERFACE PERF_WITH_CUDA=${cuda})
    target_compile_features(${target} INTERFACE ${std})
  endif()
  set(PERF_CUDA_ENABLED ${cuda} PARENT_SCOPE)
endfunction()
