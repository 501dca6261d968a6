// Host check of libdflash_plugins.so: loads the library as TensorRT's plugin registry does (dlopen +
// getCreators) and exercises every build-phase method of DFlashBlockAttention on the CPU, with no TensorRT
// library and no GPU (docs/gpu.md, "The TensorRT plugin"). The shape expressions TensorRT would pass are built
// from the public headers' implementation interfaces (apiv::VExprBuilder, apiv::VDimensionExpr).
//
// Usage: dflash_plugin_host_check LIBRARY. Prints one line per check ("ok NAME" or "FAIL NAME: why"), the
// creator's fields as "field NAME TYPE" lines, and exits non-zero when any check fails.
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

int gFailures = 0;
int gChecks = 0;

void check(bool passed, std::string const& name, std::string const& detail = "") {
    ++gChecks;
    if (passed) {
        std::printf("ok %s\n", name.c_str());
    } else {
        ++gFailures;
        std::printf("FAIL %s%s%s\n", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
    }
}

// A dimension expression: a constant, a named symbolic size, or an operation on two expressions.
class HostExprImpl final : public apiv::VDimensionExpr {
public:
    HostExprImpl(bool constant, int64_t value, DimensionOperation op, IDimensionExpr const* lhs,
                 IDimensionExpr const* rhs)
        : mConstant(constant), mValue(value), mOp(op), mLhs(lhs), mRhs(rhs) {}
    bool isConstant() const override { return mConstant; }
    int64_t getConstantValue() const override { return mConstant ? mValue : -1; }
    bool isSizeTensor() const override { return false; }
    bool isOperation(DimensionOperation op, IDimensionExpr const* lhs, IDimensionExpr const* rhs) const {
        return mLhs != nullptr && mOp == op && mLhs == lhs && mRhs == rhs;
    }

private:
    bool mConstant;
    int64_t mValue;
    DimensionOperation mOp;
    IDimensionExpr const* mLhs;
    IDimensionExpr const* mRhs;
};

class HostExpr final : public IDimensionExpr {
public:
    explicit HostExpr(HostExprImpl* impl) : mHostImpl(impl) { mImpl = impl; }
    HostExprImpl const& impl() const { return *mHostImpl; }

private:
    HostExprImpl* mHostImpl;
};

// Owns every expression it hands out; constants fold as TensorRT folds them.
class HostExprBuilderImpl final : public apiv::VExprBuilder {
public:
    IDimensionExpr const* constant(int64_t value) override { return make(true, value, DimensionOperation::kSUM); }
    IDimensionExpr const* symbol() { return make(false, 0, DimensionOperation::kSUM); }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& first,
                                    IDimensionExpr const& second) override {
        if (first.isConstant() && second.isConstant() && op == DimensionOperation::kPROD) {
            return constant(first.getConstantValue() * second.getConstantValue());
        }
        return make(false, 0, op, &first, &second);
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
        return nullptr;
    }

private:
    IDimensionExpr const* make(bool constant, int64_t value, DimensionOperation op,
                               IDimensionExpr const* lhs = nullptr, IDimensionExpr const* rhs = nullptr) {
        mImpls.emplace_back(constant, value, op, lhs, rhs);
        mExprs.emplace_back(&mImpls.back());
        return &mExprs.back();
    }
    std::deque<HostExprImpl> mImpls;
    std::deque<HostExpr> mExprs;
};

class HostExprBuilder final : public IExprBuilder {
public:
    HostExprBuilder() { mImpl = &mHostImpl; }
    HostExprBuilderImpl& host() { return mHostImpl; }

private:
    HostExprBuilderImpl mHostImpl;
};

struct Attributes {
    float scale;
    int32_t window;
    int32_t causal;
};

bool serializedAs(IPluginV3* plugin, Attributes expected) {
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* fc = runtime->getFieldsToSerialize();
    if (fc == nullptr || fc->nbFields != 3) return false;
    bool scale = false, window = false, causal = false;
    for (int32_t i = 0; i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        if (f.length != 1 || f.data == nullptr) return false;
        if (std::strcmp(f.name, "scale") == 0 && f.type == PluginFieldType::kFLOAT32)
            scale = *static_cast<float const*>(f.data) == expected.scale;
        else if (std::strcmp(f.name, "window") == 0 && f.type == PluginFieldType::kINT32)
            window = *static_cast<int32_t const*>(f.data) == expected.window;
        else if (std::strcmp(f.name, "causal") == 0 && f.type == PluginFieldType::kINT32)
            causal = *static_cast<int32_t const*>(f.data) == expected.causal;
    }
    return scale && window && causal;
}

char const* fieldTypeName(PluginFieldType type) {
    switch (type) {
        case PluginFieldType::kFLOAT32: return "float";
        case PluginFieldType::kINT32: return "int";
        case PluginFieldType::kCHAR: return "string";
        default: return "other";
    }
}

DynamicPluginTensorDesc desc(std::vector<int64_t> const& dims) {
    DynamicPluginTensorDesc d{};
    d.desc.type = DataType::kFLOAT;
    d.desc.format = TensorFormat::kLINEAR;
    d.desc.dims.nbDims = static_cast<int32_t>(dims.size());
    d.min.nbDims = d.max.nbDims = d.opt.nbDims = d.desc.dims.nbDims;
    for (size_t i = 0; i < dims.size(); ++i) {
        d.desc.dims.d[i] = -1;
        d.min.d[i] = 1;
        d.opt.d[i] = d.max.d[i] = dims[i];
    }
    return d;
}

// q [B, nq, T, d], context_k/v [B, nkv, C, d], block_k/v [B, nkv, T, d], out [B, T, nq*d].
std::vector<DynamicPluginTensorDesc> ioDescs(int64_t heads, int64_t kvHeads, int64_t headDim) {
    return {desc({2, heads, 16, headDim}), desc({2, kvHeads, 64, headDim}), desc({2, kvHeads, 64, headDim}),
            desc({2, kvHeads, 16, headDim}), desc({2, kvHeads, 16, headDim}), desc({2, 16, heads * headDim})};
}

using Fields = std::vector<PluginField>;

IPluginV3* create(IPluginCreatorV3One* creator, Fields const& fields, TensorRTPhase phase) {
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    return creator->createPlugin("block_attention_0", &fc, phase);
}

void checkFieldParsing(IPluginCreatorV3One* creator) {
    float const scale = 0.125f;
    double const scale64 = 0.125;
    int32_t const window = 3, causal = 1, negative = -1, two = 2;
    int64_t const window64 = 3;
    float const nan = std::numeric_limits<float>::quiet_NaN(), negativeScale = -1.f;
    int32_t const pair[2] = {1, 1};
    // The ONNX parser passes node attributes (float -> kFLOAT32, int -> kINT32) plus its own two keys.
    Fields const parserShaped = {PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1),
                                 PluginField("window", &window, PluginFieldType::kINT32, 1),
                                 PluginField("causal", &causal, PluginFieldType::kINT32, 1),
                                 PluginField("plugin_version", "1", PluginFieldType::kCHAR, 1),
                                 PluginField("plugin_namespace", "dflash", PluginFieldType::kCHAR, 6)};
    IPluginV3* plugin = create(creator, parserShaped, TensorRTPhase::kBUILD);
    check(plugin != nullptr && serializedAs(plugin, {0.125f, 3, 1}), "fields: ONNX-parser-shaped node");
    delete plugin;
    plugin = create(creator, {PluginField("scale", &scale64, PluginFieldType::kFLOAT64, 1),
                              PluginField("window", &window64, PluginFieldType::kINT64, 1)},
                    TensorRTPhase::kBUILD);
    check(plugin != nullptr && serializedAs(plugin, {0.125f, 3, 0}), "fields: float64 scale, int64 window");
    delete plugin;
    plugin = create(creator, {}, TensorRTPhase::kBUILD);
    check(plugin != nullptr && serializedAs(plugin, {0.f, 0, 0}), "fields: absent attributes take schema defaults");
    delete plugin;

    struct Refusal {
        char const* name;
        PluginField field;
    };
    Refusal const refusals[] = {
        {"negative scale", PluginField("scale", &negativeScale, PluginFieldType::kFLOAT32, 1)},
        {"NaN scale", PluginField("scale", &nan, PluginFieldType::kFLOAT32, 1)},
        {"scale as int", PluginField("scale", &window, PluginFieldType::kINT32, 1)},
        {"negative window", PluginField("window", &negative, PluginFieldType::kINT32, 1)},
        {"window as float", PluginField("window", &scale, PluginFieldType::kFLOAT32, 1)},
        {"causal 2", PluginField("causal", &two, PluginFieldType::kINT32, 1)},
        {"causal of length 2", PluginField("causal", pair, PluginFieldType::kINT32, 2)},
        {"window without data", PluginField("window", nullptr, PluginFieldType::kINT32, 1)},
        {"misspelled attribute", PluginField("windw", &window, PluginFieldType::kINT32, 1)},
        {"unnamed field", PluginField(nullptr, &window, PluginFieldType::kINT32, 1)},
    };
    for (Refusal const& refusal : refusals) {
        IPluginV3* refused = create(creator, {refusal.field}, TensorRTPhase::kBUILD);
        check(refused == nullptr, std::string("fields: refuses ") + refusal.name);
        delete refused;
    }
    IPluginV3* repeated = create(creator, {parserShaped[1], parserShaped[1]}, TensorRTPhase::kBUILD);
    check(repeated == nullptr, "fields: refuses a repeated attribute");
    delete repeated;
    check(creator->createPlugin("x", nullptr, TensorRTPhase::kBUILD) == nullptr, "fields: refuses no collection");
}

void checkSerialization(IPluginCreatorV3One* creator, IPluginV3* plugin) {
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* written = runtime->getFieldsToSerialize();
    IPluginV3* restored = creator->createPlugin("block_attention_0", written, TensorRTPhase::kRUNTIME);
    check(restored != nullptr && serializedAs(restored, {0.125f, 3, 1}), "serialize: round trip");
    delete restored;

    Fields const complete(written->fields, written->fields + written->nbFields);
    Fields missing(complete.begin(), complete.end() - 1);
    Fields extra = complete;
    extra.emplace_back("plugin_version", "1", PluginFieldType::kCHAR, 1);
    int32_t const causal = 7;
    Fields corrupt = complete;
    for (PluginField& f : corrupt) {
        if (std::strcmp(f.name, "causal") == 0) f.data = &causal;
    }
    Fields retyped = complete;
    for (PluginField& f : retyped) {
        if (std::strcmp(f.name, "scale") == 0) f.type = PluginFieldType::kINT8;
    }
    for (auto const& [name, fields] : {std::make_pair("a missing field", missing),
                                       std::make_pair("an unknown field", extra),
                                       std::make_pair("an out-of-range value", corrupt),
                                       std::make_pair("a retyped field", retyped)}) {
        IPluginV3* refused = create(creator, fields, TensorRTPhase::kRUNTIME);
        check(refused == nullptr, std::string("serialize: malformed blob with ") + name + " refused");
        delete refused;
    }
    PluginFieldCollection negative{-1, complete.data()};
    check(creator->createPlugin("x", &negative, TensorRTPhase::kRUNTIME) == nullptr,
          "serialize: malformed blob with a negative field count refused");
}

void checkOutputs(IPluginV3OneBuild* build) {
    check(build->getNbOutputs() == 1, "outputs: one output");
    DataType inputs[5] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType out = DataType::kHALF;
    check(build->getOutputDataTypes(&out, 1, inputs, 5) == 0 && out == DataType::kFLOAT, "outputs: float32 type");
    check(build->getOutputDataTypes(&out, 1, inputs, 4) != 0, "outputs: four inputs refused");
    bool refusedEveryOther = true;
    for (int32_t t = 0; t < EnumMax<DataType>(); ++t) {
        if (static_cast<DataType>(t) == DataType::kFLOAT) continue;
        for (int32_t pos = 0; pos < 5; ++pos) {
            DataType typed[5] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT,
                                 DataType::kFLOAT};
            typed[pos] = static_cast<DataType>(t);
            refusedEveryOther &= build->getOutputDataTypes(&out, 1, typed, 5) != 0;
        }
    }
    check(refusedEveryOther, "outputs: every non-float32 input type refused");

    HostExprBuilder builder;
    HostExprBuilderImpl& exprs = builder.host();
    IDimensionExpr const* batch = exprs.symbol();
    IDimensionExpr const* tokens = exprs.symbol();
    IDimensionExpr const* context = exprs.symbol();
    auto shapes = [&](IDimensionExpr const* heads, IDimensionExpr const* kvHeads, IDimensionExpr const* dim) {
        std::vector<DimsExprs> in(5);
        IDimensionExpr const* rows[5] = {tokens, context, context, tokens, tokens};
        for (int i = 0; i < 5; ++i) {
            in[i].nbDims = 4;
            in[i].d[0] = batch;
            in[i].d[1] = i == 0 ? heads : kvHeads;
            in[i].d[2] = rows[i];
            in[i].d[3] = dim;
        }
        return in;
    };
    std::vector<DimsExprs> in = shapes(exprs.constant(4), exprs.constant(2), exprs.constant(8));
    DimsExprs outShape{};
    int32_t status = build->getOutputShapes(in.data(), 5, nullptr, 0, &outShape, 1, builder);
    check(status == 0 && outShape.nbDims == 3 && outShape.d[0] == batch && outShape.d[1] == tokens &&
              outShape.d[2]->isConstant() && outShape.d[2]->getConstantValue() == 32,
          "outputs: shape [B, T, nq*d] with constant heads and head_dim");
    IDimensionExpr const* heads = exprs.symbol();
    IDimensionExpr const* dim = exprs.constant(64);
    in = shapes(heads, exprs.symbol(), dim);
    status = build->getOutputShapes(in.data(), 5, nullptr, 0, &outShape, 1, builder);
    check(status == 0 && outShape.nbDims == 3 &&
              static_cast<HostExpr const*>(outShape.d[2])->impl().isOperation(DimensionOperation::kPROD, heads, dim),
          "outputs: shape [B, T, nq*d] with symbolic heads");
    in[3].nbDims = 3;
    check(build->getOutputShapes(in.data(), 5, nullptr, 0, &outShape, 1, builder) != 0,
          "outputs: a rank-3 block_k refused");
    check(build->getOutputShapes(in.data(), 4, nullptr, 0, &outShape, 1, builder) != 0,
          "outputs: four inputs refused by getOutputShapes");
}

void checkFormats(IPluginV3OneBuild* build) {
    std::vector<DynamicPluginTensorDesc> io = ioDescs(4, 2, 8);
    int supported = 0, combinations = 0;
    bool onlyLinearFloat = true;
    for (int32_t pos = 0; pos < 6; ++pos) {
        for (int32_t t = 0; t < EnumMax<DataType>(); ++t) {
            for (int32_t f = 0; f < EnumMax<TensorFormat>(); ++f) {
                std::vector<DynamicPluginTensorDesc> probe = io;
                probe[pos].desc.type = static_cast<DataType>(t);
                probe[pos].desc.format = static_cast<TensorFormat>(f);
                bool const expected = probe[pos].desc.type == DataType::kFLOAT &&
                                      probe[pos].desc.format == TensorFormat::kLINEAR;
                bool const answer = build->supportsFormatCombination(pos, probe.data(), 5, 1);
                onlyLinearFloat &= answer == expected;
                supported += answer ? 1 : 0;
                ++combinations;
            }
        }
    }
    check(onlyLinearFloat && supported == 6, "formats: exactly float32 linear at each of 6 positions, of " +
                                                 std::to_string(combinations) + " combinations");
    check(!build->supportsFormatCombination(6, io.data(), 5, 1) &&
              !build->supportsFormatCombination(-1, io.data(), 5, 1),
          "formats: positions outside the 6 tensors refused");
}

void checkConfigure(IPluginV3OneBuild* build) {
    auto configure = [&](int64_t heads, int64_t kvHeads, int64_t dim, int32_t nbInputs = 5) {
        std::vector<DynamicPluginTensorDesc> io = ioDescs(heads, kvHeads, dim);
        return build->configurePlugin(io.data(), nbInputs, io.data() + 5, 1);
    };
    check(configure(4, 2, 8) == 0 && configure(32, 8, 128) == 0 && configure(8, 8, 256) == 0,
          "configure: head_dim 8, 128 and 256 accepted (GQA and MHA)");
    check(configure(4, 2, 257) != 0, "configure: head_dim 257 (> kMaxHeadDim) refused");
    check(configure(4, 2, 0) != 0, "configure: head_dim 0 refused");
    check(configure(4, 3, 8) != 0, "configure: heads not divisible by KV heads refused");
    check(configure(4, 2, 8, 4) != 0, "configure: four inputs refused");
    std::vector<DynamicPluginTensorDesc> io = ioDescs(4, 2, 8);
    check(build->getWorkspaceSize(io.data(), 5, io.data() + 5, 1) == 0, "configure: no workspace");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s LIBRARY\n", argv[0]);
        return 2;
    }
    void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
        std::printf("FAIL load: %s\n", dlerror());
        return 1;
    }
    using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
    using SetLoggerFinder = void (*)(ILoggerFinder*);
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(library, "getCreators"));
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(library, "setLoggerFinder"));
    check(getCreators != nullptr && setLoggerFinder != nullptr, "entry points: getCreators and setLoggerFinder");
    if (getCreators == nullptr) return 1;
    setLoggerFinder(nullptr);
    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    check(nbCreators == 1 && creators != nullptr && creators[0] != nullptr, "entry points: one creator");
    if (nbCreators != 1 || creators == nullptr || creators[0] == nullptr) return 1;
    InterfaceInfo const info = creators[0]->getInterfaceInfo();
    check(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1 && info.minor == 0,
          "creator: IPluginCreatorV3One 1.0", info.kind);
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
    check(std::strcmp(creator->getPluginName(), "DFlashBlockAttention") == 0 &&
              std::strcmp(creator->getPluginVersion(), "1") == 0 &&
              std::strcmp(creator->getPluginNamespace(), "dflash") == 0,
          "creator: DFlashBlockAttention version 1 in namespace dflash");
    PluginFieldCollection const* names = creator->getFieldNames();
    check(names != nullptr && names->nbFields == 3, "creator: three attribute fields");
    for (int32_t i = 0; names != nullptr && i < names->nbFields; ++i) {
        std::printf("field %s %s\n", names->fields[i].name, fieldTypeName(names->fields[i].type));
    }

    checkFieldParsing(creator);
    float const scale = 0.125f;
    int32_t const window = 3, causal = 1;
    IPluginV3* plugin = create(creator, {PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1),
                                         PluginField("window", &window, PluginFieldType::kINT32, 1),
                                         PluginField("causal", &causal, PluginFieldType::kINT32, 1)},
                               TensorRTPhase::kBUILD);
    if (plugin == nullptr) {
        check(false, "plugin: created");
        return 1;
    }
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    check(core != nullptr && build != nullptr && runtime != nullptr, "plugin: core, build and runtime capabilities");
    if (core == nullptr || build == nullptr || runtime == nullptr) return 1;
    check(std::strcmp(core->getPluginName(), "DFlashBlockAttention") == 0 &&
              std::strcmp(core->getPluginVersion(), "1") == 0 && std::strcmp(core->getPluginNamespace(), "dflash") == 0,
          "plugin: name, version and namespace match the creator");
    checkOutputs(build);
    checkFormats(build);
    checkConfigure(build);
    checkSerialization(creator, plugin);

    std::vector<DynamicPluginTensorDesc> io = ioDescs(4, 2, 8);
    PluginTensorDesc in[5], out[1];
    for (int i = 0; i < 5; ++i) in[i] = io[i].desc;
    out[0] = io[5].desc;
    check(runtime->onShapeChange(in, 5, out, 1) == 0, "runtime: onShapeChange");
    in[1].dims.d[1] = 0;  // no KV heads: refused before any launch, so this runs without a GPU
    check(runtime->enqueue(in, out, nullptr, nullptr, nullptr, nullptr) != 0, "runtime: enqueue refuses 0 KV heads");
    IPluginV3* attached = runtime->attachToContext(nullptr);
    check(attached != nullptr && attached != plugin && serializedAs(attached, {0.125f, 3, 1}),
          "runtime: attachToContext gives an independent copy");
    IPluginV3* cloned = plugin->clone();
    check(cloned != nullptr && cloned != plugin && serializedAs(cloned, {0.125f, 3, 1}), "plugin: clone");
    delete attached;
    delete plugin;  // the clone must not share state with the deleted original
    check(cloned != nullptr && serializedAs(cloned, {0.125f, 3, 1}), "plugin: clone outlives the original");
    delete cloned;

    std::printf("host check: %d of %d checks passed\n", gChecks - gFailures, gChecks);
    return gFailures == 0 ? 0 : 1;
}
