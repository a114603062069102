/* edges.c -- the fuzz harness's edge recorder, linked into the instrumented copy of the
 * native module (fuzz/instrumented.py); never part of the runtime.
 *
 * gcc's -fsanitize-coverage=trace-pc calls __sanitizer_cov_trace_pc at the start of every
 * basic block of an instrumented file. An edge is a pair (block before, this block), kept
 * exactly in an open-addressing table, with the number of times the current input took it.
 * A *feature* is an edge together with the class of its hit count (1, 2, 3, 4-7, 8-15,
 * 16-31, 32-127, 128+): an input that reaches a new edge, or takes a known one a new number
 * of times (one more loop iteration class), has a new feature. This file is compiled
 * without instrumentation, so that the recorder does not record itself. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define CAPACITY (1u << 17) /* edges; far above what the runtime has (a few thousand) */

static uintptr_t edge_from[CAPACITY], edge_to[CAPACITY];
static uint32_t hits[CAPACITY];     /* this input's count per edge */
static uint8_t classes[CAPACITY];   /* hit-count classes seen per edge, one bit each */
static uint32_t touched[CAPACITY];  /* edges this input took, in first-taken order */
static uint32_t ntouched, nedges, dropped;
static uintptr_t prev;
static int recording;

void __sanitizer_cov_trace_pc(void)
{
    uintptr_t pc = (uintptr_t)__builtin_return_address(0), from = prev;
    prev = pc;
    if (!recording)
        return;
    uint32_t h = (uint32_t)(((uint64_t)pc * 0x9E3779B97F4A7C15ull ^ (uint64_t)from * 0xC2B2AE3D27D4EB4Full) >> 47);
    for (uint32_t probes = 0; probes < CAPACITY; probes++, h = (h + 1) & (CAPACITY - 1)) {
        if (edge_to[h] == pc && edge_from[h] == from)
            break;
        if (edge_to[h] == 0) {
            if (nedges >= CAPACITY / 2) { /* keep probes short: count, do not insert */
                dropped++;
                return;
            }
            edge_to[h] = pc;
            edge_from[h] = from;
            nedges++;
            break;
        }
    }
    if (hits[h]++ == 0)
        touched[ntouched++] = h;
}

static uint8_t hit_class(uint32_t n)
{
    return n == 1 ? 1 : n == 2 ? 2 : n == 3 ? 4 : n < 8 ? 8 : n < 16 ? 16 : n < 32 ? 32 : n < 128 ? 64 : 128;
}

void fuzz_edges_begin(void)
{
    prev = 0;
    recording = 1;
}

/* The end of an input: the number of features it had that no input before it had. */
uint32_t fuzz_edges_end(void)
{
    recording = 0;
    uint32_t fresh = 0;
    for (uint32_t i = 0; i < ntouched; i++) {
        uint32_t h = touched[i];
        uint8_t c = hit_class(hits[h]);
        if (!(classes[h] & c)) {
            classes[h] |= c;
            fresh++;
        }
        hits[h] = 0;
    }
    ntouched = 0;
    return fresh;
}

uint32_t fuzz_edges_count(void) { return nedges; }

/* Forget every edge seen (a new measurement in the same process). */
void fuzz_edges_clear(void)
{
    memset(edge_from, 0, sizeof edge_from);
    memset(edge_to, 0, sizeof edge_to);
    memset(classes, 0, sizeof classes);
    nedges = dropped = 0;
}

uint32_t fuzz_edges_dropped(void) { return dropped; }

/* Every edge seen, as offsets into the module (an edge from the start of an input comes
 * from 0); up to n of them. Returns how many were written. */
uint32_t fuzz_edges_list(uint64_t *from, uint64_t *to, uint32_t n)
{
    Dl_info info;
    uintptr_t base = dladdr((void *)fuzz_edges_begin, &info) ? (uintptr_t)info.dli_fbase : 0;
    uint32_t k = 0;
    for (uint32_t h = 0; h < CAPACITY && k < n; h++)
        if (edge_to[h]) {
            from[k] = edge_from[h] ? edge_from[h] - base : 0;
            to[k++] = edge_to[h] - base;
        }
    return k;
}

#ifdef FUZZ_GCOV
void __gcov_dump(void);
void __gcov_reset(void);
#endif

/* Zero the gcov counters (the start of a measured run): 1 when the module has them. */
int fuzz_gcov_reset(void)
{
#ifdef FUZZ_GCOV
    __gcov_reset();
    return 1;
#else
    return 0;
#endif
}

/* Write the gcov counters now, to $GCOV_PREFIX; the exit of the process then writes none. */
int fuzz_gcov_dump(void)
{
#ifdef FUZZ_GCOV
    __gcov_dump();
    return 1;
#else
    return 0;
#endif
}
