/* gradacc.h must compile on its own as strict ISO C99 (-std=c99 -pedantic -Werror), be safe to
 * include twice, and carry version macros that agree with each other. */
#include "gradacc.h"
#include "gradacc.h"

#include <stdio.h>
#include <string.h>

#define STR_(x) #x
#define STR(x) STR_(x)

#if !defined(GRADACC_VERSION_MAJOR) || !defined(GRADACC_VERSION_MINOR) || \
    !defined(GRADACC_VERSION_PATCH) || !defined(GRADACC_VERSION_STRING)
#error "gradacc.h must define GRADACC_VERSION_MAJOR/MINOR/PATCH/STRING"
#endif

/* The numeric macros must be usable in #if. */
#if GRADACC_VERSION_MAJOR < 0 || GRADACC_VERSION_MINOR < 0 || GRADACC_VERSION_PATCH < 0
#error "gradacc version macros must be non-negative integers"
#endif
#if !defined(GRADACC_VERSION_NUMBER) ||                                                             \
    GRADACC_VERSION_NUMBER != GRADACC_VERSION(GRADACC_VERSION_MAJOR, GRADACC_VERSION_MINOR, GRADACC_VERSION_PATCH)
#error "GRADACC_VERSION_NUMBER must be GRADACC_VERSION(MAJOR, MINOR, PATCH)"
#endif
#ifndef GRADACC_API
#error "gradacc.h must define the export macro GRADACC_API"
#endif

int main(void) {
    const char *numbers =
        STR(GRADACC_VERSION_MAJOR) "." STR(GRADACC_VERSION_MINOR) "." STR(GRADACC_VERSION_PATCH);
    /* The string may carry a pre-release suffix ("0.2.0-rc.1"), never different numbers. */
    size_t n = strlen(numbers);
    if (strncmp(GRADACC_VERSION_STRING, numbers, n) != 0 ||
        (GRADACC_VERSION_STRING[n] != '\0' && GRADACC_VERSION_STRING[n] != '-')) {
        fprintf(stderr, "GRADACC_VERSION_STRING \"%s\" does not match %s\n", GRADACC_VERSION_STRING,
                numbers);
        return 1;
    }
    printf("gradacc.h %s compiles alone as C99\n", GRADACC_VERSION_STRING);
    return 0;
}
