/* build_attention.c -- the native builder of attention kernels: a decision record to the
 * encoded program block, at every build.
 *
 * spyre_rt.construct.attention decides once per kernel (spy_attention_record in spyre.h):
 * the tasks and their cores, the tile sizes, one core's scratchpad regions, each
 * operand's slot and view. This file makes what every launch of the kernel needs, the
 * work the dispatch modes move:
 *   blocks    each task's keys in blocks of kv_block; which block loads each block's K and
 *             V (itself, or in a sharing group the group's cores in turn; keys resident,
 *             none where its core holds them from an earlier step)
 *   moves     each tile's DMA: a strided pattern in the stick layout, or a descriptor list
 *   places    program order per core, A0 A1 B0 A2 B1 ...: block i's group A (its loads,
 *             the sends of a block it loaded for others, S = Q K^T) and group B (its SFU
 *             program, O += P V, after a task's last block its finish and store or the
 *             ring transfer of a part's state), so that the arrays compute the next
 *             block's S while the SFU works on this one's
 *   commands  loads, ring sends, matmuls, the SFU programs as instructions (one program
 *             per kind of block, shared by every block of the kind), finishes and stores
 *   links     the dependencies, command by command in program order: a scratchpad slot
 *             is free once the block two back on its core read it, each engine's
 *             operands are ready
 * Every count is known before the block is written, so it is written in place, once
 * (graph.c's spy_block_alloc), in the order the validator reads. The record is checked
 * whole before anything is built; every path frees what it took. */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "internal.h"

/* ---- the record, checked -------------------------------------------------------------- */

#define ATTN_MAX_OFFSET (1ll << 48) /* |q_offset|: a diagonal's start stays in 64 bits */

typedef struct attn_region {
    const char *name;
    uint64_t off;
    uint64_t rows, pitch, itemsize; /* bytes: rows * pitch * itemsize */
    bool used;
} attn_region;

typedef struct attn_shape {
    uint64_t group;   /* query heads per KV head */
    uint64_t e, em;   /* bytes of an operand's and of a mask's element */
    uint64_t big;     /* rows of the largest tile: group * q_rows */
    bool fp32;        /* P is S (no rounding for the arrays) */
    bool guarded;     /* a row may have seen no key yet: its running max may be -inf */
    uint64_t maxparts;
    uint64_t nblocks;
    bool paged;       /* keys and values gathered through the block table */
    uint64_t idx_e;   /* bytes of a table entry */
    uint64_t unit;    /* keys every task starts and ends on (paged): min(page, kv_block) */
    bool resident;    /* K and V slots of their own for every block of the keys (lx.kv_slots > 2) */
} attn_shape;

static const char *const VIEW_NAMES[] = {"q", "k", "v", "out", "mask", "table"};
#define ATTN_OPERANDS 6

static bool is_float(uint32_t dt) { return dt == SPY_DT_F16 || dt == SPY_DT_BF16 || dt == SPY_DT_F32; }

/* A view of its storage, in its slot: its sizes the shape's, its reach inside the storage. */
static spy_status view_check(const spy_attention_record *r, const spy_attention_view *v, const char *name,
                             const uint64_t want[4])
{
    if (v->slot >= r->nslots)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: %s.slot %u names no slot of %u", name, v->slot,
                        r->nslots);
    uint64_t bytes;
    if (spy_layout_bytes(&v->layout, &bytes) != SPY_OK)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: %s.layout: %s", name, spy_last_error());
    if (r->slot_extent[v->slot] < bytes)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "attention record: %s's slot %u of %llu bytes is smaller than its "
                        "storage's %llu bytes", name, v->slot, (unsigned long long)r->slot_extent[v->slot],
                        (unsigned long long)bytes);
    for (int i = 0; i < 4; i++)
        if (v->sizes[i] != want[i])
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: %s.sizes[%d] %llu is not the shape's %llu",
                            name, i, (unsigned long long)v->sizes[i], (unsigned long long)want[i]);
    uint64_t last = v->offset;
    for (int i = 0; i < 4; i++) {
        uint64_t reach;
        if (!spy_mul_ok(v->sizes[i] - 1, v->strides[i], &reach) || !spy_add_ok(last, reach, &last))
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "attention record: %s.strides[%d] reaches past 2^64", name, i);
    }
    uint64_t numel = (v->layout.rows ? v->layout.rows : 1) * v->layout.row_len; /* fits: bytes did */
    if (!v->layout.rows || last >= numel)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "attention record: %s.offset %llu and %s.strides reach element %llu "
                        "of a %llu-element storage", name, (unsigned long long)v->offset, name,
                        (unsigned long long)last, (unsigned long long)(v->layout.rows ? numel : 0));
    return SPY_OK;
}

static spy_status shape_check(const spy_attention_record *r, attn_shape *s)
{
    if (!r->num_cores || r->num_cores >= SPY_CORE_CARD)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: num_cores %u is not 1 .. %u", r->num_cores,
                        SPY_CORE_CARD - 1);
    if (!r->scratchpad_bytes || r->scratchpad_bytes > (1ull << 31))
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: scratchpad_bytes %llu is not 1 .. 2^31",
                        (unsigned long long)r->scratchpad_bytes);
    const struct { const char *name; uint32_t value; } sizes[] = {
        {"batch", r->batch}, {"heads", r->heads}, {"kv_heads", r->kv_heads}, {"q_len", r->q_len},
        {"kv_len", r->kv_len}, {"dim", r->dim}, {"v_dim", r->v_dim}, {"q_rows", r->q_rows},
        {"kv_block", r->kv_block}};
    for (size_t i = 0; i < SPY_ARRAY_LEN(sizes); i++)
        if (!sizes[i].value)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: %s is 0", sizes[i].name);
    if (r->heads % r->kv_heads)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: heads %u is not a multiple of kv_heads %u",
                        r->heads, r->kv_heads);
    if (!is_float(r->dtype))
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: dtype %u is not F16, BF16 or F32", r->dtype);
    if (r->mask_kind > SPY_ATTN_MASK_ADD)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: mask_kind %u is unknown", r->mask_kind);
    s->group = r->heads / r->kv_heads;
    if (r->mask_kind != SPY_ATTN_MASK_NONE) {
        bool want_bool = r->mask_kind == SPY_ATTN_MASK_BOOL;
        if (want_bool ? r->mask_dtype != SPY_DT_BOOL : !is_float(r->mask_dtype))
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: mask_dtype %u does not suit mask_kind %u",
                            r->mask_dtype, r->mask_kind);
        if (r->mask_heads != 1 && r->mask_heads != s->group)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: mask_heads %u is neither 1 nor the group %llu",
                            r->mask_heads, (unsigned long long)s->group);
    }
    if (r->causal > 1)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: causal %u is not 0 or 1", r->causal);
    if (r->q_offset > ATTN_MAX_OFFSET || r->q_offset < -ATTN_MAX_OFFSET)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: q_offset %lld is beyond +-2^48",
                        (long long)r->q_offset);
    s->e = spy_dtype_size(r->dtype);
    s->em = r->mask_kind != SPY_ATTN_MASK_NONE ? spy_dtype_size(r->mask_dtype) : 1;
    s->big = s->group * r->q_rows; /* < 2^64: two 32-bit factors */
    s->fp32 = r->dtype == SPY_DT_F32;
    s->guarded = r->causal || r->mask_kind != SPY_ATTN_MASK_NONE;
    s->paged = r->page != 0;
    if (!s->paged)
        return SPY_OK;
    if (r->table_dtype != SPY_DT_I64 && r->table_dtype != SPY_DT_I32)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: table_dtype %u is not I64 or I32", r->table_dtype);
    if (r->kv_len % r->page)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: kv_len %u is not a multiple of page %u", r->kv_len,
                        r->page);
    if (r->kv_block % r->page && r->page % r->kv_block)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: kv_block %u neither divides page %u nor is a "
                        "multiple of it", r->kv_block, r->page);
    s->idx_e = spy_dtype_size(r->table_dtype);
    s->unit = r->page < r->kv_block ? r->page : r->kv_block;
    return SPY_OK;
}

/* The tasks: inside the shape, by core, parts naming their leader, blocks that fit a block. */
static spy_status tasks_check(const spy_attention_record *r, attn_shape *s)
{
    uint64_t blocks = 0, maxparts = 1;
    uint64_t limit = SPY_BUILD_MAX_BYTES / (3 * sizeof(spy_cmd)); /* a block makes 3 commands at least */
    for (uint64_t i = 0; i < r->ntasks; i++) {
        const spy_attention_task *t = &r->tasks[i];
        unsigned long long n = (unsigned long long)i;
        if (t->core < 0 || t->core >= r->num_cores)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].core %lld is not 0 .. %u", n,
                            (long long)t->core, r->num_cores - 1);
        if (i && t->core < r->tasks[i - 1].core)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].core %lld comes after core %lld: "
                            "tasks go by core", n, (long long)t->core, (long long)r->tasks[i - 1].core);
        if (t->batch < 0 || t->batch >= r->batch || t->kv_head < 0 || t->kv_head >= r->kv_heads)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].%s is outside the shape", n,
                            t->batch < 0 || t->batch >= r->batch ? "batch" : "kv_head");
        if (t->rows < 1 || t->rows > r->q_rows || t->q0 < 0 || t->q0 > (int64_t)r->q_len - t->rows)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].q0 %lld and rows %lld are not "
                            "query rows of 1 .. q_rows %u inside q_len %u", n, (long long)t->q0,
                            (long long)t->rows, r->q_rows, r->q_len);
        if (t->kv0 < 0 || t->kv1 <= t->kv0 || t->kv1 > r->kv_len)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].kv0 %lld and kv1 %lld are not keys "
                            "of 0 .. kv_len %u", n, (long long)t->kv0, (long long)t->kv1, r->kv_len);
        if (t->parts < 1 || t->part < 0 || t->part >= t->parts || t->parts > r->num_cores)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].part %lld of parts %lld is not one "
                            "of 1 .. num_cores parts", n, (long long)t->part, (long long)t->parts);
        if (t->part == 0 ? t->leader != (int64_t)i : t->leader < 0 || (uint64_t)t->leader >= r->ntasks ||
            r->tasks[t->leader].part != 0 || r->tasks[t->leader].parts != t->parts ||
            r->tasks[t->leader].rows != t->rows)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].leader %lld is not %s", n,
                            (long long)t->leader, t->part == 0 ? "the task itself (its part 0)"
                                                               : "the part 0 of a task of as many parts and rows");
        if (s->paged && ((uint64_t)t->kv0 % s->unit || (uint64_t)t->kv1 % s->unit))
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].kv0 %lld and kv1 %lld do not start "
                            "and end on %llu keys (paged: min(page, kv_block))", n, (long long)t->kv0,
                            (long long)t->kv1, (unsigned long long)s->unit);
        if (t->group < -1 || t->step < 0)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu].%s is negative", n,
                            t->group < -1 ? "group" : "step");
        blocks += ((uint64_t)(t->kv1 - t->kv0) + r->kv_block - 1) / r->kv_block;
        if (blocks > limit)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu] makes more than %llu blocks of "
                            "keys, a program block of more than %llu bytes", n, (unsigned long long)limit,
                            (unsigned long long)SPY_BUILD_MAX_BYTES);
        if ((uint64_t)t->parts > maxparts)
            maxparts = (uint64_t)t->parts;
    }
    s->maxparts = maxparts;
    s->nblocks = blocks;
    return SPY_OK;
}

/* Every region the tiles use inside the scratchpad, every pitch as wide as its rows. */
static spy_status regions_check(const spy_attention_record *r, const attn_shape *s)
{
    const spy_attention_lx *x = &r->lx;
    bool mask = r->mask_kind != SPY_ATTN_MASK_NONE, causal = r->causal;
    const struct { const char *name; uint64_t pitch, width; bool used; } pitches[] = {
        {"q_pitch", x->q_pitch, r->dim, true}, {"k_pitch", x->k_pitch, r->dim, true},
        {"v_pitch", x->v_pitch, r->v_dim, true}, {"m_pitch", x->m_pitch, r->kv_block, mask},
        {"s_pitch", x->s_pitch, r->kv_block, true}, {"p_pitch", x->p_pitch, r->kv_block, true},
        {"o_pitch", x->o_pitch, r->v_dim, true}, {"flag_pitch", x->flag_pitch, r->kv_block, causal},
        {"stage_pitch", x->stage_pitch, r->v_dim, true}};
    for (size_t i = 0; i < SPY_ARRAY_LEN(pitches); i++)
        if (pitches[i].used && pitches[i].pitch < pitches[i].width)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.%s %llu is narrower than its %llu columns",
                            pitches[i].name, (unsigned long long)pitches[i].pitch,
                            (unsigned long long)pitches[i].width);
    uint64_t big = s->big, e = s->e, row_need, o_bytes, need;
    if (s->paged) { /* whole sticks per key, as a gather moves them */
        uint64_t sb = r->k.layout.stick_bytes;
        const struct { const char *name; uint64_t pitch, width; } kv[] = {{"k_pitch", x->k_pitch, r->dim},
                                                                           {"v_pitch", x->v_pitch, r->v_dim}};
        for (int i = 0; i < 2; i++)
            if (kv[i].pitch * e != (kv[i].width * e + sb - 1) / sb * sb)
                return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.%s %llu is not %llu columns rounded up "
                                "to %llu-byte sticks (paged)", kv[i].name, (unsigned long long)kv[i].pitch,
                                (unsigned long long)kv[i].width, (unsigned long long)sb);
        /* a row of more than a stick loads as whole sticks: its region holds them */
        uint64_t tb = r->table.layout.stick_bytes, row = (uint64_t)(r->kv_len / r->page) * s->idx_e;
        uint64_t least = row > tb && tb ? (row + tb - 1) / tb * tb : row;
        if (r->lx_table % 8 || r->table_pitch % 8 || r->table_pitch < least || !r->table_rows)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx_table %llu and table_pitch %u (multiples of "
                            "8, %llu bytes at least) and table_rows %u do not hold rows of %u table entries",
                            (unsigned long long)r->lx_table, r->table_pitch, (unsigned long long)least, r->table_rows,
                            r->kv_len / r->page);
    }
    if (!spy_mul_ok(big, 4, &row_need) || x->row_bytes < row_need)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.row_bytes %u holds fewer than %llu rows",
                        x->row_bytes, (unsigned long long)big);
    if (!spy_mul_ok(big, (uint64_t)x->o_pitch * 4, &o_bytes) || !spy_add_ok(o_bytes, 2ull * x->row_bytes, &need) ||
        x->state_bytes < need)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.state_bytes %u does not hold m, l and O",
                        x->state_bytes);
    if (s->resident && (x->k[1] < x->k[0] + (uint64_t)r->kv_block * x->k_pitch * e ||
                        x->v[1] < x->v[0] + (uint64_t)r->kv_block * x->v_pitch * e))
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: resident slots k[1] - k[0] or v[1] - v[0] hold "
                        "fewer than a block's keys");
    attn_region regions[] = {
        {"q[0]", x->q[0], big, x->q_pitch, e, true}, {"q[1]", x->q[1], big, x->q_pitch, e, true},
        {"k[0]", x->k[0], r->kv_block, x->k_pitch, e, true},
        {"k[1]", x->k[1], r->kv_block, x->k_pitch, e, !s->resident},
        {"v[0]", x->v[0], r->kv_block, x->v_pitch, e, true},
        {"v[1]", x->v[1], r->kv_block, x->v_pitch, e, !s->resident},
        {"k (resident)", x->k[0], x->kv_slots, x->k[1] - x->k[0], 1, s->resident},
        {"v (resident)", x->v[0], x->kv_slots, x->v[1] - x->v[0], 1, s->resident},
        {"mask[0]", x->mask[0], (uint64_t)r->mask_heads * r->q_rows, x->m_pitch, s->em, mask},
        {"mask[1]", x->mask[1], (uint64_t)r->mask_heads * r->q_rows, x->m_pitch, s->em, mask},
        {"s[0]", x->s[0], big, x->s_pitch, 4, true}, {"s[1]", x->s[1], big, x->s_pitch, 4, true},
        {"p", x->p, big, x->p_pitch, e, !s->fp32},
        {"state", x->state, 1, x->state_bytes, 1, true},
        {"recv", x->recv, s->maxparts - 1, x->state_bytes, 1, s->maxparts > 1},
        {"mn", x->mn, big, 4, 1, true}, {"safe", x->safe, big, 4, 1, true},
        {"alpha", x->alpha, big, 4, 1, true}, {"t", x->t, big, 4, 1, true}, {"flag", x->flag, big, 1, 1, true},
        {"diag", x->diag, r->q_rows, x->s_pitch, 4, causal},
        {"diag_flag", x->diag_flag, r->q_rows, x->flag_pitch, 1, causal},
        {"stage", x->stage, big, x->stage_pitch, e, true},
        {"table", r->lx_table, r->table_rows, r->table_pitch, 1, s->paged}};
    for (size_t i = 0; i < SPY_ARRAY_LEN(regions); i++) {
        const attn_region *g = &regions[i];
        uint64_t bytes, end;
        if (!g->used)
            continue;
        if (g->off % 4) /* typed operands start on their element: fp32 ones on 4 bytes */
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.%s %llu is not 4-byte aligned", g->name,
                            (unsigned long long)g->off);
        if (!spy_mul_ok(g->rows, g->pitch, &bytes) || !spy_mul_ok(bytes, g->itemsize, &bytes) ||
            !spy_add_ok(g->off, bytes, &end) || end > r->scratchpad_bytes)
            return spy_fail(SPY_E_SCRATCHPAD, -1, "attention record: lx.%s at %llu, %llu rows of %llu x %llu bytes, "
                            "is outside the %llu-byte scratchpad", g->name, (unsigned long long)g->off,
                            (unsigned long long)g->rows, (unsigned long long)g->pitch,
                            (unsigned long long)g->itemsize, (unsigned long long)r->scratchpad_bytes);
    }
    return SPY_OK;
}

/* Paged keys and values: one storage row per key from column 0, pages and heads whole rows
 * apart (a gather's pattern is then a page's rows of whole sticks); a table of the index
 * dtype in a storage of one row per batch element. */
static spy_status paged_check(const spy_attention_record *r, const attn_shape *s)
{
    const spy_attention_view *kv[2] = {&r->k, &r->v};
    for (int i = 0; i < 2; i++) {
        const spy_attention_view *v = kv[i];
        uint64_t n = v->layout.row_len;
        if (v->strides[3] != 1 || v->strides[2] != n || v->strides[0] % n || v->strides[1] % n || v->offset % n ||
            v->layout.stick_bytes != r->k.layout.stick_bytes)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: paged %s (strides %llu %llu %llu %llu, offset "
                            "%llu) is not one storage row of %llu elements per key from column 0", VIEW_NAMES[1 + i],
                            (unsigned long long)v->strides[0], (unsigned long long)v->strides[1],
                            (unsigned long long)v->strides[2], (unsigned long long)v->strides[3],
                            (unsigned long long)v->offset, (unsigned long long)n);
    }
    if (r->table.layout.itemsize != s->idx_e)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: the table's storage holds %u-byte elements, not "
                        "table_dtype %u's", r->table.layout.itemsize, r->table_dtype);
    return SPY_OK;
}

/* Keys resident (lx.kv_slots > 2): a slot for every block of the keys, each core's tasks
 * of one batch element and KV head (a slot holds that head's keys), in sharing groups (a
 * core's tasks one after another, the steps of its group), whole, starting on a block of
 * the keys (block j in slot j), not paged. */
static spy_status resident_check(const spy_attention_record *r, attn_shape *s)
{
    const spy_attention_lx *x = &r->lx;
    s->resident = x->kv_slots > 2;
    if (x->kv_slots == 1)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.kv_slots 1 is not 2 (or 0) or more");
    if (!s->resident)
        return SPY_OK;
    if (s->paged || x->kv_slots != ((uint64_t)r->kv_len + r->kv_block - 1) / r->kv_block)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: lx.kv_slots %u are not the blocks of %u keys of "
                        "the %u keys (or the keys are paged)", x->kv_slots, r->kv_block, r->kv_len);
    for (uint64_t i = 0; i < r->ntasks; i++) {
        const spy_attention_task *t = &r->tasks[i], *p = i ? &r->tasks[i - 1] : t;
        if (t->group < 0 || t->parts != 1 || t->kv0 % r->kv_block ||
            (p->core == t->core && (t->batch != p->batch || t->kv_head != p->kv_head)))
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu] of keys resident is not whole, in a "
                            "sharing group, of its core's batch element and KV head, from a block's first key",
                            (unsigned long long)i);
    }
    return SPY_OK;
}

static spy_status record_check(const spy_attention_record *r, attn_shape *s)
{
    if ((r->ntasks && !r->tasks) || (r->nslots && !r->slot_extent))
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: ntasks %llu or nslots %u without their array",
                        (unsigned long long)r->ntasks, r->nslots);
    spy_status st = shape_check(r, s);
    if (st == SPY_OK)
        st = tasks_check(r, s);
    if (st != SPY_OK || !r->ntasks)
        return st;
    uint64_t b = r->batch, h = r->heads, kh = r->kv_heads, ql = r->q_len, kl = r->kv_len;
    uint64_t kb = s->paged ? r->k.sizes[0] : b, vb = s->paged ? r->v.sizes[0] : b; /* paged: pages */
    uint64_t kr = s->paged ? r->page : kl;                                        /* paged: keys per page */
    const uint64_t want[ATTN_OPERANDS][4] = {{b, h, ql, r->dim}, {kb, kh, kr, r->dim}, {vb, kh, kr, r->v_dim},
                                             {b, h, ql, r->v_dim}, {b, h, ql, kl}, {b, s->paged ? kl / r->page : 0, 1, 1}};
    const spy_attention_view *views[ATTN_OPERANDS] = {&r->q, &r->k, &r->v, &r->out, &r->mask, &r->table};
    if (s->paged && (!kb || !vb))
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: a paged cache of no pages");
    for (int i = 0; i < ATTN_OPERANDS; i++) {
        if ((i == 4 && r->mask_kind == SPY_ATTN_MASK_NONE) || (i == 5 && !s->paged))
            continue;
        if ((st = view_check(r, views[i], VIEW_NAMES[i], want[i])) != SPY_OK)
            return st;
    }
    if (s->paged && (st = paged_check(r, s)) != SPY_OK)
        return st;
    if ((st = resident_check(r, s)) != SPY_OK)
        return st;
    return regions_check(r, s);
}

/* ---- DMA patterns of a tile --------------------------------------------------------------- */

typedef struct attn_dim {
    uint64_t count, src, dst; /* src: the DRAM side's byte stride, dst: the scratchpad's */
} attn_dim;

#define ATTN_MAX_DIMS 8 /* a box of 3 dims, each cut in two at a stick, and the sticks of a run */

/* The DMA of a box: `run` contiguous bytes over `dims` (innermost first), replicated over
 * `outer` (the first fastest) when more than three dimensions were left: one command per
 * base. A box with no such pattern moves as a descriptor list (one command). */
typedef struct attn_pattern {
    bool affine;
    uint32_t ndims, nouter;
    uint64_t run;
    attn_dim dims[3];
    attn_dim outer[ATTN_MAX_DIMS];
    uint64_t nbases;
} attn_pattern;

/* A box of a view: counts, strides (logical elements) and scratchpad byte strides, outermost first. */
typedef struct attn_box {
    uint32_t n;
    uint64_t count[3], stride[3], lx[3];
} attn_box;

/* The byte of logical element x in a stick layout (a stick holds a power of two elements:
 * spy_layout_bytes checked it); *column is x's column. */
static uint64_t phys_at(const spy_layout *l, uint64_t x, uint64_t *column)
{
    uint64_t r = x / l->row_len, c = x % l->row_len, s = l->stick_bytes / l->itemsize;
    unsigned shift = (unsigned)__builtin_ctzll(s);
    *column = c;
    return (c >> shift) * ((l->rows ? l->rows : 1) * l->stick_bytes) + r * l->stick_bytes +
           (c & (s - 1)) * l->itemsize;
}

static uint64_t phys(const spy_layout *l, uint64_t x)
{
    uint64_t column;
    return phys_at(l, x, &column);
}

/* Unit dimensions dropped and neighbours contiguous on both sides fused; then the inner
 * dimensions that continue the run on both sides folded into it. */
static uint64_t merge_and_fold(uint64_t run, attn_dim *d, uint32_t *n)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < *n; i++) {
        attn_dim x = d[i];
        if (x.count == 1)
            continue;
        if (k && x.src == d[k - 1].src * d[k - 1].count && x.dst == d[k - 1].dst * d[k - 1].count) {
            x = (attn_dim){d[k - 1].count * x.count, d[k - 1].src, d[k - 1].dst};
            k--;
        }
        d[k++] = x;
    }
    uint32_t skip = 0;
    while (skip < k && d[skip].src == run && d[skip].dst == run)
        run *= d[skip++].count;
    memmove(d, d + skip, (k - skip) * sizeof *d);
    *n = k - skip;
    return run;
}

/* The pattern of a box starting at logical element `base` (affine false when it has none:
 * a dimension moving part of a stick that does not tile it, a run crossing a stick at an
 * unaligned column, columns wrapping into the next row, or a store whose whole-stick runs
 * would overwrite the columns after its box). */
static void pattern_of(const spy_layout *l, uint64_t base, const attn_box *b, bool load, attn_pattern *p)
{
    uint64_t e = l->itemsize, n_row = l->row_len, sb = l->stick_bytes, s = sb / e;
    uint64_t stick_stride = (l->rows ? l->rows : 1) * sb;
    attn_dim d[ATTN_MAX_DIMS];
    uint32_t nd = 0, n = b->n;
    uint64_t run;
    p->affine = false;
    p->nbases = 1;
    if (l->rows <= 1) { /* linear memory: any box */
        run = e;
        if (n && b->stride[n - 1] == 1 && b->lx[n - 1] == e)
            run = b->count[--n] * e;
        for (uint32_t i = n; i-- > 0;)
            d[nd++] = (attn_dim){b->count[i], b->stride[i] * e, b->lx[i]};
    } else {
        uint64_t c0 = base % n_row, inner = 0, col_span = 0, in_stick = 0;
        if (n && b->stride[n - 1] == 1 && b->lx[n - 1] == e && b->count[n - 1] > 1)
            inner = b->count[--n];
        for (uint32_t i = n; i-- > 0;) {
            uint64_t count = b->count[i], q = b->stride[i] / n_row, m = b->stride[i] % n_row, lx = b->lx[i];
            if (count == 1)
                continue;
            col_span += m * (count - 1);
            if (m % s == 0) { /* whole rows and whole sticks */
                d[nd++] = (attn_dim){count, q * sb + m / s * stick_stride, lx};
                continue;
            }
            if (s % m)
                return;
            uint64_t f = s / m; /* steps that fill one stick */
            if (count <= f) {
                d[nd++] = (attn_dim){count, q * sb + m * e, lx};
                in_stick += m * (count - 1);
            } else if (count % f == 0) {
                d[nd++] = (attn_dim){f, q * sb + m * e, lx};
                d[nd++] = (attn_dim){count / f, q * sb * f + stick_stride, lx * f};
                in_stick += m * (f - 1);
            } else {
                return;
            }
        }
        if (inner) {
            col_span += inner - 1;
            if (c0 % s == 0 && in_stick == 0 && inner > s) { /* whole sticks: they form the innermost dim */
                run = sb;
                memmove(d + 1, d, nd * sizeof *d);
                d[0] = (attn_dim){(inner + s - 1) / s, stick_stride, s * e};
                nd++;
            } else if (c0 % s + in_stick + inner <= s) {
                run = inner * e;
            } else {
                return;
            }
        } else {
            run = e;
            if (c0 % s + in_stick >= s)
                return;
        }
        if (c0 + col_span >= n_row)
            return;
    }
    run = merge_and_fold(run, d, &nd);
    p->run = run;
    p->nouter = 0;
    while (nd > 3) {
        p->outer[p->nouter++] = d[--nd];
        p->nbases *= d[nd].count;
    }
    p->ndims = nd;
    memcpy(p->dims, d, nd * sizeof *d);
    if (!load) {
        uint64_t moved = run * p->nbases, numel = 1;
        for (uint32_t i = 0; i < nd; i++)
            moved *= d[i].count;
        for (uint32_t i = 0; i < b->n; i++)
            numel *= b->count[i];
        if (moved != numel * e && (base + b->count[b->n - 1]) % n_row) {
            p->nbases = 1;
            return; /* whole sticks would overwrite the columns after the box */
        }
    }
    p->affine = true;
}

/* The runs of a box contiguous on both sides, in the box's row-major order: written to
 * descs (when not NULL; device side first for a load), counted. */
static uint64_t box_runs(const spy_layout *l, uint64_t base, const attn_box *b, uint64_t lx_base, bool load,
                         spy_desc *descs)
{
    uint64_t c[3] = {1, 1, 1}, st[3] = {0, 0, 0}, lxs[3] = {0, 0, 0}, e = l->itemsize, n = 0;
    for (uint32_t i = 0; i < b->n; i++) {
        c[3 - b->n + i] = b->count[i];
        st[3 - b->n + i] = b->stride[i];
        lxs[3 - b->n + i] = b->lx[i];
    }
    uint64_t dev0 = 0, lx0 = 0, len = 0, prev_dev = 0, prev_lx = 0;
    for (uint64_t i = 0; i < c[0]; i++)
        for (uint64_t j = 0; j < c[1]; j++)
            for (uint64_t k = 0; k < c[2]; k++) {
                uint64_t dev = phys(l, base + i * st[0] + j * st[1] + k * st[2]);
                uint64_t lx = lx_base + i * lxs[0] + j * lxs[1] + k * lxs[2];
                if (len && dev == prev_dev + e && lx == prev_lx + e) {
                    len += e;
                } else {
                    if (len && descs)
                        descs[n - 1] = (spy_desc){load ? dev0 : lx0, load ? lx0 : dev0, (uint32_t)len, 0};
                    dev0 = dev;
                    lx0 = lx;
                    len = e;
                    n++;
                }
                prev_dev = dev;
                prev_lx = lx;
            }
    if (len && descs)
        descs[n - 1] = (spy_desc){load ? dev0 : lx0, load ? lx0 : dev0, (uint32_t)len, 0};
    return n;
}

/* ---- the build --------------------------------------------------------------------------- */

/* One tile's DMA: its box at `base`, the pattern it shares with the tiles before it, where
 * its commands go. */
typedef struct attn_move {
    attn_box box;
    uint64_t base, start; /* logical element, its byte in the storage */
    uint64_t column;      /* of base in its storage row (0 in a one-row storage) */
    uint64_t pattern;     /* into the operand's patterns */
    uint64_t ncmds;       /* its commands: the pattern's bases, or 1 with a descriptor list */
    uint64_t ndescs;      /* of its descriptor list */
    uint64_t row, lx_off; /* its first command, its scratchpad side */
} attn_move;

#define ATTN_KINDS 16 /* the kinds of tile an operand remembers: a task's blocks of mask columns, say */

/* An operand's tiles, a pattern per kind of tile (alike in box and column), the last
 * ATTN_KINDS kinds looked up before a pattern is made. */
typedef struct attn_operand {
    const spy_attention_view *view;
    bool load;
    spy_vec patterns; /* attn_pattern */
    spy_vec moves;    /* attn_move, one per tile */
    uint64_t ndescs;  /* of its descriptor lists */
    uint64_t kinds[ATTN_KINDS]; /* a tile of each kind remembered */
    uint32_t nkinds, next;
} attn_operand;

typedef struct attn_block {
    uint64_t task, kv0, keys, g; /* g: its place on its core */
    int64_t prev1, prev2;        /* the blocks one and two back on its core, or -1 */
    uint64_t src;                /* the block that loads its K and V */
    int64_t res;                 /* keys resident: the block on its core whose load or receive put its K
                                  * and V in its slot, when they are there already (-1: they come now) */
    uint64_t kslot;              /* its K and V slot: g % 2, or (resident) its block of the keys */
    int64_t ps_mm, ps_send;      /* the last block before it on its core reading its slot, and sending
                                  * from it (-1: none): a write into the slot waits for them */
    uint64_t nsend, send_begin;  /* the blocks it sends them to: recv[send_begin, +nsend) */
    uint64_t rank;               /* a receiver's place among its sender's receivers */
    uint64_t kv_move;            /* its K and V moves, when src is itself */
    uint64_t q1_task;            /* the task whose Q loads it hosts after its own loads (nq1) */
    uint32_t nq0, nq1, nk, nv, nm; /* its commands loading Q (a task's first, then the next task's), K, V, mask */
    uint32_t nt;                   /* a core's first block (paged): its commands loading the core's table rows */
    uint16_t core;
    bool first, last;
    uint64_t a, b;               /* the first rows of its groups A and B */
    uint32_t prog, nprog;        /* its SFU program's instructions */
} attn_block;

typedef struct attn_tstate {
    uint64_t first_block, last_block, tseq; /* tseq: its place on its core */
    uint64_t q_move, out_move;
    uint64_t q_row;
    uint32_t nq, no; /* its commands loading Q, storing the output */
    uint32_t prog, nprog; /* its finish's or combine's instructions */
    int64_t prev_store;   /* the task before it on its core that stores, or -1 */
    uint64_t parts_begin, nparts; /* a leader's other parts: parts[parts_begin, +nparts) */
    uint64_t region, owner;       /* paged: its table row's region on its core, the task that loads it */
    uint64_t table_move;          /* the owner's: its table row's load */
} attn_tstate;

/* An SFU program made: its kind and arguments, where its instructions are. */
typedef struct attn_prog {
    uint64_t key[2];
    uint32_t begin, n;
    bool used;
} attn_prog;

typedef struct attn {
    const spy_attention_record *r;
    attn_shape s;
    attn_block *blk;
    attn_tstate *tk;
    uint64_t *recv;      /* receiving blocks, grouped by the block that sends to them */
    attn_operand op[ATTN_OPERANDS]; /* q, k, v, out, mask, table (VIEW_NAMES) */
    attn_prog *progs;    /* the SFU programs made, by their kind and arguments (a hash table) */
    uint64_t progs_mask;
    spy_vec instrs;      /* their instructions */
    uint64_t *parts;     /* the other parts of each leader, in task order */
    spy_vec deps;        /* every command's dependencies, in program order */
    uint32_t *dep_at;    /* where each command's dependencies begin in deps */
    uint64_t linked;     /* the commands whose dependencies are in deps */
    bool deps_over;      /* more than a block holds */
    /* the block being written */
    spy_cmd *cmds;
    spy_desc *descs;
    uint64_t ndescs;
} attn;

enum { OP_Q, OP_K, OP_V, OP_OUT, OP_MASK, OP_TABLE };

static void attn_free(attn *a)
{
    free(a->blk);
    free(a->tk);
    free(a->recv);
    free(a->progs);
    free(a->parts);
    free(a->dep_at);
    spy_vec_free(&a->deps);
    for (int i = 0; i < ATTN_OPERANDS; i++) {
        spy_vec_free(&a->op[i].patterns);
        spy_vec_free(&a->op[i].moves);
    }
    spy_vec_free(&a->instrs);
}

/* A sharing group's member: (group, step, task), sorted to find the members of each. */
typedef struct attn_member {
    int64_t group, step;
    uint64_t task;
} attn_member;

static int member_order(const void *x, const void *y)
{
    const attn_member *a = x, *b = y;
    if (a->group != b->group)
        return a->group < b->group ? -1 : 1;
    if (a->step != b->step)
        return a->step < b->step ? -1 : 1;
    return a->task < b->task ? -1 : a->task > b->task;
}

/* The keys block b's load or send moves: its own, or, resident, its whole block of the keys
 * (a later task of the core may see more of them). */
static uint64_t moved_keys(const attn *a, const attn_block *b)
{
    uint64_t kb = a->r->kv_block, left = a->r->kv_len - b->kv0;
    return a->s.resident ? (left < kb ? left : kb) : b->keys;
}

/* Where block b's K (w 0) or V (w 1) lies in its core's scratchpad: its slot. */
static uint64_t kv_at(const attn *a, const attn_block *b, int w)
{
    const spy_attention_lx *x = &a->r->lx;
    const uint64_t *slot = w ? x->v : x->k;
    return a->s.resident ? slot[0] + b->kslot * (slot[1] - slot[0]) : slot[b->kslot];
}

/* Whether member *mk's block j (*block) can load block j for its (group, step), or, keys
 * resident, send it: it holds the `keys` the step needs of it; with `senders`, its core
 * holds them already (`held`: the keys of each core's slot). */
static bool can_load(const attn *a, const attn_member *mk, uint64_t j, uint64_t keys, bool senders,
                     const uint64_t *held, uint64_t *block)
{
    const attn_tstate *ts = &a->tk[mk->task];
    if (ts->first_block + j > ts->last_block)
        return false;
    const attn_block *b = &a->blk[ts->first_block + j];
    *block = ts->first_block + j;
    return senders ? held[(uint64_t)b->core * a->r->lx.kv_slots + b->kslot] >= keys : b->keys == keys;
}

/* The block that loads (or sends) block j of the members m[lo, hi) of a (group, step): of
 * the n members that can, the (j % n)-th, in task order. */
static uint64_t pick_loader(const attn *a, const attn_member *m, uint64_t lo, uint64_t hi, uint64_t j, uint64_t keys,
                            bool senders, const uint64_t *held)
{
    uint64_t n = 0, block = 0;
    for (uint64_t k = lo; k < hi; k++)
        n += can_load(a, &m[k], j, keys, senders, held, &block);
    for (uint64_t k = lo, c = 0; k < hi; k++)
        if (can_load(a, &m[k], j, keys, senders, held, &block) && c++ == j % n)
            return block;
    return 0;
}

/* Every task's blocks in per-core program order; which block loads each block's K and V:
 * itself, or in a sharing group the members of its (group, step), in task order, in turn.
 * Keys resident, a block whose core holds its keys already (from a load or a receive of an
 * earlier step) takes none, and sends them if the others need them.
 * The members walk keys from one first key, each as far as it sees (causal tiles of one KV
 * head see more keys the later their queries): block j of the keys is loaded by one of the
 * members whose block j holds the most keys (the j % n-th of those n), and sent to the
 * other members that have a block j, each taking the keys it holds. */
static spy_status make_blocks(attn *a)
{
    const spy_attention_record *r = a->r;
    uint64_t n = 0, ngrouped = 0;
    for (uint64_t t = 0; t < r->ntasks; t++) {
        const spy_attention_task *x = &r->tasks[t];
        attn_tstate *ts = &a->tk[t];
        ts->first_block = n;
        ts->tseq = t && r->tasks[t - 1].core == x->core ? a->tk[t - 1].tseq + 1 : 0;
        for (uint64_t kv0 = (uint64_t)x->kv0; kv0 < (uint64_t)x->kv1; kv0 += r->kv_block, n++) {
            attn_block *b = &a->blk[n];
            b->task = t;
            b->kv0 = kv0;
            b->keys = (uint64_t)x->kv1 - kv0 < r->kv_block ? (uint64_t)x->kv1 - kv0 : r->kv_block;
            b->core = (uint16_t)x->core;
            b->g = n && a->blk[n - 1].core == b->core ? a->blk[n - 1].g + 1 : 0;
            b->prev1 = b->g >= 1 ? (int64_t)n - 1 : -1;
            b->prev2 = b->g >= 2 ? (int64_t)n - 2 : -1;
            b->first = kv0 == (uint64_t)x->kv0;
            b->src = n;
            b->res = -1;
            b->kslot = a->s.resident ? kv0 / r->kv_block : b->g % 2;
        }
        ts->last_block = n - 1;
        a->blk[n - 1].last = true;
        ngrouped += x->group >= 0;
    }
    if (!ngrouped)
        return SPY_OK;
    attn_member *m = malloc(ngrouped * sizeof *m);
    if (!m)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for %llu tasks of sharing groups",
                        (unsigned long long)ngrouped);
    for (uint64_t t = 0, k = 0; t < r->ntasks; t++)
        if (r->tasks[t].group >= 0)
            m[k++] = (attn_member){r->tasks[t].group, r->tasks[t].step, t};
    qsort(m, ngrouped, sizeof *m, member_order);
    /* keys resident: the keys of each slot of each core so far, and the block that put them there */
    uint64_t slots = a->s.resident ? (uint64_t)r->num_cores * r->lx.kv_slots : 0;
    uint64_t *held = slots ? calloc(slots, sizeof *held) : NULL, *writer = slots ? malloc(slots * sizeof *writer) : NULL;
    spy_status st = SPY_OK;
    if (slots && (!held || !writer)) {
        st = spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for %llu resident key slots", (unsigned long long)slots);
        goto done;
    }
    for (uint64_t lo = 0, hi; lo < ngrouped; lo = hi) {
        uint64_t most = 0;
        for (hi = lo; hi < ngrouped && m[hi].group == m[lo].group && m[hi].step == m[lo].step; hi++) {
            const spy_attention_task *x = &r->tasks[m[lo].task], *y = &r->tasks[m[hi].task];
            const attn_tstate *ts = &a->tk[m[hi].task];
            if (x->kv0 != y->kv0) {
                st = spy_fail(SPY_E_INVALID_ARG, -1, "attention record: tasks[%llu] and tasks[%llu] of group %lld "
                              "step %lld start at different keys", (unsigned long long)m[lo].task,
                              (unsigned long long)m[hi].task, (long long)x->group, (long long)x->step);
                goto done;
            }
            if (ts->last_block - ts->first_block + 1 > most)
                most = ts->last_block - ts->first_block + 1;
        }
        for (uint64_t j = 0; j < most; j++) {
            uint64_t keys = 0;
            for (uint64_t k = lo; k < hi; k++) { /* the most keys a member's block j holds */
                const attn_tstate *ts = &a->tk[m[k].task];
                if (ts->first_block + j <= ts->last_block && a->blk[ts->first_block + j].keys > keys)
                    keys = a->blk[ts->first_block + j].keys;
            }
            /* keys resident: the members whose core holds block j's keys already, and those
             * that hold all the step needs of them (one of these sends them, loading nothing) */
            bool senders = false;
            for (uint64_t k = lo; k < hi && slots; k++) {
                const attn_tstate *ts = &a->tk[m[k].task];
                if (ts->first_block + j > ts->last_block)
                    continue;
                attn_block *b = &a->blk[ts->first_block + j];
                uint64_t at = (uint64_t)b->core * r->lx.kv_slots + b->kslot;
                if (held[at] >= b->keys)
                    b->res = (int64_t)writer[at];
                senders |= held[at] >= keys;
            }
            uint64_t pick = pick_loader(a, m, lo, hi, j, keys, senders, held);
            for (uint64_t k = lo; k < hi; k++) {
                const attn_tstate *ts = &a->tk[m[k].task];
                if (ts->first_block + j > ts->last_block)
                    continue;
                attn_block *b = &a->blk[ts->first_block + j];
                b->src = b->res >= 0 ? ts->first_block + j : pick;
                if (slots && b->res < 0) {
                    uint64_t at = (uint64_t)b->core * r->lx.kv_slots + b->kslot;
                    held[at] = moved_keys(a, b);
                    writer[at] = ts->first_block + j;
                }
            }
        }
    }
done:
    free(m);
    free(held);
    free(writer);
    return st;
}

/* The blocks each block sends its K and V to (recv, grouped by sender, each group in block order). */
static void make_sends(attn *a)
{
    uint64_t nb = a->s.nblocks;
    for (uint64_t i = 0; i < nb; i++)
        if (a->blk[i].src != i)
            a->blk[a->blk[i].src].nsend++;
    uint64_t at = 0;
    for (uint64_t i = 0; i < nb; i++) {
        a->blk[i].send_begin = at;
        at += a->blk[i].nsend;
        a->blk[i].nsend = 0; /* counted again as they are placed */
    }
    for (uint64_t i = 0; i < nb; i++)
        if (a->blk[i].src != i) {
            attn_block *s = &a->blk[a->blk[i].src];
            a->blk[i].rank = s->nsend;
            a->recv[s->send_begin + s->nsend++] = i;
        }
}

/* Who a write into each block's K and V slot waits for: the last block before it on its core
 * that reads the slot, and the last that sends from it (the engines run in program order).
 * Two slots: the block two back. Keys resident: the last with the same block of the keys. */
static spy_status make_slot_users(attn *a)
{
    const spy_attention_record *r = a->r;
    uint64_t nb = a->s.nblocks;
    if (!a->s.resident) {
        for (uint64_t i = 0; i < nb; i++)
            a->blk[i].ps_mm = a->blk[i].ps_send = a->blk[i].prev2;
        return SPY_OK;
    }
    uint64_t slots = (uint64_t)r->num_cores * r->lx.kv_slots;
    int64_t *mm = malloc(slots * sizeof *mm), *send = malloc(slots * sizeof *send);
    if (!mm || !send) {
        free(mm);
        free(send);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for %llu resident key slots", (unsigned long long)slots);
    }
    for (uint64_t k = 0; k < slots; k++)
        mm[k] = send[k] = -1;
    for (uint64_t i = 0; i < nb; i++) {
        attn_block *b = &a->blk[i];
        uint64_t at = (uint64_t)b->core * r->lx.kv_slots + b->kslot;
        b->ps_mm = mm[at];
        b->ps_send = send[at];
        mm[at] = (int64_t)i;
        if (b->nsend)
            send[at] = (int64_t)i;
    }
    free(mm);
    free(send);
    return SPY_OK;
}

/* Paged: each task's table region on its core, one per distinct batch element of the
 * core's tasks (the first task of each loads it). */
static spy_status make_tables(attn *a)
{
    const spy_attention_record *r = a->r;
    for (uint64_t lo = 0, hi; lo < r->ntasks; lo = hi) {
        uint64_t regions = 0;
        for (hi = lo; hi < r->ntasks && r->tasks[hi].core == r->tasks[lo].core; hi++) {
            uint64_t k = lo;
            while (k < hi && (r->tasks[k].batch != r->tasks[hi].batch || a->tk[k].owner != k))
                k++;
            if (k == hi) { /* a new batch element: a region of its own */
                if (regions == r->table_rows)
                    return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: core %lld's tasks read the table "
                                    "rows of more than table_rows %u batch elements", (long long)r->tasks[lo].core,
                                    r->table_rows);
                a->tk[hi].region = regions++;
            } else {
                a->tk[hi].region = a->tk[k].region;
            }
            a->tk[hi].owner = k;
        }
    }
    return SPY_OK;
}

static const attn_move *move_at(const attn_operand *op, uint64_t i) { return (const attn_move *)op->moves.data + i; }
static attn_move *move_of(attn_operand *op, uint64_t i) { return (attn_move *)op->moves.data + i; }

static bool same_kind(const attn_move *x, const attn_move *y)
{
    if (x->column != y->column || x->box.n != y->box.n)
        return false;
    for (uint32_t i = 0; i < x->box.n; i++)
        if (x->box.count[i] != y->box.count[i] || x->box.lx[i] != y->box.lx[i])
            return false;
    return true;
}

/* A tile of the operand: its box at `base`; tiles alike in box and column (a run of them,
 * as the operand's tiles come) share one pattern, moved to where each starts. Its index,
 * or UINT64_MAX when host memory ran out. */
static uint64_t add_move(attn_operand *op, uint64_t base, const attn_box *box)
{
    const spy_layout *l = &op->view->layout;
    attn_move *m = spy_vec_push(&op->moves, 1);
    if (!m)
        return UINT64_MAX;
    m->box = *box;
    m->base = base;
    m->start = phys_at(l, base, &m->column);
    if (l->rows <= 1)
        m->column = 0; /* one row: every tile is of one kind */
    uint32_t k = 0;
    while (k < op->nkinds && !same_kind(move_at(op, op->kinds[k]), m))
        k++;
    if (k < op->nkinds) {
        m->pattern = move_at(op, op->kinds[k])->pattern;
    } else {
        attn_pattern *p = spy_vec_push(&op->patterns, 1);
        if (!p)
            return UINT64_MAX;
        pattern_of(l, base, box, op->load, p);
        m->pattern = op->patterns.len - 1;
        op->kinds[op->next] = op->moves.len - 1;
        op->next = (op->next + 1) % ATTN_KINDS;
        op->nkinds += op->nkinds < ATTN_KINDS;
    }
    const attn_pattern *p = (const attn_pattern *)op->patterns.data + m->pattern;
    m->ncmds = p->affine ? p->nbases : 1;
    if (!p->affine) {
        m->ndescs = box_runs(l, base, box, 0, op->load, NULL);
        op->ndescs += m->ndescs;
    }
    return op->moves.len - 1;
}

static attn_box box3(uint64_t c0, uint64_t c1, uint64_t c2, const uint64_t *strides, uint64_t lx_pitch,
                     uint64_t e)
{
    return (attn_box){3, {c0, c1, c2}, {strides[1], strides[2], strides[3]}, {c1 * lx_pitch * e, lx_pitch * e, e}};
}

/* Every tile's DMA: each task's Q and output, each block's K and V (where it loads them
 * itself) and mask. */
static spy_status make_moves(attn *a)
{
    const spy_attention_record *r = a->r;
    const spy_attention_lx *x = &r->lx;
    uint64_t group = a->s.group, e = a->s.e;
    for (uint64_t t = 0; t < r->ntasks; t++) {
        const spy_attention_task *k = &r->tasks[t];
        uint64_t b = (uint64_t)k->batch, head = (uint64_t)k->kv_head * group, q0 = (uint64_t)k->q0;
        uint64_t rows = (uint64_t)k->rows;
        const spy_attention_view *q = &r->q, *o = &r->out;
        attn_box qb = box3(group, rows, r->dim, q->strides, x->q_pitch, e);
        a->tk[t].q_move = add_move(&a->op[OP_Q], q->offset + b * q->strides[0] + head * q->strides[1] +
                                                     q0 * q->strides[2], &qb);
        if (a->tk[t].q_move == UINT64_MAX)
            return SPY_E_HOST_NOMEM;
        if (k->part == 0) {
            attn_box ob = box3(group, rows, r->v_dim, o->strides, x->stage_pitch, e);
            a->tk[t].out_move = add_move(&a->op[OP_OUT], o->offset + b * o->strides[0] + head * o->strides[1] +
                                                             q0 * o->strides[2], &ob);
            if (a->tk[t].out_move == UINT64_MAX)
                return SPY_E_HOST_NOMEM;
        }
        if (a->s.paged && a->tk[t].owner == t) { /* the row of its batch element's pages */
            const spy_attention_view *tv = &r->table;
            attn_box tb = {1, {tv->sizes[1]}, {tv->strides[1]}, {a->s.idx_e}};
            if ((a->tk[t].table_move = add_move(&a->op[OP_TABLE], tv->offset + b * tv->strides[0], &tb)) == UINT64_MAX)
                return SPY_E_HOST_NOMEM;
        }
    }
    for (uint64_t i = 0; i < a->s.nblocks; i++) {
        attn_block *blk = &a->blk[i];
        const spy_attention_task *k = &r->tasks[blk->task];
        uint64_t b = (uint64_t)k->batch, h = (uint64_t)k->kv_head;
        if (blk->src == i && blk->res < 0 && !a->s.paged) { /* paged: a gather each (fill_gathers) */
            const spy_attention_view *kv[2] = {&r->k, &r->v};
            uint64_t dims[2] = {r->dim, r->v_dim}, pitches[2] = {x->k_pitch, x->v_pitch};
            for (int w = 0; w < 2; w++) {
                const spy_attention_view *v = kv[w];
                attn_box box = {2, {moved_keys(a, blk), dims[w]}, {v->strides[2], v->strides[3]}, {pitches[w] * e, e}};
                blk->kv_move = add_move(&a->op[OP_K + w], v->offset + b * v->strides[0] + h * v->strides[1] +
                                                              blk->kv0 * v->strides[2], &box);
                if (blk->kv_move == UINT64_MAX)
                    return SPY_E_HOST_NOMEM;
            }
        }
        if (r->mask_kind != SPY_ATTN_MASK_NONE) {
            const spy_attention_view *m = &r->mask;
            attn_box box = box3(r->mask_heads, (uint64_t)k->rows, blk->keys, m->strides, x->m_pitch, a->s.em);
            if (add_move(&a->op[OP_MASK], m->offset + b * m->strides[0] + h * group * m->strides[1] +
                                              (uint64_t)k->q0 * m->strides[2] + blk->kv0 * m->strides[3],
                         &box) == UINT64_MAX)
                return SPY_E_HOST_NOMEM;
        }
    }
    return SPY_OK;
}

/* Rows of a block's commands: group A is (paged, a core's first block) the loads of the
 * core's table rows, its K loads, the Q loads of a core's first task,
 * its mask and V loads, the Q loads of the next task (behind this block's own loads: Q has
 * two slots), the sends of K, then of V, to its group's other cores, the matmul S; group B
 * its SFU program, the matmul O, after a task's last block its end and stores. */
static uint64_t k_row(const attn_block *b) { return b->a + b->nt; }
static uint64_t m_row(const attn_block *b) { return k_row(b) + b->nk + b->nq0; }
static uint64_t v_row(const attn_block *b) { return m_row(b) + b->nm; }
static uint64_t ks_row(const attn_block *b) { return v_row(b) + b->nv + b->nq1; }
static uint64_t vs_row(const attn_block *b) { return ks_row(b) + b->nsend; }
static uint64_t mm1_row(const attn_block *b) { return vs_row(b) + b->nsend; }
static uint64_t sfu_row(const attn_block *b) { return b->b; }
static uint64_t mm2_row(const attn_block *b) { return b->b + 1; }
static uint64_t end_row(const attn_block *b) { return b->b + 2; }

/* Where each command goes: per core A0 A1 B0 A2 B1 ... A(n-1) B(n-2) B(n-1); the count. */
static uint64_t place(attn *a)
{
    const spy_attention_record *r = a->r;
    for (uint64_t t = 0; t < r->ntasks; t++) {
        attn_tstate *ts = &a->tk[t];
        ts->nq = (uint32_t)move_at(&a->op[OP_Q], ts->q_move)->ncmds;
        ts->no = r->tasks[t].part == 0 ? (uint32_t)move_at(&a->op[OP_OUT], ts->out_move)->ncmds : 0;
    }
    for (uint64_t i = 0; i < a->s.nblocks; i++) {
        attn_block *b = &a->blk[i];
        if (b->src == i && a->s.paged) {
            b->nk = b->nv = 1;
        } else if (b->src == i && b->res < 0) {
            b->nk = (uint32_t)move_at(&a->op[OP_K], b->kv_move)->ncmds;
            b->nv = (uint32_t)move_at(&a->op[OP_V], b->kv_move)->ncmds;
        }
        if (r->mask_kind != SPY_ATTN_MASK_NONE)
            b->nm = (uint32_t)move_at(&a->op[OP_MASK], i)->ncmds;
    }
    if (a->s.paged) /* a core's table rows, first of all */
        for (uint64_t t = 0; t < r->ntasks; t++)
            if (a->tk[t].owner == t) {
                attn_block *first = &a->blk[a->tk[t - a->tk[t].tseq].first_block];
                first->nt += (uint32_t)move_at(&a->op[OP_TABLE], a->tk[t].table_move)->ncmds;
            }
    /* a core's first task loads its queries with its first block; each later task while
     * the task before it runs, in that task's second block (or its only one) */
    for (uint64_t t = 0; t < r->ntasks; t++) {
        attn_tstate *ts = &a->tk[t];
        if (!ts->tseq) {
            a->blk[ts->first_block].nq0 = ts->nq;
        } else {
            const attn_tstate *p = &a->tk[t - 1];
            uint64_t host = p->first_block + 1 < p->last_block ? p->first_block + 1 : p->last_block;
            a->blk[host].nq1 = ts->nq;
            a->blk[host].q1_task = t;
        }
    }
    uint64_t pos = 0;
    for (uint64_t lo = 0, hi; lo < a->s.nblocks; lo = hi) {
        for (hi = lo + 1; hi < a->s.nblocks && a->blk[hi].core == a->blk[lo].core; hi++)
            ;
        for (uint64_t i = lo; i <= hi; i++) {
            if (i < hi) { /* A(i) */
                attn_block *b = &a->blk[i];
                b->a = pos;
                pos += (uint64_t)b->nt + b->nq0 + b->nq1 + b->nk + b->nm + b->nv + 2 * b->nsend + 1;
            }
            if (i > lo) { /* B(i - 1) */
                attn_block *b = &a->blk[i - 1];
                b->b = pos;
                pos += 2 + (b->last ? 1 + (uint64_t)a->tk[b->task].no : 0);
            }
        }
    }
    for (uint64_t t = 0; t < r->ntasks; t++) {
        attn_tstate *ts = &a->tk[t];
        const attn_block *host;
        if (!ts->tseq) {
            host = &a->blk[ts->first_block];
            ts->q_row = k_row(host) + host->nk;
        } else {
            const attn_tstate *p = &a->tk[t - 1];
            host = &a->blk[p->first_block + 1 < p->last_block ? p->first_block + 1 : p->last_block];
            ts->q_row = v_row(host) + host->nv;
        }
    }
    return pos;
}

/* ---- commands ------------------------------------------------------------------------------ */

static int move_order(const void *x, const void *y)
{
    const attn_move *a = *(const attn_move *const *)x, *b = *(const attn_move *const *)y;
    for (uint32_t i = 0; i < a->box.n; i++)
        if (a->box.count[i] != b->box.count[i])
            return a->box.count[i] < b->box.count[i] ? -1 : 1;
    for (uint32_t i = 0; i < a->box.n; i++)
        if (a->box.lx[i] != b->box.lx[i])
            return a->box.lx[i] < b->box.lx[i] ? -1 : 1;
    if (a->column != b->column)
        return a->column < b->column ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* The DMA commands of every tile of an operand; the descriptor lists of those that have
 * one, by kind of tile (box, then column) and in tile order within a kind. */
static spy_status fill_moves(attn *a, attn_operand *op)
{
    uint32_t slot = op->view->slot;
    uint8_t code = op->load ? SPY_OP_LOAD : SPY_OP_STORE;
    const attn_pattern *pats = op->patterns.data;
    uint64_t listed = 0;
    for (uint64_t i = 0; i < op->moves.len; i++) {
        const attn_move *m = move_at(op, i);
        const attn_pattern *p = &pats[m->pattern];
        if (!p->affine) {
            listed++;
            continue;
        }
        for (uint64_t j = 0; j < p->nbases; j++) {
            uint64_t dev = m->start, lx = m->lx_off, k = j;
            for (uint32_t d = 0; d < p->nouter; d++) {
                uint64_t step = k % p->outer[d].count;
                k /= p->outer[d].count;
                dev += step * p->outer[d].src;
                lx += step * p->outer[d].dst;
            }
            spy_dma *c = &a->cmds[m->row + j].u.dma;
            a->cmds[m->row + j].op = code;
            if (op->load) {
                c->src_slot = slot;
                c->src_off = dev;
                c->dst_off = lx;
            } else {
                c->dst_slot = slot;
                c->dst_off = dev;
                c->src_off = lx;
            }
            c->run_bytes = (uint32_t)p->run;
            c->ndims = p->ndims;
            for (uint32_t d = 0; d < p->ndims; d++) {
                c->count[d] = (uint32_t)p->dims[d].count;
                c->src_stride[d] = op->load ? p->dims[d].src : p->dims[d].dst;
                c->dst_stride[d] = op->load ? p->dims[d].dst : p->dims[d].src;
            }
        }
    }
    if (!listed)
        return SPY_OK;
    const attn_move **order = malloc(listed * sizeof *order);
    if (!order)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory to order %llu descriptor lists",
                        (unsigned long long)listed);
    for (uint64_t i = 0, k = 0; i < op->moves.len; i++)
        if (!pats[move_at(op, i)->pattern].affine)
            order[k++] = move_at(op, i);
    qsort(order, listed, sizeof *order, move_order);
    for (uint64_t k = 0; k < listed; k++) {
        const attn_move *m = order[k];
        uint64_t first = a->ndescs;
        box_runs(&op->view->layout, m->base, &m->box, m->lx_off, op->load, a->descs + first);
        a->ndescs += m->ndescs;
        spy_cmd *c = &a->cmds[m->row];
        c->op = code;
        c->flags = SPY_DMA_DESCS;
        c->u.dma.src_slot = op->load ? slot : 0;
        c->u.dma.dst_slot = op->load ? 0 : slot;
        c->u.dma.src_off = first;
        c->u.dma.desc_count = (uint32_t)m->ndescs;
    }
    free(order);
    return SPY_OK;
}

/* ---- SFU programs ------------------------------------------------------------------------- */

static const spy_operand NONE = {0};

static spy_operand tile(uint64_t off, uint32_t pitch, uint32_t dtype)
{
    return (spy_operand){SPY_OPND_TILE, (uint8_t)dtype, 0, pitch, {.off = off}};
}

static spy_operand row(uint64_t off, uint32_t dtype)
{
    return (spy_operand){SPY_OPND_ROW, (uint8_t)dtype, 0, 1, {.off = off}};
}
static spy_operand imm(double value) { return (spy_operand){SPY_OPND_IMM, SPY_DT_F32, 0, 0, {.imm_f = value}}; }

static spy_operand at(spy_operand x, uint64_t off)
{
    x.v.off = off;
    return x;
}

static void ins(attn *a, uint32_t op, uint64_t rows, uint64_t cols, spy_operand dst, spy_operand s0, spy_operand s1,
                spy_operand s2, uint32_t aux)
{
    spy_instr *i = spy_vec_push(&a->instrs, 1);
    if (!i)
        return; /* the vector is failed: the build says so */
    i->op = (uint8_t)op;
    i->aux = (uint8_t)aux;
    i->rows = (uint32_t)rows;
    i->cols = (uint32_t)cols;
    i->dst = dst;
    i->src[0] = s0;
    i->src[1] = s1;
    i->src[2] = s2;
}

#define INS1(op, r, c, d, x) ins(a, SPY_SFU_##op, r, c, d, x, NONE, NONE, 0)
#define INS2(op, r, c, d, x, y) ins(a, SPY_SFU_##op, r, c, d, x, y, NONE, 0)
#define INS3(op, r, c, d, x, y, z) ins(a, SPY_SFU_##op, r, c, d, x, y, z, 0)

static uint64_t lx_m(const attn *a) { return a->r->lx.state; }
static uint64_t lx_l(const attn *a) { return a->r->lx.state + a->r->lx.row_bytes; }
static uint64_t lx_o(const attn *a) { return a->r->lx.state + 2ull * a->r->lx.row_bytes; }
static uint64_t state_of(const attn *a, uint64_t part)
{
    return part ? a->r->lx.recv + (part - 1) * a->r->lx.state_bytes : a->r->lx.state;
}

/* The max to subtract: 0 where a row has seen no key yet (its max is -inf, and -inf - -inf
 * would make its exponentials NaN instead of 0). */
static spy_operand safe_max(attn *a, uint64_t r, spy_operand m)
{
    if (!a->s.guarded)
        return m;
    const spy_attention_lx *x = &a->r->lx;
    spy_operand none = row(x->flag, SPY_DT_BOOL), safe = row(x->safe, SPY_DT_F32);
    ins(a, SPY_SFU_CMP, r, 1, none, m, imm(-INFINITY), NONE, SPY_CMP_EQ);
    INS3(SELECT, r, 1, safe, none, imm(0.0), m);
    return safe;
}

/* The mask tile on S: one instruction when its rows line up with S's (a mask per head, or
 * one query row), else one per head of the group. */
static void prog_mask(attn *a, uint64_t rows, uint64_t slot, uint64_t keys, spy_operand S)
{
    const spy_attention_record *r = a->r;
    uint64_t group = a->s.group, n = 1, tr = group * rows, head = 0;
    spy_operand mask = tile(r->lx.mask[slot], r->lx.m_pitch, r->mask_dtype);
    if (r->mask_heads == group) {
    } else if (rows == 1) {
        tr = group;
        mask = (spy_operand){SPY_OPND_COL, (uint8_t)r->mask_dtype, 0, 0, {.off = r->lx.mask[slot]}};
    } else {
        n = group;
        tr = rows;
        head = rows * r->lx.s_pitch * 4;
    }
    for (uint64_t g = 0; g < n; g++) {
        spy_operand dst = at(S, S.v.off + g * head);
        if (r->mask_kind == SPY_ATTN_MASK_BOOL)
            INS3(SELECT, tr, keys, dst, mask, dst, imm(-INFINITY));
        else
            INS2(ADD, tr, keys, dst, dst, mask);
    }
}

/* Keys past the causal diagonal of each row: key kv0 + j for query q0 + i when
 * start + j - i > 0, with start = kv0 - q0 - q_offset. */
static void prog_diagonal(attn *a, uint64_t rows, uint64_t keys, spy_operand S, int64_t start)
{
    const spy_attention_lx *x = &a->r->lx;
    spy_operand d = tile(x->diag, x->s_pitch, SPY_DT_F32), past = tile(x->diag_flag, x->flag_pitch, SPY_DT_BOOL);
    INS3(IOTA, rows, keys, d, imm((double)start), imm(-1.0), imm(1.0));
    ins(a, SPY_SFU_CMP, rows, keys, past, d, imm(0.0), NONE, SPY_CMP_GT);
    uint64_t head = rows * x->s_pitch * 4;
    for (uint64_t g = 0; g < a->s.group; g++) {
        spy_operand dst = at(S, S.v.off + g * head);
        INS3(SELECT, rows, keys, dst, past, imm(-INFINITY), dst);
    }
}

/* One block of S: scale, mask, online softmax, P; O rescaled for its next P V. */
static void prog_block(attn *a, uint64_t rows, uint64_t slot, uint64_t keys, bool first, bool diagonal,
                       int64_t start)
{
    const spy_attention_record *r = a->r;
    const spy_attention_lx *x = &r->lx;
    uint64_t tr = a->s.group * rows;
    spy_operand S = tile(x->s[slot], x->s_pitch, SPY_DT_F32);
    INS2(MUL, tr, keys, S, S, imm(r->scale));
    if (r->mask_kind != SPY_ATTN_MASK_NONE)
        prog_mask(a, rows, slot, keys, S);
    if (diagonal)
        prog_diagonal(a, rows, keys, S, start);
    spy_operand top = row(lx_m(a), SPY_DT_F32), total = row(lx_l(a), SPY_DT_F32), t = row(x->t, SPY_DT_F32);
    spy_operand alpha = row(x->alpha, SPY_DT_F32), safe;
    if (first) {
        INS1(RMAX, tr, keys, top, S);
        safe = safe_max(a, tr, top);
    } else {
        spy_operand mn = row(x->mn, SPY_DT_F32);
        INS1(RMAX, tr, keys, t, S);
        INS2(MAX, tr, 1, mn, top, t);
        safe = safe_max(a, tr, mn);
        INS2(SUB, tr, 1, alpha, top, safe); /* exp(m - m'): how far the old max fell behind */
        INS1(EXP, tr, 1, alpha, alpha);
        INS1(MOV, tr, 1, top, mn);
    }
    INS2(SUB, tr, keys, S, S, safe);
    INS1(EXP, tr, keys, S, S);
    INS1(RSUM, tr, keys, first ? total : t, S);
    if (!first) {
        spy_operand acc = tile(lx_o(a), x->o_pitch, SPY_DT_F32);
        INS2(MUL, tr, 1, total, total, alpha);
        INS2(ADD, tr, 1, total, total, t);
        INS2(MUL, tr, r->v_dim, acc, acc, alpha);
    }
    if (!a->s.fp32) /* the arrays take P in the operands' dtype; l summed it unrounded */
        INS1(MOV, tr, keys, tile(x->p, x->p_pitch, r->dtype), S);
}

/* The states of a split task's parts folded into the first part's, each scaled by
 * exp(its max - the overall max). */
static void prog_combine(attn *a, uint64_t rows, uint64_t parts)
{
    const spy_attention_lx *x = &a->r->lx;
    uint64_t tr = a->s.group * rows, dv = a->r->v_dim, rb = x->row_bytes, s0 = state_of(a, 0);
    spy_operand mn = row(x->mn, SPY_DT_F32), alpha = row(x->alpha, SPY_DT_F32), t = row(x->t, SPY_DT_F32);
    INS1(MOV, tr, 1, mn, row(s0, SPY_DT_F32));
    for (uint64_t p = 1; p < parts; p++)
        INS2(MAX, tr, 1, mn, mn, row(state_of(a, p), SPY_DT_F32));
    spy_operand safe = safe_max(a, tr, mn);
    spy_operand l0 = row(s0 + rb, SPY_DT_F32), o0 = tile(s0 + 2 * rb, x->o_pitch, SPY_DT_F32);
    for (uint64_t p = 0; p < parts; p++) {
        uint64_t st = state_of(a, p);
        INS2(SUB, tr, 1, alpha, row(st, SPY_DT_F32), safe);
        INS1(EXP, tr, 1, alpha, alpha);
        if (p == 0) {
            INS2(MUL, tr, 1, l0, l0, alpha);
            INS2(MUL, tr, dv, o0, o0, alpha);
            continue;
        }
        spy_operand o = tile(st + 2 * rb, x->o_pitch, SPY_DT_F32);
        INS2(MUL, tr, 1, t, row(st + rb, SPY_DT_F32), alpha);
        INS2(ADD, tr, 1, l0, l0, t);
        INS2(MUL, tr, dv, o, o, alpha);
        INS2(ADD, tr, dv, o0, o0, o);
    }
}

/* O / l, rounded into the staging tile that is stored (a row that saw no key has l = 0
 * and O = 0: out 0, as torch's CPU kernel). */
static void prog_finish(attn *a, uint64_t rows)
{
    const spy_attention_lx *x = &a->r->lx;
    uint64_t tr = a->s.group * rows;
    spy_operand t = row(x->t, SPY_DT_F32);
    INS2(MAX, tr, 1, t, row(lx_l(a), SPY_DT_F32), imm((double)FLT_MIN));
    INS1(RECIP, tr, 1, t, t);
    INS2(MUL, tr, a->r->v_dim, tile(x->stage, x->stage_pitch, a->r->dtype), tile(lx_o(a), x->o_pitch, SPY_DT_F32),
         t);
}

enum { PROG_BLOCK, PROG_FINISH, PROG_COMBINE };

/* An SFU program, made at its first use, its instructions shared by every block or task
 * of its kind (every core lays its scratchpad out alike). */
static const attn_prog *program(attn *a, int kind, uint64_t rows, uint64_t slot, uint64_t keys, bool first,
                                bool diagonal, int64_t start, uint64_t parts)
{
    uint64_t key0 = rows << 32 | (kind == PROG_BLOCK ? keys : kind == PROG_COMBINE ? parts : 0);
    uint64_t key1 = (uint64_t)kind | slot << 2 | (uint64_t)first << 3 | (uint64_t)diagonal << 4 |
                    (diagonal ? (uint64_t)(start + (1ll << 50)) << 5 : 0);
    uint64_t h = key0 * 0x9E3779B97F4A7C15ull ^ key1 * 0xC2B2AE3D27D4EB4Full;
    uint64_t i = (h ^ h >> 31) & a->progs_mask;
    while (a->progs[i].used && (a->progs[i].key[0] != key0 || a->progs[i].key[1] != key1))
        i = (i + 1) & a->progs_mask;
    attn_prog *p = &a->progs[i];
    if (!p->used) {
        uint64_t begin = a->instrs.len;
        if (kind == PROG_BLOCK) {
            prog_block(a, rows, slot, keys, first, diagonal, start);
        } else {
            if (kind == PROG_COMBINE)
                prog_combine(a, rows, parts);
            prog_finish(a, rows);
        }
        *p = (attn_prog){{key0, key1}, (uint32_t)begin, (uint32_t)(a->instrs.len - begin), true};
    }
    return p;
}

/* The SFU programs, in the order they are first used: each block's (in block order),
 * then each storing task's finish, or combine and finish. */
static void make_programs(attn *a)
{
    const spy_attention_record *r = a->r;
    for (uint64_t i = 0; i < a->s.nblocks; i++) {
        attn_block *b = &a->blk[i];
        const spy_attention_task *t = &r->tasks[b->task];
        /* key kv0 + j is past query q0 + i's diagonal when start + j > i */
        int64_t start = (int64_t)b->kv0 - t->q0 - r->q_offset;
        bool diagonal = r->causal && start + (int64_t)b->keys - 1 > 0;
        const attn_prog *p =
            program(a, PROG_BLOCK, (uint64_t)t->rows, b->g % 2, b->keys, b->first, diagonal, start, 0);
        b->prog = p->begin;
        b->nprog = p->n;
    }
    for (uint64_t i = 0; i < r->ntasks; i++) {
        const spy_attention_task *t = &r->tasks[i];
        if (t->part != 0)
            continue;
        const attn_prog *p = program(a, t->parts == 1 ? PROG_FINISH : PROG_COMBINE, (uint64_t)t->rows, 0, 0, false,
                                     false, 0, (uint64_t)t->parts);
        a->tk[i].prog = p->begin;
        a->tk[i].nprog = p->n;
    }
}

static void sfu_command(spy_cmd *c, uint32_t begin, uint32_t n)
{
    c->op = SPY_OP_SFU;
    c->u.sfu.instr_begin = begin;
    c->u.sfu.ninstrs = n;
}

/* Paged: each block's K and V as one GATHER each through its batch element's table row
 * (in the scratchpad): whole pages (or the block's rows of one page), each key a storage
 * row of whole sticks, packed row-major into the slot as a LOAD would lay it. */
static void fill_gathers(attn *a)
{
    const spy_attention_record *r = a->r;
    const spy_attention_lx *x = &r->lx;
    uint64_t e = a->s.e, page = r->page;
    for (uint64_t i = 0; i < a->s.nblocks; i++) {
        const attn_block *b = &a->blk[i];
        if (b->src != i)
            continue;
        const attn_tstate *ts = &a->tk[b->task];
        uint64_t h = (uint64_t)r->tasks[b->task].kv_head, in_page = b->kv0 % page;
        uint64_t rows = r->kv_block < page ? b->keys : page; /* keys per index */
        const spy_attention_view *views[2] = {&r->k, &r->v};
        uint64_t pitches[2] = {x->k_pitch, x->v_pitch}, lx[2] = {kv_at(a, b, 0), kv_at(a, b, 1)};
        uint64_t rowz[2] = {k_row(b), v_row(b)};
        for (int w = 0; w < 2; w++) {
            const spy_attention_view *v = views[w];
            const spy_layout *l = &v->layout;
            uint64_t sb = l->stick_bytes, n = l->row_len;
            spy_cmd *c = &a->cmds[rowz[w]];
            c->op = SPY_OP_GATHER;
            spy_gather *g = &c->u.gather;
            g->table_slot = v->slot;
            g->idx_off = (uint32_t)(r->lx_table + ts->region * r->table_pitch + b->kv0 / page * a->s.idx_e);
            g->idx_dtype = r->table_dtype;
            g->nidx = (uint32_t)(b->keys / rows);
            g->table_off = phys(l, v->offset + h * v->strides[1] + in_page * n);
            g->row_stride = v->strides[0] / n * sb;
            g->limit = v->sizes[0];
            g->lx_off = (uint32_t)lx[w];
            g->lx_pitch = (uint32_t)(rows * pitches[w] * e);
            g->run_bytes = (uint32_t)sb;
            g->ndims = 2;
            g->count[0] = (uint32_t)(pitches[w] * e / sb); /* the sticks of a key, then the keys */
            g->count[1] = (uint32_t)rows;
            g->stride[0] = (l->rows ? l->rows : 1) * sb;
            g->stride[1] = sb;
        }
    }
}

/* Every command but the DMA of the tiles: the sends of shared blocks, the matmuls, the
 * SFU programs, a task's end (its finish, or a part's state sent to its leader). */
static void fill_compute(attn *a)
{
    const spy_attention_record *r = a->r;
    const spy_attention_lx *x = &r->lx;
    uint64_t e = a->s.e, group = a->s.group;
    for (uint64_t i = 0; i < a->s.nblocks; i++) { /* K and V from the core that loaded them, into the same slots */
        const attn_block *b = &a->blk[i];
        for (uint64_t k = 0; k < b->nsend; k++) {
            const attn_block *to = &a->blk[a->recv[b->send_begin + k]];
            spy_cmd *ks = &a->cmds[ks_row(b) + k], *vs = &a->cmds[vs_row(b) + k];
            ks->op = vs->op = SPY_OP_RING;
            ks->u.ring.dst_core = vs->u.ring.dst_core = to->core;
            ks->u.ring.src_off = (uint32_t)kv_at(a, b, 0);
            ks->u.ring.dst_off = (uint32_t)kv_at(a, to, 0);
            ks->u.ring.bytes = (uint32_t)(moved_keys(a, to) * x->k_pitch * e);
            vs->u.ring.src_off = (uint32_t)kv_at(a, b, 1);
            vs->u.ring.dst_off = (uint32_t)kv_at(a, to, 1);
            vs->u.ring.bytes = (uint32_t)(moved_keys(a, to) * x->v_pitch * e);
        }
    }
    for (uint64_t i = 0; i < a->s.nblocks; i++) {
        const attn_block *b = &a->blk[i];
        uint64_t slot = b->g % 2, rows = (uint64_t)r->tasks[b->task].rows;
        spy_matmul *s = &a->cmds[mm1_row(b)].u.mm, *o = &a->cmds[mm2_row(b)].u.mm;
        a->cmds[mm1_row(b)].op = a->cmds[mm2_row(b)].op = SPY_OP_MATMUL;
        a->cmds[mm1_row(b)].flags = SPY_MM_TRANS_B; /* K as it lies: transposed */
        a->cmds[mm2_row(b)].flags = b->first ? 0 : SPY_MM_ACCUMULATE;
        *s = (spy_matmul){(uint32_t)x->q[a->tk[b->task].tseq % 2], (uint32_t)kv_at(a, b, 0), (uint32_t)x->s[slot],
                          (uint32_t)(group * rows), (uint32_t)b->keys, r->dim, x->q_pitch, x->k_pitch, x->s_pitch,
                          r->dtype, r->dtype, {0}};
        *o = (spy_matmul){(uint32_t)(a->s.fp32 ? x->s[slot] : x->p), (uint32_t)kv_at(a, b, 1), (uint32_t)lx_o(a),
                          (uint32_t)(group * rows), r->v_dim, (uint32_t)b->keys, x->p_pitch, x->v_pitch,
                          x->o_pitch, r->dtype, r->dtype, {0}};
    }
    for (uint64_t i = 0; i < a->s.nblocks; i++)
        sfu_command(&a->cmds[sfu_row(&a->blk[i])], a->blk[i].prog, a->blk[i].nprog);
    for (uint64_t i = 0; i < r->ntasks; i++)
        if (r->tasks[i].part == 0)
            sfu_command(&a->cmds[end_row(&a->blk[a->tk[i].last_block])], a->tk[i].prog, a->tk[i].nprog);
    for (uint64_t i = 0; i < r->ntasks; i++) {
        const spy_attention_task *t = &r->tasks[i];
        if (t->part == 0)
            continue;
        spy_cmd *c = &a->cmds[end_row(&a->blk[a->tk[i].last_block])];
        c->op = SPY_OP_RING;
        c->u.ring.dst_core = (uint32_t)r->tasks[t->leader].core;
        c->u.ring.src_off = (uint32_t)x->state;
        c->u.ring.dst_off = (uint32_t)state_of(a, (uint64_t)t->part);
        c->u.ring.bytes = (uint32_t)(2ull * x->row_bytes + group * (uint64_t)t->rows * x->o_pitch * 4);
    }
}

/* ---- dependencies --------------------------------------------------------------------------
 * Made command by command in program order, so that each command's list follows the one
 * before it in the block: a scratchpad slot is free once the block two back on the core
 * read it (and sent it to its group), an engine's operands are ready. */

/* The next command in program order: its dependencies follow. */
static inline void link_next(attn *a)
{
    a->dep_at[a->linked++] = (uint32_t)a->deps.len;
}

/* The command being linked waits for commands [before, +n). */
static inline void wait_on(attn *a, uint64_t before, uint64_t n)
{
    spy_vec *v = &a->deps;
    if (v->len + n > SPY_BUILD_MAX_BYTES / sizeof(uint32_t)) { /* refused by the build */
        v->failed = a->deps_over = true;
        return;
    }
    uint32_t *d = v->len + n <= v->cap ? (uint32_t *)v->data + v->len : NULL;
    if (d)
        v->len += n;
    else if (!(d = spy_vec_push(v, n)))
        return; /* the vector is failed: the build says so */
    for (uint64_t j = 0; j < n; j++)
        d[j] = (uint32_t)(before + j);
}

static uint64_t end_of(const attn *a, uint64_t task) { return end_row(&a->blk[a->tk[task].last_block]); }

/* The command being linked waits until block i's K (w 0) or V (w 1) is in its slot: its own
 * loads, the send that brought it, or, resident, those of the block that put it there. */
static void wait_kv(attn *a, uint64_t i, int w)
{
    const attn_block *b = &a->blk[i];
    if (b->res >= 0)
        b = &a->blk[(i = (uint64_t)b->res)];
    if (b->src != i)
        wait_on(a, (w ? vs_row(&a->blk[b->src]) : ks_row(&a->blk[b->src])) + b->rank, 1);
    else
        wait_on(a, w ? v_row(b) : k_row(b), w ? b->nv : b->nk);
}

/* The command being linked writes block b's K (w 0) or V (w 1) slot: it waits until the
 * blocks before it on its core have read it and sent it. */
static void wait_slot(attn *a, const attn_block *b, int w)
{
    if (b->ps_mm >= 0)
        wait_on(a, w ? mm2_row(&a->blk[b->ps_mm]) : mm1_row(&a->blk[b->ps_mm]), 1);
    if (b->ps_send >= 0) {
        const attn_block *p = &a->blk[b->ps_send];
        wait_on(a, w ? vs_row(p) : ks_row(p), p->nsend);
    }
}

/* Group A of block i: its loads, the sends of its K and V, the matmul S. */
static void link_a(attn *a, uint64_t i)
{
    const attn_block *b = &a->blk[i], *p2 = b->prev2 >= 0 ? &a->blk[b->prev2] : NULL;
    const attn_move *table = NULL; /* paged: the load of the row its gathers read */
    if (a->s.paged && b->src == i)
        table = move_at(&a->op[OP_TABLE], a->tk[a->tk[b->task].owner].table_move);
    for (uint32_t k = 0; k < b->nt; k++) /* a core's table rows: regions of their own, never reused */
        link_next(a);
    for (uint32_t k = 0; k < b->nk; k++) {
        link_next(a);
        if (table)
            wait_on(a, table->row, table->ncmds);
        wait_slot(a, b, 0);
    }
    for (uint32_t k = 0; k < b->nq0; k++) /* a core's first task's queries */
        link_next(a);
    for (uint32_t k = 0; k < b->nm; k++) {
        link_next(a);
        if (p2)
            wait_on(a, sfu_row(p2), 1);
    }
    for (uint32_t k = 0; k < b->nv; k++) {
        link_next(a);
        if (table)
            wait_on(a, table->row, table->ncmds);
        wait_slot(a, b, 1);
    }
    for (uint32_t k = 0; k < b->nq1; k++) { /* the next task's queries: their slot was read two tasks back */
        link_next(a);
        uint64_t t = b->q1_task;
        if (a->tk[t].tseq >= 2)
            wait_on(a, mm1_row(&a->blk[a->tk[t - 2].last_block]), 1);
    }
    for (int v = 0; v < 2; v++) /* a send leaves once its block is loaded and the receiver's slot is free */
        for (uint64_t k = 0; k < b->nsend; k++) {
            const attn_block *to = &a->blk[a->recv[b->send_begin + k]];
            link_next(a);
            wait_kv(a, i, v);
            wait_slot(a, to, v);
        }
    link_next(a); /* S = Q K^T */
    wait_kv(a, i, 0);
    if (b->first)
        wait_on(a, a->tk[b->task].q_row, a->tk[b->task].nq);
    if (p2)
        wait_on(a, sfu_row(p2), 1); /* its S slot */
}

/* Group B of block i: its SFU program, the matmul O, after a task's last block its end and stores. */
static void link_b(attn *a, uint64_t i)
{
    const attn_block *b = &a->blk[i], *p1 = b->prev1 >= 0 ? &a->blk[b->prev1] : NULL;
    bool after_task = b->first && p1; /* overwrites the state its core's previous task ended with */
    link_next(a);
    wait_on(a, mm1_row(b), 1);
    wait_on(a, m_row(b), b->nm);
    if (p1)
        wait_on(a, mm2_row(p1), 1); /* P, and O rescaled */
    if (after_task)
        wait_on(a, end_row(p1), 1);
    link_next(a); /* O += P V */
    if (b->src != i || b->res >= 0)
        wait_kv(a, i, 1);
    wait_on(a, sfu_row(b), 1);
    wait_on(a, v_row(b), b->nv);
    if (after_task)
        wait_on(a, end_row(p1), 1);
    if (!b->last)
        return;
    const attn_tstate *ts = &a->tk[b->task];
    link_next(a); /* its finish or combine; or a part's state sent to its leader */
    wait_on(a, mm2_row(b), 1);
    if (ts->prev_store >= 0) /* the staging tile is free once the core's previous store is done */
        wait_on(a, end_of(a, (uint64_t)ts->prev_store) + 1, a->tk[ts->prev_store].no);
    for (uint64_t k = 0; k < ts->nparts; k++) /* a leader combines once every part's state arrived */
        wait_on(a, end_of(a, a->parts[ts->parts_begin + k]), 1);
    for (uint32_t k = 0; k < ts->no; k++) { /* the store waits for its staging tile */
        link_next(a);
        wait_on(a, end_row(b), 1);
    }
}

/* Which task before each on its core stores, which parts each leader waits for. */
static spy_status make_task_links(attn *a)
{
    const spy_attention_record *r = a->r;
    int64_t previous = -1;
    uint64_t nparts = 0;
    for (uint64_t t = 0; t < r->ntasks; t++) {
        const spy_attention_task *x = &r->tasks[t];
        a->tk[t].prev_store = -1;
        if (x->part == 0) {
            if (previous >= 0 && r->tasks[previous].core == x->core)
                a->tk[t].prev_store = previous;
            previous = (int64_t)t;
        } else {
            a->tk[x->leader].nparts++;
            nparts++;
        }
    }
    if (!nparts)
        return SPY_OK;
    if (!(a->parts = malloc(nparts * sizeof *a->parts)))
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for %llu parts of split tasks",
                        (unsigned long long)nparts);
    uint64_t at = 0;
    for (uint64_t t = 0; t < r->ntasks; t++) {
        a->tk[t].parts_begin = at;
        at += a->tk[t].nparts;
        a->tk[t].nparts = 0;
    }
    for (uint64_t t = 0; t < r->ntasks; t++)
        if (r->tasks[t].part > 0) {
            attn_tstate *l = &a->tk[r->tasks[t].leader];
            a->parts[l->parts_begin + l->nparts++] = t;
        }
    return SPY_OK;
}

/* Every command's dependencies, walking the cores' program order as place() laid it out. */
static void links(attn *a)
{
    for (uint64_t lo = 0, hi; lo < a->s.nblocks; lo = hi) {
        for (hi = lo + 1; hi < a->s.nblocks && a->blk[hi].core == a->blk[lo].core; hi++)
            ;
        link_a(a, lo);
        for (uint64_t i = lo + 1; i < hi; i++) {
            link_a(a, i);
            link_b(a, i - 1);
        }
        link_b(a, hi - 1);
    }
    a->dep_at[a->linked] = (uint32_t)a->deps.len;
}

/* ---- the entry point ------------------------------------------------------------------------ */

/* The rows of the tiles' DMA, and their scratchpad side. */
static void place_moves(attn *a)
{
    const spy_attention_record *r = a->r;
    for (uint64_t t = 0; t < r->ntasks; t++) {
        const attn_tstate *ts = &a->tk[t];
        attn_move *q = move_of(&a->op[OP_Q], ts->q_move);
        q->row = ts->q_row;
        q->lx_off = r->lx.q[ts->tseq % 2];
        if (r->tasks[t].part == 0) {
            attn_move *o = move_of(&a->op[OP_OUT], ts->out_move);
            o->row = end_row(&a->blk[ts->last_block]) + 1;
            o->lx_off = r->lx.stage;
        }
    }
    uint64_t at = 0; /* paged: the next table row's command in its core's first block */
    for (uint64_t t = 0; a->s.paged && t < r->ntasks; t++) {
        const attn_tstate *ts = &a->tk[t];
        if (!ts->tseq)
            at = a->blk[ts->first_block].a;
        if (ts->owner != t)
            continue;
        attn_move *m = move_of(&a->op[OP_TABLE], ts->table_move);
        m->row = at;
        m->lx_off = r->lx_table + ts->region * r->table_pitch;
        at += m->ncmds;
    }
    for (uint64_t i = 0; i < a->s.nblocks; i++) {
        const attn_block *b = &a->blk[i];
        if (b->src == i && b->res < 0 && !a->s.paged) {
            attn_move *k = move_of(&a->op[OP_K], b->kv_move), *v = move_of(&a->op[OP_V], b->kv_move);
            k->row = k_row(b);
            k->lx_off = kv_at(a, b, 0);
            v->row = v_row(b);
            v->lx_off = kv_at(a, b, 1);
        }
        if (r->mask_kind != SPY_ATTN_MASK_NONE) {
            attn_move *m = move_of(&a->op[OP_MASK], i);
            m->row = m_row(b);
            m->lx_off = r->lx.mask[b->g % 2];
        }
    }
}

/* Everything decided from the record, then the block written in place: its commands in
 * program order, each one's dependencies counted first. */
static spy_status build(attn *a, spy_built *out)
{
    const spy_attention_record *r = a->r;
    uint64_t nb = a->s.nblocks, nt = r->ntasks, cap = 16, ncmds = 0, ndescs = 0, total = 0;
    spy_status st = SPY_OK;
    if (nt) {
        while (cap < 2 * (nb + nt))
            cap *= 2;
        a->blk = calloc(nb, sizeof *a->blk);
        a->tk = calloc(nt, sizeof *a->tk);
        a->recv = malloc(nb * sizeof *a->recv);
        a->progs = calloc(cap, sizeof *a->progs);
        a->progs_mask = cap - 1;
        if (!a->blk || !a->tk || !a->recv || !a->progs)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for the %llu blocks of an attention",
                            (unsigned long long)nb);
        if ((st = make_blocks(a)) != SPY_OK)
            return st;
        if (a->s.paged && (st = make_tables(a)) != SPY_OK)
            return st;
        make_sends(a);
        if ((st = make_slot_users(a)) != SPY_OK)
            return st;
        const spy_attention_view *views[ATTN_OPERANDS] = {&r->q, &r->k, &r->v, &r->out, &r->mask, &r->table};
        for (int i = 0; i < ATTN_OPERANDS; i++) {
            a->op[i].view = views[i];
            a->op[i].load = i != OP_OUT;
        }
        uint64_t most[ATTN_OPERANDS] = {nt, nb, nb, nt, r->mask_kind != SPY_ATTN_MASK_NONE ? nb : 0,
                                        a->s.paged ? nt : 0}; /* tiles per operand */
        for (int i = 0; i < ATTN_OPERANDS; i++) /* room for them at once: the vectors grow no more */
            if (most[i] && spy_vec_push(&a->op[i].moves, most[i]))
                a->op[i].moves.len = 0;
        if (make_moves(a) != SPY_OK)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for the DMA of an attention's tiles");
        ncmds = place(a);
        for (int i = 0; i < ATTN_OPERANDS; i++)
            ndescs += a->op[i].ndescs;
        make_programs(a);
        if (a->instrs.failed)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for an attention's SFU programs");
        if (ncmds > SPY_BUILD_MAX_BYTES / sizeof(spy_cmd))
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: its tiles make %llu commands, a program block "
                            "of more than %llu bytes", (unsigned long long)ncmds,
                            (unsigned long long)SPY_BUILD_MAX_BYTES);
        place_moves(a);
        if ((st = make_task_links(a)) != SPY_OK)
            return st;
        if (!(a->dep_at = malloc((ncmds + 1) * sizeof *a->dep_at)))
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory to link %llu commands", (unsigned long long)ncmds);
        links(a);
        if (a->deps_over)
            return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: the dependencies of its %llu commands make a "
                            "program block of more than %llu bytes", (unsigned long long)ncmds,
                            (unsigned long long)SPY_BUILD_MAX_BYTES);
        if (a->deps.failed)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for the dependencies of %llu commands",
                            (unsigned long long)ncmds);
    }
    uint64_t ndeps = a->deps.len;
    if (!spy_block_bytes(r->nslots, ncmds, ndeps, ndescs, &total) ||
        total + a->instrs.len * sizeof(spy_instr) > SPY_BUILD_MAX_BYTES)
        return spy_fail(SPY_E_INVALID_ARG, -1, "attention record: its %llu commands, %llu dependencies, %llu SFU "
                        "instructions and %llu descriptors make a program block of more than %llu bytes",
                        (unsigned long long)ncmds, (unsigned long long)ndeps, (unsigned long long)a->instrs.len,
                        (unsigned long long)ndescs, (unsigned long long)SPY_BUILD_MAX_BYTES);
    total += a->instrs.len * sizeof(spy_instr);
    spy_block_sections blk;
    st = spy_block_alloc(total, r->nslots, (uint32_t)ncmds, (uint32_t)ndeps, (uint32_t)ndescs, out, &blk);
    if (st != SPY_OK)
        return st;
    ((spy_job_header *)out->data)->ninstrs = (uint32_t)a->instrs.len;
    for (uint32_t i = 0; i < r->nslots; i++)
        blk.slots[i] = (spy_slot){SPY_SLOT_DRAM, 0, r->slot_extent[i]};
    if (!nt)
        return SPY_OK;
    spy_instr *instrs = (spy_instr *)blk.descs; /* the instructions come before the descriptors */
    memcpy(instrs, a->instrs.data, a->instrs.len * sizeof *instrs);
    a->cmds = blk.cmds;
    if (ndeps)
        memcpy(blk.deps, a->deps.data, ndeps * sizeof *blk.deps);
    a->descs = (spy_desc *)(instrs + a->instrs.len);
    for (uint64_t i = 0; i < nb; i++) { /* every command's header: its core, its dependencies */
        const attn_block *b = &a->blk[i];
        uint64_t ranges[2][2] = {{b->a, mm1_row(b) + 1},
                                 {b->b, end_row(b) + (b->last ? 1 + (uint64_t)a->tk[b->task].no : 0)}};
        for (int g = 0; g < 2; g++)
            for (uint64_t k = ranges[g][0]; k < ranges[g][1]; k++) {
                a->cmds[k].core = b->core;
                a->cmds[k].dep_begin = a->dep_at[k];
                a->cmds[k].ndeps = a->dep_at[k + 1] - a->dep_at[k];
            }
    }
    const int order[ATTN_OPERANDS] = {OP_Q, OP_K, OP_V, OP_MASK, OP_OUT, OP_TABLE}; /* the descriptor lists' order */
    for (int i = 0; i < ATTN_OPERANDS; i++)
        if ((st = fill_moves(a, &a->op[order[i]])) != SPY_OK)
            return st;
    if (a->s.paged)
        fill_gathers(a);
    fill_compute(a);
    return SPY_OK;
}

spy_status spy_build_attention(const spy_attention_record *r, spy_built *out)
{
    if (!r || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null attention record or output");
    out->data = NULL;
    out->bytes = 0;
    attn a;
    memset(&a, 0, sizeof a);
    a.r = r;
    spy_status st = record_check(r, &a.s);
    if (st != SPY_OK)
        return st;
    for (int i = 0; i < ATTN_OPERANDS; i++) {
        a.op[i].patterns.elem = sizeof(attn_pattern);
        a.op[i].moves.elem = sizeof(attn_move);
    }
    a.instrs.elem = sizeof(spy_instr);
    a.deps.elem = sizeof(uint32_t);
    st = build(&a, out);
    attn_free(&a);
    if (st != SPY_OK)
        spy_built_free(out);
    return st;
}
