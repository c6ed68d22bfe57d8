/* The native frames of a crash, for a machine without gdb (the GPU machine has none): preloaded into a process
 * (LD_PRELOAD=segv_trace.so), it prints the crashing thread's C/C++ stack to stderr on SIGSEGV, SIGBUS, SIGILL,
 * SIGFPE and SIGABRT, then dies of the same signal. Python's faulthandler (-X faulthandler) installs its handler
 * after this one and calls it once it has written the Python frames, so a crash shows both.
 * bench/gpu/context_probe.py names the functions of the frames this prints as lib.so(+0xOFFSET).
 *
 *     cc -shared -fPIC -O1 -o segv_trace.so bench/gpu/segv_trace.c
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static const int SIGNALS[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

static void on_fatal(int sig) {
    void *frames[64];
    static const char head[] = "\n--- native stack (segv_trace) ---\n";
    int n = backtrace(frames, 64);
    if (write(2, head, sizeof head - 1) < 0) {
    }
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[1];
    struct sigaction sa;
    unsigned i;
    backtrace(warm, 1); /* loads the unwinder now: a handler must not be the first to */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fatal;
    sa.sa_flags = SA_NODEFER;
    for (i = 0; i < sizeof SIGNALS / sizeof SIGNALS[0]; i++)
        sigaction(SIGNALS[i], &sa, NULL);
}
