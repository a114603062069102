/* internal.h -- shared between the native runtime's subsystems; not part of the API. */
#ifndef SPYRE_INTERNAL_H
#define SPYRE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "spyre.h"

#define SPY_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- errors (status.c) ---- */
spy_status spy_fail(spy_status s, int64_t command, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void spy_clear_error(void);
/* Names the plan job the last failure happened in (see spy_last_error_job). */
void spy_note_error_job(int64_t job);

/* ---- small helpers ---- */
uint64_t spy_now_ns(void);
uint32_t spy_dtype_size(uint32_t dtype);
static inline bool spy_add_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_add_overflow(a, b, r); }
static inline bool spy_mul_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }

/* ---- allocator (alloc.c) ---- */
typedef struct spy_program spy_program;

typedef struct spy_block {
    uint64_t addr;
    uint64_t size;        /* rounded to the stick */
    uint32_t kind;        /* SPY_MEM_DATA / SPY_MEM_CONTROL */
    uint8_t *backing;     /* NULL for DATA in timing mode */
    spy_program *prog;    /* the committed program resident here, or NULL */
    uint32_t plan_owned;  /* a plan's program: only the plan may free it, nothing may write it */
} spy_block;

typedef struct spy_range {
    uint64_t addr;
    uint64_t size;
} spy_range;

typedef struct spy_allocator {
    uint64_t base, capacity, align;
    spy_block *live;      /* sorted by addr */
    size_t nlive, caplive;
    spy_range *free;      /* sorted by addr, coalesced */
    size_t nfree, capfree;
    spy_block *cache;     /* freed blocks kept for reuse (backing kept) */
    size_t ncache, capcache;
    uint64_t allocated, peak, cached, control, data_peak;
    uint64_t total_allocs, total_frees, ooms;
} spy_allocator;

spy_status spy_alloc_init(spy_allocator *a, uint64_t base, uint64_t capacity, uint64_t align);
void spy_alloc_destroy(spy_allocator *a);
spy_status spy_alloc_get(spy_allocator *a, uint64_t nbytes, uint32_t kind, bool backed,
                         uint64_t *addr);
spy_status spy_alloc_put(spy_allocator *a, uint64_t addr);
void spy_alloc_release_cache(spy_allocator *a);
/* The live block containing [addr, addr+len), or NULL. */
spy_block *spy_alloc_find(spy_allocator *a, uint64_t addr, uint64_t len);
void spy_alloc_stats(const spy_allocator *a, spy_mem_stats *out);

/* ---- programs (program.c) ---- */
struct spy_program {
    const spy_job_header *hdr;
    const spy_slot *slots;
    const spy_cmd *cmds;
    const uint32_t *deps;
    const spy_instr *instrs;
    const spy_desc *descs;
    uint8_t *slot_written;   /* per slot: some command writes through it */
    uint32_t *order;         /* a topological order of the commands */
    uint64_t nedges;         /* dependency edges: the sum of the commands' ndeps (windows
                                may overlap, so this can exceed the header's ndeps) */
    uint32_t *h2d_pairs;     /* (source slot, destination slot) of each H2D command */
    uint32_t nh2d;
    uint64_t bytes_h2d, bytes_d2h;
    spy_job_info info;
};

/* Decode and validate a program block; on success *out owns a spy_program that points
 * into blob (blob must outlive it). */
spy_status spy_program_decode(const spy_profile *p, const void *blob, uint64_t len,
                              spy_program **out);
void spy_program_free(spy_program *prog);

/* ---- device ---- */
typedef struct spy_trace {
    bool enabled, commands;
    spy_trace_event *ev;
    uint64_t n, cap;
    char **names;
    uint32_t nnames, capnames;
} spy_trace;

typedef struct spy_sim spy_sim;

struct spy_device {
    pthread_mutex_t lock;
    spy_profile prof;
    uint32_t mode;
    uint32_t ordinal;
    uint64_t instance;         /* address window: unique among the devices of the process */
    bool lost;
    spy_allocator mem;
    uint8_t **lx;              /* per-core scratchpads (functional mode) */
    uint64_t clock_origin;     /* spy_now_ns() at open */
    uint64_t excluded_ns;      /* simulator time excluded from the host clock */
    uint64_t waited_ns;        /* host clock moved forward by synchronize */
    double device_free;        /* end of the last job */
    uint64_t job_seq;
    spy_counters counters;
    spy_trace trace;
    spy_sim *sim;
    uint64_t epoch;            /* bumped by spy_device_reset: stale DLPack deleters skip */
    uint64_t dlpack_live;
    /* fault injection */
    uint32_t fault_kind;
    uint64_t fault_after;
};

uint64_t spy_host_clock_locked(spy_device *dev);
void spy_trace_push(spy_device *dev, const spy_trace_event *ev);

/* ---- functional execution (exec.c) ---- */
typedef struct spy_exec_ctx {
    spy_device *dev;
    const spy_program *prog;
    uint8_t **slot_host;       /* per slot: host memory behind it, NULL when not backed */
} spy_exec_ctx;

/* ---- simulation (sim.c): runs one job on the timeline from `start`, applying each
 * command's effect through ctx as it starts; *duration is the job's length. */
spy_status spy_sim_run(spy_device *dev, const spy_program *prog, spy_exec_ctx *ctx,
                       double start, uint32_t name, double *duration);
spy_sim *spy_sim_new(void);
/* Bytes an H2D/D2H command moves over PCIe. */
uint64_t spy_host_dma_bytes(const spy_program *g, const spy_cmd *c);
void spy_sim_free(spy_sim *sim);

spy_status spy_exec_command(spy_exec_ctx *ctx, uint32_t index);

/* ---- arithmetic kernels ---- */
void spy_gemm(const spy_matmul *mm, const uint8_t *lx_a, const uint8_t *lx_b, uint8_t *lx_c,
              bool accumulate, bool trans_a, bool trans_b);
spy_status spy_sfu_run(const spy_instr *ins, uint8_t *lx);
/* Cost of one SFU instruction in cycles on one core. */
double spy_sfu_cycles(const spy_profile *p, const spy_instr *ins);
/* Scratchpad extent [lo, hi) of an operand of an instruction; false if it has none. */
bool spy_operand_extent(const spy_operand *o, uint32_t rows, uint32_t cols, uint64_t *lo,
                        uint64_t *hi);

/* fp16 / bf16 conversion */
float spy_f16_to_f32(uint16_t h);
uint16_t spy_f32_to_f16(float f);
float spy_bf16_to_f32(uint16_t h);
uint16_t spy_f32_to_bf16(float f);

#endif
