// Issue 27 probe: CUTLASS sm90 grouped GEMMs the way torch's GroupMM.cu builds them (128 x 256 x 64 tiles,
// cooperative), with the two changes torch does not expose: (1) the weight gradient added into an existing
// gradient in the epilogue (beta = 1, C = D), (2) the row-ragged forward with clusters along N instead of M, so
// that an expert's rows are not rounded up to 256 (forward and input gradient). A C ABI over raw pointers (ctypes).
#include <cuda_runtime.h>
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using BF16 = cutlass::bfloat16_t;

template <class LayoutA, class LayoutB, class Cluster>
struct Grouped {
  using Tile = Shape<_128, _256, _64>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, BF16, cutlass::layout::RowMajor*, 8, BF16,
      cutlass::layout::RowMajor*, 8, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<BF16, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, BF16, LayoutA*, 8, BF16, LayoutB*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using SA = typename Kernel::InternalStrideA;
  using SB = typename Kernel::InternalStrideB;
  using SD = typename Kernel::InternalStrideD;
};

// Per group e (rows start..end of the ragged dim): problem shape, operand pointers, strides.
// wgrad: out[e] (O x I) = alpha * g_e^T x_e + beta * out[e]; A = g^T (col-major, ld O), B = x (K x I row-major).
// fwd:   y[rows] (rows x O) = x_rows (rows x I) @ w[e]^T, w [E, O, I] row-major: B col-major (ld I);
// dgrad: y[rows] (rows x O) = x_rows (rows x I) @ w[e], w [E, I, O] row-major: B row-major (ld O), same pointers.
template <class G>
__global__ void prepare(bool wgrad, const BF16* a, const BF16* b, BF16* d, const int* ends, int E, int O, int I,
                        typename ProblemShape::UnderlyingProblemShape* shapes, const BF16** pa, const BF16** pb,
                        BF16** pd, typename G::SA* sa, typename G::SB* sb, typename G::SD* sd, typename G::SA sa0,
                        typename G::SB sb0, typename G::SD sd0) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int64_t start = e ? ends[e - 1] : 0, rows = ends[e] - start;
  if (wgrad) {
    shapes[e] = {O, I, static_cast<int>(rows)};
    pa[e] = a + start * O;
    pb[e] = b + start * I;
    pd[e] = d + int64_t(e) * O * I;
  } else {
    shapes[e] = {static_cast<int>(rows), O, I};
    pa[e] = a + start * I;
    pb[e] = b + int64_t(e) * O * I;
    pd[e] = d + start * O;
  }
  sa[e] = sa0;
  sb[e] = sb0;
  sd[e] = sd0;
}

template <class G>
int run(bool wgrad, const void* a, const void* b, void* d, const int* ends, int E, int O, int I, float alpha,
        float beta, int sms, cudaStream_t stream) {
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  // One allocation for the per-group arrays, freed on the stream after the GEMM.
  size_t n = size_t(E), bytes = n * (sizeof(Shape3) + 3 * sizeof(void*) + sizeof(typename G::SA) +
                                     sizeof(typename G::SB) + sizeof(typename G::SD)) + 256;
  char* buf;
  if (cudaMallocAsync(&buf, bytes, stream) != cudaSuccess) return -1;
  auto align = [](char* p) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15)); };
  char* p = align(buf);
  auto pa = reinterpret_cast<const BF16**>(p); p += n * sizeof(void*);
  auto pb = reinterpret_cast<const BF16**>(p); p += n * sizeof(void*);
  auto pd = reinterpret_cast<BF16**>(p); p += n * sizeof(void*);
  auto shapes = reinterpret_cast<Shape3*>(align(p)); p = reinterpret_cast<char*>(shapes + n);
  auto sa = reinterpret_cast<typename G::SA*>(align(p)); p = reinterpret_cast<char*>(sa + n);
  auto sb = reinterpret_cast<typename G::SB*>(align(p)); p = reinterpret_cast<char*>(sb + n);
  auto sd = reinterpret_cast<typename G::SD*>(align(p));
  // Packed strides: ld O for A = g^T / I for A = x, ld I for B either way, ld O or I for D; none depends on K or M.
  int M = wgrad ? O : 1, N = wgrad ? I : O, K = wgrad ? 1 : I;
  auto sa0 = cutlass::make_cute_packed_stride(typename G::SA{}, {M, K, 1});
  auto sb0 = cutlass::make_cute_packed_stride(typename G::SB{}, {N, K, 1});
  auto sd0 = cutlass::make_cute_packed_stride(typename G::SD{}, {M, N, 1});
  prepare<G><<<(E + 127) / 128, 128, 0, stream>>>(wgrad, static_cast<const BF16*>(a), static_cast<const BF16*>(b),
                                                    static_cast<BF16*>(d), ends, E, O, I, shapes, pa, pb, pd, sa, sb,
                                                    sd, sa0, sb0, sd0);
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = alpha;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sms;
  args = typename G::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {E, shapes, nullptr},
                                     {pa, sa, pb, sb},
                                     {fusion, const_cast<const BF16**>(pd), sd, pd, sd},
                                     hw};
  typename G::Gemm gemm;
  size_t ws_bytes = G::Gemm::get_workspace_size(args);
  void* ws = nullptr;
  if (ws_bytes && cudaMallocAsync(&ws, ws_bytes, stream) != cudaSuccess) return -2;
  int rc = 0;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) rc = -3;
  else if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) rc = -4;
  else if (gemm.run(stream) != cutlass::Status::kSuccess) rc = -5;
  if (ws) cudaFreeAsync(ws, stream);
  cudaFreeAsync(buf, stream);
  return rc;
}

using ColMajor = cutlass::layout::ColumnMajor;
using RowMajor = cutlass::layout::RowMajor;
using WgradM2 = Grouped<ColMajor, RowMajor, Shape<_2, _1, _1>>;  // torch's cluster
using WgradN2 = Grouped<ColMajor, RowMajor, Shape<_1, _2, _1>>;
using FwdM2 = Grouped<RowMajor, ColMajor, Shape<_2, _1, _1>>;    // torch's forward
using FwdN2 = Grouped<RowMajor, ColMajor, Shape<_1, _2, _1>>;    // rows rounded to 128, not 256
using DgradM2 = Grouped<RowMajor, RowMajor, Shape<_2, _1, _1>>;
using DgradN2 = Grouped<RowMajor, RowMajor, Shape<_1, _2, _1>>;

extern "C" int grouped_gemm(int kind, const void* a, const void* b, void* d, const int* ends, int E, int O, int I,
                            float alpha, float beta, int sms, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (kind) {
    case 0: return run<WgradM2>(true, a, b, d, ends, E, O, I, alpha, beta, sms, s);
    case 1: return run<WgradN2>(true, a, b, d, ends, E, O, I, alpha, beta, sms, s);
    case 2: return run<FwdM2>(false, a, b, d, ends, E, O, I, alpha, beta, sms, s);
    case 3: return run<FwdN2>(false, a, b, d, ends, E, O, I, alpha, beta, sms, s);
    case 4: return run<DgradM2>(false, a, b, d, ends, E, O, I, alpha, beta, sms, s);
    case 5: return run<DgradN2>(false, a, b, d, ends, E, O, I, alpha, beta, sms, s);
  }
  return -9;
}
