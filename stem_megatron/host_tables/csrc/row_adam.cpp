// Row-indexed AdamW on host tables with DeepSpeed's CPU Adam step.
//
// DeepSpeed's cpu_adam_impl.cpp is compiled into this translation unit (its Step_8 templates are
// defined there, not in cpu_adam.h) so each touched row runs exactly DeepSpeed's AVX code, in place,
// with the optimizer state (step, bias correction) kept in DeepSpeed's own registry. This module also
// exports DeepSpeed's create/destroy/adam_update so one build serves whole-table and row updates.

#include "cpu_adam_impl.cpp"

namespace {

// Leading floats (1 KB) of a row's params and moments fetched ahead: enough for the hardware prefetcher to
// take over the rest of the row. A row starts where the previous touched row did not end, so without
// this every row begins with misses in three streams: one thread, 7000 random rows of 2560 took ~2x the
// time of 7000 contiguous rows, ~1.5x with it (more lines, two rows ahead or the whole row: no better).
constexpr int64_t kPrefetchFloats = 256;

// Rows per Step_8 call: a run of consecutive ids is one contiguous block of params, moments and grads, so it
// is updated by one call (one serial OpenMP region instead of one per row: ~0.24 µs each, ~4% of the update of
// 7000 random rows of 32000 here). Only when a row is a whole number of DeepSpeed's SIMD spans (SIMD_WIDTH x 8
// floats): then every element runs the same vector code in a run as alone, and as in the whole-table update.
#ifdef SIMD_WIDTH
constexpr int64_t kSpan = SIMD_WIDTH * 8;
#else
constexpr int64_t kSpan = 0;  // scalar or SVE builds: a row per call
#endif

// Without gradients (dense AdamW's untouched rows) Step_8 reads this many zero floats at most: a run of those
// rows is cut into blocks of that size (or one row), so the buffer stays small and in cache instead of a
// zero tensor of the rows' size, and a long run is still spread over the threads.
constexpr int64_t kZeroFloats = 16384;

inline void prefetch_row(const float* p, const float* m, const float* v, int64_t cols)
{
    for (int64_t at = 0; at < std::min(cols, kPrefetchFloats); at += 64 / sizeof(float)) {
        __builtin_prefetch(p + at, 0, 2);  // to L2: the row is reached after the current one
        __builtin_prefetch(m + at, 0, 2);
        __builtin_prefetch(v + at, 0, 2);
    }
}

// AdamW on rows ids[r] of params/exp_avg/exp_avg_sq with grads[r] (grads[grad_rows[r]] where grad_rows is
// given: the caller's order need not be the gradients', so they are never permuted into a copy), or with a
// zero gradient where grads is None: the same per-element math as ds_adam_step over those rows, without
// gathering them. Blocks (a row, or a run of rows consecutive in the table and in grads) are spread over
// OpenMP threads; each runs DeepSpeed's Step_8 serially (parallel = false) while the next block's start is
// prefetched.
int row_adam_step(int optimizer_id,
                  size_t step,
                  float lr,
                  float beta1,
                  float beta2,
                  float epsilon,
                  float weight_decay,
                  bool bias_correction,
                  const torch::Tensor& ids,
                  const std::optional<torch::Tensor>& grads,
                  const torch::Tensor& params,
                  const torch::Tensor& exp_avg,
                  const torch::Tensor& exp_avg_sq,
                  const std::optional<torch::Tensor>& grad_rows)
{
    TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
                      "ids must be a contiguous 1-D int64 tensor");
    TORCH_CHECK_VALUE(params.dim() == 2, "params must be a 2-D table (rows x columns)");
    std::vector<const torch::Tensor*> floats = {&params, &exp_avg, &exp_avg_sq};
    if (grads) floats.push_back(&*grads);
    for (const torch::Tensor* t : floats) {
        TORCH_CHECK_VALUE(t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->is_contiguous(),
                          "params, grads and moments must be contiguous float32 CPU tensors");
    }
    TORCH_CHECK_VALUE(exp_avg.sizes() == params.sizes() && exp_avg_sq.sizes() == params.sizes(),
                      "exp_avg and exp_avg_sq must have the shape of params");
    const int64_t n = ids.numel(), rows = params.size(0), cols = params.size(1);
    TORCH_CHECK_VALUE(!grads || (grads->dim() == 2 && (grad_rows || grads->size(0) == n) && grads->size(1) == cols),
                      "grads must be (len(ids), columns of params)");
    TORCH_CHECK_VALUE(!grad_rows || (grads && grad_rows->dim() == 1 && grad_rows->numel() == n &&
                                     grad_rows->scalar_type() == torch::kInt64 && grad_rows->is_contiguous()),
                      "grad_rows must be a contiguous 1-D int64 tensor of len(ids), with grads");
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* at_grad = grad_rows ? grad_rows->data_ptr<int64_t>() : nullptr;
    for (int64_t r = 0; at_grad && r < n; r++) {
        TORCH_CHECK_INDEX(at_grad[r] >= 0 && at_grad[r] < grads->size(0), "grad_rows[", r, "] = ", at_grad[r],
                          " out of range for ", grads->size(0), " gradient rows");
    }
    for (int64_t r = 0; r < n; r++) {
        TORCH_CHECK_INDEX(id[r] >= 0 && id[r] < rows, "row id ", id[r], " out of range for a table of ", rows,
                          " rows");
        TORCH_CHECK_VALUE(r == 0 || id[r] > id[r - 1], "ids must be sorted and unique (ids[", r, "] = ", id[r],
                          " after ", id[r - 1], ")");
    }
    auto opt = std::static_pointer_cast<Adam_Optimizer>(s_optimizers.at(optimizer_id));
    opt->IncrementStep(step, beta1, beta2);
    opt->update_state(lr, epsilon, weight_decay, bias_correction);

    float* p = params.data_ptr<float>();
    float* g = grads ? grads->data_ptr<float>() : nullptr;
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    const bool merge = kSpan > 0 && cols > 0 && cols % kSpan == 0;
    // Rows a block holds at most: a whole run with gradients; without, as many as the zero buffer.
    const int64_t most = !merge ? 1 : grads ? n : std::max<int64_t>(1, kZeroFloats / cols);
    std::vector<float> zeros(grads ? 0 : most * cols, 0.0f);  // +0.0f, the bits of a zero-filled gradient
    std::vector<int64_t> starts;  // first index into ids of each block; n at the end
    starts.reserve(n + 1);
    for (int64_t r = 0; r < n; r++) {
        const bool grads_follow = !at_grad || at_grad[r] == at_grad[r - 1] + 1;  // (r > 0 where read)
        if (r == 0 || id[r] != id[r - 1] + 1 || !grads_follow || r - starts.back() == most) starts.push_back(r);
    }
    starts.push_back(n);
    const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r = starts[b], at = id[r] * cols;
        if (b + 1 < blocks) {
            const int64_t next = id[starts[b + 1]] * cols;
            prefetch_row(p + next, m + next, v + next, cols);
        }
        float* grad = g ? g + (at_grad ? at_grad[r] : r) * cols : zeros.data();
        opt->Step_8(p + at, grad, m + at, v + at, (starts[b + 1] - r) * cols, false);
    }
    return 0;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed CPU Adam (C++)");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed CPU Adam destroy (C++)");
    m.def("adam_update", &ds_adam_step, "DeepSpeed CPU Adam update (C++)");
    m.def("row_adam_update",
          &row_adam_step,
          "DeepSpeed CPU Adam update of table rows by index, in place; grads None: zero gradients (C++)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
