// CUDA kernel of dflash::block_attention (plugins/schema.py): one warp per (batch, query head, block row).
// Query i sits at absolute position C+i and attends to keys [context ‖ block] at positions 0..C+T-1,
// subject to `window` (pos_i - j < window, 0 = none) and `causal` (j <= pos_i). Online softmax over the
// keys (Milakov & Gimelshein 2018), float32 throughout. Layouts are dense row-major (kLINEAR):
//   q [B, nq, T, d], context_k/v [B, nkv, C, d], block_k/v [B, nkv, T, d] -> out [B, T, nq*d].
#include <cuda_runtime.h>
#include <math_constants.h>

#include "block_attention.h"

namespace dflash {

constexpr int kWarp = 32;
constexpr int kSlots = kMaxHeadDim / kWarp;  // head-dim elements held per lane
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float warpSum(float value) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

__global__ void blockAttentionKernel(float const* q, float const* contextK, float const* contextV, float const* blockK,
                                     float const* blockV, float* out, BlockAttentionShape s) {
    int const warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
    int const lane = threadIdx.x % kWarp;
    if (warp >= s.batch * s.heads * s.tokens) return;
    int const t = warp % s.tokens;
    int const h = (warp / s.tokens) % s.heads;
    int const b = warp / (s.tokens * s.heads);
    int const kvHead = h / (s.heads / s.kvHeads);  // grouped-query attention
    int const queryPos = s.context + t;
    float const* qRow = q + (static_cast<long>(b * s.heads + h) * s.tokens + t) * s.headDim;

    float qv[kSlots];
    float acc[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
        int const e = lane + i * kWarp;
        qv[i] = e < s.headDim ? qRow[e] * s.scale : 0.f;
        acc[i] = 0.f;
    }
    float runningMax = -CUDART_INF_F;
    float runningSum = 0.f;
    for (int j = 0; j < s.context + s.tokens; ++j) {
        if (s.window > 0 && queryPos - j >= s.window) continue;
        if (s.window > 0 && !s.causal && j - queryPos >= s.window) continue;  // non-causal window: two-sided
        if (s.causal && j > queryPos) break;
        bool const inContext = j < s.context;
        long const row = inContext ? (static_cast<long>(b * s.kvHeads + kvHead) * s.context + j)
                                   : (static_cast<long>(b * s.kvHeads + kvHead) * s.tokens + (j - s.context));
        float const* kRow = (inContext ? contextK : blockK) + row * s.headDim;
        float const* vRow = (inContext ? contextV : blockV) + row * s.headDim;
        float partial = 0.f;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
            int const e = lane + i * kWarp;
            if (e < s.headDim) partial += qv[i] * kRow[e];
        }
        float const score = warpSum(partial);
        float const newMax = fmaxf(runningMax, score);
        float const correction = __expf(runningMax - newMax);
        float const weight = __expf(score - newMax);
        runningSum = runningSum * correction + weight;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
            int const e = lane + i * kWarp;
            if (e < s.headDim) acc[i] = acc[i] * correction + weight * vRow[e];
        }
        runningMax = newMax;
    }
    float* outRow = out + (static_cast<long>(b * s.tokens + t) * s.heads + h) * s.headDim;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
        int const e = lane + i * kWarp;
        if (e < s.headDim) outRow[e] = acc[i] / runningSum;
    }
}

cudaError_t launchBlockAttention(float const* q, float const* contextK, float const* contextV, float const* blockK,
                                 float const* blockV, float* out, BlockAttentionShape const& shape,
                                 cudaStream_t stream) {
    int const warps = shape.batch * shape.heads * shape.tokens;
    if (warps == 0) return cudaSuccess;
    int const threads = kWarpsPerBlock * kWarp;
    int const blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
    blockAttentionKernel<<<blocks, threads, 0, stream>>>(q, contextK, contextV, blockK, blockV, out, shape);
    return cudaGetLastError();
}

}  // namespace dflash
