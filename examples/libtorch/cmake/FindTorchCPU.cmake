# FindTorchCPU: libtorch's CPU libraries from a PyTorch wheel (the `torch` folder of a Python
# site-packages), without the CUDA toolkit that the wheel's own TorchConfig.cmake insists on
# ("Your installed Caffe2 version uses CUDA but I cannot find the CUDA libraries").
#
# Input:  TorchCPU_ROOT, the torch package folder (holding include/ and lib/). When unset, the
#         Python interpreter Python3_EXECUTABLE (or python3 on PATH) is asked where `torch` is,
#         without importing it.
# Output: TorchCPU_FOUND, TorchCPU_VERSION, TorchCPU_LIBRARY_DIR and the imported targets
#           Torch::c10        libc10
#           Torch::torch_cpu  libtorch_cpu, with Torch::c10, the include folders and C++20
#         Programs get an rpath to TorchCPU_LIBRARY_DIR from CMake's build-tree rpath.
include(FindPackageHandleStandardArgs)

if(NOT TorchCPU_ROOT)
    if(NOT Python3_EXECUTABLE)
        find_program(Python3_EXECUTABLE NAMES python3 python)
    endif()
    if(Python3_EXECUTABLE)
        execute_process(
            COMMAND "${Python3_EXECUTABLE}" -c
                    "import importlib.util as u; s = u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
            OUTPUT_VARIABLE _torchcpu_root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
        if(_torchcpu_root)
            set(TorchCPU_ROOT "${_torchcpu_root}" CACHE PATH "The torch package folder of a PyTorch wheel")
        endif()
    endif()
endif()

find_path(TorchCPU_INCLUDE_DIR torch/csrc/api/include/torch/torch.h
          HINTS "${TorchCPU_ROOT}/include" NO_DEFAULT_PATH)
find_library(TorchCPU_LIBRARY torch_cpu HINTS "${TorchCPU_ROOT}/lib" NO_DEFAULT_PATH)
find_library(TorchCPU_C10_LIBRARY c10 HINTS "${TorchCPU_ROOT}/lib" NO_DEFAULT_PATH)

if(EXISTS "${TorchCPU_ROOT}/version.py")
    file(STRINGS "${TorchCPU_ROOT}/version.py" _torchcpu_version_line REGEX "^__version__ *=")
    if(_torchcpu_version_line MATCHES "['\"]([0-9]+\\.[0-9]+\\.[0-9]+)")
        set(TorchCPU_VERSION "${CMAKE_MATCH_1}")
    endif()
endif()

find_package_handle_standard_args(TorchCPU
    REQUIRED_VARS TorchCPU_LIBRARY TorchCPU_C10_LIBRARY TorchCPU_INCLUDE_DIR
    VERSION_VAR TorchCPU_VERSION)

if(TorchCPU_FOUND)
    get_filename_component(TorchCPU_LIBRARY_DIR "${TorchCPU_LIBRARY}" DIRECTORY)
    if(NOT TARGET Torch::c10)
        add_library(Torch::c10 SHARED IMPORTED)
        set_target_properties(Torch::c10 PROPERTIES
            IMPORTED_LOCATION "${TorchCPU_C10_LIBRARY}"
            INTERFACE_INCLUDE_DIRECTORIES "${TorchCPU_INCLUDE_DIR}")
    endif()
    if(NOT TARGET Torch::torch_cpu)
        add_library(Torch::torch_cpu SHARED IMPORTED)
        set_target_properties(Torch::torch_cpu PROPERTIES
            IMPORTED_LOCATION "${TorchCPU_LIBRARY}"
            INTERFACE_INCLUDE_DIRECTORIES
                "${TorchCPU_INCLUDE_DIR};${TorchCPU_INCLUDE_DIR}/torch/csrc/api/include"
            INTERFACE_LINK_LIBRARIES Torch::c10
            INTERFACE_COMPILE_FEATURES cxx_std_20)
    endif()
endif()
mark_as_advanced(TorchCPU_INCLUDE_DIR TorchCPU_LIBRARY TorchCPU_C10_LIBRARY)
