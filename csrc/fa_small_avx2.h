/*
 * Register-blocked products that replace BLAS calls where their fixed cost
 * (call, packing, zeroing C) dominates or whose shapes BLAS handles badly:
 *   S (m x n)  = scale * Q (m x d) . K (n x d)^T     (small_qk)
 *   O (m x dv) = P (m x n) . V (n x dv)              (small_pv)
 * AVX2/FMA, instantiated for float and double by fa_simd.c with VEC, W
 * (lanes) and the intrinsic names defined.  No packing: both read their
 * operands in place.  Each block keeps 12 accumulators in registers, enough
 * independent FMAs to hide their latency:
 *   small_pv: 6 rows x 2 vectors of output columns (broadcast P, load V);
 *   small_qk: the same kernel against K^T, transposed into scratch first.
 * Edge blocks repeat the last valid row/key pointer and store only what is
 * valid.
 */

/* O rows p0..p5 x columns [0, 2W) of the block starting at V; rem = columns
 * left in the row from here (>= 2W when FULL). */
#define PV_6X2(NAME, FULL)                                                                \
    SMT static void SM(NAME)(int64_t n, int64_t rem, const ELT *const *p,                \
                              const ELT *V, int64_t ldv, ELT *O, int64_t ldo, int nrows)  \
    {                                                                                     \
        VEC a00 = ZERO(), a01 = ZERO(), a10 = ZERO(), a11 = ZERO();                       \
        VEC a20 = ZERO(), a21 = ZERO(), a30 = ZERO(), a31 = ZERO();                       \
        VEC a40 = ZERO(), a41 = ZERO(), a50 = ZERO(), a51 = ZERO();                       \
        const ELT *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3], *p4 = p[4], *p5 = p[5]; \
        for (int64_t j = 0; j < n; j++) {                                                 \
            const ELT *vr = V + j * ldv;                                                  \
            VEC v0 = FULL ? LOADU(vr) : SM(load_part)(vr, rem);                           \
            VEC v1 = FULL ? LOADU(vr + W) : SM(load_part)(vr + W, rem - W);               \
            VEC b = SET1(p0[j]);                                                          \
            a00 = FMADD(b, v0, a00); a01 = FMADD(b, v1, a01);                             \
            b = SET1(p1[j]);                                                              \
            a10 = FMADD(b, v0, a10); a11 = FMADD(b, v1, a11);                             \
            b = SET1(p2[j]);                                                              \
            a20 = FMADD(b, v0, a20); a21 = FMADD(b, v1, a21);                             \
            b = SET1(p3[j]);                                                              \
            a30 = FMADD(b, v0, a30); a31 = FMADD(b, v1, a31);                             \
            b = SET1(p4[j]);                                                              \
            a40 = FMADD(b, v0, a40); a41 = FMADD(b, v1, a41);                             \
            b = SET1(p5[j]);                                                              \
            a50 = FMADD(b, v0, a50); a51 = FMADD(b, v1, a51);                             \
        }                                                                                 \
        VEC acc[12] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};       \
        for (int r = 0; r < nrows; r++) {                                                 \
            SM(store_part)(O + r * ldo, acc[2 * r], rem);                                 \
            SM(store_part)(O + r * ldo + W, acc[2 * r + 1], rem - W);                     \
        }                                                                                 \
    }
PV_6X2(pv_6x2_full, 1)
PV_6X2(pv_6x2_part, 0)
#undef PV_6X2

/* One output row x 4 vectors of columns [0, 4W) (fewer when rem < 4W), with
 * even and odd keys in separate accumulators to hide FMA latency. */
SMT static void SM(pv_1x4)(int64_t n, int64_t rem, const ELT *p0, const ELT *V, int64_t ldv,
                            ELT *O)
{
    VEC a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO();
    VEC b0 = ZERO(), b1 = ZERO(), b2 = ZERO(), b3 = ZERO();
    int64_t j = 0;
    if (rem >= 4 * W) {
        for (; j + 2 <= n; j += 2) {
            const ELT *v = V + j * ldv, *u = v + ldv;
            VEC x = SET1(p0[j]), y = SET1(p0[j + 1]);
            a0 = FMADD(x, LOADU(v), a0); a1 = FMADD(x, LOADU(v + W), a1);
            a2 = FMADD(x, LOADU(v + 2 * W), a2); a3 = FMADD(x, LOADU(v + 3 * W), a3);
            b0 = FMADD(y, LOADU(u), b0); b1 = FMADD(y, LOADU(u + W), b1);
            b2 = FMADD(y, LOADU(u + 2 * W), b2); b3 = FMADD(y, LOADU(u + 3 * W), b3);
        }
    }
    for (; j < n; j++) {
        const ELT *v = V + j * ldv;
        VEC x = SET1(p0[j]);
        a0 = FMADD(x, SM(load_part)(v, rem), a0);
        a1 = FMADD(x, SM(load_part)(v + W, rem - W), a1);
        a2 = FMADD(x, SM(load_part)(v + 2 * W, rem - 2 * W), a2);
        a3 = FMADD(x, SM(load_part)(v + 3 * W, rem - 3 * W), a3);
    }
    SM(store_part)(O, ADD(a0, b0), rem);
    SM(store_part)(O + W, ADD(a1, b1), rem - W);
    SM(store_part)(O + 2 * W, ADD(a2, b2), rem - 2 * W);
    SM(store_part)(O + 3 * W, ADD(a3, b3), rem - 3 * W);
}

/* Two output rows x 4 vectors of columns [0, 4W) (fewer when rem < 4W): for
 * few rows, where 6-row blocks would mostly repeat rows. */
SMT static void SM(pv_2x4)(int64_t n, int64_t rem, const ELT *p0, const ELT *p1,
                            const ELT *V, int64_t ldv, ELT *O, int64_t ldo, int second)
{
    VEC a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO();
    VEC b0 = ZERO(), b1 = ZERO(), b2 = ZERO(), b3 = ZERO();
    if (rem >= 4 * W) {
        for (int64_t j = 0; j < n; j++) {
            const ELT *v = V + j * ldv;
            VEC x = SET1(p0[j]), y = SET1(p1[j]);
            VEC v0 = LOADU(v), v1 = LOADU(v + W), v2 = LOADU(v + 2 * W), v3 = LOADU(v + 3 * W);
            a0 = FMADD(x, v0, a0); a1 = FMADD(x, v1, a1); a2 = FMADD(x, v2, a2); a3 = FMADD(x, v3, a3);
            b0 = FMADD(y, v0, b0); b1 = FMADD(y, v1, b1); b2 = FMADD(y, v2, b2); b3 = FMADD(y, v3, b3);
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            const ELT *v = V + j * ldv;
            VEC x = SET1(p0[j]), y = SET1(p1[j]);
            VEC v0 = SM(load_part)(v, rem), v1 = SM(load_part)(v + W, rem - W);
            VEC v2 = SM(load_part)(v + 2 * W, rem - 2 * W), v3 = SM(load_part)(v + 3 * W, rem - 3 * W);
            a0 = FMADD(x, v0, a0); a1 = FMADD(x, v1, a1); a2 = FMADD(x, v2, a2); a3 = FMADD(x, v3, a3);
            b0 = FMADD(y, v0, b0); b1 = FMADD(y, v1, b1); b2 = FMADD(y, v2, b2); b3 = FMADD(y, v3, b3);
        }
    }
    SM(store_part)(O, a0, rem);
    SM(store_part)(O + W, a1, rem - W);
    SM(store_part)(O + 2 * W, a2, rem - 2 * W);
    SM(store_part)(O + 3 * W, a3, rem - 3 * W);
    if (second) {
        SM(store_part)(O + ldo, b0, rem);
        SM(store_part)(O + ldo + W, b1, rem - W);
        SM(store_part)(O + ldo + 2 * W, b2, rem - 2 * W);
        SM(store_part)(O + ldo + 3 * W, b3, rem - 3 * W);
    }
}

SMT static void SM(small_pv)(int64_t m, int64_t dv, int64_t n, const ELT *P, int64_t ldp,
                              const ELT *V, int64_t ldv, ELT *O, int64_t ldo)
{
    int64_t i = 0;
    if (m <= 16) {  /* few rows: pairs of rows, 4 vectors wide */
        for (; i < m; i += 2) {
            int second = i + 1 < m;
            const ELT *p0 = P + i * ldp, *p1 = second ? p0 + ldp : p0;
            for (int64_t c0 = 0; c0 < dv; c0 += 4 * W)
                SM(pv_2x4)(n, dv - c0, p0, p1, V + c0, ldv, O + i * ldo + c0, ldo, second);
        }
        return;
    }
    /* blocks of 6 rows; a last block of 3-5 rows repeats its first row */
    for (; i + 3 <= m; i += 6) {
        int nr = m - i < 6 ? (int)(m - i) : 6;
        const ELT *p[6];
        for (int r = 0; r < 6; r++)
            p[r] = P + (i + (r < nr ? r : 0)) * ldp;
        for (int64_t c0 = 0; c0 < dv; c0 += 2 * W) {
            int64_t rem = dv - c0;
            if (rem >= 2 * W)
                SM(pv_6x2_full)(n, rem, p, V + c0, ldv, O + i * ldo + c0, ldo, nr);
            else
                SM(pv_6x2_part)(n, rem, p, V + c0, ldv, O + i * ldo + c0, ldo, nr);
        }
    }
    for (; i < m; i++)  /* the last one or two rows one at a time */
        for (int64_t c0 = 0; c0 < dv; c0 += 4 * W)
            SM(pv_1x4)(n, dv - c0, P + i * ldp, V + c0, ldv, O + i * ldo + c0);
}

/* Dot-product form for few query rows (<= FA_SMALL_QK_DOT_ROWS), where transposing K costs
 * more than it saves: 2 rows x 4 keys, one horizontal reduction per block. */
SMT static void SM(qk_2x4)(int64_t d, const ELT *q0, const ELT *q1, const ELT *k0,
                            const ELT *k1, const ELT *k2, const ELT *k3, ELT scale,
                            ELT *s0, ELT *s1, int nkeys, int second)
{
    VEC a00 = ZERO(), a01 = ZERO(), a02 = ZERO(), a03 = ZERO();
    VEC a10 = ZERO(), a11 = ZERO(), a12 = ZERO(), a13 = ZERO();
#define QK2_STEP(LOAD)                                                    \
    do {                                                                  \
        VEC x0 = LOAD(q0 + c), x1 = LOAD(q1 + c);                         \
        VEC y = LOAD(k0 + c);                                             \
        a00 = FMADD(x0, y, a00); a10 = FMADD(x1, y, a10);                 \
        y = LOAD(k1 + c);                                                 \
        a01 = FMADD(x0, y, a01); a11 = FMADD(x1, y, a11);                 \
        y = LOAD(k2 + c);                                                 \
        a02 = FMADD(x0, y, a02); a12 = FMADD(x1, y, a12);                 \
        y = LOAD(k3 + c);                                                 \
        a03 = FMADD(x0, y, a03); a13 = FMADD(x1, y, a13);                 \
    } while (0)
    int64_t c = 0;
    for (; c + W <= d; c += W)
        QK2_STEP(LOADU);
    if (c < d) {
        const int64_t r = d - c;
#define LOADP(p) SM(load_part)(p, r)
        QK2_STEP(LOADP);
#undef LOADP
    }
#undef QK2_STEP
    SM(store4)(s0, SM(hsum4)(a00, a01, a02, a03), scale, nkeys);
    if (second)
        SM(store4)(s1, SM(hsum4)(a10, a11, a12, a13), scale, nkeys);
}

/* kt (d x n, row stride n) = scale * K^T for K (n x d, ldk): W x W blocks
 * through registers, scalar edges. */
SMT static void SM(transpose_scaled)(int64_t n, int64_t d, ELT scale, const ELT *K,
                                      int64_t ldk, ELT *kt)
{
    const VEC vs = SET1(scale);
    int64_t j = 0;
    for (; j + W <= n; j += W) {
        int64_t c = 0;
        for (; c + W <= d; c += W)
            SM(transpose_block)(K + j * ldk + c, ldk, kt + c * n + j, n, vs);
        for (; c < d; c++)
            for (int64_t r = 0; r < W; r++)
                kt[c * n + j + r] = scale * K[(j + r) * ldk + c];
    }
    for (; j < n; j++)
        for (int64_t c = 0; c < d; c++)
            kt[c * n + j] = scale * K[j * ldk + c];
}

/* S = scale * Q . K^T as a P.V-shaped product against K^T, transposed (and
 * scaled) into kt first: no horizontal reductions in the inner loop. */
SMT static void SM(small_qk)(int64_t m, int64_t n, int64_t d, ELT scale,
                              const ELT *Q, int64_t ldq, const ELT *K, int64_t ldk,
                              ELT *S, int64_t lds, ELT *kt)
{
    if (m <= FA_SMALL_QK_DOT_ROWS) {
        for (int64_t i = 0; i < m; i += 2) {
            int second = i + 1 < m;
            const ELT *q0 = Q + i * ldq, *q1 = second ? q0 + ldq : q0;
            for (int64_t j = 0; j < n; j += 4) {
                int nk = n - j < 4 ? (int)(n - j) : 4;
                const ELT *k0 = K + j * ldk;
                SM(qk_2x4)(d, q0, q1, k0, nk > 1 ? k0 + ldk : k0, nk > 2 ? k0 + 2 * ldk : k0,
                           nk > 3 ? k0 + 3 * ldk : k0, scale, S + i * lds + j,
                           S + (i + 1) * lds + j, nk, second);
            }
        }
        return;
    }
    SM(transpose_scaled)(n, d, scale, K, ldk, kt);
    SM(small_pv)(m, n, d, Q, ldq, kt, n, S, lds);
}

/* ---- Packed right-hand operands and the product against them ----
 * The streaming kernel's tiles are multiplied against panels of PW = 2W
 * columns stored contiguously (k rows x PW, zero padded past the last
 * column).  Reading a panel is then sequential, whatever the leading
 * dimension of the source: unpacked, the 16 columns of K^T or V at a
 * power-of-two stride map onto a few L1 sets and evict each other. */
#define PW (2 * W)

/* kp = scale * K^T in panels of PW keys: kp[p][c][jj] = scale * K[p*PW + jj][c]. */
SMT static void SM(pack_kt)(int64_t n, int64_t d, ELT scale, const ELT *K, int64_t ldk,
                             ELT *kp)
{
    const VEC vs = SET1(scale);
    for (int64_t p0 = 0; p0 < n; p0 += PW) {
        ELT *panel = kp + p0 * d;  /* (p0 / PW) * d * PW */
        for (int64_t h = 0; h < PW; h += W) {
            int64_t j = p0 + h;
            int64_t c = 0;
            if (j >= n) {  /* a panel's padding half: zeros (no scalar loop) */
                for (; c < d; c++)
                    STOREU(panel + c * PW + h, ZERO());
                continue;
            }
            if (j + W <= n)
                for (; c + W <= d; c += W)
                    SM(transpose_block)(K + j * ldk + c, ldk, panel + c * PW + h, PW, vs);
            for (; c < d; c++)
                for (int64_t r = 0; r < W; r++)
                    panel[c * PW + h + r] = j + r < n ? scale * K[(j + r) * ldk + c] : (ELT)0;
        }
    }
}

/* vp = V in panels of PW columns: vp[p][j][cc] = V[j][p*PW + cc]. */
SMT static void SM(pack_v)(int64_t n, int64_t dv, const ELT *V, int64_t ldv, ELT *vp)
{
    for (int64_t p0 = 0; p0 < dv; p0 += PW) {
        ELT *panel = vp + p0 * n;
        int64_t rem = dv - p0;
        const ELT *src = V + p0;
        if (rem >= PW) {
            for (int64_t j = 0; j < n; j++) {
                _Pragma("GCC unroll 2")
                for (int h = 0; h < PW; h += W)
                    STOREU(panel + j * PW + h, LOADU(src + j * ldv + h));
            }
        } else {
            for (int64_t j = 0; j < n; j++) {
                STOREU(panel + j * PW, SM(load_part)(src + j * ldv, rem));
                STOREU(panel + j * PW + W, SM(load_part)(src + j * ldv + W, rem - W));
            }
        }
    }
}

/* C rows (up to 6) x one panel: C (+)= A . Bpanel over k.  With acc the
 * product is summed from zero and then added to C (not summed onto C): the
 * streaming kernel's output rows are then a sum of per-tile sums, whose
 * rounding error grows with the tile length, not with the whole key length
 * (one sequential chain over 2048 keys had 1.6x torch's rms error). */
SMT static inline void SM(pb_6x2)(int64_t k, const ELT *b, const ELT *const *p, ELT *C,
                                   int64_t ldc, int nrows, int64_t rem, int acc)
{
    VEC a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
    a00 = a01 = a10 = a11 = a20 = a21 = ZERO();
    a30 = a31 = a40 = a41 = a50 = a51 = ZERO();
    const ELT *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3], *p4 = p[4], *p5 = p[5];
    for (int64_t j = 0; j < k; j++) {
        VEC v0 = LOADU(b + j * PW), v1 = LOADU(b + j * PW + W);
        VEC x = SET1(p0[j]);
        a00 = FMADD(x, v0, a00); a01 = FMADD(x, v1, a01);
        x = SET1(p1[j]);
        a10 = FMADD(x, v0, a10); a11 = FMADD(x, v1, a11);
        x = SET1(p2[j]);
        a20 = FMADD(x, v0, a20); a21 = FMADD(x, v1, a21);
        x = SET1(p3[j]);
        a30 = FMADD(x, v0, a30); a31 = FMADD(x, v1, a31);
        x = SET1(p4[j]);
        a40 = FMADD(x, v0, a40); a41 = FMADD(x, v1, a41);
        x = SET1(p5[j]);
        a50 = FMADD(x, v0, a50); a51 = FMADD(x, v1, a51);
    }
    VEC r[12] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};
    if (nrows == 6 && rem >= PW) {   /* the common block: plain stores, no spill */
        _Pragma("GCC unroll 6")
        for (int i = 0; i < 6; i++) {
            VEC lo = r[2 * i], hi = r[2 * i + 1];
            if (acc) {
                lo = ADD(lo, LOADU(C + i * ldc));
                hi = ADD(hi, LOADU(C + i * ldc + W));
            }
            STOREU(C + i * ldc, lo);
            STOREU(C + i * ldc + W, hi);
        }
        return;
    }
    for (int i = 0; i < nrows; i++) {
        VEC lo = r[2 * i], hi = r[2 * i + 1];
        if (acc) {
            lo = ADD(lo, SM(load_part)(C + i * ldc, rem));
            hi = ADD(hi, SM(load_part)(C + i * ldc + W, rem - W));
        }
        SM(store_part)(C + i * ldc, lo, rem);
        SM(store_part)(C + i * ldc + W, hi, rem - W);
    }
}

/* pb_6x2 for a panel with at most W valid columns (rem <= W): only its first
 * vector of columns is multiplied (the padding half is never read).  Each
 * output is the same sequential FMA chain over k as pb_6x2's: the same bits. */
SMT static inline void SM(pb_6x1)(int64_t k, const ELT *b, const ELT *const *p, ELT *C,
                                   int64_t ldc, int nrows, int64_t rem, int acc)
{
    VEC a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO(), a4 = ZERO(), a5 = ZERO();
    const ELT *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3], *p4 = p[4], *p5 = p[5];
    for (int64_t j = 0; j < k; j++) {
        VEC v0 = LOADU(b + j * PW);
        a0 = FMADD(SET1(p0[j]), v0, a0);
        a1 = FMADD(SET1(p1[j]), v0, a1);
        a2 = FMADD(SET1(p2[j]), v0, a2);
        a3 = FMADD(SET1(p3[j]), v0, a3);
        a4 = FMADD(SET1(p4[j]), v0, a4);
        a5 = FMADD(SET1(p5[j]), v0, a5);
    }
    VEC r[6] = {a0, a1, a2, a3, a4, a5};
    for (int i = 0; i < nrows; i++) {
        VEC lo = r[i];
        if (acc)
            lo = ADD(lo, SM(load_part)(C + i * ldc, rem));
        SM(store_part)(C + i * ldc, lo, rem);
    }
}

#ifdef SM_ROWS8
/* pb_8x2 for a panel with at most W valid columns (rem <= W), as pb_6x1. */
SMT static inline void SM(pb_8x1)(int64_t k, const ELT *b, const ELT *A, int64_t lda, ELT *C,
                                   int64_t ldc, int64_t rem, int acc)
{
    VEC a[8];
    const ELT *p[8];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < 8; r++) {
        a[r] = ZERO();
        p[r] = A + r * lda;
    }
    for (int64_t j = 0; j < k; j++) {
        VEC v0 = LOADU(b + j * PW);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; r++)
            a[r] = FMADD(SET1(p[r][j]), v0, a[r]);
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < 8; r++) {
        VEC lo = a[r];
        if (acc)
            lo = ADD(lo, SM(load_part)(C + r * ldc, rem));
        SM(store_part)(C + r * ldc, lo, rem);
    }
}
#endif

#ifdef SM_ROWS8
/* 8 whole rows x one panel, for 32-register (AVX-512) CPUs: 16 accumulators
 * halve the panel loads per FMA, and 8 rows divide the usual tile heights.
 * Every output is the same sequential FMA chain over k as pb_6x2's, so the
 * same bits. */
SMT static inline void SM(pb_8x2)(int64_t k, const ELT *b, const ELT *A, int64_t lda, ELT *C,
                                   int64_t ldc, int64_t rem, int acc)
{
    VEC a[8][2];
    const ELT *p[8];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < 8; r++) {
        a[r][0] = a[r][1] = ZERO();
        p[r] = A + r * lda;
    }
    for (int64_t j = 0; j < k; j++) {
        VEC v0 = LOADU(b + j * PW), v1 = LOADU(b + j * PW + W);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; r++) {
            VEC x = SET1(p[r][j]);
            a[r][0] = FMADD(x, v0, a[r][0]);
            a[r][1] = FMADD(x, v1, a[r][1]);
        }
    }
    if (rem >= PW) {
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; r++) {
            VEC lo = a[r][0], hi = a[r][1];
            if (acc) {
                lo = ADD(lo, LOADU(C + r * ldc));
                hi = ADD(hi, LOADU(C + r * ldc + W));
            }
            STOREU(C + r * ldc, lo);
            STOREU(C + r * ldc + W, hi);
        }
    } else {
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; r++) {
            VEC lo = a[r][0], hi = a[r][1];
            if (acc) {
                lo = ADD(lo, SM(load_part)(C + r * ldc, rem));
                hi = ADD(hi, SM(load_part)(C + r * ldc + W, rem - W));
            }
            SM(store_part)(C + r * ldc, lo, rem);
            SM(store_part)(C + r * ldc + W, hi, rem - W);
        }
    }
}
#endif

/* C (m x ncols, ldc) = A (m x k, lda) . B, or += when acc, for B packed in
 * panels of PW columns (pack_kt / pack_v).  Panels outer: one panel stays in
 * L1 while every row block of A passes over it.  lim (NULL: none) limits row
 * block r (rows 6r..6r+5) to its first lim[r] columns, or with lim_k to its
 * first lim[r] terms of the inner dimension (causal tiles). */
SMT static void SM(gemm_pb)(int64_t m, int64_t ncols, int64_t k, const ELT *A, int64_t lda,
                             const ELT *Bp, ELT *C, int64_t ldc, int acc, const int64_t *lim,
                             int lim_k)
{
    for (int64_t p0 = 0; p0 < ncols; p0 += PW) {
        const ELT *b = Bp + p0 * k;
        int64_t rem = ncols - p0;
        int64_t i = 0;
#ifdef SM_ROWS8
        if (!lim) {  /* lim is kept per block of 6 rows (FA_PACK_ROWS) */
            if (rem <= W)
                for (; i + 8 <= m; i += 8)
                    SM(pb_8x1)(k, b, A + i * lda, lda, C + i * ldc + p0, ldc, rem, acc);
            else
                for (; i + 8 <= m; i += 8)
                    SM(pb_8x2)(k, b, A + i * lda, lda, C + i * ldc + p0, ldc, rem, acc);
        }
#endif
        for (; i < m; i += 6) {
            int64_t kk = k;
            if (lim) {
                int64_t l = lim[i / 6];
                if (lim_k) {
                    kk = l < k ? l : k;
                } else if (l <= p0) {
                    continue;
                }
            }
            int nr = m - i < 6 ? (int)(m - i) : 6;
            const ELT *p[6];
            for (int r = 0; r < 6; r++)
                p[r] = A + (i + (r < nr ? r : 0)) * lda;
            if (rem <= W)
                SM(pb_6x1)(kk, b, p, C + i * ldc + p0, ldc, nr, rem, acc);
            else
                SM(pb_6x2)(kk, b, p, C + i * ldc + p0, ldc, nr, rem, acc);
        }
    }
}
#undef PW
