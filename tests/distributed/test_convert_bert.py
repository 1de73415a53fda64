"""tools/checkpoint/convert.py --model-type BERT on a checkpoint saved by a real TP2 x PP2 run (four
gloo ranks, with the state of one Adam step): LM head with its own (vocabulary-split) bias, pooler,
binary head, token types, padded vocabulary; and the Hugging Face ``MegatronBertForPreTraining`` /
``MegatronBertForMaskedLM`` style. Every parameter is random (norms and biases too), so a misplaced
tensor changes the outputs. Weights and optimizer state move bit-exactly; outputs at another TP size
or in transformers agree within fp32 rounding (rtol/atol 1e-5)."""

import os

import pytest
import torch

from megatron_lite.checkpoint import load_bert_checkpoint, load_checkpoint, merge_checkpoint, save_checkpoint
from megatron_lite.config import Config, ModelConfig
from megatron_lite.models import BertModel, TransformerConfig
from megatron_lite.optim import build_optimizer
from megatron_lite.parallel.pipeline import layer_ranges
from megatron_lite.parallel.tensor import padded_vocab_size
from pretrain_bert import BertConfig
from tests.convert_helpers import assert_same_weights, convert, randomize, same_optimizer
from tests.harness import cached_state, run_ranks
from tests.tools import load_tool

VOCAB = 100


def model_config(tp=1) -> ModelConfig:
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=16,
                      max_position_embeddings=16, vocab_size=VOCAB, make_vocab_size_divisible_by=8,
                      attention_dropout=0.0, hidden_dropout=0.0)
    cfg.padded_vocab_size = padded_vocab_size(VOCAB, 8, tp)
    return cfg


def run_config(tp, pp, root) -> Config:
    config = Config(model=model_config(tp), extra_sections=("bert",))
    config.fusion.bias_gelu_fusion = False  # the models here are built unfused (exact GeLU), not by the CLI
    config.bert = BertConfig()
    config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size = tp, pp
    config.checkpoint.save = config.checkpoint.load = root
    config.checkpoint.no_load_optim = config.checkpoint.no_load_rng = True
    return config


def build_chunks(state):
    (start, end), = layer_ranges(4, state.pp_size)[state.pp_rank]
    config = TransformerConfig.from_model(model_config(state.tp_size), tensor_model_parallel_size=state.tp_size)
    return [BertModel(config, state, pre_process=state.is_first_stage(), post_process=state.is_last_stage(),
                      layer_start=start, layer_end=end).eval()]


def save_source(root, vocab_txt):
    """Random weights and the state of one Adam step on random (layout-independent) gradients."""
    state = cached_state(tp=2, pp=2)
    chunks = build_chunks(state)
    randomize(chunks[0], state)
    config = run_config(2, 2, root)
    config.data.vocab_file = vocab_txt  # a WordPiece vocabulary: carried along as tokenizer/vocab.txt
    optimizer = build_optimizer(config, chunks, state)
    randomize(chunks[0], state, seed=5, grad=True)
    assert optimizer.step()[0]
    save_checkpoint(7, chunks, optimizer, None, 56, config, state)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    (folder / "bert-vocab.txt").write_text("[PAD]\n[CLS]\n")
    root = str(folder / "tp2pp2")
    run_ranks(4, save_source, root, str(folder / "bert-vocab.txt"))
    return root


def batch():
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)
    types = torch.zeros(2, 16, dtype=torch.long)
    types[:, 9:] = 1
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 12:] = 0
    return tokens, padding, types, labels


def tp2_outputs(root):
    """Load a TP2 checkpoint as training does (strict, at its layout): per-token MLM loss, binary logits."""
    state = cached_state(tp=2)
    chunks = build_chunks(state)
    assert load_checkpoint(chunks, None, None, run_config(2, 1, root), state) == (7, 56)
    with torch.no_grad():
        return chunks[0](*batch())


def test_tp2pp2_to_tp1_and_back_keeps_every_weight_file_and_optimizer_state(source, tmp_path):
    tp1, back = tmp_path / "tp1", tmp_path / "back"
    assert convert("BERT", "--load-dir", source, "--save-dir", tp1, "--target-tensor-parallel-size", 1,
                   "--target-pipeline-parallel-size", 1) == 0
    assert convert("BERT", "--load-dir", tp1, "--save-dir", back, "--target-tensor-parallel-size", 2,
                   "--target-pipeline-parallel-size", 2) == 0
    assert (tp1 / "tokenizer" / "vocab.txt").read_text() == "[PAD]\n[CLS]\n"
    original, _ = merge_checkpoint(source)
    assert "output_layer.bias" in original and "binary_head.weight" in original
    for out, tp in ((tp1, 1), (back, 2)):
        got, cfg = merge_checkpoint(str(out))
        assert cfg["padded_vocab_size"] == padded_vocab_size(VOCAB, 8, tp) and "bert_no_binary_head" in cfg
        assert_same_weights(got, original, VOCAB)
    for t in range(2):  # back at TP2 x PP2: the tensors (weights, Adam state) training wrote, param_meta, ranges
        for p in range(2):
            name = os.path.join("iter_0000007", f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
            want, got = (torch.load(os.path.join(root, name), weights_only=True) for root in (source, str(back)))
            assert got["param_meta"] == want["param_meta"] and got["layer_ranges"] == want["layer_ranges"]
            assert got["model"][0].keys() == want["model"][0].keys()
            real = max(0, min(56, VOCAB - t * 56))  # vocabulary shards (56 rows at TP2): the real rows
            for k, v in want["model"][0].items():
                rows = real if "word_emb" in k or "output_layer" in k else None
                assert torch.equal(got["model"][0][k][:rows], v[:rows]), k
            same_optimizer(got["optimizer"], want["optimizer"], 56, real)


def test_converted_bert_gives_the_same_losses_and_binary_logits(source, tmp_path):
    tp1, tp2 = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    assert convert("BERT", "--load-dir", source, "--save-dir", tp1, "--target-tensor-parallel-size", 1,
                   "--target-pipeline-parallel-size", 1) == 0
    assert convert("BERT", "--load-dir", source, "--save-dir", tp2, "--target-pipeline-parallel-size", 1) == 0
    reference, _ = load_bert_checkpoint(source)
    converted, _ = load_bert_checkpoint(tp1)
    with torch.no_grad():
        want_loss, want_binary = reference(*batch())
        got_loss, got_binary = converted(*batch())
    assert torch.equal(got_loss, want_loss) and torch.equal(got_binary, want_binary)
    for loss, binary in run_ranks(2, tp2_outputs, tp2):
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(binary, want_binary, rtol=1e-5, atol=1e-5)


def test_hf_export_gives_the_same_outputs_in_transformers(source, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert convert("BERT", "--saver", "hf", "--load-dir", source, "--save-dir", out) == 0
    assert (out / "vocab.txt").read_text() == "[PAD]\n[CLS]\n"
    hf = transformers.AutoModelForPreTraining.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "MegatronBertForPreTraining"
    tokens, padding, types, _ = batch()
    reference, _ = load_bert_checkpoint(source)
    with torch.no_grad():
        logits, binary = reference(tokens, padding, types)
        theirs = hf(input_ids=tokens, attention_mask=padding, token_type_ids=types)
    torch.testing.assert_close(theirs.prediction_logits, logits[..., :VOCAB], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs.seq_relationship_logits, binary, rtol=1e-5, atol=1e-5)


def test_megatron_hf_megatron_round_trip_is_bit_exact(source, tmp_path):
    pytest.importorskip("safetensors")
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert convert("BERT", "--saver", "hf", "--load-dir", source, "--save-dir", hf) == 0
    assert convert("BERT", "--loader", "hf", "--load-dir", hf, "--save-dir", back, "--target-tensor-parallel-size", 2,
                   "--target-pipeline-parallel-size", 2, "--make-vocab-size-divisible-by", 8) == 0
    got, cfg = merge_checkpoint(str(back))
    assert cfg["bert_no_binary_head"] is False and cfg["padded_vocab_size"] == padded_vocab_size(VOCAB, 8, 2)
    assert_same_weights(got, merge_checkpoint(source)[0], VOCAB)


def test_hf_import_of_a_transformers_megatron_bert_gives_the_same_outputs(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    cfg = transformers.MegatronBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=48, max_position_embeddings=16, layer_norm_eps=1e-5,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.MegatronBertForPreTraining(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(tmp_path / "hf"))
    words = [f"w{i}" for i in range(VOCAB - 5)]
    (tmp_path / "hf" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    out = tmp_path / "mega"
    assert convert("BERT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--target-tensor-parallel-size", 2, "--make-vocab-size-divisible-by", 8) == 0
    ours, _ = load_bert_checkpoint(str(out))
    tokens, padding, types, _ = batch()
    with torch.no_grad():
        logits, binary = ours(tokens, padding, types)
        theirs = model(input_ids=tokens, attention_mask=padding, token_type_ids=types)
    torch.testing.assert_close(logits[..., :VOCAB], theirs.prediction_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, theirs.seq_relationship_logits, rtol=1e-5, atol=1e-5)
    # tools/fill_mask.py reads the vocab.txt the import kept in <save>/tokenizer: no tokenizer flag
    assert load_tool("fill_mask").main(["--load", str(out), "--text", "w3 [MASK] w7", "--top-k", "2"]) == 0


def test_bert_without_binary_head_exports_as_masked_lm_and_comes_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron_lite.parallel.state import ParallelState

    state = ParallelState()
    config = TransformerConfig.from_model(model_config())
    model = BertModel(config, state, num_tokentypes=0, add_binary_head=False).eval()
    randomize(model, state, seed=11)
    run = run_config(1, 1, str(tmp_path / "src"))
    run.bert = BertConfig(bert_no_binary_head=True)
    save_checkpoint(7, [model], None, None, 56, run, state)
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert convert("BERT", "--saver", "hf", "--load-dir", tmp_path / "src", "--save-dir", hf) == 0
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(str(hf)).eval()
    assert type(theirs).__name__ == "MegatronBertForMaskedLM"
    tokens, padding, _, _ = batch()
    with torch.no_grad():
        logits, binary = model(tokens, padding)
        torch.testing.assert_close(theirs(input_ids=tokens, attention_mask=padding).logits, logits[..., :VOCAB],
                                   rtol=1e-5, atol=1e-5)
    assert binary is None
    assert convert("BERT", "--loader", "hf", "--load-dir", hf, "--save-dir", back,
                   "--make-vocab-size-divisible-by", 8) == 0
    got, cfg = merge_checkpoint(str(back))
    assert cfg["bert_no_binary_head"] is True
    assert_same_weights(got, merge_checkpoint(str(tmp_path / "src"))[0], VOCAB)


def test_model_type_and_hf_refusals_name_the_option(source, tmp_path, capsys):
    cases = [
        (["GPT", "--load-dir", source], "--model-type GPT"),
        (["BERT", "--saver", "hf", "--hf-style", "llama", "--load-dir", source], "--hf-style llama"),
        (["BERT", "--load-dir", source, "--target-expert-parallel-size", 2], "--target-expert-parallel-size 2"),
    ]
    for i, (argv, words) in enumerate(cases):
        assert convert(*argv, "--save-dir", tmp_path / f"out{i}") == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert not (tmp_path / f"out{i}").exists()


@pytest.mark.parametrize("with_vocab_txt", [False, True])
def test_hf_bert_with_a_tokenizer_json_imports_a_wordpiece_tokenizer_fill_mask_reads(tmp_path, capsys, with_vocab_txt):
    """transformers saves a BERT tokenizer as tokenizer.json (v5: without vocab.txt); the import must
    still give the BERT tools a WordPiece vocab.txt (was: HuggingFaceTokenizer, which pretrain_bert.py
    and fill_mask.py refuse), with the case setting of its normalizer and Hugging Face's ids."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    cfg = transformers.MegatronBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          intermediate_size=48, max_position_embeddings=16, layer_norm_eps=1e-5)
    transformers.MegatronBertForPreTraining(cfg).save_pretrained(str(tmp_path / "hf"))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Paris", "paris", "##is", "Par"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    hf_tok = tokenizers.Tokenizer(tokenizers.models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf_tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=False)  # a cased BERT
    hf_tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    hf_tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    if with_vocab_txt:  # transformers 4 wrote both files
        (tmp_path / "hf" / "vocab.txt").write_text("".join(w + "\n" for w in words))
    out = tmp_path / "mega"
    assert convert("BERT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out) == 0
    vocab_txt = out / "tokenizer" / "vocab.txt"
    assert f"--tokenizer-type BertWordPieceCase --vocab-file {vocab_txt}" in capsys.readouterr().out
    from megatron_lite.data.tokenizers import build_tokenizer

    ours = build_tokenizer("BertWordPieceCase", vocab_file=str(vocab_txt))
    for text in ("Paris w3 paris", "Parisis w7, W7"):
        assert ours.tokenize(text) == hf_tok.encode(text).ids
    assert load_tool("fill_mask").main(["--load", str(out), "--text", "Paris [MASK] w7", "--top-k", "2"]) == 0
    assert "[MASK] at 2:" in capsys.readouterr().out


@pytest.mark.parametrize("head", [True, False])
def test_untied_output_layer_exports_its_bias_and_imports_transformers_own(tmp_path, head):
    """--untie-embeddings-and-output-weights: transformers' untied MegatronBert adds
    cls.predictions.decoder.bias (not cls.predictions.bias); the export must write it (was left out:
    random-initialised there, logits off by ~1) and the import must read it."""
    transformers = pytest.importorskip("transformers")
    from megatron_lite.parallel.state import ParallelState

    state = ParallelState()
    cfg = model_config()
    cfg.untie_embeddings_and_output_weights = True
    model = BertModel(TransformerConfig.from_model(cfg), state, num_tokentypes=2 if head else 0,
                      add_binary_head=head).eval()
    randomize(model, state, seed=13)
    run = run_config(1, 1, str(tmp_path / "src"))
    run.model, run.bert = cfg, BertConfig(bert_no_binary_head=not head)
    save_checkpoint(7, [model], None, None, 56, run, state)
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert convert("BERT", "--saver", "hf", "--load-dir", tmp_path / "src", "--save-dir", hf) == 0
    cls = transformers.MegatronBertForPreTraining if head else transformers.MegatronBertForMaskedLM
    theirs = cls.from_pretrained(str(hf)).eval()
    tokens, padding, types, _ = batch()
    with torch.no_grad():
        logits, _ = model(tokens, padding, types)
        out = theirs(input_ids=tokens, attention_mask=padding, token_type_ids=types if head else None)
        torch.testing.assert_close(out.prediction_logits if head else out.logits, logits[..., :VOCAB],
                                   rtol=1e-5, atol=1e-5)
        # a model trained in transformers: only its decoder bias is used
        theirs.cls.predictions.decoder.bias.add_(torch.randn(VOCAB))
        theirs.cls.predictions.bias.zero_()
        want = theirs(input_ids=tokens, attention_mask=padding, token_type_ids=types if head else None)
    theirs.save_pretrained(str(tmp_path / "hf2"))
    assert convert("BERT", "--loader", "hf", "--load-dir", hf, "--save-dir", back, "--make-vocab-size-divisible-by", 8) == 0
    got, _ = merge_checkpoint(str(back))
    src, _ = merge_checkpoint(str(tmp_path / "src"))
    torch.testing.assert_close(got["output_layer.bias"][:VOCAB], src["output_layer.bias"][:VOCAB], rtol=0, atol=0)
    assert convert("BERT", "--loader", "hf", "--load-dir", tmp_path / "hf2", "--save-dir", tmp_path / "mega2") == 0
    ours, _ = load_bert_checkpoint(str(tmp_path / "mega2"))
    with torch.no_grad():
        logits, _ = ours(tokens, padding, types)
    torch.testing.assert_close(logits[..., :VOCAB], want.prediction_logits if head else want.logits, rtol=1e-5, atol=1e-5)


def test_hf_import_refuses_a_causal_or_relative_position_megatron_bert(tmp_path, capsys):
    """A megatron-bert config.json with is_decoder (MegatronBertForCausalLM: causal attention) or
    relative positions (transformers 4) imported as the bidirectional, absolute-position BERT gave
    other outputs silently; now one line names the option and nothing is written."""
    import json

    transformers = pytest.importorskip("transformers")
    cfg = transformers.MegatronBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          intermediate_size=48, max_position_embeddings=16, is_decoder=True)
    model = transformers.MegatronBertForCausalLM(cfg)
    torch.nn.init.zeros_(model.bert.embeddings.token_type_embeddings.weight)  # otherwise refused for its token types
    model.save_pretrained(str(tmp_path / "causal"))
    relative = tmp_path / "relative"
    transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=16)).save_pretrained(str(relative))
    config = json.loads((relative / "config.json").read_text())
    (relative / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    capsys.readouterr()  # transformers' progress bars
    for src, words in (("causal", "is_decoder"), ("relative", "position_embedding_type 'relative_key'")):
        assert convert("BERT", "--loader", "hf", "--load-dir", tmp_path / src, "--save-dir", tmp_path / f"{src}_out") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert not (tmp_path / f"{src}_out").exists()


def test_hf_export_of_a_bert_with_multi_latent_attention_names_the_flag(tmp_path, capsys):
    """A BERT trained with --multi-latent-attention was taken for a DeepSeek-V3 (its style checked
    first): a KeyError traceback, or a line about a DeepSeek option; now one megatron-bert line."""
    from megatron_lite.parallel.state import ParallelState

    state = ParallelState()
    cfg = model_config()
    cfg.multi_latent_attention = cfg.qk_layernorm = cfg.swiglu = cfg.disable_bias_linear = True
    cfg.position_embedding_type, cfg.normalization, cfg.norm_epsilon = "rope", "RMSNorm", 1e-6
    model = BertModel(TransformerConfig.from_model(cfg), state).eval()
    run = run_config(1, 1, str(tmp_path / "src"))
    run.model, run.bert = cfg, BertConfig()
    save_checkpoint(7, [model], None, None, 56, run, state)
    capsys.readouterr()
    assert convert("BERT", "--saver", "hf", "--load-dir", tmp_path / "src", "--save-dir", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--multi-latent-attention cannot be expressed in the megatron-bert format" in err
    assert not (tmp_path / "hf").exists()
