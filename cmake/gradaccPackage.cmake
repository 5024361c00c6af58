# `cpack -G DEB` in a build folder makes the Debian package of what the install rules install:
# the library (file, SONAME link, development link), the static library, both headers, the CMake
# package and gradacc.pc. The MPI build (GRADACC_WITH_MPI) is the package gradacc-mpi, since its
# library needs libmpi; the two hold the same files, so each replaces the other.
# Configure with -DCMAKE_INSTALL_PREFIX=/usr so the libraries go to the multiarch folder
# (lib/x86_64-linux-gnu) where the system looks (scripts/deb-check).

if(GRADACC_WITH_MPI)
    set(CPACK_PACKAGE_NAME gradacc-mpi)
    set(_gradacc_other_package gradacc)
    # Its CMake package finds MPI for the programs that link it (find_dependency(MPI)).
    set(CPACK_DEBIAN_PACKAGE_DEPENDS libopenmpi-dev)
else()
    set(CPACK_PACKAGE_NAME gradacc)
    set(_gradacc_other_package gradacc-mpi)
endif()
set(CPACK_PACKAGE_VERSION "${GRADACC_VERSION_STRING}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGE_CONTACT "gradacc developers <gradacc@users.noreply.github.com>")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX "${CMAKE_INSTALL_PREFIX}")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_PACKAGE_CONFLICTS "${_gradacc_other_package}")
set(CPACK_DEBIAN_PACKAGE_REPLACES "${_gradacc_other_package}")
# Depends from the libraries the shared library needs (libc6, and libopenmpi3 for gradacc-mpi),
# found by dpkg-shlibdeps; a shlibs file and the ldconfig trigger for the library's SONAME.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
# Packages built against this one depend on exactly this version: the package name is the same
# for every release, so ">=" would also accept a later 0.x, whose SONAME (and ABI) differs.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY "=")
include(CPack)
