"""What is supported, per family and per feature: the one source of ``analyze --list-archs`` and the README table.

Each adapter family registers itself with :func:`register_family` (the HF ``model_type`` values it
reads, what the decomposition covers), then every feature with :func:`register_feature`: a
feature is either *supported* (read exactly into the spec) or *refused* (with what would be needed).
Adapters added later (new families, new features of an existing family) call the same two
functions from their own modules; the README's table is :func:`support_table` verbatim (a test
compares them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Family", "register_family", "register_feature", "families", "support_table"]


@dataclass
class Family:
    """One adapter family: which checkpoints it reads and what it does with each feature."""

    name: str  # the adapter name (``arch=``)
    model_types: tuple[str, ...]  # HF model_type values read by this adapter
    covered: str  # what of the model is inside the decomposition
    supported: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (feature, what would be needed)
    selected: str = ""  # how a run gets this family, where not ``--arch NAME`` (or the config's model_type)


_FAMILIES: dict[str, Family] = {}


def register_family(name: str, model_types: tuple[str, ...], covered: str, selected: str = "") -> Family:
    """Add (or return) a family; registering one twice keeps the first description.  ``selected``: how a run
    gets it where ``--arch NAME`` does not (the README's column said ``--arch`` for ``mapped`` and
    ``per-matrix``, which --arch refuses: red team 217)."""
    return _FAMILIES.setdefault(name, Family(name, tuple(model_types), covered, selected=selected))


def register_feature(family: str, feature: str, *, refused: str | None = None) -> None:
    """Record ``feature`` of ``family`` as supported, or as refused with what would be needed."""
    fam = _FAMILIES[family]
    if refused is None:
        # a feature an adapter learnt to read is no longer refused
        fam.refused = [(f, r) for f, r in fam.refused if f != feature]
        if feature not in fam.supported:
            fam.supported.append(feature)
    else:
        fam.refused = [(f, r) for f, r in fam.refused if f != feature] + [(feature, refused)]


def families() -> list[Family]:
    return list(_FAMILIES.values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def support_table() -> str:
    """The support table in Markdown: one row per family (supported features, refused features)."""
    lines = ["| family | selected by | HF `model_type` | covered by the decomposition | supported features | "
             "refused (what would be needed) |",
             "|---|---|---|---|---|---|"]
    for fam in families():
        refused = "; ".join(f"{f}: {r}" for f, r in fam.refused) or "-"
        lines.append(" | ".join([
            f"| `{fam.name}`", _cell(fam.selected or f"`--arch {fam.name}` or the config's `model_type`"),
            ", ".join(fam.model_types) or "-", _cell(fam.covered),
            _cell(", ".join(fam.supported) or "-"), _cell(refused) + " |",
        ]))
    return "\n".join(lines) + "\n"


# -- the families of this package's adapters -----------------------------------------------------

def _register_builtin() -> None:
    rope_scaling = "the scaled frequencies as B_KQ's supremum over relative positions"
    # how a run gets a family other than by ``--arch NAME`` or its config's model_type
    clip = ("`--arch {0}`, which picks this tower of a two-tower `clip` checkpoint (without it, or with `--arch "
            "clip`, such a checkpoint is refused with this choice); a `{0}_model` config's `model_type`")
    selected = {"clip_text": clip.format("clip_text"), "clip_vision": clip.format("clip_vision"),
                "torch_encoder": "a `torch.nn.TransformerEncoder(Layer)` module (`load(module)`), or "
                                 "`--arch torch_encoder`",
                "reference": "transcover's own checkpoints (their metadata), or `--arch reference`",
                "mapped": "`--roles FILE` (or `transcover_roles.json` beside the weights); not an `--arch` value",
                "per-matrix": "automatic: `analyze` of a checkpoint no adapter reads and no `--roles` maps; "
                              "not an `--arch` value"}
    for name, types, covered, yes, no in (
        ("bert", ("bert", "roberta", "xlm-roberta"), "all layers; embedding LayerNorm as input norm",
         ["post-norm LayerNorm", "q/k/v/o biases", "absolute positions (outside)", "encoder or is_decoder (causal)"],
         [("relative position_embedding_type", "relative-position score terms per head"),
          ("cross-attention", "a second input sequence in every bound")]),
        ("distilbert", ("distilbert",), "all layers; embedding LayerNorm as input norm",
         ["post-norm LayerNorm", "q/k/v/o biases"], []),
        ("gpt2", ("gpt2",), "all layers and ln_f",
         ["pre-norm LayerNorm", "fused c_attn (Conv1D)", "causal", "scale_attn_by_inverse_layer_idx"],
         [("cross-attention", "a second input sequence in every bound")]),
        ("llama", ("llama", "mistral", "qwen2", "qwen3"), "all layers and the final RMSNorm",
         ["pre-norm RMSNorm", "grouped-query attention", "RoPE (default)", "gated SiLU FFN",
          "q/k/v/o and MLP biases", "sliding-window attention (a mask)",
          "rope scaling: linear, llama3, yarn, dynamic NTK (F22)",
          "per-head query/key RMSNorm (Qwen3; F23, G.3 and covering split)"],
         [("rope scaling longrope", "one frequency list per length regime, each as in dynamic NTK; " + rope_scaling),
          ("partial_rotary_factor != 1",
           "one meaning: transformers 5 rotates the whole head, 4 computed frequencies for part of it "
           "(also refused by olmo, olmo2, falcon, gemma, moe)")]),
        ("gemma", ("gemma", "gemma2", "gemma3_text", "gemma3"), "all layers and the final RMSNorm (Gemma 3: text tower)",
         ["RMSNorm with the (1 + gamma) gain", "GeGLU (gated gelu_tanh) FFN", "embedding scaled by sqrt(d) (input)",
          "multi-/grouped-query attention, explicit head_dim", "sandwich norms x + N_post(f(N_pre x)) (F26)",
          "query_pre_attn_scalar", "attention-logit soft-capping (F24)", "per-layer sliding window / global",
          "per-head query/key RMSNorm (Gemma 3; F23, G.3 and covering split)", "per-layer RoPE bases (local / global)",
          "final-logit soft-capping (outside g_L, recorded)"],
         [("use_bidirectional_attention", "a sliding window symmetric around the query in the mask"),
          ("Gemma 1 hidden_act and hidden_activation naming different functions",
           "one meaning: transformers 5 reads hidden_act (legacy gelu as gelu_tanh), 4 read hidden_activation")]),
        ("olmo2", ("olmo2",), "all layers and the final RMSNorm",
         ["post-norm inside the residual x + N(f(x)) (F26)",
          "query/key RMSNorm over the whole projection (F23 with all heads' width; G.3 and covering split)",
          "gated SiLU FFN", "grouped-query attention", "rope scaling: linear, llama3, yarn, dynamic NTK (F22)"],
         [("rope scaling longrope", "one frequency list per length regime, each as in dynamic NTK")]),
        ("gpt_neox", ("gpt_neox",), "all layers and final_layer_norm",
         ["pre-norm LayerNorm", "parallel residual (F21)", "sequential residual", "partial rotary (rotary_pct)",
          "q/k/v/o biases (under RoPE: inputs, G.3 and covering certified, F22)",
          "rope scaling: linear, llama3, yarn, dynamic NTK (F22)"],
         [("rope scaling longrope", "one frequency list per length regime, each as in dynamic NTK")]),
        ("gptj", ("gptj",), "all layers and ln_f",
         ["parallel residual with one LayerNorm (F21)", "interleaved partial rotary (rotary_dim, exact column permutation)",
          "MLP biases"], []),
        ("falcon", ("falcon", "RefinedWeb", "RefinedWebModel"), "all layers and ln_f",
         ["parallel residual with one or two LayerNorms (F21)", "sequential residual (parallel_attn=False)",
          "multi-query and grouped-query attention (new_decoder_architecture)", "RoPE (default)",
          "rope scaling: linear, llama3, yarn, dynamic NTK (F22)", "q/k/v/o and MLP biases (bias=True; under RoPE: inputs, G.3 and covering certified, F22)"],
         [("alibi", "the per-head linear bias in |i - j| in B_KQ and in the attention Lipschitz bound"),
          ("rope scaling longrope", "one frequency list per length regime, each as in dynamic NTK")]),
        ("phi", ("phi",), "all layers and final_layernorm",
         ["parallel residual with one LayerNorm (F21)", "partial rotary (partial_rotary_factor)",
          "grouped-query attention", "q/k/v/o and MLP biases (under RoPE: inputs, G.3 and covering certified, F22)",
          "rope scaling: linear, llama3, yarn, dynamic NTK (F22)"],
         [("qk_layernorm", "a per-head LayerNorm q/k norm in the spec (centring, shift beta) and F23's radius "
                           "sqrt(d_head) max|gamma| + ||beta|| in B_KQ and the attention bound"),
          ("rope scaling longrope", "one frequency list per length regime, each as in dynamic NTK")]),
        ("phi3", ("phi3",), "none (per-matrix norms only)", [],
         [("fused qkv_proj, gate_up_proj", "splitting them onto the llama spec ([Q; K; V] and [gate; up] rows)"),
          ("longrope", "one frequency list per length regime, each as in dynamic NTK")]),
        ("olmo", ("olmo",), "all layers and the final norm",
         ["non-parametric LayerNorm (no gamma/beta)", "grouped-query attention", "RoPE (default)", "gated SiLU FFN",
          "q/k/v/o biases (attention_bias)", "rope scaling: linear, llama3, yarn, dynamic NTK (F22)"],
         [("clip_qkv", "the clamp of q, k, v to [-c, c] in the spec's attention (1-Lipschitz elementwise; "
                       "scores then <= s c^2 d_head)")]),
        ("moe", ("mixtral", "qwen2_moe", "qwen3_moe"), "all layers (forward and norms); no bound needing a Lipschitz constant",
         ["Llama attention (GQA, RoPE, Qwen3 q/k norm)", "top-k routed gated experts (forward exact)",
          "per-expert and router norms (analyze)", "Qwen2-MoE shared expert with sigmoid gate", "dense mlp_only_layers",
          "checkpoint layouts: stacked experts, mlp.experts.<e>, block_sparse_moe.experts.<e>"],
         [("Lipschitz, G.3 and covering bounds", "a Lipschitz bound of a discontinuous map does not exist (THEORY F25): "
                                                 "a dense router, or inputs away from the switching set")]),
        ("t5", ("t5", "mt5"), "encoder: all blocks and encoder.final_layer_norm",
         ["pre-norm RMSNorm without shift", "unscaled attention (scale 1)",
          "relative position bias shared from layer 0 (F28)", "ReLU FFN", "gated-GELU FFN (v1.1, mT5, Flan-T5)"],
         [("decoder", "cross-attention to the encoder output, a second input sequence in every bound"),
          ("per-block relative bias tables (UMT5)", "one RelativeBiasSpec per layer")]),
        ("vit", ("vit",), "all layers and the final LayerNorm",
         ["pre-norm LayerNorm", "q/k/v/o biases", "patch projection (outside)"], []),
        ("clip_text", ("clip", "clip_text_model"), "text tower: all layers and final_layer_norm",
         ["pre-norm LayerNorm", "causal", "quick_gelu", "q/k/v/o biases"], []),
        ("clip_vision", ("clip", "clip_vision_model"), "vision tower: pre_layrnorm (input norm) and all layers",
         ["pre-norm LayerNorm", "quick_gelu", "q/k/v/o biases", "patch projection (outside)"],
         [("post_layernorm", "acts on the pooled class token only, not on the hidden states")]),
        ("whisper", ("whisper",), "encoder layers and encoder.layer_norm",
         ["pre-norm LayerNorm", "q/v/o biases (k without)", "conv front-end kernels (outside, per matrix)"],
         [("decoder", "cross-attention to the encoder output"),
          ("conv front-end in the bounds", "Lipschitz constants of the two GELU convolutions")]),
        ("deberta_v2", ("deberta-v2", "deberta"), "none (per-matrix norms only)", [],
         [("disentangled attention", "per-head norms of the content-to-position and position-to-content maps "
                                     "over the relative embeddings, and their terms in the attention bound")]),
        ("torch_encoder", ("-",), "torch.nn.TransformerEncoder(Layer): all layers and its norm",
         ["pre- or post-norm", "fused in_proj", "relu/gelu/silu", "nn.LayerNorm, nn.RMSNorm or nn.Identity norms"],
         [("add_bias_kv / add_zero_attn", "an extra key in every softmax"),
          ("other submodules (named in the message)", "their function in the spec")]),
        ("reference", ("-",), "transcover's ReferenceTransformer", ["everything it defines"], []),
        ("mapped", ("-",), "any layout whose roles a mapping file names (`--roles`)",
         ["the llama/bert/gpt2-style blocks named by the file"], []),
        ("per-matrix", ("any",), "no decomposition: every 2-D weight on its own (`analyze` only)",
         ["certified spectral, Frobenius and (2,1) norms per matrix"],
         [("Lipschitz, G.3, covering bounds", "the architecture: name its roles with a mapping file")]),
    ):
        register_family(name, types, covered, selected.get(name, ""))
        for feature in yes:
            register_feature(name, feature)
        for feature, need in no:
            register_feature(name, feature, refused=need)


_register_builtin()
