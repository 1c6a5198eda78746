/* rs_argmax_rows, the sampler's greedy argmax on the CPU (native.argmax_rows): torch's CPU argmax is
 * a scalar loop. Built into the same library as cpu_kernels.c, over the same vector layer. */
#include <math.h>
#include <stdint.h>

#include "cpu_simd.h"

/* out[r] = the index of the largest value of row r of x [rows, cols] (row stride `stride`): the
 * first one on ties, the first NaN where a row has one (torch.argmax's answer). One pass for
 * the max, one for its first index; rows spread over the threads. */
void rs_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        vf mx = vf_set1(-INFINITY);
        vm nan = vm_none();
        for (int64_t c = 0; c < cols; c += 16) {
            const vf v = vf_loadu_first(row + c, cols - c, -INFINITY);
            nan = vm_or(nan, vf_isnan(v));
            mx = vf_max(mx, v);
        }
        const vf best = vf_set1(vf_hmax(mx));
        int64_t at = 0;
        for (int64_t c = 0; c < cols; c += 16) {
            const vf v = vf_loadu_first(row + c, cols - c, 0.0f);
            const vm hit = vm_and(vm_first(cols - c), vm_any(nan) ? vf_isnan(v) : vf_eq(v, best));
            if (vm_any(hit)) { at = c + vm_first_set(hit); break; }
        }
        out[r] = at;
    }
}
