/*
 * spyre.h -- the contract of the spyre_rt native runtime and its simulated card.
 *
 * One prefix (spy_), one status type, no Python or torch, no hidden globals: the state
 * outside a device is the calling thread's last error and the process's count of address
 * windows handed out (SPY_ADDRESS_BASE).
 * Every call that can fail returns a spy_status and records a message (spy_last_error)
 * naming what was wrong; a call refused for its arguments or the device's state leaves
 * the device as it was, and a job that fails stops at the failing command
 * (spy_last_error_command): the commands before it have had their effect. Getters return
 * their value (0 or NULL for a null handle); destroy and release calls return nothing.
 *
 * Model of the card
 *   Device DRAM is an address space handed out by an allocator. Tensor data lives in
 *   allocations of kind SPY_MEM_DATA (backed by host memory only in functional mode);
 *   program blocks -- uploaded programs and the programs of plans -- live in
 *   SPY_MEM_CONTROL allocations (always backed: the device must read them to run).
 *
 *   The device runs *jobs*. A job is an encoded program block (spy_job_header followed by
 *   slots, commands, dependencies, SFU instructions and DMA descriptors; see
 *   "Program block layout"). Commands never carry absolute addresses: DRAM and host
 *   operands are (slot, offset) pairs and a launch binds each slot to an address. A slot
 *   declares the extent it needs, so binding validates bounds once per slot and the
 *   commands were validated against the extents when the program was committed.
 *   This is IREE's binding table: record once, submit many times with new buffers bound.
 *
 *   A *plan* is a list of committed programs with a relocation table that derives every
 *   job's slot addresses from a small set of plan bindings (inputs, outputs, weights, the
 *   static arena). One spy_plan_launch runs a whole compiled step.
 *
 * Time
 *   Host time is real host work: spy_host_clock_ns() is CPU time (CLOCK_THREAD_CPUTIME_ID)
 *   of the threads that call into the device since it was opened, less the card's own work
 *   done on the calling thread (simulating a job, walking a resident plan; measured with the
 *   same clock), plus the time the host spent waiting in spy_synchronize. A thread hands
 *   its CPU time over at each call: from its first call into the device, every CPU
 *   nanosecond it spends between and inside calls counts once, so one dispatching thread
 *   counts exactly its CPU time, and several count their sum. Sleeping, blocking and
 *   waiting for a core another process holds are not CPU time and do not move it. The
 *   wall twin (spy_clock.host_wall_ns) is monotonic time since open, less the card's work
 *   in wall time, plus the same waits: the host clock with the host's time off the CPU put
 *   back (the device timeline follows the host clock, not its twin). Device time is
 *   simulated from the profile's figures. A job starts job_launch_ns after
 *   max(host clock at launch, end of the previous job) and each of its commands at
 *   max(job start, end of its dependencies, its engine becoming free).
 *
 * Ownership
 *   The device owns its allocations and the programs committed in them; spy_device_close
 *   frees them. The caller owns what a create or wrap call returns (transfer graphs,
 *   plans, DLPack tensors) and must destroy or release plans and DLPack tensors before
 *   closing their device, which they borrow. Buffers passed in (profiles, blobs, bindings,
 *   layouts, shapes) are borrowed for the call only, except host pointers bound to HOST
 *   slots, which must stay valid until the job has run (functional jobs run to completion
 *   inside the launch call). Tables the runtime hands out (spy_sfu_ops,
 *   spy_profile_figures) are static: nothing to free.
 */
#ifndef SPYRE_H
#define SPYRE_H

#ifndef SPY_CDEF /* build.py reads this header through the preprocessor with SPY_CDEF set */
#include <stddef.h>
#include <stdint.h>
#endif

/* The sizes this header states for its structures are checked by the compiler: plan files
 * and the Python layer's copies of the structures (tests/test_native_abi.py) rely on them. */
#if defined(SPY_CDEF)
#define SPY_ABI_SIZE(type, bytes)
#elif defined(__cplusplus)
#define SPY_ABI_SIZE(type, bytes) static_assert(sizeof(type) == (bytes), #type " is " #bytes " bytes");
#else
#define SPY_ABI_SIZE(type, bytes) _Static_assert(sizeof(type) == (bytes), #type " is " #bytes " bytes");
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status (status.c) ------------------------------------------------------------- */

typedef enum spy_status {
    SPY_OK = 0,
    SPY_E_INVALID_ARG = 1,   /* a null pointer, an unknown enum, a zero size */
    SPY_E_PROFILE = 2,       /* a device profile figure is missing or out of range */
    SPY_E_OOM = 3,           /* device DRAM cannot satisfy the allocation */
    SPY_E_BAD_ADDRESS = 4,   /* not a live allocation, or a range outside one */
    SPY_E_SCRATCHPAD = 5,    /* a scratchpad (LX) range outside the core's scratchpad */
    SPY_E_CYCLE = 6,         /* the job's dependencies form a cycle */
    SPY_E_BAD_COMMAND = 7,   /* malformed command: opcode, core, dtype, shape, slot */
    SPY_E_BAD_PROGRAM = 8,   /* malformed program block or plan: header, sizes, offsets */
    SPY_E_INDEX = 9,         /* a gather/scatter index outside its table (found at run time) */
    SPY_E_DMA = 10,          /* the DMA engine reported an error (fault injection) */
    SPY_E_COMMAND_FAULT = 11,/* a compute engine reported an error (fault injection) */
    SPY_E_DEVICE_LOST = 12,  /* the device is lost; only spy_device_reset helps */
    SPY_E_HOST_NOMEM = 13,   /* host memory for the runtime's own bookkeeping ran out */
    SPY_E_NOT_COMMITTED = 14,/* launch of a program that was not committed (validated) */
    SPY_E_LAYOUT = 15,       /* a plan binding whose storage records another stick layout */
    SPY_E_CCL_TIMEOUT = 16,  /* a peer did not reach a collective within the group's timeout */
    SPY_E_CCL_MISMATCH = 17, /* the ranks called different collectives (kind, size, dtype, op, root) */
    SPY_E_CCL_PEER = 18      /* a peer exited, or the group was aborted */
} spy_status;

/* The message of the calling thread's last failure ("" if none). */
const char *spy_last_error(void);
/* The index of the command the last failure was about, or -1. */
int64_t spy_last_error_command(void);
/* The index of the job of a plan the last failure was about (spy_plan_launch stops at the
 * first failing job: the jobs before it ran to completion, the later ones did not run), or
 * -1. */
int64_t spy_last_error_job(void);
const char *spy_status_name(spy_status s);

/* ---- the device profile (profile.c) -------------------------------------------------
 * Every figure the cost model uses, declared once, in SPY_PROFILE_FIGURES: it makes the
 * fields of spy_profile, the ranges spy_device_open accepts (spy_profile_check) and the
 * table the Python layer loads profiles/devices TOML files with (spy_profile_figures).
 * Adding a figure: the recipe "Add a device figure" of docs/ARCHITECTURE.md.
 *
 * X(type, field, key, unit, scale, sign, max)
 *   type   U32, U64 or F64: the C type of the field
 *   field  the spy_profile member, in the unit its name says (or a count or a ratio)
 *   key    the figure's name in a TOML profile, whose value is in `unit`
 *   scale  field = TOML value * scale
 *   sign   POSITIVE (> 0) or NONNEGATIVE (>= 0); every figure is finite
 *   max    the largest field value the simulator accepts; SPY_FIGURE_UNBOUNDED for none */
#define SPY_FIGURE_UNBOUNDED __builtin_inf()
/* clang-format off */
#define SPY_PROFILE_FIGURES(X)                                                                                         \
    X(U32, num_cores,                 "num_cores",                 "cores",               1,         POSITIVE,    256)   \
    X(U32, corelets_per_core,         "corelets_per_core",         "corelets",            1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) \
    X(U64, scratchpad_bytes,          "scratchpad_mib",            "MiB",                 1ull << 20, POSITIVE,   1ull << 31) /* per core (LX) */ \
    X(U64, dram_bytes,                "dram_gib",                  "GiB",                 1ull << 30, POSITIVE,   1ull << SPY_ADDRESS_WINDOW_SHIFT) \
    X(U32, stick_bytes,               "stick_bytes",               "B",                   1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* and a power of two */ \
    X(U32, dram_burst_bytes,          "dram_burst_bytes",          "B",                   1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* shorter runs cost a burst */ \
    X(F64, clock_ghz,                 "clock_ghz",                 "GHz",                 1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) \
    X(F64, pt_macs_per_ns,            "pt_macs_per_ns",            "MAC/ns/core",         1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* systolic arrays: fp16 peak per core */ \
    X(F64, pt_utilization,            "pt_utilization",            "ratio",               1,         POSITIVE,    1)     /* sustained / peak */ \
    X(F64, pt_fp32_ratio,             "pt_fp32_ratio",             "ratio",               1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* fp32 rate relative to fp16 */ \
    X(U32, pt_gran_m,                 "pt_gran_m",                 "rows",                1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* tile-shape granularity */ \
    X(U32, pt_gran_n,                 "pt_gran_n",                 "columns",             1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) \
    X(U32, pt_gran_k,                 "pt_gran_k",                 "elements",            1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) \
    X(F64, pt_latency_ns,             "pt_latency_ns",             "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) /* issue + drain per matmul */ \
    X(F64, sfu_elems_per_cycle,       "sfu_elems_per_cycle",       "elements/cycle/core", 1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* SFU, simple ops */ \
    X(F64, sfu_transcendental_cycles, "sfu_transcendental_cycles", "cycles/element",      1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* multiplier for exp/log/... */ \
    X(F64, sfu_fp32_ratio,            "sfu_fp32_ratio",            "ratio",               1,         POSITIVE,    1)     /* fp32 rate relative to fp16; at most 1: a wider element is never faster on the same lanes */ \
    X(F64, sfu_latency_ns,            "sfu_latency_ns",            "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) /* per instruction */ \
    X(F64, dram_bytes_per_ns,         "dram_bandwidth_gbps",       "GB/s",                1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* sustained, shared by the cores */ \
    X(F64, core_dma_bytes_per_ns,     "core_dma_gbps",             "GB/s",                1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* one core's DMA port */ \
    X(F64, dma_latency_ns,            "dma_latency_ns",            "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) /* per DRAM<->LX command */ \
    X(F64, pcie_bytes_per_ns,         "pcie_bandwidth_gbps",       "GB/s",                1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* host link, each direction */ \
    X(F64, pcie_latency_ns,           "pcie_latency_ns",           "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) /* per host DMA command */ \
    X(F64, pcie_descriptor_ns,        "pcie_descriptor_ns",        "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) /* per scatter-gather descriptor */ \
    X(F64, ring_bytes_per_cycle,      "ring_bytes_per_cycle",      "B/cycle",             1,         POSITIVE,    SPY_FIGURE_UNBOUNDED) /* per direction */ \
    X(F64, ring_hop_ns,               "ring_hop_ns",               "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) \
    X(F64, barrier_ns,                "barrier_ns",                "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) \
    X(F64, job_launch_ns,             "job_launch_ns",             "ns",                  1,         NONNEGATIVE, SPY_FIGURE_UNBOUNDED) /* job runnable to first command */
/* clang-format on */

#define SPY_FIGURE_CTYPE_U32 uint32_t
#define SPY_FIGURE_CTYPE_U64 uint64_t
#define SPY_FIGURE_CTYPE_F64 double

typedef struct spy_profile {
#define SPY_FIGURE_FIELD_(type, field, ...) SPY_FIGURE_CTYPE_##type field;
    SPY_PROFILE_FIGURES(SPY_FIGURE_FIELD_)
#undef SPY_FIGURE_FIELD_
} spy_profile;

/* A figure as the declaration describes it. */
#define SPY_FIGURE_U32 0
#define SPY_FIGURE_U64 1
#define SPY_FIGURE_F64 2
#define SPY_FIGURE_POSITIVE 0
#define SPY_FIGURE_NONNEGATIVE 1

typedef struct spy_figure {
    const char *field; /* the spy_profile member; static storage, like key and unit */
    const char *key;   /* its name in a TOML profile */
    const char *unit;  /* the unit of the TOML value */
    uint32_t type;     /* SPY_FIGURE_U32, _U64 or _F64 */
    uint32_t sign;     /* SPY_FIGURE_POSITIVE or _NONNEGATIVE */
    uint64_t offset;   /* of the field in spy_profile */
    double scale;      /* field = TOML value * scale */
    double max;        /* the largest field value accepted; infinity: no bound */
} spy_figure;

/* The declared figures, in the order of spy_profile's fields: *figures points to *n entries
 * in static storage, valid for the life of the process (nothing to free). */
spy_status spy_profile_figures(const spy_figure **figures, uint32_t *n);
/* The check spy_device_open makes: every figure finite, of its sign and at most its max,
 * stick_bytes a power of two. SPY_E_PROFILE names the first figure out of range. */
spy_status spy_profile_check(const spy_profile *profile);

/* ---- device (device.c) ------------------------------------------------------------- */

typedef struct spy_device spy_device;

#define SPY_MODE_FUNCTIONAL 0 /* computes every value */
#define SPY_MODE_TIMING 1     /* computes only time: no arithmetic, no backing for data */

/* Device addresses: every device opened in the process gets an address window of its own,
 * [SPY_ADDRESS_BASE + (i << SPY_ADDRESS_WINDOW_SHIFT), + 1 TiB) for its instance number i
 * (0, 1, 2... in the order of opening, whatever the ordinal), so an address names its
 * device: two devices never hand out the same address, even with the same ordinal. */
#define SPY_ADDRESS_BASE 0x100000000000
#define SPY_ADDRESS_WINDOW_SHIFT 40
#define SPY_MAX_DEVICE_INSTANCES 1048576 /* devices a process can open */

spy_status spy_device_open(const spy_profile *profile, uint32_t mode, uint32_t ordinal,
                           spy_device **out);
void spy_device_close(spy_device *dev);
uint32_t spy_device_mode(const spy_device *dev);
/* The device's instance number: its address window, unique in the process. */
uint64_t spy_device_instance(const spy_device *dev);
/* Clear a lost device: drops every allocation, program and plan, and starts a new epoch. */
spy_status spy_device_reset(spy_device *dev);
/* The device's reset epoch: 0 when opened, one more after every spy_device_reset. What was
 * allocated, committed or planned in an older epoch is gone, and its addresses may belong
 * to newer allocations. */
uint64_t spy_device_epoch(spy_device *dev);

/* ---- clocks (device.c) ---------------------------------------------------------------- */

uint64_t spy_host_clock_ns(spy_device *dev);
/* End of the last job on the device timeline. */
double spy_device_finish_ns(spy_device *dev);
/* Move the host clock to the device's finish (host waits for the device). */
spy_status spy_synchronize(spy_device *dev);
/* Move the host clock to t_ns, or to the device's finish if that is earlier, when the host
 * clock is behind it: the host waits until the device timeline reaches t_ns (an event
 * recorded there completes) and no longer. */
spy_status spy_synchronize_until(spy_device *dev, double t_ns);

/* The device's clocks, read at one instant (what an event records). */
typedef struct spy_clock {
    uint64_t host_ns;      /* spy_host_clock_ns: host CPU time (see "Time" above) */
    uint64_t host_wall_ns; /* its wall twin: monotonic, the card's work left out, same waits */
    double finish_ns;  /* spy_device_finish_ns: where work launched now would queue */
    double work_ns;    /* the device's own time since it was opened: the timeline less the
                          stretches the device sat idle because the host had not launched
                          work yet (each job's launch latency and run, each plan upload).
                          It does not depend on the host's speed; never reset. */
} spy_clock; /* 32 bytes */
SPY_ABI_SIZE(spy_clock, 32)

spy_status spy_clock_read(spy_device *dev, spy_clock *out);

/* ---- memory (memory.c) ------------------------------------------------------------- */

#define SPY_MEM_DATA 0
#define SPY_MEM_CONTROL 1

typedef struct spy_mem_stats {
    uint64_t capacity;
    uint64_t allocated;        /* bytes in live allocations (rounded to sticks) */
    uint64_t peak_allocated;
    uint64_t reserved;         /* allocated + free blocks kept in the cache */
    uint64_t peak_reserved;
    uint64_t control;          /* bytes of CONTROL allocations (part of allocated) */
    uint64_t data_allocated;   /* bytes of DATA allocations: what tensors hold */
    uint64_t data_peak;
    uint64_t free;             /* capacity - reserved */
    uint64_t largest_free;     /* largest block the address space can still give */
    uint64_t num_allocs;       /* live allocations */
    uint64_t total_allocs;     /* spy_malloc calls that succeeded (accumulated: counts since
                                  the device opened or spy_mem_reset_accumulated) */
    uint64_t total_frees;      /* accumulated */
    uint64_t num_ooms;         /* accumulated */
    double fragmentation;      /* 1 - largest_free / free, 0 when free == 0 */
} spy_mem_stats;

spy_status spy_malloc(spy_device *dev, uint64_t nbytes, uint32_t kind, uint64_t *addr);
spy_status spy_free(spy_device *dev, uint64_t addr);
/* spy_free of an allocation made in `epoch` (spy_device_epoch read before spy_malloc): if the
 * device was reset since, the reset dropped it and the address may now start a newer
 * allocation, so nothing is freed and the call succeeds. */
spy_status spy_free_epoch(spy_device *dev, uint64_t addr, uint64_t epoch);
/* Release cached free blocks back to the address space. */
spy_status spy_empty_cache(spy_device *dev);
spy_status spy_mem_stats_get(spy_device *dev, spy_mem_stats *out);
/* Peaks (peak_allocated, data_peak, peak_reserved) start again from the current values. */
spy_status spy_mem_reset_peak(spy_device *dev);
/* The accumulated counts (total_allocs, total_frees, num_ooms) start again from zero. */
spy_status spy_mem_reset_accumulated(spy_device *dev);
/* ---- stick layouts (memory.c) ----------------------------------------------------------
 * A DATA allocation may record the stick layout of the tensor storage it holds, so the
 * layers above find a storage's layout from its address. A layout: the storage holds
 * rows x row_len elements of itemsize bytes; each row is cut into sticks of stick_bytes,
 * padded to a whole stick, and sticks are stored stick-major: with S = stick_bytes /
 * itemsize, element (r, c) is at byte
 *   (c / S) * max(rows, 1) * stick_bytes + r * stick_bytes + (c % S) * itemsize
 * (spyre_rt.layout.StickLayout). The record belongs to its allocation: it is copied in,
 * and goes when the allocation is freed (spy_free, spy_free_epoch, a DLPack deleter, a
 * device reset). */

typedef struct spy_layout {
    uint64_t rows;        /* may be 0: an empty storage */
    uint64_t row_len;     /* elements per row, at least 1 */
    uint32_t itemsize;    /* bytes per element: 1, 2, 4 or 8 */
    uint32_t stick_bytes; /* the device profile's stick_bytes */
} spy_layout; /* 24 bytes */
SPY_ABI_SIZE(spy_layout, 24)

/* The bytes a layout occupies: max(rows, 1) * ceil(row_len / S) * stick_bytes.
 * SPY_E_INVALID_ARG for a malformed layout (itemsize, a stick_bytes that is not a power
 * of two of at least itemsize, row_len 0, a size past 2^64). */
spy_status spy_layout_bytes(const spy_layout *layout, uint64_t *nbytes);
/* spy_malloc recording a layout (NULL: none, as spy_malloc). A layout needs kind
 * SPY_MEM_DATA, the device's stick_bytes and at most nbytes bytes (spy_layout_bytes). */
spy_status spy_malloc_layout(spy_device *dev, uint64_t nbytes, uint32_t kind, const spy_layout *layout,
                             uint64_t *addr);
/* n DATA allocations in one call, all or nothing. Allocation i is nbytes[i] bytes or, with
 * nbytes NULL, the size of layouts[i]; layouts NULL records none. On success the caller
 * owns addrs[0..n) as if each came from spy_malloc. On failure (SPY_E_OOM names the
 * allocation that did not fit) none is left allocated -- their blocks may stay in the
 * free-block cache -- and addrs holds nothing to use. */
spy_status spy_malloc_many(spy_device *dev, uint32_t n, const uint64_t *nbytes, const spy_layout *layouts,
                           uint64_t *addrs);
/* The layout recorded for the allocation starting at addr; SPY_E_BAD_ADDRESS when addr does
 * not start a live allocation or it records none. */
spy_status spy_layout_of(spy_device *dev, uint64_t addr, spy_layout *out);

/* Direct access to backed memory (tests, program upload checks): copies len bytes.
 * Like every call that touches the card, refused with SPY_E_DEVICE_LOST on a lost card. */
spy_status spy_mem_read(spy_device *dev, uint64_t addr, void *dst, uint64_t len);
spy_status spy_mem_write(spy_device *dev, uint64_t addr, const void *src, uint64_t len);

/* ---- program block layout (validated by program.c) -----------------------------------
 * [spy_job_header][spy_slot * nslots][spy_cmd * ncmds][uint32 dep * ndeps, padded to 8]
 * [spy_instr * ninstrs][spy_desc * ndescs], all little endian, total == header.total_bytes */

#define SPY_JOB_MAGIC 0x4A595053u /* "SPYJ" */
#define SPY_JOB_VERSION 1u

typedef struct spy_job_header {
    uint32_t magic;
    uint32_t version;
    uint32_t ncmds;
    uint32_t ndeps;
    uint32_t ninstrs;
    uint32_t nslots;
    uint32_t ndescs;
    uint32_t flags;
    uint64_t total_bytes;
    uint64_t reserved[3];
} spy_job_header; /* 64 bytes */
SPY_ABI_SIZE(spy_job_header, 64)

#define SPY_SLOT_DRAM 0
#define SPY_SLOT_HOST 1

typedef struct spy_slot {
    uint32_t kind;
    uint32_t reserved;
    uint64_t extent; /* bytes from the bound address the commands may touch */
} spy_slot; /* 16 bytes */
SPY_ABI_SIZE(spy_slot, 16)

/* opcodes */
#define SPY_OP_BARRIER 1 /* a join; runs on the card's control engine */
#define SPY_OP_H2D 2     /* host slot -> DRAM slot over PCIe */
#define SPY_OP_D2H 3     /* DRAM slot -> host slot over PCIe */
#define SPY_OP_LOAD 4    /* DRAM slot -> core scratchpad */
#define SPY_OP_STORE 5   /* core scratchpad -> DRAM slot */
#define SPY_OP_MATMUL 6  /* systolic arrays, scratchpad operands */
#define SPY_OP_SFU 7     /* a vector program on the scratchpad */
#define SPY_OP_RING 8    /* scratchpad -> another core's scratchpad */
#define SPY_OP_GATHER 9  /* rows of a DRAM table picked by scratchpad indices -> scratchpad */
#define SPY_OP_SCATTER 10 /* scratchpad rows -> rows of a DRAM table picked by indices */
#define SPY_OP_COUNT 11

#define SPY_CORE_CARD 0xFFFFu /* core field of card-level commands (H2D, D2H, BARRIER) */

/* dtypes (storage types of DRAM and scratchpad data) */
#define SPY_DT_F32 0
#define SPY_DT_F16 1
#define SPY_DT_BF16 2
#define SPY_DT_I64 3
#define SPY_DT_I32 4
#define SPY_DT_I8 5
#define SPY_DT_U8 6
#define SPY_DT_BOOL 7
#define SPY_DT_COUNT 8

/* DMA flags */
#define SPY_DMA_DESCS 1 /* use the descriptor list, not the strided pattern */

typedef struct spy_dma {
    uint32_t src_slot;      /* LOAD/D2H/H2D: a slot; STORE: unused */
    uint32_t dst_slot;      /* STORE/H2D/D2H: a slot; LOAD: unused */
    uint64_t src_off;       /* bytes into the slot, or the scratchpad offset */
    uint64_t dst_off;
    uint32_t run_bytes;     /* contiguous bytes per run */
    uint32_t ndims;         /* 0..3 outer dimensions */
    uint32_t count[3];      /* innermost first */
    uint32_t desc_count;    /* SPY_DMA_DESCS: descriptors [desc_begin, +desc_count) */
    uint64_t src_stride[3]; /* bytes */
    uint64_t dst_stride[3];
} spy_dma; /* 96 bytes; with SPY_DMA_DESCS, src_off holds desc_begin */
SPY_ABI_SIZE(spy_dma, 96)

#define SPY_MM_ACCUMULATE 1
#define SPY_MM_TRANS_A 2
#define SPY_MM_TRANS_B 4

/* Typed scratchpad operands (matmul A, B and C, SFU operands, gather/scatter indices)
 * start at a multiple of their element size; the validator refuses others
 * (SPY_E_BAD_COMMAND). DMA and ring transfers move bytes and take any offset. */
typedef struct spy_matmul {
    uint32_t a_off, b_off, c_off;   /* scratchpad byte offsets (element aligned) */
    uint32_t m, n, k;
    uint32_t lda, ldb, ldc;         /* row pitch in elements */
    uint32_t a_dtype, b_dtype;      /* F16, BF16 or F32; C is F32 */
    uint32_t reserved[13];
} spy_matmul; /* 96 bytes: C[m,n] (+)= op(A)[m,k] op(B)[k,n] */
SPY_ABI_SIZE(spy_matmul, 96)

typedef struct spy_sfu {
    uint32_t instr_begin;
    uint32_t ninstrs;
    uint32_t reserved[22];
} spy_sfu; /* 96 bytes */
SPY_ABI_SIZE(spy_sfu, 96)

typedef struct spy_ring {
    uint32_t dst_core;
    uint32_t src_off;
    uint32_t dst_off;
    uint32_t bytes;
    uint32_t reserved[20];
} spy_ring; /* 96 bytes */
SPY_ABI_SIZE(spy_ring, 96)

/* GATHER: for i in [0, nidx): row = idx[i] (validated 0 <= row < limit);
 *   copy the pattern at slot[table_off + row*row_stride] -> scratchpad[lx_off + i*lx_pitch].
 * SCATTER: the reverse. The pattern is run_bytes with up to two outer dims; its
 * scratchpad side is packed: dims advance by run_bytes * inner counts. */
typedef struct spy_gather {
    uint32_t table_slot;
    uint32_t idx_off;      /* scratchpad offset of the indices */
    uint32_t idx_dtype;    /* I64 or I32 */
    uint32_t nidx;
    uint64_t table_off;
    uint64_t row_stride;
    uint64_t limit;        /* number of rows in the table */
    uint32_t lx_off;
    uint32_t lx_pitch;
    uint32_t run_bytes;
    uint32_t ndims;        /* 0..2 */
    uint32_t count[2];
    uint64_t stride[2];    /* DRAM side, bytes */
    uint32_t reserved[4];
} spy_gather; /* 96 bytes */
SPY_ABI_SIZE(spy_gather, 96)

typedef struct spy_cmd {
    uint8_t op;
    uint8_t flags;
    uint16_t core;
    uint32_t dep_begin;  /* into the job's dependency list */
    uint32_t ndeps;
    uint32_t reserved;
    union {
        spy_dma dma;
        spy_matmul mm;
        spy_sfu sfu;
        spy_ring ring;
        spy_gather gather;
    } u;
    uint8_t pad[16];
} spy_cmd; /* 128 bytes */
SPY_ABI_SIZE(spy_cmd, 128)

/* SFU instructions operate on rows x cols elements of scratchpad operands.
 * Arithmetic is float32 for float types and int64 for integer types; results are
 * rounded to the destination dtype. */
#define SPY_OPND_NONE 0
#define SPY_OPND_TILE 1   /* rows x cols, row pitch `pitch` elements */
#define SPY_OPND_ROW 2    /* one value per row: element r at off + r*pitch */
#define SPY_OPND_COL 3    /* one value per column: element c at off + c */
#define SPY_OPND_SCALAR 4 /* one value at off */
#define SPY_OPND_IMM 5    /* the immediate: imm_f for float dtypes, imm_i for integers */

#define SPY_OPND_FIXED 1 /* (a matmul record's program and pro_program) an operand that stays
                            where it is in every strip and piece: it holds one strip */

typedef struct spy_operand {
    uint8_t kind;
    uint8_t dtype;
    uint16_t reserved; /* 0 in a program; in a matmul record's programs, SPY_OPND_FIXED or 0 */
    uint32_t pitch;
    union {
        uint64_t off;
        double imm_f;
        int64_t imm_i;
    } v;
} spy_operand; /* 16 bytes */
SPY_ABI_SIZE(spy_operand, 16)

/* SFU opcodes: the op table of sfu_ops.h (one row per op: arity, cost, how it runs;
 * implemented in sfu.c). */
#include "sfu_ops.h"

typedef enum spy_sfu_opcode {
#define SPY_SFU_OPCODE_(NAME, opcode, ...) SPY_SFU_##NAME = opcode,
    SPY_SFU_OPS(SPY_SFU_OPCODE_)
#undef SPY_SFU_OPCODE_
} spy_sfu_opcode;

/* aux of SPY_SFU_CMP */
#define SPY_CMP_EQ 0
#define SPY_CMP_NE 1
#define SPY_CMP_LT 2
#define SPY_CMP_LE 3
#define SPY_CMP_GT 4
#define SPY_CMP_GE 5

typedef struct spy_instr {
    uint8_t op;
    uint8_t aux;
    uint16_t flags;
    uint32_t reserved;
    uint32_t rows;
    uint32_t cols;
    spy_operand dst;
    spy_operand src[3];
} spy_instr; /* 80 bytes */
SPY_ABI_SIZE(spy_instr, 80)

/* An SFU op as the table describes it (sfu_ops.h), for the layers above: the Python
 * emitter derives its opcodes and arities from these. */
#define SPY_SFU_COST_SIMPLE 0
#define SPY_SFU_COST_TRANSCENDENTAL 1
#define SPY_SFU_KIND_MAP 0
#define SPY_SFU_KIND_CAST 1
#define SPY_SFU_KIND_TEST 2
#define SPY_SFU_KIND_REDUCE 3
#define SPY_SFU_KIND_IOTA 4

typedef struct spy_sfu_op {
    const char *name; /* "ADD" for SPY_SFU_ADD; static storage */
    uint32_t opcode;
    uint32_t arity;   /* source operands: 1 to 3 */
    uint32_t aux_max; /* the largest aux the validator accepts */
    uint32_t cost;    /* SPY_SFU_COST_* */
    uint32_t kind;    /* SPY_SFU_KIND_* */
    uint32_t reserved;
} spy_sfu_op;

/* The op table, in opcode order: *ops points to *n entries in static storage, valid for
 * the life of the process (nothing to free). */
spy_status spy_sfu_ops(const spy_sfu_op **ops, uint32_t *n);

typedef struct spy_desc {
    uint64_t src_off;
    uint64_t dst_off;
    uint32_t bytes;
    uint32_t reserved;
} spy_desc; /* 24 bytes */
SPY_ABI_SIZE(spy_desc, 24)

/* Summary of a validated program. */
typedef struct spy_job_info {
    uint32_t ncmds;
    uint32_t nslots;
    uint64_t total_bytes;
    uint64_t dma_bytes;     /* bytes the program moves */
    uint64_t macs;
    uint64_t sfu_elems;
    uint32_t cores_used;
    uint32_t reserved;
    uint64_t lx_high_water; /* highest scratchpad byte any command touches */
} spy_job_info;

/* What a program's commands move and where they run, as the profiler places a kernel
 * against the roofline: the bytes its LOAD, STORE, GATHER and SCATTER commands move between
 * DRAM and the scratchpads (a plain DMA its runs times its counts, one with a descriptor
 * list the bytes of its entries from src_off, clipped to the table; a gather or scatter
 * its indices' patterns) and the distinct cores of its commands (SPY_CORE_CARD aside).
 * Counts beyond a command's dimensions are not read: nothing here is validated. */
spy_status spy_program_footprint(const spy_cmd *cmds, uint32_t ncmds, const spy_desc *descs, uint32_t ndescs,
                                 uint64_t *dram_bytes, uint32_t *cores);

/* Validate a program block held in host memory (construction-time check). */
spy_status spy_job_validate(spy_device *dev, const void *blob, uint64_t len, spy_job_info *info);

/* ---- launching (job.c) -----------------------------------------------------------------
 * A program is uploaded into a CONTROL allocation (normally by an H2D job: the
 * transfer graph of the program block) and then committed: the device validates the
 * resident copy once and marks it runnable; any later write to it uncommits it.       */

spy_status spy_program_commit(spy_device *dev, uint64_t prog_addr, spy_job_info *info);

/* Run a committed program with its slots bound: bindings[i] is a device address for a
 * DRAM slot, a host pointer (as an integer) for a HOST slot. `name` labels the job in
 * the trace (an id from spy_trace_intern, or 0). On return the job's effects are
 * complete in functional mode and *job_end_ns holds its simulated end. */
spy_status spy_launch(spy_device *dev, uint64_t prog_addr, const uint64_t *bindings,
                      uint32_t nbindings, uint32_t name, double *job_end_ns);

/* ---- transfer graphs (transfer.c) --------------------------------------------------------
 * A transfer graph is a program of DMA commands between host and device memory (H2D, D2H,
 * barriers only). Its descriptor lists stay in host memory, where the card's DMA engines
 * fetch them (the per-descriptor cost of the profile covers the fetch), so it needs no
 * upload: create validates a copy of the block once; run binds its slots and submits. */
typedef struct spy_transfer spy_transfer;

spy_status spy_transfer_create(spy_device *dev, const void *blob, uint64_t len, spy_transfer **out);
void spy_transfer_destroy(spy_transfer *t);
spy_status spy_transfer_run(spy_transfer *t, const uint64_t *bindings, uint32_t nbindings,
                            uint32_t name, double *end_ns);

/* ---- construction (construct.c, build_loop.c) ----------------------------------------------
 * The native builder. The layers above decide once per kernel or view what to build (its
 * slots, its ranges, its layout) and hand the decision over as a plain-data record; the
 * builder makes the commands, dependencies and descriptors and encodes the program block
 * (the same block the validator reads, see "Program block layout"), on every call: this is
 * the work the dispatch modes move. A record is checked whole before anything is built: a
 * range outside its slot (SPY_E_BAD_ADDRESS), scratchpad regions outside the scratchpad
 * (SPY_E_SCRATCHPAD), an unknown slot or direction, counts that overflow the block's
 * fields or make it larger than SPY_BUILD_MAX_BYTES (SPY_E_INVALID_ARG); the message names
 * the field. On success *out holds a block
 * the caller owns (spy_built_free); on failure it holds nothing. */
#define SPY_BUILD_MAX_BYTES 0x40000000u /* 1 GiB: the largest block the builder makes */

typedef struct spy_built {
    uint8_t *data;  /* the encoded program block, 8-byte aligned */
    uint64_t bytes; /* == its header's total_bytes */
} spy_built; /* 16 bytes */
SPY_ABI_SIZE(spy_built, 16)

void spy_built_free(spy_built *b);

/* A byte copy between two DRAM slots of a copy kernel. */
typedef struct spy_copy_range {
    uint32_t src_slot;
    uint32_t dst_slot;
    uint64_t src_off;
    uint64_t dst_off;
    uint64_t nbytes; /* 0: nothing to copy */
} spy_copy_range; /* 32 bytes */
SPY_ABI_SIZE(spy_copy_range, 32)

/* A copy kernel: each range is cut into chunks of min(chunk_max, its bytes over the cores
 * rounded up to a stick), dealt round-robin to the cores, the ranges' chunks one after
 * the other. Chunk i is a LOAD into scratchpad slot (i / num_cores) % 2 (of chunk_max
 * bytes each) and a STORE from it; the store waits for its load, a load for the store two
 * chunks back on its core. */
typedef struct spy_copy_record {
    uint32_t num_cores;        /* 1 .. SPY_CORE_CARD - 1 */
    uint32_t stick_bytes;      /* a power of two */
    uint64_t chunk_max;        /* bytes; two chunks fit the scratchpad */
    uint64_t scratchpad_bytes; /* of one core */
    uint32_t nslots;           /* DRAM slots of the program, in slot order */
    uint32_t nranges;
    const uint64_t *slot_extent;  /* nslots extents */
    const spy_copy_range *ranges; /* nranges ranges */
} spy_copy_record;

spy_status spy_build_copy(const spy_copy_record *rec, spy_built *out);

#define SPY_TRANSFER_MAX_DIMS 8

/* A transfer graph: one H2D or D2H command whose descriptors (one per stick piece) move a
 * strided view of a stick-layout storage (slot 1, the storage's bytes) to or from a
 * contiguous host staging buffer (slot 0) holding the view in its memory order: the
 * dimensions sorted size-1 first, then by decreasing stride (spyre_rt.transfer). */
typedef struct spy_transfer_record {
    uint32_t direction; /* SPY_OP_H2D or SPY_OP_D2H */
    uint32_t ndims;     /* 0 .. SPY_TRANSFER_MAX_DIMS */
    spy_layout layout;  /* of the storage */
    uint64_t offset;    /* of the view, in logical elements */
    uint64_t sizes[SPY_TRANSFER_MAX_DIMS];
    uint64_t strides[SPY_TRANSFER_MAX_DIMS]; /* in logical elements */
} spy_transfer_record; /* 168 bytes */
SPY_ABI_SIZE(spy_transfer_record, 168)

spy_status spy_build_transfer(const spy_transfer_record *rec, spy_built *out);

/* A job graph made in blocks: commands in the order they were
 * made, each with a program-order key, and dependency pairs naming commands by that
 * order. The block's commands are sorted by key (stably), the pairs renumbered and
 * grouped per waiting command (in the order they were given), and encoded with the
 * slots, SFU instructions and descriptors given. The commands' dep_begin and ndeps are
 * the builder's; their other fields are copied as they are (the validator checks them
 * when the block is committed). */
typedef struct spy_graph_record {
    uint32_t nslots;
    uint32_t ninstrs;
    uint32_t ndescs;
    uint32_t reserved;
    uint64_t ncmds;
    uint64_t npairs;
    const spy_slot *slots;
    const spy_cmd *cmds;    /* ncmds commands, in the order they were made */
    const int64_t *keys;    /* ncmds program-order keys */
    const int64_t *after;   /* npairs: command after[i] waits for command before[i] */
    const int64_t *before;
    const spy_instr *instrs;
    const spy_desc *descs;
} spy_graph_record;

spy_status spy_build_graph(const spy_graph_record *rec, spy_built *out);

/* A matmul's decision record (build_matmul.c): C[b] = A[b] @ B[b], each output tile then
 * run through a per-tile SFU program (a bias, a fused epilogue, the rounding) and stored.
 * The layers above decide the tiling (groups of pk x pm x pn cores, the sizes of the M
 * and N tiles and K slices, the K chunk tk and the nbuf operand buffers), the scratchpad
 * regions every core uses at the same offsets, the views and the slots of the buffers, and
 * the program; the builder derives which core does what, makes the loads, ring forwards,
 * matmuls, the split-K reduction, the epilogue's loads, SFU commands and stores, their
 * dependencies and DMA patterns in the stick layout, and encodes the block. Checked whole
 * first: a region outside the scratchpad (SPY_E_SCRATCHPAD), a view outside its slot's
 * storage (SPY_E_BAD_ADDRESS), counts that do not add up or overflow (SPY_E_INVALID_ARG). */
#define SPY_MM_MAX_NBUF 4     /* operand buffers per core */
#define SPY_MM_MAX_SLOTS 64   /* buffers of one matmul */
#define SPY_MM_MAX_TILES 16   /* tiles an epilogue loads, tiles it stores */
#define SPY_MM_MAX_PROGRAM 256 /* instructions of the per-tile program */

/* A strided view of a slot's storage, in logical elements: element (b, r, c) at
 * offset + b * strides[0] + r * strides[1] + c * strides[2]. Its sizes are the matmul's:
 * A batch x M x K, B batch x K x N, the others batch x M x N (batch x 1 x N for a row). */
typedef struct spy_mm_view {
    uint32_t slot;
    uint32_t reserved;
    uint64_t offset;
    uint64_t strides[3];
} spy_mm_view; /* 40 bytes */
SPY_ABI_SIZE(spy_mm_view, 40)

/* Tiles of a view the epilogue loads (before its program) or stores (after it), double
 * buffered: the q-th output tile a core finishes uses lx[q % 2]. */
typedef struct spy_mm_tiles {
    spy_mm_view view;
    uint64_t lx[2];     /* scratchpad byte offsets of the two tiles */
    uint32_t pitch;     /* elements per scratchpad row */
    uint32_t itemsize;  /* bytes per element (the slot layout's) */
    uint32_t row;       /* what each tile lands (SPY_MM_TILES_*): the tile, or one row of it */
    uint32_t part;      /* stores of a grouped matmul: i + 1 for part i's columns alone, the
                           view's column 0 the part's first (0: every column) */
} spy_mm_tiles; /* 72 bytes */
SPY_ABI_SIZE(spy_mm_tiles, 72)

/* spy_mm_tiles.row: what a tile of the view lands in the scratchpad */
#define SPY_MM_TILES_WHOLE 0    /* the tile's rows and columns, `pitch` elements apart */
#define SPY_MM_TILES_ROW 1      /* one row: the tile's columns, broadcast over its rows (a bias) */
#define SPY_MM_TILES_PER_ROW 2  /* (loads) one value per row of the tile, contiguous: the view's
                                   column stride is 0 (an SFU ROW operand of pitch 1) */
#define SPY_MM_TILES_PERIODIC 3 /* (loads) one row of the view's first `pitch` columns, the same
                                   for every tile: a vector periodic in the columns, which an
                                   epilogue's column slices read at offsets of their own */
#define SPY_MM_TILES_PERIODIC_ROWS 4 /* (loads) the view's first `pitch` columns of each of the
                                        tile's rows: a table periodic in the columns */

/* A part of a grouped matmul: matmuls of one A side by side, C = A @ [B0 B1 ...], each B its
 * own view (K x N_i) from column n0 on (0 for the first, increasing). Every N tile lies in
 * one part. */
#define SPY_MM_MAX_PARTS 8
typedef struct spy_mm_part {
    spy_mm_view b;
    uint64_t n0;
} spy_mm_part; /* 48 bytes */
SPY_ABI_SIZE(spy_mm_part, 48)

/* A vector an A prologue reads with each chunk of A it rewrites: one value per row of A
 * (per_row: an SFU ROW operand, the chunk's row r at lx + r * itemsize) or one per column
 * (a COL operand, the chunk's column c at lx + c * itemsize). Its view is batch x M x K,
 * the stride of the dimension it does not vary along 0. Loaded with the chunk, into the
 * region of the chunk's operand buffer. */
#define SPY_MM_MAX_VECTORS 4
typedef struct spy_mm_vector {
    spy_mm_view view;
    uint64_t lx[SPY_MM_MAX_NBUF]; /* one region per operand buffer */
    uint32_t itemsize;            /* bytes per element (the slot layout's) */
    uint32_t per_row;             /* 1: a value per row of A; 0: per column (along K) */
} spy_mm_vector; /* 80 bytes */
SPY_ABI_SIZE(spy_mm_vector, 80)

/* One instruction of the per-tile program: `ins` as for a tile in slot 0 (its rows and
 * cols are each tile's, filled in), and its operands' v (dst, src[0..2]) for slot 1. */
typedef struct spy_mm_instr {
    spy_instr ins;
    uint64_t v1[4];
} spy_mm_instr; /* 112 bytes */
SPY_ABI_SIZE(spy_mm_instr, 112)

typedef struct spy_matmul_record {
    /* the card */
    uint32_t num_cores;        /* 1 .. SPY_CORE_CARD - 1 */
    uint32_t stick_bytes;      /* a power of two */
    uint64_t scratchpad_bytes; /* of one core */
    /* the problem */
    uint64_t batch, m, n, k;   /* each below 2^32 */
    uint32_t in_dtype;         /* of A and B: F16, BF16 or F32 */
    uint32_t flags;            /* SPY_MM_TRANS_A (A read with M contiguous), SPY_MM_TRANS_B */
    /* the tiling */
    uint32_t groups, pk, pm, pn; /* groups of pk x pm x pn cores */
    uint32_t m_tiles, n_tiles;   /* multiples of pm and pn */
    uint32_t tk, nbuf;           /* K chunk; operand buffers (1 .. SPY_MM_MAX_NBUF) */
    const uint32_t *m_size;      /* m_tiles: rows of each M tile, adding up to m */
    const uint32_t *n_size;      /* n_tiles: columns of each N tile, adding up to n */
    const uint64_t *k_slice;     /* pk: the K slices, adding up to k (one slice of 0 when k is 0) */
    /* the scratchpad, alike on every core */
    uint64_t a_lx[SPY_MM_MAX_NBUF], b_lx[SPY_MM_MAX_NBUF]; /* operand buffers */
    uint64_t acc_lx, recv_lx;    /* the fp32 accumulator; split-K's receive buffer (pk > 1) */
    uint32_t a_pitch, b_pitch, c_pitch; /* elements per row: A, B and accumulator tiles */
    /* the buffers and the per-tile program */
    uint32_t nslots;
    uint32_t nloads, nstores, ninstrs;
    /* Tiles finish in pieces of rows (not with split-K), so that a piece's program and
     * stores run while the arrays compute the next. The pieces of a core's last tile each
     * walk its last `last_depth` K chunks in turn (0 or 1: the last only; at most nbuf,
     * whose buffers hold them all): deeper, its first rows are done that many chunks
     * before the end. */
    uint32_t last_depth;
    const spy_layout *slots;     /* nslots: the stick layout of each slot's buffer, in slot order */
    spy_mm_view a, b;
    const spy_mm_tiles *loads;   /* nloads */
    const spy_mm_tiles *stores;  /* nstores (at least one) */
    const spy_mm_instr *program; /* ninstrs (at least one) */
    /* An A prologue (npro_instrs 0: none): the pointwise kernel that made A, folded into the
     * matmul. The core that loads an A chunk loads the vectors with it and runs the program
     * on the chunk in place, before forwarding or multiplying it, in strips of pro_strip
     * rows (its temporaries hold a strip). The program for a chunk in operand buffer i is
     * pro_program[i * npro_instrs ..], rows and cols filled in (a strip's rows, the chunk's
     * K depth); each strip's moves its TILE and ROW operands down to its first row but for
     * those marked SPY_OPND_FIXED (the temporaries, which hold one strip). A is read with K
     * contiguous. */
    uint32_t npro_vectors, npro_instrs, pro_strip, reserved2;
    const spy_mm_vector *pro_vectors; /* npro_vectors */
    const spy_instr *pro_program;     /* nbuf * npro_instrs */
    /* a grouped matmul (nparts 0: B is `b`): B in parts, each output part stored by the
     * store tiles of its part */
    uint32_t nparts;
    /* The per-tile program in strips (0: whole tiles): each tile's (and each piece's) program
     * runs strip by strip, on epi_strip rows at a time, its TILE and ROW operands moved down to
     * the strip's first row but for those marked SPY_OPND_FIXED (an epilogue's temporaries,
     * which hold one strip). */
    uint32_t epi_strip;
    const spy_mm_part *parts;         /* nparts */
} spy_matmul_record;

spy_status spy_build_matmul(const spy_matmul_record *rec, spy_built *out);
/* A loop kernel (build_loop.c): fused element-wise work, reductions, gathers and scatters,
 * cut into tiles of rows dealt to the cores (spyre_rt.construct.loops decides all of it once
 * per kernel). Loop variables 0 .. nvars-1: the leading nrow index a tile's rows, the others
 * its columns. One row variable, the block variable, is cut into blocks; the row variables
 * inside it are whole in every tile; those outside it are fixed per tile. Per tile, on its
 * core, in this order (its parity p is its position on its core modulo 2):
 *   LOADs of its boxes                  each waits for the last SFU command of the tile two
 *                                       places back on the core (which used the same regions)
 *   a prologue SFU command              one IOTA per tile constant (nconsts > 0)
 *   per stage l: an SFU command         stage l's instructions for parity p (none when it has
 *                                       none), waiting for the loads and gathers before it, the
 *                                       prologue, and (stage 0) the stores two tiles back;
 *                then its GATHERs       the gathers of level l + 1, after it
 *   STOREs and SCATTERs                 after the last stage
 * A box is the part of an access a tile moves: its fixed variables outside the mask move
 * nothing; otherwise the block variable's indices of the tile and every other variable of
 * its kind (rows for TILE and ROW values, columns for TILE and COL ones) clipped to the
 * mask. A box moves as a strided DMA where the stick layout allows (up to three outer
 * dimensions per command, more commands for more), else through a descriptor list; a
 * gather or scatter moves each tile row's columns in pieces that keep the scratchpad side
 * packed. Instructions are written once per (stage, parity, tile rows), in the order tiles
 * first need them, then every tile's prologue in tile order; descriptor lists are grouped
 * by tiles of alike commands, in the order those first appear.
 * Merged stores (nmerges > 0): where a stored buffer's sticks hold the results of more rows
 * than one tile does, the tiles of those rows form a group (spy_loop_merge). Such a tile does
 * not store a merged access (merge_off[i] != SPY_LOOP_UNMERGED): after its last stage, one
 * RING command sends its staged rows to the group's region on the group's core (the rows of
 * a tile of its size, at their place among the group's rows). After every tile, each group
 * stores the box of its rows once from that region, on its core, after all its tiles' rings:
 * no two cores write one stick back. */
#define SPY_LOOP_MAX_VARS 16
#define SPY_LOOP_UNMERGED 0xFFFFFFFFu /* merge_off of an access each tile stores itself */

typedef struct spy_loop_access {
    uint32_t op;           /* SPY_OP_LOAD, _STORE, or _GATHER, _SCATTER through an index */
    uint32_t kind;         /* SPY_OPND_TILE, _ROW, _COL or _SCALAR: the value's shape in a tile */
    uint32_t slot;         /* the program slot of its buffer (slot_extent[slot]) */
    uint32_t level;        /* a gather: the stage its value is read in (1 .. levels - 1) */
    spy_layout layout;     /* its buffer's storage; stick_bytes the record's */
    int64_t base;          /* the storage element at loop index 0 (constant plus view offset) */
    uint32_t itemsize;     /* bytes of its element in the scratchpad */
    uint32_t masked;       /* bit j: variable j is bounded by [lo[j], hi[j]) */
    uint32_t element_rows; /* a gather/scatter of single elements of a one-row table */
    uint32_t lx_pitch;     /* elements from one tile row to the next in its region */
    uint32_t lx_off[2];    /* its scratchpad region, per tile parity */
    uint32_t idx_off[2];   /* a gather/scatter: the table row of each tile row, per parity */
    int64_t coeffs[SPY_LOOP_MAX_VARS]; /* elements per index of each loop variable */
    int64_t lo[SPY_LOOP_MAX_VARS];
    int64_t hi[SPY_LOOP_MAX_VARS];
} spy_loop_access; /* 464 bytes */
SPY_ABI_SIZE(spy_loop_access, 464)

typedef struct spy_loop_tile {
    uint32_t core;
    uint32_t size;                     /* indices of the block variable (rows: size x inner rows) */
    int64_t start;                     /* its first index of the block variable */
    int64_t fixed[SPY_LOOP_MAX_VARS];  /* the row variables before the block variable */
} spy_loop_tile; /* 144 bytes */
SPY_ABI_SIZE(spy_loop_tile, 144)

/* One SFU stage: instructions [first[p], first[p] + count) of the record's for parity p. */
typedef struct spy_loop_stage {
    uint32_t first[2];
    uint32_t count;
    uint32_t reserved;
} spy_loop_stage; /* 16 bytes */
SPY_ABI_SIZE(spy_loop_stage, 16)

typedef struct spy_loop_instr {
    spy_instr instr;
    uint32_t tile_rows; /* nonzero: it covers one in tile_rows of the tile's rows, which it
                         * divides (1: all of them; instr.rows is not used) */
    uint32_t reserved;
} spy_loop_instr; /* 88 bytes */
SPY_ABI_SIZE(spy_loop_instr, 88)

/* A tile constant: floor((base + sum of coeffs[j] x the tile's first index of each row
 * variable up to the block variable) / unit), an int64 the prologue writes at lx_off. */
typedef struct spy_loop_const {
    uint32_t lx_off;
    uint32_t reserved;
    int64_t base;
    int64_t unit;      /* at least 1 */
    int64_t coeffs[SPY_LOOP_MAX_VARS];
} spy_loop_const; /* 152 bytes */
SPY_ABI_SIZE(spy_loop_const, 152)

/* A group of tiles whose merged stores share sticks: its rows as a tile's (box.core: the core
 * that stores them) and its region there. A merged access i's rows sit at lx_off +
 * merge_off[i], row after row as in a tile's region. */
typedef struct spy_loop_merge {
    spy_loop_tile box;
    uint32_t lx_off;
    uint32_t reserved;
} spy_loop_merge; /* 152 bytes */
SPY_ABI_SIZE(spy_loop_merge, 152)

typedef struct spy_loop_record {
    uint32_t num_cores;        /* 1 .. SPY_CORE_CARD - 1 */
    uint32_t stick_bytes;      /* a power of two up to 65536 */
    uint64_t scratchpad_bytes; /* of one core */
    uint64_t lx_bytes;         /* the kernel's scratchpad layout: every region ends below */
    uint32_t nvars;            /* 0 .. SPY_LOOP_MAX_VARS */
    uint32_t nrow;             /* row variables: 0 .. nvars */
    int32_t block;             /* the block variable (< nrow), or -1 when nrow is 0 */
    uint32_t rows_per_tile;    /* rows of the largest tile the layout holds */
    uint32_t levels;           /* SFU stages: 1 or more */
    uint32_t nslots;
    uint32_t naccesses;
    uint32_t ntiles;           /* in per-core order */
    uint32_t ninstrs;
    uint32_t nconsts;
    uint64_t sizes[SPY_LOOP_MAX_VARS];
    const uint64_t *slot_extent;      /* nslots DRAM slots, in slot order */
    const spy_loop_access *accesses;  /* the loads, then the stores, in body order */
    const spy_loop_tile *tiles;
    const spy_loop_stage *stages;     /* levels */
    const spy_loop_instr *instrs;
    const spy_loop_const *consts;
    uint32_t nmerges;                 /* groups of merged stores; 0: every tile stores its own */
    uint32_t reserved;
    const spy_loop_merge *merges;
    const int32_t *tile_merge;        /* ntiles: the tile's group, or -1 (nmerges > 0) */
    const uint32_t *merge_off;        /* naccesses: see spy_loop_merge, or SPY_LOOP_UNMERGED */
} spy_loop_record; /* 272 bytes */
SPY_ABI_SIZE(spy_loop_record, 272)

spy_status spy_build_loop(const spy_loop_record *rec, spy_built *out);
/* An attention kernel (build_attention.c): flash attention over the cores, as
 * spyre_rt.construct.attention decides it once per kernel. Its tasks (one KV head of one
 * batch element and a tile of query rows, folded with the group's query heads) are walked
 * in blocks of kv_block keys; the builder makes, at every call, each block's loads, ring
 * sends, matmuls and SFU program, each task's finish and store (or a split task's state
 * sent to its leader and combined there), the DMA patterns or descriptor lists of every
 * tile, the dependencies, and the encoded block. Checked whole first: a scratchpad region
 * outside the scratchpad (SPY_E_SCRATCHPAD), a view reaching past its storage or a slot
 * smaller than its storage (SPY_E_BAD_ADDRESS), tasks outside the shape, out of core
 * order or counts that overflow (SPY_E_INVALID_ARG). A record without tasks builds a
 * program of its slots only. */
#define SPY_ATTN_MASK_NONE 0
#define SPY_ATTN_MASK_BOOL 1 /* keep the score where the mask is true */
#define SPY_ATTN_MASK_ADD 2  /* add the mask to the score */

/* One operand: a 4-D view of the storage bound to a DRAM slot. */
typedef struct spy_attention_view {
    uint32_t slot;
    uint32_t reserved;
    spy_layout layout;   /* of the storage */
    uint64_t offset;     /* logical elements */
    uint64_t sizes[4];   /* q, out: (batch, heads, q_len, dim or v_dim); k, v: (batch, kv_heads,
                            kv_len, dim or v_dim); mask: (batch, heads, q_len, kv_len) */
    uint64_t strides[4]; /* logical elements */
} spy_attention_view; /* 104 bytes */
SPY_ABI_SIZE(spy_attention_view, 104)

/* One task: the columns of spyre_rt.construct.attention's task table. Tasks come grouped
 * by core, in each core's program order. A task split over cores has parts > 1; its parts
 * name the first (part 0) as their leader; part 0 is its own leader. Tasks of one group
 * (>= 0; -1: none) and step walk the same keys in lockstep, one of them loading each block
 * and sending it to the others over the ring. */
typedef struct spy_attention_task {
    int64_t core, batch, kv_head, q0, rows, kv0, kv1, part, parts, leader, group, step;
} spy_attention_task; /* 96 bytes */
SPY_ABI_SIZE(spy_attention_task, 96)

/* One core's scratchpad regions (every core lays it out alike): byte offsets; pitches in
 * elements. Two slots each for Q, K, V, the mask and S; P in the operands' dtype (none
 * for fp32: P is S); the running state m, l, O (row_bytes, row_bytes, then O) in one
 * region of state_bytes, and parts - 1 more from `recv` on for the states of a split
 * task's other parts; rows of the running max, the safe max, the rescale and a temporary;
 * the flags of rows that saw no key; the iota and flags of the causal diagonal; the
 * staging tile of the output. */
typedef struct spy_attention_lx {
    uint64_t q[2], k[2], v[2], mask[2], s[2];
    uint64_t p, state, recv, mn, safe, alpha, t, flag, diag, diag_flag, stage;
    uint32_t q_pitch, k_pitch, v_pitch, m_pitch, s_pitch, p_pitch, o_pitch, flag_pitch, stage_pitch;
    uint32_t row_bytes, state_bytes;
    /* K and V slots: 2 (or 0), each block in the slot of its place on its core (g % 2); or, more,
     * the keys resident: block j of the keys in slot j (at k[0] + j * (k[1] - k[0]), v
     * alike), loaded or received once and read again by a core's later tasks (every
     * task of a core of one batch element and KV head; not paged) */
    uint32_t kv_slots;
} spy_attention_lx; /* 216 bytes */
SPY_ABI_SIZE(spy_attention_lx, 216)

typedef struct spy_attention_record {
    uint32_t num_cores;        /* 1 .. SPY_CORE_CARD - 1 */
    uint32_t nslots;           /* DRAM slots of the program, in slot order */
    uint64_t scratchpad_bytes; /* of one core: 1 .. 2^31 */
    uint32_t batch, heads, kv_heads, q_len, kv_len, dim, v_dim;
    uint32_t dtype;            /* of q, k, v and out: SPY_DT_F16, BF16 or F32 */
    uint32_t mask_kind;        /* SPY_ATTN_MASK_* */
    uint32_t mask_dtype;       /* BOOL for a BOOL mask, F16, BF16 or F32 for an ADD mask */
    uint32_t mask_heads;       /* mask rows per query: 1 when the heads share them, else the group */
    uint32_t causal;           /* 0 or 1: key j of query i is masked past j > i + q_offset */
    int64_t q_offset;
    double scale;              /* of the scores */
    uint32_t q_rows;           /* query rows per head of the largest task */
    uint32_t kv_block;         /* keys per block */
    uint64_t ntasks;
    const spy_attention_task *tasks;
    const uint64_t *slot_extent; /* nslots extents */
    spy_attention_view q, k, v, out, mask; /* mask: read only with a mask_kind */
    spy_attention_lx lx;
    /* Paged keys and values (page > 0; vLLM's paged KV cache): k and v are views (pages,
     * kv_heads, page, dim) of a cache of pages, one storage row per key (strides[3] 1,
     * strides[2] the storage's row_len, column 0), and key j of batch element b is row
     * j % page of page table[b, j / page]. Each block of keys is then one GATHER through
     * the batch element's row of the table (whole sticks per key: k_pitch and v_pitch are
     * their dims rounded up to sticks), the row loaded once per core into one of
     * table_rows regions of table_pitch bytes from lx_table, a region per distinct batch
     * element of the core's tasks. kv_len is a multiple of page; kv_block divides page or
     * is a multiple of it; every task's keys start and end on min(page, kv_block). A page
     * number outside [0, pages) fails the launch with SPY_E_INDEX. */
    uint32_t page;             /* keys per page; 0: k and v are dense views */
    uint32_t table_dtype;      /* SPY_DT_I64 or SPY_DT_I32 */
    spy_attention_view table;  /* (batch, kv_len / page, 1, 1) */
    uint64_t lx_table;         /* the first region: a multiple of 8 */
    uint32_t table_pitch;      /* bytes per region: a multiple of 8; a row of more than a stick loads as whole sticks */
    uint32_t table_rows;       /* regions */
} spy_attention_record;

spy_status spy_build_attention(const spy_attention_record *rec, spy_built *out);
/* ---- collectives between processes (ccl.c) ------------------------------------------ */
#include "ccl.h"

/* ---- plans (plan.c) ---------------------------------------------------------------------
 * Plan block layout:
 *   [spy_plan_header][spy_plan_job * njobs][spy_reloc * nrelocs][spy_layout * nbindings]
 *   [program blocks...]
 * Each job names its program block (offset/length inside the plan block) and its slot
 * relocations [reloc_begin, +nslots): slot address = bindings[reloc.binding] + reloc.offset.
 * Plans bind device memory only: every slot of every job must be a DRAM slot (a plan job
 * with a HOST slot is refused with SPY_E_BAD_PROGRAM), and every binding a job uses is a
 * device address checked against the card's allocations at each launch.
 * The programs address a binding's storage through the stick layout it was built for: a
 * binding with a layout (itemsize != 0) must be the start of an allocation that records
 * that layout (SPY_E_LAYOUT otherwise, before any job runs); a zero layout is not checked
 * (an arena of intermediates, which records none).
 * A collective job (kind SPY_PLAN_JOB_COLLECTIVE) holds a spy_collective instead of a
 * program, and two slots: its input and its output. It runs in group `group` of the plan,
 * a ring the caller attaches once the plan exists (spy_plan_set_group); a launch refuses a
 * plan with a group unattached. A launch that fails in any job aborts the plan's groups, so
 * that the other ranks' collectives fail instead of waiting for this one (NCCL's abort).
 * spy_plan_create validates the whole block, uploads and commits every program. Jobs that
 * name the same program (offset and length) share one resident copy, uploaded once: a
 * decoder's layers run the same programs on other buffers, through their own relocations. */

#define SPY_PLAN_MAGIC 0x4E4C5053u /* "SPLN" */
#define SPY_PLAN_VERSION 3u

typedef struct spy_plan_header {
    uint32_t magic;
    uint32_t version;
    uint32_t njobs;
    uint32_t nrelocs;
    uint32_t nbindings;   /* bindings a launch must pass */
    uint32_t ngroups;     /* process groups its collective jobs run in (spy_plan_set_group) */
    uint64_t total_bytes;
    uint64_t reserved[4];
} spy_plan_header; /* 64 bytes */
SPY_ABI_SIZE(spy_plan_header, 64)

#define SPY_PLAN_JOB_PROGRAM 0    /* a program block: the card's commands */
#define SPY_PLAN_JOB_COLLECTIVE 1 /* a spy_collective between the cards of a group */

typedef struct spy_plan_job {
    uint64_t prog_off;    /* from the start of the plan block: its program or collective */
    uint64_t prog_len;
    uint32_t reloc_begin;
    uint32_t nslots;      /* a collective's: 2 (its input, its output) */
    uint32_t name;        /* trace label id */
    uint32_t kind;        /* SPY_PLAN_JOB_* */
} spy_plan_job; /* 32 bytes */
SPY_ABI_SIZE(spy_plan_job, 32)

typedef struct spy_reloc {
    uint32_t binding;
    uint32_t reserved;
    uint64_t offset;
} spy_reloc; /* 16 bytes */
SPY_ABI_SIZE(spy_reloc, 16)

typedef struct spy_plan spy_plan;

spy_status spy_plan_create(spy_device *dev, const void *blob, uint64_t len, spy_plan **out);
void spy_plan_destroy(spy_plan *plan);
/* Attach the ring of group `index` (< the header's ngroups): it must have the number of
 * ranks the plan's collectives of that group were built for, and outlive the plan's
 * launches (the caller keeps it). */
spy_status spy_plan_set_group(spy_plan *plan, uint32_t index, spy_ccl *ring);
/* Declared minimum size for each binding (computed from the relocated slot extents). */
spy_status spy_plan_binding_extent(const spy_plan *plan, uint32_t binding, uint64_t *extent);
uint32_t spy_plan_num_jobs(const spy_plan *plan);
/* One call per compiled step: patch the relocation table, run every job in order. */
spy_status spy_plan_launch(spy_plan *plan, const uint64_t *bindings, uint32_t nbindings,
                           uint32_t name, double *step_end_ns);
/* A captured sequence of plan launches in one call (a graph replay): plan i runs with the
 * nbindings[i] addresses of bindings[i] and trace name names[i], in order, all on one
 * device. Every plan must be of the device's current reset epoch, checked before any runs
 * (SPY_E_NOT_COMMITTED otherwise). Stops at the first failure; *failed (if not NULL) is
 * the index of the plan it was about, and the plans before it have had their effect.
 * *end_ns (if not NULL) is the device time the last job run ends. */
spy_status spy_plan_launch_many(uint32_t n, spy_plan *const *plans, const uint64_t *const *bindings,
                                const uint32_t *nbindings, const uint32_t *names, uint32_t *failed,
                                double *end_ns);

/* ---- counters (device.c) ----------------------------------------------------------------- */

typedef struct spy_counters {
    uint64_t native_calls;      /* calls into the runtime that did host work */
    uint64_t jobs;
    uint64_t commands;
    uint64_t plan_launches;
    uint64_t commits;
    uint64_t validated_commands;
    uint64_t bytes_h2d;
    uint64_t bytes_d2h;
    uint64_t sim_ns;            /* wall time of the card's work on the host's thread (simulating,
                                   walking plans): left out of the wall host clock */
    uint64_t wait_ns;           /* host clock advanced by synchronize */
    uint64_t sim_cpu_ns;        /* CPU time of the same: left out of the host clock */
    double device_busy_ns;      /* sum over jobs of (end - start) */
    double device_idle_host_ns; /* device idle because the host had not launched yet */
} spy_counters;

spy_status spy_counters_get(spy_device *dev, spy_counters *out);
spy_status spy_counters_reset(spy_device *dev);

/* ---- trace (trace.c) ------------------------------------------------------------------- */

#define SPY_EV_JOB 1       /* a job on the device: a = name, b = ncmds */
#define SPY_EV_CMD 2       /* a command: a = op, b = bytes moved (DRAM<->scratchpad: as
                              charged, whole bursts), MACs (matmul) or SFU instructions;
                              engine/core set */
#define SPY_EV_HOST 3      /* a host span recorded by spy_trace_host_span: a = name */
#define SPY_EV_LAUNCH 4    /* the host-side instant of a launch: a = name, b = job seq */
#define SPY_EV_COMPUTE 5   /* after a job event, when the job computes: from its first compute
                              command's start (systolic arrays or SFU) to its last one's end;
                              what lies outside it is the job's fill and drain */

/* engines */
#define SPY_ENG_LOAD 0
#define SPY_ENG_STORE 1
#define SPY_ENG_PT 2
#define SPY_ENG_SFU 3
#define SPY_ENG_RING 4
#define SPY_ENG_PER_CORE 5
#define SPY_ENG_H2D 0
#define SPY_ENG_D2H 1
#define SPY_ENG_CTRL 2

typedef struct spy_trace_event {
    uint32_t kind;
    uint16_t core;     /* SPY_CORE_CARD for card engines and jobs */
    uint16_t engine;
    double start_ns;   /* device events: simulated time; host events: host clock */
    double end_ns;
    uint64_t job;      /* job sequence number */
    uint64_t a;
    uint64_t b;
} spy_trace_event; /* 48 bytes */
SPY_ABI_SIZE(spy_trace_event, 48)

spy_status spy_trace_enable(spy_device *dev, uint32_t enabled, uint32_t commands);
uint32_t spy_trace_intern(spy_device *dev, const char *name);
/* The interned name of id, or NULL. */
const char *spy_trace_name(spy_device *dev, uint32_t id);
spy_status spy_trace_host_span(spy_device *dev, uint32_t name, uint64_t start_ns, uint64_t end_ns);
uint64_t spy_trace_count(spy_device *dev);
/* Copy events [first, first+max) out; *n is set to the number copied. */
spy_status spy_trace_read(spy_device *dev, uint64_t first, spy_trace_event *out, uint64_t max,
                          uint64_t *n);
spy_status spy_trace_clear(spy_device *dev);

/* ---- DLPack (dlpack.c) ----------------------------------------------------------------------
 * A device allocation as a DLPack DLManagedTensor (void *: the DLPack ABI, v0.8
 * unversioned) whose deleter frees the allocation -- and its layout record -- so that a
 * framework importing it ties the allocation's lifetime to its tensors. The device must
 * outlive every wrapped tensor; after a spy_device_reset the deleter frees nothing.
 * Ownership: a wrap call hands the caller the DLManagedTensor; the caller passes it to a
 * framework (which calls its deleter) or gives it back with spy_dlpack_release. The
 * allocation then belongs to the tensor: do not spy_free it. */

/* How to present one allocation: shape and strides (in elements) are copied. */
typedef struct spy_dlpack_tensor {
    const int64_t *shape;   /* ndim sizes */
    const int64_t *strides; /* ndim strides */
    int32_t ndim;           /* 0 to 64 */
    uint32_t code;          /* DLPack type code: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool */
    uint32_t bits;          /* bits per element, 8 to 64 */
    uint32_t reserved;
} spy_dlpack_tensor; /* 32 bytes */
SPY_ABI_SIZE(spy_dlpack_tensor, 32)

/* Wrap the allocation starting at addr (shape and strides in elements, copied). */
spy_status spy_dlpack_wrap(spy_device *dev, uint64_t addr, int32_t ndim, const int64_t *shape,
                           const int64_t *strides, uint32_t code, uint32_t bits, int32_t device_type,
                           void **out);
/* Wrap n allocations in one call, all or nothing: out[i] wraps the allocation starting at
 * addrs[i], presented as tensors[i]. On failure nothing is wrapped and the allocations
 * stay the caller's. */
spy_status spy_dlpack_wrap_many(spy_device *dev, uint32_t n, const uint64_t *addrs,
                                const spy_dlpack_tensor *tensors, int32_t device_type, void **out);
/* A compiled step's outputs in one call: n DATA allocations, allocation i the size of
 * layouts[i] and recording it, each wrapped as tensors[i]. All or nothing: on failure
 * nothing is allocated or wrapped. On success addrs[i] is the device address out[i] wraps
 * and the caller owns out[0..n) (see Ownership above). */
spy_status spy_dlpack_new_many(spy_device *dev, uint32_t n, const spy_layout *layouts,
                               const spy_dlpack_tensor *tensors, int32_t device_type, uint64_t *addrs,
                               void **out);
/* Run the deleter of a wrapped tensor that no framework took ownership of. */
void spy_dlpack_release(void *managed);
/* Wrapped tensors whose deleter has not run yet. */
uint64_t spy_dlpack_live(spy_device *dev);

/* ---- fault injection, for tests (device.c) ---------------------------------------------- */

#define SPY_FAULT_NONE 0
#define SPY_FAULT_COMMAND 1 /* the Nth command executed from now fails */
#define SPY_FAULT_DMA 2     /* the Nth DMA command from now fails */
#define SPY_FAULT_LOST 3    /* the device is lost at the Nth command from now */

spy_status spy_fault_inject(spy_device *dev, uint32_t kind, uint64_t after_n);

/* A job of the card's timeline that touches no memory and lasts duration_ns: a collective on
 * the interconnect (the data moved through spy_ccl_*). It starts at not_before (the last
 * rank's arrival) or when the card is free, whichever is later; *end_ns (if not NULL) is
 * its end. Traced as a job named `name`. (job.c) */
spy_status spy_timed_job(spy_device *dev, double not_before, double duration_ns, uint32_t name, double *end_ns);


/* ---- collectives of card memory (job.c) --------------------------------------------------
 * A collective between the cards of a process group, as a job of each card's timeline: it
 * starts when every rank's card is ready for it (the latest of the ranks' clocks, exchanged
 * with its first round) and lasts duration_ns (the interconnect's time, which the caller
 * computes from the profile). On functional cards the ring moves the data of card memory in
 * place -- the input and output bytes of the storages as they lie, stick layout included --
 * on timing-mode cards one round of the ring exchanges the clocks and no data.
 *
 * all_reduce      out = op over ranks of in, elementwise (count = in_bytes / element size);
 *                 in and out may be the same memory
 * all_gather      out (nranks * in_bytes) = every rank's in, by chunks (spy_ccl_allgather)
 * reduce_scatter  out (in_bytes / nranks) = op over ranks of their blocks (spy_ccl_reduce_scatter)
 * broadcast       out = root's in (in and out the same memory)
 * The walk of the ring is the card's work (the interconnect's), not the host's. */
#define SPY_COLL_ALL_REDUCE 1
#define SPY_COLL_ALL_GATHER 2
#define SPY_COLL_REDUCE_SCATTER 3
#define SPY_COLL_BROADCAST 4

typedef struct spy_collective {
    uint32_t kind;        /* SPY_COLL_* */
    uint32_t dtype;       /* SPY_CCL_F32...: the elements reduced */
    uint32_t op;          /* SPY_CCL_SUM...: reductions */
    uint32_t nranks;      /* the group's size */
    uint32_t root;        /* broadcast */
    uint32_t group;       /* in a plan: which of its groups */
    uint64_t in_bytes;    /* this rank's input */
    uint64_t out_bytes;   /* this rank's output */
    uint64_t chunk_bytes; /* all_gather, reduce_scatter: the chunk of the interleaving (of out,
                             of in: its stick column); 0 = the whole block */
    uint64_t tag;         /* compared across ranks like the sizes (the storage's layout) */
    double duration_ns;   /* time on the interconnect */
} spy_collective; /* 64 bytes */
SPY_ABI_SIZE(spy_collective, 64)

/* Run one collective on this card's memory, outside a plan: in and out are device
 * addresses inside live allocations of in_bytes and out_bytes; an input that is a whole
 * storage recording a stick layout must record the one the tag names (rows << 32 | row
 * length; SPY_E_LAYOUT otherwise, before anything moves). It starts no sooner than the host
 * clock (a launch) and *end_ns (if not NULL) is its end. A failure of the ring aborts the
 * group (ccl.h). */
spy_status spy_collective_launch(spy_device *dev, spy_ccl *ring, const spy_collective *coll, uint64_t in,
                                 uint64_t out, uint32_t name, double *end_ns);

/* ---- the matmul's tiling search (tiling.c) ---------------------------------------------
 * How a matmul is spread over the cores, chosen by a cost model made of the card's command
 * charges (spyre_rt.construct.matmul.tiling documents the grid, the tiles and the model;
 * spyre_rt.cost the charges, as sim.c makes them). Construction calls it once per matmul
 * shape; the tests and the profiler read the model's terms through spy_mm_estimate. Every
 * call checks its arguments whole first (SPY_E_INVALID_ARG names the field) and frees what
 * it took. */
#define SPY_MM_K_GRANULE 64   /* K slices and chunks start on whole fp16 sticks */
#define SPY_MM_SHORTLIST 48   /* grids estimated with every K chunk and buffer count */
#define SPY_MM_BUSY_FROM 10   /* job launches of roofline from which every core has a tile in every wave */
#define SPY_MM_MAX_EPI 16     /* element sizes of an epilogue's stores, tiles and rows, each */

/* The card's figures as the cost model uses them (spyre_rt.cost.CostModel's fields). */
typedef struct spy_mm_cost {
    uint32_t num_cores;        /* 1 .. SPY_CORE_CARD - 1 */
    uint32_t stick_bytes;      /* a power of two */
    uint64_t scratchpad_bytes; /* of one core */
    uint32_t gran_m, gran_n, gran_k; /* the systolic arrays' granules */
    uint32_t dram_burst_bytes;
    double macs_per_ns;        /* one core's sustained fp16 rate */
    double dram_bytes_per_ns, core_dma_bytes_per_ns, pt_fp32_ratio, pt_latency_ns, dma_latency_ns;
    double ring_bytes_per_ns, ring_hop_ns, sfu_elems_per_ns, sfu_fp32_ratio, sfu_latency_ns;
    double job_launch_ns;
} spy_mm_cost; /* 128 bytes */
SPY_ABI_SIZE(spy_mm_cost, 128)

/* The shape of a matmul as tiling sees it (spyre_rt.construct.matmul.spec.Problem). */
typedef struct spy_mm_problem {
    uint64_t batch, m, n, k;  /* each below 2^32 */
    uint32_t e_in, e_out;     /* element sizes: 1, 2 or 4 */
    uint32_t e_bias;          /* 0: no bias */
    uint32_t trans_a, trans_b, fp32; /* 0 or 1 */
    uint32_t nstores, ntiles, nrows; /* a fused epilogue's stored tiles (0: the product's, e_out),
                                        loaded tiles and loaded rows */
    uint32_t epi_temps, epi_temp_e, epi_instrs;
    uint32_t e_stores[SPY_MM_MAX_EPI], e_tiles[SPY_MM_MAX_EPI], e_rows[SPY_MM_MAX_EPI];
    /* an A prologue's (pro_instrs 0: none): its temporaries, its instructions per strip,
     * the element sizes of the vectors it loads per row of A and per column */
    uint32_t pro_temps, pro_temp_e, pro_instrs, npro_rows, npro_cols;
    uint32_t e_pro_rows[SPY_MM_MAX_VECTORS], e_pro_cols[SPY_MM_MAX_VECTORS];
    uint32_t pro_strip; /* rows of A the prologue's temporaries hold */
    uint32_t epi_strip; /* rows the epilogue's temporaries hold (0: a whole tile's) */
} spy_mm_problem; /* 336 bytes */
SPY_ABI_SIZE(spy_mm_problem, 336)

typedef struct spy_mm_tiling {
    uint32_t groups, pk, pm, pn, m_tiles, n_tiles, tk, nbuf;
} spy_mm_tiling; /* 32 bytes */
SPY_ABI_SIZE(spy_mm_tiling, 32)

/* Every term of a tiling's estimate (times in ns; the tiles, bytes and counts as numbers). */
typedef struct spy_mm_terms {
    double tm, tn, tm_avg, tn_avg, blocks, waves, active, steps, tail, per_block, dram_bytes, cmds;
    double t_mm, t_port, t_ring, t_load, t_fwd, t_step, t_steps, t_reduce, t_epilogue, t_wave;
    double t_fill, t_drain, t_stream, ns, lx_bytes, floor_ns, t_prologue;
} spy_mm_terms; /* 232 bytes */
SPY_ABI_SIZE(spy_mm_terms, 232)

/* The cheapest tiling that fits the scratchpad, by the rule of spyre_rt's `choose`.
 * SPY_E_SCRATCHPAD when no tile fits. */
spy_status spy_mm_choose(const spy_mm_cost *c, const spy_mm_problem *p, spy_mm_tiling *out);
/* The model's terms of each of `n` tilings (any grid: tk and nbuf >= 1 and >= 2). */
spy_status spy_mm_estimate(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, uint32_t n,
                           spy_mm_terms *out);
/* The K chunks the pieces of a core's last tile walk under tiling *t (the record's
 * last_depth): as many chunks' matmuls as the model's stores of the last tiles take. */
spy_status spy_mm_last_depth(const spy_mm_cost *c, const spy_mm_problem *p, const spy_mm_tiling *t, uint32_t *out);
/* The grids the search tries, in its order (tk and nbuf 0): up to `cap` into out, *n of them
 * in all (call with cap 0 to count). */
spy_status spy_mm_grids(const spy_mm_cost *c, const spy_mm_problem *p, spy_mm_tiling *out, uint32_t cap,
                        uint32_t *n);
/* Per grid (spy_mm_grids' order): its best estimate with the search's two coarse K chunks
 * (inf where none fits), and the DRAM floor under every estimate of it; and the grids the
 * search shortlists, best first (with `prune` 0 every grid is estimated). Arrays of `cap`. */
spy_status spy_mm_coarse(const spy_mm_cost *c, const spy_mm_problem *p, uint32_t prune, double *best,
                         double *floor_ns, uint32_t *shortlist, uint32_t cap, uint32_t *n, uint32_t *nshort);
/* The tables the search walks: tile aims along M and N, the K chunks (static storage). */
spy_status spy_mm_aims(const uint32_t **m_aims, uint32_t *nm, const uint32_t **n_aims, uint32_t *nn,
                       const uint32_t **k_chunks, uint32_t *nk);

#ifdef __cplusplus
}
#endif
#endif /* SPYRE_H */
