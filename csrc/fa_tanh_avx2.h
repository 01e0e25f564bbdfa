/*
 * Vectorised tanh (AVX2/FMA) shared by fa_additive.c and fa_rnn.c: the
 * includer defines AVX2 (the target attribute), includes <immintrin.h> and
 * fa_exp_avx2.h.  Construction and bounds: fa_additive.c's header comment
 * (float <= 2 ulp, double <= 3 ulp; tests/similarity/test_additive_kernel.py pins them).
 * tanh(+-inf) = +-1, tanh(+-0) = +-0, NaN stays NaN.
 */
#ifndef FA_TANH_AVX2_H
#define FA_TANH_AVX2_H

AVX2 static inline __m256 tanh8_f32(__m256 x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, x);
    /* |x| < 0.625: tanh(x) = x + x^3 P(x^2), P of degree 4 fitted here for
     * least maximum relative error (4.4e-9 in exact arithmetic) */
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(x2, _mm256_set1_ps(-0.00570508511736989f), _mm256_set1_ps(0.020639173686504364f));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-0.05373974144458771f));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(0.13331443071365356f));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-0.3333328068256378f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x2, x), p, x);
    small = _mm256_or_ps(small, _mm256_and_ps(sign, x));  /* tanh(-0) = -0 */
    /* otherwise (1 - E) / (1 + E), E = exp(-2|x|) <= exp(-1.25), with the sign
     * of x; |x| clamped to 9.05, where the result is 1 in float (a NaN x stays
     * NaN: min/max with the constant first) */
    __m256 z = _mm256_mul_ps(_mm256_set1_ps(-2.0f),
                             _mm256_min_ps(_mm256_set1_ps(9.05f), _mm256_max_ps(_mm256_set1_ps(0.625f), a)));
    __m256 e = exp8_nonpos_f32(z);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    big = _mm256_or_ps(big, _mm256_and_ps(sign, x));
    return _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

/* tanh for doubles: |x| < 0.625: x P(x^2) / Q(x^2), the [4/3] Pade
 * approximant of tanh(x)/x in x^2 (from its Taylor series, mpmath);
 * otherwise sign(x) (1 - 2 / (exp(2|x|) + 1)) with |x| clamped to 19.1
 * (tanh is 1 in double beyond) and exp by Cody-Waite reduction and a
 * degree-13 Taylor polynomial (2|x| in [1.25, 38.2]: no overflow or
 * subnormal case).  Measured <= 3 ulp against mpmath (the test pins it). */
AVX2 static inline __m256d tanh4_f64(__m256d x)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    __m256d a = _mm256_andnot_pd(sign, x);
    /* small: Pade */
    __m256d x2 = _mm256_mul_pd(x, x);
    __m256d p = _mm256_fmadd_pd(x2, _mm256_set1_pd(-1.7619065238112858e-08), _mm256_set1_pd(1.11000111000111e-05));
    p = _mm256_fmadd_pd(x2, p, _mm256_set1_pd(0.0031135531135531138));
    p = _mm256_fmadd_pd(x2, p, _mm256_set1_pd(0.13095238095238096));
    p = _mm256_fmadd_pd(x2, p, _mm256_set1_pd(1.0));
    __m256d q = _mm256_fmadd_pd(x2, _mm256_set1_pd(0.0002553002553002553), _mm256_set1_pd(0.02454212454212454));
    q = _mm256_fmadd_pd(x2, q, _mm256_set1_pd(0.4642857142857143));
    q = _mm256_fmadd_pd(x2, q, _mm256_set1_pd(1.0));
    __m256d small = _mm256_div_pd(_mm256_mul_pd(x, p), q);
    /* large: 1 - 2 / (exp(2a) + 1); a NaN stays NaN through min/max (constant first) */
    __m256d z = _mm256_mul_pd(_mm256_set1_pd(2.0),
                              _mm256_min_pd(_mm256_set1_pd(19.1), _mm256_max_pd(_mm256_set1_pd(0.625), a)));
    __m256d e = exp4_f64(z);  /* fa_exp_avx2.h */
    __m256d big = _mm256_sub_pd(_mm256_set1_pd(1.0),
                                _mm256_div_pd(_mm256_set1_pd(2.0), _mm256_add_pd(e, _mm256_set1_pd(1.0))));
    big = _mm256_or_pd(big, _mm256_and_pd(sign, x));   /* sign of x */
    __m256d use_small = _mm256_cmp_pd(a, _mm256_set1_pd(0.625), _CMP_LT_OQ);
    return _mm256_blendv_pd(big, small, use_small);
}

#endif
