/*
 * Vectorised logistic sigmoid 1 / (1 + exp(-x)) (AVX2/FMA) shared by the RNN
 * forward (fa_rnn.c) and backward (fa_rnn_bwd.c), so that the backward
 * recomputes the forward's gates bit for bit: the includer defines AVX2 (the
 * target attribute) and includes <immintrin.h> and fa_exp_avx2.h.
 */
#ifndef FA_SIG_AVX2_H
#define FA_SIG_AVX2_H

AVX2 static inline __m256 sig8(__m256 x)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8_f32(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

AVX2 static inline __m256d sig4(__m256d x)
{
    const __m256d one = _mm256_set1_pd(1.0);
    return _mm256_div_pd(one, _mm256_add_pd(one, exp4_f64(_mm256_sub_pd(_mm256_setzero_pd(), x))));
}

#endif
