/* gradacc-info: what this installation of gradacc is and what it found, for a bug report: the
 * library's version and file, the host's SIMD path, each backend available or why not, the CUDA
 * driver, NVRTC and NCCL (version and file) or why not, and the environment variables the library
 * reads. The C twin of `python -m gradacc`; the report is gradacc_diagnostics'. */
#include <gradacc.h>
#include <stdio.h>
#include <stdlib.h>

int main(void)
{
    size_t needed = 0;
    if (gradacc_diagnostics(NULL, 0, &needed) != GRADACC_STATUS_OK) {
        fprintf(stderr, "gradacc-info: %s\n", gradacc_last_error());
        return 1;
    }
    char *report = malloc(needed);
    if (report == NULL) {
        fprintf(stderr, "gradacc-info: cannot allocate %zu bytes\n", needed);
        return 1;
    }
    if (gradacc_diagnostics(report, needed, NULL) != GRADACC_STATUS_OK) {
        fprintf(stderr, "gradacc-info: %s\n", gradacc_last_error());
        free(report);
        return 1;
    }
    fputs(report, stdout);
    free(report);
    /* A program built against one header and run with another library is the first suspect. */
    if (gradacc_version_number() != GRADACC_VERSION_NUMBER)
        printf("built against the header of gradacc %s, running with the library of %s\n",
               GRADACC_VERSION_STRING, gradacc_version_string());
    return 0;
}
