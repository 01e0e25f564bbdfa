/*
 * Vectorised exp (AVX2/FMA) shared by fa_simd.c and fa_additive.c: the
 * includer defines AVX2 (the target attribute) and includes <immintrin.h>.
 * float: <= 2 ulp over the softmax range (measured 0.98), double: <= 1 ulp
 * (tests/kernels/test_exp.py); exact 0 for -inf, NaN propagates.
 */
#ifndef FA_EXP_AVX2_H
#define FA_EXP_AVX2_H

/* exp(r) for |r| <= ln2/2 as 1 + r + r^2 * P(r), P of degree 4: coefficients
 * fitted for least maximum relative error (3.1e-9, far below float32's
 * rounding; the float32 evaluation keeps the result within 2 ulp -- tests/kernels/test_exp.py) */
AVX2 static inline __m256 exp8_poly_f32(__m256 r)
{
    __m256 p = _mm256_set1_ps(1.381461275741458e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.368710055947304e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166838899254799e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666652113199234e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.999999403953552e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    return _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
}

/* nonpos: the caller guarantees x <= 0 or NaN (scores minus their row max),
 * which drops the upper clamp and the overflow test. */
AVX2 static inline __m256 exp8_any_f32(__m256 x, const int nonpos)
{
    const __m256 lo = _mm256_set1_ps(-110.0f);
    const __m256 hi = _mm256_set1_ps(89.0f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
    const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 magic = _mm256_set1_ps(12582912.0f); /* 1.5 * 2^23 */
    /* max/min with the constant first: a NaN x is returned unchanged */
    x = _mm256_max_ps(lo, x);
    if (!nonpos)
        x = _mm256_min_ps(hi, x);
    /* n = nearest integer to x / ln2, read off the low mantissa bits of t */
    __m256 t = _mm256_fmadd_ps(x, log2e, magic);
    __m256 n = _mm256_sub_ps(t, magic);
    __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
    __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
    r = _mm256_fnmadd_ps(n, ln2_lo, r);
    __m256 e = exp8_poly_f32(r);
    /* 2^n: one multiply while it is a normal number (the usual case) */
    __m256i out = _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), ni);
    if (!nonpos)
        out = _mm256_or_si256(out, _mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127)));
    if (_mm256_testz_si256(out, out))
        return _mm256_mul_ps(e, _mm256_castsi256_ps(
                                    _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23)));
    /* subnormal results or overflow: 2^n1 * 2^n2, each normal, one rounding */
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(e, s1), s2);
}

AVX2 static inline __m256 exp8_f32(__m256 x) { return exp8_any_f32(x, 0); }
AVX2 static inline __m256 exp8_nonpos_f32(__m256 x) { return exp8_any_f32(x, 1); }

AVX2 static inline __m256d exp4_f64(__m256d x)
{
    const __m256d lo = _mm256_set1_pd(-750.0);
    const __m256d hi = _mm256_set1_pd(710.0);
    const __m256d log2e = _mm256_set1_pd(1.4426950408889634074);
    const __m256d ln2_hi = _mm256_set1_pd(6.93147180369123816490e-01);
    const __m256d ln2_lo = _mm256_set1_pd(1.90821492927058770002e-10);
    const __m256d magic = _mm256_set1_pd(6755399441055744.0); /* 1.5 * 2^52 */
    x = _mm256_min_pd(hi, _mm256_max_pd(lo, x));
    __m256d t = _mm256_fmadd_pd(x, log2e, magic);
    __m256d n = _mm256_sub_pd(t, magic);
    __m256i ni = _mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_castpd_si256(magic));
    __m256d r = _mm256_fnmadd_pd(n, ln2_hi, x);
    r = _mm256_fnmadd_pd(n, ln2_lo, r);
    /* Taylor series to r^13 (|r| <= 0.347: truncation < 1e-17 relative) */
    __m256d p = _mm256_set1_pd(1.0 / 6227020800.0);           /* 1/13! */
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 479001600.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 39916800.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 3628800.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 362880.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 40320.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 5040.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 720.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 120.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 24.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 6.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5));
    /* 1 + r + r^2 p with the leading sum split exactly (Fast2Sum, |r| < 1):
     * s + lo == 1 + r, so only the last addition rounds at full weight */
    __m256d r2 = _mm256_mul_pd(r, r);
    const __m256d one = _mm256_set1_pd(1.0);
    __m256d s = _mm256_add_pd(one, r);
    __m256d slo = _mm256_add_pd(_mm256_sub_pd(one, s), r);
    __m256d e = _mm256_add_pd(s, _mm256_fmadd_pd(p, r2, slo));
    /* 2^n: one multiply while it is a normal number (the usual case) */
    __m256i out = _mm256_or_si256(_mm256_cmpgt_epi64(ni, _mm256_set1_epi64x(1023)),
                                  _mm256_cmpgt_epi64(_mm256_set1_epi64x(-1022), ni));
    if (_mm256_testz_si256(out, out))
        return _mm256_mul_pd(e, _mm256_castsi256_pd(
                                    _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52)));
    /* subnormal results or overflow: 2^n1 * 2^n2, each normal, one rounding */
    /* n1 = floor(n / 2) for small signed 64-bit n (AVX2 has no 64-bit arithmetic shift) */
    __m256i n1 = _mm256_sub_epi64(
        _mm256_srli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1 << 20)), 1),
        _mm256_set1_epi64x(1 << 19));
    __m256i n2 = _mm256_sub_epi64(ni, n1);
    __m256i b1 = _mm256_slli_epi64(_mm256_add_epi64(n1, _mm256_set1_epi64x(1023)), 52);
    __m256i b2 = _mm256_slli_epi64(_mm256_add_epi64(n2, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(_mm256_mul_pd(e, _mm256_castsi256_pd(b1)), _mm256_castsi256_pd(b2));
}

#endif
