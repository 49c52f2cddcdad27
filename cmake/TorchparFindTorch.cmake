# Finds the torch of the Python that runs the build (the one `pip install` put there), so that
# LibTorch, the Python extension and the tests all agree on one torch.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import sysconfig, torch; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(sysconfig.get_config_var('EXT_SUFFIX'))"
  OUTPUT_VARIABLE _torchpar_py_out OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torchpar_py_rc ERROR_QUIET)
if(NOT _torchpar_py_rc EQUAL 0)
  message(FATAL_ERROR "torchpar: `${Python3_EXECUTABLE} -c 'import torch'` failed: run scripts/setup.sh first (pip builds need --no-build-isolation)")
endif()
string(REPLACE "\n" ";" _torchpar_py_out "${_torchpar_py_out}")
list(GET _torchpar_py_out 0 _torchpar_torch_prefix)
list(GET _torchpar_py_out 1 TORCHPAR_TORCH_VERSION)
list(GET _torchpar_py_out 2 TORCHPAR_PYTHON_EXT_SUFFIX)
list(APPEND CMAKE_PREFIX_PATH "${_torchpar_torch_prefix}")

find_package(Torch REQUIRED)
get_filename_component(TORCH_LIBRARY_DIR "${TORCH_INSTALL_PREFIX}/lib" ABSOLUTE)
find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_LIBRARY_DIR}" NO_DEFAULT_PATH REQUIRED)
message(STATUS "torchpar: building against torch ${TORCHPAR_TORCH_VERSION} at ${TORCH_INSTALL_PREFIX}")
if(TORCHPAR_TORCH_VERSION VERSION_LESS 2.11)
  message(WARNING "torchpar supports torch 2.11 to 2.15; found ${TORCHPAR_TORCH_VERSION}")
endif()

# Gloo headers. The torch wheels do not ship them, yet c10d's ProcessGroupGloo.hpp includes them.
# torchpar only constructs ProcessGroupGloo through its out-of-line constructor and uses it through
# the c10d::Backend interface; every member of ProcessGroupGloo is a std/c10 type (gloo objects are
# held by shared_ptr/unique_ptr), so Debian's libgloo-dev headers give the same class layout as the
# newer gloo that libtorch_cpu was built with. We never link Debian's libgloo: torch's copy runs.
find_path(TORCHPAR_GLOO_INCLUDE_DIR gloo/rendezvous/store.h
  HINTS "${TORCH_INSTALL_PREFIX}/include" PATHS /usr/include /usr/local/include)
if(NOT TORCHPAR_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "torchpar: gloo headers not found; install Debian's libgloo-dev (scripts/setup.sh does)")
endif()

function(torchpar_add_gloo target source)
  target_sources(${target} PRIVATE ${source})
  set_source_files_properties(${source} PROPERTIES
    COMPILE_DEFINITIONS USE_C10D_GLOO
    INCLUDE_DIRECTORIES "${TORCHPAR_GLOO_INCLUDE_DIR}"
    SKIP_PRECOMPILE_HEADERS ON)
endfunction()

# NCCL: compiled when torch has CUDA (its CMake package then already required the CUDA toolkit).
# The nccl.h must be the one of the NCCL torch was built with (ProcessGroupNCCL's layout depends on
# NCCL_* version macros): the nvidia-nccl wheel that torch depends on carries it.
set(TORCHPAR_HAS_NCCL OFF)
if(TORCHPAR_WITH_NCCL AND TARGET torch_cuda)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'include'))"
    OUTPUT_VARIABLE _torchpar_nccl_hint OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  find_path(TORCHPAR_NCCL_INCLUDE_DIR nccl.h HINTS "${_torchpar_nccl_hint}" ${CUDAToolkit_INCLUDE_DIRS})
  if(TORCHPAR_NCCL_INCLUDE_DIR)
    set(TORCHPAR_HAS_NCCL ON)
  endif()
endif()
message(STATUS "torchpar: NCCL paths ${TORCHPAR_HAS_NCCL} (nccl.h: ${TORCHPAR_NCCL_INCLUDE_DIR})")

function(torchpar_add_nccl target source)
  if(NOT TORCHPAR_HAS_NCCL)
    return()
  endif()
  target_sources(${target} PRIVATE ${source})
  target_compile_definitions(${target} PRIVATE TORCHPAR_HAS_NCCL=1)
  set_source_files_properties(${source} PROPERTIES
    COMPILE_DEFINITIONS USE_C10D_NCCL
    INCLUDE_DIRECTORIES "${TORCHPAR_NCCL_INCLUDE_DIR}"
    SKIP_PRECOMPILE_HEADERS ON)
endfunction()
