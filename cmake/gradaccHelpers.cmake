# Functions shared by the top-level CMakeLists.txt, ctests/ and examples/.

# The warning set every C/C++ file of this project (tests, examples) is held to.
function(gradacc_strict_warnings target)
    if(MSVC)
        target_compile_options(${target} PRIVATE /W4 /WX)
    else()
        target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
    endif()
endfunction()

# Configures gradacc.pc from `template` into `output`. With a relative CMAKE_INSTALL_LIBDIR the
# file finds its prefix from its own location (${pcfiledir}), so an install made with
# `cmake --install --prefix` or moved afterwards still points at the right files.
function(gradacc_configure_pc template output)
    if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
        set(GRADACC_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
    else()
        file(RELATIVE_PATH up "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
        string(REGEX REPLACE "/$" "" up "${up}")
        set(GRADACC_PC_PREFIX "\${pcfiledir}/${up}")
    endif()
    foreach(kind LIBDIR INCLUDEDIR)
        if(IS_ABSOLUTE "${CMAKE_INSTALL_${kind}}")
            set(GRADACC_PC_${kind} "${CMAKE_INSTALL_${kind}}")
        else()
            set(GRADACC_PC_${kind} "\${prefix}/${CMAKE_INSTALL_${kind}}")
        endif()
    endforeach()
    list(TRANSFORM GRADACC_NATIVE_STATIC_LIBS PREPEND "-l" OUTPUT_VARIABLE libs)
    list(JOIN libs " " GRADACC_PC_LIBS_PRIVATE)
    configure_file("${template}" "${output}" @ONLY)
endfunction()
