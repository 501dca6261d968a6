// TensorRT IPluginV3 "DFlashBlockAttention" v1, namespace "dflash" (TensorRT 10.x and 11.x).
// Binds schema dflash::block_attention (dflash_trt/plugins/schema.py): inputs q, context_k, context_v, block_k,
// block_v (float32, linear); attributes scale (float), window (int), causal (int); one output [B, T, nq*d].
// The ONNX parser creates it from a DFlashBlockAttention node (plugin_version "1", plugin_namespace "dflash").
// Load with IPluginRegistry::loadLibrary / trtexec --dynamicPlugins: the library exports getCreators and
// setLoggerFinder (docs/serving-notes.md §4.1, docs/gpu.md).
#include <NvInferRuntime.h>

#include <cmath>
#include <cstring>
#include <limits>
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

// Keys the ONNX parser adds to every plugin node (schema.py); they select the creator and carry no attribute.
bool isParserKey(char const* name) {
    return std::strcmp(name, "plugin_version") == 0 || std::strcmp(name, "plugin_namespace") == 0;
}

bool readInt(PluginField const& field, int32_t& value) {
    if (field.length != 1) return false;
    int64_t wide = 0;
    if (field.type == PluginFieldType::kINT32) wide = *static_cast<int32_t const*>(field.data);
    else if (field.type == PluginFieldType::kINT64) wide = *static_cast<int64_t const*>(field.data);
    else return false;
    if (wide < 0 || wide > std::numeric_limits<int32_t>::max()) return false;
    value = static_cast<int32_t>(wide);
    return true;
}

bool readFloat(PluginField const& field, float& value) {
    if (field.length != 1) return false;
    double wide = 0.;
    if (field.type == PluginFieldType::kFLOAT32) wide = *static_cast<float const*>(field.data);
    else if (field.type == PluginFieldType::kFLOAT64) wide = *static_cast<double const*>(field.data);
    else return false;
    if (!std::isfinite(wide) || wide < 0.) return false;
    value = static_cast<float>(wide);
    return true;
}

// Attributes from a creator's field collection. At build time (the ONNX parser) absent attributes keep the
// schema defaults and the parser's own keys are skipped; at runtime the fields are the ones
// getFieldsToSerialize wrote, so all three must be present and nothing else. Returns false on a field of the
// wrong type, length or value (a malformed node or serialized plan), which createPlugin turns into nullptr.
bool parseAttributes(PluginFieldCollection const* fc, TensorRTPhase phase, Attributes& attributes) {
    if (fc == nullptr || fc->nbFields < 0 || (fc->nbFields > 0 && fc->fields == nullptr)) return false;
    bool const serialized = phase == TensorRTPhase::kRUNTIME;
    bool seenScale = false, seenWindow = false, seenCausal = false;
    for (int32_t i = 0; i < fc->nbFields; ++i) {
        PluginField const& field = fc->fields[i];
        if (field.name == nullptr) return false;
        if (!serialized && isParserKey(field.name)) continue;
        if (field.data == nullptr) return false;
        bool ok = false;
        if (std::strcmp(field.name, "scale") == 0 && !seenScale) ok = seenScale = readFloat(field, attributes.scale);
        else if (std::strcmp(field.name, "window") == 0 && !seenWindow)
            ok = seenWindow = readInt(field, attributes.window);
        else if (std::strcmp(field.name, "causal") == 0 && !seenCausal)
            ok = seenCausal = readInt(field, attributes.causal) && attributes.causal <= 1;
        if (!ok) return false;  // unknown, repeated or invalid field
    }
    return !serialized || (seenScale && seenWindow && seenCausal);
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
        for (int32_t i = 0; i < nbInputs; ++i) {
            if (inputTypes[i] != DataType::kFLOAT) return -1;  // the kernel is float32 throughout
        }
        outputTypes[0] = DataType::kFLOAT;
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* outputs,
                            int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept override {
        if (nbInputs != 5 || nbOutputs != 1) return -1;
        for (int32_t i = 0; i < nbInputs; ++i) {
            if (inputs[i].nbDims != 4) return -1;  // q [B, nq, T, d]; context/block k, v [B, nkv, C|T, d]
        }
        outputs[0].nbDims = 3;
        outputs[0].d[0] = inputs[0].d[0];  // B
        outputs[0].d[1] = inputs[0].d[2];  // T
        outputs[0].d[2] = exprBuilder.operation(DimensionOperation::kPROD, *inputs[0].d[1], *inputs[0].d[3]);  // nq*d
        return 0;
    }
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (pos < 0 || pos >= nbInputs + nbOutputs) return false;
        return inOut[pos].desc.type == DataType::kFLOAT && inOut[pos].desc.format == TensorFormat::kLINEAR;
    }
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
                            int32_t) noexcept override {
        if (nbInputs != 5 || in[0].max.nbDims != 4 || in[1].max.nbDims != 4) return -1;
        int64_t const headDim = in[0].max.d[3];  // q [B, nq, T, d]
        int64_t const heads = in[0].max.d[1];
        int64_t const kvHeads = in[1].max.d[1];   // context_k [B, nkv, C, d]
        if (headDim < 1 || headDim > kMaxHeadDim) return -1;
        if (heads > 0 && kvHeads > 0 && heads % kvHeads != 0) return -1;  // grouped-query attention
        return 0;
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
    IPluginV3* createPlugin(AsciiChar const*, PluginFieldCollection const* fc,
                            TensorRTPhase phase) noexcept override {
        Attributes attributes;
        if (!parseAttributes(fc, phase, attributes)) return nullptr;
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
