// Lean AdamW on table rows (docs/lean_tables.md): moments in fp32 or bf16, the second moment per element or one
// fp32 per row, the master in fp32 or bf16; every bf16 store stochastically rounded with bits from a counter-based
// hash of (seed, step, layer, token id, global column). This file is the definition on CPU; lean_adam.py's torch
// version is the same arithmetic op for op (fp32, each op rounded once: built with -ffp-contract=off), so the two
// agree bit for bit on CPU.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Chris Wellons' "lowbias32": a bijection on 32 bits with low bias, two multiplies and three xor-shifts.
inline uint32_t mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// The hash of a row: its column c draws mix32(key + c), c the global column (a TP block starts at col0).
inline uint32_t row_key(uint32_t seed, uint32_t step, uint32_t layer, uint32_t token)
{
    return mix32(mix32(mix32(mix32(seed) ^ step) ^ layer) ^ token);
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x)
{
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// fp32 stores as is; bf16 rounds stochastically: 16 random bits added below the kept ones, then truncated, so a
// value rounds up with the probability of its distance from the bf16 below it (unbiased; ties have no special case).
inline void store(float& to, float x, uint32_t) { to = x; }
inline void store(uint16_t& to, float x, uint32_t bits16)
{
    uint32_t u;
    std::memcpy(&u, &x, 4);
    to = uint16_t((u + bits16) >> 16);
}

struct Scalars {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2, decay;
};

// Sum of g[0..n)^2 in a fixed order, torch's too: fold the upper half onto the lower until one is left (an odd
// middle element waits a level). Where n is a multiple of 4, two levels fold in one pass, the same sums in the
// same order: x[i] = (x[i] + x[i + 2q]) + (x[i + q] + x[i + 3q]); the first squares as it folds.
inline float fold_squares(const float* __restrict g, int64_t n, float* __restrict x)
{
    if (n % 4 == 0) {
        const int64_t q = n / 4;
        for (int64_t i = 0; i < q; i++)
            x[i] = (g[i] * g[i] + g[i + 2 * q] * g[i + 2 * q]) + (g[i + q] * g[i + q] + g[i + 3 * q] * g[i + 3 * q]);
        n = q;
    } else {
        const int64_t half = (n + 1) / 2;
        for (int64_t i = 0; i < n - half; i++) x[i] = g[i] * g[i] + g[half + i] * g[half + i];
        if (n - half < half) x[n - half] = g[n - half] * g[n - half];
        n = half;
    }
    while (n > 1) {
        if (n % 4 == 0) {
            const int64_t q = n / 4;
            for (int64_t i = 0; i < q; i++) x[i] = (x[i] + x[i + 2 * q]) + (x[i + q] + x[i + 3 * q]);
            n = q;
        } else {
            const int64_t half = (n + 1) / 2;
            float* __restrict low = x;
            const float* __restrict high = x + half;
            for (int64_t i = 0; i < n - half; i++) low[i] = low[i] + high[i];
            n = half;
        }
    }
    return x[0];
}

// Cache lines of the next row fetched ahead, into L2, a slice of them with each block of kAhead columns: the next
// row's data arrive while this row computes (~1.5 us of arithmetic a row at 8,192 columns, about memory's time).
constexpr int64_t kAhead = 128;

template <typename T>
inline void fetch_ahead(const T* at, int64_t n, int rw)
{
    for (int64_t i = 0; i < n; i += 64 / int64_t(sizeof(T))) {
        if (rw) __builtin_prefetch(at + i, 1, 2);
        else __builtin_prefetch(at + i, 0, 2);
    }
}

// A row's tensors: g its gradient (zeros for dense Adam's untouched rows), p and m of `cols` columns, v of `cols`
// or (row-wise) of `blocks` columns.
template <typename P, typename M, typename V>
struct Row {
    const float* g;
    P* p;
    M* m;
    V* v;
};

// One row; `next` the row to fetch ahead (nullptrs: none). kRow: v holds `blocks` fp32 values, one per block of
// cols / blocks columns: the mean of g^2 over the block. The column loop is one straight pass the compiler
// vectorises (AVX2/AVX-512, -march=native): no branches, the hash's counter in 32-bit lanes.
template <typename P, typename M, typename V, bool kRow>
void update_row(const Scalars& s, uint32_t key, uint32_t col0, const Row<P, M, V>& row, const Row<P, M, V>& next,
                int64_t cols, int64_t blocks, float* scratch)
{
    constexpr bool kBits = !std::is_same<P, float>::value || !std::is_same<M, float>::value ||
                           (!kRow && !std::is_same<V, float>::value);
    const int64_t width = kRow ? cols / blocks : cols;
    V* __restrict v = row.v;
    for (int64_t b = 0; b < (kRow ? blocks : 1); b++) {
        const int64_t lo = b * width;
        float denom_row = 0.0f;
        if constexpr (kRow) {
            const float mean = fold_squares(row.g + lo, width, scratch) / float(width);
            const float vb = to_float(v[b]) * s.beta2 + mean * s.one_minus_beta2;
            v[b] = vb;
            denom_row = std::sqrt(vb) * s.bias_correction2 + s.eps;
        }
        for (int64_t at = lo; at < lo + width; at += kAhead) {
            const int64_t n = std::min(kAhead, lo + width - at);
            if (next.p) {
                fetch_ahead(next.g + at, n, 0);
                fetch_ahead(next.p + at, n, 1);
                fetch_ahead(next.m + at, n, 1);
                if constexpr (!kRow) fetch_ahead(next.v + at, n, 1);
            }
            const float* __restrict g = row.g + at;
            P* __restrict p = row.p + at;
            M* __restrict m = row.m + at;
            const uint32_t first = key + col0 + uint32_t(at);  // the hash of column at + j: mix32(first + j)
            for (uint32_t j = 0; j < uint32_t(n); j++) {
                const float gc = g[j];
                const float mc = to_float(m[j]) * s.beta1 + gc * s.one_minus_beta1;
                float denom = denom_row;
                float vc = 0.0f;
                if constexpr (!kRow) {
                    vc = to_float(v[at + j]) * s.beta2 + (gc * gc) * s.one_minus_beta2;
                    denom = std::sqrt(vc) * s.bias_correction2 + s.eps;
                }
                const float pc = to_float(p[j]) * s.decay + (mc / denom) * s.step_size;
                uint32_t h = 0;
                if constexpr (kBits) h = mix32(first + j);
                store(p[j], pc, h >> 16);     // the master: the high half
                store(m[j], mc, h & 0xffffU);  // exp_avg: the low half
                if constexpr (!kRow) store(v[at + j], vc, kBits ? mix32(h) >> 16 : 0U);  // exp_avg_sq: own bits
            }
        }
    }
}

template <typename T>
T* data(const torch::Tensor& t)
{
    return reinterpret_cast<T*>(t.data_ptr());
}

template <typename P, typename M, typename V, bool kRow>
void update_rows(const Scalars& s, uint32_t seed, uint32_t step, uint32_t layer, uint32_t col0, const int64_t* id,
                 const int64_t* token, int64_t n, const float* g, const int64_t* at_grad, const torch::Tensor& params,
                 const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq)
{
    const int64_t cols = params.size(1), vcols = exp_avg_sq.size(1);
    P* p = data<P>(params);
    M* m = data<M>(exp_avg);
    V* v = data<V>(exp_avg_sq);
#pragma omp parallel
    {
        std::vector<float> scratch(kRow ? (cols + 1) / 2 : 0);
        std::vector<float> zeros(g ? 0 : cols, 0.0f);  // +0.0f, the bits of a zero-filled gradient
        auto row = [&](int64_t r) {
            return Row<P, M, V>{g ? g + (at_grad ? at_grad[r] : r) * cols : zeros.data(), p + id[r] * cols,
                                m + id[r] * cols, v + id[r] * vcols};
        };
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const uint32_t key = row_key(seed, step, layer, uint32_t(token[r]));
            update_row<P, M, V, kRow>(s, key, col0, row(r), r + 1 < n ? row(r + 1) : Row<P, M, V>{}, cols, vcols,
                                      scratch.data());
        }
    }
}

// Lean AdamW on rows ids[r] (positions in the tensors, sorted, unique) with gradient grads[r] (grads[grad_rows[r]]
// with grad_rows), or zero gradients where grads is None (dense Adam's untouched rows); tokens[r] is row r's token
// id for the hash (None: the ids). scalars: beta1, 1 - beta1, beta2, 1 - beta2, eps, -lr / (1 - beta1^t),
// 1 / sqrt(1 - beta2^t), 1 - lr * weight_decay (lean_adam.scalars).
void lean_adam_rows(const std::vector<double>& scalars, int64_t seed, int64_t step, int64_t layer, int64_t col0,
                    const torch::Tensor& ids, const std::optional<torch::Tensor>& tokens,
                    const std::optional<torch::Tensor>& grads, const std::optional<torch::Tensor>& grad_rows,
                    const torch::Tensor& params, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq)
{
    TORCH_CHECK_VALUE(scalars.size() == 8, "scalars must be lean_adam.scalars' 8 values");
    const Scalars s{float(scalars[0]), float(scalars[1]), float(scalars[2]), float(scalars[3]),
                    float(scalars[4]), float(scalars[5]), float(scalars[6]), float(scalars[7])};
    auto check_ids = [](const torch::Tensor& t, const char* name) {
        TORCH_CHECK_VALUE(t.dim() == 1 && t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.device().is_cpu(),
                          name, " must be a contiguous 1-D int64 CPU tensor");
    };
    check_ids(ids, "ids");
    const int64_t n = ids.numel();
    if (tokens) check_ids(*tokens, "tokens");
    if (grad_rows) check_ids(*grad_rows, "grad_rows");
    TORCH_CHECK_VALUE(!tokens || tokens->numel() == n, "tokens must have len(ids) entries");
    TORCH_CHECK_VALUE(params.dim() == 2 && exp_avg.dim() == 2 && exp_avg_sq.dim() == 2,
                      "params, exp_avg and exp_avg_sq must be 2-D (rows x columns)");
    for (const torch::Tensor* t : {&params, &exp_avg, &exp_avg_sq}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->is_contiguous() &&
                              (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16),
                          "params and moments must be contiguous float32 or bfloat16 CPU tensors");
    }
    const int64_t rows = params.size(0), cols = params.size(1), vcols = exp_avg_sq.size(1);
    TORCH_CHECK_VALUE(exp_avg.sizes() == params.sizes() && exp_avg_sq.size(0) == rows,
                      "exp_avg must have the shape of params, exp_avg_sq its rows");
    const bool row_wise = vcols != cols;  // (one column: the row's mean of g^2 is the element's g^2)
    TORCH_CHECK_VALUE(!row_wise || (vcols >= 1 && cols % vcols == 0 && exp_avg_sq.scalar_type() == torch::kFloat32),
                      "a row-wise exp_avg_sq must be float32 (rows x blocks), blocks dividing the columns; got ",
                      vcols, " for ", cols, " columns");
    if (grads) {
        TORCH_CHECK_VALUE(grads->scalar_type() == torch::kFloat32 && grads->is_contiguous() &&
                              grads->device().is_cpu() && grads->dim() == 2 && grads->size(1) == cols &&
                              (grad_rows || grads->size(0) == n),
                          "grads must be a contiguous float32 CPU tensor of (len(ids), columns of params)");
    }
    TORCH_CHECK_VALUE(!grad_rows || (grads && grad_rows->numel() == n), "grad_rows needs grads and len(ids) entries");
    const int64_t* id = data<int64_t>(ids);
    const int64_t* at_grad = grad_rows ? data<int64_t>(*grad_rows) : nullptr;
    for (int64_t r = 0; r < n; r++) {
        TORCH_CHECK_INDEX(id[r] >= 0 && id[r] < rows, "row id ", id[r], " out of range for a table of ", rows, " rows");
        TORCH_CHECK_VALUE(r == 0 || id[r] > id[r - 1], "ids must be sorted and unique (ids[", r, "] = ", id[r],
                          " after ", id[r - 1], ")");
        TORCH_CHECK_INDEX(!at_grad || (at_grad[r] >= 0 && at_grad[r] < grads->size(0)), "grad_rows[", r, "] = ",
                          at_grad ? at_grad[r] : 0, " out of range for the gradient rows");
    }
    const int64_t* token = tokens ? data<int64_t>(*tokens) : id;
    const float* g = grads ? data<float>(*grads) : nullptr;
    const bool p16 = params.scalar_type() == torch::kBFloat16, m16 = exp_avg.scalar_type() == torch::kBFloat16;
    const bool v16 = exp_avg_sq.scalar_type() == torch::kBFloat16;
    auto run = [&](auto p, auto m, auto v, auto row) {
        update_rows<decltype(p), decltype(m), decltype(v), decltype(row)::value>(
            s, uint32_t(seed), uint32_t(step), uint32_t(layer), uint32_t(col0), id, token, n, g, at_grad, params,
            exp_avg, exp_avg_sq);
    };
    using Row = std::true_type;
    using Element = std::false_type;
    const float f = 0;
    const uint16_t h = 0;
    if (row_wise) {
        if (p16 && m16) run(h, h, f, Row{});
        else if (p16) run(h, f, f, Row{});
        else if (m16) run(f, h, f, Row{});
        else run(f, f, f, Row{});
    } else if (v16) {
        if (p16 && m16) run(h, h, h, Element{});
        else if (p16) run(h, f, h, Element{});
        else if (m16) run(f, h, h, Element{});
        else run(f, f, h, Element{});
    } else {
        if (p16 && m16) run(h, h, f, Element{});
        else if (p16) run(h, f, f, Element{});
        else if (m16) run(f, h, f, Element{});
        else run(f, f, f, Element{});
    }
}

// The hash's 32 bits for rows `tokens` and `cols` columns from col0: what lean_adam.rounding_bits must equal.
torch::Tensor rounding_bits(int64_t seed, int64_t step, int64_t layer, int64_t col0, const torch::Tensor& tokens,
                            int64_t cols)
{
    TORCH_CHECK_VALUE(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(),
                      "tokens must be a contiguous 1-D int64 tensor");
    auto out = torch::empty({tokens.size(0), cols}, torch::kInt64);
    int64_t* o = out.data_ptr<int64_t>();
    const int64_t* t = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < tokens.size(0); r++) {
        const uint32_t key = row_key(uint32_t(seed), uint32_t(step), uint32_t(layer), uint32_t(t[r]));
        for (int64_t c = 0; c < cols; c++) o[r * cols + c] = mix32(key + uint32_t(col0) + uint32_t(c));
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("lean_adam_rows", &lean_adam_rows, "Lean AdamW on table rows by index, in place (C++)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("rounding_bits", &rounding_bits, "The stochastic rounding's 32-bit hash per (row, column) (C++)");
}
