/*
 * Register-blocked products for problems too small for a BLAS call to pay:
 *   S (m x n)  = scale * Q (m x d) . K (n x d)^T     (small_qk)
 *   O (m x dv) = P (m x n) . V (n x dv)              (small_pv)
 * AVX2/FMA, instantiated for float and double by fa_simd.c with VEC, W
 * (lanes) and the intrinsic names defined.  Two rows at a time share every
 * load of K (transposed into kt first) or V; the column-block width NC is a
 * compile-time constant in each instance so the accumulators stay in
 * registers.
 */


#ifndef FA_SMALL_DISPATCH
/* call F(NC, TWO) with both as compile-time constants */
#define FA_SMALL_DISPATCH(F, nc, two)                                   \
    do {                                                                \
        if (two) {                                                      \
            switch (nc) {                                               \
            case 4: F(4, 1); break;                                     \
            case 3: F(3, 1); break;                                     \
            case 2: F(2, 1); break;                                     \
            default: F(1, 1); break;                                    \
            }                                                           \
        } else {                                                        \
            switch (nc) {                                               \
            case 4: F(4, 0); break;                                     \
            case 3: F(3, 0); break;                                     \
            case 2: F(2, 0); break;                                     \
            default: F(1, 0); break;                                    \
            }                                                           \
        }                                                               \
    } while (0)
#endif

/* rows i, i+1 (TWO = 1) or i alone, columns [j0, j0 + NC*W) of S; one
 * function per (NC, TWO) so the accumulators live in registers */
#define QK_BLOCK(NC, TWO)                                                                 \
    AVX2 static void SM(qk_block_##NC##_##TWO)(int64_t d, int64_t np, int64_t n, VEC vs,   \
                                               const ELT *q0, const ELT *q1,             \
                                               const ELT *kt, ELT *s0, ELT *s1)          \
    {                                                                                    \
        VEC a0[4], a1[4];                                                                \
        for (int u = 0; u < NC; u++)                                                     \
            a0[u] = a1[u] = ZERO();                                                      \
        for (int64_t c = 0; c < d; c++) {                                                \
            const ELT *kr = kt + c * np;                                                 \
            VEC b0 = SET1(q0[c]);                                                        \
            VEC b1 = TWO ? SET1(q1[c]) : b0;                                             \
            for (int u = 0; u < NC; u++) {                                               \
                VEC kv = LOADU(kr + u * W);                                              \
                a0[u] = FMADD(b0, kv, a0[u]);                                            \
                if (TWO)                                                                 \
                    a1[u] = FMADD(b1, kv, a1[u]);                                        \
            }                                                                            \
        }                                                                                \
        for (int u = 0; u < NC; u++) {                                                   \
            SM(store_part)(s0 + u * W, MUL(a0[u], vs), n - u * W);                       \
            if (TWO)                                                                     \
                SM(store_part)(s1 + u * W, MUL(a1[u], vs), n - u * W);                   \
        }                                                                                \
    }
QK_BLOCK(1, 0) QK_BLOCK(2, 0) QK_BLOCK(3, 0) QK_BLOCK(4, 0)
QK_BLOCK(1, 1) QK_BLOCK(2, 1) QK_BLOCK(3, 1) QK_BLOCK(4, 1)
#undef QK_BLOCK

/* kt must hold d * round_up(n, W) elements. */
AVX2 static void SM(small_qk)(int64_t m, int64_t n, int64_t d, ELT scale,
                              const ELT *Q, int64_t ldq, const ELT *K, int64_t ldk,
                              ELT *S, int64_t lds, ELT *kt)
{
    const int64_t np = (n + W - 1) / W * W;
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < d; c++)
            kt[c * np + j] = K[j * ldk + c];
    for (int64_t j = n; j < np; j++)
        for (int64_t c = 0; c < d; c++)
            kt[c * np + j] = (ELT)0;
    const VEC vs = SET1(scale);
    for (int64_t j0 = 0; j0 < np; j0 += 4 * W) {
        const int nc = (int)((np - j0) / W < 4 ? (np - j0) / W : 4);
        const ELT *ktj = kt + j0;
        for (int64_t i = 0; i < m; i += 2) {
            int two = i + 1 < m;
            const ELT *q0 = Q + i * ldq, *q1 = two ? q0 + ldq : q0;
            ELT *s0 = S + i * lds + j0, *s1 = two ? s0 + lds : s0;
#define QK(NC, TWO) SM(qk_block_##NC##_##TWO)(d, np, n - j0, vs, q0, q1, ktj, s0, s1)
            FA_SMALL_DISPATCH(QK, nc, two);
#undef QK
        }
    }
}

/* rows i, i+1 (TWO = 1) or i alone, columns [c0, c0 + NC*W) of O; rem = dv - c0;
 * FULL: every column block is whole (no masked loads) */
#define PV_BLOCK(NC, TWO, FULL)                                                           \
    AVX2 static void SM(pv_block_##NC##_##TWO##_##FULL)(int64_t n, int64_t rem,            \
                                                       const ELT *p0, const ELT *p1,     \
                                                       const ELT *V, int64_t ldv,        \
                                                       ELT *o0, ELT *o1)                 \
    {                                                                                    \
        VEC a0[4], a1[4];                                                                \
        for (int u = 0; u < NC; u++)                                                     \
            a0[u] = a1[u] = ZERO();                                                      \
        for (int64_t j = 0; j < n; j++) {                                                \
            const ELT *vr = V + j * ldv;                                                 \
            VEC b0 = SET1(p0[j]);                                                        \
            VEC b1 = TWO ? SET1(p1[j]) : b0;                                             \
            for (int u = 0; u < NC; u++) {                                               \
                VEC vv = FULL ? LOADU(vr + u * W) : SM(load_part)(vr + u * W, rem - u * W); \
                a0[u] = FMADD(b0, vv, a0[u]);                                            \
                if (TWO)                                                                 \
                    a1[u] = FMADD(b1, vv, a1[u]);                                        \
            }                                                                            \
        }                                                                                \
        for (int u = 0; u < NC; u++) {                                                   \
            SM(store_part)(o0 + u * W, a0[u], rem - u * W);                              \
            if (TWO)                                                                     \
                SM(store_part)(o1 + u * W, a1[u], rem - u * W);                          \
        }                                                                                \
    }
PV_BLOCK(1, 0, 0) PV_BLOCK(2, 0, 0) PV_BLOCK(3, 0, 0) PV_BLOCK(4, 0, 0)
PV_BLOCK(1, 1, 0) PV_BLOCK(2, 1, 0) PV_BLOCK(3, 1, 0) PV_BLOCK(4, 1, 0)
PV_BLOCK(1, 0, 1) PV_BLOCK(2, 0, 1) PV_BLOCK(3, 0, 1) PV_BLOCK(4, 0, 1)
PV_BLOCK(1, 1, 1) PV_BLOCK(2, 1, 1) PV_BLOCK(3, 1, 1) PV_BLOCK(4, 1, 1)
#undef PV_BLOCK

AVX2 static void SM(small_pv)(int64_t m, int64_t dv, int64_t n, const ELT *P, int64_t ldp,
                              const ELT *V, int64_t ldv, ELT *O, int64_t ldo)
{
    for (int64_t c0 = 0; c0 < dv; c0 += 4 * W) {
        const int64_t rem = dv - c0;
        const int nc = (int)(rem >= 4 * W ? 4 : (rem + W - 1) / W);
        const int full = rem >= (int64_t)nc * W;
        for (int64_t i = 0; i < m; i += 2) {
            int two = i + 1 < m;
            const ELT *p0 = P + i * ldp, *p1 = two ? p0 + ldp : p0;
            ELT *o0 = O + i * ldo + c0, *o1 = two ? o0 + ldo : o0;
#define PVF(NC, TWO) SM(pv_block_##NC##_##TWO##_1)(n, rem, p0, p1, V + c0, ldv, o0, o1)
#define PVP(NC, TWO) SM(pv_block_##NC##_##TWO##_0)(n, rem, p0, p1, V + c0, ldv, o0, o1)
            if (full)
                FA_SMALL_DISPATCH(PVF, nc, two);
            else
                FA_SMALL_DISPATCH(PVP, nc, two);
#undef PVF
#undef PVP
        }
    }
}

