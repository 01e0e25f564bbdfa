/*
 * Streaming score-tile attention, instantiated once per precision by
 * fa_additive.c with REAL and SFX defined.  Not a public header.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

static inline int64_t FN(boff)(const fa_tiled_args *a, const int64_t *bs, int64_t t)
{
    int64_t off = 0;
    for (int i = a->nbatch - 1; i >= 0; i--) {
        int64_t n = a->batch_shape[i];
        off += (t % n) * bs[i];
        t /= n;
    }
    return off;
}

/* Mask and causal limit on the tile row s[0..n) of query gi, keys j0.. */
static inline void FN(mask_row)(const fa_tiled_args *a, const unsigned char *mb, const REAL *bb,
                                REAL *s, int64_t gi, int64_t j0, int64_t n)
{
    if (mb) {
        const unsigned char *mr = mb + gi * a->ldm + j0;
        for (int64_t c = 0; c < n; c++)
            s[c] = mr[c] ? s[c] : (REAL)(-INFINITY);
    } else if (bb) {
        const REAL *br = bb + gi * a->ldm + j0;
        for (int64_t c = 0; c < n; c++)
            s[c] += br[c];
    }
    if (a->causal) {
        int64_t lim = gi + a->causal_offset - j0;
        for (int64_t c = lim < 0 ? 0 : lim + 1; c < n; c++)
            s[c] = (REAL)(-INFINITY);
    }
}

/* 1 when a score is NaN or +inf */
static inline int FN(bad_scores)(const REAL *S, int64_t lds, int64_t m, int64_t n)
{
    for (int64_t r = 0; r < m; r++) {
        const REAL *s = S + r * lds;
        int bad = 0;
        for (int64_t c = 0; c < n; c++)
            bad |= !(s[c] < (REAL)INFINITY);   /* NaN or +inf */
        if (bad)
            return 1;
    }
    return 0;
}

typedef struct {
    fa_tiled_args *a;
    const fa_rowops *ops;
    pv_fn_t(REAL) pv;
    int64_t nqb;
    size_t slot_elems;
    REAL *scratch;
    int reverse;
    int status;       /* atomic: first failure */
    fa_stop_poll poll;
} FN(tjob);

static int FN(score_tile)(FN(tjob) *j, const REAL *Q, const REAL *Kt, int64_t m, int64_t n,
                          REAL *S, int64_t lds)
{
    fa_tiled_args *a = j->a;
    int rc = a->CAT(score, SFX)(a->score_params, Q, a->ldq, Kt, a->ldk, m, n, a->d, S, lds);
    if (rc != 0) {
        int expected = 0;
        __atomic_compare_exchange_n(&a->score_status, &expected, rc, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
        return FA_ESCORE;
    }
    if (a->check_scores && FN(bad_scores)(S, lds, m, n))
        return FA_ENONFINITE;
    return FA_OK;
}

/* Returns early with FA_EINTR (rows unfinished) when poll says stop. */
static int FN(task)(FN(tjob) *j, int64_t b, int64_t i0, int64_t m, REAL *scratch, int slot)
{
    fa_tiled_args *a = j->a;
    const fa_rowops *ops = j->ops;
    const REAL *Q = (const REAL *)a->q + FN(boff)(a, a->q_bs, b) + i0 * a->ldq;
    const REAL *K = (const REAL *)a->k + FN(boff)(a, a->k_bs, b);
    const REAL *V = (const REAL *)a->v + FN(boff)(a, a->v_bs, b);
    REAL *O = (REAL *)a->out + FN(boff)(a, a->o_bs, b) + i0 * a->ldo;
    const unsigned char *mb = NULL;
    const REAL *bb = NULL;
    if (a->mask_kind == FA_MASK_BOOL)
        mb = (const unsigned char *)a->mask + FN(boff)(a, a->m_bs, b);
    else if (a->mask_kind == FA_MASK_ADD)
        bb = (const REAL *)a->mask + FN(boff)(a, a->m_bs, b);
    REAL *W = a->weights ? (REAL *)a->weights + FN(boff)(a, a->w_bs, b) + i0 * a->ldw : NULL;
    REAL *Lse = a->lse ? (REAL *)a->lse + FN(boff)(a, a->l_bs, b) + i0 : NULL;
    const int64_t dv = a->dv, bk = a->block_k;
    int64_t kend = a->Lk;
    if (a->causal) {
        int64_t lim = i0 + m - 1 + a->causal_offset + 1;
        kend = lim < kend ? lim : kend;
        kend = kend < 0 ? 0 : kend;
    }
    for (int64_t r = 0; r < m; r++)
        memset(O + r * a->ldo, 0, (size_t)dv * sizeof(REAL));

    if (W) {
        /* weights wanted: the scores of whole rows go into them, exact softmax */
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < a->Lk; c++)
                W[r * a->ldw + c] = (REAL)(-INFINITY);
        for (int64_t j0 = 0; j0 < kend; j0 += bk) {
            if (fa_stop_poll_check(&j->poll, slot))
                return FA_EINTR;
            int64_t n = kend - j0 < bk ? kend - j0 : bk;
            if (mb && fa_tile_masked_out(mb, a->ldm, i0, m, j0, n))
                continue;
            int rc = FN(score_tile)(j, Q, K + j0 * a->ldk, m, n, W + j0, a->ldw);
            if (rc)
                return rc;
            for (int64_t r = 0; r < m; r++)
                FN(mask_row)(a, mb, bb, W + r * a->ldw + j0, i0 + r, j0, n);
        }
        for (int64_t r = 0; r < m; r++) {
            REAL *w = W + r * a->ldw;
            REAL mx = FN(ops_rowmax)(ops, w, kend);
            REAL mref = mx == (REAL)(-INFINITY) ? (REAL)0 : mx;
            REAL l = kend ? FN(ops_expsub)(ops, w, kend, mref) : (REAL)0;
            if (Lse)
                Lse[r] = (REAL)fa_row_lse((double)mref, (double)l);
            REAL f = l == (REAL)0 ? (REAL)0 : (REAL)1 / l;
            for (int64_t c = 0; c < kend; c++)
                w[c] *= f;
            for (int64_t c = kend; c < a->Lk; c++)
                w[c] = 0;
        }
        j->pv(m, dv, kend, W, a->ldw, V, a->ldv, O, a->ldo);
        return FA_OK;
    }

    REAL *S = scratch;              /* m x bk */
    REAL *Mx = scratch + m * bk;    /* running max */
    REAL *Ls = Mx + m;              /* running sum */
    for (int64_t r = 0; r < m; r++) {
        Mx[r] = (REAL)(-INFINITY);
        Ls[r] = (REAL)0;
    }
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        if (fa_stop_poll_check(&j->poll, slot))
            return FA_EINTR;
        int64_t n = kend - j0 < bk ? kend - j0 : bk;
        if (mb && fa_tile_masked_out(mb, a->ldm, i0, m, j0, n))
            continue;
        int rc = FN(score_tile)(j, Q, K + j0 * a->ldk, m, n, S, bk);
        if (rc)
            return rc;
        for (int64_t r = 0; r < m; r++) {
            REAL *s = S + r * bk;
            FN(mask_row)(a, mb, bb, s, i0 + r, j0, n);
            REAL tmax = FN(ops_rowmax)(ops, s, n);
            REAL mold = Mx[r];
            if (tmax > mold) {
                if (mold != (REAL)(-INFINITY)) {   /* rescale only when the max grows */
                    REAL alpha = (REAL)FN(expo)(mold - tmax);
                    Ls[r] *= alpha;
                    REAL *o = O + r * a->ldo;
                    for (int64_t c = 0; c < dv; c++)
                        o[c] *= alpha;
                }
                Mx[r] = tmax;
            }
            REAL mu = Mx[r];
            Ls[r] += FN(ops_expsub)(ops, s, n, mu == (REAL)(-INFINITY) ? (REAL)0 : mu);
        }
        j->pv(m, dv, n, S, bk, V + j0 * a->ldv, a->ldv, O, a->ldo);
    }
    for (int64_t r = 0; r < m; r++) {
        REAL *o = O + r * a->ldo;
        REAL l = Ls[r];
        if (Lse)
            Lse[r] = (REAL)fa_row_lse(Mx[r] == (REAL)(-INFINITY) ? 0.0 : (double)Mx[r], (double)l);
        if (l == (REAL)0)
            memset(o, 0, (size_t)dv * sizeof(REAL));
        else {
            REAL f = (REAL)1 / l;
            for (int64_t c = 0; c < dv; c++)
                o[c] *= f;
        }
    }
    return FA_OK;
}

static void FN(run)(void *ctx, int64_t t, int slot)
{
    FN(tjob) *j = (FN(tjob) *)ctx;
    if (__atomic_load_n(&j->status, __ATOMIC_RELAXED))
        return;   /* a task failed: the call fails, do no more work */
    fa_tiled_args *a = j->a;
    int64_t b = t / j->nqb, qb = t % j->nqb;
    if (j->reverse)
        qb = j->nqb - 1 - qb;
    int64_t i0 = qb * a->block_q;
    int64_t m = a->Lq - i0 < a->block_q ? a->Lq - i0 : a->block_q;
    int rc = FN(task)(j, b, i0, m, j->scratch + (size_t)slot * j->slot_elems, slot);
    if (rc) {
        int expected = 0;
        __atomic_compare_exchange_n(&j->status, &expected, rc, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
    }
}

int FN(fa_tiled_attention)(fa_tiled_args *a)
{
    if (!a->CAT(score, SFX) || a->block_q < 1 || a->block_k < 1 || a->n_threads < 1 || a->d < 1)
        return FA_EINVAL;
    a->score_status = 0;
    int64_t nbatch = 1;
    for (int i = 0; i < a->nbatch; i++)
        nbatch *= a->batch_shape[i];
    FN(tjob) j;
    j.a = a;
    j.ops = fa_get_rowops();
    j.pv = FN(get_pv)();
    j.nqb = (a->Lq + a->block_q - 1) / a->block_q;
    j.reverse = a->causal;
    j.status = FA_OK;
    fa_stop_poll_init(&j.poll, a->stop, a->stop_ctx);
    int64_t ntasks = nbatch * j.nqb;
    if (ntasks == 0)
        return FA_OK;
    int nt = a->n_threads;
    if (nt > ntasks)
        nt = (int)ntasks;
    /* per slot: the score tile, running max and sum (64-byte multiples) */
    size_t elems = a->weights ? 16 : (size_t)(a->block_q * a->block_k + 2 * a->block_q);
    elems = (elems + 15) & ~(size_t)15;
    j.slot_elems = elems;
    j.scratch = (REAL *)fa_arena(elems * sizeof(REAL) * (size_t)nt);
    if (!j.scratch)
        return FA_ENOMEM;
    int stopped = add_pool_run(ntasks, nt, FN(run), &j, a->stop ? fa_stop_poll_fn : NULL, &j.poll);
    if (stopped || fa_stop_poll_stopped(&j.poll))
        return FA_EINTR;
    return j.status;
}

#undef FN
#undef CAT
#undef CAT_
