/* status.c -- status names, the per-thread last error, small helpers. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

static _Thread_local char last_message[512];
static _Thread_local int64_t last_command = -1;
static _Thread_local int64_t last_job = -1;

/* The message is formatted into a buffer of its own and then copied: an argument may be
 * spy_last_error() itself (a caller prefixing a nested failure's message), which
 * vsnprintf must not read while writing it. */
spy_status spy_fail(spy_status s, int64_t command, const char *fmt, ...)
{
    char message[sizeof last_message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    memcpy(last_message, message, sizeof message);
    last_command = command;
    return s;
}

void spy_clear_error(void)
{
    last_message[0] = '\0';
    last_command = -1;
    last_job = -1;
}

void spy_note_error_job(int64_t job) { last_job = job; }

const char *spy_last_error(void) { return last_message; }

int64_t spy_last_error_command(void) { return last_command; }

int64_t spy_last_error_job(void) { return last_job; }

const char *spy_status_name(spy_status s)
{
    switch (s) {
    case SPY_OK: return "SPY_OK";
    case SPY_E_INVALID_ARG: return "SPY_E_INVALID_ARG";
    case SPY_E_PROFILE: return "SPY_E_PROFILE";
    case SPY_E_OOM: return "SPY_E_OOM";
    case SPY_E_BAD_ADDRESS: return "SPY_E_BAD_ADDRESS";
    case SPY_E_SCRATCHPAD: return "SPY_E_SCRATCHPAD";
    case SPY_E_CYCLE: return "SPY_E_CYCLE";
    case SPY_E_BAD_COMMAND: return "SPY_E_BAD_COMMAND";
    case SPY_E_BAD_PROGRAM: return "SPY_E_BAD_PROGRAM";
    case SPY_E_INDEX: return "SPY_E_INDEX";
    case SPY_E_DMA: return "SPY_E_DMA";
    case SPY_E_COMMAND_FAULT: return "SPY_E_COMMAND_FAULT";
    case SPY_E_DEVICE_LOST: return "SPY_E_DEVICE_LOST";
    case SPY_E_HOST_NOMEM: return "SPY_E_HOST_NOMEM";
    case SPY_E_NOT_COMMITTED: return "SPY_E_NOT_COMMITTED";
    case SPY_E_LAYOUT: return "SPY_E_LAYOUT";
    case SPY_E_CCL_TIMEOUT: return "SPY_E_CCL_TIMEOUT";
    case SPY_E_CCL_MISMATCH: return "SPY_E_CCL_MISMATCH";
    case SPY_E_CCL_PEER: return "SPY_E_CCL_PEER";
    }
    return "SPY_E_UNKNOWN";
}

uint64_t spy_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t spy_thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Per thread, the CPU-clock mark of each device key it took lately: a small table, the
 * least recently used entry making room for a new key. A thread that calls into more devices
 * in turn than the table holds starts again at 0 on a device it dropped, losing the CPU
 * time since its last call there. */
#define CPU_MARKS 16
static _Thread_local struct {
    uint64_t key, mark, used;
} cpu_marks[CPU_MARKS];
static _Thread_local uint64_t cpu_marks_tick;

uint64_t spy_thread_cpu_take(uint64_t key)
{
    uint64_t now = spy_thread_cpu_ns();
    unsigned victim = 0;
    for (unsigned i = 0; i < CPU_MARKS; i++) {
        if (cpu_marks[i].key == key) {
            uint64_t since = now > cpu_marks[i].mark ? now - cpu_marks[i].mark : 0;
            cpu_marks[i].mark = now;
            cpu_marks[i].used = ++cpu_marks_tick;
            return since;
        }
        if (cpu_marks[i].used < cpu_marks[victim].used)
            victim = i;
    }
    cpu_marks[victim].key = key;
    cpu_marks[victim].mark = now;
    cpu_marks[victim].used = ++cpu_marks_tick;
    return 0;
}

uint32_t spy_dtype_size(uint32_t dtype)
{
    switch (dtype) {
    case SPY_DT_F32: return 4;
    case SPY_DT_F16: return 2;
    case SPY_DT_BF16: return 2;
    case SPY_DT_I64: return 8;
    case SPY_DT_I32: return 4;
    case SPY_DT_I8: return 1;
    case SPY_DT_U8: return 1;
    case SPY_DT_BOOL: return 1;
    default: return 0;
    }
}
