"""Strictness and file handling of the HF checkpoint import."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hf_fixtures
from rag_jax.io import hf
from rag_jax.models import bart


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    hf_fixtures.save_bert(tmp_path)
    _edit_tensors(tmp_path, lambda s: s.pop("encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(hf.CheckpointError, match=r"missing \(1\): encoder\.layer\.1\.attention"):
        hf.load_bert(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    hf_fixtures.save_bart(tmp_path)
    _edit_tensors(tmp_path, lambda s: s.update({"model.decoder.extra.weight": np.zeros(3, "f4")}))
    with pytest.raises(hf.CheckpointError, match=r"unexpected \(1\): model\.decoder\.extra"):
        hf.load_bart(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    hf_fixtures.save_bert(tmp_path)
    _edit_tensors(
        tmp_path,
        lambda s: s.update({"pooler.dense.bias": np.zeros(5, "f4")}),
    )
    with pytest.raises(hf.CheckpointError, match=r"pooler\.dense\.bias has shape \(5,\)"):
        hf.load_bert(tmp_path)


def test_a_bart_config_layer_norm_eps_changes_nothing_as_in_hf(tmp_path):
    """HF's BART has no LayerNorm eps field: one in config.json (e.g. a BERT-initialised
    generator's 1e-12) is stored but every LayerNorm runs at 1e-5, and so they do here."""
    model = hf_fixtures.save_bart(tmp_path, layer_norm_eps=1e-12)
    assert json.loads((tmp_path / "config.json").read_text())["layer_norm_eps"] == 1e-12
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and {m.eps for m in norms} == {1e-5}
    assert hf.load_bart(tmp_path)[0].layer_norm_eps == 1e-5
    assert hf.bart_architecture(tmp_path).layer_norm_eps == 1e-5


def test_wrong_architecture_says_what_was_found(tmp_path):
    hf_fixtures.save_bart(tmp_path)
    with pytest.raises(hf.CheckpointError, match=r"model_type 'bart'.*\('bert',\)"):
        hf.load_bert(tmp_path)
    with pytest.raises(hf.CheckpointError, match=r"model_type 'bart'.*\('dpr',\)"):
        hf.load_dpr(tmp_path)


def test_bert_checkpoint_is_not_a_dpr_encoder(tmp_path):
    hf_fixtures.save_bert(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "dpr"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.CheckpointError, match="bert_model"):
        hf.load_dpr(tmp_path)


def test_pytorch_bin_checkpoint_loads_identically(tmp_path):
    model = hf_fixtures.save_bart(tmp_path / "st", seed=5)
    (tmp_path / "bin").mkdir()
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    cfg_a, params_a = hf.load_bart(tmp_path / "st")
    cfg_b, params_b = hf.load_bart(tmp_path / "bin")
    assert cfg_a == cfg_b
    flat_a, flat_b = dict(_flatten(params_a)), dict(_flatten(params_b))
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=k)


def test_untied_lm_head_is_refused(tmp_path):
    model = hf_fixtures.save_bart(tmp_path / "ok", seed=6)
    (tmp_path / "bad").mkdir()
    model.config.save_pretrained(tmp_path / "bad")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    torch.save(state, tmp_path / "bad" / "pytorch_model.bin")
    with pytest.raises(hf.CheckpointError, match="lm_head.weight.*differs"):
        hf.load_bart(tmp_path / "bad")


def test_param_tree_and_dtype(tmp_path):
    hf_fixtures.save_bart(tmp_path)
    cfg, params = hf.load_bart(tmp_path, param_dtype="bfloat16")
    shapes = bart.param_shapes(cfg)
    assert dict(_flatten(shapes)).keys() == dict(_flatten(params)).keys()
    assert params["shared"]["embedding"].dtype == np.dtype("bfloat16")


def test_missing_files_and_bad_paths(tmp_path):
    with pytest.raises(hf.CheckpointError, match="no config.json"):
        hf.load_bert(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hf.CheckpointError, match="config.json is not valid JSON"):
        hf.load_bert(tmp_path)
    hf_fixtures.bert_config().save_pretrained(tmp_path)
    with pytest.raises(hf.CheckpointError, match="no weights in"):
        hf.load_bert(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(hf.CheckpointError, match="model.safetensors"):
        hf.load_bert(tmp_path)


def test_tokenizer_loads_from_checkpoint_dir():
    tokenizer = hf.load_tokenizer(hf_fixtures.minilm_path())
    assert tokenizer("hello world")["input_ids"][0] == tokenizer.cls_token_id


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", np.asarray(v)


@pytest.mark.parametrize(
    "model, field, value",
    [
        ("bart", "add_bias_logits", True),
        ("bart", "static_position_embeddings", True),
        ("bart", "normalize_embedding", False),
        ("bart", "activation_function", "glu"),
        ("bert", "add_cross_attention", True),
        ("bert", "is_decoder", True),
        ("bert", "position_embedding_type", "relative_key"),
    ],
)
def test_config_fields_that_change_the_model_are_refused(tmp_path, model, field, value):
    save = {"bart": hf_fixtures.save_bart, "bert": hf_fixtures.save_bert}[model]
    save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    load = {"bart": hf.load_bart, "bert": hf.load_bert}[model]
    with pytest.raises(hf.CheckpointError, match=rf"field {field}={value!r}.* not supported"):
        load(tmp_path)
