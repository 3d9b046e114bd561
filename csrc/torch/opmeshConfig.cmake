# find_package(opmesh) for C++ programs: the target opmesh::ops (libopmesh_ops and its headers).
# Needs torch's CMake package too (torch.utils.cmake_prefix_path on CMAKE_PREFIX_PATH).
include(CMakeFindDependencyMacro)
find_dependency(Torch)
include("${CMAKE_CURRENT_LIST_DIR}/opmeshTargets.cmake")
