// Shared declarations of the DFlashBlockAttention TensorRT plugin (schema: dflash_trt/plugins/schema.py).
#pragma once
#include <cuda_runtime_api.h>

namespace dflash {

constexpr int kMaxHeadDim = 256;
constexpr char const* kPluginName = "DFlashBlockAttention";
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "dflash";

struct BlockAttentionShape {
    int batch;    // B
    int heads;    // nq
    int kvHeads;  // nkv (nq % nkv == 0)
    int tokens;   // T, block rows
    int context;  // C, context rows (may be 0)
    int headDim;  // d <= kMaxHeadDim
    float scale;  // softmax scale (d^-0.5 when the attribute is 0)
    int window;   // 0 = no sliding window
    int causal;   // 1 = key j visible only if j <= C + i
};

cudaError_t launchBlockAttention(float const* q, float const* contextK, float const* contextV, float const* blockK,
                                 float const* blockV, float* out, BlockAttentionShape const& shape,
                                 cudaStream_t stream);

}  // namespace dflash
