# Run by `cmake --install`: installs the public headers — the umbrella torchpar/torchpar.h and what it
# includes, transitively — and nothing else, so internal classes do not become API. Computed at install
# time, so the list follows the includes without a re-configure.
# In: TORCHPAR_SOURCE_ROOT (csrc), TORCHPAR_INCLUDE_DESTINATION (relative to the install prefix).
cmake_policy(PUSH)
cmake_policy(VERSION 3.22) # IN_LIST; included scripts get their own policy scope
include("${CMAKE_CURRENT_LIST_DIR}/TorchparHeaderWalk.cmake")
torchpar_included_headers("${TORCHPAR_SOURCE_ROOT}" torchpar/torchpar.h public_headers)
foreach(header IN LISTS public_headers)
  get_filename_component(folder "${header}" DIRECTORY)
  file(INSTALL "${TORCHPAR_SOURCE_ROOT}/${header}"
       DESTINATION "${CMAKE_INSTALL_PREFIX}/${TORCHPAR_INCLUDE_DESTINATION}/${folder}")
endforeach()
cmake_policy(POP)
