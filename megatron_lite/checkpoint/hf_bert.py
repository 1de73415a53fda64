"""Hugging Face ``MegatronBertForPreTraining`` (``model_type: megatron-bert``) <-> our single-process BERT.

Hugging Face's Megatron BERT is this BERT: pre-LayerNorm layers (``attention.ln`` before attention,
``ln`` before the MLP), a final ``encoder.ln``, no embedding LayerNorm, learned positions, token
types, a pooler (tanh on the first token), the LM head (dense, GeLU, LayerNorm, then the decoder
tied to the word embedding with its own bias ``cls.predictions.bias``) and the sentence-order head
``cls.seq_relationship``. Our fused per-head QKV is split into ``query``/``key``/``value``.
Without the binary head (``--bert-no-binary-head``: no token types, no pooler) the export is a
``MegatronBertForMaskedLM`` whose token-type table is zero (adding nothing).

Refused with one line naming the option: RMSNorm, rotary positions, SwiGLU, no biases, grouped-query
attention, a head size other than hidden / heads, ``--openai-gelu`` or the fused bias + GeLU of
``--bias-gelu-fusion``, Megatron's default (both tanh; Hugging Face uses one activation for the MLP and
the LM head, ours is exact in the head: train BERTs to export with ``--no-bias-gelu-fusion``),
mixture of experts; on import, a causal (``is_decoder``) or relative-position megatron-bert.
"""

from __future__ import annotations

from ..config import Config
from ..errors import ConfigError
from ..fusions.config import tanh_gelu
from .hf import _dims, _require, qkv_to_separate, separate_to_qkv
from .hf_defaults import require_sizes

ATTN, QKV, PROJ = "self_attention.", "self_attention.linear_qkv.", "self_attention.linear_proj."
# ours (per layer) <-> Hugging Face (per layer), weights and biases alike
LAYER_PAIRS = (("input_norm.", "attention.ln."), (PROJ, "attention.output.dense."), ("pre_mlp_norm.", "ln."),
               ("mlp.linear_fc1.", "intermediate.dense."), ("mlp.linear_fc2.", "output.dense."))
HEAD_PAIRS = (("encoder.final_norm.", "bert.encoder.ln."), ("lm_head.dense.", "cls.predictions.transform.dense."),
              ("lm_head.layer_norm.", "cls.predictions.transform.LayerNorm."), ("pooler.dense.", "bert.pooler.dense."),
              ("binary_head.", "cls.seq_relationship."))


def check_bert(cfg: dict) -> None:
    """Raise one ConfigError naming the first option the megatron-bert format cannot express."""
    _, hidden, heads, groups, head_dim = _dims(cfg)
    for ok, words in (
        (not cfg.get("multi_latent_attention"), "--multi-latent-attention"),
        (not cfg.get("qk_layernorm"), "--qk-layernorm"),
        (cfg.get("normalization", "LayerNorm") == "LayerNorm", "--normalization RMSNorm"),
        (cfg.get("position_embedding_type", "learned_absolute") == "learned_absolute", "--position-embedding-type rope"),
        (not cfg.get("swiglu"), "--swiglu"), (not cfg.get("disable_bias_linear"), "--disable-bias-linear"),
        (groups == heads, f"--num-query-groups {groups}"), (head_dim * heads == hidden, f"--kv-channels {head_dim}"),
        (not cfg.get("openai_gelu"), "--openai-gelu"), (not cfg.get("num_experts"), "--num-experts"),
        (not tanh_gelu(cfg), "--bias-gelu-fusion (the MLP's fused GeLU is the tanh approximation, the LM head's is "
         "exact, and megatron-bert has one hidden_act for both; train with --no-bias-gelu-fusion)"),
    ):
        _require(ok, f"{words} cannot be expressed in the megatron-bert format")


def to_bert(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded BERT state dict ``sd``."""
    check_bert(cfg)
    layers, hidden, heads, groups, d = _dims(cfg)
    head = not cfg.get("bert_no_binary_head")
    tied = not cfg.get("untie_embeddings_and_output_weights", False)
    word = sd["embedding.word_embeddings.weight"]
    types = sd["embedding.tokentype_embeddings.weight"] if head else word.new_zeros(2, hidden)
    out = {"bert.embeddings.word_embeddings.weight": word, "bert.embeddings.token_type_embeddings.weight": types,
           "bert.embeddings.position_embeddings.weight": sd["embedding.position_embeddings.weight"],
           "cls.predictions.bias": sd["output_layer.bias"]}
    for i in range(layers):
        src, dst = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = qkv_to_separate(sd[src + QKV + kind], heads, groups, d)
            out.update({dst + f"attention.self.query.{kind}": q, dst + f"attention.self.key.{kind}": k,
                        dst + f"attention.self.value.{kind}": v})
            out.update({dst + theirs + kind: sd[src + ours + kind] for ours, theirs in LAYER_PAIRS})
    for ours, theirs in HEAD_PAIRS:
        if head or "pooler" not in ours and "binary" not in ours:
            out.update({theirs + kind: sd[ours + kind] for kind in ("weight", "bias")})
    if not tied:  # untied, transformers (v5) adds the decoder's own bias, not cls.predictions.bias: write both
        out["cls.predictions.decoder.weight"] = sd["output_layer.weight"]
        out["cls.predictions.decoder.bias"] = sd["output_layer.bias"].clone()
    dtype = str(word.dtype).replace("torch.", "")
    hf = {"architectures": ["MegatronBertForPreTraining" if head else "MegatronBertForMaskedLM"],
          "model_type": "megatron-bert", "vocab_size": int(cfg["vocab_size"]), "hidden_size": hidden,
          "num_hidden_layers": layers, "num_attention_heads": heads,
          "intermediate_size": cfg.get("ffn_hidden_size") or 4 * hidden, "hidden_act": "gelu",
          "hidden_dropout_prob": cfg.get("hidden_dropout", 0.1), "attention_probs_dropout_prob":
          cfg.get("attention_dropout", 0.1), "max_position_embeddings": cfg.get("max_position_embeddings") or
          cfg.get("seq_length"), "type_vocab_size": 2, "initializer_range": cfg.get("init_method_std", 0.02),
          "layer_norm_eps": cfg.get("norm_epsilon", 1e-5), "tie_word_embeddings": tied, "dtype": dtype,
          "torch_dtype": dtype, "pad_token_id": 0}
    return hf, out


def from_bert(hf: dict, hf_sd: dict) -> tuple[dict, dict]:
    """(flat config, single-process unpadded BERT state dict) of a megatron-bert config and tensors
    (the binary head when the weights have ``cls.seq_relationship``)."""
    require_sizes(hf, "megatron-bert")
    _require(hf.get("hidden_act", "gelu") == "gelu", f"hidden_act {hf.get('hidden_act')!r} cannot be expressed "
             "(BERT's GeLU is exact: 'gelu')")
    _require(not hf.get("is_decoder") and not hf.get("add_cross_attention"), "is_decoder / add_cross_attention (a "
             "causal MegatronBertForCausalLM or an encoder-decoder part) cannot be expressed: this BERT is bidirectional")
    _require(hf.get("position_embedding_type", "absolute") == "absolute", f"position_embedding_type "
             f"{hf.get('position_embedding_type')!r} cannot be expressed (learned absolute positions only)")
    _require(hf.get("type_vocab_size", 2) == 2, f"type_vocab_size {hf.get('type_vocab_size')} cannot be expressed "
             "(two token types, with the binary head)")
    hidden, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head = "cls.seq_relationship.weight" in hf_sd
    types = hf_sd.get("bert.embeddings.token_type_embeddings.weight")
    _require(head or types is None or not types.any(), "token_type_embeddings without the sentence-order head "
             "(cls.seq_relationship) cannot be expressed: --bert-no-binary-head has no token types")
    cfg = Config().flat()
    cfg.update(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
               kv_channels=hidden // heads, ffn_hidden_size=hf["intermediate_size"],
               max_position_embeddings=hf["max_position_embeddings"], seq_length=hf["max_position_embeddings"],
               position_embedding_type="learned_absolute", normalization="LayerNorm",
               norm_epsilon=hf.get("layer_norm_eps", 1e-12), swiglu=False, disable_bias_linear=False,
               untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
               attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
               hidden_dropout=hf.get("hidden_dropout_prob", 0.1), init_method_std=hf.get("initializer_range", 0.02),
               vocab_size=hf["vocab_size"], padded_vocab_size=None, bert_no_binary_head=not head,
               bias_gelu_fusion=False)  # exact GeLU: fine-tune with --no-bias-gelu-fusion
    t = hf_sd
    try:
        sd = {"embedding.word_embeddings.weight": t["bert.embeddings.word_embeddings.weight"],
              "embedding.position_embeddings.weight": t["bert.embeddings.position_embeddings.weight"],
              "output_layer.bias": t["cls.predictions.bias"]}
        if head:
            sd["embedding.tokentype_embeddings.weight"] = t["bert.embeddings.token_type_embeddings.weight"]
        for i in range(layers):
            src, dst = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
            for kind in ("weight", "bias"):
                sd[dst + QKV + kind] = separate_to_qkv(*(t[src + f"attention.self.{n}.{kind}"] for n in ("query", "key", "value")),
                                                       heads, heads, hidden // heads)
                sd.update({dst + ours + kind: t[src + theirs + kind] for ours, theirs in LAYER_PAIRS})
        for ours, theirs in HEAD_PAIRS:
            if head or "pooler" not in ours and "binary" not in ours:
                sd.update({ours + kind: t[theirs + kind] for kind in ("weight", "bias")})
        if cfg["untie_embeddings_and_output_weights"]:
            sd["output_layer.weight"] = t["cls.predictions.decoder.weight"]
            if "cls.predictions.decoder.bias" in t:  # the bias an untied transformers model adds
                sd["output_layer.bias"] = t["cls.predictions.decoder.bias"]
    except KeyError as err:
        raise ConfigError(f"the megatron-bert weights have no tensor {err.args[0]}; the folder does not match its "
                          "config.json") from None
    return cfg, {k: v.contiguous() for k, v in sd.items()}
