// The index's C++ library as a Python module: every op's binding (the ops are in the files
// ivf_scan.h lists).
#include <torch/extension.h>

#include "ivf_scan.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch only tensors: other Python threads (a server's gRPC threads) run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("topk_rows", &ivf::topk_rows, "Best k per row with a bounded heap", nogil);
  m.def("list_bounds", &ivf::list_bounds, "A filtered first round's lists and the bound check's bounds", nogil);
  m.def("second_round_lists", &ivf::second_round_lists, "The bound check's second-round rows and lists", nogil);
  m.def("ivf_probe", &ivf::ivf_probe, "The lists each query probes, best first, and q·c of each", pybind11::arg("q"),
        pybind11::arg("centroids_t"), pybind11::arg("half"), pybind11::arg("p"), pybind11::arg("table") = pybind11::none(),
        nogil);
  m.def("probe_table", &ivf::probe_table, "The centroids quantized for the probe of a few queries", nogil);
  m.def("filter_mask", &ivf::filter_mask, "Items passing one filter", nogil);
  m.def("bit_slices", &ivf::bit_slices, "The filter signatures bit-sliced, 64 items a word", nogil);
  m.def("sliced_mask", &ivf::sliced_mask, "Items passing one filter, from the bit slices", nogil);
  m.def("sliced_rows", &ivf::sliced_rows, "Positions passing one filter, from the bit slices", nogil);
  m.def("many_rows_int8", &ivf::many_rows_int8,
        "Many queries' scores of chosen rows: int8 GEMMs of quantized queries, or decoded rows and matmuls", nogil);
  m.def("decode_rows_int8", &ivf::decode_rows_int8, "Float vectors of chosen rows off the int8 codes, one pass", nogil);
  m.def("exact_search_ids_int8", &ivf::exact_search_ids_int8,
        "A selective filter's exact search: eligible rows, scores, top-k, ids", nogil);
  m.def("eligible_rows", &ivf::eligible_rows, "Rows passing one filter, driven by its most selective clause's postings", nogil);
  m.def("id_rows", &ivf::id_rows, "Rows of item ids through the index's id order (missing where absent)", nogil);
  m.def("centroid_dots", &ivf::centroid_dots, "q · every centroid, as the probe computes it", nogil);
  m.def("score_rows_int8", &ivf::score_rows_int8, "Scores of chosen rows off the int8 codes (the exact plan)", nogil);
  m.def("ids_of_positions", &ivf::ids_of_positions, "Positions (-1 pads) -> item ids (-1 pads)", nogil);
  m.def("bit_index", &ivf::bit_index, "Per-bit item counts and postings of the filter signatures", nogil);
  m.def("value_index", &ivf::value_index, "The items of each bucket of the hashed attributes' values", nogil);
  m.def("value_drive", &ivf::value_drive, "The buckets of a hashed attribute's values one filter reads", nogil);
  m.def("encode_int8", &ivf::encode_int8, "The build's int8 residual codes, scales and norms in list-sorted order", nogil);
  m.def("ivf_scan_int8", &ivf::ivf_scan_int8, "List-major IVF scan over int8 residual codes with in-scan filter", nogil);
  m.def("int8_isa", [] { return std::string(ivf::isa_name(ivf::int8_isa())); },
        "The int8 scan's path for the next call: portable, avx2 or vnni ($RECSERVE_SCAN_ISA, else the CPU's best)");
  m.def("stream_select", [] {
#ifdef RECSERVE_AVX512_BUILD
    return true;
#else
    return false;
#endif
  }, "Whether selections of k <= 160 run TopStream (an AVX-512 build): equal scores by position");
  m.def("ivf_search_ids_int8", &ivf::ivf_search_ids_int8,
        "Exclusions by id -> rows, probe, int8 scan, rows -> ids: a plain search in one call", pybind11::arg("q"),
        pybind11::arg("centroids_t"), pybind11::arg("half"), pybind11::arg("p"), pybind11::arg("codes"),
        pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("sig"), pybind11::arg("fmask"),
        pybind11::arg("fneg"), pybind11::arg("fnone"), pybind11::arg("excl_ids"), pybind11::arg("item_ids"), pybind11::arg("perm"),
        pybind11::arg("r"), pybind11::arg("sizes"), pybind11::arg("least"), pybind11::arg("hold"),
        pybind11::arg("table") = pybind11::none(), nogil);
  m.def("merge_rounds", &ivf::merge_rounds, "The bound check's two rounds of chosen rows merged into their top-k",
        nogil);
  m.def("ivf_scan_fp8", &ivf::ivf_scan_fp8, "List-major IVF scan over fp8 e4m3 residual codes with in-scan filter", nogil);
}
