// Pooled lookups of many features in one call: the inference path of EmbeddingCollection.
//
// Per feature f: ids[f] int64 [B, L] (-1: no id) into weights[f] float32 [R, D] ->
// out[f] float32 [B, D], the sum of the present rows, divided by their count when mean[f]
// (no present id: zeros). The result equals nn.EmbeddingBag(mode="sum") with per-sample weights
// present / count, which is how the collection pools when it trains; one C++ call instead of ~10
// small torch ops per feature matters when a serving batch holds a few users.
//
// Each row is accumulated as w * row with w = 1 (sum) or 1 / count (mean), in id order, as
// embedding_bag's per-sample weights are, so both paths round alike. Ids are range-checked.
// The GIL is released while it runs.
//
// pool_cached: the same pooling over the rows of a hot-row cache (sharded_tables/remote_tier.py).
// A batch's U distinct ids have their packed rows either in the cache's storage (slot >= 0) or
// among the rows fetched for its misses (slot -1, in id order); each is decoded once from its
// packed dtype (sharded_tables/quantize.py's layout, decoded as its unpack_rows does), then every
// feature pools over them with pool_bags, pooled_lookup's loop. One call in place of a gather,
// a decode and a pooled product per feature, which a served batch of a few users pays in
// dispatch, not arithmetic.
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Bags b0..b1 of len rows each (rows[b * len + l] indexes w [., dim]; -1: none) summed into
// o [., dim], zero-filled (mean: each row weighted 1 / the bag's present count), in row order.
void pool_bags(const float* w, int64_t dim, const int64_t* rows, int64_t b0, int64_t b1, int64_t len,
               bool mean, float* o) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t* row_ids = rows + b * len;
    int64_t present = 0;
    for (int64_t l = 0; l < len; ++l) present += row_ids[l] >= 0;
    float* dst = o + b * dim;
    if (present == 0) continue;  // out was zero-filled
    const float scale = mean ? 1.0f / static_cast<float>(present) : 1.0f;
    for (int64_t l = 0; l < len; ++l) {
      if (row_ids[l] < 0) continue;
      const float* src = w + row_ids[l] * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += scale * src[d];
    }
  }
}

void pool_one(const at::Tensor& weight, const at::Tensor& ids, bool mean, at::Tensor& out) {
  const int64_t rows = weight.size(0), dim = weight.size(1);
  const int64_t b_count = ids.size(0), len = ids.size(1);
  const float* w = weight.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  // a bad id is found before any work, so the error is the same whatever the threading
  for (int64_t i = 0; i < b_count * len; ++i) {
    TORCH_CHECK(id[i] >= -1 && id[i] < rows, "id ", id[i], " is out of range for a table of ",
                rows, " rows (-1 for padding)");
  }
  at::parallel_for(0, b_count, 256,
                   [&](int64_t b0, int64_t b1) { pool_bags(w, dim, id, b0, b1, len, mean, o); });
}

std::vector<at::Tensor> pooled_lookup(const std::vector<at::Tensor>& weights,
                                      const std::vector<at::Tensor>& ids,
                                      const std::vector<bool>& mean) {
  TORCH_CHECK(weights.size() == ids.size() && ids.size() == mean.size(),
              "weights, ids and mean need one entry per feature");
  std::vector<at::Tensor> outs;
  outs.reserve(ids.size());
  for (size_t f = 0; f < ids.size(); ++f) {
    const at::Tensor& weight = weights[f];
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                    weight.dim() == 2 && weight.is_contiguous(),
                "weights must be contiguous float32 [R, D] CPU tensors");
    TORCH_CHECK(ids[f].device().is_cpu() && ids[f].scalar_type() == at::kLong && ids[f].dim() == 2,
                "ids must be int64 [B, L] CPU tensors");
    const at::Tensor feature_ids = ids[f].contiguous();
    at::Tensor out = at::zeros({feature_ids.size(0), weight.size(1)}, weight.options());
    pool_one(weight, feature_ids, mean[f], out);
    outs.push_back(out);
  }
  return outs;
}

// Packed dtypes, in the order of sharded_tables/pooled_lookup.py's PACKED_DTYPES.
enum PackedDtype : int64_t { kFp32 = 0, kFp16 = 1, kFp8 = 2, kInt8 = 3, kInt4 = 4 };

int64_t packed_row_bytes(int64_t dtype, int64_t dim) {
  switch (dtype) {
    case kFp32: return 4 * dim;
    case kFp16: return 2 * dim;
    case kFp8: return dim;
    case kInt8: return dim + 4;  // fp16 scale and bias first, then the codes
    case kInt4: return dim / 2 + 4;
    default: TORCH_CHECK(false, "unknown packed dtype ", dtype);
  }
}

inline float half_at(const uint8_t* p) {  // little-endian fp16, as torch's view of the bytes
  return static_cast<float>(c10::Half(uint16_t(p[0] | (p[1] << 8)), c10::Half::from_bits()));
}

void decode_row(const uint8_t* src, int64_t dtype, int64_t dim, float* dst) {
  switch (dtype) {
    case kFp32:
      std::memcpy(dst, src, sizeof(float) * dim);
      return;
    case kFp16:
      for (int64_t d = 0; d < dim; ++d) dst[d] = half_at(src + 2 * d);
      return;
    case kFp8:
      for (int64_t d = 0; d < dim; ++d)
        dst[d] = static_cast<float>(c10::Float8_e4m3fn(src[d], c10::Float8_e4m3fn::from_bits()));
      return;
    default: {  // int8 / int4: code * scale + bias
      const float scale = half_at(src), bias = half_at(src + 2);
      const uint8_t* codes = src + 4;
      if (dtype == kInt8) {
        for (int64_t d = 0; d < dim; ++d) dst[d] = float(codes[d]) * scale + bias;
      } else {  // element 2i in the low nibble (fbgemm's order)
        for (int64_t i = 0; i < dim / 2; ++i) {
          dst[2 * i] = float(codes[i] & 0x0F) * scale + bias;
          dst[2 * i + 1] = float(codes[i] >> 4) * scale + bias;
        }
      }
    }
  }
}

// storage uint8 [C, rb]: the cache's rows; slots int64 [U]: each distinct id's slot, -1 for a
// miss; fetched uint8 [M, rb]: the misses' rows in order (M = misses); ids int64 [n]: every
// feature's [B, L_f] ids end to end (-1: none); positions int64 [n]: each id's index among the
// distinct ids; widths: L_f per feature -> per feature float32 [B, dim].
std::vector<at::Tensor> pool_cached(const at::Tensor& storage, const at::Tensor& slots,
                                    const at::Tensor& fetched, const at::Tensor& ids,
                                    const at::Tensor& positions, const std::vector<int64_t>& widths,
                                    int64_t batch, bool mean, int64_t dtype, int64_t dim) {
  const int64_t rb = packed_row_bytes(dtype, dim);
  auto packed = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 2 &&
                    t.size(1) == rb && t.is_contiguous(),
                name, " must be contiguous uint8 [rows, ", rb, "] on the CPU");
  };
  packed(storage, "storage");
  packed(fetched, "fetched");
  auto longs = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 &&
                    t.is_contiguous(),
                name, " must be a contiguous int64 [n] CPU tensor");
  };
  longs(slots, "slots");
  longs(ids, "ids");
  longs(positions, "positions");
  int64_t n = 0;
  for (int64_t w : widths) n += batch * w;
  TORCH_CHECK(ids.size(0) == n && positions.size(0) == n, "ids and positions need ", n,
              " entries (batch ", batch, " times the widths), got ", ids.size(0), " and ",
              positions.size(0));
  const int64_t u = slots.size(0), cap = storage.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  for (size_t f = 0; f < widths.size(); ++f) outs.push_back(at::zeros({batch, dim}, at::kFloat));
  py::gil_scoped_release no_gil;
  // every row's source is checked before any is read, so a bad call reads nothing
  int64_t misses = 0;
  for (int64_t j = 0; j < u; ++j) {
    TORCH_CHECK(slot[j] >= -1 && slot[j] < cap, "slot ", slot[j], " is outside the cache's ", cap,
                " rows");
    misses += slot[j] < 0;
  }
  TORCH_CHECK(fetched.size(0) == misses, "fetched has ", fetched.size(0), " rows for ", misses,
              " misses");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] == -1 || (pos[i] >= 0 && pos[i] < u), "position ", pos[i],
                " is outside the ", u, " distinct ids");
  std::vector<float> dense(u * dim);
  const uint8_t* cached = storage.data_ptr<uint8_t>();
  const uint8_t* missed = fetched.data_ptr<uint8_t>();
  for (int64_t j = 0, m = 0; j < u; ++j) {
    const uint8_t* src = slot[j] >= 0 ? cached + slot[j] * rb : missed + (m++) * rb;
    decode_row(src, dtype, dim, dense.data() + j * dim);
  }
  std::vector<int64_t> rows(n);  // each id's decoded row (-1: none), pooled as pooled_lookup pools
  for (int64_t i = 0; i < n; ++i) rows[i] = id[i] == -1 ? -1 : pos[i];
  int64_t at = 0;
  for (size_t f = 0; f < widths.size(); ++f) {
    float* o = outs[f].data_ptr<float>();
    pool_bags(dense.data(), dim, rows.data() + at, 0, batch, widths[f], mean, o);
    at += batch * widths[f];
  }
  return outs;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pooled_lookup", &pooled_lookup, "Sum / mean pooled rows of many features in one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("pool_cached", &pool_cached, "Pooled rows of a batch's distinct ids from a hot-row cache",
        py::arg("storage"), py::arg("slots"), py::arg("fetched"), py::arg("ids"),
        py::arg("positions"), py::arg("widths"), py::arg("batch"), py::arg("mean"),
        py::arg("dtype"), py::arg("dim"));
}
