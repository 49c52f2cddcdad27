# A torch installed by pip finds NCCL, cuDNN, cuBLAS ... in site-packages/nvidia/*/lib through its
# RUNPATH. The linker does not follow that RUNPATH when it checks an executable's indirect
# dependencies, and would pick other copies (e.g. the CUDA toolkit's older libnccl, missing symbols
# libtorch_cuda needs) — so executables get -rpath-link to the wheel's directories.
function(torchpar_wheel_link_options torch_prefix out_var)
  file(GLOB _torchpar_nvidia_dirs LIST_DIRECTORIES true "${torch_prefix}/../nvidia/*/lib")
  set(_options "")
  foreach(_dir IN LISTS _torchpar_nvidia_dirs)
    get_filename_component(_dir "${_dir}" ABSOLUTE)
    list(APPEND _options "-Wl,-rpath-link,${_dir}")
  endforeach()
  set(${out_var} "${_options}" PARENT_SCOPE)
endfunction()
