"""The corpus of real architectures: torchvision and transformers models as users bring them
(issue 11). Random init from the libraries' own constructors and configs (no downloads),
fixed shapes, exported without their loss by the legacy exporter (``dynamo=False``, opset
17) or the dynamo exporter (``dynamo=True``, opset 18).

``CORPUS[name](size)`` gives a ``RealModel``: the torch module (returns the logits only),
its inputs by name, the loss kind and labels for ``build_training_graph``. Sizes:

* ``"tiny"``: reduced configs (2 layers, narrow) for the tests: seconds per model;
* ``"full"``: the library's real config (ResNet-50, GPT-2 12 layers, BERT-base, T5-small,
  ViT-B/16 ...) at small inputs (images 64-96 px at batch 8, 2-4 x 64-128 tokens), where
  weights and gradients dominate a step;
* ``"large"``: activation-heavy configurations (transformers at a few thousand tokens per
  batch, ViT at 224 px), where checkpointing should pay.

``export(model, exporter)`` returns the forward ``onnx.ModelProto`` (output ``logits``).
Exporters merge equal-valued initializers in eval mode, so ``perturb_constant_tensors``
(applied by every constructor) gives each constant-valued parameter or buffer (BatchNorm
gamma = 1 / beta = 0, zero biases, LayerNorm) distinct values first, so that gradients can be
compared with torch per parameter.

torchvision 0.28's wheel is a CUDA build whose C extension does not load beside the CPU
torch 2.13; the classification models are pure Python, so ``import_torchvision`` defines the
two op schemas its import registers fake kernels for (shared/docs/zoo-facts.md).
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from typing import Callable

import onnx
import torch
from torch import nn

LEGACY_OPSET = 17
DYNAMO_OPSET = 18
EXPORTERS = ("legacy", "dynamo")
SIZES = ("tiny", "full", "large")
SEED = 11

_TORCHVISION_LIBRARY = None


def import_torchvision():
    """``torchvision`` with its two C++ op schemas defined first (see module docstring)."""
    global _TORCHVISION_LIBRARY
    import sys
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    if _TORCHVISION_LIBRARY is None:
        try:
            library = torch.library.Library("torchvision", "DEF")
            library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _TORCHVISION_LIBRARY = library        # kept alive: the schemas die with it
        except RuntimeError:                      # defined already (a working C extension)
            _TORCHVISION_LIBRARY = False
    import torchvision
    return torchvision


@dataclass
class RealModel:
    name: str
    module: nn.Module
    inputs: dict[str, torch.Tensor]
    loss: str                      # "cross_entropy"
    labels: torch.Tensor
    class_axis: int | None = None  # None: the builder's default (1 for rank 2, last above)
    family: str = ""               # "torchvision" | "transformers"
    notes: dict = field(default_factory=dict)


class LogitsOnly(nn.Module):
    """A transformers model whose forward returns ``.logits`` (a tensor, for the exporters)."""

    def __init__(self, model: nn.Module, input_names: list[str]):
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *args):
        return self.model(**dict(zip(self.input_names, args))).logits


def perturb_constant_tensors(module: nn.Module, seed: int = SEED, scale: float = 0.1) -> None:
    """Give every constant-valued floating parameter or buffer distinct values: value ·
    (1 ± scale), plus ± scale · 0.1 around zero (zero biases), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if not tensor.is_floating_point() or tensor.numel() < 2:
                continue
            flat = tensor.reshape(-1)
            if bool((flat == flat[0]).all()):
                noise = torch.rand(tensor.shape, generator=generator) * 2 - 1
                tensor.mul_(1 + scale * noise).add_(0.1 * scale * noise)


def _images(batch: int, size: int, classes: int, name: str, module: nn.Module,
            channels: int = 3) -> RealModel:
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(batch, channels, size, size, generator=generator)
    labels = torch.randint(0, classes, (batch,), generator=generator)
    perturb_constant_tensors(module)
    module.eval()
    return RealModel(name, module, {"x": x}, "cross_entropy", labels, family="torchvision")


def _no_dropout(cfg):
    """Dropout off in a transformers config: an eval export has none, and attention kernels
    take the rate from the config, not from a module's mode (LayerDrop, which skips whole
    layers at random in training, too)."""
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
                "dropout_rate", "attention_dropout", "dropout", "activation_dropout", "encoder_layerdrop",
                "decoder_layerdrop"):
        if getattr(cfg, key, None):
            setattr(cfg, key, 0.0)
    return cfg


def _tokens(name: str, model: nn.Module, vocab: int, batch: int, seq: int, *,
            classes: int | None = None, decoder: bool = False) -> RealModel:
    """A transformers model fed input_ids and an explicit attention_mask (the legacy exporter
    cannot export the mask code without one), logits over the vocabulary (or `classes`)."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.int64)}
    if decoder:
        inputs["decoder_input_ids"] = torch.randint(0, vocab, (batch, seq), generator=generator)
    if classes is None:
        labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    else:
        labels = torch.randint(0, classes, (batch,), generator=generator)
    perturb_constant_tensors(model)
    model.eval()
    module = LogitsOnly(model, list(inputs))
    module.eval()
    return RealModel(name, module, inputs, "cross_entropy", labels, family="transformers")


# ------------------------------------------------------------------------ torchvision --

def _tv(builder: str, *, tiny: dict | None = None, image: dict | None = None,
        tiny_class: str | None = None, **kwargs):
    """A torchvision classification model: `builder` from torchvision.models, random init.
    `image`: (batch, pixels) per size; `tiny`: arguments for the tiny size (or a function of
    the torchvision module giving them); `tiny_class`: the model class to build the tiny size
    from (with `tiny` as its arguments) where the builder fixes the architecture."""
    image = image or {"tiny": (2, 64), "full": (8, 64), "large": (8, 224)}

    def make(size: str = "tiny") -> RealModel:
        tv = import_torchvision()
        torch.manual_seed(SEED)
        args = dict(kwargs)
        args.setdefault("num_classes", 10 if size == "tiny" else 1000)
        if size == "tiny" and tiny:
            args.update(tiny(tv) if callable(tiny) else tiny)
        if size == "tiny" and tiny_class:
            module = getattr(tv.models, tiny_class)(**args)
        else:
            module = getattr(tv.models, builder)(weights=None, **args)
        batch, pixels = image[size]
        return _images(batch, pixels, args["num_classes"], builder, module)
    return make


def _r3d(size: str = "tiny") -> RealModel:
    """torchvision's 3D-convolution video ResNet-18 (r3d_18: Conv3d 3x3x3 and 1x1x1 with
    strides over time and space, BatchNorm3d, AdaptiveAvgPool3d), fed clips [batch, 3,
    frames, pixels, pixels]. At the tiny size one input of a ReLU (layer2.1, after conv1's
    BatchNorm) lies within 1.3e-7 of the largest of them from zero, so float32 rounding may
    land it on either side of the kink: the gradients of that convolution and of what feeds it
    read 0.15 off float64 there (and torch float32 1.5e-5), while the same network at
    another seed (9e-6), and runs of its blocks alone (up to 1.6e-5), do not."""
    tv = import_torchvision()
    torch.manual_seed(SEED)
    classes = 10 if size == "tiny" else 400
    module = tv.models.video.r3d_18(weights=None, num_classes=classes)
    batch, frames, pixels = {"tiny": (2, 4, 32), "full": (4, 8, 56), "large": (8, 16, 112)}[size]
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(batch, 3, frames, pixels, pixels, generator=generator)
    labels = torch.randint(0, classes, (batch,), generator=generator)
    perturb_constant_tensors(module)
    module.eval()
    return RealModel("r3d_18", module, {"x": x}, "cross_entropy", labels, family="torchvision")


def _vit(size: str = "tiny") -> RealModel:
    tv = import_torchvision()
    from torchvision.models.vision_transformer import VisionTransformer
    torch.manual_seed(SEED)
    if size == "tiny":
        module = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                   hidden_dim=32, mlp_dim=64, num_classes=10)
        return _images(2, 32, 10, "vit_b_16", module)
    pixels, batch = (96, 8) if size == "full" else (224, 8)
    module = tv.models.vit_b_16(weights=None, image_size=pixels)
    return _images(batch, pixels, 1000, "vit_b_16", module)


def _swin(size: str = "tiny") -> RealModel:
    tv = import_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer
    torch.manual_seed(SEED)
    if size == "tiny":
        module = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                 window_size=[4, 4], num_classes=10)
        return _images(2, 32, 10, "swin_t", module)
    pixels = 64 if size == "full" else 224
    return _images(8, pixels, 1000, "swin_t", tv.models.swin_t(weights=None))


class OutOnly(nn.Module):
    """A torchvision segmentation model whose forward returns its ``"out"`` map (a tensor)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def _lraspp(size: str = "tiny") -> RealModel:
    """LR-ASPP on a dilated MobileNetV3-Large backbone (torchvision's lraspp_mobilenet_v3_large,
    random init): per-pixel logits upsampled (bilinear Resize) to the image, cross entropy
    over the class axis 1 against a label per pixel. tiny: the backbone at width 0.25."""
    tv = import_torchvision()
    from torchvision.models.segmentation.lraspp import _lraspp_mobilenetv3
    torch.manual_seed(SEED)
    classes = 5 if size == "tiny" else 21
    width = 0.25 if size == "tiny" else 1.0
    backbone = tv.models.mobilenet_v3_large(weights=None, width_mult=width, dilated=True)
    module = OutOnly(_lraspp_mobilenetv3(backbone, classes))
    batch, pixels = {"tiny": (2, 64), "full": (4, 128), "large": (8, 224)}[size]
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(batch, 3, pixels, pixels, generator=generator)
    labels = torch.randint(0, classes, (batch, pixels, pixels), generator=generator)
    perturb_constant_tensors(module)
    module.eval()
    return RealModel("lraspp_mobilenet_v3_large", module, {"x": x}, "cross_entropy", labels,
                     class_axis=1, family="torchvision")


# ----------------------------------------------------------------------- transformers --

def _gpt2(size: str = "tiny") -> RealModel:
    import_torchvision()          # transformers imports torchvision
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(SEED)
    if size == "tiny":
        cfg, batch, seq = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64), 2, 16
    elif size == "full":
        cfg, batch, seq = GPT2Config(), 2, 64
    else:
        cfg, batch, seq = GPT2Config(n_layer=6), 4, 256
    cfg.attn_implementation = "sdpa"
    model = GPT2LMHeadModel._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("gpt2", model, cfg.vocab_size, batch, seq)


def _bert_config(size: str):
    from transformers import BertConfig
    if size == "tiny":
        return BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                          intermediate_size=64, vocab_size=256, max_position_embeddings=64)
    return BertConfig()


def _bert(size: str = "tiny") -> RealModel:
    import_torchvision()          # transformers imports torchvision
    from transformers import BertForMaskedLM
    torch.manual_seed(SEED)
    cfg = _bert_config(size)
    batch, seq = {"tiny": (2, 16), "full": (2, 64), "large": (8, 256)}[size]
    model = BertForMaskedLM._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("bert", model, cfg.vocab_size, batch, seq)


def _albert(size: str = "tiny") -> RealModel:
    """ALBERT: every layer shares one layer's weights (12 layers at full size, albert-base's
    config), so each shared weight's gradient is the sum of every layer's contribution."""
    import_torchvision()          # transformers imports torchvision
    from transformers import AlbertConfig, AlbertForMaskedLM
    torch.manual_seed(SEED)
    if size == "tiny":
        cfg = AlbertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                           embedding_size=16, vocab_size=256, max_position_embeddings=64)
    else:
        cfg = AlbertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072)   # albert-base-v2
    batch, seq = {"tiny": (2, 16), "full": (2, 64), "large": (8, 256)}[size]
    model = AlbertForMaskedLM._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("albert", model, cfg.vocab_size, batch, seq)


def _bert_classifier(size: str = "tiny") -> RealModel:
    import_torchvision()          # transformers imports torchvision
    from transformers import BertForSequenceClassification
    torch.manual_seed(SEED)
    cfg = _bert_config(size)
    cfg.num_labels = 4
    batch, seq = {"tiny": (2, 16), "full": (4, 128), "large": (8, 256)}[size]
    model = BertForSequenceClassification._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("bert_classifier", model, cfg.vocab_size, batch, seq, classes=4)


def _t5(size: str = "tiny") -> RealModel:
    import_torchvision()          # transformers imports torchvision
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(SEED)
    if size == "tiny":
        cfg = T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=256)
        batch, seq = 2, 16
    else:   # t5-small
        cfg = T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128)
        batch, seq = (2, 64) if size == "full" else (8, 256)
    model = T5ForConditionalGeneration._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    real = _tokens("t5", model, cfg.vocab_size, batch, seq, decoder=True)
    # torch 2.13's dynamo exporter fails on T5's sdpa path ("Failed to decompose the FX graph":
    # the reshape of sdpa's transposed output is traced as a view the decomposed graph cannot
    # take); transformers' eager attention (the same math) exports
    real.notes["dynamo"] = {"attn_implementation": "eager"}
    return real


def _bart(size: str = "tiny") -> RealModel:
    """BART: an encoder-decoder whose one embedding is read three times (the encoder's and the
    decoder's token lookups and the tied output projection), bart-base's config at full size."""
    import_torchvision()          # transformers imports torchvision
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(SEED)
    if size == "tiny":
        cfg = BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=256,
                         max_position_embeddings=64)
        batch, seq = 2, 16
    else:   # bart-base
        cfg = BartConfig(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                         decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=50265)
        batch, seq = (2, 64) if size == "full" else (8, 256)
    model = BartForConditionalGeneration._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("bart", model, cfg.vocab_size, batch, seq, decoder=True)


def _llama(size: str = "tiny") -> RealModel:
    import_torchvision()          # transformers imports torchvision
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SEED)
    if size == "tiny":
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        batch, seq = 2, 16
    else:   # 4 layers, d 512, grouped-query attention
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
        batch, seq = (2, 64) if size == "full" else (4, 512)
    model = LlamaForCausalLM._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("llama", model, cfg.vocab_size, batch, seq)


def _qwen2(size: str = "tiny") -> RealModel:
    import_torchvision()          # transformers imports torchvision
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(SEED)
    if size == "tiny":
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        batch, seq = 2, 16
    else:   # a small Qwen2: 4 layers, d 512, GQA, biased q/k/v, tied embeddings
        cfg = Qwen2Config(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                          tie_word_embeddings=True)
        batch, seq = (2, 64) if size == "full" else (4, 512)
    model = Qwen2ForCausalLM._from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return _tokens("qwen2", model, cfg.vocab_size, batch, seq)


CORPUS: dict[str, Callable[[str], RealModel]] = {
    # torchvision
    # tiny: ResNet-50's Bottleneck block, one per stage (the full depth costs a minute a test)
    "resnet50": _tv("resnet50", tiny_class="ResNet",
                    tiny=lambda tv: {"block": tv.models.resnet.Bottleneck, "layers": [1, 1, 1, 1]},
                    image={"tiny": (4, 128), "full": (8, 64), "large": (8, 224)}),
    "mobilenet_v2": _tv("mobilenet_v2", tiny={"width_mult": 0.25}),
    "mobilenet_v3_large": _tv("mobilenet_v3_large", tiny={"width_mult": 0.25}),
    "efficientnet_b0": _tv("efficientnet_b0"),
    "densenet121": _tv("densenet121", tiny_class="DenseNet", tiny={"growth_rate": 8, "block_config": (2, 2, 2, 2),
                                            "num_init_features": 16}),
    "convnext_tiny": _tv("convnext_tiny"),
    "regnet_y_400mf": _tv("regnet_y_400mf"),
    "vit_b_16": _vit,
    "swin_t": _swin,
    "shufflenet_v2": _tv("shufflenet_v2_x1_0", tiny={}),
    "googlenet": _tv("googlenet", aux_logits=False, init_weights=True),
    # VGG's classifier reads a 7 x 7 pool: 224 px is the smallest input the legacy exporter takes
    "vgg11_bn": _tv("vgg11_bn", image={"tiny": (1, 224), "full": (2, 224), "large": (8, 224)}),
    # segmentation: a per-pixel head upsampled to the image
    "lraspp_mobilenet_v3_large": _lraspp,
    # video: 3D convolutions over frames and pixels
    "r3d_18": _r3d,
    # transformers
    "gpt2": _gpt2,
    "bert": _bert,
    "albert": _albert,
    "bert_classifier": _bert_classifier,
    "t5": _t5,
    "bart": _bart,
    "llama": _llama,
    "qwen2": _qwen2,
}

# the models whose tiny forms the tests build against torch on every run (one per kind of
# structure: residual CNN, depthwise + squeeze-excite + hardswish, windowed attention with
# strided slices, encoder-decoder with relative position buckets, GQA + RoPE decoder,
# dilated convolutions under a bilinear-upsampled per-pixel head, layers sharing their weights)
TEST_SUBSET = ("resnet50", "mobilenet_v3_large", "swin_t", "gpt2", "t5", "llama", "lraspp_mobilenet_v3_large",
               "albert")


def export(model: RealModel, exporter: str = "legacy") -> onnx.ModelProto:
    """The forward model (no loss) in eval mode, output ``logits``, BatchNormalization kept
    as a node and parameters kept as parameters: constant folding off for the legacy exporter
    (``do_constant_folding=False``) and the dynamo exporter's optimizer off
    (``optimize=False``): with torch 2.13 it folds BatchNormalization into the convolutions
    (no batch statistics left to train with) and parameter-only subgraphs into constants
    (Swin's relative position bias gathered from its table, T5's too and its tied
    embedding's transposed copy), which a training graph would then train in their place.
    ``model.notes[exporter]``: a constructor's settings for that exporter, keyword arguments
    of ``torch.onnx.export`` plus ``attn_implementation`` (a transformers model's attention,
    set for the export and restored after)."""
    if exporter not in EXPORTERS:
        raise ValueError("exporter must be one of %s" % (EXPORTERS,))
    module = model.module.eval()
    args = tuple(model.inputs.values())
    names = list(model.inputs)
    options = dict(model.notes.get(exporter, {}))     # a constructor's per-exporter settings
    attention = options.pop("attn_implementation", None)
    if attention:
        inner = module.model
        previous = inner.config._attn_implementation
        inner.set_attn_implementation(attention)
        try:
            return export(RealModel(**{**model.__dict__, "notes": {exporter: options}}), exporter)
        finally:
            inner.set_attn_implementation(previous)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            buffer = io.BytesIO()
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=LEGACY_OPSET,
                              input_names=names, output_names=["logits"],
                              do_constant_folding=False, **options)
            return onnx.load_from_string(buffer.getvalue())
        options.setdefault("optimize", False)
        program = torch.onnx.export(module, args, dynamo=True, opset_version=DYNAMO_OPSET,
                                    input_names=names, output_names=["logits"], verbose=False,
                                    **options)
        return program.model_proto


# ------------------------------------------------------------------ torch's reference --

def _train_mode(module: nn.Module) -> nn.Module:
    """Train mode (BatchNorm on batch statistics) with every stochastic layer off: the eval
    export drops Dropout and stochastic depth, so the reference must too."""
    module.train()
    for m in module.modules():
        kind = type(m).__name__
        if "Dropout" in kind or "StochasticDepth" in kind:
            m.eval()
            if isinstance(getattr(m, "p", None), float):
                m.p = 0.0          # attention kernels read .p whatever the mode
    return module


def torch_step(model: RealModel, dtype: torch.dtype = torch.float32,
               perturb_seed: int | None = None, perturb_relative: float = 2.0 ** -23):
    """(loss, {parameter name: gradient as float64 numpy}) of one training step of a copy
    of the model in `dtype` under torch autograd, the builder's loss (cross entropy over the
    class axis, mean). With `perturb_seed`, every parameter and floating input is first
    multiplied by (1 + perturb_relative · N(0, 1)): a float32-sized nudge (see
    gradient_check)."""
    import copy

    import numpy as np
    module = _train_mode(copy.deepcopy(model.module).to(dtype))
    module.zero_grad()
    args = [t.to(dtype) if t.is_floating_point() else t for t in model.inputs.values()]
    if perturb_seed is not None:
        generator = torch.Generator().manual_seed(perturb_seed)

        def nudge(t):
            return t * (1 + perturb_relative * torch.randn(t.shape, generator=generator, dtype=t.dtype))
        with torch.no_grad():
            for p in module.parameters():
                if p.is_floating_point():
                    p.copy_(nudge(p))
        args = [nudge(t) if t.is_floating_point() else t for t in args]
    out = module(*args)
    axis = model.class_axis if model.class_axis is not None else (1 if out.dim() == 2 else out.dim() - 1)
    loss = torch.nn.functional.cross_entropy(out.movedim(axis, 1), model.labels)
    loss.backward()
    grads = {name: p.grad.detach().to(torch.float64).numpy() for name, p in module.named_parameters()
             if p.requires_grad and p.grad is not None}
    return float(loss.detach()), grads


def match_parameters(model: RealModel, forward: onnx.ModelProto, gradient_of: dict[str, str]):
    """torch parameter name -> (ONNX initializer, "same" | "transpose"), by name, else by
    value (the initializer equals the parameter or its transpose; exporters rename the
    weights they transpose). `gradient_of`: initializer -> gradient output."""
    import numpy as np
    from onnx import numpy_helper
    values = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    matched = {}
    for name, param in model.module.named_parameters():
        if not param.requires_grad:
            continue
        if name in gradient_of:
            matched[name] = (name, "same")
            continue
        p = param.detach().numpy()
        found = []
        for onnx_name in gradient_of:
            v = values.get(onnx_name)
            if v is None:
                continue
            if v.shape == p.shape and np.array_equal(v, p):
                found.append((onnx_name, "same"))
            elif p.ndim == 2 and v.shape == p.T.shape and np.array_equal(v, p.T):
                found.append((onnx_name, "transpose"))
        if len(found) == 1:
            matched[name] = found[0]
        else:
            matched[name] = (None, "%d matches" % len(found))
    return matched


def relative_error(value, expected, floor: float = 0.0) -> float:
    """max |value - expected| / max(max |expected|, floor)."""
    import numpy as np
    value, expected = np.asarray(value, np.float64), np.asarray(expected, np.float64)
    if expected.size == 0:
        return 0.0
    scale = max(float(np.abs(expected).max()), floor)
    diff = float(np.abs(value - expected).max())
    return 0.0 if diff == 0.0 else (diff / scale if scale else float("inf"))


def model_feeds(model: RealModel) -> dict:
    """The model's own inputs and labels as numpy, by the training graph's input names."""
    import numpy as np
    feeds = {k: v.numpy() for k, v in model.inputs.items()}
    feeds["labels"] = model.labels.numpy().astype(np.int64)
    return feeds


def gradient_check(model: RealModel, forward: onnx.ModelProto, train: onnx.ModelProto,
                   threads: int = 1, sensitivity_samples: int = 5) -> dict:
    """Run the training graph once in ONNX Runtime (CPU, `threads`) and compare its loss and
    every gradient with torch float32 and float64. Errors are max |g - g_ref| / max |g_ref|,
    the denominator floored at 1e-3 x the model's largest gradient (a gradient that is zero
    in exact arithmetic is rounding noise on both sides). Returns loss errors, the worst
    gradient errors against float32 and float64, the parameter names of the worst, the
    parameters that could not be matched, and two noise floors on the same measure:

    * ``torch_fp32_vs_fp64``: torch's own float32 result against its float64 one;
    * ``fp32_sensitivity``: how far float64 gradients move when every parameter and input is
      nudged by one float32 epsilon (relative, random; the worst of `sensitivity_samples`
      nudges). A model with a unit whose pre-activation sits within rounding of a kink (a
      ReLU input of -1e-7 among values of 4, as in T5-small) has a large one: float32
      rounding in ONNX Runtime's order of operations can land on the other side of the kink
      than torch's, and that is rounding, not a wrong gradient.

    The same three on every matched gradient at once (``*_l2``: the norm of the differences of
    all of them, concatenated, over the norm of the float64 gradients): a rounding flip at a
    kink moves a few elements, which the worst-element measure above cannot tell from a wrong
    gradient; a wrong rule or scale moves the whole vector."""
    import numpy as np
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    session = ort.InferenceSession(train.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = model_feeds(model)
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))
    gradient_of = {n[:-len("_grad")]: n for n in names if n.endswith("_grad")}
    matched = match_parameters(model, forward, gradient_of)
    loss32, grads32 = torch_step(model, torch.float32)
    loss64, grads64 = torch_step(model, torch.float64)
    nudged = [torch_step(model, torch.float64, perturb_seed=seed)[1]
              for seed in range(1, sensitivity_samples + 1)]
    largest = max(float(np.abs(g).max()) for g in grads64.values())
    floor = 1e-3 * largest
    report = {"loss": float(results["loss"]), "loss_torch": loss64,
              "loss_error": abs(float(results["loss"]) - loss64) / abs(loss64),
              "unmatched": sorted(n for n, (o, _) in matched.items() if o is None),
              "grad_error_fp32": 0.0, "grad_error_fp64": 0.0, "torch_fp32_vs_fp64": 0.0,
              "fp32_sensitivity": 0.0, "worst_fp64": "", "parameters": 0}
    squares = {"grad_error_fp64_l2": 0.0, "torch_fp32_vs_fp64_l2": 0.0, "fp32_sensitivity_l2": 0.0, "": 0.0}
    for name, (onnx_name, layout) in matched.items():
        if onnx_name is None or name not in grads64:
            continue
        value = results[gradient_of[onnx_name]]
        if layout == "transpose":
            value = value.T
        e32 = relative_error(value, grads32[name], floor)
        e64 = relative_error(value, grads64[name], floor)
        own = relative_error(grads32[name], grads64[name], floor)
        report["parameters"] += 1
        report["grad_error_fp32"] = max(report["grad_error_fp32"], e32)
        if e64 > report["grad_error_fp64"]:
            report["grad_error_fp64"], report["worst_fp64"] = e64, name
        report["torch_fp32_vs_fp64"] = max(report["torch_fp32_vs_fp64"], own)
        for other in nudged:
            report["fp32_sensitivity"] = max(report["fp32_sensitivity"],
                                             relative_error(other[name], grads64[name], floor))
        reference = np.asarray(grads64[name], np.float64)
        squares[""] += float(np.sum(reference ** 2))
        squares["grad_error_fp64_l2"] += float(np.sum((np.asarray(value, np.float64) - reference) ** 2))
        squares["torch_fp32_vs_fp64_l2"] += float(np.sum((np.asarray(grads32[name], np.float64) - reference) ** 2))
    for other in nudged:   # the worst nudge's
        total = sum(float(np.sum((np.asarray(other[n], np.float64) - np.asarray(grads64[n], np.float64)) ** 2))
                    for n, (o, _) in matched.items() if o is not None and n in grads64)
        squares["fp32_sensitivity_l2"] = max(squares["fp32_sensitivity_l2"], total)
    norm = squares.pop("") ** 0.5
    for key, value in squares.items():
        report[key] = value ** 0.5 / norm if norm else 0.0
    return report
