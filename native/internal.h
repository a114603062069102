/* internal.h -- the native runtime's internal contract; not part of the API (spyre.h is).
 *
 * Every function one file calls in another is declared here, once, in the section of the
 * file that defines it; a file-local function stays static in its file. The files form
 * layers, and a file calls only into layers below its own (status.c into none):
 *
 *   layer 1  device.c plan.c transfer.c dlpack.c construct.c build_matmul.c build_loop.c build_attention.c tiling.c   entry points, the builders, the matmul search
 *   layer 2  job.c memory.c graph.c                one job's run; the memory API; blocks under construction
 *   layer 3  sim.c alloc.c ccl.c                   the timeline; the address space; the ring between processes
 *   layer 4  exec.c trace.c program.c profile.c    effects, trace, validation, figures
 *   layer 5  gemm.c sfu.c                          the arithmetic units
 *   layer 6  half.c status.c                       conversions, errors
 *
 * tests/test_native_c.py checks this picture against the compiled objects. The sections
 * below come in the order their types need, lower layers first. */
#ifndef SPYRE_INTERNAL_H
#define SPYRE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "spyre.h"

#define SPY_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- status.c: the calling thread's last error, small helpers ------------------------ */

spy_status spy_fail(spy_status s, int64_t command, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void spy_clear_error(void);
/* Names the plan job the last failure happened in (see spy_last_error_job). */
void spy_note_error_job(int64_t job);
uint64_t spy_now_ns(void);
/* CPU time of the calling thread (CLOCK_THREAD_CPUTIME_ID). */
uint64_t spy_thread_cpu_ns(void);
/* CPU time the calling thread consumed since it last took `key` (nonzero; 0 the first
 * time), and the thread's mark for `key` moved to now. Each device takes its own key, so
 * a thread's CPU time is handed to a device once, at the thread's next call into it. */
uint64_t spy_thread_cpu_take(uint64_t key);
uint32_t spy_dtype_size(uint32_t dtype);
static inline bool spy_add_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_add_overflow(a, b, r); }
static inline bool spy_mul_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }

/* ---- half.c: fp16 / bf16 conversion ---------------------------------------------------- */

float spy_f16_to_f32(uint16_t h);
uint16_t spy_f32_to_f16(float f);
float spy_bf16_to_f32(uint16_t h);
uint16_t spy_f32_to_bf16(float f);
void spy_f16_to_f32_n(const uint16_t *s, float *d, size_t n);
void spy_f32_to_f16_n(const float *s, uint16_t *d, size_t n);

/* ---- gemm.c: the systolic arrays' arithmetic ------------------------------------------- */

/* Packing panels of one device (owned by it: spy_gemm_panels_free at close). */
typedef struct spy_gemm_panels {
    float *a, *b, *tmp;
} spy_gemm_panels;

void spy_gemm(const spy_matmul *mm, const uint8_t *lx_a, const uint8_t *lx_b, uint8_t *lx_c,
              bool accumulate, bool trans_a, bool trans_b, spy_gemm_panels *panels);
void spy_gemm_panels_free(spy_gemm_panels *panels);

/* ---- sfu.c: the special-function units --------------------------------------------------- */

/* Staging rows of one device (owned by it: spy_sfu_rows_free at close). */
typedef struct spy_sfu_rows {
    float *f[4];
    int64_t *i[4];
    size_t cap;
} spy_sfu_rows;

/* The op table's row of an opcode, or NULL when no op has it. */
const spy_sfu_op *spy_sfu_op_find(uint32_t opcode);
/* Run one validated instruction on a core's scratchpad. */
spy_status spy_sfu_run(const spy_instr *ins, uint8_t *lx, spy_sfu_rows *rows);
void spy_sfu_rows_free(spy_sfu_rows *rows);
/* Cost of one SFU instruction in cycles on one core. */
double spy_sfu_cycles(const spy_profile *p, const spy_instr *ins);

/* ---- program.c: decoding and validating program blocks; facts about commands --------- */

struct spy_program {
    const spy_job_header *hdr;
    const spy_slot *slots;
    const spy_cmd *cmds;
    const uint32_t *deps;
    const spy_instr *instrs;
    const spy_desc *descs;
    uint8_t *slot_written;   /* per slot: some command writes through it */
    uint64_t nedges;         /* dependency edges: the sum of the commands' ndeps (windows
                                may overlap, so this can exceed the header's ndeps) */
    uint32_t *h2d_pairs;     /* (source slot, destination slot) of each H2D command */
    uint32_t nh2d;
    uint64_t bytes_h2d, bytes_d2h;
    spy_job_info info;
    /* The job's length on the timeline, recorded at its first run (timed != 0): it depends
     * on the program alone, the simulator running in job-relative time (job.c reuses it). */
    double duration_ns;
    double compute_ns[2]; /* the span of its compute commands, from its start ([0] < 0: none) */
    uint32_t timed;
};
typedef struct spy_program spy_program;

/* SPY_E_BAD_PROGRAM unless blob holds a block `what` ("program", "plan") can start with: at
 * least header_bytes, 8-byte aligned, the magic and version its header opens with. */
spy_status spy_block_check(const void *blob, uint64_t len, uint64_t header_bytes, uint32_t magic,
                           uint32_t version, const char *what);
/* Decode and validate a program block; on success *out owns a spy_program that points
 * into blob (blob must outlive it). */
spy_status spy_program_decode(const spy_profile *p, const void *blob, uint64_t len,
                              spy_program **out);
void spy_program_free(spy_program *prog);
/* The engine a command runs on: per core SPY_ENG_PER_CORE engines, then the card's
 * SPY_ENG_H2D, SPY_ENG_D2H and SPY_ENG_CTRL after the last core's. */
uint32_t spy_engine_of(const spy_profile *p, const spy_cmd *c);
/* Engines of a card: the simulator's and the validator's engine index space. */
static inline uint32_t spy_num_engines(const spy_profile *p) { return p->num_cores * SPY_ENG_PER_CORE + 3; }
/* Bytes an H2D/D2H command moves over PCIe. */
uint64_t spy_host_dma_bytes(const spy_program *g, const spy_cmd *c);
/* The scratchpad bytes [*lo, *hi) an SFU operand of a rows x cols instruction covers (kinds
 * TILE, ROW, COL and SCALAR; false for the others). */
bool spy_operand_extent(const spy_operand *o, uint32_t rows, uint32_t cols, uint64_t *lo, uint64_t *hi);

/* ---- alloc.c: the device DRAM allocator -------------------------------------------------- */

typedef struct spy_block {
    uint64_t addr;
    uint64_t size;        /* rounded to the stick */
    uint32_t kind;        /* SPY_MEM_DATA / SPY_MEM_CONTROL */
    uint8_t *backing;     /* NULL for DATA in timing mode */
    spy_program *prog;    /* the committed program resident here, or NULL (owned) */
    uint32_t plan_owned;  /* a plan's program: only the plan may free it, nothing may write it */
    spy_layout layout;    /* the stick layout recorded for a DATA block; itemsize 0: none */
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
    uint64_t allocated, peak, cached, control, data_peak, reserved_peak;
    uint64_t total_allocs, total_frees, ooms;
    /* One more at every free and every program committed into a block: while it stays the
     * same, every address that lay inside a live block still does, in a block of the same
     * kind (what a plan launch checks of its bindings; see plan.c). */
    uint64_t changes;
} spy_allocator;

spy_status spy_alloc_init(spy_allocator *a, uint64_t base, uint64_t capacity, uint64_t align);
void spy_alloc_destroy(spy_allocator *a);
/* A new block of nbytes (rounded to the alignment) recording layout (NULL: none; the
 * caller validated it). */
spy_status spy_alloc_get(spy_allocator *a, uint64_t nbytes, uint32_t kind, bool backed,
                         const spy_layout *layout, uint64_t *addr);
spy_status spy_alloc_put(spy_allocator *a, uint64_t addr);
void spy_alloc_release_cache(spy_allocator *a);
/* The live block containing [addr, addr+len), or NULL. The pointer is valid until the
 * next allocation or free. */
spy_block *spy_alloc_find(spy_allocator *a, uint64_t addr, uint64_t len);
void spy_alloc_stats(const spy_allocator *a, spy_mem_stats *out);
/* Drop the committed program resident in b, if any: b was written. */
void spy_block_uncommit(spy_block *b);

/* ---- ccl.c: the ring's clock and its rounds without data (collectives of card jobs) ---- */

/* The time this rank's card is ready for its next collective (ns of its timeline): every
 * round publishes it beside the call's descriptor. */
void spy_ccl_set_clock(spy_ccl *c, double clock);
/* The latest of every rank's clock at the last round: when the collective can start. */
double spy_ccl_clock(const spy_ccl *c);
/* One round that moves no data: the descriptor (kind, size, dtype, op, root/tag) compared
 * and the clocks exchanged, as a collective of timing-mode cards does. */
spy_status spy_ccl_sync(spy_ccl *c, const uint64_t desc[5]);
/* Bytes of one element of a ccl element type, 0 for an unknown type. */
uint32_t spy_ccl_elem_size(uint32_t dtype);
/* ccl.c's kind numbers, for a descriptor of spy_ccl_sync */
#define SPY_CCL_KIND_ALLREDUCE 1
#define SPY_CCL_KIND_ALLGATHER 2
#define SPY_CCL_KIND_REDUCE_SCATTER 3
#define SPY_CCL_KIND_BROADCAST 4

/* ---- trace.c: the trace buffer ------------------------------------------------------------ */

typedef struct spy_trace {
    bool enabled, commands;
    spy_trace_event *ev;
    uint64_t n, cap;
    char **names;
    uint32_t nnames, capnames;
} spy_trace;

typedef struct spy_device spy_device;

/* Append an event (best effort: an event that finds no host memory is dropped). */
void spy_trace_push(spy_device *dev, const spy_trace_event *ev);
/* The host-side span of a launch, from host_start to now, that ran njobs jobs from
 * first_job on (nothing when the trace is off or no job ran). */
void spy_trace_launch(spy_device *dev, uint32_t name, uint64_t host_start, uint64_t first_job,
                      uint64_t njobs);
/* A job on the device timeline, [start, end), of ncmds commands (nothing when the trace is off). */
/* A job's event; with compute (not NULL, compute[0] >= 0: offsets from start) its compute
 * span's event after it. */
void spy_trace_job(spy_device *dev, uint64_t job, double start, double end, uint32_t name, uint64_t ncmds,
                   const double *compute);
void spy_trace_free(spy_trace *t);

/* ---- the device object (its functions: device.c) ------------------------------------------ */

typedef struct spy_sim spy_sim;

struct spy_device {
    pthread_mutex_t lock;      /* every entry point holds it: one card, several threads */
    spy_profile prof;
    uint32_t mode;
    uint32_t ordinal;
    uint64_t instance;         /* address window: unique among the devices of the process */
    bool lost;
    spy_allocator mem;
    uint8_t **lx;              /* per-core scratchpads (functional mode) */
    /* The host clock (see spy_host_clock_locked): CPU time of the threads calling into the
     * device, less the card's own work, plus the waits for the card; its wall twin beside. */
    uint64_t clock_key;        /* the device's key in each thread's CPU marks (instance + 1) */
    uint64_t host_cpu_ns;      /* CPU time handed over by calling threads, card work left out */
    uint64_t excluded_ns;      /* CPU time of the card's work left out of host_cpu_ns */
    uint64_t waited_ns;        /* host clock moved forward by synchronize */
    uint64_t clock_origin;     /* spy_now_ns() at open */
    uint64_t excluded_wall_ns; /* wall time of the card's work */
    bool excluding;            /* inside the card's work (spy_card_work_begin) */
    uint64_t excluding_wall0;  /* spy_now_ns() when it began */
    double device_free;        /* end of the last job */
    double device_work;        /* the device's own time (spy_clock.work_ns) */
    uint64_t job_seq;
    spy_counters counters;
    spy_trace trace;
    spy_sim *sim;
    _Atomic uint64_t epoch;    /* bumped by spy_device_reset (under the lock); read without it
                                  by spy_device_epoch. Stale DLPack deleters skip. */
    uint64_t dlpack_live;
    /* scratch of the running job, owned by the device and used under its lock */
    uint8_t **slot_host;       /* per slot: host memory behind it, NULL when not backed */
    size_t slot_host_cap;
    spy_sfu_rows sfu_rows;
    spy_gemm_panels gemm_panels;
    /* fault injection */
    uint32_t fault_kind;
    uint64_t fault_after;
};

static inline void spy_lock(spy_device *d) { pthread_mutex_lock(&d->lock); }
static inline void spy_unlock(spy_device *d) { pthread_mutex_unlock(&d->lock); }

/* Copy a field of the device under its lock (the getters' one step). */
static inline void spy_read_locked(spy_device *d, void *dst, const void *field, size_t n)
{
    spy_lock(d);
    memcpy(dst, field, n);
    spy_unlock(d);
}

/* The discipline of an entry point that takes a device: clear the thread's error, refuse
 * a null device, take the lock and count the call; SPY_LEAVE unlocks and returns. */
#define SPY_ENTER(d)                                                                               \
    do {                                                                                           \
        spy_clear_error();                                                                         \
        if (!(d))                                                                                  \
            return spy_fail(SPY_E_INVALID_ARG, -1, "null device");                                 \
        spy_lock(d);                                                                               \
        (d)->counters.native_calls++;                                                              \
    } while (0)

#define SPY_LEAVE(d, s)                                                                            \
    do {                                                                                           \
        spy_status s_ = (s);                                                                       \
        spy_unlock(d);                                                                             \
        return s_;                                                                                 \
    } while (0)

#define SPY_REFUSE_IF_LOST(d)                                                                      \
    if ((d)->lost)                                                                                 \
    SPY_LEAVE(d, spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", (d)->ordinal))

/* Host clock of a locked device (spy_host_clock_ns without the lock): the calling thread
 * hands over the CPU time it consumed since its last call into this device, unless the card
 * is working (its work is the card's, not the host's). */
static inline uint64_t spy_host_clock_locked(spy_device *d)
{
    if (!d->excluding)
        d->host_cpu_ns += spy_thread_cpu_take(d->clock_key);
    return d->host_cpu_ns + d->waited_ns;
}

/* The host clock's wall twin: monotonic time since open, less the wall time of the card's
 * work, plus the same waits for the card as the host clock. With one calling thread it is
 * the host clock plus the time the host spent off the CPU (sleeping, blocked, or waiting for
 * a core another process held). */
static inline uint64_t spy_host_wall_locked(const spy_device *d)
{
    uint64_t now = d->excluding ? d->excluding_wall0 : spy_now_ns();
    return now - d->clock_origin - d->excluded_wall_ns + d->waited_ns;
}

/* The card's own work on a locked device (simulating a job, walking a resident plan):
 * what the calling thread spends between begin and end leaves the host clock, in CPU time
 * (excluded_ns, counters.sim_cpu_ns) and in wall time (excluded_wall_ns, counters.sim_ns).
 * Nested spans belong to the outermost. Returns whether this span is the outermost. */
static inline bool spy_card_work_begin(spy_device *d)
{
    if (d->excluding)
        return false;
    d->host_cpu_ns += spy_thread_cpu_take(d->clock_key);
    d->excluding = true;
    d->excluding_wall0 = spy_now_ns();
    return true;
}

static inline void spy_card_work_end(spy_device *d, bool outermost)
{
    if (!outermost)
        return;
    /* the wall span inside the CPU span (read after begin's, before end's CPU reading), so
     * that the wall twin, which leaves the wall span out, is not set below the host clock */
    uint64_t wall = spy_now_ns() - d->excluding_wall0;
    uint64_t cpu = spy_thread_cpu_take(d->clock_key); /* not handed over: the card's */
    d->excluded_ns += cpu;
    d->excluded_wall_ns += wall;
    d->counters.sim_cpu_ns += cpu;
    d->counters.sim_ns += wall;
    d->excluding = false;
}

/* ---- memory.c: the device's memory entry points ---------------------------------------- */

/* A layout the device can record for an allocation of nbytes (UINT64_MAX: of any size):
 * well-formed, in the device's stick size, fitting nbytes. SPY_E_INVALID_ARG otherwise. */
spy_status spy_layout_check(const spy_device *dev, const spy_layout *layout, uint64_t nbytes);

/* spy_malloc_many on a locked device (dlpack.c allocates a step's outputs with it). */
spy_status spy_mem_alloc_many_locked(spy_device *dev, uint32_t n, const uint64_t *nbytes,
                                     const spy_layout *layouts, uint64_t *addrs);

/* ---- exec.c: the functional effect of each command ---------------------------------------- */

typedef struct spy_exec_ctx {
    spy_device *dev;
    const spy_program *prog;
    uint8_t **slot_host;       /* per slot: host memory behind it, NULL when not backed */
} spy_exec_ctx;

spy_status spy_exec_command(spy_exec_ctx *ctx, uint32_t index);

/* ---- sim.c: the device timeline ------------------------------------------------------------ */

spy_sim *spy_sim_new(void);
void spy_sim_free(spy_sim *sim);
/* Run one job on the timeline from `start`, applying each command's effect through ctx as
 * it starts; *duration is the job's length, compute[0..1] the span of its compute commands
 * (systolic arrays and SFU) from its start (compute[0] < 0: it has none). */
spy_status spy_sim_run(spy_device *dev, const spy_program *prog, spy_exec_ctx *ctx,
                       double start, uint32_t name, double *duration, double compute[2]);

/* ---- graph.c: program blocks under construction (the native builder's common part) ----
 * Builders (construct.c) append to a spy_graph and encode it once. Appending reports no
 * error: the first host allocation that fails marks the graph, spy_graph_encode then fails
 * with SPY_E_HOST_NOMEM (a pointer an append returned is NULL; check it before writing).
 * Pointers into a graph's arrays are valid until its next append. */

/* Host memory for builders (graph.c): large buffers freed are kept to be handed out again
 * (a build's block and arrays would otherwise be faulted in page by page at every launch).
 * What spy_host_alloc gives is freed with spy_host_free only; realloc keeps `used` bytes. */
void *spy_host_alloc(uint64_t bytes);
void spy_host_free(void *p);
void *spy_host_realloc(void *p, uint64_t used, uint64_t bytes);

typedef struct spy_vec {
    void *data;
    uint64_t len, cap; /* in elements */
    uint32_t elem;     /* bytes of one element */
    bool failed;
} spy_vec;

/* n zeroed elements appended; their address, or NULL (the vector is then failed). */
void *spy_vec_push(spy_vec *v, uint64_t n);
/* Room for n more elements without moving them (false: the vector is failed). */
bool spy_vec_reserve(spy_vec *v, uint64_t n);
void spy_vec_free(spy_vec *v);

/* The sections of one program block being written (spy_block_alloc). */
typedef struct spy_block_sections {
    spy_slot *slots;
    spy_cmd *cmds;
    uint32_t *deps;
    spy_desc *descs;
} spy_block_sections;

/* Bytes of a block of these counts, or false when they pass SPY_BUILD_MAX_BYTES. */
bool spy_block_bytes(uint32_t nslots, uint64_t ncmds, uint64_t ndeps, uint64_t ndescs, uint64_t *total);
/* An 8-byte aligned, zeroed block of `total` bytes with its header written; *blk points at
 * its sections and *out owns it. */
spy_status spy_block_alloc(uint64_t total, uint32_t nslots, uint32_t ncmds, uint32_t ndeps, uint32_t ndescs,
                           spy_built *out, spy_block_sections *blk);
/* A graph record checked whole and encoded (spy_build_graph's work, see spyre.h). */
spy_status spy_graph_encode_record(const spy_graph_record *r, spy_built *out);

typedef struct spy_graph {
    spy_vec slots, cmds, keys, instrs, descs;
    spy_vec pairs; /* dependency pairs: (after, before) as uint32, commands in the order made */
} spy_graph;

void spy_graph_init(spy_graph *g);
void spy_graph_free(spy_graph *g);
/* A new slot; its index. */
uint32_t spy_graph_slot(spy_graph *g, uint32_t kind, uint64_t extent);
/* n zeroed commands of program-order key `key`; *first is the index of the first (the
 * order of appending, which dependencies name). */
spy_cmd *spy_graph_add(spy_graph *g, uint64_t n, int64_t key, uint64_t *first);
/* Room for ncmds more commands and npairs more dependency pairs (a builder that knows
 * about how many it makes saves the arrays' regrowth). */
void spy_graph_reserve(spy_graph *g, uint64_t ncmds, uint64_t npairs);
/* Command `after` waits for command `before` (indices in the order of appending). */
void spy_graph_depend(spy_graph *g, uint64_t after, uint64_t before);
/* Every command of [after, after + na) waits for every command of [before, before + nb): the
 * pairs of each waiting command in turn. */
void spy_graph_depend_runs(spy_graph *g, uint64_t after, uint64_t na, uint64_t before, uint64_t nb);
spy_instr *spy_graph_instrs(spy_graph *g, uint64_t n, uint64_t *first);
spy_desc *spy_graph_descs(spy_graph *g, uint64_t n, uint64_t *first);
/* The block: commands sorted stably by key, each one's dependencies in the order given. */
spy_status spy_graph_encode(const spy_graph *g, spy_built *out);

/* ---- job.c: committing programs and running one job ----------------------------------------- */

/* Validate the program resident in b's first len bytes and make it b's committed program. */
spy_status spy_job_commit_block(spy_device *dev, spy_block *b, uint64_t len, spy_job_info *info);
/* Host memory behind each of n slots, for the job being bound: device-owned scratch, valid
 * until the next call (NULL when host memory ran out). */
uint8_t **spy_job_slot_hosts(spy_device *dev, size_t n);
/* Bind the slots of the program committed in blk to addr and run it (launch, transfer). */
spy_status spy_job_run_bound(spy_device *dev, spy_block *blk, const uint64_t *addr,
                             double not_before, uint32_t name, double *end);
/* Run a job whose slots are resolved in the device's slot scratch (plans). */
spy_status spy_job_execute(spy_device *dev, spy_program *g, double not_before,
                           uint32_t name, double *end);
/* SPY_OK if c describes a collective the ring can run (kind, sizes, type, op, root, time). */
spy_status spy_collective_check(const spy_collective *c);
/* Run collective c through ring on the host memory behind its input and output (both NULL
 * on a timing-mode card: the clocks alone are exchanged), starting no sooner than not_before
 * and the card being free; *end is its end (see spy_collective_launch). */
spy_status spy_job_collective(spy_device *dev, spy_ccl *ring, const spy_collective *c, uint8_t *in, uint8_t *out,
                              double not_before, uint32_t name, double *end);

#endif
