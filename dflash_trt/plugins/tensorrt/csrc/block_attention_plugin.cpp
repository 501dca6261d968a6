// TensorRT IPluginV3 "DFlashBlockAttention" v1, namespace "dflash" (TensorRT 10.x and 11.x).
// Binds schema dflash::block_attention (dflash_trt/plugins/schema.py): inputs q, context_k, context_v, block_k,
// block_v (float32, linear); attributes scale (float), window (int), causal (int); one output [B, T, nq*d].
// The ONNX parser creates it from a DFlashBlockAttention node (plugin_version "1", plugin_namespace "dflash").
// Load with IPluginRegistry::loadLibrary / trtexec --dynamicPlugins: the library exports getCreators and
// setLoggerFinder (serving.md §4.1).
#include <NvInferRuntime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "block_attention.h"

using namespace nvinfer1;

namespace dflash {
namespace {

struct Attributes {
    float scale{0.f};
    int32_t window{0};
    int32_t causal{0};
};

int32_t readInt(PluginField const& field) {
    if (field.type == PluginFieldType::kINT64) return static_cast<int32_t>(*static_cast<int64_t const*>(field.data));
    return *static_cast<int32_t const*>(field.data);
}

float readFloat(PluginField const& field) {
    if (field.type == PluginFieldType::kFLOAT64) return static_cast<float>(*static_cast<double const*>(field.data));
    return *static_cast<float const*>(field.data);
}

}  // namespace

class BlockAttentionPlugin final : public IPluginV3,
                                   public IPluginV3OneCore,
                                   public IPluginV3OneBuild,
                                   public IPluginV3OneRuntime {
public:
    explicit BlockAttentionPlugin(Attributes attributes) : mAttributes(attributes) { initFields(); }

    // IPluginV3
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }
    IPluginV3* clone() noexcept override { return new BlockAttentionPlugin(mAttributes); }

    // IPluginV3OneCore
    AsciiChar const* getPluginName() const noexcept override { return kPluginName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return 1; }
    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                               int32_t nbInputs) const noexcept override {
        if (nbOutputs != 1 || nbInputs != 5) return -1;
        outputTypes[0] = inputTypes[0];
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* outputs,
                            int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept override {
        if (nbInputs != 5 || nbOutputs != 1 || inputs[0].nbDims != 4) return -1;
        outputs[0].nbDims = 3;
        outputs[0].d[0] = inputs[0].d[0];  // B
        outputs[0].d[1] = inputs[0].d[2];  // T
        outputs[0].d[2] = exprBuilder.operation(DimensionOperation::kPROD, *inputs[0].d[1], *inputs[0].d[3]);  // nq*d
        return 0;
    }
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (pos >= nbInputs + nbOutputs) return false;
        return inOut[pos].desc.type == DataType::kFLOAT && inOut[pos].desc.format == TensorFormat::kLINEAR;
    }
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
                            int32_t) noexcept override {
        if (nbInputs != 5) return -1;
        int64_t const headDim = in[0].max.d[3];
        return headDim > kMaxHeadDim ? -1 : 0;
    }
    size_t getWorkspaceSize(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*,
                            int32_t) const noexcept override {
        return 0;
    }

    // IPluginV3OneRuntime
    int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override {
        return 0;
    }
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
                    void* const* outputs, void*, cudaStream_t stream) noexcept override {
        Dims const& q = inputDesc[0].dims;     // [B, nq, T, d]
        Dims const& ctx = inputDesc[1].dims;   // [B, nkv, C, d]
        BlockAttentionShape shape{};
        shape.batch = static_cast<int>(q.d[0]);
        shape.heads = static_cast<int>(q.d[1]);
        shape.tokens = static_cast<int>(q.d[2]);
        shape.headDim = static_cast<int>(q.d[3]);
        shape.kvHeads = static_cast<int>(ctx.d[1]);
        shape.context = static_cast<int>(ctx.d[2]);
        shape.scale = mAttributes.scale > 0.f ? mAttributes.scale : 1.f / std::sqrt(static_cast<float>(shape.headDim));
        shape.window = mAttributes.window;
        shape.causal = mAttributes.causal;
        if (shape.headDim > kMaxHeadDim || shape.kvHeads == 0 || shape.heads % shape.kvHeads != 0) return -1;
        cudaError_t status = launchBlockAttention(
            static_cast<float const*>(inputs[0]), static_cast<float const*>(inputs[1]),
            static_cast<float const*>(inputs[2]), static_cast<float const*>(inputs[3]),
            static_cast<float const*>(inputs[4]), static_cast<float*>(outputs[0]), shape, stream);
        return status == cudaSuccess ? 0 : -1;
    }
    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &mFieldCollection; }

private:
    void initFields() {
        mFields = {PluginField("scale", &mAttributes.scale, PluginFieldType::kFLOAT32, 1),
                   PluginField("window", &mAttributes.window, PluginFieldType::kINT32, 1),
                   PluginField("causal", &mAttributes.causal, PluginFieldType::kINT32, 1)};
        mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
        mFieldCollection.fields = mFields.data();
    }

    Attributes mAttributes;
    std::vector<PluginField> mFields;
    PluginFieldCollection mFieldCollection{};
};

class BlockAttentionCreator final : public IPluginCreatorV3One {
public:
    BlockAttentionCreator() {
        mFieldNames = {PluginField("scale", nullptr, PluginFieldType::kFLOAT32, 1),
                       PluginField("window", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("causal", nullptr, PluginFieldType::kINT32, 1)};
        mFieldCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
        mFieldCollection.fields = mFieldNames.data();
    }
    AsciiChar const* getPluginName() const noexcept override { return kPluginName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldCollection; }
    IPluginV3* createPlugin(AsciiChar const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
        Attributes attributes;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
            PluginField const& field = fc->fields[i];
            if (field.data == nullptr) continue;
            if (std::strcmp(field.name, "scale") == 0) attributes.scale = readFloat(field);
            else if (std::strcmp(field.name, "window") == 0) attributes.window = readInt(field);
            else if (std::strcmp(field.name, "causal") == 0) attributes.causal = readInt(field);
            // plugin_version / plugin_namespace are consumed by the parser; anything else is ignored
        }
        return new BlockAttentionPlugin(attributes);
    }

private:
    std::vector<PluginField> mFieldNames;
    PluginFieldCollection mFieldCollection{};
};

}  // namespace dflash

extern "C" {

// Entry points of a TensorRT plugin library (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins).
void setLoggerFinder(ILoggerFinder*) {}

IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static dflash::BlockAttentionCreator creator;
    static IPluginCreatorInterface* const creators[] = {&creator};
    nbCreators = 1;
    return creators;
}

}  // extern "C"
