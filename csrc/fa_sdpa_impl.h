/*
 * Scaled-dot-product attention kernel body, instantiated once per precision
 * by fa_sdpa.c with REAL, SFX and GEMM defined.  Not a public header.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* Row-major C (M x N, ldc) = alpha * op(A) . op(B) + beta * C through a
 * column-major BLAS: compute C^T = op(B)^T . op(A)^T.  The int casts are
 * safe: fa_sdpa refuses BLAS calls with sizes beyond FA_BLAS_INT_MAX
 * (FN(blas_sizes_ok)). */
static void FN(rm_gemm)(char ta, char tb, int64_t M, int64_t N, int64_t K, REAL alpha,
                        const REAL *A, int64_t lda, const REAL *B, int64_t ldb,
                        REAL beta, REAL *C, int64_t ldc)
{
    int m = (int)N, n = (int)M, k = (int)K;
    int ia = (int)ldb, ib = (int)lda, ic = (int)ldc;
    GEMM(&tb, &ta, &m, &n, &k, &alpha, (REAL *)B, &ia, (REAL *)A, &ib, &beta, C, &ic);
}

/* Offset (in elements) of batch item t for an array with batch strides bs. */
static inline int64_t FN(batch_off)(const fa_sdpa_args *a, const int64_t *bs, int64_t t)
{
    int64_t off = 0;
    for (int i = a->nbatch - 1; i >= 0; i--) {
        int64_t n = a->batch_shape[i];
        int64_t idx = t % n;
        t /= n;
        off += idx * bs[i];
    }
    return off;
}

/* Apply mask and causal limit to the tile row s[0..n) of query row gi, keys j0..j0+n. */
static inline void FN(mask_row)(const fa_sdpa_args *a, const fa_rowops *ops,
                                const unsigned char *mb, const REAL *bb,
                                REAL *s, int64_t gi, int64_t j0, int64_t n)
{
    if (mb) {
        FN(ops_mask_bool)(ops, s, mb + gi * a->ldm + j0, n);
    } else if (bb) {
        const REAL *br = bb + gi * a->ldm + j0;
        for (int64_t c = 0; c < n; c++)
            s[c] += br[c];
    }
    if (a->causal) {
        int64_t lim = gi + a->causal_offset - j0;  /* last allowed column */
        for (int64_t c = lim < 0 ? 0 : lim + 1; c < n; c++)
            s[c] = (REAL)(-INFINITY);
    }
}

static inline void FN(scale_row)(REAL *x, int64_t n, REAL f)
{
    for (int64_t c = 0; c < n; c++)
        x[c] *= f;
}

/* Final touch on an output row with softmax denominator l: a row that may
 * attend to nothing is exactly zero (even if masked-out values hold NaN or
 * inf); otherwise divide by l when asked. */
static inline void FN(finish_row)(REAL *o, int64_t dv, REAL l, int divide)
{
    if (l == (REAL)0)
        memset(o, 0, (size_t)dv * sizeof(REAL));
    else if (divide)
        FN(scale_row)(o, dv, (REAL)1 / l);
}

/* Exclusive end of the keys any row in [i0, i0+m) may see. */
static inline int64_t FN(key_end)(const fa_sdpa_args *a, int64_t i0, int64_t m)
{
    int64_t kend = a->Lk;
    if (a->causal) {
        int64_t lim = i0 + m - 1 + a->causal_offset + 1;
        if (lim < kend)
            kend = lim;
        if (kend < 0)
            kend = 0;
    }
    return kend;
}

/* Tasks that skip BLAS: single-pass ones too small for a BLAS call to pay,
 * streaming ones with our packed tile products. */
static inline int FN(use_direct)(const fa_sdpa_args *a)
{
    return a->direct;
}

/* Where K^T goes for the direct products: after the scores and l. */
static inline REAL *FN(kt_scratch)(const fa_sdpa_args *a, REAL *scratch)
{
    return scratch + (a->weights ? a->block_q : a->block_q * a->Lk + a->block_q);
}

/* REAL elements reserved (64-byte multiples) for the causal block limits. */
static inline int64_t FN(lim_elems)(const fa_sdpa_args *a)
{
    if (!(FN(use_direct)(a) && a->causal && a->path == FA_PATH_STREAM))
        return 0;
    int64_t nblk = (a->block_q + FA_PACK_ROWS - 1) / FA_PACK_ROWS;
    int64_t bytes = (nblk * (int64_t)sizeof(int64_t) + 63) / 64 * 64;
    return bytes / (int64_t)sizeof(REAL);
}

/* One task: batch item b, query rows [i0, i0+m).  scratch is large enough for the path.
 * The streaming path asks poll once per key tile and returns early (rows
 * unfinished) when the call is being stopped. */
static void FN(task)(const fa_sdpa_args *a, const fa_rowops *ops, int64_t b, int64_t i0,
                     int64_t m, REAL *scratch, fa_stop_poll *poll, int slot)
{
    const REAL *Q = (const REAL *)a->q + FN(batch_off)(a, a->q_bs, b) + i0 * a->ldq;
    const REAL *K = (const REAL *)a->k + FN(batch_off)(a, a->k_bs, b);
    const REAL *V = (const REAL *)a->v + FN(batch_off)(a, a->v_bs, b);
    REAL *O = (REAL *)a->out + FN(batch_off)(a, a->o_bs, b) + i0 * a->ldo;
    const unsigned char *mb = NULL;
    const REAL *bb = NULL;
    if (a->mask_kind == FA_MASK_BOOL)
        mb = (const unsigned char *)a->mask + FN(batch_off)(a, a->m_bs, b);
    else if (a->mask_kind == FA_MASK_ADD)
        bb = (const REAL *)a->mask + FN(batch_off)(a, a->m_bs, b);
    REAL *W = a->weights ? (REAL *)a->weights + FN(batch_off)(a, a->w_bs, b) + i0 * a->ldw : NULL;
    REAL *Lse = a->lse ? (REAL *)a->lse + FN(batch_off)(a, a->l_bs, b) + i0 : NULL;
    const REAL scale = (REAL)a->scale;
    const int64_t dv = a->dv;
    const int64_t kend = FN(key_end)(a, i0, m);

    if (kend == 0) {  /* every row fully masked by causality, or no keys */
        for (int64_t r = 0; r < m; r++) {
            memset(O + r * a->ldo, 0, (size_t)dv * sizeof(REAL));
            if (W)
                memset(W + r * a->ldw, 0, (size_t)a->Lk * sizeof(REAL));
            if (Lse)
                Lse[r] = (REAL)(-INFINITY);
        }
        return;
    }

    if (W || a->path == FA_PATH_SINGLE) {
        /* Whole key row at once: exact two-pass softmax. */
        REAL *S = W ? W : scratch;
        int64_t lds = W ? a->ldw : kend;
        const int direct = FN(use_direct)(a);
        if (direct)
            FN(ops_small_qk)(ops, m, kend, a->d, scale, Q, a->ldq, K, a->ldk, S, lds,
                             FN(kt_scratch)(a, scratch));
        else
            FN(rm_gemm)('N', 'T', m, kend, a->d, scale, Q, a->ldq, K, a->ldk, (REAL)0, S, lds);
        REAL *lsum = W ? scratch : scratch + m * a->Lk;  /* softmax denominators */
        for (int64_t r = 0; r < m; r++) {
            REAL *s = S + r * lds;
            FN(mask_row)(a, ops, mb, bb, s, i0 + r, 0, kend);
            REAL mx = FN(ops_rowmax)(ops, s, kend);
            REAL mref = mx == (REAL)(-INFINITY) ? (REAL)0 : mx;
            REAL l = (mb || bb || a->causal) ? FN(ops_expsub_masked)(ops, s, kend, mref)
                                              : FN(ops_expsub)(ops, s, kend, mref);
            lsum[r] = l;
            if (Lse)
                Lse[r] = (REAL)fa_row_lse((double)mref, (double)l);
            if (W) {
                FN(scale_row)(s, kend, l == (REAL)0 ? (REAL)0 : (REAL)1 / l);
                if (kend < a->Lk)
                    memset(s + kend, 0, (size_t)(a->Lk - kend) * sizeof(REAL));
            }
        }
        if (direct)
            FN(ops_small_pv)(ops, m, dv, kend, S, lds, V, a->ldv, O, a->ldo);
        else
            FN(rm_gemm)('N', 'N', m, dv, kend, (REAL)1, S, lds, V, a->ldv, (REAL)0, O, a->ldo);
        /* without weights P was left unnormalised: divide the output rows instead */
        for (int64_t r = 0; r < m; r++)
            FN(finish_row)(O + r * a->ldo, dv, lsum[r], !W);
        return;
    }

    /* Streaming: key tiles with a running max and sum per query row; the
     * output rows themselves are the accumulator. */
    const int64_t bk = a->block_k;
    const int direct = FN(use_direct)(a);
    /* causal tiles with our products: each block of FA_PACK_ROWS query rows
     * only computes and combines the keys its last row may see */
    int64_t *Lim = direct && a->causal ? (int64_t *)scratch : NULL;
    REAL *S = scratch + FN(lim_elems)(a);  /* m x bk */
    REAL *Mx = S + m * bk;             /* running max */
    REAL *Ls = Mx + m;                 /* running sum */
    REAL *kp = Ls + m;                 /* packed scale * K^T tile (direct) */
    REAL *vp = kp + FA_PACK_ROUND(bk) * a->d;  /* packed V tile (direct) */
    for (int64_t r = 0; r < m; r++) {
        Mx[r] = (REAL)(-INFINITY);
        Ls[r] = (REAL)0;
    }
    int started = 0;
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        if (fa_stop_poll_check(poll, slot))
            return;
        int64_t n = kend - j0 < bk ? kend - j0 : bk;
        if (mb && fa_tile_masked_out(mb, a->ldm, i0, m, j0, n))
            continue;
        if (mb && a->ldm == 0) {
            /* one key mask for every query (padding): the tile ends at its
             * last allowed key */
            while (n > 0 && !mb[j0 + n - 1])
                n--;
        }
        if (Lim) {
            for (int64_t r0 = 0; r0 < m; r0 += FA_PACK_ROWS) {
                int64_t last = r0 + FA_PACK_ROWS - 1 < m - 1 ? r0 + FA_PACK_ROWS - 1 : m - 1;
                int64_t c = i0 + last + a->causal_offset - j0 + 1;
                Lim[r0 / FA_PACK_ROWS] = c < 0 ? 0 : c > n ? n : c;
            }
        }
        if (direct) {
            FN(ops_pack_kt)(ops, n, a->d, scale, K + j0 * a->ldk, a->ldk, kp);
            FN(ops_gemm_pb)(ops, m, n, a->d, Q, a->ldq, kp, S, bk, 0, Lim, 0);
        } else {
            FN(rm_gemm)('N', 'T', m, n, a->d, scale, Q, a->ldq, K + j0 * a->ldk, a->ldk,
                        (REAL)0, S, bk);
        }
        for (int64_t r = 0; r < m; r++) {
            REAL *s = S + r * bk;
            int64_t nu = Lim ? Lim[r / FA_PACK_ROWS] : n;  /* columns this row's block uses */
            int64_t na = nu;                               /* of which this row may see */
            if (a->causal) {
                int64_t c = i0 + r + a->causal_offset - j0 + 1;
                na = c < 0 ? 0 : c < nu ? c : nu;
            }
            /* the causally forbidden columns become exact zeros after the
             * exponentials (not -inf before: exp's slow path) */
            FN(mask_row)(a, ops, mb, bb, s, i0 + r, j0, na);
            REAL tmax = FN(ops_rowmax)(ops, s, na);
            REAL mold = Mx[r];
            REAL mnew = tmax > mold ? tmax : mold;
            if (started && mnew > mold) {
                REAL alpha = (REAL)FN(expo)(mold - mnew);
                Ls[r] *= alpha;
                FN(scale_row)(O + r * a->ldo, dv, alpha);
            }
            Mx[r] = mnew;
            REAL mref = mnew == (REAL)(-INFINITY) ? (REAL)0 : mnew;
            Ls[r] += (mb || bb) ? FN(ops_expsub_masked)(ops, s, na, mref)
                                : FN(ops_expsub)(ops, s, na, mref);
            if (na < nu)
                memset(s + na, 0, (size_t)(nu - na) * sizeof(REAL));
        }
        if (direct) {
            FN(ops_pack_v)(ops, n, dv, V + j0 * a->ldv, a->ldv, vp);
            FN(ops_gemm_pb)(ops, m, dv, n, S, bk, vp, O, a->ldo, started, Lim, 1);
        } else {
            FN(rm_gemm)('N', 'N', m, dv, n, (REAL)1, S, bk, V + j0 * a->ldv, a->ldv,
                        started ? (REAL)1 : (REAL)0, O, a->ldo);
        }
        started = 1;
    }
    if (!started) {
        for (int64_t r = 0; r < m; r++) {
            memset(O + r * a->ldo, 0, (size_t)dv * sizeof(REAL));
            if (Lse)
                Lse[r] = (REAL)(-INFINITY);
        }
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        FN(finish_row)(O + r * a->ldo, dv, Ls[r], 1);
        if (Lse)
            Lse[r] = (REAL)fa_row_lse(Mx[r] == (REAL)(-INFINITY) ? 0.0 : (double)Mx[r],
                                      (double)Ls[r]);
    }
}

/* 1 when every size and leading dimension the BLAS calls of this call can see
 * fits BLAS's int: M <= block_q, N and K <= Lk, d, dv (or block_k), and the
 * row strides of q, k, v, out, weights and the scratch (<= Lk or block_k). */
static int FN(blas_sizes_ok)(const fa_sdpa_args *a)
{
    return fa_blas_fits(a->block_q) && fa_blas_fits(a->Lk) && fa_blas_fits(a->d)
           && fa_blas_fits(a->dv) && (a->path != FA_PATH_STREAM || fa_blas_fits(a->block_k))
           && fa_blas_fits(a->ldq) && fa_blas_fits(a->ldk) && fa_blas_fits(a->ldv)
           && fa_blas_fits(a->ldo) && (!a->weights || fa_blas_fits(a->ldw));
}

/* Scratch elements one task needs. */
static int64_t FN(scratch_elems)(const fa_sdpa_args *a)
{
    int64_t m = a->block_q;
    /* K^T for the direct products (not needed by their few-rows form) */
    int64_t kt = FN(use_direct)(a) && a->path == FA_PATH_SINGLE && m > FA_SMALL_QK_DOT_ROWS
                     ? a->d * a->Lk : 0;
    if (a->weights)
        return m + kt;                 /* scores go straight into the weights: just l */
    if (a->path == FA_PATH_SINGLE) {
        return m * a->Lk + m + kt;     /* scores and l */
    }
    if (FN(use_direct)(a))         /* tile, max, sum, packed K^T and V tiles */
        return FN(lim_elems)(a) + m * a->block_k + 2 * m + FA_PACK_ROUND(a->block_k) * a->d
               + a->block_k * FA_PACK_ROUND(a->dv);
    return m * a->block_k + 2 * m;
}

typedef struct {
    const fa_sdpa_args *a;
    const fa_rowops *ops;
    int64_t nqb;
    size_t need;
    int reverse;
    int status;            /* atomic: FA_ENOMEM when a thread could not get scratch */
    fa_stop_poll poll;     /* a->stop, asked between tasks and key tiles */
} FN(job);

static void FN(run_task)(void *ctx, int64_t t, int slot)
{
    FN(job) *j = (FN(job) *)ctx;
    const fa_sdpa_args *a = j->a;
    if (fa_stop_poll_stopped(&j->poll))
        return;
    REAL *scratch = (REAL *)fa_arena(j->need);
    if (j->need && !scratch) {
        __atomic_store_n(&j->status, FA_ENOMEM, __ATOMIC_RELAXED);
        return;
    }
    int64_t b = t / j->nqb, qb = t % j->nqb;
    if (j->reverse)
        qb = j->nqb - 1 - qb;
    int64_t i0 = qb * a->block_q;
    int64_t m = a->Lq - i0 < a->block_q ? a->Lq - i0 : a->block_q;
    FN(task)(a, j->ops, b, i0, m, scratch, &j->poll, slot);
}

int FN(fa_sdpa)(const fa_sdpa_args *a)
{
    if ((a->path != FA_PATH_SINGLE && a->path != FA_PATH_STREAM)
        || (!GEMM && !FN(use_direct)(a)) || a->block_q < 1 || a->n_threads < 1 || (a->path == FA_PATH_STREAM && a->block_k < 1))
        return FA_EINVAL;
    if (!FN(use_direct)(a) && !FN(blas_sizes_ok)(a))
        return FA_EINVAL;   /* BLAS takes 32-bit ints: never truncate a size */
    int64_t nbatch = 1;
    for (int i = 0; i < a->nbatch; i++)
        nbatch *= a->batch_shape[i];
    FN(job) j;
    j.a = a;
    j.ops = fa_get_rowops();
    j.nqb = (a->Lq + a->block_q - 1) / a->block_q;
    j.need = (size_t)FN(scratch_elems)(a) * sizeof(REAL);
    /* with causality, later query blocks carry more work: hand them out first */
    j.reverse = a->causal;
    j.status = FA_OK;
    fa_stop_poll_init(&j.poll, a->stop, a->stop_ctx);
    const int64_t ntasks = nbatch * j.nqb;
    if (ntasks == 0)
        return FA_OK;
    int nt = a->n_threads;
    if (nt > ntasks)
        nt = (int)ntasks;
    /* BLAS is held at one thread whenever it runs: our threads (or the app's,
     * calling concurrently) each call it on their own tiles */
    fa_blas_set_threads_fn hook = FN(use_direct)(a) ? NULL : fa_blas_threads_enter();
    int stopped = fa_pool_run(ntasks, nt, FN(run_task), &j, a->stop ? fa_stop_poll_fn : NULL,
                              &j.poll);
    fa_blas_threads_exit(hook);
    if (stopped || fa_stop_poll_stopped(&j.poll))
        return FA_EINTR;
    return j.status;
}

#undef FN
#undef CAT
#undef CAT_
