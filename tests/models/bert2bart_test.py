"""A BART generator warm-started from BERT: the encoder computes BERT exactly (HF PyTorch
reference, real MiniLM weights), the decoder takes BERT's layers, bad checkpoints are refused."""

import jax
import numpy as np
import pytest
import torch
import transformers

import hf_fixtures
from rag_jax.io import hf
from rag_jax.models import bart, bert2bart

IDS = dict(
    bos_token_id=101,
    eos_token_id=102,
    decoder_start_token_id=102,
    pad_token_id=0,
    forced_bos_token_id=101,
    forced_eos_token_id=102,
)
SENTENCES = [
    "who designed the eiffel tower? [SEP] the tower was designed by gustave eiffel's company.",
    "when did the war end?",
    "Canberra was selected as the capital as a compromise between Sydney and Melbourne.",
]


def _encode(cfg, params, ids, mask):
    return bart.Bart(cfg).apply({"params": params}, ids, mask, method=bart.Bart.encode)


@pytest.fixture(scope="module")
def minilm():
    path = hf_fixtures.minilm_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="np")
    torch_model = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = torch_model(
            **{k: torch.tensor(v) for k, v in batch.items()}, output_hidden_states=True
        )
    cfg, params = hf.load_bert(path)
    return cfg, params, batch, [h.numpy() for h in ref.hidden_states]


@pytest.mark.parametrize("layers", [6, 2])
def test_mapped_encoder_computes_minilm_hidden_states(minilm, layers):
    """The BART encoder built from MiniLM's first k layers outputs BertModel's hidden state k."""
    bert_cfg, bert_params, batch, hidden = minilm
    cfg, params = bert2bart.bart_from_bert(
        bert_cfg,
        bert_params,
        special_ids=IDS,
        rng=jax.random.PRNGKey(0),
        encoder_layers=layers,
        decoder_layers=1,
    )
    assert (cfg.encoder_layers, cfg.decoder_layers, cfg.d_model) == (layers, 1, 384)
    mask = batch["attention_mask"]
    got = np.asarray(_encode(cfg, params, batch["input_ids"], mask))
    real = mask.astype(bool)  # padded rows attend only to real tokens; compare those
    np.testing.assert_allclose(got[real], hidden[layers][real], atol=1e-4, rtol=0)
    assert np.abs(hidden[layers]).max() > 1.0


def test_a_fixed_encoder_reads_its_own_copy_of_the_word_embeddings(minilm):
    """`frozen_encoder_layers`: BERT's word embeddings go to the shared table and to the
    encoder's own copy (two arrays), the encoder still computes BertModel's hidden states, and
    the tree is the tied mapping with its embedding untied (`bart.untie_encoder_embedding`)."""
    bert_cfg, bert_params, batch, hidden = minilm
    kw = dict(special_ids=IDS, rng=jax.random.PRNGKey(0), encoder_layers=2, decoder_layers=1)
    cfg, params = bert2bart.bart_from_bert(bert_cfg, bert_params, frozen_encoder_layers=2, **kw)
    assert cfg.frozen_encoder_layers == 2
    words = bert_params["word_embeddings"]["embedding"]
    own, shared = params["encoder"]["embed_tokens"]["embedding"], params["shared"]["embedding"]
    np.testing.assert_array_equal(own, words)
    np.testing.assert_array_equal(shared, words)
    assert own.unsafe_buffer_pointer() != shared.unsafe_buffer_pointer()
    mask = batch["attention_mask"]
    got = np.asarray(_encode(cfg, params, batch["input_ids"], mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], hidden[2][real], atol=1e-4, rtol=0)
    _, tied = bert2bart.bart_from_bert(bert_cfg, bert_params, **kw)
    jax.tree.map(np.testing.assert_array_equal, params, bart.untie_encoder_embedding(tied))


def test_decoder_takes_bert_layers_and_fresh_cross_attention(minilm):
    bert_cfg, bert_params, _, _ = minilm
    kw = dict(special_ids=IDS, encoder_layers=3, decoder_layers=2)
    cfg, params = bert2bart.bart_from_bert(bert_cfg, bert_params, rng=jax.random.PRNGKey(0), **kw)
    dec = params["decoder"]
    for i in range(2):
        for module in ("self_attn", "mlp", "self_attn_ln", "mlp_ln"):
            jax.tree.map(
                np.testing.assert_array_equal,
                dec[f"layer_{i}"][module],
                bert_params[f"layer_{i}"][module],
            )
        cross = np.asarray(dec[f"layer_{i}"]["cross_attn"]["query"]["kernel"])
        assert np.std(cross) == pytest.approx(cfg.init_std, rel=0.05)  # BART's init, fresh
    np.testing.assert_array_equal(
        params["shared"]["embedding"], bert_params["word_embeddings"]["embedding"]
    )
    # Position p + 2 holds BERT's position p plus its token-type-0 embedding.
    table = np.asarray(params["decoder"]["positions"]["embedding"])
    want = (
        bert_params["position_embeddings"]["embedding"]
        + bert_params["token_type_embeddings"]["embedding"][0]
    )
    np.testing.assert_allclose(table[bart.POSITION_OFFSET :], want, rtol=0, atol=0)
    assert not np.asarray(params["final_logits_bias"]).any()
    # bert_cross: the cross-attention starts as a copy of the same layer's self-attention.
    _, crossed = bert2bart.bart_from_bert(
        bert_cfg, bert_params, rng=jax.random.PRNGKey(0), decoder_init="bert_cross", **kw
    )
    for i in range(2):
        layer = crossed["decoder"][f"layer_{i}"]
        jax.tree.map(
            np.testing.assert_array_equal,
            layer["cross_attn"],
            bert_params[f"layer_{i}"]["self_attn"],
        )
        jax.tree.map(
            np.testing.assert_array_equal,
            layer["cross_attn_ln"],
            bert_params[f"layer_{i}"]["self_attn_ln"],
        )
        jax.tree.map(np.testing.assert_array_equal, layer["mlp"], dec[f"layer_{i}"]["mlp"])
    # A fresh decoder shares nothing with BERT's layers; the encoder is unchanged.
    _, fresh = bert2bart.bart_from_bert(
        bert_cfg, bert_params, rng=jax.random.PRNGKey(0), decoder_init="random", **kw
    )
    assert not np.array_equal(
        fresh["decoder"]["layer_0"]["mlp"]["wi"]["kernel"],
        bert_params["layer_0"]["mlp"]["wi"]["kernel"],
    )
    jax.tree.map(np.testing.assert_array_equal, fresh["encoder"], params["encoder"])
    # The mapped model runs: teacher-forced logits over BERT's vocabulary, finite.
    ids = np.array([[101, 2040, 2003, 102]])
    logits, _ = bart.Bart(cfg).apply({"params": params}, ids, np.ones_like(ids), ids[:, :3])
    assert logits.shape == (1, 3, bert_cfg.vocab_size) and np.isfinite(logits).all()


def test_mismatched_checkpoints_are_refused_by_name(tmp_path):
    hf_fixtures.save_bert(tmp_path)
    bert_cfg, bert_params = hf.load_bert(tmp_path)
    rng = jax.random.PRNGKey(0)
    # A generator config whose width or vocabulary does not fit: both values named.
    with pytest.raises(bert2bart.MappingError, match=r"d_model=128 \(BERT's 12\)"):
        bert2bart.bart_config(bert_cfg, special_ids=IDS, d_model=128)
    with pytest.raises(bert2bart.MappingError, match=r"vocab_size=50265 \(BERT's 41\)"):
        bert2bart.bart_config(bert_cfg, special_ids=IDS, vocab_size=50265)
    with pytest.raises(bert2bart.MappingError, match="encoder_layers=3: the BERT checkpoint has 2"):
        bert2bart.bart_config(bert_cfg, special_ids=IDS, encoder_layers=3)
    cfg = bert2bart.bart_config(bert_cfg, special_ids=IDS)
    # A tensor missing, and one with no place in BART, are named.
    broken = jax.tree.map(np.asarray, bert_params)
    del broken["layer_1"]["mlp"]["wo"]
    broken["adapter"] = {"kernel": np.zeros((2, 2), np.float32)}
    with pytest.raises(bert2bart.MappingError) as err:
        bert2bart.map_params(cfg, broken, rng=rng)
    message = str(err.value)
    assert "missing (2)" in message and "layer_1/mlp/wo/bias" in message
    assert "unexpected (1): adapter/kernel" in message
    # A tensor of another shape names both paths and both shapes.
    wide = jax.tree.map(np.asarray, bert_params)
    wide["layer_0"]["mlp"]["wi"]["kernel"] = np.zeros((12, 21), np.float32)
    with pytest.raises(bert2bart.MappingError, match=r"layer_0/mlp/wi/kernel has shape \(12, 21\)"):
        bert2bart.map_params(cfg, wide, rng=rng)
    with pytest.raises(bert2bart.MappingError, match="decoder_init must be one of"):
        bert2bart.map_params(cfg, bert_params, rng=rng, decoder_init="copy")
