/* Preloaded into the emulated Python only: opening /proc/cpuinfo opens the file named by
   KILN_FAKE_CPUINFO instead. Both variables are removed at load, so the processes it starts
   (which run natively) see the real file. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *fake;

__attribute__((constructor)) static void take_environment(void) {
    const char *path = getenv("KILN_FAKE_CPUINFO");
    fake = path ? strdup(path) : NULL;
    unsetenv("KILN_FAKE_CPUINFO");
    unsetenv("LD_PRELOAD");
}

static const char *redirect(const char *path) {
    return fake && path && strcmp(path, "/proc/cpuinfo") == 0 ? fake : path;
}

static mode_t mode_of(int flags, va_list args) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(args, int) : 0;
}

#define OPEN(name)                                                              \
    int name(const char *path, int flags, ...) {                                \
        static int (*real)(const char *, int, ...);                             \
        va_list args;                                                           \
        va_start(args, flags);                                                  \
        mode_t mode = mode_of(flags, args);                                     \
        va_end(args);                                                           \
        if (!real) real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name); \
        return real(redirect(path), flags, mode);                               \
    }
#define OPENAT(name)                                                            \
    int name(int dir, const char *path, int flags, ...) {                       \
        static int (*real)(int, const char *, int, ...);                        \
        va_list args;                                                           \
        va_start(args, flags);                                                  \
        mode_t mode = mode_of(flags, args);                                     \
        va_end(args);                                                           \
        if (!real) real = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, #name); \
        return real(dir, redirect(path), flags, mode);                          \
    }
#define FOPEN(name)                                                             \
    FILE *name(const char *path, const char *how) {                             \
        static FILE *(*real)(const char *, const char *);                       \
        if (!real) real = (FILE *(*)(const char *, const char *))dlsym(RTLD_NEXT, #name); \
        return real(redirect(path), how);                                       \
    }

OPEN(open)
OPEN(open64)
OPENAT(openat)
OPENAT(openat64)
FOPEN(fopen)
FOPEN(fopen64)
