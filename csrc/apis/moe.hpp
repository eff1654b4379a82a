#pragma once
// pybind entry points of the MoE kernels around the grouped GEMMs (routing, one rank's decode
// dispatch, combine, the staged backend's row exchange, the low-latency expert-parallel transport).
// Tensors arrive as raw integers; kernels/moe.py validates them first.
#include <cstdint>
#include <tuple>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "launchers/moe_combine.hpp"
#include "launchers/moe_ep_ll.hpp"
#include "launchers/moe_exchange.hpp"
#include "launchers/moe_local_dispatch.hpp"
#include "launchers/moe_route.hpp"
#include "launchers/swiglu_quant.hpp"

namespace moe_apis::moe {

inline void moe_combine(std::uint64_t src, long long num_src_rows, std::uint64_t rows, std::uint64_t routed,
                        std::uint64_t out, long long num_tokens, int top_k, int hidden, bool float_out, int device,
                        std::uint64_t stream) {
  namespace L = moe_launchers::moe_combine;
  L::launch(L::get_config(top_k, hidden, float_out), {src, num_src_rows, rows, routed, out, num_tokens, device, stream});
}

inline void moe_local_dispatch(std::uint64_t topk_idx, std::uint64_t topk_weights, std::uint64_t xq, std::uint64_t xs,
                               long long num_tokens, int top_k, int num_local, int hidden, long long first_expert,
                               std::uint64_t acts, std::uint64_t acts_sf, std::uint64_t weights,
                               std::uint64_t global_ids, std::uint64_t pair_rows, std::uint64_t masked_m, int device,
                               std::uint64_t stream) {
  namespace L = moe_launchers::moe_local_dispatch;
  L::launch(L::get_config(top_k, num_local, hidden), {topk_idx, topk_weights, xq, xs, num_tokens, first_expert, acts,
                                                      acts_sf, weights, global_ids, pair_rows, masked_m, device,
                                                      stream});
}

inline void moe_route(std::uint64_t logits, std::uint64_t bias, long long num_tokens, int num_experts, int top_k,
                      int num_groups, int topk_groups, bool sigmoid, bool norm, float scaling, std::uint64_t topk_idx,
                      std::uint64_t topk_weights, int device, std::uint64_t stream) {
  namespace L = moe_launchers::moe_route;
  L::launch(L::get_config(num_experts, top_k, num_groups, topk_groups, sigmoid, norm, bias != 0),
            {logits, bias, num_tokens, scaling, topk_idx, topk_weights, device, stream});
}

// The exchange's peer tables as Python passes them: (tables, num_ranks, rank, pairs_per_rank).
using ExchangePeersTuple = std::tuple<std::uint64_t, int, int, int>;

inline moe_launchers::moe_exchange::Peers exchange_peers(const ExchangePeersTuple& t) {
  const auto& [tables, ranks, rank, pairs] = t;
  return {tables, ranks, rank, pairs};
}

// The layout as Python passes it: (counts, counts_stride, num_local, alignment, masked_max_rows,
// row_capacity, num_layout_rows, first_expert, m_indices, global_ids, masked_m).
using ExchangeLayoutTuple = std::tuple<std::uint64_t, int, int, int, int, long long, long long, long long,
                                       std::uint64_t, std::uint64_t, std::uint64_t>;

// The grid barrier as Python passes it: (flag_rows, flags, done), all 0 for none.
using ExchangeBarrierTuple = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>;

inline moe_launchers::moe_exchange::GridBarrier grid_barrier(const ExchangeBarrierTuple& t) {
  const auto& [flag_rows, flags, done] = t;
  return {flag_rows, flags, done};
}

inline void moe_exchange_dispatch(const ExchangePeersTuple& peers, const ExchangeLayoutTuple& layout, int top_k,
                                  int hidden, std::uint64_t within, long long num_pairs, std::uint64_t topk_idx,
                                  std::uint64_t topk_weights, std::uint64_t x, int x_dtype, long long x_row_stride,
                                  std::uint64_t xs, int device, std::uint64_t stream,
                                  const ExchangeBarrierTuple& barrier) {
  const auto& [counts, stride, local, alignment, masked, capacity, rows, first, m_indices, global_ids, masked_m] =
      layout;
  moe_launchers::moe_exchange::dispatch(exchange_peers(peers),
                                        {counts, stride, local, alignment, masked, capacity, rows, first, m_indices,
                                         global_ids, masked_m},
                                        top_k, hidden, within, num_pairs, topk_idx, topk_weights, x,
                                        static_cast<DType>(x_dtype), x_row_stride, xs, device, stream,
                                        grid_barrier(barrier));
}

inline void moe_exchange_count(std::uint64_t topk_idx, long long num_pairs, int num_experts, std::uint64_t within,
                               std::uint64_t row, std::uint64_t rows, int num_rows, int device, std::uint64_t stream) {
  moe_launchers::moe_exchange::count(topk_idx, num_pairs, num_experts, within, row, rows, num_rows, device, stream);
}

inline void moe_exchange_sizes(std::uint64_t counts, int counts_stride, int num_ranks, int rank, int num_local,
                               int alignment, int masked_max_rows, std::uint64_t sizes, int device,
                               std::uint64_t stream) {
  moe_launchers::moe_exchange::sizes(counts, counts_stride, num_ranks, rank, num_local, alignment, masked_max_rows,
                                     sizes, device, stream);
}

inline void moe_exchange_combine(const ExchangePeersTuple& peers, int hidden, std::uint64_t m_indices,
                                 long long num_rows, std::uint64_t expert_out, int device, std::uint64_t stream,
                                 const ExchangeBarrierTuple& barrier) {
  moe_launchers::moe_exchange::combine(exchange_peers(peers), hidden, m_indices, num_rows, expert_out, device, stream,
                                       grid_barrier(barrier));
}

// The transport layout as Python passes it: (peers, off_x, off_sf, off_w, off_src, off_combine,
// off_signals, rank, num_ranks, num_local, max_tokens, top_k, hidden).
using EpLayoutTuple = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t,
                                 std::uint64_t, int, int, int, int, int, int>;

inline moe_launchers::moe_ep_ll::Layout ep_layout(const EpLayoutTuple& t) {
  const auto& [peers, x, sf, w, src, combine, signals, rank, ranks, local, tokens, top_k, hidden] = t;
  return {peers, x, sf, w, src, combine, signals, rank, ranks, local, tokens, top_k, hidden};
}

inline void moe_ep_dispatch(const EpLayoutTuple& layout, std::uint64_t topk_idx, std::uint64_t topk_weights,
                            std::uint64_t x, int x_dtype, long long x_row_stride, std::uint64_t xs, long long num_tokens,
                            std::uint64_t masked_m, std::uint64_t routed, int device, std::uint64_t stream) {
  moe_launchers::moe_ep_ll::dispatch(ep_layout(layout), topk_idx, topk_weights, x, static_cast<DType>(x_dtype),
                                     x_row_stride, xs, num_tokens, masked_m, routed, device, stream);
}

inline void moe_ep_combine(const EpLayoutTuple& layout, std::uint64_t expert_out, int device, std::uint64_t stream) {
  moe_launchers::moe_ep_ll::combine(ep_layout(layout), expert_out, device, stream);
}

template <typename Generated>
pybind11::tuple as_tuple(const Generated& g) {
  return pybind11::make_tuple(g.name, g.code);
}

inline pybind11::tuple moe_local_dispatch_code(int top_k, int num_local, int hidden) {
  namespace L = moe_launchers::moe_local_dispatch;
  return as_tuple(L::generate(L::get_config(top_k, num_local, hidden)));
}

inline pybind11::tuple moe_route_code(int num_experts, int top_k, int num_groups, int topk_groups, bool sigmoid,
                                      bool norm, bool has_bias) {
  namespace L = moe_launchers::moe_route;
  return as_tuple(L::generate(L::get_config(num_experts, top_k, num_groups, topk_groups, sigmoid, norm, has_bias)));
}

inline pybind11::tuple moe_combine_code(int top_k, int hidden, bool float_out) {
  namespace L = moe_launchers::moe_combine;
  return as_tuple(L::generate(L::get_config(top_k, hidden, float_out)));
}

inline void swiglu_quant_fp8(std::uint64_t h, std::uint64_t weights, std::uint64_t masked_m, long long rows_per_group,
                             long long num_rows, int inter, std::uint64_t out, std::uint64_t sf, long long sf_stride_m,
                             long long sf_stride_k, int device, std::uint64_t stream) {
  moe_launchers::swiglu_quant::launch(h, weights, masked_m, rows_per_group, num_rows, inter, out, sf, sf_stride_m,
                                      sf_stride_k, device, stream);
}

inline pybind11::tuple swiglu_quant_code(int inter) {
  return as_tuple(moe_launchers::swiglu_quant::generate(inter));
}

inline pybind11::tuple moe_ep_ll_code(int kernel, int top_k, int hidden, int in_dtype) {
  namespace L = moe_launchers::moe_ep_ll;
  MOE_HOST_ASSERT(kernel >= 0 && kernel <= 1, L::kFn << ": kernel must be 0 (dispatch) or 1 (combine), got " << kernel);
  return as_tuple(L::generate(static_cast<L::Kernel>(kernel), top_k, hidden, static_cast<DType>(in_dtype)));
}

inline pybind11::tuple moe_exchange_code(int kernel, int top_k, int hidden, int in_dtype) {
  namespace L = moe_launchers::moe_exchange;
  MOE_HOST_ASSERT(kernel >= 0 && kernel <= 5,
                  L::kFn << ": kernel must be 0 (dispatch), 1 (combine), 2 (count), 3 (sizes), 4 (barrier) or 5 "
                            "(count-sizes), got "
                         << kernel);
  return as_tuple(L::generate(static_cast<L::Kernel>(kernel), top_k, hidden, static_cast<DType>(in_dtype)));
}

inline void register_apis(pybind11::module_& m) {
  using pybind11::arg;
  m.def("moe_exchange_dispatch", &moe_exchange_dispatch, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "staged dispatch: the pairs' FP8 rows (E4M3 with scales, or quantized in the kernel), scales, weights and "
        "slot words into their owners' layout rows (layouts from the count matrix, positions from the count "
        "kernel), and this rank's layout index; barrier (flag_rows, flags, done) not all 0: its last CTA then "
        "raises the group's barrier");
  m.def("moe_exchange_count", &moe_exchange_count, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "staged count: each pair's position among its expert's pairs and this rank's row of the count matrix "
        "(pairs per expert, invalid ids) into a local row and/or every rank's matrix (row addresses)");
  m.def("moe_exchange_sizes", &moe_exchange_sizes, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "staged sizes: every rank's layout rows, masked rows and invalid ids, and this rank's pairs sent, int32 [3P + 1]");
  m.def("moe_exchange_combine", &moe_exchange_combine, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "staged combine: received rows' (m_indices >= 0) expert outputs into their sources' combine buffers; "
        "barrier as the dispatch's");
  m.def("moe_exchange_barrier", &moe_launchers::moe_exchange::barrier,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "staged barrier on the device: raise this rank's flag on every rank, wait for every rank's (one CTA)",
        arg("flag_rows"), arg("flags"), arg("rank"), arg("num_ranks"), arg("device"), arg("stream"));
  m.def("moe_exchange_count_sizes", &moe_launchers::moe_exchange::count_sizes,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "staged count, barrier and sizes in one launch (a CTA per 4096 pairs, the last one going on): positions, "
        "this rank's count row into every rank's matrix, the device barrier, then sizes int32 [3P + 1] from this "
        "rank's matrix",
        arg("topk_idx"), arg("num_pairs"), arg("within"), arg("scratch"), arg("rows"), arg("flag_rows"), arg("flags"),
        arg("counts"),
        arg("counts_stride"), arg("num_ranks"), arg("rank"), arg("num_local"), arg("alignment"),
        arg("masked_max_rows"), arg("sizes"), arg("device"), arg("stream"));
  m.def("moe_exchange_code", &moe_exchange_code,
        "(name, code) of an exchange kernel: 0 dispatch (in_dtype: its input rows' dtype code), 1 combine, 2 count, "
        "3 sizes, 4 barrier, 5 count-sizes (no GPU)",
        arg("kernel"), arg("top_k"), arg("hidden"), arg("in_dtype") = 3);
  m.def("moe_ep_dispatch", &moe_ep_dispatch, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "low-latency EP dispatch (one launch: send, then the last CTA waits): this rank's tokens (E4M3 with "
        "scales, or quantized in the kernel) into the owners' buffers, masked_m [E_l], routed [T, k]");
  m.def("moe_ep_combine", &moe_ep_combine, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "low-latency EP combine (one launch: send, then the last CTA waits): expert outputs [E_l, R, H] into their sources' combine buffers");
  m.def("swiglu_quant_fp8", &swiglu_quant_fp8, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "silu(gate) * up * w, quantized to E4M3 per 1x128 (masked layout: valid rows only); sf with strides "
        "(sf_stride_m, sf_stride_k) in elements");
  m.def("swiglu_quant_code", &swiglu_quant_code, "(name, code) of the SwiGLU + quantization kernel (no GPU)",
        arg("inter"));
  m.def("moe_ep_ll_code", &moe_ep_ll_code,
        "(name, code) of a transport kernel (no GPU): 0 dispatch (in_dtype: its input rows' dtype code), 1 combine",
        arg("kernel"), arg("top_k"), arg("hidden"), arg("in_dtype") = 1);
  m.def("moe_route", &moe_route, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "top-k routing from float32 logits [T, E]: softmax/sigmoid, bias, grouped top-k, weights");
  m.def("moe_route_code", &moe_route_code, "(name, code) of the routing kernel (no GPU)", arg("num_experts"),
        arg("top_k"), arg("num_groups"), arg("topk_groups"), arg("sigmoid"), arg("norm"), arg("has_bias"));
  m.def("moe_local_dispatch", &moe_local_dispatch, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "one rank's decode dispatch of T x k pairs into the masked layout [E_l, T] + spare rows");
  m.def("moe_local_dispatch_code", &moe_local_dispatch_code, "(name, code) of the local dispatch kernel (no GPU)",
        arg("top_k"), arg("num_local"), arg("hidden"));
  m.def("moe_combine", &moe_combine, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "out[t] = sum over j of src[rows[t * k + j]] where routed[t, j], float32 in slot order, rounded once "
        "(rows, routed: 0 for the identity and all routed)");
  m.def("moe_combine_code", &moe_combine_code, "(name, code) of the combine kernel (no GPU)", arg("top_k"),
        arg("hidden"), arg("float_out"));
}

}  // namespace moe_apis::moe
